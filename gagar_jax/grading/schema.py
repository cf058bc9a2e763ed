"""Typed grading inputs and verdicts, their validation, and the arrays the advantage kernels take.

A group is graded from a ``GroupWorkspace``: the task, a snapshot of the repository, and every
rollout of the group as a ``Candidate`` (passing ones are judged, failed ones are background).
A grader returns a ``Verdict``: for every passing candidate exactly once a ``Judgement`` with

- ``tier`` in 1..3 (T1 best) and ``rank`` >= 1 within the group (ties allowed: "no evidence"
  is a tie),
- ``scores`` on the five Gagar dimensions, each in [0, 1] (1 best),
- ``cheat`` with a reason,
- ``evidence``: for every negative judgement a pointer at something that exists in the workspace.

Negative judgements (each needs evidence whose ``claim`` names it):
  * a dimension scored below ``NEGATIVE_SCORE`` (claim = that dimension),
  * ``cheat=True`` (claim = ``"cheat"``),
  * ``tier >= 2`` needs at least one evidence item of any claim.

Evidence kinds and when they exist:
  * ``patch``: ``file`` is touched by the cited candidate's patch and, if ``line`` is given, a
    hunk of that file covers it (old or new side);
  * ``trajectory``: ``event`` indexes the cited candidate's trajectory;
  * ``execution``: ``quote`` (>= 3 non-blank characters) occurs in the cited candidate's test log,
    in one of its monitor flags' evidence, or in a check log produced while grading.

``validate`` turns anything else into ``VerdictRejected`` with a ``RejectReason``; ``parse_verdict``
reads JSON text or a dict (the LLM grader's output) and rejects malformed output the same way.
A rejected verdict is never a zero score: ``to_arrays`` gives such a group ``graded=False`` and
neutral tiers/ranks, and the kernels keep its original advantages.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gagar_jax.verify import diff, untrusted

DIMENSIONS = (
    "solution_fit",
    "implementation_precision",
    "minimality",
    "side_effect_avoidance",
    "codebase_consistency",
)
CLAIMS = DIMENSIONS + ("cheat",)
EVIDENCE_KINDS = ("patch", "trajectory", "execution")
NUM_TIERS = 3
NEGATIVE_SCORE = 0.5  # a dimension scored below this is a negative judgement and needs evidence
MIN_QUOTE_CHARS = 3
MAX_OUTPUT_CHARS = 200_000  # longer grader output is rejected unread
MAX_JSON_ATTEMPTS = 64  # '{' positions tried per chunk when looking for the verdict object


class RejectReason(enum.StrEnum):
    """Why a verdict was rejected by validation (the named reasons fallbacks are counted by)."""

    MALFORMED = "malformed_output"  # not JSON / wrong types / missing fields / out-of-range values
    MISSING_CANDIDATE = "missing_candidate"  # a passing candidate has no judgement
    DUPLICATE_CANDIDATE = "duplicate_candidate"  # a candidate is judged twice
    EXTRA_CANDIDATE = "extra_candidate"  # unknown id, or a candidate that did not pass
    TIER_RANK_INCONSISTENT = "tier_rank_inconsistent"  # a better tier ranked below a worse one
    MISSING_EVIDENCE = "missing_evidence"  # a negative judgement without evidence
    NONEXISTENT_EVIDENCE = "nonexistent_evidence"  # evidence pointing at nothing in the workspace
    WRONG_GROUP = "wrong_group"  # a verdict for another group
    BUDGET_EXHAUSTED = (
        "budget_exhausted"  # the agentic grader ran out of steps/time before a verdict
    )


class FallbackReason(enum.StrEnum):
    """Why a group got no accepted verdict (validation reasons plus the pool's own)."""

    MALFORMED = "malformed_output"
    MISSING_CANDIDATE = "missing_candidate"
    DUPLICATE_CANDIDATE = "duplicate_candidate"
    EXTRA_CANDIDATE = "extra_candidate"
    TIER_RANK_INCONSISTENT = "tier_rank_inconsistent"
    MISSING_EVIDENCE = "missing_evidence"
    NONEXISTENT_EVIDENCE = "nonexistent_evidence"
    WRONG_GROUP = "wrong_group"
    BUDGET_EXHAUSTED = "budget_exhausted"
    DEADLINE = "deadline"  # no verdict by the per-group deadline or the caller's timeout
    GRADER_ERROR = "grader_error"  # the grader raised
    CANCELLED = "cancelled"  # cancelled by the caller
    NOT_SUBMITTED = "not_submitted"  # results() asked for a group that was never submitted


class VerdictRejected(Exception):
    """A verdict failed validation; ``reason`` is a ``RejectReason``, ``detail`` says where."""

    def __init__(self, reason: RejectReason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = RejectReason(reason)
        self.detail = detail


# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrajectoryEvent:
    """One event of a rollout: a turn's action, tool call, observation or message.

    Attributes:
      turn: 0-based turn index.
      kind: ``"action"``, ``"tool_call"``, ``"observation"``, ``"message"`` or a family's own kind.
      text: the event's text (possibly truncated by the producer).
      tokens: model tokens spent on the event (0 for observations).
    """

    turn: int
    kind: str
    text: str
    tokens: int = 0


def _freeze_flag(flag: Any) -> MonitorFlagView:
    if isinstance(flag, MonitorFlagView):
        return flag
    if isinstance(flag, Mapping):
        return MonitorFlagView(
            str(flag["rule"]), str(flag.get("evidence", "")), bool(flag.get("confirmed", False))
        )
    # gagar_jax.verify.MonitorFlag or anything with the same attributes.
    return MonitorFlagView(str(flag.rule), str(flag.evidence), bool(flag.confirmed))


@dataclasses.dataclass(frozen=True)
class MonitorFlagView:
    """A behaviour-monitor flag as grading sees it (the fields of ``verify.MonitorFlag``)."""

    rule: str
    evidence: str
    confirmed: bool


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One rollout of a group as graders see it.

    Attributes:
      candidate_id: unique within the group.
      patch: the rollout's final patch as a unified diff (see ``gagar_jax.verify.diff``).
      passed: the verifier's outcome.
      test_log: the verifier's test output.
      trajectory: the rollout's events (dicts with the ``TrajectoryEvent`` fields are accepted).
      summary: per-turn summary text.
      monitor_flags: behaviour-monitor flags (``gagar_jax.verify.MonitorFlag``, dicts, or views).
      quality: optional family-specific quality features in [0, 1] (``Verification.quality``).
      applied: the patch as it applied to the repository (``verify.diff.AppliedPatch``): the
        one object every view of the candidate is built from. A ``GroupWorkspace`` sets it
        from its ``repo_files`` when the family did not; ``patch`` is then its canonical text
        (``applied.text``), so no text outside the applied hunks (a preamble, a hunk header's
        trailing words, a ``\\`` line's words) and no header number that lies survives. Give
        ``patch`` as "" or ``applied.text``; another text is another patch (``applied`` and
        ``prepared`` are dropped and the workspace locates it again).
        Without it (a patch that does not apply to the snapshot) ``patch`` is the canonical
        text of its parse, or "" when it does not parse.
      verdict_lines: the verifier's verdict as lines built from its structured result (status,
        per-test outcomes: nothing the candidate chose), when the family has one; graders show
        them as the verifier's and quote the log's whole header as untrusted notes.
      prepared: the tree the verifier ran the tests on (``verify.repo.prepare_tree``: protected
        files reset, hidden tests applied), as changes to the workspace's ``repo_files`` (path ->
        text, None for a file it removed; a few files, not a tree per candidate), when the
        family knows it: the grader's ``run_check`` runs there. None: checks run on
        ``applied.tree(repo_files)``.
    """

    candidate_id: str
    patch: str
    passed: bool
    test_log: str = ""
    trajectory: tuple[TrajectoryEvent, ...] = ()
    summary: str = ""
    monitor_flags: tuple[MonitorFlagView, ...] = ()
    quality: Mapping[str, float] = dataclasses.field(default_factory=dict)
    applied: diff.AppliedPatch | None = dataclasses.field(default=None, compare=False)
    verdict_lines: tuple[str, ...] = ()
    prepared: Mapping[str, str | None] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self):
        if not isinstance(self.candidate_id, str) or not self.candidate_id:
            raise ValueError(
                f"Candidate.candidate_id must be a non-empty str, got {self.candidate_id!r}"
            )
        if not isinstance(self.patch, str):
            raise TypeError(f"Candidate.patch must be str (a unified diff), got {type(self.patch)}")
        if self.applied is not None and self.patch not in ("", self.applied.text):
            # a different patch text (``dataclasses.replace(c, patch=...)``): its own parse
            object.__setattr__(self, "applied", None)
            object.__setattr__(self, "prepared", None)
        if self.applied is not None:
            if not isinstance(self.applied, diff.AppliedPatch):
                raise TypeError(
                    "Candidate.applied must be a verify.diff.AppliedPatch, got "
                    f"{type(self.applied).__name__}"
                )
            object.__setattr__(self, "patch", self.applied.text)
        else:
            object.__setattr__(self, "patch", canonical_text(self.patch))
            if self.patch:  # a prepared tree belongs to its applied patch (or the empty one)
                object.__setattr__(self, "prepared", None)
        events = tuple(
            e if isinstance(e, TrajectoryEvent) else TrajectoryEvent(**e) for e in self.trajectory
        )
        object.__setattr__(self, "trajectory", events)
        object.__setattr__(
            self, "monitor_flags", tuple(_freeze_flag(f) for f in self.monitor_flags)
        )
        object.__setattr__(self, "passed", bool(self.passed))
        object.__setattr__(self, "quality", dict(self.quality))
        object.__setattr__(self, "verdict_lines", tuple(str(x) for x in self.verdict_lines))

    @property
    def parsed_patch(self) -> diff.Patch:
        """The patch's files and hunks: ``applied.patch`` when set (hunks where they applied)."""
        return self.applied.patch if self.applied is not None else _parsed(self.patch)

    @property
    def confirmed_cheat(self) -> bool:
        return any(f.confirmed for f in self.monitor_flags)

    @property
    def num_turns(self) -> int:
        return len({e.turn for e in self.trajectory})

    @property
    def num_tokens(self) -> int:
        return sum(e.tokens for e in self.trajectory)


_PARSE_CACHE: dict[str, diff.Patch] = {}


def _parsed(patch: str) -> diff.Patch:
    hit = _PARSE_CACHE.get(patch)
    if hit is None:
        if len(_PARSE_CACHE) > 4096:
            _PARSE_CACHE.clear()
        try:
            hit = diff.read_patch(patch)
        except (RecursionError, MemoryError):  # one candidate's patch: it reads empty
            hit = diff.Patch()
        _PARSE_CACHE[patch] = hit
    return hit


def canonical_text(patch: str) -> str:
    """The canonical unified diff of ``patch``'s parse (``verify.diff.render_patch``); "" when it
    does not parse. Idempotent: canonical text is its own canonical text."""
    if not patch:
        return ""
    return diff.render_patch(_parsed(patch))


def _located(c: Candidate, repo_files: Mapping[str, str]) -> Candidate:
    """``c`` with ``applied`` set from ``repo_files`` when its patch applies there."""
    if c.applied is not None or not c.patch:
        return c
    try:
        applied = diff.apply_patch(repo_files, c.parsed_patch)
    except (diff.DiffError, RecursionError, MemoryError):
        return c  # the views show the parse (it did not apply to this snapshot)
    return dataclasses.replace(c, patch="", applied=applied)


@dataclasses.dataclass(frozen=True)
class GroupWorkspace:
    """Everything a grader may look at for one group.

    Attributes:
      group_id: unique per group within a run.
      task_text: the task statement.
      repo_files: the repository snapshot before any patch, path -> text.
      candidates: every rollout of the group, in slot order (candidate k fills rollout slot k).
      scope_files: files the task is about, when the family knows them; graders infer the scope
        from the group otherwise.
    """

    group_id: str
    task_text: str
    repo_files: Mapping[str, str]
    candidates: tuple[Candidate, ...]
    scope_files: tuple[str, ...] = ()

    def __post_init__(self):
        cands = tuple(self.candidates)
        ids = [c.candidate_id for c in cands]
        if len(set(ids)) != len(ids):
            raise ValueError(f"GroupWorkspace.candidates: candidate ids must be unique, got {ids}")
        object.__setattr__(self, "repo_files", dict(self.repo_files))
        # every view of a candidate reads its patch as it applies to this snapshot
        cands = tuple(_located(c, self.repo_files) for c in cands)
        object.__setattr__(self, "candidates", cands)
        object.__setattr__(self, "scope_files", tuple(self.scope_files))

    @property
    def passing(self) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.passed)

    def tree_of(self, candidate: Candidate) -> dict[str, str]:
        """The tree ``candidate``'s code runs in for a check: the verifier's prepared tree when
        the family gave it (``prepared``), else ``repo_files`` with its applied patch.
        Never a re-application of the text the policy wrote; ``verify.diff.DiffError`` when
        the patch did not apply to the snapshot."""
        if candidate.prepared is not None:
            out = dict(self.repo_files)
            for path, text in candidate.prepared.items():
                if text is None:
                    out.pop(path, None)
                else:
                    out[path] = text
            return out
        if candidate.applied is None:
            if not candidate.patch:
                return dict(self.repo_files)
            raise diff.DiffError(
                f"the patch of {candidate.candidate_id} did not apply to the snapshot"
            )
        return candidate.applied.tree(self.repo_files)

    def candidate(self, candidate_id: str) -> Candidate | None:
        for c in self.candidates:
            if c.candidate_id == candidate_id:
                return c
        return None

    def content_key(self) -> str:
        """SHA-256 of the workspace's content (everything a grader sees), stable across runs."""
        payload = {
            "group_id": self.group_id,
            "task": self.task_text,
            "repo": sorted(self.repo_files.items()),
            "scope": list(self.scope_files),
            "candidates": [
                [
                    c.candidate_id,
                    c.patch,
                    c.passed,
                    c.test_log,
                    c.summary,
                    [dataclasses.astuple(e) for e in c.trajectory],
                    [dataclasses.astuple(f) for f in c.monitor_flags],
                    sorted((k, float(v)) for k, v in c.quality.items()),
                ]
                for c in self.candidates
            ],
        }
        blob = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# Verdict
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Evidence:
    """A pointer at something in the workspace that backs a negative judgement.

    Attributes:
      claim: the judgement it backs: one of ``DIMENSIONS`` or ``"cheat"``.
      kind: ``"patch"``, ``"trajectory"`` or ``"execution"``.
      candidate_id: whose artefact is cited (any candidate of the group, failed ones included).
      file, line: for ``patch`` evidence (``line`` optional, 1-based).
      event: for ``trajectory`` evidence, the index into the cited candidate's trajectory.
      quote: for ``execution`` evidence, text that occurs in the cited execution output.
      note: free text, the grader's explanation.
    """

    claim: str
    kind: str
    candidate_id: str
    file: str | None = None
    line: int | None = None
    event: int | None = None
    quote: str | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The verdict on one passing candidate. ``scores`` maps each of ``DIMENSIONS`` to [0, 1]."""

    candidate_id: str
    tier: int
    rank: int
    scores: Mapping[str, float]
    cheat: bool = False
    cheat_reason: str = ""
    evidence: tuple[Evidence, ...] = ()

    def weighted_score(self, weights: Mapping[str, float] | None = None) -> float:
        weights = weights or {d: 1.0 for d in DIMENSIONS}
        total = sum(weights.values())
        return sum(weights[d] * float(self.scores[d]) for d in DIMENSIONS) / total


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A grader's verdict on one group.

    Attributes:
      group_id: the graded group.
      judgements: one per passing candidate.
      grader_id, grader_version: which grader (and prompt/rule version) produced it.
      latency_s: wall time the grader spent.
      votes: number of accepted self-consistency votes merged into it (1 without voting).
      agreement: mean fraction of votes agreeing with the majority tier (None without voting).
    """

    group_id: str
    judgements: tuple[Judgement, ...]
    grader_id: str
    grader_version: str
    latency_s: float = 0.0
    votes: int = 1
    agreement: float | None = None

    def judgement(self, candidate_id: str) -> Judgement | None:
        for j in self.judgements:
            if j.candidate_id == candidate_id:
                return j
        return None


def _check_evidence(
    ev: Evidence, workspace: GroupWorkspace, check_logs: Mapping[str, Sequence[str]]
) -> str | None:
    """Returns why ``ev`` does not exist in the workspace, or None when it does."""
    cand = workspace.candidate(ev.candidate_id)
    if cand is None:
        return f"evidence cites unknown candidate {ev.candidate_id!r}"
    if ev.kind == "patch":
        if not ev.file or not cand.parsed_patch.has_location(ev.file, ev.line):
            return (
                f"patch location {ev.file}:{ev.line} is not in candidate "
                f"{ev.candidate_id!r}'s patch"
            )
    elif ev.kind == "trajectory":
        if ev.event is None or not 0 <= ev.event < len(cand.trajectory):
            return (
                f"trajectory event {ev.event} out of range for candidate {ev.candidate_id!r} "
                f"({len(cand.trajectory)} events)"
            )
    elif ev.kind == "execution":
        quote = (ev.quote or "").strip()
        if len(quote) < MIN_QUOTE_CHARS:
            return f"execution evidence needs a quote of >= {MIN_QUOTE_CHARS} characters"
        sources = [
            cand.test_log,
            *(f.evidence for f in cand.monitor_flags),
            *check_logs.get(ev.candidate_id, ()),
        ]
        plain = untrusted.unmark(quote)  # the grader saw candidate lines marked with "| "
        # ... and escapes of what it could not be shown (controls, letters posing as Latin).
        if not any(quote in s or plain in s for s in sources) and not any(
            quote in t or plain in t for t in map(untrusted.sanitize, sources)
        ):
            return f"quote {quote[:40]!r} not in candidate {ev.candidate_id!r}'s execution output"
    else:
        return f"evidence kind {ev.kind!r} not in {EVIDENCE_KINDS}"
    return None


def _check_types(verdict: Verdict) -> None:
    """Structural checks on a constructed ``Verdict`` (parse_verdict guarantees these for JSON)."""
    if not isinstance(verdict, Verdict):
        raise VerdictRejected(
            RejectReason.MALFORMED, f"expected a Verdict, got {type(verdict).__name__}"
        )
    for j in verdict.judgements:
        if not isinstance(j, Judgement):
            raise VerdictRejected(RejectReason.MALFORMED, f"judgement of type {type(j).__name__}")
        where = f"candidate {j.candidate_id!r}"
        if not _is_int(j.tier) or not 1 <= j.tier <= NUM_TIERS:
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}: tier {j.tier!r} not in 1..{NUM_TIERS}"
            )
        if not _is_int(j.rank) or j.rank < 1:
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}: rank {j.rank!r} must be an int >= 1"
            )
        if not isinstance(j.scores, Mapping) or set(j.scores) != set(DIMENSIONS):
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}: scores must have exactly the keys {DIMENSIONS}"
            )
        for d in DIMENSIONS:
            s = j.scores[d]
            if not _is_number(s) or not 0.0 <= float(s) <= 1.0:
                raise VerdictRejected(
                    RejectReason.MALFORMED, f"{where}: score {d}={s!r} not in [0, 1]"
                )
        if not isinstance(j.cheat, bool):
            raise VerdictRejected(RejectReason.MALFORMED, f"{where}: cheat must be a bool")
        if j.cheat and not (isinstance(j.cheat_reason, str) and j.cheat_reason.strip()):
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}: cheat=true needs a cheat_reason"
            )
        for ev in j.evidence:
            if (
                not isinstance(ev, Evidence)
                or ev.claim not in CLAIMS
                or ev.kind not in EVIDENCE_KINDS
            ):
                raise VerdictRejected(RejectReason.MALFORMED, f"{where}: malformed evidence {ev!r}")


# What malformed input can make Python itself raise while it is read: a number too large for a
# float (OverflowError), an int over the 4,300-digit str limit (ValueError), deep nesting
# (RecursionError), a wrong type met by an operation (TypeError, ...). Each becomes a named
# rejection (``malformed_output``); every check is linear in the input, so time is bounded.
_PYTHON_ERRORS = (
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
    KeyError,
    IndexError,
    AttributeError,
    UnicodeError,
)


def _malformed(e: BaseException, where: str) -> VerdictRejected:
    try:
        msg = str(e)[:200]
    except Exception:  # noqa: BLE001 - the message itself may be unprintable
        msg = ""
    return VerdictRejected(RejectReason.MALFORMED, f"{where}: {type(e).__name__} {msg}".strip())


RANK_POLICIES = ("strict", "tier_first")
SCORE_POLICIES = ("cite", "drop_uncited")


def ranks_follow_tiers(verdict: Verdict) -> bool:
    """True when no candidate of a better tier has a rank that is not better than a worse tier's."""
    js = verdict.judgements
    return all(a.rank < b.rank for a in js for b in js if a.tier < b.tier)


def order_ranks_by_tier(verdict: Verdict) -> Verdict:
    """``verdict`` with ranks renumbered densely in (tier, rank) order: equal (tier, rank) pairs
    share a rank, the order inside each tier is kept, and every better tier ranks above every
    worse one. A verdict whose ranks already follow its tiers keeps its order (its ranks are
    made dense)."""
    keys = sorted({(j.tier, j.rank) for j in verdict.judgements})
    new = {k: i + 1 for i, k in enumerate(keys)}
    return dataclasses.replace(
        verdict,
        judgements=tuple(
            dataclasses.replace(j, rank=new[(j.tier, j.rank)]) for j in verdict.judgements
        ),
    )


def uncited_dimensions(j: Judgement) -> list[str]:
    """The dimensions ``j`` scores below ``NEGATIVE_SCORE`` with no evidence item of that claim,
    in ``DIMENSIONS`` order."""
    claims = {ev.claim for ev in j.evidence}
    return [d for d in DIMENSIONS if float(j.scores[d]) < NEGATIVE_SCORE and d not in claims]


def drop_uncited_scores(verdict: Verdict) -> Verdict:
    """``verdict`` with every dimension scored below ``NEGATIVE_SCORE`` without evidence of that
    claim raised to ``NEGATIVE_SCORE``: a negative judgement nobody cited is not believed.
    Tiers, ranks, cheat flags and evidence are unchanged, and so are cited scores."""
    out = []
    for j in verdict.judgements:
        uncited = set(uncited_dimensions(j))
        scores = {d: NEGATIVE_SCORE if d in uncited else v for d, v in j.scores.items()}
        out.append(dataclasses.replace(j, scores=scores))
    return dataclasses.replace(verdict, judgements=tuple(out))


def validate(
    verdict: Verdict,
    workspace: GroupWorkspace,
    *,
    check_logs: Mapping[str, Sequence[str]] | None = None,
    ranks: str = "strict",
    scores: str = "cite",
) -> Verdict:
    """Validates ``verdict`` against ``workspace`` (see ``_validate``); any other exception a
    malformed value provokes is a ``malformed_output`` rejection."""
    if ranks not in RANK_POLICIES:
        raise ValueError(f"ranks: expected one of {RANK_POLICIES}, got {ranks!r}")
    if scores not in SCORE_POLICIES:
        raise ValueError(f"scores: expected one of {SCORE_POLICIES}, got {scores!r}")
    try:
        return _validate(verdict, workspace, check_logs=check_logs, ranks=ranks, scores=scores)
    except VerdictRejected:
        raise
    except _PYTHON_ERRORS as e:
        raise _malformed(e, "verdict") from None


def _validate(
    verdict: Verdict,
    workspace: GroupWorkspace,
    *,
    check_logs: Mapping[str, Sequence[str]] | None = None,
    ranks: str = "strict",
    scores: str = "cite",
) -> Verdict:
    """Validates ``verdict`` against ``workspace``; returns it with ranks made dense.

    Args:
      verdict: the grader's verdict.
      workspace: the group it claims to judge.
      check_logs: candidate id -> outputs of checks the grader ran (extra execution evidence).
      ranks: ``"strict"``: a better tier ranked below a worse one is rejected
        (``tier_rank_inconsistent``). ``"tier_first"``: the tiers are the verdict and the ranks
        only order candidates within a tier, so the ranks are renumbered in (tier, rank) order
        first (``order_ranks_by_tier``) and no verdict is rejected for them; the order inside
        each tier, which is what the discount factors read, is the verdict's own.
      scores: ``"cite"``: a dimension scored below ``NEGATIVE_SCORE`` without evidence of that
        claim is rejected (``missing_evidence``). ``"drop_uncited"``: such a score is raised to
        ``NEGATIVE_SCORE`` first (``drop_uncited_scores``) and the verdict is judged on the
        rest; a cheat flag or a tier 2 or 3 without evidence is still rejected.

    Returns:
      The verdict, ranks renumbered densely (1, 1, 2, ...) in the same order.

    Raises:
      VerdictRejected: with the first violated rule's ``RejectReason`` (see module docstring).
    """
    check_logs = check_logs or {}
    _check_types(verdict)
    if verdict.group_id != workspace.group_id:
        raise VerdictRejected(
            RejectReason.WRONG_GROUP,
            f"verdict for group {verdict.group_id!r}, workspace {workspace.group_id!r}",
        )
    passing = {c.candidate_id for c in workspace.passing}
    seen: set[str] = set()
    for j in verdict.judgements:
        if j.candidate_id in seen:
            raise VerdictRejected(
                RejectReason.DUPLICATE_CANDIDATE, f"candidate {j.candidate_id!r} judged twice"
            )
        seen.add(j.candidate_id)
        if j.candidate_id not in passing:
            raise VerdictRejected(
                RejectReason.EXTRA_CANDIDATE,
                f"candidate {j.candidate_id!r} is unknown or did not pass",
            )
    missing = sorted(passing - seen)
    if missing:
        raise VerdictRejected(RejectReason.MISSING_CANDIDATE, f"no judgement for {missing}")
    if ranks == "tier_first":
        verdict = order_ranks_by_tier(verdict)
    if scores == "drop_uncited":
        verdict = drop_uncited_scores(verdict)
    js = verdict.judgements
    for a in js:
        for b in js:
            if a.tier < b.tier and not a.rank < b.rank:
                raise VerdictRejected(
                    RejectReason.TIER_RANK_INCONSISTENT,
                    f"{a.candidate_id!r} (tier {a.tier}, rank {a.rank}) is not ranked above "
                    f"{b.candidate_id!r} (tier {b.tier}, rank {b.rank})",
                )
    for j in js:
        uncited = uncited_dimensions(j)
        uncited += ["cheat"] if j.cheat and "cheat" not in {ev.claim for ev in j.evidence} else []
        if uncited:
            raise VerdictRejected(
                RejectReason.MISSING_EVIDENCE,
                f"candidate {j.candidate_id!r}: negative {uncited[0]!r} without evidence",
            )
        if j.tier >= 2 and not j.evidence:
            raise VerdictRejected(
                RejectReason.MISSING_EVIDENCE,
                f"candidate {j.candidate_id!r}: tier {j.tier} without evidence",
            )
        for ev in j.evidence:
            why = _check_evidence(ev, workspace, check_logs)
            if why is not None:
                raise VerdictRejected(
                    RejectReason.NONEXISTENT_EVIDENCE, f"candidate {j.candidate_id!r}: {why}"
                )
    dense = {r: i + 1 for i, r in enumerate(sorted({j.rank for j in js}))}
    return dataclasses.replace(
        verdict, judgements=tuple(dataclasses.replace(j, rank=dense[j.rank]) for j in js)
    )


# ------------------------------------------------------------------------------------------------
# JSON
# ------------------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (
        isinstance(x, int | float | np.integer | np.floating)
        and not isinstance(x, bool)
        and math.isfinite(float(x))
    )


def verdict_to_dict(verdict: Verdict) -> dict[str, Any]:
    """The JSON form ``parse_verdict`` reads (and the cache stores)."""
    return {
        "group_id": verdict.group_id,
        "grader_id": verdict.grader_id,
        "grader_version": verdict.grader_version,
        "latency_s": verdict.latency_s,
        "votes": verdict.votes,
        "agreement": verdict.agreement,
        "verdicts": [
            {
                "candidate": j.candidate_id,
                "tier": j.tier,
                "rank": j.rank,
                "scores": {d: float(j.scores[d]) for d in DIMENSIONS},
                "cheat": j.cheat,
                "cheat_reason": j.cheat_reason,
                "evidence": [
                    {
                        k: v
                        for k, v in dataclasses.asdict(ev).items()
                        if v is not None and k != "candidate_id"
                    }
                    | {"candidate": ev.candidate_id}
                    for ev in j.evidence
                ],
            }
            for j in verdict.judgements
        ],
    }


def extract_json(text: str) -> Any:
    """The one verdict object in a grader's text reply. Raises VerdictRejected(MALFORMED).

    The reply is scanned for top-level JSON objects (fenced or bare; an object inside another,
    or inside a string, is part of that one). A reply must hold exactly one verdict (an object
    with ``"verdicts"``): a second one means the grader quoted one (a verdict planted in a
    candidate's text would otherwise win), so the reply is rejected, never read in part. With
    no verdict, the first object is returned (validation then names what is missing).
    """
    if not isinstance(text, str):
        raise VerdictRejected(RejectReason.MALFORMED, f"expected text, got {type(text).__name__}")
    if len(text) > MAX_OUTPUT_CHARS:
        raise VerdictRejected(
            RejectReason.MALFORMED, f"output of {len(text)} chars exceeds {MAX_OUTPUT_CHARS}"
        )
    if text.count('"verdicts"') > 1:  # linear, whatever the scan below gets to read
        raise VerdictRejected(
            RejectReason.MALFORMED,
            f'the reply names "verdicts" {text.count(chr(34) + "verdicts" + chr(34))} times; '
            "answer with exactly one verdict (a quoted verdict is never read)",
        )
    decoder = json.JSONDecoder()
    objects: list[dict] = []
    start = text.find("{")
    attempts = 0
    # Bounded attempts keep pathological text (many unterminated objects) linear-ish.
    while start != -1 and attempts < MAX_JSON_ATTEMPTS:
        attempts += 1
        try:
            obj, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):  # JSONDecodeError, an int over 4,300 digits
            start = text.find("{", start + 1)
            continue
        if isinstance(obj, dict):
            objects.append(obj)
        start = text.find("{", end)
    verdicts = [o for o in objects if "verdicts" in o]
    if len(verdicts) > 1:
        raise VerdictRejected(
            RejectReason.MALFORMED,
            f"the reply holds {len(verdicts)} verdict objects; answer with exactly one "
            "(a quoted verdict is never read)",
        )
    if verdicts:
        return verdicts[0]
    if objects:
        return objects[0]
    raise VerdictRejected(RejectReason.MALFORMED, f"no JSON object in output ({len(text)} chars)")


def _need(obj: Mapping[str, Any], key: str, types: tuple[type, ...] | type, where: str) -> Any:
    if key not in obj:
        raise VerdictRejected(RejectReason.MALFORMED, f"{where}: missing field {key!r}")
    val = obj[key]
    if not isinstance(val, types) or (isinstance(val, bool) and bool not in _as_tuple(types)):
        raise VerdictRejected(
            RejectReason.MALFORMED, f"{where}: field {key!r} has type {type(val).__name__}"
        )
    return val


def _as_tuple(types: tuple[type, ...] | type) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _opt(obj: Mapping[str, Any], key: str, types: tuple[type, ...] | type, where: str) -> Any:
    if obj.get(key) is None:
        return None
    return _need(obj, key, types, where)


def parse_verdict(
    output: str | Mapping[str, Any],
    workspace: GroupWorkspace,
    *,
    grader_id: str,
    grader_version: str,
    latency_s: float = 0.0,
    check_logs: Mapping[str, Sequence[str]] | None = None,
    id_map: Mapping[str, str] | None = None,
    ranks: str = "strict",
    scores: str = "cite",
) -> Verdict:
    """Parses a grader's JSON output into a validated ``Verdict`` (see ``_parse_verdict``).

    Every input is accepted or rejected with a ``VerdictRejected`` naming the reason: huge
    numbers, deep nesting and wrong types included (``malformed_output``). ``ranks`` and
    ``scores`` are ``validate``'s policies.
    """
    try:
        return _parse_verdict(
            output,
            workspace,
            grader_id=grader_id,
            grader_version=grader_version,
            latency_s=latency_s,
            check_logs=check_logs,
            id_map=id_map,
            ranks=ranks,
            score_policy=scores,
        )
    except VerdictRejected:
        raise
    except _PYTHON_ERRORS as e:
        raise _malformed(e, "verdict") from None


def _parse_verdict(
    output: str | Mapping[str, Any],
    workspace: GroupWorkspace,
    *,
    grader_id: str,
    grader_version: str,
    latency_s: float = 0.0,
    check_logs: Mapping[str, Sequence[str]] | None = None,
    id_map: Mapping[str, str] | None = None,
    ranks: str = "strict",
    score_policy: str = "cite",
) -> Verdict:
    """Parses a grader's JSON output (text or dict) into a validated ``Verdict``.

    Expected form (``group_id`` optional; the workspace's is used)::

      {"verdicts": [{"candidate": "C1", "tier": 1, "rank": 1,
                     "scores": {"solution_fit": 0.9, ...all five...},
                     "cheat": false, "cheat_reason": "",
                     "evidence": [{"claim": "minimality", "kind": "patch", "candidate": "C1",
                                   "file": "a.py", "line": 3, "note": "..."}]}]}

    Args:
      output: the grader's text (JSON possibly inside a ``json`` fence) or an already-decoded dict.
      workspace: the group judged (validation target).
      grader_id, grader_version, latency_s: recorded on the verdict.
      check_logs: see ``validate``.
      id_map: alias -> real candidate id (anonymised graders). When given, every candidate named
        in the output must be an alias: a real id (which the grader never saw) or an unknown name
        is rejected (``extra_candidate`` for a judgement, ``nonexistent_evidence`` for evidence).
      ranks: see ``validate``.

    Raises:
      VerdictRejected: malformed output, or any validation failure.
    """
    obj = extract_json(output) if isinstance(output, str) else output
    if not isinstance(obj, Mapping):
        raise VerdictRejected(
            RejectReason.MALFORMED, f"expected an object, got {type(obj).__name__}"
        )

    def real(name: str, reason: RejectReason, where: str) -> str:
        if id_map is None:
            return name
        if name not in id_map:
            raise VerdictRejected(reason, f"{where}: unknown candidate {name!r}")
        return id_map[name]

    items = _need(obj, "verdicts", list, "verdict")
    judgements = []
    for i, item in enumerate(items):
        where = f"verdicts[{i}]"
        if not isinstance(item, Mapping):
            raise VerdictRejected(RejectReason.MALFORMED, f"{where}: expected an object")
        cid = _need(item, "candidate", str, where)
        tier = _need(item, "tier", int, where)
        rank = _need(item, "rank", int, where)
        scores_obj = _need(item, "scores", Mapping, where)
        scores = {}
        for d in DIMENSIONS:
            s = _need(scores_obj, d, (int, float), f"{where}.scores")
            if isinstance(s, int) and not -(10**6) <= s <= 10**6:
                raise VerdictRejected(RejectReason.MALFORMED, f"{where}.scores: {d} out of range")
            if not math.isfinite(float(s)):
                raise VerdictRejected(RejectReason.MALFORMED, f"{where}.scores: {d} is not finite")
            scores[d] = float(s)
        extra = set(scores_obj) - set(DIMENSIONS)
        if extra:
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}.scores: unknown keys {sorted(extra)}"
            )
        cheat = item.get("cheat", False)
        if not isinstance(cheat, bool):
            raise VerdictRejected(RejectReason.MALFORMED, f"{where}: field 'cheat' must be a bool")
        reason = item.get("cheat_reason") or ""
        if not isinstance(reason, str):
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}: field 'cheat_reason' must be text"
            )
        evs = item.get("evidence") or []
        if not isinstance(evs, list):
            raise VerdictRejected(
                RejectReason.MALFORMED, f"{where}: field 'evidence' must be a list"
            )
        evidence = []
        for e, ev in enumerate(evs):
            ew = f"{where}.evidence[{e}]"
            if not isinstance(ev, Mapping):
                raise VerdictRejected(RejectReason.MALFORMED, f"{ew}: expected an object")
            claim = _need(ev, "claim", str, ew)
            kind = _need(ev, "kind", str, ew)
            if claim not in CLAIMS:
                raise VerdictRejected(
                    RejectReason.MALFORMED, f"{ew}: claim {claim!r} not in {CLAIMS}"
                )
            if kind not in EVIDENCE_KINDS:
                raise VerdictRejected(
                    RejectReason.MALFORMED, f"{ew}: kind {kind!r} not in {EVIDENCE_KINDS}"
                )
            ev_cid = ev.get("candidate", cid)
            if not isinstance(ev_cid, str):
                raise VerdictRejected(
                    RejectReason.MALFORMED, f"{ew}: field 'candidate' must be text"
                )
            note = ev.get("note") or ""
            if not isinstance(note, str | int | float | bool):
                raise VerdictRejected(RejectReason.MALFORMED, f"{ew}: field 'note' must be text")
            evidence.append(
                Evidence(
                    claim=claim,
                    kind=kind,
                    candidate_id=real(ev_cid, RejectReason.NONEXISTENT_EVIDENCE, ew),
                    file=_opt(ev, "file", str, ew),
                    line=_opt(ev, "line", int, ew),
                    event=_opt(ev, "event", int, ew),
                    quote=_opt(ev, "quote", str, ew),
                    note=note if isinstance(note, str) else str(note),
                )
            )
        judgements.append(
            Judgement(
                candidate_id=real(cid, RejectReason.EXTRA_CANDIDATE, where),
                tier=tier,
                rank=rank,
                scores=scores,
                cheat=cheat,
                cheat_reason=reason,
                evidence=tuple(evidence),
            )
        )
    group_id = obj.get("group_id", workspace.group_id)
    if not isinstance(group_id, str):
        raise VerdictRejected(RejectReason.MALFORMED, "field 'group_id' must be text")
    votes = obj.get("votes", 1)
    agreement = obj.get("agreement")
    verdict = Verdict(
        group_id=group_id,
        judgements=tuple(judgements),
        grader_id=grader_id,
        grader_version=grader_version,
        latency_s=float(latency_s),
        votes=votes if _is_int(votes) and votes >= 1 else 1,
        agreement=float(agreement) if _is_number(agreement) else None,
    )
    return validate(verdict, workspace, check_logs=check_logs, ranks=ranks, scores=score_policy)


def verdict_from_dict(obj: Mapping[str, Any], workspace: GroupWorkspace) -> Verdict:
    """Inverse of ``verdict_to_dict`` (validated against ``workspace``)."""
    if not isinstance(obj, Mapping):
        raise VerdictRejected(
            RejectReason.MALFORMED, f"expected an object, got {type(obj).__name__}"
        )
    latency = obj.get("latency_s", 0.0) or 0.0
    out_of_range = isinstance(latency, int) and not 0 <= latency <= 10**9
    if out_of_range or (not isinstance(latency, int) and not _is_number(latency)):
        raise VerdictRejected(RejectReason.MALFORMED, "field 'latency_s' must be a finite number")
    ids = [obj.get("grader_id", ""), obj.get("grader_version", "")]
    if not all(isinstance(x, str) for x in ids):
        raise VerdictRejected(RejectReason.MALFORMED, "grader_id/grader_version must be text")
    return parse_verdict(
        obj, workspace, grader_id=ids[0], grader_version=ids[1], latency_s=float(latency)
    )


# ------------------------------------------------------------------------------------------------
# Results -> kernel arrays
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GradeResult:
    """The outcome of grading one group.

    Attributes:
      group_id: the group.
      verdict: the accepted verdict, or None.
      fallback_reason: why there is no verdict (None when there is one).
      candidate_ids: candidate ids in slot order (slot k of the group's rollouts).
      monitor_cheat: per slot, True where a confirmed monitor flag marks a cheat (applied even
        when grading fell back: the flag comes from verification, not from the grader).
      latency_s: seconds from the start of grading to the result (0 for cache hits).
      cached: True when the verdict came from the cache.
      detail: the rejection or error message, for logs.
    """

    group_id: str
    verdict: Verdict | None
    fallback_reason: FallbackReason | None
    candidate_ids: tuple[str, ...] = ()
    monitor_cheat: tuple[bool, ...] = ()
    latency_s: float = 0.0
    cached: bool = False
    detail: str = ""

    @classmethod
    def fallback(
        cls,
        workspace: GroupWorkspace,
        reason: FallbackReason,
        detail: str = "",
        latency_s: float = 0.0,
    ) -> GradeResult:
        return cls(
            workspace.group_id,
            None,
            FallbackReason(reason),
            *_slots(workspace),
            latency_s=latency_s,
            detail=detail,
        )

    @classmethod
    def accepted(
        cls,
        workspace: GroupWorkspace,
        verdict: Verdict,
        latency_s: float = 0.0,
        cached: bool = False,
    ) -> GradeResult:
        return cls(
            workspace.group_id,
            verdict,
            None,
            *_slots(workspace),
            latency_s=latency_s,
            cached=cached,
        )


def _slots(workspace: GroupWorkspace) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    return (
        tuple(c.candidate_id for c in workspace.candidates),
        tuple(c.confirmed_cheat for c in workspace.candidates),
    )


def to_arrays(
    results: Sequence[GradeResult], K: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Converts one batch of grade results into the kernels' inputs.

    Args:
      results: one ``GradeResult`` per group, in group order (G groups).
      K: rollout slots per group; every group must have at most K candidates.

    Returns:
      ``(tier [G, K] int32, rank [G, K] int32, graded [G] bool, cheat [G, K] bool)``.
      Slots without a judgement (failed or empty slots, and every slot of a fallback group) get
      tier 1 and rank 1, which the kernels ignore (not passing, or ``graded=False``). ``cheat`` is
      the verdict's cheat flag OR the slot's confirmed monitor flag.
    """
    if not isinstance(K, int | np.integer) or K < 1:
        raise ValueError(f"to_arrays: K must be a positive int, got {K!r}")
    G = len(results)
    tier = np.ones((G, K), np.int32)
    rank = np.ones((G, K), np.int32)
    cheat = np.zeros((G, K), bool)
    graded = np.zeros((G,), bool)
    for g, res in enumerate(results):
        if len(res.candidate_ids) > K:
            raise ValueError(
                f"to_arrays: results[{g}] (group {res.group_id!r}) has "
                f"{len(res.candidate_ids)} candidates, more than K={K}"
            )
        cheat[g, : len(res.monitor_cheat)] = res.monitor_cheat
        if res.verdict is None:
            continue
        graded[g] = True
        slot = {cid: k for k, cid in enumerate(res.candidate_ids)}
        for j in res.verdict.judgements:
            k = slot[j.candidate_id]
            tier[g, k] = j.tier
            rank[g, k] = j.rank
            cheat[g, k] |= j.cheat
    return tier, rank, graded, cheat


def tier_histogram(verdicts: Iterable[Verdict]) -> dict[int, int]:
    """Counts of judgements per tier over ``verdicts``."""
    hist = {t: 0 for t in range(1, NUM_TIERS + 1)}
    for v in verdicts:
        for j in v.judgements:
            hist[j.tier] += 1
    return hist
