"""Asynchronous RL steps: grading overlapped with the next steps' generation, bounded staleness.

With ``rollout.max_staleness = S > 0`` the loop keeps a FIFO of dispatched batches (each one
collect phase: ``G`` kept groups, every group submitted to the grading pool as it is kept) and
every RL step

1. **dispatches** (admission control): while fewer than ``S + 1`` batches wait and the grading
   pool has room for another batch (``grading.max_inflight_groups`` groups submitted and not
   yet trained), a new batch is collected with the engine's current weights; every token is
   tagged with the policy version that produced it (``Rollout.versions()``: a sample's tokens
   share its engine call's version, an episode's turns each have their own);
2. **trains the oldest batch** (oldest first, nothing discarded or requeued): the loop waits
   for its verdicts until the grading deadline counted from its submission, then grade ->
   pack -> exchange -> update -> sync as the synchronous step does;
3. reports the staleness of that batch at its update: the trainer's version minus the oldest
   token version in it. A batch dispatched at version ``v`` has at most ``S`` batches ahead of
   it, so it is trained at a version ``<= v + S``, generation, verification, grading and queue
   time included. A group whose verdict has not arrived when the bound forces its update takes
   the grading fallback (``deadline``; counted as ``async/staleness_fallbacks``), never
   dropped.

Partial rollouts (``rollout.partial_rollout``; multi-turn families, or single-turn ones whose
samples are generated in chunks, ``rollout.partial_chunk_tokens``): one slot of the bound is
kept for a batch that spans a weight sync. After the oldest batch leaves the queue and before
its update, :func:`start_phase` draws the next batch's prompts and runs the first turn of its
episodes (a :class:`StartedBatch`); the next step resumes them under the new weights
(:func:`~gagar_jax.rl.train.collect_phase` with ``first_round``), so their tokens carry two
versions. With ``rollout.partial_chunk_tokens`` the turns are sampled in chunks and the
episodes stop after the first chunk of their first turn: that turn is finished under the new
weights, its first tokens tagged with the old version. ``rollout.mask_offpolicy_tokens`` takes
the tokens older than the batch's newest version out of the loss (:func:`offpolicy_token_mask`).

``S = 0``: the loop calls the synchronous :func:`~gagar_jax.rl.train.rl_step` (one dispatch,
wait, update per step). With ``rollout.async_scheduler`` it runs this module's steps at
``S = 0`` instead: admission then allows one batch, dispatched and trained in the same step,
and the run's metrics (time fields aside, ``async/*`` added) and parameters equal the
synchronous loop's exactly (``tests/test_async_script.py``).

Bias monitor: per step, the two-sample Kolmogorov-Smirnov distance between the dispatched and
the trained distributions of response length (``async/ks_length``) and of grading latency
(``async/ks_grading_latency``; latency = submission to the verdict as the loop observes it).
FIFO training keeps both near the sampling noise; a scheme that let fast groups overtake slow
ones would show here first.

Checkpoints: the batches still queued at a checkpoint are saved in the loop state of the same
atomic checkpoint (:func:`batch_state`): dispatch index and version, data position and every
kept group's trajectories (tokens, behaviour log-probs, per-token versions; a multi-turn
episode with its turn spans), and the started batch with its interrupted episodes
(:func:`started_state`). A resumed run rebuilds them: each episode's environment is a fresh one
replayed through the recorded model turns, each rollout is verified again, each kept group is
resubmitted to the grading pool, whose verdict cache keyed by the trajectory's content answers
every group graded before the interruption. It trains them first and resumes the interrupted
episodes: no group is lost, duplicated or graded twice and the data position is exact.
Checkpoints that hold a batch as its data position only (written before episodes were saved)
dispatch it again from there.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any

import numpy as np

from gagar_jax.envs.family import Attempt
from gagar_jax.rl import collect, grade, train
from gagar_jax.rl.collect import Group, SamplingResult, StartedEpisodes, StepCounters, _rollout
from gagar_jax.rl.multihost import prompt_seed
from gagar_jax.rollout import finish_episodes, restore_episodes

ASYNC_KEY = "async"  # LoopState.extra: dispatch counter and the queued batches


def ks_distance(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic ``sup_x |F_a(x) - F_b(x)|`` (nan if either is
    empty)."""
    a = np.sort(np.asarray(a, np.float64).ravel())
    b = np.sort(np.asarray(b, np.float64).ravel())
    if a.size == 0 or b.size == 0:
        return float("nan")
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / a.size
    fb = np.searchsorted(b, x, side="right") / b.size
    return float(np.max(np.abs(fa - fb)))


@dataclasses.dataclass
class InflightBatch:
    """One dispatched collect phase waiting for its update."""

    index: int  # dispatch counter (group ids and host exchange tags use it)
    version: int  # the policy version the engine had at dispatch
    position: int  # data position at dispatch (a resumed run re-dispatches from here)
    collected: Any = None  # train.Collected
    submitted_at: float = 0.0  # time.monotonic() at the end of the dispatch
    resolved_at: dict[str, float] = dataclasses.field(default_factory=dict)
    # the engine's version when its last token was generated (> version: a partial rollout,
    # begun before a weight sync and finished after it)
    completed_version: int | None = None

    def lengths(self) -> list[int]:
        return [
            len(r.response_tokens)
            for g in self.collected.sampling.groups
            for r in g.rollouts
            if not r.infra_error
        ]


@dataclasses.dataclass
class StartedBatch:
    """A dispatch whose first round of episodes was begun before a weight sync (a partial
    rollout, ``rollout.partial_rollout``): its prompts are drawn, their episodes ran their first
    turn under ``version``; the next step resumes them under the new weights
    (:func:`~gagar_jax.rl.train.collect_phase` with ``first_round``)."""

    index: int  # dispatch counter
    version: int  # the engine's version when its episodes began
    position: int  # data position before its prompts were drawn
    n: list[int]  # the first round's prompts per host
    idx: list[int]  # their task indices (every host's)
    pos: list[int]  # their data positions
    skipped: int  # prompts passed over as saturated while drawing them
    episodes: Any  # rl.collect.StartedEpisodes: this host's episodes, interrupted


class AsyncQueue:
    """Admission control and the FIFO of dispatched batches (host-side, one per host)."""

    def __init__(
        self,
        max_staleness: int,
        max_inflight_groups: int,
        groups_per_batch: int,
        *,
        partial_rollout: bool = False,
    ):
        if max_staleness < 0:
            raise ValueError(f"AsyncQueue: max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.max_inflight_groups = max_inflight_groups
        self.groups_per_batch = groups_per_batch
        self.partial_rollout = partial_rollout
        self.queue: collections.deque[InflightBatch] = collections.deque()
        self.started: StartedBatch | None = None  # begun before the last weight sync
        self.dispatched = 0
        self.resume_positions: list[tuple[int, int]] = []  # (position, version) to redo first
        self.latencies: list[float] = []  # grading latencies observed this step

    def inflight_groups(self) -> int:
        """Group slots dispatched and not yet trained (``groups_per_batch`` per queued or
        started batch: the same count on every host, so all hosts take the same admission
        decisions)."""
        return (len(self.queue) + (self.started is not None)) * self.groups_per_batch

    def may_dispatch(self) -> bool:
        """Admission: a new batch keeps the staleness bound (at most ``S`` batches ahead of it)
        and the pool's bound; an empty queue always admits one batch (no deadlock). With
        partial rollouts one slot is kept for the batch begun before each weight sync."""
        if not self.queue:
            return True
        reserve = int(self.partial_rollout)
        if len(self.queue) + reserve > self.max_staleness:
            return False
        return (
            self.inflight_groups() + (1 + reserve) * self.groups_per_batch
            <= self.max_inflight_groups
        )

    def may_start(self, steps_left: int | None) -> bool:
        """Partial rollouts: whether a batch may begin now, before this step's weight sync (the
        oldest batch already taken off the queue): it is trained at most ``S`` versions after
        the one it begins with, the pool's bound holds, and a later step trains it."""
        if not self.partial_rollout or self.started is not None:
            return False
        if len(self.queue) + 1 > self.max_staleness:
            return False
        if steps_left is not None and len(self.queue) + 1 > steps_left - 1:
            return False
        return self.inflight_groups() + self.groups_per_batch <= self.max_inflight_groups

    def observe(self, pool) -> None:
        """Records the verdicts that arrived since the last look (their latencies)."""
        now = time.monotonic()
        for b in self.queue:
            for gid in b.collected.submitted:
                if gid not in b.resolved_at and pool.done(gid):
                    b.resolved_at[gid] = now
                    self.latencies.append(now - b.submitted_at)

    def state_dict(self) -> dict[str, Any]:
        """The checkpointed part (JSON): the dispatch counter and every queued batch, its
        groups' trajectories included (:func:`batch_state`)."""
        return {
            "dispatched": self.dispatched,
            "queued": [batch_state(b) for b in self.queue]
            + [{"position": p, "version": v} for p, v in self.resume_positions],
            "started": None if self.started is None else started_state(self.started),
        }

    def load(
        self, state: dict[str, Any], *, family=None, pool=None, cfg=None, host: int = 0
    ) -> None:
        """Restores :meth:`state_dict`: batches saved with their trajectories are rebuilt
        (verified again, resubmitted to ``pool``, whose verdict cache answers every group
        graded before the interruption) and queued as they were; batches saved as positions
        only are dispatched again from there, first."""
        self.dispatched = int(state.get("dispatched", 0))
        self.resume_positions = []
        for item in state.get("queued", []):
            if item.get("groups") is not None and family is not None:
                self.queue.append(restore_batch(item, family, pool, cfg))
            else:
                self.resume_positions.append((int(item["position"]), int(item["version"])))
        if state.get("started") is not None:
            self.started = restore_started(state["started"], family, cfg, host)


_ROLLOUT_FIELDS = (
    "prompt_tokens",
    "response_tokens",
    "logprobs",
    "finish_reason",
    "policy_version",
    "response_mask",
    "token_versions",
    "num_turns",
    "num_tool_calls",
    "routes",  # [P + R, layers, K] as nested lists (MoE routes, or None)
)


def _episode_state(ep) -> dict[str, Any]:
    """One finished episode as an entry of ``EpisodeBatch.state_dict()``."""
    return {
        "tokens": list(ep.tokens),
        "mask": list(ep.response_mask),
        "logprobs": list(ep.logprobs),
        "token_versions": list(ep.token_versions),
        "prompt_len": ep.prompt_len,
        "versions": list(ep.policy_versions),
        "turn_finish": [t.finish_reason for t in ep.turns],
        "model_spans": [list(t.model_span) for t in ep.turns],
        "finish": ep.finish_reason,
        "routes": None if ep.routes is None else np.asarray(ep.routes).tolist(),
    }


def _replay_episodes(family, tasks, saved: list[dict], cfg, next_turn: int, budgets, seeds):
    """Fresh environments of ``tasks`` (one per saved episode, in order) and the
    ``EpisodeBatch`` of the saved episodes, the environments replayed to their state."""

    envs = collect.episode_envs(family, tasks)
    batch = restore_episodes(
        {"budgets": budgets, "episode_seeds": seeds, "next_turn": next_turn, "episodes": saved},
        envs,
        family.tokenizer,
        max_observation_tokens=cfg.task.max_observation_tokens,
        observation_tokens=family.observation_tokens,
    )
    return envs, batch


def started_state(sb: StartedBatch) -> dict[str, Any]:
    """A :class:`StartedBatch` as JSON: its draw and its interrupted episodes (tokens,
    log-probs, per-token versions, turn spans; the environments are rebuilt by replay)."""
    return {
        "index": sb.index,
        "version": sb.version,
        "position": sb.position,
        "n": list(sb.n),
        "idx": list(sb.idx),
        "pos": list(sb.pos),
        "skipped": sb.skipped,
        "gen_time": sb.episodes.gen_time,
        "episodes": sb.episodes.batch.state_dict(),
    }


def restore_started(item: dict[str, Any], family, cfg, host: int = 0) -> StartedBatch:
    """The :class:`StartedBatch` of :func:`started_state` (this host's block of prompts, each
    episode's environment replayed to where the episode stopped)."""

    n, idx = list(item["n"]), list(item["idx"])
    lo = sum(n[:host])  # this host's block of the drawn prompts
    hi = lo + n[host]
    tasks = [family.train_task(i) for i in idx[lo:hi] for _ in range(cfg.rollout.num_rollouts)]
    st = item["episodes"]
    envs, batch = _replay_episodes(
        family, tasks, st["episodes"], cfg, st["next_turn"], st["budgets"], st["episode_seeds"]
    )
    return StartedBatch(
        index=int(item["index"]),
        version=int(item["version"]),
        position=int(item["position"]),
        n=n,
        idx=idx,
        pos=list(item["pos"]),
        skipped=int(item["skipped"]),
        episodes=StartedEpisodes(envs=envs, batch=batch, gen_time=float(item["gen_time"])),
    )


def batch_state(b: InflightBatch) -> dict[str, Any]:
    """One queued batch as JSON: dispatch index, version, data position, and (single-turn
    families) each kept group's task index and trajectories (tokens, behaviour log-probs,
    versions), its tallies and sampling figures. Multi-turn episodes end in an environment
    state the trajectory alone cannot restore: those batches are saved as their position."""
    out: dict[str, Any] = {
        "index": b.index,
        "version": b.version,
        "position": b.position,
        "groups": None,
    }
    sres = b.collected.sampling

    def rollout_state(r):
        d = {f: getattr(r, f) for f in _ROLLOUT_FIELDS}
        if d["routes"] is not None:
            d["routes"] = np.asarray(d["routes"]).tolist()
        ep = getattr(r.attempt, "episode", None)
        if ep is not None:  # multi-turn: the episode, its environment rebuilt by replay
            d["episode"] = _episode_state(ep)
        return d

    out["groups"] = [
        {
            "group_id": g.group_id,
            "task_index": g.task_index,
            "rollouts": [rollout_state(r) for r in g.rollouts],
        }
        for g in sres.groups
    ]
    out["completed_version"] = b.completed_version
    out["sampling"] = {
        f.name: getattr(sres, f.name) for f in dataclasses.fields(sres) if f.name != "groups"
    }
    out["counters"] = dataclasses.asdict(b.collected.counters)
    out["submitted"] = list(b.collected.submitted)
    out["attempts"] = [[i, list(p)] for i, p in b.collected.attempts]
    return out


def restore_batch(item: dict[str, Any], family, pool, cfg) -> InflightBatch:
    """The :class:`InflightBatch` of :func:`batch_state`: each rollout verified again from its
    tokens (the verifier is a function of the task and the response) and each group
    resubmitted for grading when grading is on."""

    tok = family.tokenizer
    groups = []
    for gd in item["groups"]:
        task = family.train_task(gd["task_index"])
        rollouts = []
        for rd in gd["rollouts"]:
            if rd.get("episode") is not None:  # multi-turn: the episode replayed
                e = rd["episode"]
                envs, eb = _replay_episodes(
                    family,
                    [task],
                    [e],
                    cfg,
                    len(e["versions"]),
                    [len(rd["prompt_tokens"]) + cfg.rollout.max_new_tokens],
                    None,
                )
                ep = finish_episodes(eb)[0]
                attempt = Attempt(
                    response_tokens=ep.tokens[ep.prompt_len :], episode=ep, env=envs[0]
                )
            else:
                attempt = Attempt(
                    response_tokens=list(rd["response_tokens"]),
                    text=tok.decode(rd["response_tokens"]),
                )
            fields = {f: rd.get(f) for f in _ROLLOUT_FIELDS if f != "prompt_tokens"}
            rollouts.append(_rollout(family, task, rd["prompt_tokens"], attempt, **fields))
        groups.append(
            Group(
                group_id=gd["group_id"], task=task, rollouts=rollouts, task_index=gd["task_index"]
            )
        )
    sres = SamplingResult(groups=groups, **item["sampling"])
    if cfg is not None and cfg.grading.enabled:
        for g in groups:
            if g.group_id in item["submitted"]:
                pool.submit(train.group_workspace(family, g))
    collected = train.Collected(
        sampling=sres,
        counters=StepCounters.merged([item["counters"]]),
        submitted=tuple(item["submitted"]),
        attempts=tuple((int(i), tuple(bool(x) for x in p)) for i, p in item["attempts"]),
        wait_start=time.monotonic(),
    )
    return InflightBatch(
        index=int(item["index"]),
        version=int(item["version"]),
        position=int(item["position"]),
        collected=collected,
        submitted_at=time.monotonic(),
        completed_version=item.get("completed_version"),
    )


def start_phase(ctx, ls, aq: AsyncQueue) -> StartedBatch:
    """Partial rollouts: draws the next dispatch's first round of prompts (as
    :func:`~gagar_jax.rl.collect.collect_blocks` would) and runs the first turn of its episodes
    with the engine's current weights; the next step resumes them after the weight sync."""

    cfg, hosts = ctx.cfg, ctx.hosts
    quota = cfg.rollout.num_prompts // hosts.count
    per_block = (
        max(quota, math.ceil(cfg.sampling.oversample * quota)) if cfg.sampling.enabled else quota
    )
    n = [per_block] * hosts.count
    position = ls.data_position
    skip = None if ctx.tracker is None else (lambda i: ctx.tracker.skip(str(i)))
    idx, pos, ls.data_position, n_skip = collect.select_prompts(
        ctx.stream, ls.data_position, sum(n), skip
    )
    lo = sum(n[: hosts.index])
    hi = lo + n[hosts.index]
    episodes = collect.start_groups(
        ctx.engine,
        ctx.family,
        [ctx.family.train_task(i) for i in idx[lo:hi]],
        cfg=cfg,
        step=aq.dispatched,
        round_id=1,
        num_rollouts=cfg.rollout.num_rollouts,
        temperature=cfg.rollout.temperature,
        # turns sampled in chunks: stopped mid-way through the first turn; else after it
        until_turn=0 if cfg.rollout.partial_chunk_tokens else 1,
        until_chunk=1 if cfg.rollout.partial_chunk_tokens else 0,
        prompt_seeds=[prompt_seed(ls.rng_key, 1, p) for p in pos[lo:hi]],
    )
    sb = StartedBatch(
        index=aq.dispatched,
        version=ls.policy_version,
        position=position,
        n=n,
        idx=[int(i) for i in idx],
        pos=[int(p) for p in pos],
        skipped=n_skip,
        episodes=episodes,
    )
    aq.dispatched += 1
    return sb


def offpolicy_token_mask(groups, newest: int):
    """``rollout.mask_offpolicy_tokens``: the groups with every response token whose version is
    older than ``newest`` taken out of the loss (its ``response_mask`` entry 0; rewards,
    advantages and the group's credit are unchanged). Returns ``(groups, masked, model)``: new
    :class:`~gagar_jax.rl.collect.Group` objects (the queued ones are left intact), the count
    of model tokens masked and of all model tokens."""
    masked = total = 0
    out = []
    for g in groups:
        rollouts = []
        for r in g.rollouts:
            versions = np.asarray(r.versions(), np.int64)
            mask = (
                np.ones(len(versions), np.int64)
                if r.response_mask is None
                else np.asarray(r.response_mask, np.int64)
            )
            keep = mask * (versions >= newest)
            masked += int(mask.sum() - keep.sum())
            total += int(mask.sum())
            rollouts.append(dataclasses.replace(r, response_mask=[int(x) for x in keep]))
        out.append(dataclasses.replace(g, rollouts=rollouts))
    return out, masked, total


def async_step(step: int, state, ls, ctx, aq: AsyncQueue, *, steps_left: int | None = None):
    """One asynchronous RL step (module docstring); returns ``(state, metrics)``.

    ``steps_left`` (this one included): no batch is dispatched that no remaining step would
    train, so a run ends with an empty queue."""

    cfg, hosts = ctx.cfg, ctx.hosts
    t_step = time.monotonic()
    G_local = cfg.rollout.num_prompts // hosts.count
    dispatched_lengths: list[int] = []
    if aq.started is not None:  # a partial rollout: its episodes resume under the new weights
        sb, aq.started = aq.started, None
        collected = train.collect_phase(
            ctx.engine,
            ctx.family,
            ctx.grading_pool,
            ctx.stream,
            ls,
            cfg,
            step=sb.index,
            hosts=hosts,
            tracker=ctx.tracker,
            first_round=sb,
            rollout_log=ctx.rollout_log,
        )
        batch = InflightBatch(
            index=sb.index,
            version=sb.version,
            position=sb.position,
            collected=collected,
            submitted_at=time.monotonic(),
            completed_version=ls.policy_version,
        )
        aq.queue.append(batch)
        dispatched_lengths += batch.lengths()
        aq.observe(ctx.grading_pool)
    while aq.may_dispatch() and (steps_left is None or len(aq.queue) < steps_left):
        saved_position = None
        if aq.resume_positions:  # a resumed run's queued batches first, from their positions
            position, _ = aq.resume_positions.pop(0)
            saved_position, ls.data_position = ls.data_position, position
        start = ls.data_position
        collected = train.collect_phase(
            ctx.engine,
            ctx.family,
            ctx.grading_pool,
            ctx.stream,
            ls,
            cfg,
            step=aq.dispatched,
            hosts=hosts,
            tracker=ctx.tracker,
            rollout_log=ctx.rollout_log,
        )
        if saved_position is not None:
            ls.data_position = max(saved_position, ls.data_position)
        batch = InflightBatch(
            index=aq.dispatched,
            version=ls.policy_version,
            position=start,
            collected=collected,
            submitted_at=time.monotonic(),
            completed_version=ls.policy_version,
        )
        aq.dispatched += 1
        aq.queue.append(batch)
        dispatched_lengths += batch.lengths()
        aq.observe(ctx.grading_pool)
    t_wait = time.monotonic()
    aq.observe(ctx.grading_pool)
    oldest = aq.queue.popleft()
    pending_before = [g for g in oldest.collected.submitted if g not in oldest.resolved_at]
    remaining = max(cfg.grading.deadline_s - (t_wait - oldest.submitted_at), 0.0)
    grades = train.grade_phase(
        ctx.grading_pool, ctx.family, oldest.collected, cfg, num_groups=G_local, timeout=remaining
    )
    t_graded = time.monotonic()
    paused = t_graded - t_wait
    for gid in pending_before:
        oldest.resolved_at[gid] = t_graded
        aq.latencies.append(t_graded - oldest.submitted_at)
    if aq.may_start(steps_left):  # the next batch's first turn, before this step's sync
        aq.started = start_phase(ctx, ls, aq)
    trained_groups = oldest.collected.sampling.groups
    masked = model_tokens = 0
    newest = oldest.version if oldest.completed_version is None else oldest.completed_version
    if cfg.rollout.mask_offpolicy_tokens:
        trained_groups, masked, model_tokens = offpolicy_token_mask(trained_groups, newest)
    packed = train.pack_phase(
        trained_groups,
        grades,
        cfg,
        num_groups=G_local,
        pad_id=ctx.family.tokenizer.pad_id,
        route_shape=train.route_shape(ctx.engine),
    )
    ex = train.exchange_phase(packed, oldest.collected, hosts, step=oldest.index)
    if ctx.tracker is not None:
        for i, passed in ex.attempts:
            ctx.tracker.record(str(i), list(passed))
    versions = [
        r.oldest_version
        for g in oldest.collected.sampling.groups
        for r in g.rollouts
        if not r.infra_error
    ]
    token_versions = [
        v
        for g in oldest.collected.sampling.groups
        for r in g.rollouts
        if not r.infra_error
        for v in r.versions()
        if v >= 0
    ]
    older_tokens = sum(v < newest for v in token_versions)
    version_at_update = ls.policy_version
    t_update = time.monotonic()
    with hosts.collective(f"the update of step {step}"):
        updated = train.update_phase(ctx, state, ex.batch, step=step)
        sync_m: dict = {}
        weight_version = train.sync_phase(ctx, updated.state, ls, step=step, metrics=sync_m)
    ls.step = step + 1
    t_end = time.monotonic()
    grading_m = (
        grade.batch_grading_metrics(ex.batch, ex.kept, ex.grader_cheat, ex.fallback)
        if cfg.grading.enabled and ex.kept.any()
        else {}
    )
    m = train.step_metrics(
        oldest.collected.sampling,
        ex.counters,
        grading_m,
        updated.metrics,
        weight_version,
        cfg,
        ctx.tracker,
    )
    trained_latency = [
        oldest.resolved_at[g] - oldest.submitted_at
        for g in oldest.collected.submitted
        if g in oldest.resolved_at
    ]
    samples = {
        "dispatched": dispatched_lengths,
        "trained": oldest.lengths(),
        "latency": aq.latencies,
        "trained_latency": trained_latency,
    }
    counts = [older_tokens, len(token_versions), masked, model_tokens]
    if hosts.count > 1:  # the bias monitor over every host's groups
        parts = hosts.allgather(f"s{step}/async_samples", {**samples, "counts": counts})
        samples = {k: [x for p in parts for x in p[k]] for k in samples}
        counts = [sum(p["counts"][i] for p in parts) for i in range(4)]
    oldest_version = min(versions) if versions else oldest.version
    m.update(
        {
            "async/staleness": float(version_at_update - oldest_version),
            # newest minus oldest token version in the batch (a partial rollout spans a sync)
            "async/version_spread": float(max(token_versions) - min(token_versions))
            if token_versions
            else 0.0,
            "async/dispatch_version": float(oldest.version),
            "async/dispatch_index": float(oldest.index),
            "async/queued_batches": float(len(aq.queue)),
            "async/inflight_groups": float(aq.inflight_groups() * hosts.count),
            "async/dispatch_paused_s": paused,
            # partial rollouts: model tokens older than the batch's newest version (begun
            # before a weight sync), and those mask_offpolicy_tokens took out of the loss
            "async/partial_batch": float(newest > oldest.version),
            "async/offpolicy_token_frac": counts[0] / max(counts[1], 1),
            "async/masked_token_frac": counts[2] / max(counts[3], 1),
            # groups trained without a verdict because none came within the deadline counted
            # from their submission (every host's)
            "async/staleness_fallbacks": float(sum(r == "deadline" for r in ex.fallback)),
            "async/ks_length": ks_distance(samples["dispatched"], samples["trained"]),
            "async/ks_grading_latency": ks_distance(samples["latency"], samples["trained_latency"]),
        }
    )
    aq.latencies = []
    m.update(sync_m)
    m.update(
        grade_wait_s=t_update - t_wait,
        update_time_s=t_end - t_update,
        step_time_s=t_end - t_step,
        policy_version=float(ls.policy_version),
        data_position=float(ls.data_position),
    )
    return updated.state, m


__all__ = [
    "ASYNC_KEY",
    "AsyncQueue",
    "InflightBatch",
    "StartedBatch",
    "async_step",
    "ks_distance",
    "offpolicy_token_mask",
    "start_phase",
]
