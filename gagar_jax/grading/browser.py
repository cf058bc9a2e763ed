"""The browser judge as a grader: checklist pass rate -> tiers for front-end task groups.

``BrowserGrader(judge, rubric_for)`` grades a ``GroupWorkspace`` whose repository is a front-end
artifact (HTML/JS files): for every passing candidate it applies the candidate's patch to the
pristine files in a fresh directory, runs ``verify.browser.BrowserJudge.judge`` on it and maps
the verdict's checklist pass rate to a tier (``pass_rate >= t1`` -> T1, ``>= t2`` -> T2, else
T3; defaults 1.0 / 0.75), ranks by pass rate (dense, best first) and scores ``solution_fit`` by
the pass rate (the other four dimensions are not measured by a browser and stay 1.0).

No LLM reads the page here: the judge's optional LLM stages (``verify.browser_llm``) enclose
everything the page produced in per-call delimiters (``verify.untrusted.Envelope``) and read one
answer object per reply. The evidence notes below quote page text with control characters
escaped (``untrusted.sanitize``).

Evidence for every tier-2/3 candidate (``schema.validate`` requires it): the execution line
``FAIL <item>: ...`` when that exact text is in the candidate's test log (the front-end family's
verifier writes the same report), otherwise the first file of the candidate's patch, with the
failing items, their frames and selectors in the note.

A judge that cannot run (``status="infra_error"``: the browser did not start or died) raises
``BrowserGradingError``; the pool turns it into its ``grader_error`` fallback (the group keeps
its original advantages) and ``metrics["infra_error"]`` counts it. The pool's ``deadline_s``
covers a judge that takes too long.
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any

from gagar_jax.grading import schema
from gagar_jax.grading.schema import DIMENSIONS, Evidence, GroupWorkspace, Judgement, Verdict
from gagar_jax.verify.untrusted import sanitize


class BrowserGradingError(RuntimeError):
    """The browser judge could not judge a candidate (infrastructure): the pool falls back."""


def tier_of(pass_rate: float, thresholds: tuple[float, float] = (1.0, 0.75)) -> int:
    """T1 if ``pass_rate >= thresholds[0]``, T2 if ``>= thresholds[1]``, else T3."""
    t1, t2 = thresholds
    return 1 if pass_rate >= t1 - 1e-9 else 2 if pass_rate >= t2 - 1e-9 else 3


def write_artifact(root: str, files: Mapping[str, str]) -> None:
    """Writes ``{path: text}`` under ``root`` (paths must stay inside it)."""
    for path, text in files.items():
        full = os.path.normpath(os.path.join(root, path))
        if not full.startswith(os.path.normpath(root) + os.sep):
            raise ValueError(f"artifact path {path!r} escapes the artifact directory")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)


class BrowserGrader:
    """Grades front-end groups with a ``BrowserJudge`` (see the module docstring).

    Args:
      judge: a ``gagar_jax.verify.browser.BrowserJudge`` (``keep_browser=True`` saves a launch
        per candidate).
      rubric_for: workspace -> rubric (dict or ``Rubric``) of the group's task.
      tier_thresholds: ``(t1, t2)`` pass-rate thresholds.
    """

    grader_id = "browser"

    def __init__(
        self,
        judge: Any,
        rubric_for: Callable[[GroupWorkspace], Any],
        *,
        tier_thresholds: tuple[float, float] = (1.0, 0.75),
    ):
        t1, t2 = tier_thresholds
        if not 0.0 <= t2 <= t1 <= 1.0:
            raise ValueError(
                f"BrowserGrader.tier_thresholds must be 0 <= t2 <= t1 <= 1, got {tier_thresholds}"
            )
        self.judge = judge
        self.rubric_for = rubric_for
        self.tier_thresholds = (float(t1), float(t2))
        self.version = f"v1/t{t1:g}-{t2:g}"
        self.cache_id = f"{self.grader_id}@{self.version}"
        self.metrics: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.metrics[key] += 1

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Verdict:
        rubric = self.rubric_for(workspace)
        rated = []
        for cand in workspace.passing:
            if cancel is not None and cancel.is_set():
                raise BrowserGradingError("cancelled by the pool")
            files = workspace.tree_of(cand)
            with tempfile.TemporaryDirectory(prefix="gagar-frontend-") as d:
                write_artifact(d, files)
                v = self.judge.judge(d, rubric)
            self._count("judged")
            if v.status != "ok":
                self._count("infra_error")
                raise BrowserGradingError(
                    f"browser judge infra_error on {cand.candidate_id}: {v.detail[:300]}"
                )
            rated.append((cand, v))
        rates = sorted({round(v.pass_rate, 9) for _, v in rated}, reverse=True)
        rank_of = {r: i + 1 for i, r in enumerate(rates)}
        judgements = []
        for cand, v in rated:
            rate = v.pass_rate
            tier = tier_of(rate, self.tier_thresholds)
            self._count(f"tier/{tier}")
            scores = {d: 1.0 for d in DIMENSIONS} | {"solution_fit": float(rate)}
            evidence = ()
            if tier >= 2 or rate < schema.NEGATIVE_SCORE:
                evidence = (self._evidence(cand, v),)
            judgements.append(
                Judgement(
                    cand.candidate_id, tier, rank_of[round(rate, 9)], scores, evidence=evidence
                )
            )
        return schema.validate(
            Verdict(workspace.group_id, tuple(judgements), self.grader_id, self.version),
            workspace,
        )

    @staticmethod
    def _evidence(cand: schema.Candidate, v: Any) -> Evidence:
        failing = [i for i in v.items if i.passed is False]
        # The items' evidence quotes the candidate's page: control characters escaped, so the
        # note cannot carry line breaks or terminal codes into whatever shows the verdict.
        note = sanitize(
            "; ".join(f"{i.id} (frame {i.frame}, {i.selector}): {i.evidence}" for i in failing)[
                :500
            ]
            or (v.fault or "")
        )
        note = note.replace("\r", "\\r").replace("\n", "\\n")  # one line
        for i in failing:
            quote = f"FAIL {i.id}: {i.evidence}"
            if quote in cand.test_log:
                return Evidence(
                    "solution_fit", "execution", cand.candidate_id, quote=quote, note=note
                )
        paths = cand.parsed_patch.paths
        if not paths:
            raise schema.VerdictRejected(
                schema.RejectReason.MISSING_EVIDENCE,
                f"candidate {cand.candidate_id!r}: failing items but no patch or log to cite",
            )
        return Evidence("solution_fit", "patch", cand.candidate_id, file=paths[0], note=note)
