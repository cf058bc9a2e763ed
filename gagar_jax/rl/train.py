"""The training loop: tasks -> rollouts -> verification -> dynamic sampling -> grading -> update.

One RL step (``for step in range(start, total)``), each piece from its own package:

1. **Sample and verify.** Prompts come from the task family's stream (deterministic by data
   position; ``gagar_jax.envs.family`` is the only part of ``envs`` the loop knows); the rollout
   engine generates K samples per prompt, or, for a multi-turn family, K episodes through
   ``rollout.run_episodes`` (one batched engine call per turn; model tokens kept as generated,
   observations masked out of the loss); each is verified by the family (tests + behaviour
   monitor). A verifier crash is an infra error: masked, counted.
2. **Dynamic sampling** (:func:`~gagar_jax.rl.collect.collect_groups`): rounds of fresh prompts
   until ``num_prompts`` mixed groups are held (cap + clear error, or a partial batch when allowed).
3. **Grading, overlapped.** Every kept group is submitted to the grading pool the moment it is
   kept, so grading runs while the following refill rounds generate; after the last round the
   loop waits (deadline-bounded) for the verdicts. A missing / invalid / late verdict means the
   group keeps its original advantages (the pool's fallback, counted in metrics).
4. **Pack** the groups and their grade arrays into the update's static group-major ``[N, T]``
   batch (no recompilation, whatever the refills did).
5. **Update**: one jitted call (advantages computed inside from the raw results, then PPO-clip).
6. **Weight sync** to the rollout engine (``policy_version`` + 1; the engine must report that
   version back: ``rollout/weight_version``), with the training-inference mismatch of the step's
   batch (``rollout/logprob_mismatch_k3``, ``rollout/logprob_mismatch_max_abs``).
7. Periodic **held-out evaluation**, **checkpoint** (one orbax step: the train state and the
   loop's :class:`~gagar_jax.rl.resume.LoopState` as two items, one fingerprint) and metrics.

Preemption: SIGTERM (what a pod sends before it takes the machines) sets a flag; at the next step
boundary every host learns whether any host got one, they save that step's checkpoint together
and :func:`train_and_evaluate` returns ``{"preempted": True, ...}`` (``scripts/train.py`` then
exits with ``128 + SIGTERM``); a rerun resumes there. SIGKILL loses at most the steps since the
last checkpoint, and a rerun repeats none and skips none.

Modes (``config.mode``) change only the advantage redistribution inside the update; the grader
runs in every mode so quality and T1 share are measured identically.

Before RL, an SFT warm start on demonstrations (``config.sft``) runs once; its completion is part
of the resumable state.

Overlap: with ``rollout.max_staleness = 0`` (the default) generation for step t+1 starts after
the update of step t (on-policy, as the paper's synchronous setting); the grading/generation
overlap is inside a step, across refill rounds, and grading of the last round is the only
exposed wait. With ``max_staleness > 0`` the loop runs :func:`~gagar_jax.rl.asynchronous.async_step`
instead: grading overlaps the following steps' generation and updates, with the staleness of
every trained group bounded (docs/async.md). ``rollout.async_scheduler`` runs that scheduler at
``max_staleness = 0`` too, where it gives this loop's run.

Steps 1-6 are the named phases of :func:`rl_step`: :func:`collect_phase` (1-3, each kept group
submitted for grading) -> :func:`grade_phase` -> :func:`pack_phase` (4) ->
:func:`exchange_phase` (the group fields of every host; the identity on one host) ->
:func:`update_phase` (5) -> :func:`sync_phase` (6), with a named type between each.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from gagar_jax.analysis import writers
from gagar_jax.data.audit import PassRateTracker
from gagar_jax.host_cpu import prepare_cpu_host
from gagar_jax.rl import asynchronous, canary, engines, grade, policy
from gagar_jax.rl import rollout_log as rollout_store
from gagar_jax.rl.collect import (  # noqa: F401 - some re-exported (tests import them here)
    Group,
    Rollout,
    SamplingResult,
    StepCounters,
    _rollout,
    build_family,
    collect_blocks,
    family_settings,
    generate_groups,
    pack_groups,
    rollout_metrics,
    select_prompts,
)
from gagar_jax.rl.config import MeshConfig, RunConfig
from gagar_jax.rl.grade import group_workspace
from gagar_jax.rl.multihost import Hosts, check_process_rows, prompt_seed
from gagar_jax.rl.resume import LoopState, TaskStream
from gagar_jax.update import UpdateBatch, jit_update, make_mesh, sft
from gagar_jax.update.alignment import jit_behaviour_logprobs
from gagar_jax.update.checkpoint import ConfigMismatchError
from gagar_jax.verify import execution


class ResumeMismatchError(RuntimeError):
    """The workdir holds a run with a different configuration."""


class SigtermFlag:
    """Between :meth:`install` and :meth:`uninstall`, SIGTERM only sets ``requested`` (the loop
    saves at the next step boundary and stops). Outside the main thread (a notebook's worker, a
    test's host thread) signals cannot be caught, and the flag stays False."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def initialize_distributed(mesh_cfg: MeshConfig) -> None:
    """``jax.distributed.initialize`` from the config, else from JAX_* environment variables.

    Must be called before any JAX computation. Single-process runs (no coordinator configured
    anywhere) skip it. Environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID.
    """
    address = mesh_cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    num = mesh_cfg.num_processes
    pid = mesh_cfg.process_id
    if "JAX_NUM_PROCESSES" in os.environ and num == 1:
        num = int(os.environ["JAX_NUM_PROCESSES"])
    if "JAX_PROCESS_ID" in os.environ and pid == 0:
        pid = int(os.environ["JAX_PROCESS_ID"])
    if not address or num <= 1:
        return
    if not 0 <= pid < num:
        raise ValueError(f"process id {pid} outside [0, {num}) (mesh.process_id/JAX_PROCESS_ID)")
    # heartbeat: JAX's own detection of a dead or frozen process, the backstop where ours cannot
    # run (a host lost inside orbax's save barrier, which holds the interpreter)
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=num,
        process_id=pid,
        heartbeat_timeout_seconds=int(mesh_cfg.heartbeat_timeout_s),
    )


def enable_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in ``directory`` (every program, however fast)."""
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Rows (tasks x samples) per sampler call of an evaluation: one call for the toy default
# (32 tasks x 4 samples); a larger held-out set takes several calls of this size.
EVAL_CALL_ROWS = 128


def eval_groups(
    engine,
    family,
    cfg: RunConfig,
    tasks,
    *,
    step: int,
    first_index: int = 0,
    sample_step: int | None = None,
    counters: StepCounters | None = None,
) -> list[Group]:
    """``loop.eval_rollouts`` samples of each task at ``loop.eval_temperature``, verified, in
    calls of at most ``EVAL_CALL_ROWS`` rows.

    Each task's samples are seeded by ``(seed, sample_step, its index)`` alone (``sample_step``
    defaults to ``step``): the split into calls changes nothing, and two checkpoints sampled
    with the same ``sample_step`` draw with the same seeds (paired samples).
    ``first_index``: the index of ``tasks[0]`` within the evaluated set.
    """
    k = max(cfg.loop.eval_rollouts, 1)
    per_call = max(1, EVAL_CALL_ROWS // k)
    seed_step = step if sample_step is None else sample_step
    groups: list[Group] = []
    for a in range(0, len(tasks), per_call):
        part = tasks[a : a + per_call]
        lo = first_index + a
        groups += generate_groups(
            engine,
            family,
            part,
            cfg=cfg,
            step=step,
            round_id=10_000,
            num_rollouts=k,
            temperature=cfg.loop.eval_temperature,
            id_prefix=f"eval{step}",
            counters=counters,
            first_index=lo,
            prompt_seeds=[
                prompt_seed((cfg.seed,), 2, seed_step, i) for i in range(lo, lo + len(part))
            ],
        )
    return groups


def evaluate(
    engine, family, cfg: RunConfig, *, step: int, hosts: Hosts | None = None
) -> dict[str, float]:
    """Held-out tasks: pass rate, quality of passing patches, cheat rate, response length (and
    turns / tool calls per episode for multi-turn families).

    Several hosts split the tasks (contiguous shares, each task seeded by its index) and
    reduce their counters, so every host returns the figures of all of them. Any number of
    tasks: :func:`eval_groups` samples them in calls of ``EVAL_CALL_ROWS`` rows.
    """
    tasks = family.eval_tasks()
    if not tasks:
        return {}
    hosts = hosts or Hosts(cfg.mesh.host_timeout_s)
    lo = len(tasks) * hosts.index // hosts.count
    hi = len(tasks) * (hosts.index + 1) // hosts.count
    counters = StepCounters()
    eval_groups(engine, family, cfg, tasks[lo:hi], step=step, first_index=lo, counters=counters)
    counters = StepCounters.merged(
        hosts.allgather(f"eval{step}/counters", dataclasses.asdict(counters))
    )
    m = counters.metrics()
    out = {
        "eval_pass_rate": m["pass_rate"],
        "eval_quality": m["quality"],
        "eval_cheat_rate": m["cheat_rate"],
        "eval_response_length": m["response_length"],
    }
    if family.multi_turn:
        out.update(
            {
                "eval_turns_mean": m["episode/turns_mean"],
                "eval_tool_calls_mean": m["episode/tool_calls_mean"],
            }
        )
    return out


PASS_RATES_KEY = "pass_rates"  # LoopState.extra: the PassRateTracker's state


def pass_rate_tracker(cfg: RunConfig, ls: LoopState) -> PassRateTracker | None:
    """The run's tracker (``task.skip_saturated``; else None): the one saved in the loop state
    (a resumed run), or a fresh one."""
    if not cfg.task.skip_saturated:
        return None
    if PASS_RATES_KEY in ls.extra:
        return PassRateTracker.from_state(ls.extra[PASS_RATES_KEY])
    return PassRateTracker(cfg.task.saturation_window, cfg.task.saturation_min_attempts)


def saturation_metrics(sres, tracker: PassRateTracker) -> dict[str, float]:
    """``task.skip_saturated`` figures of one step (identical on every host)."""
    return {
        "sampling_skipped_saturated": float(getattr(sres, "skipped_saturated", 0)),
        "sampling_saturated_tasks": float(len(tracker.saturated())),
    }


# The [G, K] (and [G]) fields of the UpdateBatch: global on every host (the rest are its rows).
GROUP_FIELDS = ("rewards", "passed", "cheat", "tier", "rank", "graded", "valid")


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------
# The plot panels' names for two of the update's metrics (the update's own names stay too).
_PANEL_NAMES = {"pg_loss_mean": "pg_loss", "credit_ratio": "credit/ratio"}


def _with_panel_names(m: dict[str, float]) -> dict[str, float]:
    out = dict(m)
    for panel, name in _PANEL_NAMES.items():
        if name in m:
            out.setdefault(panel, m[name])
    return out


@dataclasses.dataclass
class RLContext:
    """What one RL step works with, built once by :func:`train_and_evaluate`."""

    cfg: RunConfig
    hosts: Hosts
    family: Any  # gagar_jax.envs.family.TaskFamily
    stream: TaskStream
    engine: Any  # gagar_jax.rollout RolloutEngine: generate, sync_weights
    grading_pool: Any  # gagar_jax.grading.GradingPool
    update_fn: Any  # gagar_jax.update.jit_update(...)
    mesh: Any
    sampler_device: Any  # the embedded sampler's device (weight sync target)
    tracker: PassRateTracker | None = None
    rollout_log: Any = None  # rl.rollout_log.RolloutLog: this host's stored rollouts
    # rollout.bitwise_onpolicy: gagar_jax.update.alignment.jit_behaviour_logprobs(...)
    behaviour_fn: Any = None


# ------------------------------------------------------------------------------------------
# The phases of one RL step, with arrays (named types) between them
# ------------------------------------------------------------------------------------------
class Collected(NamedTuple):
    """The collect phase's output: this host's kept groups (each already submitted to the
    grading pool when grading is on) and the step's tallies."""

    sampling: SamplingResult  # kept groups (this host's block), rounds, drawn counts
    counters: StepCounters  # this host's tallies over every rollout drawn
    submitted: tuple[str, ...]  # group ids submitted to the grading pool, in order
    attempts: tuple[tuple[int, tuple[bool, ...]], ...]  # (task index, valid rollouts passed)
    wait_start: float  # time.monotonic() when collection ended (the grading wait starts)


class Packed(NamedTuple):
    """The pack phase's output: the update batch and the per-group grading facts the metrics
    read (arrays only: what the exchange moves between hosts)."""

    batch: UpdateBatch  # NumPy; this host's [G_local * K, T] rows and [G_local, K] fields
    kept: np.ndarray  # [G_local] bool, the slot holds a kept group (not padding)
    grader_cheat: np.ndarray  # [G_local, K] bool, the verdict's (or monitor's) cheat flag
    fallback: tuple[str, ...]  # [G_local] fallback reason of a kept ungraded group, else ""


class Exchanged(NamedTuple):
    """The exchange phase's output: every host's group fields and tallies (identity on one
    host)."""

    batch: UpdateBatch  # this host's token rows, the global [G, K] group fields
    kept: np.ndarray  # [G] bool
    grader_cheat: np.ndarray  # [G, K] bool
    fallback: tuple[str, ...]  # [G]
    counters: StepCounters  # over all hosts
    attempts: tuple[tuple[int, tuple[bool, ...]], ...]  # every host's, in host order


class Updated(NamedTuple):
    """The update phase's output."""

    state: Any  # the new TrainState
    metrics: dict[str, float]  # the update's metrics (host floats)


def collect_phase(
    engine,
    family,
    grading_pool,
    stream: TaskStream,
    ls: LoopState,
    cfg: RunConfig,
    *,
    step: int,
    hosts: Hosts,
    tracker: PassRateTracker | None = None,
    first_round: Any = None,
    rollout_log: Any = None,
) -> Collected:
    """Collect: dynamic sampling of this host's block of groups (K rollouts per prompt,
    verified), each kept group submitted to the grading pool the moment it is kept.

    ``first_round`` (:class:`~gagar_jax.rl.asynchronous.StartedBatch`): the first round's
    prompts were drawn and their episodes begun before the last weight sync (a partial rollout):
    they are resumed here under the engine's current weights instead of drawn again.

    Advances ``ls.data_position`` by every prompt drawn (by all hosts). With ``tracker``
    (``task.skip_saturated``), prompt selection passes over tasks the tracker finds saturated
    (:func:`~gagar_jax.rl.collect.select_prompts`; ``skipped_saturated`` counts them).
    """
    G, K = cfg.rollout.num_prompts, cfg.rollout.num_rollouts
    counters = StepCounters()
    submitted: list[str] = []
    rounds = [0]
    skipped = [0]
    attempts: list[tuple[int, tuple[bool, ...]]] = []
    skip = None if tracker is None else (lambda i: tracker.skip(str(i)))
    # groups drawn with a grader slot held (execution back-end admission): a kept group's slot
    # is freed when the pool finishes it; the others' when they are dropped
    hold = bool(cfg.grading.enabled)
    holding: list[str] = []

    def release_dropped():
        done = set(submitted)
        execution.current().release_grader([g for g in holding if g not in done])
        holding.clear()

    def draw(n):
        release_dropped()  # the last round's groups that were not kept
        rounds[0] += 1
        started = None
        if rounds[0] == 1 and first_round is not None:  # drawn and begun before the sync
            if list(n) != list(first_round.n):
                raise RuntimeError(f"first round draws {n}, the started batch {first_round.n}")
            idx, pos, n_skip = first_round.idx, first_round.pos, first_round.skipped
            started = first_round.episodes
        else:
            idx, pos, ls.data_position, n_skip = select_prompts(
                stream, ls.data_position, sum(n), skip
            )
        skipped[0] += n_skip  # every host selects the same prompts: a global count
        lo = sum(n[: hosts.index])
        hi = lo + n[hosts.index]
        # a prompt's samples are seeded by its global data position: the same on any host
        groups = generate_groups(
            engine,
            family,
            [family.train_task(i) for i in idx[lo:hi]],
            cfg=cfg,
            step=step,
            round_id=rounds[0],
            num_rollouts=K,
            temperature=cfg.rollout.temperature,
            id_prefix=f"s{step}",
            counters=counters,
            first_index=lo,
            prompt_seeds=[prompt_seed(ls.rng_key, 1, p) for p in pos[lo:hi]],
            started=started,
            hold_grader=hold,
        )
        if hold:
            holding.extend(g.group_id for g in groups)
        for i, g in zip(idx[lo:hi], groups):
            g.task_index = int(i)
        if tracker is not None:
            attempts.extend(
                (int(i), tuple(r.reward > 0 for r in g.rollouts if not r.infra_error))
                for i, g in zip(idx[lo:hi], groups)
            )
        return groups

    def exchange(round_id, tally):
        return hosts.allgather(f"s{step}/r{round_id}/tally", tally)

    def submit(group):
        grading_pool.submit(group_workspace(family, group))
        submitted.append(group.group_id)

    try:
        sres = collect_blocks(
            draw,
            exchange,
            target=G,
            num_blocks=hosts.count,
            block=hosts.index,
            enabled=cfg.sampling.enabled,
            oversample=cfg.sampling.oversample,
            max_rounds=cfg.sampling.max_rounds,
            allow_partial=cfg.sampling.allow_partial,
            on_keep=submit if cfg.grading.enabled else None,
        )
    finally:
        release_dropped()
    sres.skipped_saturated = skipped[0]
    if rollout_log is not None:  # this host's kept groups, for re-scoring later
        rollout_log.write(step, sres.groups)
    canary.run_canaries(
        engine, family, cfg, counters, step=step, host=hosts.index, num_hosts=hosts.count
    )
    return Collected(
        sampling=sres,
        counters=counters,
        submitted=tuple(submitted),
        attempts=tuple(attempts),
        wait_start=time.monotonic(),
    )


def grade_phase(
    grading_pool,
    family,
    collected: Collected,
    cfg: RunConfig,
    *,
    num_groups: int,
    timeout: float | None = None,
) -> grade.Grades:
    """Grade: the pool's verdicts on the collected groups, once, as ``[G_local, K]`` arrays
    (a wait of at most ``timeout`` seconds, default ``grading.deadline_s``; a missing verdict
    is the pool's counted fallback)."""
    K, R = cfg.rollout.num_rollouts, cfg.rollout.max_new_tokens
    groups = collected.sampling.groups
    if cfg.grading.enabled and groups:
        results = grading_pool.results(
            list(collected.submitted),
            timeout=cfg.grading.deadline_s if timeout is None else timeout,
        )
        return grade.to_arrays(
            results,
            groups,
            num_groups=num_groups,
            num_rollouts=K,
            max_new_tokens=R,
            token_spans=family.token_spans,
        )
    return grade.no_grades(num_groups, K, R)


def route_shape(engine) -> tuple[int, int] | None:
    """``(MoE layers, experts per token)`` when ``engine`` records mixture-of-experts routes
    (the embedded sampler's ``record_routes``): the batches then carry them."""
    if not getattr(engine, "record_routes", False):
        return None
    c = engine.config
    return (c.num_layers, c.num_experts_per_tok)


def harness_rows(cfg: RunConfig) -> int:
    """Rows of the update batch per rollout: ``rollout.harness_max_segments`` with a harness,
    else 1."""
    return 1 if cfg.rollout.harness == "native" else cfg.rollout.harness_max_segments


def pack_phase(
    groups,
    grades: grade.Grades,
    cfg: RunConfig,
    *,
    num_groups: int,
    pad_id: int,
    route_shape: tuple[int, int] | None = None,
) -> Packed:
    """Pack: the groups and their grades into the static group-major update batch (with the
    rollouts' recorded routes when ``route_shape`` is given)."""
    batch = pack_groups(
        groups,
        grades,
        num_groups=num_groups,
        num_rollouts=cfg.rollout.num_rollouts,
        max_prompt_len=cfg.rollout.max_prompt_len,
        max_new_tokens=cfg.rollout.max_new_tokens,
        pad_id=pad_id,
        route_shape=route_shape,
        max_segments=harness_rows(cfg),
    )
    kept = np.zeros((num_groups,), bool)
    kept[: len(groups)] = True
    fallback = [""] * num_groups
    for gi in range(len(groups)):
        if not grades.graded[gi]:
            reason = grades.reasons[gi] if gi < len(grades.reasons) else None
            fallback[gi] = str(getattr(reason, "value", reason) or "unknown")
    return Packed(
        batch=batch,
        kept=kept,
        grader_cheat=np.asarray(grades.cheat, bool),
        fallback=tuple(fallback),
    )


def exchange_phase(packed: Packed, collected: Collected, hosts: Hosts, *, step: int) -> Exchanged:
    """Exchange: every host's ``[G_local, K]`` group fields, grading facts and tallies, so all
    hosts build the same replicated group arrays and metrics. The identity on one host (no
    serialisation)."""
    if hosts.count == 1:
        return Exchanged(
            batch=packed.batch,
            kept=packed.kept,
            grader_cheat=packed.grader_cheat,
            fallback=packed.fallback,
            counters=collected.counters,
            attempts=collected.attempts,
        )
    local = packed.batch
    parts = hosts.allgather(
        f"s{step}/verdicts",
        {
            "fields": {f: getattr(local, f).tolist() for f in GROUP_FIELDS},
            "kept": packed.kept.tolist(),
            "grader_cheat": packed.grader_cheat.tolist(),
            "fallback": list(packed.fallback),
            "counters": dataclasses.asdict(collected.counters),
            "attempts": [[i, list(p)] for i, p in collected.attempts],
        },
    )
    batch = local._replace(
        **{
            f: np.concatenate(
                [np.asarray(part["fields"][f], getattr(local, f).dtype) for part in parts]
            )
            for f in GROUP_FIELDS
        }
    )
    return Exchanged(
        batch=batch,
        kept=np.concatenate([np.asarray(p["kept"], bool) for p in parts]),
        grader_cheat=np.concatenate(
            [np.asarray(p["grader_cheat"], bool).reshape(len(p["kept"]), -1) for p in parts]
        ),
        fallback=tuple(r for p in parts for r in p["fallback"]),
        counters=StepCounters.merged([p["counters"] for p in parts]),
        attempts=tuple(
            (int(i), tuple(bool(x) for x in passed)) for p in parts for i, passed in p["attempts"]
        ),
    )


def update_phase(ctx: RLContext, state, batch: UpdateBatch, *, step: int) -> Updated:
    """Update: the jitted update on the exchanged batch (advantages computed inside). With
    ``rollout.bitwise_onpolicy`` the batch's behaviour log-probs are first recomputed by the
    update's own program with the embedded sampler's weights."""
    behaviour = None
    if ctx.behaviour_fn is not None:
        params = nnx.to_pure_dict(ctx.engine.state)
        behaviour = functools.partial(ctx.behaviour_fn, params)
    state, m = policy.rl_update(
        ctx.update_fn, state, batch, cfg=ctx.cfg, mesh=ctx.mesh, step=step, behaviour=behaviour
    )
    return Updated(state=state, metrics=m)


def sync_phase(
    ctx: RLContext, state, ls: LoopState, *, step: int, metrics: dict | None = None
) -> int:
    """Sync: the new parameters to the rollout engine as ``policy_version + 1``; returns the
    version the engine reports (it must be that one). ``metrics`` receives the sync check's
    (``sync/probe_max_abs_diff``: the engine's probe log-probs against the trainer's)."""
    ls.policy_version += 1
    version = policy.sync_engine(
        ctx.engine,
        ctx.cfg,
        state.params,
        mesh=ctx.mesh,
        device=ctx.sampler_device,
        version=ls.policy_version,
        metrics=metrics,
    )
    if version != ls.policy_version:
        raise RuntimeError(
            f"rollout engine reports weight version {version} "
            f"after syncing version {ls.policy_version} (step {step})"
        )
    return version


def collect_step(
    engine,
    family,
    grading_pool,
    stream: TaskStream,
    ls: LoopState,
    cfg: RunConfig,
    *,
    step: int,
    hosts: Hosts | None = None,
    tracker: PassRateTracker | None = None,
):
    """Collect -> grade -> pack -> exchange for one RL step (what :func:`rl_step` runs before
    the update), for this host's block of groups.

    Returns ``(SamplingResult, StepCounters, grading metrics, time the grading wait started,
    batch)``: the counters and metrics are over all hosts, the ``UpdateBatch`` (NumPy) holds
    this host's ``[G / P * K, T]`` rows and the global ``[G, K]`` group fields (see
    :mod:`gagar_jax.rl.multihost`). With ``tracker``, every drawn group's valid rollouts of
    every host are recorded after the step (in host order), so it stays identical on all
    hosts.
    """
    hosts = hosts or Hosts(cfg.mesh.host_timeout_s)
    G_local = cfg.rollout.num_prompts // hosts.count
    collected = collect_phase(
        engine, family, grading_pool, stream, ls, cfg, step=step, hosts=hosts, tracker=tracker
    )
    grades = grade_phase(grading_pool, family, collected, cfg, num_groups=G_local)
    packed = pack_phase(
        collected.sampling.groups,
        grades,
        cfg,
        num_groups=G_local,
        pad_id=family.tokenizer.pad_id,
        route_shape=route_shape(engine),
    )
    ex = exchange_phase(packed, collected, hosts, step=step)
    if tracker is not None:
        for i, passed in ex.attempts:
            tracker.record(str(i), list(passed))
    grading_m = (
        grade.batch_grading_metrics(ex.batch, ex.kept, ex.grader_cheat, ex.fallback)
        if cfg.grading.enabled and ex.kept.any()
        else {}
    )
    return collected.sampling, ex.counters, grading_m, collected.wait_start, ex.batch


def rl_step(step: int, state, ls: LoopState, ctx: RLContext):
    """One RL step as named phases with arrays between them; returns ``(state, metrics)`` and
    advances ``ls`` (data position, policy version, step).

    :func:`collect_phase` (:class:`Collected`) -> :func:`grade_phase`
    (:class:`~gagar_jax.rl.grade.Grades`) -> :func:`pack_phase` (:class:`Packed`) ->
    :func:`exchange_phase` (:class:`Exchanged`; the identity on one host) ->
    :func:`update_phase` (:class:`Updated`) -> :func:`sync_phase` (the engine's version).
    The grading metrics are computed from the exchanged, packed batch
    (:func:`~gagar_jax.rl.grade.batch_grading_metrics`).
    """
    cfg, hosts = ctx.cfg, ctx.hosts
    t_step = time.monotonic()
    G_local = cfg.rollout.num_prompts // hosts.count
    collected = collect_phase(
        ctx.engine,
        ctx.family,
        ctx.grading_pool,
        ctx.stream,
        ls,
        cfg,
        step=step,
        hosts=hosts,
        tracker=ctx.tracker,
        rollout_log=ctx.rollout_log,
    )
    grades = grade_phase(ctx.grading_pool, ctx.family, collected, cfg, num_groups=G_local)
    packed = pack_phase(
        collected.sampling.groups,
        grades,
        cfg,
        num_groups=G_local,
        pad_id=ctx.family.tokenizer.pad_id,
        route_shape=route_shape(ctx.engine),
    )
    ex = exchange_phase(packed, collected, hosts, step=step)
    if ctx.tracker is not None:
        for i, passed in ex.attempts:
            ctx.tracker.record(str(i), list(passed))
    t_update = time.monotonic()
    with hosts.collective(f"the update of step {step}"):
        updated = update_phase(ctx, state, ex.batch, step=step)
        sync_m: dict = {}
        weight_version = sync_phase(ctx, updated.state, ls, step=step, metrics=sync_m)
    ls.step = step + 1
    t_end = time.monotonic()
    grading_m = (
        grade.batch_grading_metrics(ex.batch, ex.kept, ex.grader_cheat, ex.fallback)
        if cfg.grading.enabled and ex.kept.any()
        else {}
    )
    m = step_metrics(
        collected.sampling,
        ex.counters,
        grading_m,
        updated.metrics,
        weight_version,
        cfg,
        ctx.tracker,
    )
    m.update(
        grade_wait_s=t_update - collected.wait_start,
        update_time_s=t_end - t_update,
        step_time_s=t_end - t_step,
        policy_version=float(ls.policy_version),
        data_position=float(ls.data_position),
    )
    m.update(sync_m)
    return updated.state, m


def step_metrics(
    sres,
    counters: StepCounters,
    grading_m,
    update_m,
    weight_version: int,
    cfg: RunConfig,
    tracker: PassRateTracker | None,
) -> dict[str, float]:
    """The metrics row of one step (rollouts over all drawn, the update's over the kept batch;
    an update figure whose name a rollout figure has is logged as ``update/<name>``)."""
    m = counters.metrics()
    m.update(sres.metrics(cfg.rollout.num_prompts))
    m.update(grading_m)
    if tracker is not None:
        m.update(saturation_metrics(sres, tracker))
    for k, v in _with_panel_names(update_m).items():
        m[f"update/{k}" if k in m else k] = v
    m.update(rollout_metrics(sres.groups, update_m, weight_version))
    return m


def _itstime(step: int, every: int, total: int) -> bool:
    """After step ``step`` (0-based): on the ``every`` interval, and after the last step."""
    return (step + 1) % every == 0 or step == total - 1


def _restore_or_start(cfg: RunConfig, ckpt, model_config, mesh, workdir: str):
    """``(state or None, LoopState, checkpoint step or None)``: the newest intact checkpoint's,
    else a fresh loop state (the state is created after the SFT warm start)."""
    if not ckpt.all_steps():
        key = jax.random.key_data(jax.random.key(cfg.seed))
        return None, LoopState(rng_key=[int(x) for x in np.asarray(key).ravel()]), None
    try:  # train state and loop state: one orbax step
        state, step, ls = policy.restore(ckpt, cfg, model_config, mesh)
    except ConfigMismatchError as e:
        raise ResumeMismatchError(
            f"{workdir} holds a run with another config fingerprint ({e}), this config is "
            f"{cfg.fingerprint()}: use another --workdir or the original config"
        ) from e
    return state, ls, step


def train_and_evaluate(cfg: RunConfig, workdir: str, *, grader: Any = None) -> dict[str, Any]:
    """Runs (or resumes) the configured job in ``workdir``; returns the final summary
    (``{"preempted": True, "step": s}`` when SIGTERM stopped it after checkpoint ``s``).

    Args:
      cfg: the validated run configuration.
      workdir: checkpoints, metrics, plots; an existing run there is resumed.
      grader: optional grader object (``grade(workspace[, cancel])``) used instead of the one
        ``cfg.grading.grader`` names, e.g. a custom grader from a notebook.
    """
    # On a CPU: keep freed memory for the next step's buffers (before JAX's backend starts: its
    # threads' allocator arenas), log the host facts that slow CPU steps (gagar_jax.host_cpu;
    # GAGAR_MALLOC_KEEP_HEAP=0 opts out of the first).
    prepare_cpu_host()
    workdir = os.path.abspath(workdir)
    hosts = Hosts(cfg.mesh.host_timeout_s)
    primary = hosts.primary
    G, K = cfg.rollout.num_prompts, cfg.rollout.num_rollouts
    if G % hosts.count:
        raise ValueError(
            f"config.rollout.num_prompts={G} must be a multiple of the "
            f"{hosts.count} processes (each host fills an equal block of groups)"
        )
    family = build_family(cfg)
    tok = family.tokenizer
    model_config, model = policy.build_model(cfg, tok.vocab_size)
    mesh = make_mesh(cfg.mesh.shape)
    check_process_rows(mesh, G * K)
    ckpt = policy.checkpointer(cfg, workdir, model_config)
    try:
        state, ls, resume_step = _restore_or_start(cfg, ckpt, model_config, mesh, workdir)
    except ResumeMismatchError:
        ckpt.close()
        raise
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if primary:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg.to_dict(), f, indent=1, sort_keys=True, default=str)
        dropped = writers.truncate_jsonl(
            metrics_path, keep_before_step=ls.step, drop_phases=None if ls.sft_done else ("sft",)
        )
    writer = writers.MetricsWriter(
        workdir, total_steps=cfg.loop.total_steps, start_step=ls.step, primary=primary
    )
    if resume_step is not None:
        writer.log(
            f"resumed from checkpoint {resume_step}: step {ls.step}, data position "
            f"{ls.data_position}, policy version {ls.policy_version}"
            + (f" ({dropped} stale metric rows dropped)" if primary and dropped else "")
        )

    # Engine and grader first: a dead server fails here, before any compute is spent.
    engine = engines.build_engine(cfg, model, workdir=workdir, pad_id=tok.pad_id, hosts=hosts)
    if cfg.rollout.engine == "embedded" and engine.mesh is not None:
        writer.log(f"embedded sampler: rows split over {engine.mesh.devices.size} local devices")
    if cfg.rollout.harness != "native":  # the gateway records every episode under the run
        from gagar_jax.rl import harness_rollouts  # noqa: PLC0415 -- the gateway's server stack

        harness_rollouts.harness_runner(
            engine,
            tok,
            cfg,
            record_dir=os.path.join(workdir, "episodes" if primary else f"episodes.p{hosts.index}"),
        )
    # one grading pool per host, for its own groups; each keeps its own verdict cache
    cache_path = os.path.join(
        workdir, "grader_cache.jsonl" if primary else f"grader_cache.p{hosts.index}.jsonl"
    )
    grading_pool = engines.build_grading_pool(
        cfg, cache_path=cache_path, grader=grader, check_runner=family.check_runner()
    )
    # Cited-token masks travel with every graded run, so every mode reports the share of
    # positive credit on evidence tokens (gagar_token's "evidence" importance reads them).
    with_routes = route_shape(engine) is not None
    if harness_rows(cfg) > 1 and hosts.count > 1:
        raise ValueError(
            f"rollout.harness_max_segments={cfg.rollout.harness_max_segments} runs in one "
            f"process (this run has {hosts.count}): set it to 1"
        )
    update_fn = jit_update(
        model_config,
        cfg.learner,
        mesh,
        with_evidence=cfg.grading.enabled,
        with_routes=with_routes,
        with_row_episode=harness_rows(cfg) > 1,
    )
    ctx = RLContext(
        cfg=cfg,
        hosts=hosts,
        family=family,
        stream=TaskStream(family.num_train, seed=cfg.seed),
        engine=engine,
        grading_pool=grading_pool,
        update_fn=update_fn,
        mesh=mesh,
        sampler_device=policy.model_device(model),
        tracker=pass_rate_tracker(cfg, ls),
        rollout_log=rollout_store.RolloutLog(
            os.path.join(
                workdir, "rollouts.jsonl" if primary else f"rollouts.p{hosts.index}.jsonl"
            ),
            keep_before_step=ls.step,
        )
        if cfg.loop.log_rollouts
        else None,
        behaviour_fn=jit_behaviour_logprobs(
            model_config,
            cfg.learner,
            mesh,
            temperature=cfg.rollout.temperature,
            with_evidence=cfg.grading.enabled,
            with_routes=with_routes,
        )
        if cfg.rollout.bitwise_onpolicy
        else None,
    )
    onset = rollout_store.OnsetTracker()

    summary: dict[str, Any] = {}
    sigterm = SigtermFlag()
    # where verification, run_tests, grading and its checks run (config.execution)
    # (a group holds a grader slot from its admission until the pool has graded it: at most
    # grading.max_inflight_groups groups wait for or are in grading, beyond the current round)
    backend = execution.make_backend(
        **dataclasses.asdict(cfg.execution), grader_slots=cfg.grading.max_inflight_groups
    )
    prev_backend = execution.use(backend)
    grading_pool.add_finish_callback(backend.release_grader)
    try:
        if execution.attach_grading(grading_pool, backend):
            writer.log("grading runs on the Ray cluster")
        # ---- SFT warm start, then the train state from the warmed model -------------------
        if not ls.sft_done:
            if cfg.sft.steps > 0:
                t0 = time.monotonic()
                # too long for the static response budget: skipped, never truncated
                demos = [
                    d
                    for d in family.demonstrations(cfg.task.num_train)
                    if d.response_len <= cfg.rollout.max_new_tokens
                ]
                writer.log(f"SFT warm start: {cfg.sft.steps} steps on {len(demos)} demonstrations")
                sft.run_sft(
                    model,
                    demos,
                    steps=cfg.sft.steps,
                    batch_size=cfg.sft.batch_size,
                    lr=cfg.sft.lr,
                    warmup_steps=cfg.sft.warmup_steps,
                    seq_len=cfg.rollout.seq_len,
                    pad_id=tok.pad_id,
                    seed=cfg.seed,
                    log_fn=lambda s, m: writer.write(s, m, phase="sft"),
                )
                writer.log(f"SFT done in {time.monotonic() - t0:.1f}s")
            ls.sft_done = True
            state = policy.initial_state(cfg, model, mesh)
            hosts.barrier("ckpt0")
            with hosts.collective("the checkpoint after SFT"):
                policy.save(ckpt, 0, state, ls)

        with hosts.collective("the first weight sync"):
            policy.sync_engine(
                engine,
                cfg,
                state.params,
                mesh=mesh,
                device=ctx.sampler_device,
                version=ls.policy_version,
            )
        if ls.step == 0 and cfg.loop.total_steps > 0 and family.eval_tasks():
            m = evaluate(engine, family, cfg, step=0, hosts=hosts)
            writer.write(0, m, phase="eval")
            writer.log("eval before RL: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
        writer.start_clock(ls.step)
        sigterm.install()
        total = cfg.loop.total_steps
        aq = None
        # the asynchronous loop (rl.asynchronous); at max_staleness=0 only when asked for
        if cfg.rollout.max_staleness > 0 or cfg.rollout.async_scheduler:
            if (
                cfg.rollout.partial_rollout
                and not family.multi_turn
                and not cfg.rollout.partial_chunk_tokens
            ):
                raise ValueError(
                    f"rollout.partial_rollout=True on a single-turn task family "
                    f"(task.family={cfg.task.family!r}) needs rollout.partial_chunk_tokens > 0: "
                    "a sample is interrupted between two chunks of its tokens"
                )
            aq = asynchronous.AsyncQueue(
                cfg.rollout.max_staleness,
                cfg.grading.max_inflight_groups,
                G // hosts.count,
                partial_rollout=cfg.rollout.partial_rollout,
            )
            saved = ls.extra.get(asynchronous.ASYNC_KEY, {}).get("per_host")
            if saved is not None:
                if len(saved) != hosts.count:
                    raise ResumeMismatchError(
                        f"{workdir}: the checkpoint holds the queued batches of {len(saved)} "
                        f"hosts, this run has {hosts.count} (rollout.max_staleness > 0 "
                        "resumes on the same number of processes)"
                    )
                aq.load(
                    saved[hosts.index], family=family, pool=grading_pool, cfg=cfg, host=hosts.index
                )
        for step in range(ls.step, total):
            if aq is None:
                state, m = rl_step(step, state, ls, ctx)
            else:
                state, m = asynchronous.async_step(
                    step, state, ls, ctx, aq, steps_left=total - step
                )
            m = {**m, **backend.metrics()}  # execution/*: calls in flight, waits, retries, ...
            onset.observe_train(m.get("pass_rate", 0.0))
            m.update(rollout_store.hacking_metrics(m))
            m.update(onset.metrics())
            if step % cfg.loop.log_every == 0 or step == total - 1:
                writer.write(step, m)
                writer.progress(step, m)
            if _itstime(step, cfg.loop.eval_every, total):
                em = evaluate(engine, family, cfg, step=step + 1, hosts=hosts)
                if em:
                    onset.observe_eval(em["eval_pass_rate"])
                    writer.write(step + 1, em, phase="eval")
                    writer.log(
                        f"eval @ step {step + 1}: "
                        + ", ".join(f"{k} {v:.3f}" for k, v in em.items())
                    )
            # SIGTERM on any host: all save this step and stop (the save is collective)
            stop = any(hosts.allgather(f"s{step}/sigterm", sigterm.requested))
            if _itstime(step, cfg.loop.checkpoint_every, total) or stop:
                ls.grader_cache = {
                    "path": os.path.basename(cache_path),
                    "entries": len(grading_pool.cache),
                }
                if ctx.tracker is not None:  # the same on every host: the primary's is saved
                    ls.extra[PASS_RATES_KEY] = ctx.tracker.state_dict()
                if aq is not None:  # every host's queued batches, in the same checkpoint
                    ls.extra[asynchronous.ASYNC_KEY] = {
                        "per_host": hosts.allgather(f"s{step}/async_state", aq.state_dict())
                    }
                hosts.barrier(f"ckpt{step + 1}")  # a host hung before the save is named here
                with hosts.collective(f"the checkpoint of step {step + 1}"):
                    policy.save(ckpt, step + 1, state, ls)  # all hosts take part; orbax writes once
            if stop and step < total - 1:
                writer.log(f"SIGTERM: checkpoint {step + 1} saved; stopping (rerun to resume)")
                summary.update(preempted=True, step=step + 1)
                return summary
        summary["update_traces"] = update_fn._cache_size()
    finally:
        sigterm.uninstall()
        ckpt.close()
        grading_pool.close()
        execution.use(prev_backend)
        backend.close()
        writer.close()
    if primary:
        rows = writers.read_jsonl(metrics_path)
        summary.update(writers.summarize(rows))
        if cfg.loop.plot:
            summary["plot"] = writers.plot_run(workdir)
        _print_summary(cfg, workdir, summary)
    return summary


def _print_summary(cfg: RunConfig, workdir: str, summary: dict[str, Any]) -> None:
    title = f"== {cfg.name} ({cfg.mode}) finished: {cfg.loop.total_steps} steps in {workdir}"
    eval_samples = cfg.task.num_eval * cfg.loop.eval_rollouts
    print(writers.format_summary(title, summary, eval_samples=eval_samples), flush=True)


def evaluate_checkpoint(
    workdir: str, *, step: int = -1, samples: int = 4, temperature: float = 0.7
) -> tuple[dict[str, float], int]:
    """Restores a run's checkpoint (newest complete one for ``step=-1``) and evaluates it."""
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} a run directory?")
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    run_cfg = RunConfig.from_config_dict(d)  # the checkpoints' own (their fingerprint)
    d["loop"].update(eval_rollouts=samples, eval_temperature=temperature)
    cfg = RunConfig.from_config_dict(d)
    family = build_family(cfg)
    model_config, model = policy.build_model(cfg, family.tokenizer.vocab_size)
    mesh = make_mesh(cfg.mesh.shape)
    ckpt = policy.checkpointer(run_cfg, workdir, model_config)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"no complete checkpoint in {workdir}")
        if step >= 0 and step not in steps:
            raise ValueError(f"checkpoint {step} not in {workdir} (complete ones: {steps})")
        state, step, ls = policy.restore(
            ckpt, run_cfg, model_config, mesh, None if step < 0 else step
        )
        engine = engines.build_engine(cfg, model, workdir=workdir, pad_id=family.tokenizer.pad_id)
        policy.sync_engine(
            engine,
            cfg,
            state.params,
            mesh=mesh,
            device=policy.model_device(model),
            version=ls.policy_version,
        )
        return evaluate(engine, family, cfg, step=step), step
    finally:
        ckpt.close()
