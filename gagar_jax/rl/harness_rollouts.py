"""Harness episodes as the rollouts of a training step (``rollout.harness`` other than
``"native"``).

Each rollout of a group is one episode of an agent harness (``gagar_jax.envs.harness``): the
harness runs inside the sandbox and talks to the run's own engine through one in-process
gateway per engine (:func:`harness_runner`; the embedded sampler behind ``BatchingBackend``,
SGLang behind ``DirectBackend``: the same code path), with the update's sampling temperature
forced on every call so behaviour and training log-probs are of one distribution. The episode's
final diff goes through the standard verifier (``verify_harness_episode``); the behaviour
monitor reads the commands and outputs from the gateway's record; the graders get the
trajectory summary and the diff (:class:`HarnessAttempt`); the verification runs on the execution
back-end like a native group's (a Ray cluster's nodes with ``execution.backend=ray``, the
group admitted with its verifier slots and grader slot). An episode without a diff fails; a
harness that crashes, hangs or loops fails with the reason; an engine or sandbox failure is
``infra_error`` (masked, counted).

**Rows of the update batch.** The update's batch is one row per rollout (``[G, K, T]``). An
episode's linked calls are one segment (``gagar_jax.rollout.segments``): its first segment is
the rollout's row, the first call's prompt its prompt and everything after it (completions
with response mask 1 and their recorded log-probs, tool results between with mask 0) its
response: the layout of a native multi-turn episode, so the advantage kernels, dynamic
sampling, staleness and the update take it unchanged, and the update scores every recorded
call's completion against its own prompt, as the engine sampled it.

An episode whose history was edited (a compaction, a sub-agent, a template that drops old
reasoning) has several segments. They cannot share one causal row (a later segment would
attend to the earlier one's tokens, which its calls never saw, and the model has no
block-diagonal mask), so each later segment is an extra row of the batch carrying its
episode's index (``UpdateBatch.row_episode``, ``rollout.harness_max_segments`` rows per
rollout, ``pack_groups``). The advantage kernels still see ``[G, K]``: one reward per
episode, group statistics per episode, not per row; each row then takes its episode's
advantage (``segment_advantages``' broadcast), so with the token-mean loss the episode's
credit is ``A_e |M_e|`` whatever its number of segments (its segments' model tokens partition
its model tokens). This was chosen over a new batch layout because it changes only how the
update broadcasts advantages to rows (one gather) and leaves every kernel, the dynamic
sampling and the staleness accounting as they are. Segments beyond
``rollout.harness_max_segments`` are counted (``episode/untrained_segments``), never trained
with a wrong context. With token-level credit (``learner.token_credit``) the update
redistributes each episode's advantage over the tokens of all its rows at once
(``redistribute_segment_tokens``, see ``gagar_jax.update.step``), so its credit is conserved
across its segments and each token gets the weight it would get were the episode one row.
``episode/segments``, ``episode/calls`` and
``episode/tokens`` (means over the step's harness episodes) are logged by ``StepCounters``.

**Records.** With a record directory (the training loop gives ``RUN_DIR/episodes``, see
:func:`harness_runner`) the gateway writes every finished episode there as one JSON file (per
call: the prompt ids, completion ids, behaviour log-probs, policy version, the messages in and
the answer out with its tool calls; the harness's tool results are the next call's messages), so
``python -m gagar_jax.data.trajectories export RUN_DIR --format atif`` exports a run's episodes,
and a gateway started again on the same directory (a resumed run) keeps them: an episode drawn
again gets a new id (``-r<n>``), never a finished one's.

The gateway's context limit is the row (``rollout.max_prompt_len + rollout.max_new_tokens``),
so every segment fits one; a first segment whose prompt is longer than ``max_prompt_len``
carries the prompt's tail in the response with mask 0, and one whose response part would pass
``max_new_tokens`` is cut there (its kept tokens stay exact) and finishes with ``"length"``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import functools
import itertools
import os
import tempfile
import weakref
from typing import Any

from gagar_jax.envs.family import Attempt, Outcome
from gagar_jax.envs.harness import (
    HarnessConfig,
    HarnessEpisode,
    HarnessRunner,
    verify_harness_episode,
)
from gagar_jax.rl.config import RunConfig
from gagar_jax.rollout.gateway import (
    BatchingBackend,
    DirectBackend,
    Gateway,
    GatewayConfig,
    GatewayServer,
)
from gagar_jax.rollout.segments import Segment
from gagar_jax.verify import execution


@dataclasses.dataclass
class HarnessAttempt(Attempt):
    """A harness episode as the family's graders see it: the gateway's trajectory (commands
    and their outputs) and the final diff."""

    harness: HarnessEpisode | None = None

    def trajectory(self) -> list[dict[str, Any]]:
        return [] if self.harness is None else self.harness.events()

    def summary(self) -> str:
        if self.harness is None:
            return ""
        lines = [e["summary"] for e in self.harness.trajectory()]
        lines.append(f"harness: {self.harness.finish_reason}")
        return "\n".join(lines)


_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# draws of this process: a step drawn again (a resumed run, an evaluation of the same tasks)
# opens new sessions, never a finished one's episode id
_DRAWS = itertools.count()


def _harness_config(cfg: RunConfig) -> HarnessConfig:
    r = cfg.rollout
    return HarnessConfig(
        harness=r.harness,
        command=r.harness_command,
        max_calls=r.harness_max_calls,
        max_completion_tokens=r.max_new_tokens,
        max_wall_s=r.harness_max_wall_s,
        agents_venv=r.harness_agents_venv,
    )


def harness_runner(
    engine, tokenizer, cfg: RunConfig, *, record_dir: str | None = None
) -> HarnessRunner:
    """The harness runner of ``engine`` (built once per engine and kept while it lives): a
    gateway on the engine, served on a Unix socket in a private directory, with the run's
    row budget as its context limit and ``rollout.temperature`` on every call, writing each
    finished episode's record to ``record_dir`` (None: kept in memory). The first call for an
    engine decides its record directory; a later call naming another one is an error."""
    got = _RUNNERS.get(engine)
    if got is not None:
        have = got.gateway.store.record_dir
        if record_dir is not None and (
            have is None or os.path.realpath(have) != os.path.realpath(record_dir)
        ):
            raise ValueError(
                f"harness_runner: this engine's gateway records to {have!r}, not {record_dir!r}"
            )
        return got
    r = cfg.rollout
    backend = BatchingBackend(engine) if r.engine == "embedded" else DirectBackend(engine)
    gw_cfg = GatewayConfig(
        model_name="policy",
        context_limit=r.max_prompt_len + r.max_new_tokens,
        default_max_tokens=r.max_turn_tokens or r.max_new_tokens,
        max_tokens_cap=r.max_turn_tokens or r.max_new_tokens,
        temperature=r.temperature,
    )
    gateway = Gateway(backend, tokenizer, gw_cfg, record_dir=record_dir)
    sock_dir = tempfile.mkdtemp(prefix="gagar_gw_")
    server = GatewayServer(gateway, uds=os.path.join(sock_dir, "gateway.sock")).start()
    atexit.register(server.stop)
    runner = HarnessRunner(gateway, server, _harness_config(cfg))
    _RUNNERS[engine] = runner
    return runner


def _row_fields(ep: HarnessEpisode, fallback_prompt: list[int], cfg: RunConfig) -> tuple[dict, int]:
    """The rollout fields of an episode's row and its untrained segments (see the module
    docstring)."""
    P_max, R_max = cfg.rollout.max_prompt_len, cfg.rollout.max_new_tokens
    segs: list[Segment] = ep.segments
    calls = len(ep.record.get("calls", []))
    if not segs:
        return (
            dict(
                prompt=list(fallback_prompt[:P_max]) or [0],
                response_tokens=[],
                logprobs=[],
                response_mask=[],
                token_versions=[],
                finish_reason="abort" if ep.infra_error else "stop",
                policy_version=0,
                num_turns=0,
                num_tool_calls=0,
            ),
            0,
        )
    extra = [
        {
            "tokens": s.tokens,
            "response_mask": s.response_mask,
            "logprobs": s.logprobs,
            "token_versions": s.token_versions,
        }
        for s in segs[1 : cfg.rollout.harness_max_segments]
    ]
    seg = segs[0]
    P = min(seg.prompt_len, P_max)
    tokens = seg.tokens[: P + R_max]
    finish = "length" if len(seg.tokens) > P + R_max or seg.prompt_len > P_max else "stop"
    mask = [0] * (seg.prompt_len - P) + seg.response_mask[seg.prompt_len :]
    lps = [0.0] * (seg.prompt_len - P) + seg.logprobs[seg.prompt_len :]
    vers = [-1] * (seg.prompt_len - P) + seg.token_versions[seg.prompt_len :]
    R = len(tokens) - P
    versions = [v for v in vers[:R] if v >= 0]
    versions += [v for s in extra for v in s["token_versions"] if v >= 0]
    traj = ep.trajectory()
    return (
        dict(
            prompt=tokens[:P],
            response_tokens=tokens[P:],
            logprobs=lps[:R],
            response_mask=mask[:R],
            token_versions=vers[:R],
            finish_reason=finish,
            policy_version=min(versions, default=0),
            num_turns=calls,
            num_tool_calls=sum(len(e["tool_calls"]) for e in traj),
            extra_segments=extra,
        ),
        len(segs) - 1 - len(extra),
    )


def _verify(task, ep: HarnessEpisode) -> Outcome:
    """``verify_harness_episode``; a verifier that raises is an infrastructure failure
    (masked, never scored)."""
    try:
        return verify_harness_episode(task, ep)
    except Exception as e:  # noqa: BLE001 -- a verifier crash is masked, never scored
        return Outcome(
            passed=False,
            infra_error=True,
            test_log=f"infra error: verifier raised {type(e).__name__}: {e}",
        )


def _fresh_id(runner: HarnessRunner, episode_id: str) -> str:
    """``episode_id``, or ``episode_id-r<n>`` if the gateway knows it already (a record read
    back from an earlier process of the run)."""
    n, got = 0, episode_id
    while runner.gateway.store.known(got):
        n += 1
        got = f"{episode_id}-r{n}"
    return got


def harness_rollouts(
    engine,
    family,
    tasks,
    prompts,
    *,
    cfg: RunConfig,
    num_rollouts: int,
    episode_ids: list[list[str]],
    seeds: list[list[int]],
    group_ids: list[str] | None = None,
    hold_grader: bool = False,
):
    """``num_rollouts`` harness episodes per task, run ``rollout.harness_concurrency`` at a
    time on this host (the gateway is in this process), then verified on the execution
    back-end (``execution.backend``: in this thread, or as Ray calls on the cluster's nodes)
    group by group: per task a list of ``(attempt, outcome, rollout fields)``.
    ``hold_grader``: each group keeps a grader slot under its ``group_ids`` entry
    (``collect.generate_groups``)."""
    runner = harness_runner(engine, family.tokenizer, cfg)
    draw = next(_DRAWS)
    jobs = [(i, k) for i in range(len(tasks)) for k in range(num_rollouts)]

    def one(job):
        i, k = job
        eid = _fresh_id(runner, f"{episode_ids[i][k]}-d{draw}")
        return runner.run(tasks[i], episode_id=eid, seed=seeds[i][k])

    with concurrent.futures.ThreadPoolExecutor(cfg.rollout.harness_concurrency) as pool:
        eps = list(pool.map(one, jobs))
    # Verified as the native groups are (``collect.generate_groups``): each group's K calls on
    # the execution back-end once admitted (on a cluster: its K verifier slots and, with
    # ``hold_grader``, a grader slot held under its group id until released).
    if hold_grader and (group_ids is None or len(group_ids) != len(tasks)):
        raise ValueError("harness_rollouts: hold_grader needs one group id per task")
    verified = execution.current().gather_groups(
        [
            [
                functools.partial(_verify, tasks[i], eps[i * num_rollouts + k])
                for k in range(num_rollouts)
            ]
            for i in range(len(tasks))
        ],
        grader=int(hold_grader),
        keys=list(group_ids) if hold_grader else None,
    )
    done = [(eps[i * num_rollouts + k], verified[i][k]) for i, k in jobs]
    per_task: list[list] = [[] for _ in tasks]
    for (i, _k), (ep, out) in zip(jobs, done):
        fields, untrained = _row_fields(ep, prompts[i], cfg)
        fields["harness_stats"] = {
            "segments": len(ep.segments),
            "calls": len(ep.record.get("calls", [])),
            "tokens": sum(len(s.tokens) for s in ep.segments),
            "untrained_segments": untrained,
        }
        attempt = HarnessAttempt(response_tokens=list(fields["response_tokens"]), harness=ep)
        per_task[i].append((attempt, out, fields))
    return per_task


__all__ = ["HarnessAttempt", "harness_rollouts", "harness_runner"]
