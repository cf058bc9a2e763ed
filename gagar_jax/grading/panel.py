"""Heterogeneous grading panels: several graders per group, aggregated, escalated on disagreement.

A single grader's systematic bias keeps injecting wrong credit; a panel of graders that differ
(kinds, prompts, models, settings) cross-checks it. ``Panel`` is a grader (the pool runs it like
any other): it grades the group with every member, validates each member's verdict, aggregates
the accepted ones, and, when the members disagree more than ``escalate_above``, hands the group
to ``escalate_to`` (a stronger, costlier grader) instead.

Aggregations (``AGGREGATIONS``), for the tiers and ranks:

* ``majority``: per candidate the most common member tier (a tie takes the worse tier); order by
  that tier, then by the mean member rank.
* ``mean_rank``: order by the mean member rank; tier = the rounded mean member tier, made
  monotone along that order (a candidate never gets a better tier than one ranked above it).

Cheat aggregations (``CHEAT_AGGREGATIONS``): ``max_severity`` (a cheat if any member says so, and
then tier 3: one credible cheat flag outweighs the others' silence) or ``majority``.

Scores are the mean of the members'; evidence is the union of the members' evidence for that
candidate (each member's verdict was validated, so every negative aggregate judgement is backed:
a mean score below 0.5 needs a member below 0.5, which cited evidence for it). Evidence that
quoted a member's own check log is dropped (the panel cannot re-validate it).

Disagreement of a group: the fraction of passing candidates on whose tier the accepted members
are not unanimous. ``disagreements`` keeps it per group id; ``metrics`` counts groups, escalations,
member failures and the mean disagreement.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import threading
import time
from collections.abc import Sequence
from typing import Any

from gagar_jax.grading import schema
from gagar_jax.grading.adapters import ToyCheckRunner
from gagar_jax.grading.agentic import AgenticGrader
from gagar_jax.grading.heuristic import HeuristicConfig, HeuristicGrader
from gagar_jax.grading.pool import accept_output
from gagar_jax.grading.schema import (
    DIMENSIONS,
    GroupWorkspace,
    Judgement,
    RejectReason,
    Verdict,
    VerdictRejected,
)
from gagar_jax.grading.scripted import ScriptedGraderPolicy

AGGREGATIONS = ("majority", "mean_rank")
CHEAT_AGGREGATIONS = ("max_severity", "majority")


def _call(grader: Any, ws: GroupWorkspace, cancel: threading.Event | None) -> Any:
    try:
        takes_cancel = "cancel" in inspect.signature(grader.grade).parameters
    except (TypeError, ValueError):
        takes_cancel = False
    return grader.grade(ws, cancel=cancel) if takes_cancel else grader.grade(ws)


def disagreement(verdicts: Sequence[Verdict], workspace: GroupWorkspace) -> float:
    """Fraction of passing candidates whose tier is not the same in every verdict."""
    ids = [c.candidate_id for c in workspace.passing]
    if not ids or len(verdicts) < 2:
        return 0.0
    split = sum(len({v.judgement(c).tier for v in verdicts}) > 1 for c in ids)
    return split / len(ids)


def aggregate(
    verdicts: Sequence[Verdict],
    workspace: GroupWorkspace,
    *,
    aggregation: str = "majority",
    cheat_aggregation: str = "max_severity",
    grader_id: str = "panel",
    grader_version: str = "1",
    latency_s: float = 0.0,
) -> Verdict:
    """Aggregates accepted member verdicts of one group into one validated verdict."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}")
    if cheat_aggregation not in CHEAT_AGGREGATIONS:
        raise ValueError(
            f"cheat_aggregation: expected one of {CHEAT_AGGREGATIONS}, got {cheat_aggregation!r}"
        )
    if not verdicts:
        raise ValueError("aggregate: no verdicts")
    ids = [c.candidate_id for c in workspace.passing]
    by = {c: [v.judgement(c) for v in verdicts] for c in ids}
    mean_rank = {c: sum(j.rank for j in js) / len(js) for c, js in by.items()}
    cheat = {}
    for c, js in by.items():
        n = sum(j.cheat for j in js)
        cheat[c] = n > 0 if cheat_aggregation == "max_severity" else 2 * n > len(js)
    tier: dict[str, int] = {}
    if aggregation == "majority":
        for c, js in by.items():
            counts = collections.Counter(j.tier for j in js)
            top = max(counts.values())
            tier[c] = max(t for t, n in counts.items() if n == top)
    else:
        order = sorted(ids, key=lambda c: (mean_rank[c], c))
        worst = 1
        for c in order:
            t = int(round(sum(j.tier for j in by[c]) / len(by[c])))
            worst = max(worst, t)
            tier[c] = worst
    for c in ids:
        if cheat[c]:
            tier[c] = schema.NUM_TIERS
    keys = sorted({(tier[c], round(mean_rank[c], 6)) for c in ids})
    rank_of = {k: i + 1 for i, k in enumerate(keys)}
    agreement = [sum(j.tier == tier[c] for j in js) / len(js) for c, js in by.items()]
    judgements = []
    for c, js in by.items():
        scores = {d: sum(float(j.scores[d]) for j in js) / len(js) for d in DIMENSIONS}
        evidence = tuple(
            e
            for e in dict.fromkeys(e for j in js for e in j.evidence)
            if schema._check_evidence(e, workspace, {}) is None
        )
        reasons = [j.cheat_reason for j in js if j.cheat and j.cheat_reason]
        judgements.append(
            Judgement(
                c,
                tier[c],
                rank_of[(tier[c], round(mean_rank[c], 6))],
                scores,
                cheat[c],
                "; ".join(dict.fromkeys(reasons)) if cheat[c] else "",
                evidence,
            )
        )
    v = Verdict(
        workspace.group_id,
        tuple(judgements),
        grader_id,
        grader_version,
        latency_s=latency_s,
        votes=len(verdicts),
        agreement=sum(agreement) / len(agreement) if agreement else None,
    )
    return schema.validate(v, workspace)


class Panel:
    """Several graders per group (see the module docstring).

    Args:
      members: graders (anything the pool accepts), at least two.
      aggregation: one of ``AGGREGATIONS``.
      cheat_aggregation: one of ``CHEAT_AGGREGATIONS``.
      escalate_to: a stronger grader for groups the members disagree on (None: never escalate).
      escalate_above: escalate when the group's disagreement exceeds this fraction.
      min_members: accepted member verdicts needed (default: a majority of the members).
      grader_id: the panel's id in verdicts and reports.
    """

    def __init__(
        self,
        members: Sequence[Any],
        *,
        aggregation: str = "majority",
        cheat_aggregation: str = "max_severity",
        escalate_to: Any = None,
        escalate_above: float = 0.5,
        min_members: int | None = None,
        grader_id: str = "panel",
    ):
        members = list(members)
        if len(members) < 2:
            raise ValueError(f"Panel.members: expected at least 2 graders, got {len(members)}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"Panel.aggregation: expected one of {AGGREGATIONS}, got {aggregation!r}"
            )
        if cheat_aggregation not in CHEAT_AGGREGATIONS:
            raise ValueError(
                f"Panel.cheat_aggregation: expected one of {CHEAT_AGGREGATIONS}, "
                f"got {cheat_aggregation!r}"
            )
        if not 0.0 <= escalate_above <= 1.0:
            raise ValueError(
                f"Panel.escalate_above: expected a fraction in [0, 1], got {escalate_above!r}"
            )
        self.members = members
        self.aggregation = aggregation
        self.cheat_aggregation = cheat_aggregation
        self.escalate_to = escalate_to
        self.escalate_above = float(escalate_above)
        self.min_members = min_members if min_members is not None else len(members) // 2 + 1
        if not 1 <= self.min_members <= len(members):
            raise ValueError(f"Panel.min_members: expected 1..{len(members)}, got {min_members}")
        self.grader_id = grader_id
        names = "+".join(_member_id(m) for m in members)
        esc = f">{_member_id(escalate_to)}" if escalate_to is not None else ""
        self.version = f"{aggregation}-{len(members)}" + ("-esc" if escalate_to is not None else "")
        self.description = f"{aggregation}/{cheat_aggregation}[{names}]{esc}"
        self.cache_id = f"{grader_id}@{self.description}/{self.min_members}/{self.escalate_above}"
        self.disagreements: dict[str, float] = {}
        self.escalated: set[str] = set()
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Verdict:
        t0 = time.monotonic()
        accepted, errors = [], []
        for m in self.members:
            if cancel is not None and cancel.is_set():
                break
            s = time.monotonic()
            try:
                out = _call(m, workspace, cancel)
                accepted.append(accept_output(out, workspace, m, time.monotonic() - s))
            except Exception as e:  # noqa: BLE001 - a member's failure is counted, not fatal
                errors.append(f"{_member_id(m)}: {type(e).__name__}: {e}"[:300])
                self._count("member_failures")
        if len(accepted) < self.min_members:
            raise VerdictRejected(
                RejectReason.BUDGET_EXHAUSTED if not errors else RejectReason.MALFORMED,
                f"{len(accepted)}/{len(self.members)} panel members accepted "
                f"(< {self.min_members}): {'; '.join(errors)}",
            )
        d = disagreement(accepted, workspace)
        with self._lock:
            self.disagreements[workspace.group_id] = d
            self._counts["groups"] += 1
        if self.escalate_to is not None and d > self.escalate_above:
            self._count("escalated")
            with self._lock:
                self.escalated.add(workspace.group_id)
            s = time.monotonic()
            out = _call(self.escalate_to, workspace, cancel)
            v = accept_output(out, workspace, self.escalate_to, time.monotonic() - s)
            return dataclasses.replace(
                v,
                grader_id=self.grader_id,
                grader_version=self.version,
                latency_s=time.monotonic() - t0,
            )
        return aggregate(
            accepted,
            workspace,
            aggregation=self.aggregation,
            cheat_aggregation=self.cheat_aggregation,
            grader_id=self.grader_id,
            grader_version=self.version,
            latency_s=time.monotonic() - t0,
        )

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def metrics(self) -> dict[str, float]:
        with self._lock:
            d = list(self.disagreements.values())
            return {
                "panel/groups": float(self._counts["groups"]),
                "panel/escalated": float(self._counts["escalated"]),
                "panel/member_failures": float(self._counts["member_failures"]),
                "panel/disagreement_mean": sum(d) / len(d) if d else 0.0,
            }


def _member_id(g: Any) -> str:
    return f"{getattr(g, 'grader_id', type(g).__name__)}@{getattr(g, 'version', '')}"


def default_panel(
    set_name: str = "toy", *, aggregation: str = "majority", escalate: bool = False
) -> Panel:
    """The panels the evaluation CLI measures (``panel``, ``panel_mean_rank``,
    ``panel_escalate``): the heuristic grader, a stricter heuristic (more weight on minimality
    and side effects, T1 only when flawless) and the scripted tool-loop grader; cheats by
    ``max_severity``. With ``escalate``, groups the members split on (more than half the
    candidates) go to the heuristic grader alone: no grader stronger than the members exists on
    CPU, so this measures what escalating to the best single member costs or gains."""

    strict = HeuristicGrader(
        HeuristicConfig(weights=(0.2, 0.2, 0.25, 0.25, 0.1), t1_at_least=0.98, t3_below=0.85)
    )
    strict.grader_id = "heuristic_strict"
    runner = ToyCheckRunner() if set_name == "toy" else None
    scripted = AgenticGrader(ScriptedGraderPolicy(), check_runner=runner)
    scripted.grader_id = "scripted"
    return Panel(
        [HeuristicGrader(), strict, scripted],
        aggregation=aggregation,
        escalate_to=HeuristicGrader() if escalate else None,
        escalate_above=0.5,
    )
