"""Asynchronous RL steps: grading overlapped with the next steps' generation, bounded staleness.

With ``rollout.max_staleness = S > 0`` the loop keeps a FIFO of dispatched batches (each one
collect phase: ``G`` kept groups, every group submitted to the grading pool as it is kept) and
every RL step

1. **dispatches** (admission control): while fewer than ``S + 1`` batches wait and the grading
   pool has room for another batch (``grading.max_inflight_groups`` groups submitted and not
   yet trained), a new batch is collected with the engine's current weights; each sample is
   tagged with the policy version it was dispatched with (``Rollout.policy_version``; every
   token of an embedded-sampler sample or episode is generated within that dispatch, so a
   token's version is its sample's);
2. **trains the oldest batch** (oldest first, nothing discarded or requeued): the loop waits
   for its verdicts until the grading deadline counted from its submission, then grade ->
   pack -> exchange -> update -> sync as the synchronous step does;
3. reports the staleness of that batch at its update: the trainer's version minus the oldest
   version in it. A batch dispatched at version ``v`` has at most ``S`` batches ahead of it, so
   it is trained at a version ``<= v + S``, generation, verification, grading and queue time
   included. A group whose verdict has not arrived when the bound forces its update takes the
   grading fallback (``deadline``; counted as ``async/staleness_fallbacks``), never dropped.

``S = 0`` is not run by this module: the loop then calls the synchronous
:func:`~gagar_jax.rl.train.rl_step` (one dispatch, wait, update per step), bit for bit.

Bias monitor: per step, the two-sample Kolmogorov-Smirnov distance between the dispatched and
the trained distributions of response length (``async/ks_length``) and of grading latency
(``async/ks_grading_latency``; latency = submission to the verdict as the loop observes it).
FIFO training keeps both near the sampling noise; a scheme that let fast groups overtake slow
ones would show here first.

Checkpoints: the batches still queued at a checkpoint are saved in the loop state of the same
atomic checkpoint (:func:`batch_state`): dispatch index and version, data position and, for
single-turn families, every kept group's trajectories. A resumed run rebuilds them (verified
again from their tokens, resubmitted to the grading pool, whose verdict cache keyed by the
trajectory's content answers every group graded before the interruption) and trains them
first: no group is lost, duplicated or graded twice and the data position is exact. A
multi-turn batch (its episodes end in environment states) is saved as its data position and
dispatched again from there under the restored weights; with dynamic sampling the redrawn
prompts may then differ from the lost ones.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import numpy as np

from gagar_jax.envs.family import Attempt
from gagar_jax.rl import grade, train
from gagar_jax.rl.collect import Group, SamplingResult, StepCounters, _rollout

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

    def lengths(self) -> list[int]:
        return [
            len(r.response_tokens)
            for g in self.collected.sampling.groups
            for r in g.rollouts
            if not r.infra_error
        ]


class AsyncQueue:
    """Admission control and the FIFO of dispatched batches (host-side, one per host)."""

    def __init__(self, max_staleness: int, max_inflight_groups: int, groups_per_batch: int):
        if max_staleness < 1:
            raise ValueError(f"AsyncQueue: max_staleness must be >= 1, got {max_staleness}")
        self.max_staleness = max_staleness
        self.max_inflight_groups = max_inflight_groups
        self.groups_per_batch = groups_per_batch
        self.queue: collections.deque[InflightBatch] = collections.deque()
        self.dispatched = 0
        self.resume_positions: list[tuple[int, int]] = []  # (position, version) to redo first
        self.latencies: list[float] = []  # grading latencies observed this step

    def inflight_groups(self) -> int:
        """Group slots dispatched and not yet trained (``groups_per_batch`` per queued batch:
        the same count on every host, so all hosts take the same admission decisions)."""
        return len(self.queue) * self.groups_per_batch

    def may_dispatch(self) -> bool:
        """Admission: a new batch keeps the staleness bound (at most ``S`` batches ahead of it)
        and the pool's bound; an empty queue always admits one batch (no deadlock)."""
        if not self.queue:
            return True
        if len(self.queue) > self.max_staleness:
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
        }

    def load(self, state: dict[str, Any], *, family=None, pool=None, cfg=None) -> None:
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


_ROLLOUT_FIELDS = (
    "prompt_tokens",
    "response_tokens",
    "logprobs",
    "finish_reason",
    "policy_version",
    "response_mask",
    "num_turns",
    "num_tool_calls",
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
    if any(
        getattr(r.attempt, "episode", None) is not None for g in sres.groups for r in g.rollouts
    ):
        return out
    out["groups"] = [
        {
            "group_id": g.group_id,
            "task_index": g.task_index,
            "rollouts": [{f: getattr(r, f) for f in _ROLLOUT_FIELDS} for r in g.rollouts],
        }
        for g in sres.groups
    ]
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
            attempt = Attempt(
                response_tokens=list(rd["response_tokens"]), text=tok.decode(rd["response_tokens"])
            )
            fields = {f: rd[f] for f in _ROLLOUT_FIELDS if f != "prompt_tokens"}
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
    )


def async_step(step: int, state, ls, ctx, aq: AsyncQueue, *, steps_left: int | None = None):
    """One asynchronous RL step (module docstring); returns ``(state, metrics)``.

    ``steps_left`` (this one included): no batch is dispatched that no remaining step would
    train, so a run ends with an empty queue."""

    cfg, hosts = ctx.cfg, ctx.hosts
    t_step = time.monotonic()
    G_local = cfg.rollout.num_prompts // hosts.count
    dispatched_lengths: list[int] = []
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
        )
        if saved_position is not None:
            ls.data_position = max(saved_position, ls.data_position)
        batch = InflightBatch(
            index=aq.dispatched,
            version=ls.policy_version,
            position=start,
            collected=collected,
            submitted_at=time.monotonic(),
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
    packed = train.pack_phase(
        oldest.collected.sampling.groups,
        grades,
        cfg,
        num_groups=G_local,
        pad_id=ctx.family.tokenizer.pad_id,
    )
    ex = train.exchange_phase(packed, oldest.collected, hosts, step=oldest.index)
    if ctx.tracker is not None:
        for i, passed in ex.attempts:
            ctx.tracker.record(str(i), list(passed))
    versions = [
        r.policy_version
        for g in oldest.collected.sampling.groups
        for r in g.rollouts
        if not r.infra_error
    ]
    version_at_update = ls.policy_version
    t_update = time.monotonic()
    with hosts.collective(f"the update of step {step}"):
        updated = train.update_phase(ctx, state, ex.batch, step=step)
        weight_version = train.sync_phase(ctx, updated.state, ls, step=step)
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
    if hosts.count > 1:  # the bias monitor over every host's groups
        parts = hosts.allgather(f"s{step}/async_samples", samples)
        samples = {k: [x for p in parts for x in p[k]] for k in samples}
    oldest_version = min(versions) if versions else oldest.version
    m.update(
        {
            "async/staleness": float(version_at_update - oldest_version),
            "async/version_spread": float(max(versions) - min(versions)) if versions else 0.0,
            "async/dispatch_version": float(oldest.version),
            "async/dispatch_index": float(oldest.index),
            "async/queued_batches": float(len(aq.queue)),
            "async/inflight_groups": float(aq.inflight_groups() * hosts.count),
            "async/dispatch_paused_s": paused,
            # groups trained without a verdict because none came within the deadline counted
            # from their submission (every host's)
            "async/staleness_fallbacks": float(sum(r == "deadline" for r in ex.fallback)),
            "async/ks_length": ks_distance(samples["dispatched"], samples["trained"]),
            "async/ks_grading_latency": ks_distance(samples["latency"], samples["trained_latency"]),
        }
    )
    aq.latencies = []
    m.update(
        grade_wait_s=t_update - t_wait,
        update_time_s=t_end - t_update,
        step_time_s=t_end - t_step,
        policy_version=float(ls.policy_version),
        data_position=float(ls.data_position),
    )
    return updated.state, m


__all__ = ["ASYNC_KEY", "AsyncQueue", "InflightBatch", "async_step", "ks_distance"]
