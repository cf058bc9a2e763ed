"""Grading of kept groups: each family's workspace, the pool's verdicts onto the groups (tiers,
ranks, cheat flags, cited-evidence token masks) and the grading metrics over all hosts."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gagar_jax.envs.family import Attempt, GroupMember, Outcome
from gagar_jax.grading import evidence_tokens, to_arrays
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


def attach_verdicts(
    groups: list[Group], results: list[Any], K: int, *, token_spans=None
) -> dict[str, float]:
    """Copies the grading pool's results into the groups; returns grading metrics.

    With ``token_spans(task, response_tokens) -> TokenSpans`` (the task pool's), each rollout
    of a graded group also gets the mask of its response tokens that its judgement's evidence
    cites (``Group.evidence``; token-level credit and its metrics read it).

    ``results[i]`` is the ``GradeResult`` of ``groups[i]``: a verdict (tier/rank per passing
    candidate) or ``None`` with a ``fallback_reason``. Metrics: :func:`grading_metrics`.
    """
    tier, rank, graded, cheat = (np.asarray(a) for a in to_arrays(results, K))
    for gi, (g, res) in enumerate(zip(groups, results)):
        g.graded = bool(graded[gi])
        g.tier = [int(x) for x in tier[gi][: len(g.rollouts)]]
        g.rank = [int(x) for x in rank[gi][: len(g.rollouts)]]
        g.grader_cheat = [bool(x) for x in cheat[gi][: len(g.rollouts)]]
        g.fallback_reason = getattr(res, "fallback_reason", None)
        verdict = getattr(res, "verdict", None)
        if token_spans is not None and g.graded and verdict is not None:
            g.evidence = _evidence_masks(g, res, verdict, token_spans)
    return grading_metrics([verdict_summary(g) for g in groups])


def verdict_summary(g: Group) -> dict[str, Any]:
    """What the other hosts need of a graded group (JSON): outcomes and verdict per slot."""
    reason = (
        None
        if g.graded
        else str(getattr(g.fallback_reason, "value", g.fallback_reason) or "unknown")
    )
    return {
        "graded": bool(g.graded),
        "reason": reason,
        "passed": [bool(r.passed) for r in g.rollouts],
        "infra": [bool(r.infra_error) for r in g.rollouts],
        "cheat": [bool(r.cheat) for r in g.rollouts],
        "tier": list(g.tier or [1] * len(g.rollouts)),
        "rank": list(g.rank or [1] * len(g.rollouts)),
        "grader_cheat": list(g.grader_cheat or [False] * len(g.rollouts)),
    }


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
