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
4. **Pack** to the static ``[G, K, T]`` shape (no recompilation, whatever the refills did).
5. **Update**: one jitted call (advantages computed inside from the raw results, then PPO-clip).
6. **Weight sync** to the rollout engine (``policy_version`` + 1; the engine must report that
   version back: ``rollout/weight_version``), with the training-inference mismatch of the step's
   batch (``rollout/logprob_mismatch_k3``, ``rollout/logprob_mismatch_max_abs``).
7. Periodic **held-out evaluation**, **checkpoint** (train state via orbax; loop bookkeeping via
   :class:`~gagar_jax.rl.resume.ResumeStore` after the state is finished writing) and metrics.

Modes (``config.mode``) change only the advantage redistribution inside the update; the grader
runs in every mode so quality and T1 share are measured identically.

Before RL, an SFT warm start on demonstrations (``config.sft``) runs once; its completion is part
of the resumable state.

Overlap note: generation for step t+1 starts after the update of step t (on-policy, as the
paper's synchronous setting); the grading/generation overlap is inside a step, across refill
rounds, and grading of the last round is the only exposed wait.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np

from gagar_jax.data.audit import PassRateTracker
from gagar_jax.rl import writers
from gagar_jax.rl.collect import Group, Rollout, collect_blocks, pack_groups, select_prompts
from gagar_jax.rl.config import MeshConfig, RunConfig
from gagar_jax.rl.multihost import Hosts, check_process_rows, prompt_seed
from gagar_jax.rl.resume import LoopState, ResumeStore, TaskStream


class ResumeMismatchError(RuntimeError):
    """The workdir holds a run with a different configuration."""


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
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                               heartbeat_timeout_seconds=int(mesh_cfg.heartbeat_timeout_s))


def enable_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in ``directory`` (every program, however fast)."""
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# ------------------------------------------------------------------------------------------
# Rollouts
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StepCounters:
    """Host-side tallies over every rollout drawn in one step (all refill rounds)."""

    rollouts: int = 0
    valid: int = 0
    passed: int = 0
    cheats: int = 0
    infra_errors: int = 0
    length_sum: int = 0
    truncated: int = 0
    quality_sum: float = 0.0
    quality_n: int = 0
    gen_time: float = 0.0
    verify_time: float = 0.0
    turns_sum: int = 0
    tool_calls_sum: int = 0
    model_tokens_sum: int = 0
    # policy version -> [rollouts, infra errors]: infra_error is masked, so a policy that learns
    # to provoke it escapes its negative reward; the rate per version shows such a trend.
    by_version: dict = dataclasses.field(default_factory=dict)

    def add(self, group: Group) -> None:
        for r in group.rollouts:
            self.rollouts += 1
            tally = self.by_version.setdefault(int(r.policy_version), [0, 0])
            tally[0] += 1
            tally[1] += bool(r.infra_error)
            self.length_sum += len(r.response_tokens)
            self.turns_sum += r.num_turns
            self.tool_calls_sum += r.num_tool_calls
            self.model_tokens_sum += (len(r.response_tokens) if r.response_mask is None
                                      else int(sum(r.response_mask)))
            self.truncated += r.finish_reason == "length"
            if r.infra_error:
                self.infra_errors += 1
                continue
            self.valid += 1
            self.cheats += bool(r.cheat)
            if r.passed and not r.cheat:
                self.passed += 1
                if r.quality is not None:
                    self.quality_sum += r.quality
                    self.quality_n += 1

    @classmethod
    def merged(cls, parts: list[dict[str, Any]]) -> StepCounters:
        """The counters of all hosts (``dataclasses.asdict`` of each): sums; times: the slowest."""
        out = cls()
        for f in dataclasses.fields(cls):
            values = [p[f.name] for p in parts]
            if isinstance(getattr(out, f.name), dict):  # by_version: key -> [counts], summed
                merged: dict = {}
                for v in values:  # (JSON turned the int keys into strings)
                    for key, counts in v.items():
                        acc = merged.setdefault(int(key), [0] * len(counts))
                        merged[int(key)] = [a + b for a, b in zip(acc, counts)]
                setattr(out, f.name, merged)
            else:
                setattr(out, f.name, max(values) if f.name.endswith("_time") else
                        type(getattr(out, f.name))(sum(values)))
        return out

    def metrics(self) -> dict[str, float]:
        v = max(self.valid, 1)
        return {
            "pass_rate": self.passed / v,
            "cheat_rate": self.cheats / v,
            "infra_errors": float(self.infra_errors),
            "infra_error_rate": self.infra_errors / max(self.rollouts, 1),
            "response_length": self.length_sum / max(self.rollouts, 1),
            "truncated_frac": self.truncated / max(self.rollouts, 1),
            "quality": self.quality_sum / self.quality_n if self.quality_n else math.nan,
            "gen_time_s": self.gen_time,
            "verify_time_s": self.verify_time,
            # per rollout (single-turn: 1 turn, 0 tool calls, every response token the model's)
            "episode/turns_mean": self.turns_sum / max(self.rollouts, 1),
            "episode/tool_calls_mean": self.tool_calls_sum / max(self.rollouts, 1),
            "episode/model_tokens_mean": self.model_tokens_sum / max(self.rollouts, 1),
        }


def family_settings(cfg: RunConfig):
    """The task family's plain settings from the run config."""
    from gagar_jax.envs.family import FamilySettings

    t = cfg.task
    return FamilySettings(
        seed=t.seed, difficulty=t.difficulty, num_train=t.num_train, num_eval=t.num_eval,
        max_prompt_len=cfg.rollout.max_prompt_len, data_path=t.data_path,
        eval_data_path=t.eval_data_path,
        tokenizer_path=t.tokenizer_path or cfg.model.hf_checkpoint, max_turns=t.max_turns,
        max_observation_tokens=t.max_observation_tokens,
        extra={"demo_kinds": t.demo_kinds} if t.demo_kinds else {})


def build_family(cfg: RunConfig):
    """The configured task family (``gagar_jax.envs.family.make_family``)."""
    from gagar_jax.envs.family import make_family

    return make_family(cfg.task.family, family_settings(cfg))


def _quality_score(quality) -> float | None:
    """Mean of the outcome's per-dimension quality scores (None when it reported none)."""
    vals = [float(v) for v in quality.values()]
    return sum(vals) / len(vals) if vals else None


_EPISODE_FINISH = {"submitted": "stop", "max_turns": "length", "max_tokens": "length",
                   "abort": "abort"}


def _rollout(family, task, prompt: list[int], attempt, *, response_tokens, logprobs,
             finish_reason, policy_version, response_mask=None, num_turns=1,
             num_tool_calls=0) -> Rollout:
    """Verifies one attempt (a verifier crash is an infra error: masked, never a failure)."""
    try:
        out = family.verify(task, attempt)
    except Exception as e:  # noqa: BLE001 - a family bug must be masked, never scored
        from gagar_jax.envs.family import Outcome

        out = Outcome(passed=False, infra_error=True,
                      test_log=f"infra error: verifier raised {type(e).__name__}: {e}")
    return Rollout(
        prompt_tokens=list(prompt), response_tokens=list(response_tokens),
        logprobs=[float(x) for x in logprobs], finish_reason=finish_reason,
        policy_version=int(policy_version), patch=out.patch, passed=bool(out.passed),
        infra_error=bool(out.infra_error), cheat=bool(out.cheat),
        quality=_quality_score(out.quality) if out.passed else None, test_log=out.test_log,
        monitor_flags=list(out.flags), quality_dims=dict(out.quality) if out.passed else {},
        verification=out.detail, response_mask=response_mask, num_turns=num_turns,
        num_tool_calls=num_tool_calls, attempt=attempt, outcome=out)


def _sample_rollouts(engine, family, prompts, params, prompt_seeds=None):
    """Single-turn: one engine call, ``params.n`` samples per prompt (``prompt_seeds``: one
    engine seed per prompt, see :func:`generate_groups`)."""
    from gagar_jax.envs.family import Attempt

    seeds = {} if prompt_seeds is None else {"prompt_seeds": list(prompt_seeds)}
    outputs = engine.generate(prompts, params, **seeds)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"engine returned {len(outputs)} prompt results for {len(prompts)}")
    tok = family.tokenizer
    per_task = []
    for samples in outputs:
        if len(samples) != params.n:
            raise RuntimeError(f"engine returned {len(samples)} samples for n={params.n}")
        per_task.append([
            (Attempt(response_tokens=list(s.tokens), text=tok.decode(s.tokens)),
             dict(response_tokens=s.tokens, logprobs=s.logprobs, finish_reason=s.finish_reason,
                  policy_version=s.policy_version))
            for s in samples])
    return per_task


def _episode_rollouts(engine, family, tasks, prompts, params, cfg: RunConfig,
                      prompt_seeds=None):
    """Multi-turn: ``params.n`` episodes per prompt through ``run_episodes`` (one batched engine
    call per turn); model tokens are appended as generated, never re-tokenised. With
    ``prompt_seeds``, episode ``k`` of prompt ``i`` is seeded by ``(prompt_seeds[i], k)``
    alone (each of its turns by that and the turn), so it does not depend on the host."""
    from gagar_jax.envs.family import Attempt
    from gagar_jax.rollout import run_episodes

    K = params.n
    envs = [family.make_env(t) for t in tasks for _ in range(K)]
    flat_prompts = [p for p in prompts for _ in range(K)]
    turn_tokens = cfg.rollout.max_turn_tokens or cfg.rollout.max_new_tokens
    turn_params = dataclasses.replace(params, n=1, max_tokens=turn_tokens)
    episodes = run_episodes(
        engine, family.tokenizer, envs, flat_prompts, turn_params,
        max_turns=cfg.task.max_turns,
        max_total_tokens=[len(p) + cfg.rollout.max_new_tokens for p in flat_prompts],
        max_observation_tokens=cfg.task.max_observation_tokens,
        observation_tokens=family.observation_tokens,
        episode_seeds=None if prompt_seeds is None else
        [prompt_seed((s,), k) for s in prompt_seeds for k in range(K)])
    per_task = []
    for i in range(len(tasks)):
        row = []
        for k in range(K):
            ep, env = episodes[i * K + k], envs[i * K + k]
            P = ep.prompt_len
            row.append((
                Attempt(response_tokens=ep.tokens[P:], episode=ep, env=env),
                dict(response_tokens=ep.tokens[P:], logprobs=ep.logprobs[P:],
                     response_mask=ep.response_mask[P:],
                     finish_reason=_EPISODE_FINISH.get(ep.finish_reason, "length"),
                     policy_version=min(ep.policy_versions, default=0),
                     num_turns=len(ep.turns),
                     num_tool_calls=sum(t.info.get("tool") is not None for t in ep.turns))))
        per_task.append(row)
    return per_task


def generate_groups(engine, family, tasks, *, cfg: RunConfig, step: int, round_id: int,
                    num_rollouts: int, temperature: float, id_prefix: str,
                    counters: StepCounters | None = None,
                    rng_words: tuple[int, ...] = (), prompt_seeds: list[int] | None = None,
                    first_index: int = 0) -> list[Group]:
    """K rollouts for each task (samples, or episodes of a multi-turn family), verified; one
    :class:`Group` per task.

    ``prompt_seeds`` (one per task) seed each prompt's samples by themselves (the engine's
    ``prompt_seeds``), so they do not depend on which other prompts share the call or host;
    otherwise one seed from ``(rng_words, step, round_id)`` seeds the call. ``first_index``:
    the index of ``tasks[0]`` within its round (group ids stay global on every host).

    Raises:
      RuntimeError: the engine failed (dead server after its retries); the message names the
        step and the engine so a dead server is a clear error, not a hang.
    """
    from gagar_jax.rollout import SamplingParams

    if not tasks:
        return []
    prompts = [family.prompt_tokens(t) for t in tasks]
    params = SamplingParams(
        n=num_rollouts, temperature=temperature, top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=tuple(family.stop_token_ids),
        # the sampler seed is a function of (run key, step, round): a resumed step redraws
        # exactly what the uninterrupted run drew
        seed=int(np.random.default_rng([*(rng_words or (cfg.seed,)), step, round_id])
                 .integers(2**31)))
    t0 = time.monotonic()
    try:
        if family.multi_turn:
            per_task = _episode_rollouts(engine, family, tasks, prompts, params, cfg,
                                         prompt_seeds)
        else:
            per_task = _sample_rollouts(engine, family, prompts, params, prompt_seeds)
    except Exception as e:
        raise RuntimeError(f"rollout engine {cfg.rollout.engine!r} failed at step {step} "
                           f"(round {round_id}): {type(e).__name__}: {e}") from e
    t1 = time.monotonic()
    groups = []
    for i, (task, prompt, row) in enumerate(zip(tasks, prompts, per_task)):
        rollouts = [_rollout(family, task, prompt, attempt, **fields) for attempt, fields in row]
        groups.append(Group(
            group_id=f"{id_prefix}-r{round_id}-{first_index + i}-{family.task_id(task)}",
                            task=task, rollouts=rollouts))
    if counters is not None:
        counters.gen_time += t1 - t0
        counters.verify_time += time.monotonic() - t1
        for g in groups:
            counters.add(g)
    return groups


def rollout_metrics(groups: list[Group], update_m: dict[str, float],
                    weight_version: int) -> dict[str, float]:
    """``rollout/weight_version`` (what the engine reports after this step's sync) and the
    training-inference mismatch on this step's batch: the trainer's log-probs of the engine's
    own tokens (recomputed by the update at its first optimizer step, before the parameters
    move, at the sampling temperature) against the engine's behaviour log-probs, as the k3 KL
    estimate and the largest absolute difference. ~0 for the embedded sampler (same program);
    small but non-zero for SGLang (other kernels)."""
    versions = [r.policy_version for g in groups for r in g.rollouts if not r.infra_error]
    return {
        "rollout/weight_version": float(weight_version),
        "rollout/sample_version_min": float(min(versions)) if versions else math.nan,
        "rollout/logprob_mismatch_k3": update_m.get("approx_kl_first", math.nan),
        "rollout/logprob_mismatch_max_abs": update_m.get("logprob_max_abs_diff_first",
                                                         math.nan),
    }


def group_workspace(family, group: Group):
    """The grading workspace of one group, built by its family."""
    from gagar_jax.envs.family import Attempt, GroupMember, Outcome

    members = [GroupMember(f"{group.group_id}/{k}", r.attempt or Attempt(),
                           r.outcome or Outcome(passed=r.passed, infra_error=r.infra_error))
               for k, r in enumerate(group.rollouts)]
    return family.workspace(group.group_id, group.task, members)


def attach_verdicts(groups: list[Group], results: list[Any], K: int, *,
                    token_spans=None) -> dict[str, float]:
    """Copies the grading pool's results into the groups; returns grading metrics.

    With ``token_spans(task, response_tokens) -> TokenSpans`` (the task pool's), each rollout
    of a graded group also gets the mask of its response tokens that its judgement's evidence
    cites (``Group.evidence``; token-level credit and its metrics read it).

    ``results[i]`` is the ``GradeResult`` of ``groups[i]``: a verdict (tier/rank per passing
    candidate) or ``None`` with a ``fallback_reason``. Metrics: :func:`grading_metrics`.
    """
    from gagar_jax.grading import to_arrays

    tier, rank, graded, cheat = (np.asarray(a) for a in to_arrays(results, K))
    for gi, (g, res) in enumerate(zip(groups, results)):
        g.graded = bool(graded[gi])
        g.tier = [int(x) for x in tier[gi][:len(g.rollouts)]]
        g.rank = [int(x) for x in rank[gi][:len(g.rollouts)]]
        g.grader_cheat = [bool(x) for x in cheat[gi][:len(g.rollouts)]]
        g.fallback_reason = getattr(res, "fallback_reason", None)
        verdict = getattr(res, "verdict", None)
        if token_spans is not None and g.graded and verdict is not None:
            g.evidence = _evidence_masks(g, res, verdict, token_spans)
    return grading_metrics([verdict_summary(g) for g in groups])


def verdict_summary(g: Group) -> dict[str, Any]:
    """What the other hosts need of a graded group (JSON): outcomes and verdict per slot."""
    reason = None if g.graded else str(getattr(g.fallback_reason, "value", g.fallback_reason)
                                       or "unknown")
    return {"graded": bool(g.graded), "reason": reason,
            "passed": [bool(r.passed) for r in g.rollouts],
            "infra": [bool(r.infra_error) for r in g.rollouts],
            "cheat": [bool(r.cheat) for r in g.rollouts],
            "tier": list(g.tier or [1] * len(g.rollouts)),
            "rank": list(g.rank or [1] * len(g.rollouts)),
            "grader_cheat": list(g.grader_cheat or [False] * len(g.rollouts))}


def grading_metrics(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """Grading metrics over groups (:func:`verdict_summary` of each, from every host).

    T1 share is over the test-passing rollouts of graded groups (a cheat passes the tests and
    is graded T3).
    """
    t1 = n_pass_graded = fallbacks = rank1 = n_clean = 0
    reasons: dict[str, int] = {}
    for g in summaries:
        if not g["graded"]:
            fallbacks += 1
            reasons[g["reason"]] = reasons.get(g["reason"], 0) + 1
            continue
        for k, passed in enumerate(g["passed"]):
            if passed and not g["infra"][k]:  # test-passing, cheats included (graded T3)
                n_pass_graded += 1
                t1 += g["tier"][k] == 1 and not g["grader_cheat"][k]
                if not (g["cheat"][k] or g["grader_cheat"][k]):
                    n_clean += 1
                    rank1 += g["rank"][k] == 1
    out = {
        "t1_share": t1 / n_pass_graded if n_pass_graded else math.nan,
        # passing non-cheats ranked best in their group: rises as the policy converges on the
        # grader's preferred (minimal, in-scope, consistent) solutions
        "rank1_share": rank1 / n_clean if n_clean else math.nan,
        "grading_fallbacks": float(fallbacks),
        "grading_graded_frac": (len(summaries) - fallbacks) / max(len(summaries), 1),
        "grader_cheats": float(sum(sum(g["grader_cheat"]) for g in summaries)),
    }
    for reason, n in reasons.items():
        out[f"grading_fallback_{reason}"] = float(n)
    return out


def _evidence_masks(g: Group, res: Any, verdict: Any, token_spans) -> list[Any]:
    """Per rollout slot, the response-token mask its judgement's evidence cites."""
    from gagar_jax.grading import evidence_tokens

    ids = list(getattr(res, "candidate_ids", ()))
    spans = {}
    for cid, r in zip(ids, g.rollouts):
        s = token_spans(g.task, r.attempt) if r.attempt is not None else None
        if s is not None:
            spans[cid] = s
    masks = evidence_tokens.verdict_token_masks(verdict, spans)
    return [masks.get(cid) for cid in ids[:len(g.rollouts)]] + [None] * (len(g.rollouts)
                                                                       - len(ids))


def evaluate(engine, family, cfg: RunConfig, *, step: int,
             hosts: Hosts | None = None) -> dict[str, float]:
    """Held-out tasks: pass rate, quality of passing patches, cheat rate, response length (and
    turns / tool calls per episode for multi-turn families).

    Several hosts split the tasks (contiguous shares, each task seeded by its index) and
    reduce their counters, so every host returns the figures of all of them.
    """
    tasks = family.eval_tasks()
    if not tasks:
        return {}
    hosts = hosts or Hosts(cfg.mesh.host_timeout_s)
    lo = len(tasks) * hosts.index // hosts.count
    hi = len(tasks) * (hosts.index + 1) // hosts.count
    counters = StepCounters()
    generate_groups(engine, family, tasks[lo:hi], cfg=cfg, step=step, round_id=10_000,
                    num_rollouts=max(cfg.loop.eval_rollouts, 1),
                    temperature=cfg.loop.eval_temperature, id_prefix=f"eval{step}",
                    counters=counters, first_index=lo,
                    prompt_seeds=[prompt_seed((cfg.seed,), 2, step, i) for i in range(lo, hi)])
    counters = StepCounters.merged(hosts.allgather(f"eval{step}/counters",
                                                   dataclasses.asdict(counters)))
    m = counters.metrics()
    out = {"eval_pass_rate": m["pass_rate"], "eval_quality": m["quality"],
           "eval_cheat_rate": m["cheat_rate"], "eval_response_length": m["response_length"]}
    if family.multi_turn:
        out.update({"eval_turns_mean": m["episode/turns_mean"],
                    "eval_tool_calls_mean": m["episode/tool_calls_mean"]})
    return out


def collect_step(engine, family, grading_pool, stream: TaskStream, ls: LoopState, cfg: RunConfig,
                 *, step: int, hosts: Hosts | None = None, tracker: PassRateTracker | None = None):
    """Steps 1-3 of the module docstring for one RL step, for this host's block of groups.

    Advances ``ls.data_position`` by every prompt drawn (by all hosts). With ``tracker``
    (``task.skip_saturated``), prompt selection passes over tasks the tracker finds saturated
    (:func:`~gagar_jax.rl.collect.select_prompts`; ``sres.skipped_saturated`` counts them)
    and, after the step, the tracker records every drawn group's valid rollouts of every host
    (exchanged with the verdicts, recorded in host order), so it stays identical on all hosts.
    Returns
    ``(SamplingResult, StepCounters, grading metrics, time the grading wait started, batch)``:
    the counters and metrics are over all hosts, the :class:`PackedBatch` holds this host's
    ``[G / P, K, T]`` rows and the global ``[G, K]`` group fields (see
    :mod:`gagar_jax.rl.multihost`).
    """
    hosts = hosts or Hosts(cfg.mesh.host_timeout_s)
    G, K = cfg.rollout.num_prompts, cfg.rollout.num_rollouts
    counters = StepCounters()
    submitted: list[str] = []
    rounds = [0]
    skipped = [0]
    attempts: list[tuple[int, list[bool]]] = []  # (task index, valid rollouts passed) of ours
    skip = None if tracker is None else (lambda i: tracker.skip(str(i)))

    def draw(n):
        idx, pos, ls.data_position, n_skip = select_prompts(stream, ls.data_position, sum(n),
                                                            skip)
        skipped[0] += n_skip  # every host selects the same prompts: a global count
        rounds[0] += 1
        lo = sum(n[:hosts.index])
        hi = lo + n[hosts.index]
        # a prompt's samples are seeded by its global data position: the same on any host
        groups = generate_groups(engine, family, [family.train_task(i) for i in idx[lo:hi]],
                                 cfg=cfg,
                                 step=step, round_id=rounds[0], num_rollouts=K,
                                 temperature=cfg.rollout.temperature, id_prefix=f"s{step}",
                                 counters=counters, first_index=lo,
                                 prompt_seeds=[prompt_seed(ls.rng_key, 1, p)
                                               for p in pos[lo:hi]])
        if tracker is not None:
            attempts.extend((int(i), [r.reward > 0 for r in g.rollouts if not r.infra_error])
                            for i, g in zip(idx[lo:hi], groups))
        return groups

    def exchange(round_id, tally):
        return hosts.allgather(f"s{step}/r{round_id}/tally", tally)

    def submit(group):
        grading_pool.submit(group_workspace(family, group))
        submitted.append(group.group_id)

    sres = collect_blocks(draw, exchange, target=G, num_blocks=hosts.count, block=hosts.index,
                          enabled=cfg.sampling.enabled, oversample=cfg.sampling.oversample,
                          max_rounds=cfg.sampling.max_rounds,
                          allow_partial=cfg.sampling.allow_partial,
                          on_keep=submit if cfg.grading.enabled else None)
    t_wait = time.monotonic()
    if cfg.grading.enabled and sres.groups:
        results = grading_pool.results(submitted, timeout=cfg.grading.deadline_s)
        attach_verdicts(sres.groups, results, K, token_spans=family.token_spans)
    # step 4 for this block: its rows of the static [G, K, T] batch
    local = pack_groups(sres.groups, num_groups=G // hosts.count, num_rollouts=K,
                        max_prompt_len=cfg.rollout.max_prompt_len,
                        max_new_tokens=cfg.rollout.max_new_tokens, pad_id=family.tokenizer.pad_id)
    # verdicts (and fallbacks) and the [G, K] group fields of every host's block, so all hosts
    # build the same replicated arrays and metrics
    parts = hosts.allgather(f"s{step}/verdicts", {
        "groups": [verdict_summary(g) for g in sres.groups],
        "counters": dataclasses.asdict(counters),
        "fields": {f: getattr(local, f).tolist() for f in GROUP_FIELDS},
        "attempts": attempts})
    if tracker is not None:
        for part in parts:
            for i, passed in part["attempts"]:
                tracker.record(str(i), [bool(x) for x in passed])
    sres.skipped_saturated = skipped[0]
    summaries = [g for part in parts for g in part["groups"]]
    grading_m = grading_metrics(summaries) if cfg.grading.enabled and summaries else {}
    counters = StepCounters.merged([part["counters"] for part in parts])
    batch = local._replace(**{
        f: np.concatenate([np.asarray(part["fields"][f], getattr(local, f).dtype)
                           for part in parts]) for f in GROUP_FIELDS})
    return sres, counters, grading_m, t_wait, batch


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
    return {"sampling_skipped_saturated": float(getattr(sres, "skipped_saturated", 0)),
            "sampling_saturated_tasks": float(len(tracker.saturated()))}


# The [G, K] (and [G]) fields of a PackedBatch: global on every host (the rest are its rows).
GROUP_FIELDS = ("rewards", "passed", "cheat", "tier", "rank", "graded", "valid")


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------
def _update_metric_aliases(m: dict[str, float]) -> dict[str, float]:
    """Canonical names for the plot panels from the update's metric names."""
    aliases = {
        "entropy": ("entropy", "policy_entropy"),
        "pg_loss_mean": ("pg_loss_mean", "pg_loss", "policy_loss"),
        "credit_ratio": ("credit_ratio", "credit/ratio", "credit_balance_ratio"),
    }
    out = dict(m)
    for canon, names in aliases.items():
        if canon in out:
            continue
        for n in names:
            if n in m:
                out[canon] = m[n]
                break
    return out


def train_and_evaluate(cfg: RunConfig, workdir: str, *, grader: Any = None) -> dict[str, Any]:
    """Runs (or resumes) the configured job in ``workdir``; returns the final summary.

    Args:
      cfg: the validated run configuration.
      workdir: checkpoints, metrics, plots; an existing run there is resumed.
      grader: optional grader object (``grade(workspace[, cancel])``) used instead of the one
        ``cfg.grading.grader`` names, e.g. a custom grader from a notebook.
    """
    from gagar_jax.rl import backends

    workdir = os.path.abspath(workdir)
    hosts = Hosts(cfg.mesh.host_timeout_s)
    primary = hosts.primary
    G, K = cfg.rollout.num_prompts, cfg.rollout.num_rollouts
    if G % hosts.count:
        raise ValueError(f"config.rollout.num_prompts={G} must be a multiple of the "
                         f"{hosts.count} processes (each host fills an equal block of groups)")
    family = build_family(cfg)
    tok = family.tokenizer
    stream = TaskStream(family.num_train, seed=cfg.seed)
    store = ResumeStore(os.path.join(workdir, "loop_state"))

    policy = backends.build_policy(cfg, vocab_size=tok.vocab_size, workdir=workdir)
    check_process_rows(policy.mesh, G * K)
    resume_step = store.latest_consistent(policy.checkpoint_steps())
    if resume_step is not None:
        ls = store.load(resume_step)
        if ls.fingerprint != cfg.fingerprint():
            raise ResumeMismatchError(
                f"{workdir} holds a run with config fingerprint {ls.fingerprint}, this config is "
                f"{cfg.fingerprint()}: use another --workdir or the original config")
        policy.restore(resume_step)
    else:
        key = jax.random.key_data(jax.random.key(cfg.seed))
        ls = LoopState(rng_key=[int(x) for x in np.asarray(key).ravel()],
                       fingerprint=cfg.fingerprint())
    tracker = pass_rate_tracker(cfg, ls)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if primary:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
            import json

            json.dump(cfg.to_dict(), f, indent=1, sort_keys=True, default=str)
        dropped = writers.truncate_jsonl(metrics_path, keep_before_step=ls.step,
                                            drop_phases=None if ls.sft_done else ("sft",))
    writer = writers.MetricsWriter(workdir, total_steps=cfg.loop.total_steps,
                                      start_step=ls.step, primary=primary)
    if resume_step is not None:
        writer.log(f"resumed from checkpoint {resume_step}: step {ls.step}, data position "
                   f"{ls.data_position}, policy version {ls.policy_version}"
                   + (f" ({dropped} stale metric rows dropped)" if primary and dropped else ""))

    # Engine and grader first: a dead server fails here, before any compute is spent.
    engine = backends.build_engine(cfg, policy, workdir=workdir, pad_id=tok.pad_id,
                                   hosts=hosts)
    # one grading pool per host, for its own groups; each keeps its own verdict cache
    cache_path = os.path.join(workdir, "grader_cache.jsonl" if primary else
                              f"grader_cache.p{hosts.index}.jsonl")
    grading_pool = backends.build_grading_pool(cfg, cache_path=cache_path, grader=grader,
                                               check_runner=family.check_runner())

    summary: dict[str, Any] = {}
    try:
        # ---- SFT warm start -----------------------------------------------------------------
        if not ls.sft_done:
            if cfg.sft.steps > 0:
                t0 = time.monotonic()
                # too long for the static response budget: skipped, never truncated
                demos = [d for d in family.demonstrations(cfg.task.num_train)
                         if d.response_len <= cfg.rollout.max_new_tokens]
                writer.log(f"SFT warm start: {cfg.sft.steps} steps on {len(demos)} "
                           "demonstrations")
                policy.run_sft(demos, pad_id=tok.pad_id,
                               log_fn=lambda s, m: writer.write(s, m, phase="sft"))
                writer.log(f"SFT done in {time.monotonic() - t0:.1f}s")
            ls.sft_done = True
            hosts.barrier("ckpt0")
            with hosts.collective("the checkpoint after SFT"):
                policy.save(0)
            if primary:
                store.save(0, ls, keep=cfg.loop.keep_checkpoints + 1)

        with hosts.collective("the first weight sync"):
            weight_version = engine.sync_weights(policy.params_for_sync(), ls.policy_version)
        if ls.step == 0 and cfg.loop.total_steps > 0 and family.eval_tasks():
            m = evaluate(engine, family, cfg, step=0, hosts=hosts)
            writer.write(0, m, phase="eval")
            writer.log("eval before RL: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
        writer.start_clock(ls.step)
        for step in range(ls.step, cfg.loop.total_steps):
            t_step = time.monotonic()
            sres, counters, grading_m, t_wait, batch = collect_step(
                engine, family, grading_pool, stream, ls, cfg, step=step, hosts=hosts,
                tracker=tracker)
            t_update = time.monotonic()
            with hosts.collective(f"the update of step {step}"):
                update_m = policy.update(batch, step=step)
                ls.policy_version += 1
                weight_version = engine.sync_weights(policy.params_for_sync(),
                                                     ls.policy_version)
            if weight_version != ls.policy_version:
                raise RuntimeError(f"rollout engine reports weight version {weight_version} "
                                   f"after syncing version {ls.policy_version} (step {step})")
            ls.step = step + 1
            t_end = time.monotonic()

            m = counters.metrics()
            m.update(sres.metrics(G))
            m.update(grading_m)
            if tracker is not None:
                m.update(saturation_metrics(sres, tracker))
            for k, v in _update_metric_aliases(update_m).items():
                # the update's figures cover the kept batch; ours all drawn rollouts
                m[f"update/{k}" if k in m else k] = v
            m.update(rollout_metrics(sres.groups, update_m, weight_version))
            m.update(grade_wait_s=t_update - t_wait, update_time_s=t_end - t_update,
                     step_time_s=t_end - t_step, policy_version=float(ls.policy_version),
                     data_position=float(ls.data_position))
            if step % cfg.loop.log_every == 0 or step == cfg.loop.total_steps - 1:
                writer.write(step, m)
                writer.progress(step, m)
            last = step == cfg.loop.total_steps - 1
            if (step + 1) % cfg.loop.eval_every == 0 or last:
                em = evaluate(engine, family, cfg, step=step + 1, hosts=hosts)
                if em:
                    writer.write(step + 1, em, phase="eval")
                    writer.log(f"eval @ step {step + 1}: " +
                               ", ".join(f"{k} {v:.3f}" for k, v in em.items()))
            if (step + 1) % cfg.loop.checkpoint_every == 0 or last:
                ls.grader_cache = {"path": os.path.basename(cache_path),
                                   "entries": len(grading_pool.cache)}
                if tracker is not None:  # the same on every host: the primary's is saved
                    ls.extra[PASS_RATES_KEY] = tracker.state_dict()
                hosts.barrier(f"ckpt{step + 1}")  # a host hung before the save is named here
                with hosts.collective(f"the checkpoint of step {step + 1}"):
                    policy.save(step + 1)
                if primary:  # every process saves the state (collective); one writes metadata
                    store.save(step + 1, ls, keep=cfg.loop.keep_checkpoints + 1)
        summary["update_traces"] = policy.update_traces()
    finally:
        policy.close()
        grading_pool.close()
        writer.close()
    if primary:
        rows = writers.read_jsonl(metrics_path)
        summary.update(writers.summarize(rows))
        if cfg.loop.plot:
            summary["plot"] = writers.plot_run(workdir)
        _print_summary(cfg, workdir, summary)
    return summary


def _print_summary(cfg: RunConfig, workdir: str, summary: dict[str, Any]) -> None:
    lines = [f"== {cfg.name} ({cfg.mode}) finished: {cfg.loop.total_steps} steps in {workdir}"]
    for key, title in writers.PLOT_PANELS:
        a, b = summary.get(f"{key}_first"), summary.get(f"{key}_last")
        if a is None or b is None:
            continue
        lines.append(f"   {title:<42s} {a:10.4f} -> {b:10.4f}")
    if summary.get("update_traces") is not None:
        lines.append(f"   update compiled {summary['update_traces']} time(s) (static batch shape)")
    if "plot" in summary:
        lines.append(f"   plot: {summary['plot']}")
    print("\n".join(lines), flush=True)


def evaluate_checkpoint(workdir: str, *, step: int = -1, samples: int = 4,
                        temperature: float = 0.7) -> tuple[dict[str, float], int]:
    """Restores a run's checkpoint (newest complete one for ``step=-1``) and evaluates it."""
    import json

    from gagar_jax.rl import backends

    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} a run directory?")
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    d["loop"].update(eval_rollouts=samples, eval_temperature=temperature)
    cfg = RunConfig.from_config_dict(d)
    family = build_family(cfg)
    policy = backends.build_policy(cfg, vocab_size=family.tokenizer.vocab_size, workdir=workdir)
    store = ResumeStore(os.path.join(workdir, "loop_state"))
    steps = sorted(set(store.steps()) & set(policy.checkpoint_steps()))
    if not steps:
        raise FileNotFoundError(f"no complete checkpoint in {workdir}")
    if step < 0:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"checkpoint {step} not in {workdir} (complete ones: {steps})")
    policy.restore(step)
    try:
        engine = backends.build_engine(cfg, policy, workdir=workdir,
                                       pad_id=family.tokenizer.pad_id)
        engine.sync_weights(policy.params_for_sync(), store.load(step).policy_version)
        return evaluate(engine, family, cfg, step=step), step
    finally:
        policy.close()
