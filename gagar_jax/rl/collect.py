"""Rollouts of a step: generation and verification of groups, dynamic sampling, packing.

:func:`generate_groups` draws K rollouts per task (samples, or episodes of a multi-turn family
through ``rollout.run_episodes``), verifies each with its family and tallies them in
:class:`StepCounters`.

Dynamic sampling (DAPO; the Gagar paper builds on it): a group whose rollouts all pass or all
fail has zero advantage everywhere, contributes no gradient and gives the grader nothing to
compare. Each training step therefore over-samples prompts and keeps drawing until it holds
``num_prompts`` *mixed* groups, with a cap on the rounds and an error that says whether the
data is too easy or too hard when the cap is hit.

Whatever the number of refill rounds, :func:`pack_groups` writes the kept groups and their
grades straight into the update's ``UpdateBatch`` of one static shape: group-major rows
``[N = G * K, T]`` (``G = num_prompts``, ``K = num_rollouts``,
``T = max_prompt_len + max_new_tokens``) and ``[G, K]`` group fields; missing groups and rollouts
are masked with ``valid``, so the jitted update is traced once for the whole run.

Token layout of one rollout row (length ``T``)::

    [p_0 .. p_{P-1}  r_0 .. r_{R-1}  pad ... pad]
     prompt          response        right padding
    response_mask:   0 on the prompt and padding, 1 on response tokens (of a multi-turn
                     episode: 1 on model tokens only, 0 on the observations between turns)
    old_logprobs:    the behaviour log-prob of each response token at its own position
                     (0 on observation tokens)
    positions:       0..P+R-1 then 0 on padding
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# data.swe registers the python_repo family's reader of SWE-bench-format pools (task.repos_dir)
from gagar_jax.data import swe  # noqa: F401
from gagar_jax.envs.family import Attempt, FamilySettings, Outcome, make_family
from gagar_jax.rl.config import RunConfig
from gagar_jax.rl.multihost import prompt_seed
from gagar_jax.rollout import (
    SamplingParams,
    StepResult,
    advance_episodes,
    finish_episodes,
    start_episodes,
)
from gagar_jax.update import UpdateBatch
from gagar_jax.verify import execution


@dataclasses.dataclass
class Rollout:
    """One verified rollout."""

    prompt_tokens: list[int]
    response_tokens: list[int]
    logprobs: list[float]  # behaviour log-prob of each response token
    finish_reason: str = "stop"
    policy_version: int = 0
    patch: str = ""
    passed: bool = False
    infra_error: bool = False  # verifier failed: masked out (valid=False), never scored 0
    cheat: bool = False  # a confirmed monitor flag
    quality: float | None = None  # env's quality score of a passing patch (metrics only)
    quality_dims: dict[str, float] = dataclasses.field(default_factory=dict)  # per dimension
    verification: Any = None  # the verifier's full result (host only; for grading workspaces)
    test_log: str = ""
    monitor_flags: list[Any] = dataclasses.field(default_factory=list)
    # Multi-turn episodes: 1 on model tokens, 0 on observation tokens (None = all model tokens).
    response_mask: list[int] | None = None
    # [R] the policy version that produced each response token (-1 on observation tokens);
    # None: every token is the rollout's policy_version (a single engine call)
    token_versions: list[int] | None = None
    num_turns: int = 1
    num_tool_calls: int = 0
    # mixture-of-experts engines that record routes: [P + R, layers, K] int16 experts of every
    # token, prompt included (-1 where none was recorded); None: not recorded
    routes: Any = None
    attempt: Any = None  # the family's view of the rollout (envs.family.Attempt)
    outcome: Any = None  # its verification (envs.family.Outcome)
    # a harness episode (rl.harness_rollouts): its segments, calls, tokens over its segments
    # and segments its row does not hold; None for native rollouts
    harness_stats: dict | None = None
    # a harness episode's segments after its first (each ``tokens``, ``response_mask``,
    # ``logprobs``: one more row of the batch with the rollout's advantage, ``pack_groups``)
    extra_segments: list[dict] = dataclasses.field(default_factory=list)

    @property
    def reward(self) -> float:
        return 1.0 if (self.passed and not self.cheat) else 0.0

    def versions(self) -> list[int]:
        """[R] the version of each response token (-1 on observation tokens)."""
        if self.token_versions is None:
            return [self.policy_version] * len(self.response_tokens)
        return list(self.token_versions)

    @property
    def oldest_version(self) -> int:
        """The oldest version among its model tokens, its extra segments' too (its staleness
        counts from it)."""
        extra = [v for s in self.extra_segments for v in s.get("token_versions", ())]
        return min((v for v in [*self.versions(), *extra] if v >= 0), default=self.policy_version)


@dataclasses.dataclass
class Group:
    """The K rollouts of one prompt (the grader's verdict on them: ``rl.grade.Grades``)."""

    group_id: str
    task: Any
    rollouts: list[Rollout]
    task_index: int = -1  # the task's index in the family's training pool (-1: not known)

    def valid_mask(self) -> list[bool]:
        return [not r.infra_error for r in self.rollouts]

    @property
    def num_valid(self) -> int:
        return sum(self.valid_mask())

    @property
    def num_passed(self) -> int:
        return sum(1 for r in self.rollouts if not r.infra_error and r.reward > 0)

    @property
    def is_mixed(self) -> bool:
        """Some valid rollouts pass and some fail (nonzero advantages)."""
        return 0 < self.num_passed < self.num_valid

    @property
    def outcome(self) -> str:
        """'mixed' | 'all_pass' | 'all_fail' | 'empty' (every rollout an infra error)."""
        if self.num_valid == 0:
            return "empty"
        if self.num_passed == self.num_valid:
            return "all_pass"
        if self.num_passed == 0:
            return "all_fail"
        return "mixed"


class DynamicSamplingError(RuntimeError):
    """The cap on refill rounds was reached without enough mixed groups."""


@dataclasses.dataclass
class SamplingResult:
    groups: list[Group]  # the kept groups (at most target)
    rounds: int
    drawn: int  # groups generated in all rounds
    counts: dict[str, int]  # outcome -> groups drawn with that outcome
    discarded_mixed: int  # mixed groups beyond the target (thrown away)
    rollouts_drawn: int
    num_kept: int | None = None  # kept groups over all hosts (None: len(groups), one host)
    skipped_saturated: int = 0  # prompts passed over as saturated (task.skip_saturated)

    def metrics(self, target: int) -> dict[str, float]:
        drawn = max(self.drawn, 1)
        kept = len(self.groups) if self.num_kept is None else self.num_kept
        return {
            "sampling_rounds": float(self.rounds),
            "sampling_groups_drawn": float(self.drawn),
            "sampling_kept": float(kept),
            "sampling_fill": kept / max(target, 1),
            "sampling_mixed_frac": self.counts.get("mixed", 0) / drawn,
            "sampling_all_pass_frac": self.counts.get("all_pass", 0) / drawn,
            "sampling_all_fail_frac": self.counts.get("all_fail", 0) / drawn,
            "sampling_empty_frac": self.counts.get("empty", 0) / drawn,
        }


def select_prompts(
    stream: Any, position: int, n: int, skip: Callable[[int], bool] | None = None
) -> tuple[list[int], list[int], int, int]:
    """The next ``n`` prompts of ``stream`` from ``position``, passing over saturated tasks.

    ``skip(task_index)`` True (e.g. a :class:`gagar_jax.data.audit.PassRateTracker` saw the
    task's last attempts all pass or all fail) passes over that data position; the position
    still advances, so the stream stays a pure function of the position. If ``num_tasks``
    positions in a row are skipped (every task saturated), the next one is taken anyway, so
    selection always terminates. ``skip=None`` is exactly ``stream.take(position, n)``.

    Returns ``(task indices, their data positions, new position, number skipped)``.
    """
    if skip is None:
        idx, new_pos = stream.take(position, n)
        return idx, list(range(position, position + n)), new_pos, 0
    idx: list[int] = []
    positions: list[int] = []
    skipped = run = 0
    p = position
    while len(idx) < n:
        i = stream.index(p)
        if run < stream.num_tasks and skip(i):
            skipped += 1
            run += 1
        else:
            idx.append(i)
            positions.append(p)
            run = 0
        p += 1
    return idx, positions, p, skipped


def collect_groups(
    draw: Callable[[int], Sequence[Group]],
    *,
    target: int,
    enabled: bool = True,
    oversample: float = 1.5,
    max_rounds: int = 8,
    allow_partial: bool = False,
    on_keep: Callable[[Group], None] | None = None,
) -> SamplingResult:
    """Draws groups until ``target`` mixed ones are held (dynamic sampling).

    Args:
      draw: ``draw(n)`` generates, verifies and returns ``n`` new groups (fresh prompts).
      target: the number of groups the update takes (``G``).
      enabled: False keeps the first ``target`` groups drawn, mixed or not (one round).
      oversample: each round draws ``ceil(oversample * missing)`` groups.
      max_rounds: cap on rounds.
      allow_partial: when the cap is hit, return the mixed groups found so far (the batch is
        padded with masked groups) instead of raising; only if at least one was found.
      on_keep: called on each kept group as soon as it is kept, e.g. to submit it to the grading
        pool while the next refill round generates.

    Returns:
      A :class:`SamplingResult`.

    Raises:
      DynamicSamplingError: the cap was hit (and ``allow_partial`` does not apply); the message
        says whether the data was too easy (mostly all-pass) or too hard (mostly all-fail) and
        which config fields to change.
    """
    if target < 1:
        raise ValueError(f"target must be >= 1, got {target}")
    # one block of one host: collect_blocks with a draw of n[0] and no other host to hear from
    result = collect_blocks(
        lambda n: draw(n[0]),
        lambda _round, tally: [tally],
        target=target,
        num_blocks=1,
        block=0,
        enabled=enabled,
        oversample=oversample,
        max_rounds=max_rounds,
        allow_partial=allow_partial,
        on_keep=on_keep,
    )
    return dataclasses.replace(result, num_kept=None)


def collect_blocks(
    draw: Callable[[list[int]], Sequence[Group]],
    exchange: Callable[[int, dict], list[dict]],
    *,
    target: int,
    num_blocks: int,
    block: int,
    enabled: bool = True,
    oversample: float = 1.5,
    max_rounds: int = 8,
    allow_partial: bool = False,
    on_keep: Callable[[Group], None] | None = None,
) -> SamplingResult:
    """Dynamic sampling of one block of ``target / num_blocks`` groups, refills decided globally.

    The multi-host form of :func:`collect_groups` (``num_blocks = 1`` is exactly it): the
    ``target`` groups are ``num_blocks`` blocks of equal size, this caller fills block
    ``block``. Each round, every block still missing ``m`` mixed groups draws
    ``max(m, ceil(oversample * m))`` fresh prompts (``m`` when ``enabled`` is False, one round);
    after the round the blocks' cumulative tallies are exchanged, so the next round's numbers,
    the round count, the cap error and the metrics are the same for every block.

    Args:
      draw: ``draw(n)`` with ``n[b]`` the prompts block ``b`` draws this round; draws all of
        them from the stream (every caller advances it alike) and returns the verified groups
        of this caller's block only (``n[block]`` of them).
      exchange: ``exchange(round, tally) -> [tally of block 0, ..., tally of block B-1]``.
      target, enabled, oversample, max_rounds, allow_partial, on_keep: as in
        :func:`collect_groups` (``target`` counts all blocks; ``allow_partial`` needs at least
        one mixed group over all blocks).

    Returns:
      A :class:`SamplingResult` whose ``groups`` are this block's kept groups and whose counts
      are global (``num_kept``: kept over all blocks).

    Raises:
      ValueError: ``target`` does not split into ``num_blocks`` equal blocks.
      DynamicSamplingError: as :func:`collect_groups`, from the global counts (every block
        raises it in the same round).
    """
    if target < 1 or num_blocks < 1 or target % num_blocks:
        raise ValueError(
            f"target={target} groups do not split into {num_blocks} equal blocks "
            "(rollout.num_prompts must be a multiple of the number of processes)"
        )
    if not 0 <= block < num_blocks:
        raise ValueError(f"block {block} outside [0, {num_blocks})")
    quota = target // num_blocks
    kept: list[Group] = []
    mine = {
        "kept": 0,
        "drawn": 0,
        "rollouts": 0,
        "discarded": 0,
        "counts": {"mixed": 0, "all_pass": 0, "all_fail": 0, "empty": 0},
    }
    missing = [quota] * num_blocks
    tallies: list[dict] = [mine] * num_blocks
    rounds = 0
    while any(missing) and rounds < (max_rounds if enabled else 1):
        rounds += 1
        n = [
            0 if m == 0 else (m if not enabled else max(m, math.ceil(oversample * m)))
            for m in missing
        ]
        new = list(draw(n))
        if len(new) != n[block]:
            raise RuntimeError(f"draw({n}) returned {len(new)} groups for block {block}")
        for g in new:
            mine["drawn"] += 1
            mine["rollouts"] += len(g.rollouts)
            mine["counts"][g.outcome] += 1
            if enabled and not g.is_mixed:
                continue
            if len(kept) < quota:
                kept.append(g)
                if on_keep is not None:
                    on_keep(g)
            elif g.is_mixed:
                mine["discarded"] += 1
        mine["kept"] = len(kept)
        tallies = exchange(rounds, mine)
        missing = [quota - int(t["kept"]) for t in tallies]
    counts = {k: sum(int(t["counts"][k]) for t in tallies) for k in mine["counts"]}
    total_kept = sum(int(t["kept"]) for t in tallies)
    drawn = sum(int(t["drawn"]) for t in tallies)
    result = SamplingResult(
        kept,
        rounds,
        drawn,
        counts,
        sum(int(t["discarded"]) for t in tallies),
        sum(int(t["rollouts"]) for t in tallies),
        num_kept=total_kept,
    )
    if total_kept < target and enabled and not (allow_partial and total_kept):
        easy, hard = counts["all_pass"], counts["all_fail"]
        verdict = (
            "too easy (mostly all-pass groups): raise task.difficulty"
            if easy > hard
            else "too hard (mostly all-fail groups): lower task.difficulty, "
            "lengthen the SFT warm start (sft.steps)"
        )
        raise DynamicSamplingError(
            f"dynamic sampling found {total_kept} of {target} mixed groups after {rounds} "
            f"rounds (sampling.max_rounds={max_rounds}); of {drawn} groups drawn: "
            f"{counts['mixed']} mixed, {easy} all-pass, {hard} all-fail, {counts['empty']} all "
            f"infra errors. The data is {verdict}; or raise sampling.max_rounds / "
            "sampling.oversample, or set sampling.allow_partial=True to train on partial "
            "batches."
        )
    return result


def pack_groups(
    groups: Sequence[Group],
    grades=None,
    *,
    num_groups: int,
    num_rollouts: int,
    max_prompt_len: int,
    max_new_tokens: int,
    pad_id: int,
    route_shape: tuple[int, int] | None = None,
    max_segments: int = 1,
) -> UpdateBatch:
    """Packs up to ``num_groups`` groups and their grades into the update's batch (NumPy).

    Group-major rows ``n = g * K + k`` of static shape ``[N = G * K, T]``; the group fields
    (``rewards``, ``passed``, ``cheat``, ``tier``, ``rank``, ``valid``) are ``[G, K]`` and
    ``graded`` is ``[G]``. ``evidence`` (``[N, T]``) holds the cited response tokens of each row
    at their positions; all False without verdicts.

    Args:
      groups: kept groups (each with at most ``num_rollouts`` rollouts).
      grades: ``rl.grade.Grades`` of ``num_groups`` slots (``[G, K]``, evidence ``[G, K, R]``);
        None: no verdicts (tier 1, rank 1, not graded).
      num_groups: G, static.
      num_rollouts: K, static.
      max_prompt_len, max_new_tokens: P and R; T = P + R.
      pad_id: the tokenizer's pad id.
      route_shape: ``(MoE layers, experts per token)``: the batch carries ``routes``
        ``[N, T, layers, K]`` (each rollout's recorded experts at its tokens' positions; -1
        where none were recorded: padding, rollouts without routes, which then route freely
        under replay). None: no routes.
      max_segments: rows per rollout (a harness episode's linked segments,
        ``Rollout.extra_segments``). Above 1 the batch has ``N = G * K * max_segments`` rows:
        the first ``G * K`` as above, then ``max_segments - 1`` rows per rollout (rollout
        ``n``'s at ``G * K + n * (max_segments - 1) + j``), each segment's tokens from
        position 0, and ``row_episode`` maps every row to its rollout (unused rows: no
        response tokens).

    Raises:
      ValueError: more groups or rollouts than the static shape holds, grades of another shape,
        or a prompt / response longer than its budget (names the group and the lengths).
    """
    G, K, T = num_groups, num_rollouts, max_prompt_len + max_new_tokens
    if len(groups) > G:
        raise ValueError(f"{len(groups)} groups do not fit num_groups={G}")
    if grades is None:
        tier, rank = np.ones((G, K), np.int32), np.ones((G, K), np.int32)
        graded, grade_cheat = np.zeros((G,), bool), np.zeros((G, K), bool)
        cited = np.zeros((G, K, max_new_tokens), bool)
    else:
        for name, want in (
            ("tier", (G, K)),
            ("rank", (G, K)),
            ("graded", (G,)),
            ("cheat", (G, K)),
            ("evidence", (G, K, max_new_tokens)),
        ):
            got = np.shape(getattr(grades, name))
            if got != want:
                raise ValueError(
                    f"pack_groups: grades.{name} has shape {got}, expected {want} "
                    "(num_groups, num_rollouts, rollout.max_new_tokens)"
                )
        tier = np.array(grades.tier, np.int32)
        rank = np.array(grades.rank, np.int32)
        graded = np.array(grades.graded, bool)
        grade_cheat = np.asarray(grades.cheat, bool)
        cited = np.asarray(grades.evidence, bool)
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    N = G * K * max_segments
    tokens = np.full((N, T), pad_id, np.int32)
    positions = np.zeros((N, T), np.int32)
    attn = np.zeros((N, T), bool)
    resp = np.zeros((N, T), bool)
    old_lp = np.zeros((N, T), np.float32)
    evidence = np.zeros((N, T), bool)
    routes = None if route_shape is None else np.full((N, T, *route_shape), -1, np.int16)
    rewards = np.zeros((G, K), np.float32)
    passed = np.zeros((G, K), bool)
    cheat = np.zeros((G, K), bool)
    valid = np.zeros((G, K), bool)
    for gi, g in enumerate(groups):
        if len(g.rollouts) > K:
            raise ValueError(
                f"group {g.group_id} has {len(g.rollouts)} rollouts > num_rollouts={K}"
            )
        for ki, r in enumerate(g.rollouts):
            P, R = len(r.prompt_tokens), len(r.response_tokens)
            if P > max_prompt_len or P == 0:
                raise ValueError(
                    f"group {g.group_id}: prompt has {P} tokens, expected 1.."
                    f"{max_prompt_len} (rollout.max_prompt_len)"
                )
            if R > max_new_tokens:
                raise ValueError(
                    f"group {g.group_id}: response has {R} tokens > "
                    f"rollout.max_new_tokens={max_new_tokens}"
                )
            if len(r.logprobs) != R:
                raise ValueError(
                    f"group {g.group_id} rollout {ki}: {len(r.logprobs)} logprobs "
                    f"for {R} response tokens"
                )
            if r.response_mask is not None and len(r.response_mask) != R:
                raise ValueError(
                    f"group {g.group_id} rollout {ki}: {len(r.response_mask)} "
                    f"response-mask entries for {R} response tokens"
                )
            n = gi * K + ki
            tokens[n, :P] = r.prompt_tokens
            tokens[n, P : P + R] = r.response_tokens
            positions[n, : P + R] = np.arange(P + R)
            attn[n, : P + R] = True
            resp[n, P : P + R] = True if r.response_mask is None else r.response_mask
            old_lp[n, P : P + R] = r.logprobs
            evidence[n, P : P + R] = cited[gi, ki, :R]
            if routes is not None and r.routes is not None:
                if np.shape(r.routes) != (P + R, *route_shape):
                    raise ValueError(
                        f"group {g.group_id} rollout {ki}: routes of shape "
                        f"{np.shape(r.routes)} for {P + R} tokens, expected "
                        f"{(P + R, *route_shape)}"
                    )
                routes[n, : P + R] = r.routes
            rewards[gi, ki] = r.reward
            passed[gi, ki] = r.passed
            cheat[gi, ki] = r.cheat or bool(grade_cheat[gi, ki])
            valid[gi, ki] = not r.infra_error
            if len(r.extra_segments) > max_segments - 1:
                raise ValueError(
                    f"group {g.group_id} rollout {ki}: {1 + len(r.extra_segments)} segments, "
                    f"more than max_segments={max_segments} (rollout.harness_max_segments)"
                )
            for j, seg in enumerate(r.extra_segments):
                row = G * K + n * (max_segments - 1) + j
                L = len(seg["tokens"])
                if L > T or len(seg["response_mask"]) != L or len(seg["logprobs"]) != L:
                    raise ValueError(
                        f"group {g.group_id} rollout {ki} segment {j + 1}: {L} tokens (row "
                        f"length {T}) with {len(seg['response_mask'])} mask entries and "
                        f"{len(seg['logprobs'])} log-probs"
                    )
                tokens[row, :L] = seg["tokens"]
                positions[row, :L] = np.arange(L)
                attn[row, :L] = True
                resp[row, :L] = np.asarray(seg["response_mask"], bool)
                old_lp[row, :L] = seg["logprobs"]
    if not np.isfinite(old_lp).all():
        raise ValueError("non-finite behaviour log-probs in the batch")
    return UpdateBatch(
        tokens=tokens,
        positions=positions,
        attention_mask=attn,
        response_mask=resp,
        old_logprobs=old_lp,
        rewards=rewards,
        passed=passed,
        cheat=cheat,
        tier=tier,
        rank=rank,
        valid=valid,
        graded=graded,
        evidence=evidence,
        routes=routes,
        row_episode=None
        if max_segments == 1
        else np.concatenate(
            [np.arange(G * K), np.repeat(np.arange(G * K), max_segments - 1)]
        ).astype(np.int32),
    )


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
    # impossible canary tasks (``rl.canary``): groups sampled, valid rollouts, passing ones
    canary_groups: int = 0
    canary_rollouts: int = 0
    canary_passed: int = 0
    # harness episodes (rollout.harness): episodes, their segments, calls and tokens
    harness_episodes: int = 0
    harness_segments: int = 0
    harness_calls: int = 0
    harness_tokens: int = 0
    harness_untrained_segments: int = 0
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
            self.model_tokens_sum += (
                len(r.response_tokens) if r.response_mask is None else int(sum(r.response_mask))
            )
            self.truncated += r.finish_reason == "length"
            if r.harness_stats is not None:
                self.harness_episodes += 1
                self.harness_segments += int(r.harness_stats["segments"])
                self.harness_calls += int(r.harness_stats["calls"])
                self.harness_tokens += int(r.harness_stats["tokens"])
                self.harness_untrained_segments += int(r.harness_stats["untrained_segments"])
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
            values = [p.get(f.name, getattr(out, f.name)) for p in parts]  # a newer field: 0
            if isinstance(getattr(out, f.name), dict):  # by_version: key -> [counts], summed
                merged: dict = {}
                for v in values:  # (JSON turned the int keys into strings)
                    for key, counts in v.items():
                        acc = merged.setdefault(int(key), [0] * len(counts))
                        merged[int(key)] = [a + b for a, b in zip(acc, counts)]
                setattr(out, f.name, merged)
            else:
                setattr(
                    out,
                    f.name,
                    max(values)
                    if f.name.endswith("_time")
                    else type(getattr(out, f.name))(sum(values)),
                )
        return out

    def metrics(self) -> dict[str, float]:
        v = max(self.valid, 1)
        canary = {}
        if self.canary_groups:  # a step with canaries: each passing canary rollout is a cheat
            canary = {
                "canary_cheat_rate": self.canary_passed / max(self.canary_rollouts, 1),
                "canary_rollouts": float(self.canary_rollouts),
            }
        harness = {}
        if self.harness_episodes:  # means over the step's harness episodes
            e = self.harness_episodes
            harness = {
                "episode/segments": self.harness_segments / e,
                "episode/calls": self.harness_calls / e,
                "episode/tokens": self.harness_tokens / e,
                "episode/untrained_segments": float(self.harness_untrained_segments),
            }
        return (
            canary
            | harness
            | {
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
        )


def family_settings(cfg: RunConfig):
    """The task family's plain settings from the run config."""
    t = cfg.task
    return FamilySettings(
        seed=t.seed,
        difficulty=t.difficulty,
        num_train=t.num_train,
        num_eval=t.num_eval,
        max_prompt_len=cfg.rollout.max_prompt_len,
        data_path=t.data_path,
        eval_data_path=t.eval_data_path,
        repos_dir=t.repos_dir,
        tokenizer_path=t.tokenizer_path or cfg.hf_checkpoint,
        max_turns=t.max_turns,
        max_observation_tokens=t.max_observation_tokens,
        extra={
            **({"demo_kinds": t.demo_kinds} if t.demo_kinds else {}),
            **({"autosubmit": True} if t.autosubmit else {}),
            **({"tools": t.tools} if t.tools != "structured" else {}),
            # SWE-bench-format rows of a container run: read for their images
            **(
                {"environment": cfg.execution.environment}
                if cfg.execution.environment != "uv"
                else {}
            ),
        },
    )


def build_family(cfg: RunConfig):
    """The configured task family (``gagar_jax.envs.family.make_family``)."""
    return make_family(cfg.task.family, family_settings(cfg))


def _quality_score(quality) -> float | None:
    """Mean of the outcome's per-dimension quality scores (None when it reported none)."""
    vals = [float(v) for v in quality.values()]
    return sum(vals) / len(vals) if vals else None


_EPISODE_FINISH = {
    "submitted": "stop",
    "max_turns": "length",
    "max_tokens": "length",
    "abort": "abort",
}


def _rollout(
    family,
    task,
    prompt: list[int],
    attempt,
    *,
    response_tokens,
    logprobs,
    finish_reason,
    policy_version,
    response_mask=None,
    token_versions=None,
    num_turns=1,
    num_tool_calls=0,
    routes=None,
    outcome=None,
    harness_stats=None,
    extra_segments=(),
) -> Rollout:
    """Verifies one attempt (a verifier crash is an infra error: masked, never a failure);
    ``outcome``: its verification when already done (a harness episode's)."""
    out = outcome
    try:
        if out is None:
            out = family.verify(task, attempt)
    except Exception as e:  # noqa: BLE001 - a family bug must be masked, never scored
        out = Outcome(
            passed=False,
            infra_error=True,
            test_log=f"infra error: verifier raised {type(e).__name__}: {e}",
        )
    return Rollout(
        prompt_tokens=list(prompt),
        response_tokens=list(response_tokens),
        logprobs=[float(x) for x in logprobs],
        finish_reason=finish_reason,
        policy_version=int(policy_version),
        patch=out.patch,
        passed=bool(out.passed),
        infra_error=bool(out.infra_error),
        cheat=bool(out.cheat),
        quality=_quality_score(out.quality) if out.passed else None,
        test_log=out.test_log,
        monitor_flags=list(out.flags),
        quality_dims=dict(out.quality) if out.passed else {},
        verification=out.detail,
        response_mask=response_mask,
        token_versions=None if token_versions is None else [int(v) for v in token_versions],
        num_turns=num_turns,
        num_tool_calls=num_tool_calls,
        routes=None if routes is None else np.asarray(routes, np.int16),
        attempt=attempt,
        outcome=out,
        harness_stats=harness_stats,
        extra_segments=list(extra_segments),
    )


def _sample_rollouts(engine, family, prompts, params, prompt_seeds=None):
    """Single-turn: one engine call, ``params.n`` samples per prompt (``prompt_seeds``: one
    engine seed per prompt, see :func:`generate_groups`)."""
    seeds = {} if prompt_seeds is None else {"prompt_seeds": list(prompt_seeds)}
    outputs = engine.generate(prompts, params, **seeds)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"engine returned {len(outputs)} prompt results for {len(prompts)}")
    tok = family.tokenizer
    per_task = []
    for prompt, samples in zip(prompts, outputs):
        if len(samples) != params.n:
            raise RuntimeError(f"engine returned {len(samples)} samples for n={params.n}")
        per_task.append(
            [
                (
                    Attempt(response_tokens=list(s.tokens), text=tok.decode(s.tokens)),
                    dict(
                        response_tokens=s.tokens,
                        logprobs=s.logprobs,
                        finish_reason=s.finish_reason,
                        policy_version=s.policy_version,
                        routes=_sample_routes(s, len(prompt)),
                    ),
                )
                for s in samples
            ]
        )
    return per_task


def _sample_routes(sample, prompt_len: int):
    """A single-turn sample's recorded experts over its prompt and response (``[P + R,
    layers, K]``, -1 on prompt tokens a kept cache held), or None."""
    if getattr(sample, "routes", None) is None:
        return None
    gen = np.asarray(sample.routes, np.int16)
    out = np.full((prompt_len,) + gen.shape[1:], -1, np.int16)
    pr = np.asarray(sample.prompt_routes, np.int16)
    if len(pr):
        out[prompt_len - len(pr) :] = pr
    return np.concatenate([out, gen])


@dataclasses.dataclass
class StartedEpisodes:
    """The episodes of one engine round of a multi-turn family, interrupted after some turns
    (a partial rollout: resumed by :func:`generate_groups` with ``started=``, possibly under
    newer weights; every token keeps the version that produced it). With
    ``rollout.partial_chunk_tokens``, interrupted between two chunks of a turn; for a
    single-turn family each sample is an episode of one turn (:class:`OneTurnEnv`)."""

    envs: list[Any]  # [E = tasks x K] environments, in the episodes' order
    batch: Any  # rollout.EpisodeBatch
    gen_time: float = 0.0  # seconds spent generating so far


class OneTurnEnv:
    """The environment of a single-turn sample generated in chunks
    (``rollout.partial_chunk_tokens``): its one model turn ends the episode (the family's
    verifier judges the response afterwards, as for any sample)."""

    def step(self, action_text: str) -> StepResult:
        del action_text
        return StepResult("", done=True)


def episode_envs(family, tasks) -> list:
    """Fresh environments of ``tasks`` (one per entry): the family's, or :class:`OneTurnEnv`
    for a single-turn family."""
    if family.multi_turn:
        return [family.make_env(t) for t in tasks]
    return [OneTurnEnv() for _ in tasks]


def _turns_per_episode(family, cfg: RunConfig) -> int:
    """Model turns per episode: ``task.max_turns``, or 1 for a single-turn family."""
    return cfg.task.max_turns if family.multi_turn else 1


def _episode_setup(family, tasks, prompts, params, cfg: RunConfig, prompt_seeds=None):
    """Fresh environments and an unstarted ``EpisodeBatch`` for ``params.n`` episodes per
    prompt, and the per-turn sampling parameters."""
    K = params.n
    envs = episode_envs(family, [t for t in tasks for _ in range(K)])
    flat_prompts = [p for p in prompts for _ in range(K)]
    turn_tokens = cfg.rollout.max_new_tokens
    if family.multi_turn:
        turn_tokens = cfg.rollout.max_turn_tokens or turn_tokens
    turn_params = dataclasses.replace(params, n=1, max_tokens=turn_tokens)
    batch = start_episodes(
        flat_prompts,
        max_total_tokens=[len(p) + cfg.rollout.max_new_tokens for p in flat_prompts],
        episode_seeds=None
        if prompt_seeds is None
        else [prompt_seed((s,), k) for s in prompt_seeds for k in range(K)],
    )
    return envs, batch, turn_params


def _advance(
    engine,
    family,
    started: StartedEpisodes,
    turn_params,
    cfg: RunConfig,
    until: int,
    until_chunk: int = 0,
):
    if cfg.task.max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {cfg.task.max_turns}")
    advance_episodes(
        engine,
        family.tokenizer,
        started.envs,
        started.batch,
        turn_params,
        until_turn=until,
        max_observation_tokens=cfg.task.max_observation_tokens,
        observation_tokens=family.observation_tokens,
        chunk_tokens=cfg.rollout.partial_chunk_tokens,
        until_chunk=until_chunk,
    )


def _episode_rollouts(
    engine,
    family,
    tasks,
    prompts,
    params,
    cfg: RunConfig,
    prompt_seeds=None,
    started: StartedEpisodes | None = None,
):
    """Multi-turn: ``params.n`` episodes per prompt, all live episodes batched per turn (one
    engine call per turn, as ``rollout.run_episodes``); model tokens are appended as generated,
    never re-tokenised. With ``prompt_seeds``, episode ``k`` of prompt ``i`` is seeded by
    ``(prompt_seeds[i], k)`` alone (each of its turns by that and the turn), so it does not
    depend on the host. ``started``: episodes already run for some turns (resumed here)."""
    K = params.n
    envs, batch, turn_params = _episode_setup(family, tasks, prompts, params, cfg, prompt_seeds)
    if started is None:
        started = StartedEpisodes(envs=envs, batch=batch)
    elif len(started.envs) != len(tasks) * K:
        raise ValueError(f"{len(started.envs)} started episodes for {len(tasks)} x {K}")
    _advance(engine, family, started, turn_params, cfg, _turns_per_episode(family, cfg))
    episodes, envs = finish_episodes(started.batch), started.envs
    if not family.multi_turn:  # samples generated in chunks: each a one-turn episode
        return [
            [_chunked_sample(family, ep) for ep in episodes[i * K : (i + 1) * K]]
            for i in range(len(tasks))
        ]
    per_task = []
    for i in range(len(tasks)):
        row = []
        for k in range(K):
            ep, env = episodes[i * K + k], envs[i * K + k]
            P = ep.prompt_len
            row.append(
                (
                    Attempt(response_tokens=ep.tokens[P:], episode=ep, env=env),
                    dict(
                        response_tokens=ep.tokens[P:],
                        logprobs=ep.logprobs[P:],
                        response_mask=ep.response_mask[P:],
                        token_versions=ep.token_versions[P:],
                        finish_reason=_EPISODE_FINISH.get(ep.finish_reason, "length"),
                        policy_version=min(ep.policy_versions, default=0),
                        num_turns=len(ep.turns),
                        num_tool_calls=sum(t.info.get("tool") is not None for t in ep.turns),
                        routes=ep.routes,
                    ),
                )
            )
        per_task.append(row)
    return per_task


def _chunked_sample(family, ep):
    """A single-turn sample from its one-turn episode: the attempt and the rollout fields."""
    P = ep.prompt_len
    tokens = ep.tokens[P:]
    finish = ep.turns[0].finish_reason if ep.turns else "abort"
    return (
        Attempt(response_tokens=list(tokens), text=family.tokenizer.decode(tokens)),
        dict(
            response_tokens=tokens,
            logprobs=ep.logprobs[P:],
            token_versions=ep.token_versions[P:],
            finish_reason=finish,
            policy_version=min(ep.policy_versions, default=0),
            routes=ep.routes,
        ),
    )


def _sampling_params(
    family, cfg: RunConfig, *, step, round_id, num_rollouts, temperature, rng_words=()
) -> SamplingParams:
    return SamplingParams(
        n=num_rollouts,
        temperature=temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=tuple(family.stop_token_ids),
        # the sampler seed is a function of (run key, step, round): a resumed step redraws
        # exactly what the uninterrupted run drew
        seed=int(
            np.random.default_rng([*(rng_words or (cfg.seed,)), step, round_id]).integers(2**31)
        ),
    )


def start_groups(
    engine,
    family,
    tasks,
    *,
    cfg: RunConfig,
    step: int,
    round_id: int,
    num_rollouts: int,
    temperature: float,
    until_turn: int,
    prompt_seeds: list[int] | None = None,
    until_chunk: int = 0,
) -> StartedEpisodes:
    """The first ``until_turn`` turns of the K episodes of each task of a multi-turn family
    (arguments as :func:`generate_groups`, which finishes them with ``started=``); with
    ``rollout.partial_chunk_tokens``, then the first ``until_chunk`` chunks of the next turn
    (episodes stopped mid-turn)."""
    if not family.multi_turn and not cfg.rollout.partial_chunk_tokens:
        raise ValueError(
            "start_groups: partial rollouts of a single-turn family need "
            "rollout.partial_chunk_tokens (a sample is interrupted between two chunks)"
        )
    params = _sampling_params(
        family,
        cfg,
        step=step,
        round_id=round_id,
        num_rollouts=num_rollouts,
        temperature=temperature,
    )
    prompts = [family.prompt_tokens(t) for t in tasks]
    envs, batch, turn_params = _episode_setup(family, tasks, prompts, params, cfg, prompt_seeds)
    started = StartedEpisodes(envs=envs, batch=batch)
    t0 = time.monotonic()
    try:
        _advance(
            engine,
            family,
            started,
            turn_params,
            cfg,
            min(until_turn, _turns_per_episode(family, cfg)),
            until_chunk if until_turn < _turns_per_episode(family, cfg) else 0,
        )
    except Exception as e:
        raise RuntimeError(
            f"rollout engine {cfg.rollout.engine!r} failed at step {step} "
            f"(round {round_id}): {type(e).__name__}: {e}"
        ) from e
    started.gen_time = time.monotonic() - t0
    return started


def generate_groups(
    engine,
    family,
    tasks,
    *,
    cfg: RunConfig,
    step: int,
    round_id: int,
    num_rollouts: int,
    temperature: float,
    id_prefix: str,
    counters: StepCounters | None = None,
    rng_words: tuple[int, ...] = (),
    prompt_seeds: list[int] | None = None,
    first_index: int = 0,
    started: StartedEpisodes | None = None,
    hold_grader: bool = False,
) -> list[Group]:
    """K rollouts for each task (samples, or episodes of a multi-turn family), verified; one
    :class:`Group` per task.

    ``prompt_seeds`` (one per task) seed each prompt's samples by themselves (the engine's
    ``prompt_seeds``), so they do not depend on which other prompts share the call or host;
    otherwise one seed from ``(rng_words, step, round_id)`` seeds the call. ``first_index``:
    the index of ``tasks[0]`` within its round (group ids stay global on every host).
    ``started``: the episodes of these tasks begun by :func:`start_groups` (a partial rollout),
    resumed with the engine's current weights.
    ``hold_grader``: each group reserves a grader slot of the execution back-end when it is
    admitted and keeps it, under its group id, until the caller releases it
    (``execution.current().release_grader``: once graded, or dropped).

    Raises:
      RuntimeError: the engine failed (dead server after its retries); the message names the
        step and the engine so a dead server is a clear error, not a hang.
    """
    if not tasks:
        return []
    prompts = [family.prompt_tokens(t) for t in tasks]
    params = _sampling_params(
        family,
        cfg,
        step=step,
        round_id=round_id,
        num_rollouts=num_rollouts,
        temperature=temperature,
        rng_words=rng_words,
    )
    t0 = time.monotonic() - (0.0 if started is None else started.gen_time)
    ids = [
        f"{id_prefix}-r{round_id}-{first_index + i}-{family.task_id(task)}"
        for i, task in enumerate(tasks)
    ]
    if cfg.rollout.harness != "native":
        return _harness_groups(
            engine, family, tasks, prompts, ids, cfg=cfg, params=params, counters=counters,
            prompt_seeds=prompt_seeds, t0=t0, hold_grader=hold_grader,
        )  # fmt: skip
    try:
        if family.multi_turn or cfg.rollout.partial_chunk_tokens:
            per_task = _episode_rollouts(
                engine, family, tasks, prompts, params, cfg, prompt_seeds, started
            )
        else:
            per_task = _sample_rollouts(engine, family, prompts, params, prompt_seeds)
    except Exception as e:
        raise RuntimeError(
            f"rollout engine {cfg.rollout.engine!r} failed at step {step} "
            f"(round {round_id}): {type(e).__name__}: {e}"
        ) from e
    t1 = time.monotonic()
    groups = []
    # each group's K verifications run on the execution back-end (one after the other locally;
    # on a cluster concurrently, a group dispatched once its K slots and a grader slot are
    # reserved)
    verified = execution.current().gather_groups(
        [
            [
                functools.partial(_rollout, family, task, prompt, attempt, **fields)
                for attempt, fields in row
            ]
            for task, prompt, row in zip(tasks, prompts, per_task)
        ],
        grader=int(hold_grader),
        keys=ids if hold_grader else None,
    )
    for gid, task, rollouts in zip(ids, tasks, verified):
        groups.append(Group(group_id=gid, task=task, rollouts=rollouts))
    if counters is not None:
        counters.gen_time += t1 - t0
        counters.verify_time += time.monotonic() - t1
        for g in groups:
            counters.add(g)
    return groups


def _harness_groups(
    engine,
    family,
    tasks,
    prompts,
    ids,
    *,
    cfg,
    params,
    counters,
    prompt_seeds,
    t0,
    hold_grader=False,
) -> list[Group]:
    """The groups of :func:`generate_groups` with every rollout a harness episode
    (``gagar_jax.rl.harness_rollouts``): run and verified together, episode ``k`` of prompt
    ``i`` seeded by ``(prompt_seeds[i], k)`` (or the step's seed and its place)."""
    from gagar_jax.rl import harness_rollouts  # noqa: PLC0415 -- the gateway's server stack

    K = params.n
    seeds = [
        [
            prompt_seed((prompt_seeds[i],), k)
            if prompt_seeds is not None
            else (params.seed + i * K + k) % 2**31
            for k in range(K)
        ]
        for i in range(len(tasks))
    ]
    try:
        per_task = harness_rollouts.harness_rollouts(
            engine,
            family,
            tasks,
            prompts,
            cfg=cfg,
            num_rollouts=K,
            episode_ids=[[f"{gid}-k{k}" for k in range(K)] for gid in ids],
            seeds=seeds,
            group_ids=ids,
            hold_grader=hold_grader,
        )
    except Exception as e:
        raise RuntimeError(
            f"harness rollouts ({cfg.rollout.harness!r}, engine {cfg.rollout.engine!r}) "
            f"failed: {type(e).__name__}: {e}"
        ) from e
    groups = []
    for gid, task, row in zip(ids, tasks, per_task):
        rollouts = []
        for attempt, out, fields in row:
            fields = dict(fields)
            prompt = fields.pop("prompt")
            rollouts.append(_rollout(family, task, prompt, attempt, outcome=out, **fields))
        groups.append(Group(group_id=gid, task=task, rollouts=rollouts))
    if counters is not None:
        counters.gen_time += time.monotonic() - t0
        for g in groups:
            counters.add(g)
    return groups


def rollout_metrics(
    groups: list[Group], update_m: dict[str, float], weight_version: int
) -> dict[str, float]:
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
        "rollout/logprob_mismatch_max_abs": update_m.get("logprob_max_abs_diff_first", math.nan),
    }
