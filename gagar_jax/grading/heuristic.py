"""The heuristic grader: deterministic, fast scores of the five Gagar dimensions.

It is the embedded default (no model needed) and a baseline for the agentic grader. Every score is
a documented function of the candidate's patch, test log, trajectory and monitor flags, made
relative to the group where that is the point of groupwise grading (minimality is measured against
the smallest passing patch of the same group; the task's scope is the files most passing
candidates touch when the task does not name them).

Dimension scores (each clipped to [0, 1], 1 best; ``HeuristicConfig`` holds every constant):

* ``solution_fit``: 1 - ``off_scope_fix`` if no file in scope is touched (scope known)
  - ``log_warning`` per warning line in the passing test log (at most 2)
  - ``log_error`` if the passing log still shows a traceback or error.
* ``implementation_precision``: 1 - ``debris`` per added line of debugging or placeholder debris
  (``print(``, ``breakpoint()``, ``pdb``, ``TODO``/``FIXME``/``XXX``, bare ``except:``,
  ``except ...: pass``) - ``unconfirmed_flag`` per unconfirmed monitor flag.
* ``minimality``: sqrt((m + c) / (s + c)), ``s`` this candidate's changed lines, ``m`` the smallest
  passing patch's, ``c = size_slack`` (so one line more than the minimum costs little), times
  ``spread`` per file beyond the group's smallest file count, times the effort factor
  max(``effort_floor``, ((t_min + ``token_slack``) / (t + ``token_slack``)) ** 0.25) for the
  trajectory's tokens ``t`` (turns count ``tokens_per_turn`` each) against the group's least.
* ``side_effect_avoidance``: 1 - ``out_of_scope`` per touched non-test file outside the scope
  - ``tests_touched`` per touched test file - ``deleted_file`` per deleted file.
* ``codebase_consistency``: 1 - ``style`` per style deviation of added lines from the file they
  go into, or for a new file from the repository's files with its extension (indent character
  and width, trailing whitespace, line length beyond the file's longest, operator spacing, quote
  style, camelCase names in a snake_case file), each kind counted at most twice per file.

A family may supply ``Candidate.quality[d]`` in [0, 1] for a dimension ``d`` (the toy family's
verifier measures all five with hidden tests): the score becomes the mean of the heuristic's and
the family's value, citing the candidate's test log as the execution evidence (no log, no blend).

Two group-level judgements of the gold rubric's T3 ("the behaviour differs from the intended fix
beyond the tests; the bug is left in place and compensated elsewhere"):

* bug left in place: the fix site is the set of original non-test lines whose code a strict
  majority (and at least two) of the passing candidates remove or replace (a line whose
  replacement differs only in comments or whitespace is not changed). A passing candidate that
  changes code but none of those lines leaves the bug where it is and makes the tests pass by
  changing something else: ``solution_fit`` loses ``bug_left`` and the tier is T3, citing the
  candidate's first changed line. Groups without such a majority site give no judgement, and
  neither does a disputed site: one that the smallest passing patch changing code lines (the
  group's most minimal fix) leaves alone while being strictly smaller than every patch that
  changes it. A majority is a vote of the group's own candidates, so it is trusted only where
  the least change does not contradict it: rollouts that all touch one harmless line besides
  their compensating change are larger than a fix at the bug, and cannot move the site onto
  that line to make the fix look misplaced. (A majority of compensations exactly as small as
  the fix is indistinguishable from a majority of fixes: the judgement then stands.)
* behaviour beyond the tests: when the family's verifier measured, by execution, how far the
  patched program agrees with the intended behaviour beyond the visible tests
  (``quality["solution_fit"]``: hidden tests; ``quality["implementation_precision"]``:
  agreement with the reference), a value below ``behaviour_at_least`` makes the tier T3, citing
  the test log (the toy family measures both; a family that does not gives no judgement).
* over-broad rewrite: a candidate that removes at least ``rewrite_fraction`` of an existing
  non-test file's lines, and at least ``rewrite_min_lines`` of them, rewrites more than a bug
  fix needs: ``minimality`` loses ``rewrite`` and the tier is T3.

And one of T2 ("a small edit outside the task's scope"): a change block (a run of removed and
added lines) in a file the group's smallest passing patches without confirmed monitor flags
change, lying more than ``near_lines`` lines away from each of their change blocks, is an edit
beyond the fix (other files are the scope rule's business): ``side_effect_avoidance`` loses
``extra_change`` per block (at most two) and the candidate cannot be T1.

Tiers (``weighted`` is the ``weights``-weighted mean of the five scores):

* T3: cheat (a confirmed monitor flag), a T3 judgement above, or ``weighted < t3_below``, or a
  dimension < ``t3_min_dim``;
* T1: ``weighted >= t1_at_least`` and every dimension >= ``NEGATIVE_SCORE`` (0.5). T1 means
  "mergeable as is": 0.95 allows one minor deduction and no more. (At 0.85 every passing toy
  patch kind but the cheat was T1, which left the T1/T2 split with nothing to say.)
* T2: the rest.

Rank: by tier; inside a tier cheats last, then candidates whose measured behaviour differs beyond
the tests (a wrong program is worse than a right one changed in the wrong place); then by
``weighted`` quantised to ``rank_quantum`` (closer scores are a tie: the
grader has no evidence to separate them); dense ranks.

Every penalty is recorded with evidence pointing at the offending patch line, test-log line,
trajectory event or monitor flag, so each negative judgement is backed as ``schema.validate``
requires. A penalty without a citable artefact is not applied (no evidence, no negative judgement).
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
import time
import tokenize
from collections import Counter
from collections.abc import Mapping

from gagar_jax.grading import schema
from gagar_jax.grading.schema import DIMENSIONS, NEGATIVE_SCORE, Evidence, Judgement, Verdict
from gagar_jax.verify import diff

GRADER_ID = "heuristic"
GRADER_VERSION = "2"

_DEBRIS = [
    (re.compile(r"^\s*print\("), "debug print"),
    (re.compile(r"breakpoint\(\)|\bpdb\b"), "debugger call"),
    (re.compile(r"\b(TODO|FIXME|XXX)\b"), "placeholder comment"),
    (re.compile(r"^\s*except\s*:"), "bare except"),
    (re.compile(r"^\s*except\b.*:\s*pass\s*$"), "swallowed exception"),
]
_WARNING_RE = re.compile(r"warning", re.IGNORECASE)
_ERROR_RE = re.compile(r"Traceback \(most recent call last\)|^\s*\w*Error\b", re.MULTILINE)
_CAMEL_DEF_RE = re.compile(r"^\s*(?:def|class)?\s*([a-z]+[A-Z]\w*)\s*(?:\(|=)")
_SNAKE_DEF_RE = re.compile(r"^\s*(?:def\s+)?([a-z]+_[a-z0-9_]+)\s*(?:\(|=)")
_PATH_RE = re.compile(r"[\w./-]+\.\w+")


@dataclasses.dataclass(frozen=True)
class HeuristicConfig:
    """Constants of the heuristic grader (see the module docstring for their use)."""

    off_scope_fix: float = 0.5
    log_warning: float = 0.1
    log_error: float = 0.2
    debris: float = 0.25
    unconfirmed_flag: float = 0.25
    size_slack: float = 3.0
    spread: float = 0.9
    out_of_scope: float = 0.35
    tests_touched: float = 0.5
    deleted_file: float = 0.5
    style: float = 0.15
    weights: tuple[float, ...] = (0.3, 0.2, 0.2, 0.2, 0.1)  # in DIMENSIONS order
    t1_at_least: float = 0.95
    t3_below: float = 0.6
    t3_min_dim: float = 0.25
    rank_quantum: float = 0.05
    token_slack: float = 200.0
    tokens_per_turn: float = 50.0
    effort_floor: float = 0.8
    bug_left: float = 0.5
    behaviour_at_least: float = 0.95
    rewrite: float = 0.5
    rewrite_fraction: float = 0.5
    rewrite_min_lines: int = 8
    extra_change: float = 0.2
    near_lines: int = 2

    def __post_init__(self):
        if len(self.weights) != len(DIMENSIONS) or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise ValueError(
                f"HeuristicConfig.weights: expected {len(DIMENSIONS)} non-negative weights "
                f"with a positive sum, got {self.weights}"
            )
        if not 0 < self.t3_below <= self.t1_at_least <= 1:
            raise ValueError(
                "HeuristicConfig: need 0 < t3_below <= t1_at_least <= 1, got "
                f"{self.t3_below}, {self.t1_at_least}"
            )


@dataclasses.dataclass
class _Card:
    """A candidate's running scores and the evidence behind each penalty."""

    candidate: schema.Candidate
    penalties: dict[str, float] = dataclasses.field(default_factory=lambda: Counter())
    evidence: list[Evidence] = dataclasses.field(default_factory=list)
    factors: dict[str, float] = dataclasses.field(default_factory=dict)
    t3_reasons: list[str] = dataclasses.field(default_factory=list)
    not_t1: list[str] = dataclasses.field(default_factory=list)
    wrong_behaviour: bool = False

    def penalise(self, claim: str, amount: float, ev: Evidence | None) -> None:
        if ev is None or amount <= 0:
            return  # no evidence, no negative judgement
        self.penalties[claim] += amount
        self.evidence.append(ev)

    def scale(self, claim: str, factor: float, ev: Evidence | None) -> None:
        if ev is None or factor >= 1:
            return
        self.factors[claim] = self.factors.get(claim, 1.0) * factor
        self.evidence.append(ev)

    def scores(self) -> dict[str, float]:
        out = {}
        for d in DIMENSIONS:
            s = (1.0 - self.penalties.get(d, 0.0)) * self.factors.get(d, 1.0)
            s = min(1.0, max(0.0, s))
            q = self.candidate.quality.get(d)
            if q is not None and math.isfinite(float(q)):
                q = min(1.0, max(0.0, float(q)))
                ev = None
                if q < 1.0:  # the verifier's measurement is the evidence: cite its output
                    log = next(
                        (ln for ln in self.candidate.test_log.splitlines() if ln.strip()), ""
                    )
                    ev = _log_ev(d, self.candidate, log, f"verifier quality feature {d}={q:.3f}")
                if q >= 1.0 or ev is not None:
                    s = 0.5 * (s + q)
                    if ev is not None:
                        self.evidence.append(ev)
            out[d] = round(s, 6)
        return out


def _patch_ev(claim: str, c: schema.Candidate, path: str, line: int | None, note: str) -> Evidence:
    return Evidence(claim, "patch", c.candidate_id, file=path, line=line, note=note)


def _log_ev(claim: str, c: schema.Candidate, text: str, note: str) -> Evidence | None:
    quote = text.strip()[:120]
    if len(quote) < schema.MIN_QUOTE_CHARS:
        return None
    return Evidence(claim, "execution", c.candidate_id, quote=quote, note=note)


def _first_line(f: diff.FilePatch) -> int | None:
    if f.added():
        return f.added()[0][0]
    if f.removed():
        return f.removed()[0][0]
    return f.hunks[0].new_start if f.hunks else None


def _file_style(text: str) -> dict[str, object]:
    """The dominant conventions of a file's existing code."""
    lines = text.splitlines()
    indents = [ln[: len(ln) - len(ln.lstrip())] for ln in lines if ln.strip()]
    tabs = sum(1 for i in indents if i.startswith("\t"))
    spaces = sum(1 for i in indents if i.startswith(" "))
    widths = [len(i) for i in indents if i and not i.startswith("\t")]
    unit = min(widths) if widths else None
    single = sum(ln.count("'") for ln in lines)
    double = sum(ln.count('"') for ln in lines)
    spaced = sum(len(re.findall(r"\w \S?= \w", ln)) for ln in lines)
    tight = sum(len(re.findall(r"\w[+\-*/]?=\w", ln)) for ln in lines)
    snake = sum(1 for ln in lines if _SNAKE_DEF_RE.match(ln))
    camel = sum(1 for ln in lines if _CAMEL_DEF_RE.match(ln))
    return {
        "indent_char": "\t" if tabs > spaces else (" " if spaces else None),
        "indent_unit": unit,
        "max_len": max((len(ln) for ln in lines), default=0),
        "quote": "'" if single > 2 * double + 2 else ('"' if double > 2 * single + 2 else None),
        "spacing": "spaced" if spaced > 2 * tight else ("tight" if tight > 2 * spaced else None),
        "snake": snake > camel,
        "known": bool(lines),
    }


def _style_issues(line: str, style: Mapping[str, object]) -> list[str]:
    issues = []
    if not line.strip():
        return issues
    if line != line.rstrip():
        issues.append("trailing whitespace")
    if not style["known"]:
        return issues
    indent = line[: len(line) - len(line.lstrip())]
    if indent and style["indent_char"] and indent[0] != style["indent_char"]:
        issues.append("indent character differs from the file")
    elif (
        indent and style["indent_unit"] and indent[0] == " " and len(indent) % style["indent_unit"]
    ):
        issues.append("indent width differs from the file")
    if len(line) > max(int(style["max_len"]), 79):
        issues.append("line longer than the file's lines")
    code = re.sub(r"#.*$", "", line)
    if style["spacing"] == "spaced" and re.search(r"\w[+\-*/]?=\w", code) and "==" not in code:
        issues.append("operator spacing differs from the file")
    if style["spacing"] == "tight" and re.search(r"\w \S?= \w", code):
        issues.append("operator spacing differs from the file")
    if style["quote"] == "'" and '"' in code and "'" not in code:
        issues.append("quote style differs from the file")
    if style["quote"] == '"' and "'" in code and '"' not in code:
        issues.append("quote style differs from the file")
    if style["snake"] and _CAMEL_DEF_RE.match(code):
        issues.append("camelCase name in a snake_case file")
    return issues


def infer_scope(workspace: schema.GroupWorkspace) -> set[str]:
    """The task's files: ``scope_files`` if given, else files named in the task text plus the
    non-test files touched by at least half of the passing candidates."""
    if workspace.scope_files:
        return set(workspace.scope_files)
    named = {p for p in _PATH_RE.findall(workspace.task_text) if p in workspace.repo_files}
    counts: Counter[str] = Counter()
    passing = workspace.passing
    for c in passing:
        for f in c.parsed_patch.files:
            if not diff.is_test_path(f.path):
                counts[f.path] += 1
    consensus = {p for p, n in counts.items() if 2 * n >= len(passing)}
    return named | consensus


def _code_of(path: str, line: str) -> str:
    """A line's code: its tokens without comments or whitespace (Python), or its words."""
    if path.endswith(".py"):
        try:
            toks = tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline)
            return " ".join(t.string for t in toks if t.type not in _NOT_CODE)
        except (tokenize.TokenError, IndentationError, SyntaxError):
            pass
    return " ".join(line.split())


_NOT_CODE = frozenset(
    {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
)


def code_removed(f: diff.FilePatch) -> set[int]:
    """Original line numbers of ``f`` whose code the patch removes or replaces: a removed line
    whose code comes back among the same hunk's added lines (a comment or whitespace edit, a
    line moved inside the hunk) is not counted."""
    out = set()
    for h in f.hunks:
        back = Counter(_code_of(f.path, t) for _, t in h.added())
        for n, t in h.removed():
            code = _code_of(f.path, t)
            if back[code] > 0:
                back[code] -= 1
            else:
                out.add(n)
    return out


def _site_lines(c: schema.Candidate) -> set[tuple[str, int]]:
    return {
        (f.path, n)
        for f in c.parsed_patch.files
        if not diff.is_test_path(f.path) and not f.is_new
        for n in code_removed(f)
    }


def fix_site(workspace: schema.GroupWorkspace) -> set[tuple[str, int]]:
    """The original non-test lines ``(path, line)`` whose code a strict majority (at least two)
    of the passing candidates remove or replace: where the group agrees the bug is. Empty
    without such a majority, and when the site is disputed: the smallest passing patch that
    changes code lines leaves it alone and is strictly smaller than every patch that changes it
    (see the module docstring)."""
    passing = workspace.passing
    lines = {c.candidate_id: _site_lines(c) for c in passing}
    counts: Counter[tuple[str, int]] = Counter()
    for c in passing:
        counts.update(lines[c.candidate_id])
    site = {k for k, n in counts.items() if n >= 2 and 2 * n > len(passing)}
    voters = [c for c in passing if lines[c.candidate_id]]
    if site and voters:
        size = {
            c.candidate_id: c.parsed_patch.num_added + c.parsed_patch.num_removed for c in voters
        }
        on_site = [n for k, n in size.items() if lines[k] & site]
        off_site = [n for k, n in size.items() if not lines[k] & site]
        if off_site and min(off_site) < min(on_site):
            return set()
    return site


def change_blocks(pp: diff.Patch) -> list[tuple[str, float, float]]:
    """``(path, lo, hi)`` per run of consecutive removed/added lines, in original line numbers:
    the removed lines' range, or ``n - 0.5`` for lines inserted before original line ``n``."""
    out = []
    for f in pp.files:
        for h in f.hunks:
            old = h.old_start if h.old_len else h.old_start + 1  # empty range: insertion after
            lo = hi = None
            for tag in (*(ln[0] for ln in h.lines), " "):
                if tag == "-":
                    lo = old if lo is None else lo
                    hi = old
                    old += 1
                elif tag == "+":
                    if lo is None:
                        lo = hi = old - 0.5
                else:
                    if lo is not None:
                        out.append((f.path, float(lo), float(hi)))
                    lo = hi = None
                    old += 1
    return out


def _site_text(site: set[tuple[str, int]]) -> str:
    lines = sorted(site)
    text = ", ".join(f"{p}:{n}" for p, n in lines[:3])
    return text + (f" and {len(lines) - 3} more" if len(lines) > 3 else "")


class HeuristicGrader:
    """Deterministic grader of a group's passing candidates (see the module docstring)."""

    grader_id = GRADER_ID
    version = GRADER_VERSION

    def __init__(self, config: HeuristicConfig | None = None):
        self.config = config or HeuristicConfig()
        self.cache_id = f"{GRADER_ID}@{GRADER_VERSION}/{self.config!r}"

    def grade(self, workspace: schema.GroupWorkspace, cancel=None) -> Verdict:  # noqa: ARG002
        """Grades ``workspace``; the verdict always passes ``schema.validate``."""
        t0 = time.perf_counter()
        cfg = self.config
        passing = workspace.passing
        scope = infer_scope(workspace)
        sizes = {
            c.candidate_id: c.parsed_patch.num_added + c.parsed_patch.num_removed for c in passing
        }
        nonzero = [s for s in sizes.values() if s > 0]
        min_size = min(nonzero) if nonzero else 0
        nfiles = [len(c.parsed_patch.files) for c in passing if c.parsed_patch.files]
        min_files = min(nfiles) if nfiles else 0
        efforts = {c.candidate_id: self._effort(c) for c in passing if c.trajectory}
        min_effort = min(efforts.values(), default=0.0)
        styles: dict[str, dict[str, object]] = {}
        site = fix_site(workspace)
        clean = [c for c in passing if not any(f.confirmed for f in c.monitor_flags)]
        clean_sizes = [sizes[c.candidate_id] for c in clean if sizes[c.candidate_id] > 0]
        smallest = [
            b
            for c in clean
            if clean_sizes and sizes[c.candidate_id] == min(clean_sizes)
            for b in change_blocks(c.parsed_patch)
        ]
        cards = []
        for c in passing:
            card = _Card(c)
            pp = c.parsed_patch
            self._solution_fit(card, pp, scope)
            self._precision(card, pp)
            self._minimality(card, pp, sizes[c.candidate_id], min_size, min_files)
            if c.candidate_id in efforts:
                e = efforts[c.candidate_id]
                slack = cfg.token_slack
                card.scale(
                    "minimality",
                    max(cfg.effort_floor, ((min_effort + slack) / (e + slack)) ** 0.25),
                    Evidence(
                        "minimality",
                        "trajectory",
                        c.candidate_id,
                        event=len(c.trajectory) - 1,
                        note=f"effort {e:.0f} (tokens, turns); least in group {min_effort:.0f}",
                    ),
                )
            self._side_effects(card, pp, scope)
            self._consistency(card, pp, workspace, styles)
            self._bug_left(card, pp, site)
            self._behaviour(card)
            self._rewrite(card, pp, workspace)
            self._extra_changes(card, pp, smallest)
            cards.append(card)
        weights = dict(zip(DIMENSIONS, cfg.weights))
        judged = []
        for card in cards:
            c = card.candidate
            scores = card.scores()
            confirmed = [f for f in c.monitor_flags if f.confirmed]
            cheat_ev = [self._flag_evidence("cheat", c, f) for f in confirmed]
            cheat_ev = [e for e in cheat_ev if e is not None]
            cheat = bool(cheat_ev)
            weighted = sum(weights[d] * scores[d] for d in DIMENSIONS) / sum(weights.values())
            low = min(scores.values())
            if cheat or card.t3_reasons or weighted < cfg.t3_below or low < cfg.t3_min_dim:
                tier = 3
            elif weighted >= cfg.t1_at_least and low >= NEGATIVE_SCORE and not card.not_t1:
                tier = 1
            else:
                tier = 2
            reason = "; ".join(f"monitor flag {f.rule}: {f.evidence}" for f in confirmed)
            judged.append((card, scores, tier, weighted, cheat, reason if cheat else "", cheat_ev))

        def key(card, t, w, ch):
            return (t, 2 if ch else int(card.wrong_behaviour), -round(w / cfg.rank_quantum))

        keys = sorted({key(card, t, w, ch) for card, _, t, w, ch, *_ in judged})
        rank_of = {k: i + 1 for i, k in enumerate(keys)}
        judgements = tuple(
            Judgement(
                candidate_id=card.candidate.candidate_id,
                tier=tier,
                rank=rank_of[key(card, tier, w, cheat)],
                scores=scores,
                cheat=cheat,
                cheat_reason=reason,
                evidence=tuple(card.evidence) + tuple(cheat_ev),
            )
            for card, scores, tier, w, cheat, reason, cheat_ev in judged
        )
        return Verdict(
            workspace.group_id,
            judgements,
            self.grader_id,
            self.version,
            latency_s=time.perf_counter() - t0,
        )

    def _effort(self, c: schema.Candidate) -> float:
        return float(c.num_tokens) + self.config.tokens_per_turn * c.num_turns

    # -- dimensions ------------------------------------------------------------------------------

    def _solution_fit(self, card: _Card, pp: diff.Patch, scope: set[str]) -> None:
        cfg, c = self.config, card.candidate
        if scope and pp.files and not any(f.path in scope for f in pp.files):
            f = pp.files[0]
            card.penalise(
                "solution_fit",
                cfg.off_scope_fix,
                _patch_ev(
                    "solution_fit", c, f.path, _first_line(f), "no change in the task's files"
                ),
            )
        warnings = [ln for ln in c.test_log.splitlines() if _WARNING_RE.search(ln)][:2]
        for ln in warnings:
            card.penalise(
                "solution_fit",
                cfg.log_warning,
                _log_ev("solution_fit", c, ln, "warning in the passing test log"),
            )
        m = _ERROR_RE.search(c.test_log)
        if m:
            line = c.test_log[m.start() :].splitlines()[0]
            card.penalise(
                "solution_fit",
                cfg.log_error,
                _log_ev("solution_fit", c, line, "error in the test log"),
            )

    def _bug_left(self, card: _Card, pp: diff.Patch, site: set[tuple[str, int]]) -> None:
        c = card.candidate
        code = [f for f in pp.files if not diff.is_test_path(f.path)]
        if not site or not code:
            return
        if any((f.path, n) in site for f in code for n in code_removed(f)):
            return
        f = code[0]
        ev = _patch_ev(
            "solution_fit",
            c,
            f.path,
            _first_line(f),
            f"leaves the fix site ({_site_text(site)}) unchanged: the bug stays in place and "
            "the tests pass through changes elsewhere",
        )
        card.penalise("solution_fit", self.config.bug_left, ev)
        card.t3_reasons.append("bug left in place")

    def _rewrite(self, card: _Card, pp: diff.Patch, workspace: schema.GroupWorkspace) -> None:
        cfg, c = self.config, card.candidate
        for f in pp.files:
            old = workspace.repo_files.get(f.path)
            if old is None or diff.is_test_path(f.path):
                continue
            n_old = max(1, len(old.splitlines()))
            n_removed = len(f.removed())
            if n_removed >= cfg.rewrite_min_lines and n_removed >= cfg.rewrite_fraction * n_old:
                ev = _patch_ev(
                    "minimality",
                    c,
                    f.path,
                    _first_line(f),
                    f"rewrites {n_removed} of the file's {n_old} lines",
                )
                card.penalise("minimality", cfg.rewrite, ev)
                card.t3_reasons.append("over-broad rewrite")
                return

    def _extra_changes(
        self, card: _Card, pp: diff.Patch, smallest: list[tuple[str, float, float]]
    ) -> None:
        cfg, c = self.config, card.candidate
        if not smallest:
            return
        files = {p for p, _, _ in smallest}
        extra = [
            b
            for b in change_blocks(pp)
            if b[0] in files
            and not any(
                p == b[0] and b[1] - cfg.near_lines <= hi and lo - cfg.near_lines <= b[2]
                for p, lo, hi in smallest
            )
        ]
        for path, lo, _ in extra[:2]:
            line = int(lo) if lo >= 1 else None
            ev = _patch_ev(
                "side_effect_avoidance",
                c,
                path,
                line,
                "change away from every change of the group's smallest passing patches",
            )
            card.penalise("side_effect_avoidance", cfg.extra_change, ev)
        if extra:
            card.not_t1.append("edit beyond the fix")

    def _behaviour(self, card: _Card) -> None:
        c = card.candidate
        log = next((ln for ln in c.test_log.splitlines() if ln.strip()), "")
        for d, what in (
            ("solution_fit", "hidden tests"),
            ("implementation_precision", "agreement with the intended behaviour"),
        ):
            q = c.quality.get(d)
            if q is None or not math.isfinite(float(q)) or q >= self.config.behaviour_at_least:
                continue
            ev = _log_ev(d, c, log, f"verifier measured {what} beyond the visible tests: {q:.3f}")
            if ev is not None:
                card.evidence.append(ev)
                card.t3_reasons.append(f"behaviour differs beyond the tests ({d}={q:.3f})")
                card.wrong_behaviour = True

    def _precision(self, card: _Card, pp: diff.Patch) -> None:
        cfg, c = self.config, card.candidate
        for f in pp.files:
            for n, text in f.added():
                for pattern, what in _DEBRIS:
                    if pattern.search(text):
                        card.penalise(
                            "implementation_precision",
                            cfg.debris,
                            _patch_ev("implementation_precision", c, f.path, n, what),
                        )
                        break
        for flag in c.monitor_flags:
            if not flag.confirmed:
                card.penalise(
                    "implementation_precision",
                    cfg.unconfirmed_flag,
                    self._flag_evidence("implementation_precision", c, flag),
                )

    def _minimality(
        self, card: _Card, pp: diff.Patch, size: int, min_size: int, min_files: int
    ) -> None:
        cfg, c = self.config, card.candidate
        if size <= 0 or not pp.files:
            return
        biggest = max(pp.files, key=lambda f: len(f.added()) + len(f.removed()))
        ratio = math.sqrt((min_size + cfg.size_slack) / (size + cfg.size_slack))
        card.scale(
            "minimality",
            ratio,
            _patch_ev(
                "minimality",
                c,
                biggest.path,
                _first_line(biggest),
                f"{size} changed lines; the smallest passing patch has {min_size}",
            ),
        )
        extra = len(pp.files) - min_files
        if extra > 0:
            f = pp.files[-1]
            card.scale(
                "minimality",
                cfg.spread**extra,
                _patch_ev(
                    "minimality", c, f.path, _first_line(f), f"{extra} more files than needed"
                ),
            )

    def _side_effects(self, card: _Card, pp: diff.Patch, scope: set[str]) -> None:
        cfg, c = self.config, card.candidate
        for f in pp.files:
            line = _first_line(f)
            if diff.is_test_path(f.path) and f.path not in scope:
                card.penalise(
                    "side_effect_avoidance",
                    cfg.tests_touched,
                    _patch_ev("side_effect_avoidance", c, f.path, line, "modifies a test file"),
                )
            elif scope and f.path not in scope:
                card.penalise(
                    "side_effect_avoidance",
                    cfg.out_of_scope,
                    _patch_ev(
                        "side_effect_avoidance", c, f.path, line, "file outside the task's scope"
                    ),
                )
            if f.is_deleted:
                card.penalise(
                    "side_effect_avoidance",
                    cfg.deleted_file,
                    _patch_ev("side_effect_avoidance", c, f.path, line, "deletes a file"),
                )

    def _consistency(
        self,
        card: _Card,
        pp: diff.Patch,
        workspace: schema.GroupWorkspace,
        styles: dict[str, dict[str, object]],
    ) -> None:
        cfg, c = self.config, card.candidate
        for f in pp.files:
            if f.path not in styles:
                text = workspace.repo_files.get(f.path)
                if text is None:  # a new file follows the repository's files of its kind
                    ext = f.path.rsplit(".", 1)[-1]
                    text = "\n".join(
                        t for p, t in sorted(workspace.repo_files.items()) if p.endswith("." + ext)
                    )
                styles[f.path] = _file_style(text)
            seen: Counter[str] = Counter()
            for n, text in f.added():
                for issue in _style_issues(text, styles[f.path]):
                    seen[issue] += 1
                    if seen[issue] <= 2:
                        card.penalise(
                            "codebase_consistency",
                            cfg.style,
                            _patch_ev("codebase_consistency", c, f.path, n, issue),
                        )

    @staticmethod
    def _flag_evidence(
        claim: str, c: schema.Candidate, flag: schema.MonitorFlagView
    ) -> Evidence | None:
        note = f"monitor flag {flag.rule}"
        ev = _log_ev(claim, c, flag.evidence, note)
        if ev is not None:
            return ev
        if c.trajectory:
            return Evidence(
                claim, "trajectory", c.candidate_id, event=len(c.trajectory) - 1, note=note
            )
        if c.parsed_patch.files:
            f = c.parsed_patch.files[0]
            return _patch_ev(claim, c, f.path, None, note)
        return None
