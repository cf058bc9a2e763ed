"""Group assembly, dynamic sampling and packing to a static batch shape.

Dynamic sampling (DAPO; the Gagar paper builds on it): a group whose rollouts all pass or all
fail has zero advantage everywhere, contributes no gradient and gives the grader nothing to
compare. Each training step therefore over-samples prompts and keeps drawing until it holds
``num_prompts`` *mixed* groups, with a cap on the rounds and an error that says whether the
data is too easy or too hard when the cap is hit.

Whatever the number of refill rounds, :func:`pack_groups` writes the kept groups into arrays of
one static shape ``[G, K, T]`` (``G = num_prompts``, ``K = num_rollouts``,
``T = max_prompt_len + max_new_tokens``); missing groups and rollouts are masked with ``valid``,
so the jitted update is traced once for the whole run.

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
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np


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
    num_turns: int = 1
    num_tool_calls: int = 0
    attempt: Any = None  # the family's view of the rollout (envs.family.Attempt)
    outcome: Any = None  # its verification (envs.family.Outcome)

    @property
    def reward(self) -> float:
        return 1.0 if (self.passed and not self.cheat) else 0.0


@dataclasses.dataclass
class Group:
    """The K rollouts of one prompt, plus whatever the grader said about them."""

    group_id: str
    task: Any
    rollouts: list[Rollout]
    # Filled from the grading pool; per rollout, defaults mean "no verdict".
    tier: list[int] | None = None
    rank: list[int] | None = None
    grader_cheat: list[bool] | None = None
    graded: bool = False
    fallback_reason: str | None = None
    # Per rollout, a bool mask over its response tokens: the tokens the verdict cites as
    # evidence (``gagar_jax.grading.evidence_tokens``); None without a verdict.
    evidence: list[Any] | None = None

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


def select_prompts(stream: Any, position: int, n: int, skip: Callable[[int], bool] | None = None
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


def collect_groups(draw: Callable[[int], Sequence[Group]], *, target: int, enabled: bool = True,
                   oversample: float = 1.5, max_rounds: int = 8, allow_partial: bool = False,
                   on_keep: Callable[[Group], None] | None = None) -> SamplingResult:
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
    kept: list[Group] = []
    counts = {"mixed": 0, "all_pass": 0, "all_fail": 0, "empty": 0}
    drawn = rollouts = discarded = rounds = 0
    while len(kept) < target and rounds < (max_rounds if enabled else 1):
        rounds += 1
        missing = target - len(kept)
        n = missing if not enabled else max(missing, math.ceil(oversample * missing))
        new = list(draw(n))
        if len(new) != n:
            raise RuntimeError(f"draw({n}) returned {len(new)} groups")
        for g in new:
            drawn += 1
            rollouts += len(g.rollouts)
            counts[g.outcome] += 1
            if enabled and not g.is_mixed:
                continue
            if len(kept) < target:
                kept.append(g)
                if on_keep is not None:
                    on_keep(g)
            elif g.is_mixed:
                discarded += 1
    result = SamplingResult(kept, rounds, drawn, counts, discarded, rollouts)
    if len(kept) < target and enabled and not (allow_partial and kept):
        easy, hard = counts["all_pass"], counts["all_fail"]
        verdict = ("too easy (mostly all-pass groups): raise task.difficulty"
                   if easy > hard else
                   "too hard (mostly all-fail groups): lower task.difficulty, "
                   "lengthen the SFT warm start (sft.steps)")
        raise DynamicSamplingError(
            f"dynamic sampling found {len(kept)} of {target} mixed groups after {rounds} rounds "
            f"(sampling.max_rounds={max_rounds}); of {drawn} groups drawn: {counts['mixed']} "
            f"mixed, {easy} all-pass, {hard} all-fail, {counts['empty']} all infra errors. "
            f"The data is {verdict}; or raise sampling.max_rounds / sampling.oversample, or set "
            f"sampling.allow_partial=True to train on partial batches.")
    return result


def collect_blocks(draw: Callable[[list[int]], Sequence[Group]],
                   exchange: Callable[[int, dict], list[dict]], *, target: int,
                   num_blocks: int, block: int, enabled: bool = True, oversample: float = 1.5,
                   max_rounds: int = 8, allow_partial: bool = False,
                   on_keep: Callable[[Group], None] | None = None) -> SamplingResult:
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
        raise ValueError(f"target={target} groups do not split into {num_blocks} equal blocks "
                         "(rollout.num_prompts must be a multiple of the number of processes)")
    if not 0 <= block < num_blocks:
        raise ValueError(f"block {block} outside [0, {num_blocks})")
    quota = target // num_blocks
    kept: list[Group] = []
    mine = {"kept": 0, "drawn": 0, "rollouts": 0, "discarded": 0,
            "counts": {"mixed": 0, "all_pass": 0, "all_fail": 0, "empty": 0}}
    missing = [quota] * num_blocks
    tallies: list[dict] = [mine] * num_blocks
    rounds = 0
    while any(missing) and rounds < (max_rounds if enabled else 1):
        rounds += 1
        n = [0 if m == 0 else (m if not enabled else max(m, math.ceil(oversample * m)))
             for m in missing]
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
    result = SamplingResult(kept, rounds, drawn, counts,
                            sum(int(t["discarded"]) for t in tallies),
                            sum(int(t["rollouts"]) for t in tallies), num_kept=total_kept)
    if total_kept < target and enabled and not (allow_partial and total_kept):
        easy, hard = counts["all_pass"], counts["all_fail"]
        verdict = ("too easy (mostly all-pass groups): raise task.difficulty"
                   if easy > hard else
                   "too hard (mostly all-fail groups): lower task.difficulty, "
                   "lengthen the SFT warm start (sft.steps)")
        raise DynamicSamplingError(
            f"dynamic sampling found {total_kept} of {target} mixed groups after {rounds} "
            f"rounds (sampling.max_rounds={max_rounds}); of {drawn} groups drawn: "
            f"{counts['mixed']} mixed, {easy} all-pass, {hard} all-fail, {counts['empty']} all "
            f"infra errors. The data is {verdict}; or raise sampling.max_rounds / "
            "sampling.oversample, or set sampling.allow_partial=True to train on partial "
            "batches.")
    return result


class PackedBatch(NamedTuple):
    """A static-shape batch of G groups x K rollouts x T tokens (NumPy, host side)."""

    tokens: np.ndarray  # [G, K, T] int32, prompt + response, right-padded with pad_id
    positions: np.ndarray  # [G, K, T] int32
    attention_mask: np.ndarray  # [G, K, T] bool, True on prompt and response tokens
    response_mask: np.ndarray  # [G, K, T] bool, True on response tokens (the loss's tokens)
    old_logprobs: np.ndarray  # [G, K, T] float32, behaviour log-probs on response tokens
    rewards: np.ndarray  # [G, K] float32, 1 = passed and not a cheat
    passed: np.ndarray  # [G, K] bool
    cheat: np.ndarray  # [G, K] bool
    tier: np.ndarray  # [G, K] int32, 1..3 where graded and passing, else 1
    rank: np.ndarray  # [G, K] int32, >= 1
    graded: np.ndarray  # [G] bool, a valid verdict arrived for the group
    valid: np.ndarray  # [G, K] bool, a real rollout (not padding, not an infra error)
    evidence: np.ndarray | None = None  # [G, K, T] bool, response tokens a verdict cites

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.tokens.shape


def pack_groups(groups: Sequence[Group], *, num_groups: int, num_rollouts: int,
                max_prompt_len: int, max_new_tokens: int, pad_id: int) -> PackedBatch:
    """Packs up to ``num_groups`` groups into a :class:`PackedBatch` of static shape.

    Args:
      groups: kept groups (each with at most ``num_rollouts`` rollouts).
      num_groups: G, static.
      num_rollouts: K, static.
      max_prompt_len, max_new_tokens: P and R; T = P + R.
      pad_id: the tokenizer's pad id.

    Raises:
      ValueError: more groups or rollouts than the static shape holds, or a prompt / response
        longer than its budget (names the group and the lengths).
    """
    G, K, T = num_groups, num_rollouts, max_prompt_len + max_new_tokens
    if len(groups) > G:
        raise ValueError(f"{len(groups)} groups do not fit num_groups={G}")
    tokens = np.full((G, K, T), pad_id, np.int32)
    positions = np.zeros((G, K, T), np.int32)
    attn = np.zeros((G, K, T), bool)
    resp = np.zeros((G, K, T), bool)
    old_lp = np.zeros((G, K, T), np.float32)
    rewards = np.zeros((G, K), np.float32)
    passed = np.zeros((G, K), bool)
    cheat = np.zeros((G, K), bool)
    tier = np.ones((G, K), np.int32)
    rank = np.ones((G, K), np.int32)
    graded = np.zeros((G,), bool)
    valid = np.zeros((G, K), bool)
    evidence = np.zeros((G, K, T), bool)
    for gi, g in enumerate(groups):
        if len(g.rollouts) > K:
            raise ValueError(f"group {g.group_id} has {len(g.rollouts)} rollouts > "
                             f"num_rollouts={K}")
        graded[gi] = bool(g.graded)
        for ki, r in enumerate(g.rollouts):
            P, R = len(r.prompt_tokens), len(r.response_tokens)
            if P > max_prompt_len or P == 0:
                raise ValueError(f"group {g.group_id}: prompt has {P} tokens, expected 1.."
                                 f"{max_prompt_len} (rollout.max_prompt_len)")
            if R > max_new_tokens:
                raise ValueError(f"group {g.group_id}: response has {R} tokens > "
                                 f"rollout.max_new_tokens={max_new_tokens}")
            if len(r.logprobs) != R:
                raise ValueError(f"group {g.group_id} rollout {ki}: {len(r.logprobs)} logprobs "
                                 f"for {R} response tokens")
            if r.response_mask is not None and len(r.response_mask) != R:
                raise ValueError(f"group {g.group_id} rollout {ki}: {len(r.response_mask)} "
                                 f"response-mask entries for {R} response tokens")
            tokens[gi, ki, :P] = r.prompt_tokens
            tokens[gi, ki, P:P + R] = r.response_tokens
            positions[gi, ki, :P + R] = np.arange(P + R)
            attn[gi, ki, :P + R] = True
            resp[gi, ki, P:P + R] = True if r.response_mask is None else r.response_mask
            old_lp[gi, ki, P:P + R] = r.logprobs
            rewards[gi, ki] = r.reward
            passed[gi, ki] = r.passed
            cheat[gi, ki] = r.cheat or bool(g.grader_cheat and g.grader_cheat[ki])
            valid[gi, ki] = not r.infra_error
            if g.tier is not None:
                tier[gi, ki] = g.tier[ki]
            if g.rank is not None:
                rank[gi, ki] = g.rank[ki]
            if g.evidence is not None and g.evidence[ki] is not None:
                ev = np.asarray(g.evidence[ki], bool)[:R]
                evidence[gi, ki, P:P + len(ev)] = ev
    if not np.isfinite(old_lp).all():
        raise ValueError("non-finite behaviour log-probs in the batch")
    return PackedBatch(tokens, positions, attn, resp, old_lp, rewards, passed, cheat, tier, rank,
                       graded, valid, evidence)
