"""Grading of kept groups: each family's workspace, the pool's verdicts as arrays (tiers, ranks,
cheat flags, cited-evidence token masks: :class:`Grades`) and the grading metrics over all
hosts."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from gagar_jax.envs.family import Attempt, GroupMember, Outcome
from gagar_jax.grading import evidence_tokens
from gagar_jax.grading import to_arrays as to_schema_arrays
from gagar_jax.rl.collect import Group


def group_workspace(family, group: Group):
    """The grading workspace of one group, built by its family."""
    members = [
        GroupMember(
            f"{group.group_id}/{k}",
            r.attempt or Attempt(),
            r.outcome or Outcome(passed=r.passed, infra_error=r.infra_error),
        )
        for k, r in enumerate(group.rollouts)
    ]
    return family.workspace(group.group_id, group.task, members)


class Grades(NamedTuple):
    """The grading pool's results for one host's block of ``G`` group slots, as arrays.

    Slots without a judgement (no verdict, failed or missing rollouts, padding groups) hold the
    defaults the kernels ignore: tier 1, rank 1, not graded, no cheat, no cited token.
    """

    tier: np.ndarray  # [G, K] int32, 1..3 per judged candidate
    rank: np.ndarray  # [G, K] int32, >= 1
    graded: np.ndarray  # [G] bool, a valid verdict arrived for the group
    cheat: np.ndarray  # [G, K] bool, the verdict's cheat flag or the slot's monitor flag
    evidence: np.ndarray  # [G, K, R] bool, response tokens (from the first) a verdict cites
    reasons: tuple[Any, ...] = ()  # per group with a result, its fallback reason or None


def no_grades(num_groups: int, num_rollouts: int, max_new_tokens: int) -> Grades:
    """``Grades`` of ``num_groups`` groups without any verdict (grading off, nothing kept)."""
    G, K, R = num_groups, num_rollouts, max_new_tokens
    return Grades(
        tier=np.ones((G, K), np.int32),
        rank=np.ones((G, K), np.int32),
        graded=np.zeros((G,), bool),
        cheat=np.zeros((G, K), bool),
        evidence=np.zeros((G, K, R), bool),
    )


def to_arrays(
    results: list[Any],
    groups: list[Group],
    *,
    num_groups: int,
    num_rollouts: int,
    max_new_tokens: int,
    token_spans=None,
) -> Grades:
    """The pool's results for ``groups`` (``results[i]`` of ``groups[i]``) as :class:`Grades`.

    ``results[i]`` is a ``GradeResult``: a verdict (tier/rank per passing candidate) or
    ``None`` with a ``fallback_reason``. With ``token_spans(task, attempt) -> TokenSpans`` (the
    task pool's), each rollout of a graded group also gets the mask of its response tokens
    that its judgement's evidence cites (token-level credit and its metrics read it).

    Raises:
      ValueError: more results than ``num_groups``, or than there are groups.
    """
    G, K, R = num_groups, num_rollouts, max_new_tokens
    if len(results) > G or len(results) != len(groups):
        raise ValueError(
            f"to_arrays: {len(results)} results for {len(groups)} groups (num_groups={G})"
        )
    out = no_grades(G, K, R)
    if not results:
        return out
    tier, rank, graded, cheat = (np.asarray(a) for a in to_schema_arrays(results, K))
    reasons = []
    for gi, (g, res) in enumerate(zip(groups, results)):
        n = len(g.rollouts)  # slots past the group's rollouts keep the defaults
        out.graded[gi] = bool(graded[gi])
        out.tier[gi, :n] = tier[gi, :n]
        out.rank[gi, :n] = rank[gi, :n]
        out.cheat[gi, :n] = cheat[gi, :n]
        reasons.append(getattr(res, "fallback_reason", None))
        verdict = getattr(res, "verdict", None)
        if token_spans is not None and graded[gi] and verdict is not None:
            for ki, (r, mask) in enumerate(
                zip(g.rollouts, _evidence_masks(g, res, verdict, token_spans))
            ):
                if mask is not None:
                    ev = np.asarray(mask, bool)[: min(len(r.response_tokens), R)]
                    out.evidence[gi, ki, : len(ev)] = ev
    return out._replace(reasons=tuple(reasons))


def _evidence_masks(g: Group, res: Any, verdict: Any, token_spans) -> list[Any]:
    """Per rollout slot, the response-token mask its judgement's evidence cites."""
    ids = list(getattr(res, "candidate_ids", ()))
    spans = {}
    for cid, r in zip(ids, g.rollouts):
        s = token_spans(g.task, r.attempt) if r.attempt is not None else None
        if s is not None:
            spans[cid] = s
    masks = evidence_tokens.verdict_token_masks(verdict, spans)
    return [masks.get(cid) for cid in ids[: len(g.rollouts)]] + [None] * (
        len(g.rollouts) - len(ids)
    )


def batch_grading_metrics(
    batch, kept: np.ndarray, grader_cheat: np.ndarray, fallback: tuple[str, ...]
) -> dict[str, float]:
    """Grading metrics from the packed update batch (every host's group fields).

    The one T1 share: over the test-passing valid rollouts of graded kept groups (a cheat
    passes the tests and is graded T3), the fraction in tier 1 and not flagged as a cheat (by
    the verdict or the monitor: the batch's ``cheat``). ``rank1_share``: passing non-cheats
    ranked best in their group, over passing non-cheats of graded groups.

    Args:
      batch: ``UpdateBatch`` (NumPy) whose ``[G, K]`` fields hold every host's groups.
      kept: [G] bool, the slot holds a kept group (padding slots are not counted).
      grader_cheat: [G, K] bool, the verdict's (or the monitor's) cheat flag per slot.
      fallback: [G] the fallback reason of each kept ungraded group ("" otherwise).
    """
    kept = np.asarray(kept, bool)
    graded = np.asarray(batch.graded, bool) & kept
    passing = np.asarray(batch.passed, bool) & np.asarray(batch.valid, bool) & graded[:, None]
    cheat = np.asarray(batch.cheat, bool)
    clean = passing & ~cheat
    tier1 = passing & (np.asarray(batch.tier) == 1) & ~cheat
    rank1 = clean & (np.asarray(batch.rank) == 1)
    n_pass, n_clean, n_kept = int(passing.sum()), int(clean.sum()), int(kept.sum())
    fallbacks = kept & ~graded
    out = {
        "t1_share": int(tier1.sum()) / n_pass if n_pass else math.nan,
        # passing non-cheats ranked best in their group: rises as the policy converges on the
        # grader's preferred (minimal, in-scope, consistent) solutions
        "rank1_share": int(rank1.sum()) / n_clean if n_clean else math.nan,
        "grading_fallbacks": float(fallbacks.sum()),
        "grading_graded_frac": int(graded.sum()) / max(n_kept, 1),
        "grader_cheats": float((np.asarray(grader_cheat, bool) & kept[:, None]).sum()),
    }
    reasons: dict[str, int] = {}
    for gi in np.flatnonzero(fallbacks):
        reasons[fallback[gi]] = reasons.get(fallback[gi], 0) + 1
    for reason, n in reasons.items():
        out[f"grading_fallback_{reason}"] = float(n)
    return out
