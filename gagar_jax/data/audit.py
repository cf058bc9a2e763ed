"""Task auditor: execution pre-checks, an LLM evaluator agent, and pool filters.

Following the verification paper (evaluator agents filter the task pool for instruction clarity
and test alignment) and SWE-bench Verified's annotation protocol.

1. ``precheck(task, *, repeats=5) -> AuditReport`` runs before any LLM, in the sandbox, through
   the repository verifier (``verify.verify_repo_patch``): the reference ("gold") patch and the
   empty patch, ``repeats`` times each. Named reasons:

   ===================  =========================================================================
   reason               when
   ===================  =========================================================================
   gold_fails_f2p       a fail_to_pass test is not passed in any gold run
   gold_breaks_p2p      a pass_to_pass test is not passed in any gold run
   empty_patch_passes   a fail_to_pass test passes in every run without a fix
   flaky                one patch gives one test different outcomes across the repeats
   leaks_solution       the gold patch is reachable from what the agent can read: version-control
                        or patch files (``.git/``, ``*.patch``, ``*.orig``, ...), a file or the
                        issue text holding (nearly) all of its distinctive added lines or its
                        text, or the git data of the agent's tree (objects beyond its base
                        commit, reflog, tags); ``details["leaks_solution:<kind>"]`` names each
                        kind found (``LEAK_KINDS``)
   infra_error          the sandbox could not run the tests (the task is not audited, not bad)
   ===================  =========================================================================

   A sound task has ``ok=True`` and no reasons.

2. ``TaskAuditor(client)`` is an evaluator agent: it reads the issue, the repository through read
   tools, the tests, optionally examples and the gold patch, and submits, under a strict schema,
   SWE-bench Verified's two scores (``underspecification`` 0-3, ``test_validity`` 0-3; 0 best), a
   ``difficulty`` bucket, a ``category`` and ``evidence`` pointers that must exist (a file line, a
   quote of the issue, the tests or the gold patch). A bad submission is fed back while steps
   last; then the vote falls back (``None``, counted), never a verdict on the task. ``votes=K``
   independent episodes are merged with ``max_severity`` (the human protocol: the worst score of
   any vote) or ``majority`` (ties go to the more severe); both are order-invariant and K=1 is
   the raw vote. Prompts are versioned (``data/prompts/<version>/``) because the paper shows that
   prompt granularity matters.

3. ``filter_tasks(pool, thresholds) -> (kept, report)``: how many tasks each threshold keeps on
   its own and in combination, with the reasons; ``PassRateTracker`` lets dynamic sampling skip
   tasks whose empirical pass rate over the last attempts is 0 or 1; ``save_pool``/``load_pool``
   store audit results and pass rates with the tasks (JSON lines, the builders' input).
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import hashlib
import importlib.resources
import json
import os
import posixpath
import random
import re
import string
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify import execution
from gagar_jax.verify.browser_llm import OutputRejected, first_json_object
from gagar_jax.verify.diff import parse_unified_diff
from gagar_jax.verify.repo import DEFAULT_LIMITS

REASONS = (
    "gold_fails_f2p",
    "gold_breaks_p2p",
    "empty_patch_passes",
    "flaky",
    "leaks_solution",
    "infra_error",
)
LEAKY_PATTERNS = ("*.patch", "*.diff", "*.orig", "*.rej", "*.bak", "*~", "*.swp")
VCS_DIRS = (".git", ".hg", ".svn", ".bzr")
# Where a leak was found (``leak_kinds``): git objects beyond the base commit (future commits,
# other branches, dangling or packed objects), a reflog, tags, stray patch/backup files, the
# issue text, a file's text, the version-control history of the task's directory.
LEAK_KINDS = ("git_objects", "reflog", "tags", "patch_files", "issue_text", "file_text", "history")
MIN_LEAK_LINE_CHARS = 8
LEAK_LINE_FRACTION = 0.8
MAX_HISTORY_CHARS = 4 << 20
PROMPT_VERSION = "v1"
AGGREGATIONS = ("max_severity", "majority")
DIFFICULTY_BUCKETS = ("<15m", "15m-1h", "1-4h", ">4h")  # SWE-bench Verified's buckets
CATEGORIES = ("bug_fix", "feature", "refactor", "performance", "documentation", "tests", "other")
EVIDENCE_KINDS = ("issue", "file", "test", "patch", "example")


# ------------------------------------------------------------------------------------------------
# 1. Execution pre-checks
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AuditRun:
    """One sandboxed run: ``patch`` is ``"gold"`` or ``"empty"``; ``tests``: id -> outcome."""

    patch: str
    repeat: int
    status: str
    tests: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The pre-check's result. ``details``: reason -> what was seen (test ids, paths)."""

    task_id: str
    ok: bool
    reasons: tuple[str, ...]
    runs: tuple[AuditRun, ...]
    details: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "ok": self.ok,
            "reasons": list(self.reasons),
            "details": dict(self.details),
            "runs": [dataclasses.asdict(r) | {"tests": dict(r.tests)} for r in self.runs],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AuditReport:
        return cls(
            str(d["task_id"]),
            bool(d["ok"]),
            tuple(d["reasons"]),
            tuple(AuditRun(**r) for r in d.get("runs", ())),
            dict(d.get("details", {})),
        )


def _as_task(task: Any) -> RepoTask:
    if isinstance(task, RepoTask):
        return task
    if isinstance(task, Mapping):
        return RepoTask.from_dict(task)
    raise TypeError(f"precheck: expected a RepoTask or its JSON dict, got {type(task).__name__}")


def _added_lines(patch: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for fp in parse_unified_diff(patch):
        path = fp.new_path or fp.old_path
        for h in fp.hunks:
            out.setdefault(path, []).extend(text for _, text in h.added())
    return out


def _history_text(source_dir: str) -> str | None:
    """``git log -p --all`` of ``source_dir/repo`` (or ``source_dir``), None without history."""
    for root in (os.path.join(source_dir, "repo"), source_dir):
        if os.path.isdir(os.path.join(root, ".git")):
            try:
                out = subprocess.run(
                    ["git", "-C", root, "log", "--all", "-p", "--no-color", "--format=%H %s"],
                    capture_output=True, timeout=30, check=False,
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                         "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"},
                )  # fmt: skip  # argv pairs
            except (OSError, subprocess.TimeoutExpired):
                return "(history present but unreadable)"
            return out.stdout.decode(errors="replace")[:MAX_HISTORY_CHARS]
    return None


def _git_out(root: str, *args: str) -> str | None:
    try:
        r = subprocess.run(
            ["git", "-C", root, *args],
            capture_output=True,
            timeout=60,
            check=False,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "GIT_CONFIG_NOSYSTEM": "1",
                "HOME": "/nonexistent",
            },
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.decode(errors="replace") if r.returncode == 0 else None


def git_leaks(tree_dir: str | os.PathLike) -> dict[str, list[str]]:
    """Leaks in the git data of an agent's tree: ``git_objects`` (objects not reachable from
    ``HEAD``: future commits, other refs, dangling or packed objects), ``reflog`` (``logs/``,
    ``ORIG_HEAD``, ``FETCH_HEAD``), ``tags``. Empty when the tree has no ``.git``."""
    root = os.fspath(tree_dir)
    gd = os.path.join(root, ".git")
    if not os.path.exists(gd):
        return {}
    out: dict[str, list[str]] = {}
    if not os.path.isdir(gd):
        return {"git_objects": [".git: a gitdir link to a repository outside the tree"]}
    logs = os.path.join(gd, "logs")
    entries = [
        os.path.relpath(os.path.join(d, f), root)
        for d, _, fs in os.walk(logs)
        for f in fs
        if os.path.getsize(os.path.join(d, f)) > 0
    ]
    entries += [
        f".git/{n}" for n in ("ORIG_HEAD", "FETCH_HEAD") if os.path.exists(os.path.join(gd, n))
    ]
    if entries:
        out["reflog"] = [f"{e}: reflog entries name other commits" for e in sorted(entries)]
    tags = (_git_out(root, "for-each-ref", "--format=%(refname)", "refs/tags") or "").split()
    if tags:
        out["tags"] = [f"{t}: a tag in the agent's repository" for t in tags]
    reachable = _git_out(root, "rev-list", "--objects", "HEAD")
    every = _git_out(root, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)")
    if reachable is None or every is None:
        out["git_objects"] = [".git: unreadable or without a HEAD commit"]
        return out
    base = {ln.split()[0] for ln in reachable.splitlines() if ln.strip()}
    extra = sorted({ln.strip() for ln in every.splitlines() if ln.strip()} - base)
    refs = _git_out(root, "for-each-ref", "--format=%(refname) %(objectname)") or ""
    head = (_git_out(root, "rev-parse", "HEAD") or "").strip()
    other = [
        ln.split()[0]
        for ln in refs.splitlines()
        if ln.split()
        and not ln.startswith("refs/tags/")
        and ln.split()[1] != head
        and ln.split()[1] not in base
    ]
    if extra or other:
        out["git_objects"] = [
            f".git: {len(extra)} object(s) not reachable from HEAD"
            + (f"; refs beyond it: {', '.join(other)}" if other else "")
        ]
    return out


def leak_kinds(
    task: Any,
    *,
    source_dir: str | os.PathLike | None = None,
    tree_dir: str | os.PathLike | None = None,
) -> dict[str, list[str]]:
    """Where the gold patch is reachable, by kind (``LEAK_KINDS``); empty: no leak found.

    ``source_dir``: the task's directory (``RepoTask.from_dir``); its version-control history
    (``repo/.git``, which ``RepoTask`` never carries) is searched for the gold patch's lines.
    ``tree_dir``: the agent's materialised tree; its git data (``git_leaks``) and stray
    patch/backup files on disk are checked.
    """
    task = _as_task(task)
    found: dict[str, set[str]] = collections.defaultdict(set)
    paths = set(task.files)
    if tree_dir is not None:
        for kind, items in git_leaks(tree_dir).items():
            found[kind].update(items)
        root = os.fspath(tree_dir)
        for d, dirs, fs in os.walk(root):
            dirs[:] = [x for x in dirs if x != ".git"]
            paths.update(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in fs)
    for path in sorted(paths):
        parts = path.split("/")
        if any(p in VCS_DIRS for p in parts):
            found["git_objects"].add(f"{path}: version-control data in the task's files")
        elif any(fnmatch.fnmatch(posixpath.basename(path), pat) for pat in LEAKY_PATTERNS):
            found["patch_files"].add(f"{path}: patch/backup file in the task's files")
    ref = task.reference_patch
    if ref.strip():
        try:
            added = _added_lines(ref)
        except Exception:  # noqa: BLE001 - an unparsable gold patch fails the gold runs instead
            added = None
        if added is not None:
            _text_leaks(task, ref, added, source_dir, found)
    return {k: sorted(found[k]) for k in LEAK_KINDS if found.get(k)}


def _text_leaks(task, ref, added, source_dir, found) -> None:
    distinctive = set()
    for path, lines in added.items():
        pristine = task.files.get(path, "")
        for ln in lines:
            s = ln.strip()
            if len(s) >= MIN_LEAK_LINE_CHARS and s not in pristine:
                distinctive.add(s)
    body = "".join(ln for ln in ref.splitlines(True) if ln.startswith("+") and ln[:3] != "+++")
    texts = {path: ("file_text", text) for path, text in task.files.items()}
    texts["<issue text>"] = ("issue_text", task.issue)
    if source_dir is not None:
        history = _history_text(os.fspath(source_dir))
        if history is not None:
            texts["<version-control history>"] = (
                "history",
                "\n".join(ln[1:] for ln in history.splitlines() if ln[:1] in "+-"),
            )
    for path, (kind, text) in sorted(texts.items()):
        if body.strip() and body in text:
            found[kind].add(f"{path}: contains the gold patch's added text")
            continue
        if distinctive:
            hits = sum(1 for s in distinctive if s in text)
            if hits >= max(1, LEAK_LINE_FRACTION * len(distinctive)):
                found[kind].add(
                    f"{path}: holds {hits}/{len(distinctive)} distinctive lines of the gold patch"
                )


def leak_findings(
    task: Any,
    *,
    source_dir: str | os.PathLike | None = None,
    tree_dir: str | os.PathLike | None = None,
) -> list[str]:
    """Where the gold patch is reachable (``leak_kinds``, flattened; empty: no leak found)."""
    kinds = leak_kinds(task, source_dir=source_dir, tree_dir=tree_dir)
    return sorted({item for items in kinds.values() for item in items})


def precheck(
    task: Any,
    *,
    repeats: int = 5,
    limits: Any = None,
    config: Any = None,
    extra_pythonpath: Sequence[str] = (),
    source_dir: str | os.PathLike | None = None,
    tree_dir: str | os.PathLike | None = None,
) -> AuditReport:
    """Execution pre-checks of one task in the sandbox (see the module docstring).

    Args:
      task: a ``envs.repo.RepoTask`` or its JSON dict.
      repeats: runs of each patch (gold and empty); >= 2 to detect flakiness.
      limits, config, extra_pythonpath: passed to ``verify.verify_repo_patch``.
      source_dir: the task's directory, whose version-control history is searched for leaks.
      tree_dir: the agent's materialised tree, whose git data and files are checked for leaks.
    """
    import functools

    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"precheck: repeats must be an int >= 1, got {repeats!r}")
    task = _as_task(task)
    runs: list[AuditRun] = []
    plan = [
        (kind, patch, r)
        for kind, patch in (("gold", task.reference_patch), ("empty", ""))
        for r in range(repeats)
    ]
    # every run on the execution back-end (one after the other locally, at once on a cluster)
    backend = execution.current()
    verdicts = backend.gather(
        [
            functools.partial(
                execution.verify_repo_call,
                task,
                patch,
                backend=backend,
                limits=limits or DEFAULT_LIMITS,
                config=config,
                run_monitor=False,
                extra_pythonpath=tuple(extra_pythonpath),
            )
            for _, patch, _ in plan
        ]
    )
    for (kind, _, r), v in zip(plan, verdicts):
        runs.append(AuditRun(kind, r, v.status, dict(v.tests)))
    details: dict[str, str] = {}
    if any(r.status == "infra_error" for r in runs):
        details["infra_error"] = "the sandbox could not run the tests"
        return AuditReport(task.task_id, False, ("infra_error",), tuple(runs), details)

    def outcomes(kind: str, test: str) -> list[str]:
        return [r.tests.get(test, "missing") for r in runs if r.patch == kind]

    f2p, p2p = task.fail_to_pass, task.pass_to_pass
    never = lambda kind, t: all(o != "passed" for o in outcomes(kind, t))  # noqa: E731
    bad_f2p = [t for t in f2p if never("gold", t)]
    bad_p2p = [t for t in p2p if t not in f2p and never("gold", t)]
    free = [t for t in f2p if all(o == "passed" for o in outcomes("empty", t))]
    flaky = sorted(
        {
            f"{t} ({kind}: {sorted(set(outcomes(kind, t)))})"
            for kind in ("gold", "empty")
            for t in task.required_tests
            if len(set(outcomes(kind, t))) > 1
        }
    )
    if not task.reference_patch.strip():
        details["gold_fails_f2p"] = "the task has no reference patch"
    elif bad_f2p:
        details["gold_fails_f2p"] = ", ".join(bad_f2p)
    if bad_p2p:
        details["gold_breaks_p2p"] = ", ".join(bad_p2p)
    if free:
        details["empty_patch_passes"] = ", ".join(free)
    if flaky:
        details["flaky"] = "; ".join(flaky)
    kinds = leak_kinds(task, source_dir=source_dir, tree_dir=tree_dir)
    if kinds:
        details["leaks_solution"] = "; ".join(sorted({i for v in kinds.values() for i in v}))
        for kind, items in kinds.items():
            details[f"leaks_solution:{kind}"] = "; ".join(items)
    reasons = tuple(r for r in REASONS if r in details)
    return AuditReport(task.task_id, not reasons, reasons, tuple(runs), details)


# ------------------------------------------------------------------------------------------------
# 2. The evaluator agent
# ------------------------------------------------------------------------------------------------


class AuditRejected(ValueError):
    """An auditor submission failed validation (fed back to the model while steps last)."""


@dataclasses.dataclass(frozen=True)
class AuditEvidence:
    """A pointer backing a score: ``kind`` in ``EVIDENCE_KINDS``; ``path``/``line`` for files
    and tests, ``quote`` (>= 3 chars) that must occur where it points."""

    kind: str
    path: str | None = None
    line: int | None = None
    quote: str | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class AuditVote:
    underspecification: int
    test_validity: int
    difficulty: str
    category: str
    evidence: tuple[AuditEvidence, ...] = ()


@dataclasses.dataclass(frozen=True)
class TaskAudit:
    """The merged audit of one task (``vote`` is None when every vote fell back)."""

    task_id: str
    vote: AuditVote | None
    votes: tuple[AuditVote, ...]
    fallbacks: int
    aggregation: str
    prompt_version: str
    reasons: tuple[str, ...] = ()  # why votes fell back

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "vote": dataclasses.asdict(self.vote) if self.vote else None,
            "votes": [dataclasses.asdict(v) for v in self.votes],
            "fallbacks": self.fallbacks,
            "aggregation": self.aggregation,
            "prompt_version": self.prompt_version,
            "reasons": list(self.reasons),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TaskAudit:
        def vote(v):
            return AuditVote(**{**v, "evidence": tuple(AuditEvidence(**e) for e in v["evidence"])})

        return cls(
            str(d["task_id"]),
            vote(d["vote"]) if d.get("vote") else None,
            tuple(vote(v) for v in d.get("votes", ())),
            int(d.get("fallbacks", 0)),
            str(d.get("aggregation", "max_severity")),
            str(d.get("prompt_version", PROMPT_VERSION)),
            tuple(d.get("reasons", ())),
        )


def _score(obj: Mapping, key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 3:
        raise AuditRejected(f"field {key!r} must be an integer 0..3, got {v!r}")
    return v


def parse_audit(
    obj: Any, task: Any, *, gold_shown: bool, examples: Sequence[str] = ()
) -> AuditVote:
    """Validates one auditor submission against the task; raises ``AuditRejected``."""
    if not isinstance(obj, Mapping):
        raise AuditRejected(f"expected an object, got {type(obj).__name__}")
    extra = set(obj) - {"underspecification", "test_validity", "difficulty", "category", "evidence"}
    if extra:
        raise AuditRejected(f"unknown fields {sorted(extra)}")
    under, valid = _score(obj, "underspecification"), _score(obj, "test_validity")
    diff, cat = obj.get("difficulty"), obj.get("category")
    if diff not in DIFFICULTY_BUCKETS:
        raise AuditRejected(f"field 'difficulty' must be one of {DIFFICULTY_BUCKETS}, got {diff!r}")
    if cat not in CATEGORIES:
        raise AuditRejected(f"field 'category' must be one of {CATEGORIES}, got {cat!r}")
    evs = obj.get("evidence", [])
    if not isinstance(evs, list):
        raise AuditRejected("field 'evidence' must be a list")
    tests_text = {p: task.files[p] for p in task.files if p in task.test_files}
    test_patch_files = {}
    if task.test_patch.strip():
        try:
            for path, lines in _added_lines(task.test_patch).items():
                test_patch_files[path] = "\n".join(lines)
        except Exception:  # noqa: BLE001
            pass
    evidence = []
    for k, ev in enumerate(evs):
        where = f"evidence[{k}]"
        if not isinstance(ev, Mapping):
            raise AuditRejected(f"{where}: expected an object")
        kind = ev.get("kind")
        if kind not in EVIDENCE_KINDS:
            raise AuditRejected(f"{where}.kind must be one of {EVIDENCE_KINDS}, got {kind!r}")
        path, line, quote = ev.get("path"), ev.get("line"), ev.get("quote")
        note = ev.get("note") or ""
        if quote is not None and (not isinstance(quote, str) or len(quote.strip()) < 3):
            raise AuditRejected(f"{where}.quote must be text of >= 3 characters")
        if line is not None and (not isinstance(line, int) or isinstance(line, bool)):
            raise AuditRejected(f"{where}.line must be an integer")
        q = quote.strip() if quote else None
        if kind == "issue":
            if not q or q not in task.issue:
                raise AuditRejected(f"{where}: issue evidence needs a quote of the issue text")
        elif kind == "patch":
            if not gold_shown:
                raise AuditRejected(f"{where}: the gold patch was not shown")
            if not q or q not in task.reference_patch:
                raise AuditRejected(f"{where}: quote not in the gold patch")
        elif kind == "example":
            if not q or not any(q in e for e in examples):
                raise AuditRejected(f"{where}: quote not in the examples")
        else:  # file / test
            pool = dict(task.files) if kind == "file" else {**tests_text, **test_patch_files}
            if kind == "test" and not pool:
                pool = dict(task.files)
            if not isinstance(path, str) or path not in pool:
                raise AuditRejected(f"{where}: {kind} {path!r} does not exist")
            lines = pool[path].splitlines()
            if line is not None and not 1 <= line <= len(lines):
                raise AuditRejected(f"{where}: line {line} outside {path} (1..{len(lines)})")
            if q and q not in (lines[line - 1] if line else pool[path]):
                raise AuditRejected(f"{where}: quote not at {path}:{line or ''}")
        evidence.append(AuditEvidence(kind, path, line, quote, str(note)[:300]))
    if (under >= 2 or valid >= 2) and not evidence:
        raise AuditRejected("a score >= 2 needs at least one evidence pointer")
    return AuditVote(under, valid, diff, cat, tuple(evidence))


def _mode(values: Sequence[Any], order: Sequence[Any]) -> Any:
    """Most common value; ties go to the latest in ``order`` (the more severe)."""
    counts = collections.Counter(values)
    top = max(counts.values())
    return max((v for v, n in counts.items() if n == top), key=order.index)


def merge_audit_votes(votes: Sequence[AuditVote], aggregation: str = "max_severity") -> AuditVote:
    """Merges votes (order-invariant; one vote merges to itself).

    ``max_severity``: the largest ``underspecification`` and ``test_validity`` of any vote (the
    human protocol); ``majority``: the most common value, ties to the more severe. Both: the
    difficulty bucket by majority (ties harder), the category by majority (ties by
    ``CATEGORIES`` order), the union of the votes' evidence.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if not votes:
        raise ValueError("merge_audit_votes: no votes")
    if len(votes) == 1:
        return votes[0]
    scale = (0, 1, 2, 3)
    if aggregation == "max_severity":
        under = max(v.underspecification for v in votes)
        valid = max(v.test_validity for v in votes)
    else:
        under = _mode([v.underspecification for v in votes], scale)
        valid = _mode([v.test_validity for v in votes], scale)
    diff = _mode([v.difficulty for v in votes], DIFFICULTY_BUCKETS)
    cat = _mode([v.category for v in votes], tuple(reversed(CATEGORIES)))
    evidence = tuple(sorted({e for v in votes for e in v.evidence}, key=repr))
    return AuditVote(under, valid, diff, cat, evidence)


def load_audit_prompt(name: str, version: str = PROMPT_VERSION) -> str:
    res = importlib.resources.files("gagar_jax.data") / "prompts" / version / f"{name}.md"
    if not res.is_file():
        raise FileNotFoundError(f"auditor prompt {version}/{name}.md not found in gagar_jax.data")
    return res.read_text(encoding="utf-8")


def _fn(name: str, description: str, properties: dict, required: Sequence[str] = ()) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(required)},
        },
    }


AUDIT_TOOLS = [
    _fn("list_files", "Paths of the repository's files.", {}),
    _fn(
        "read_file",
        "Numbered lines [start_line, end_line] of a repository file.",
        {
            "path": {"type": "string"},
            "start_line": {"type": "integer"},
            "end_line": {"type": "integer"},
        },
        ["path"],
    ),
    _fn("read_tests", "The tests that decide the task: ids, test files, hidden test patch.", {}),
    _fn("read_examples", "Worked examples of audited tasks (when provided).", {}),
    _fn("show_gold_patch", "The reference solution (when provided).", {}),
    _fn(
        "submit_audit",
        "Submit the audit.",
        {
            "underspecification": {"type": "integer", "minimum": 0, "maximum": 3},
            "test_validity": {"type": "integer", "minimum": 0, "maximum": 3},
            "difficulty": {"type": "string", "enum": list(DIFFICULTY_BUCKETS)},
            "category": {"type": "string", "enum": list(CATEGORIES)},
            "evidence": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "kind": {"type": "string", "enum": list(EVIDENCE_KINDS)},
                        "path": {"type": "string"},
                        "line": {"type": "integer"},
                        "quote": {"type": "string"},
                        "note": {"type": "string"},
                    },
                    "required": ["kind"],
                },
            },
        },
        ["underspecification", "test_validity", "difficulty", "category", "evidence"],
    ),
]
AUDIT_TOOL_NAMES = tuple(t["function"]["name"] for t in AUDIT_TOOLS)


class TaskAuditor:
    """LLM evaluator agent over one task (see the module docstring).

    Args:
      client: anything with ``chat_completions(messages, *, tools, max_tokens, temperature)``.
      votes: independent episodes per task (K).
      aggregation: ``"max_severity"`` or ``"majority"``.
      include_gold: show the gold patch (the paper: helps test alignment).
      examples: worked examples (the paper: help clarity), shown through ``read_examples``.
      max_steps: model calls per vote. max_tokens, temperature, vote_temperature: sampling.
      prompt_version: directory under ``data/prompts/``.
      seed: seeds the per-vote order in which the files are listed.
    """

    def __init__(
        self,
        client: Any,
        *,
        votes: int = 1,
        aggregation: str = "max_severity",
        include_gold: bool = True,
        examples: Sequence[str] = (),
        max_steps: int = 10,
        max_tokens: int = 1024,
        temperature: float = 0.0,
        vote_temperature: float = 0.7,
        prompt_version: str = PROMPT_VERSION,
        seed: int = 0,
    ):
        if not isinstance(votes, int) or votes < 1:
            raise ValueError(f"TaskAuditor.votes must be an int >= 1, got {votes!r}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"TaskAuditor.aggregation must be one of {AGGREGATIONS}")
        if max_steps < 1:
            raise ValueError(f"TaskAuditor.max_steps must be >= 1, got {max_steps}")
        self.client = client
        self.votes = votes
        self.aggregation = aggregation
        self.include_gold = include_gold
        self.examples = tuple(examples)
        self.max_steps = max_steps
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.vote_temperature = vote_temperature
        self.prompt_version = prompt_version
        self.seed = seed
        self.system = load_audit_prompt("system", prompt_version)
        self.template = string.Template(load_audit_prompt("task", prompt_version))
        self.metrics: collections.Counter[str] = collections.Counter()

    def audit(self, task: Any) -> TaskAudit:
        task = _as_task(task)
        accepted, reasons = [], []
        for k in range(self.votes):
            try:
                accepted.append(self._episode(task, k))
                self.metrics["votes_accepted"] += 1
            except AuditRejected as e:
                reasons.append(str(e)[:300])
                self.metrics["votes_fallback"] += 1
            except Exception as e:  # noqa: BLE001 - a dead server is a fallback, counted
                reasons.append(f"client error: {type(e).__name__}: {str(e)[:200]}")
                self.metrics["client_errors"] += 1
                self.metrics["votes_fallback"] += 1
        vote = merge_audit_votes(accepted, self.aggregation) if accepted else None
        if vote is None:
            self.metrics["tasks_fallback"] += 1
        return TaskAudit(
            task.task_id,
            vote,
            tuple(accepted),
            self.votes - len(accepted),
            self.aggregation,
            self.prompt_version,
            tuple(reasons),
        )

    def _tools(self) -> list[dict]:
        skip = set()
        if not self.include_gold:
            skip.add("show_gold_patch")
        if not self.examples:
            skip.add("read_examples")
        return [t for t in AUDIT_TOOLS if t["function"]["name"] not in skip]

    def _run_tool(self, task, name: str, args: Mapping[str, Any], order: list[str]) -> str:
        if name == "list_files":
            return "\n".join(order)
        if name == "read_file":
            path = args.get("path")
            if path not in task.files:
                raise ValueError(f"no file {path!r}")
            lines = task.files[path].splitlines()
            start = max(1, int(args.get("start_line", 1)))
            end = min(len(lines), int(args.get("end_line", start + 199)), start + 199)
            return "\n".join(f"{n:5d}  {lines[n - 1]}" for n in range(start, end + 1)) or "(empty)"
        if name == "read_tests":
            parts = [
                "fail_to_pass: " + ", ".join(task.fail_to_pass),
                "pass_to_pass: " + ", ".join(task.pass_to_pass),
            ]
            for p in task.test_files:
                if p in task.files:
                    parts.append(f"--- {p}\n{task.files[p]}")
            if task.test_patch.strip():
                parts.append(f"--- hidden test patch\n{task.test_patch}")
            return "\n".join(parts)[:8000]
        if name == "read_examples" and self.examples:
            return "\n\n".join(self.examples)[:8000]
        if name == "show_gold_patch" and self.include_gold:
            return task.reference_patch or "(no reference patch)"
        raise ValueError(f"tool {name!r} is not available; tools: {AUDIT_TOOL_NAMES}")

    def _episode(self, task, vote: int) -> AuditVote:
        seed = int.from_bytes(
            hashlib.sha256(f"{self.seed}/{task.task_id}/{vote}".encode()).digest()[:8], "big"
        )
        order = sorted(task.files)
        random.Random(seed).shuffle(order)
        temperature = self.temperature if vote == 0 else self.vote_temperature
        user = self.template.substitute(
            issue=task.issue,
            num_files=len(task.files),
            gold="available (show_gold_patch)" if self.include_gold else "not available",
            examples="available (read_examples)" if self.examples else "not available",
        )
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": user}]
        tools = self._tools()
        last: AuditRejected | None = None
        for _ in range(self.max_steps):
            self.metrics["steps"] += 1
            resp = self.client.chat_completions(
                messages, tools=tools, max_tokens=self.max_tokens, temperature=temperature
            )
            try:
                msg = resp["choices"][0]["message"]
            except (KeyError, IndexError, TypeError):
                last = AuditRejected("response without choices[0].message")
                messages.append({"role": "user", "content": "Your reply was empty. Continue."})
                continue
            content = msg.get("content") or ""
            calls = msg.get("tool_calls") or []
            good = []
            for k, call in enumerate(calls if isinstance(calls, list) else []):
                fn = call.get("function") if isinstance(call, dict) else None
                name = fn.get("name") if isinstance(fn, dict) else None
                try:
                    raw = fn.get("arguments") or "{}"
                    args = json.loads(raw) if isinstance(raw, str) else raw
                except (json.JSONDecodeError, AttributeError):
                    args = None
                if name in AUDIT_TOOL_NAMES and isinstance(args, dict):
                    good.append((str(call.get("id") or f"call_{k}"), name, args))
            messages.append(
                {
                    "role": "assistant",
                    "content": str(content)[:4000],
                    **(
                        {
                            "tool_calls": [
                                {
                                    "id": i,
                                    "type": "function",
                                    "function": {"name": n, "arguments": json.dumps(a)},
                                }
                                for i, n, a in good
                            ]
                        }
                        if good
                        else {}
                    ),
                }
            )
            if not calls:
                try:
                    obj = first_json_object(content)
                except OutputRejected as e:
                    last = AuditRejected(str(e))
                    messages.append(
                        {"role": "user", "content": f"Rejected: {e}. Call submit_audit."}
                    )
                    continue
                good = [("text", "submit_audit", obj)]
            for call_id, name, args in good:
                if name == "submit_audit":
                    try:
                        return parse_audit(
                            args, task, gold_shown=self.include_gold, examples=self.examples
                        )
                    except AuditRejected as e:
                        last = e
                        self.metrics["rejections"] += 1
                        out = f"Audit rejected: {e}. Fix it and call submit_audit again."
                else:
                    try:
                        out = self._run_tool(task, name, args, order)
                    except Exception as e:  # noqa: BLE001 - reported to the model
                        out = f"error: {type(e).__name__}: {e}"
                if call_id == "text":
                    messages.append({"role": "user", "content": out})
                else:
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": out})
        raise last or AuditRejected(f"no audit within {self.max_steps} steps")


class ScriptedAuditorPolicy:
    """A deterministic evaluator policy for ``TaskAuditor`` (tests and a reference baseline).

    It reads only the tools' outputs: ``list_files``, ``read_tests``, the gold patch when offered,
    then submits. Heuristics: an issue of fewer than 12 words, or one asking a question without
    naming a file or function of the repository, is underspecified (2, quoting the issue); tests
    that never call (``name(``) a function the gold patch changes are invalid (3, citing the
    test file); otherwise 0/0. ``first_invalid`` makes the first submission cite a line that
    does not exist.
    """

    def __init__(self, *, first_invalid: bool = False):
        self.first_invalid = first_invalid
        self.calls = 0

    def chat_completions(self, messages, *, tools=None, max_tokens=1024, temperature=0.0):
        self.calls += 1
        results = {
            m.get("tool_call_id"): m.get("content", "") for m in messages if m.get("role") == "tool"
        }
        names = {t["function"]["name"] for t in tools or ()}
        wanted = [("files", "list_files"), ("tests", "read_tests")]
        if "show_gold_patch" in names:
            wanted.append(("gold", "show_gold_patch"))
        missing = [(i, n) for i, n in wanted if i not in results]
        if missing:
            return _calls([(i, n, {}) for i, n in missing])
        issue = messages[1]["content"].split("ISSUE:\n", 1)[1].split("\nEND ISSUE", 1)[0]
        rejected = sum(
            1 for m in messages if str(m.get("content", "")).startswith("Audit rejected")
        )
        under, valid, evidence = 0, 0, []
        words = issue.split()
        files = results["files"].splitlines()
        stems = {posixpath.splitext(posixpath.basename(f))[0] for f in files}
        gold = results.get("gold", "")
        changed, current = set(), None  # functions enclosing a changed line of the gold patch
        for ln in gold.splitlines():
            if ln.startswith("@@"):
                current = ln.split("def ", 1)[1].split("(", 1)[0] if "def " in ln else None
            elif ln[1:].startswith("def "):
                current = ln[5:].split("(", 1)[0]
            if ln[:1] in "+-" and ln[:3] not in ("+++", "---") and current:
                changed.add(current)
        mentions = any(s in issue for s in stems | changed if len(s) >= 3)
        if len(words) < 12 or ("?" in issue and not mentions):
            under = 2
            evidence.append({"kind": "issue", "quote": " ".join(words[:3]), "note": "vague"})
        tests = results["tests"]
        test_file = next(
            (
                ln[4:]
                for ln in tests.splitlines()
                if ln.startswith("--- ") and not ln.startswith("--- hidden")
            ),
            None,
        )
        calls = lambda c: re.search(rf"\b{re.escape(c)}\(", tests)  # noqa: E731
        if changed and not any(calls(c) for c in changed) and test_file:
            valid = 3
            line = 10_000 if self.first_invalid and not rejected else 1
            evidence.append(
                {
                    "kind": "test",
                    "path": test_file,
                    "line": line,
                    "note": "tests never call the changed code",
                }
            )
        size = sum(1 for ln in gold.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))
        audit = {
            "underspecification": under,
            "test_validity": valid,
            "difficulty": "<15m" if size <= 4 else "15m-1h",
            "category": "bug_fix",
            "evidence": evidence,
        }
        return _calls([(f"submit{rejected}", "submit_audit", audit)])


def _calls(calls: list[tuple[str, str, dict]]) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": i,
                            "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a)},
                        }
                        for i, n, a in calls
                    ],
                },
            }
        ]
    }


def auditor_calibration(
    audits: Sequence[TaskAudit],
    labels: Mapping[str, Mapping[str, bool]],
    *,
    threshold: int = 2,
    prechecks: Sequence[AuditReport] = (),
) -> dict[str, dict[str, float]]:
    """Precision/recall of the audit's flags against planted labels.

    ``labels[task_id]`` = ``{"unclear": bool, "invalid_tests": bool[, "leaked": bool]}``; a task
    is flagged unclear when ``underspecification >= threshold``, invalid when ``test_validity >=
    threshold`` (fallback audits count as not flagged), and leaked when its pre-check (in
    ``prechecks``, matched by task id) has ``leaks_solution``.
    """
    flags = {}
    for a in audits:
        flags.setdefault(a.task_id, {})
        flags[a.task_id]["unclear"] = a.vote is not None and a.vote.underspecification >= threshold
        flags[a.task_id]["invalid_tests"] = a.vote is not None and a.vote.test_validity >= threshold
    for r in prechecks:
        flags.setdefault(r.task_id, {})["leaked"] = "leaks_solution" in r.reasons
    out = {}
    for key in ("unclear", "invalid_tests", "leaked"):
        rows = [(bool(labels[t][key]), got[key]) for t, got in flags.items() if key in got]
        if not rows:
            continue
        tp = sum(1 for want, got in rows if want and got)
        fp = sum(1 for want, got in rows if got and not want)
        fn = sum(1 for want, got in rows if want and not got)
        out[key] = {
            "precision": tp / (tp + fp) if tp + fp else 1.0,
            "recall": tp / (tp + fn) if tp + fn else 1.0,
            "tp": tp,
            "fp": fp,
            "fn": fn,
            "n": len(rows),
        }
    return out


# ------------------------------------------------------------------------------------------------
# 3. Pool filters and pass rates
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolEntry:
    """A task with what is known about it: pre-check, LLM audit, and recent attempts."""

    task: Any
    precheck: AuditReport | None = None
    audit: TaskAudit | None = None
    attempts: tuple[bool, ...] = ()

    @property
    def task_id(self) -> str:
        t = self.task
        return t["task_id"] if isinstance(t, Mapping) else t.task_id

    def to_dict(self) -> dict[str, Any]:
        t = self.task
        return {
            "task": dict(t) if isinstance(t, Mapping) else t.to_dict(),
            "precheck": self.precheck.to_dict() if self.precheck else None,
            "audit": self.audit.to_dict() if self.audit else None,
            "attempts": [bool(a) for a in self.attempts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PoolEntry:
        return cls(
            d["task"],
            AuditReport.from_dict(d["precheck"]) if d.get("precheck") else None,
            TaskAudit.from_dict(d["audit"]) if d.get("audit") else None,
            tuple(bool(a) for a in d.get("attempts", ())),
        )


def save_pool(path: str | os.PathLike, entries: Iterable[PoolEntry]) -> None:
    """Writes entries as JSON lines (tasks with their audit results and attempts)."""
    with open(path, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e.to_dict(), sort_keys=True) + "\n")


def load_pool(path: str | os.PathLike) -> list[PoolEntry]:
    with open(path, encoding="utf-8") as f:
        return [PoolEntry.from_dict(json.loads(line)) for line in f if line.strip()]


THRESHOLD_KEYS = (
    "require_precheck",
    "max_underspecification",
    "max_test_validity",
    "require_audit",
    "skip_saturated",
)


def _entry(x: Any) -> PoolEntry:
    return x if isinstance(x, PoolEntry) else PoolEntry(x)


def filter_tasks(
    pool: Iterable[Any], thresholds: Mapping[str, Any]
) -> tuple[list[PoolEntry], dict[str, Any]]:
    """Keeps the entries that meet every threshold; reports what each threshold keeps alone.

    Thresholds (all optional):
      ``require_precheck`` (bool): the pre-check ran and is ok (a missing one drops the task).
      ``max_underspecification`` / ``max_test_validity`` (0..3): the merged audit's scores are at
        most this (a task without an accepted audit is kept unless ``require_audit``).
      ``require_audit`` (bool): an accepted LLM audit exists.
      ``skip_saturated`` (``{"window": n, "min_attempts": m}``): drop tasks whose last ``window``
        attempts (at least ``min_attempts`` of them) all passed or all failed.

    Returns ``(kept, report)``; ``report`` has ``total``, ``kept``, ``per_threshold`` (kept by
    that threshold alone) and ``reasons`` (drop reason -> count, e.g. ``precheck:flaky``).
    """
    unknown = set(thresholds) - set(THRESHOLD_KEYS)
    if unknown:
        raise ValueError(
            f"filter_tasks: unknown thresholds {sorted(unknown)}; known {THRESHOLD_KEYS}"
        )
    for key in ("max_underspecification", "max_test_validity"):
        v = thresholds.get(key)
        if v is not None and (not isinstance(v, int) or not 0 <= v <= 3):
            raise ValueError(f"filter_tasks: {key} must be an integer 0..3, got {v!r}")
    entries = [_entry(x) for x in pool]

    def why(e: PoolEntry, key: str) -> list[str]:
        val = thresholds[key]
        if key == "require_precheck" and val:
            if e.precheck is None:
                return ["precheck:missing"]
            return [f"precheck:{r}" for r in e.precheck.reasons]
        if key == "require_audit" and val and (e.audit is None or e.audit.vote is None):
            return ["audit:missing"]
        if key in ("max_underspecification", "max_test_validity") and val is not None:
            field = key[4:]
            if e.audit is not None and e.audit.vote is not None:
                if getattr(e.audit.vote, field) > val:
                    return [f"audit:{field}>{val}"]
        if key == "skip_saturated" and val:
            window = int(val.get("window", 8))
            need = int(val.get("min_attempts", window))
            last = e.attempts[-window:]
            if len(last) >= need and len(set(last)) == 1:
                return [f"saturated:pass_rate={float(last[0]):.0f}"]
        return []

    reasons: collections.Counter[str] = collections.Counter()
    per_threshold = {}
    kept = []
    for key in thresholds:
        per_threshold[key] = sum(1 for e in entries if not why(e, key))
    for e in entries:
        rs = [r for key in thresholds for r in why(e, key)]
        reasons.update(rs)
        if not rs:
            kept.append(e)
    report = {
        "total": len(entries),
        "kept": len(kept),
        "per_threshold": per_threshold,
        "reasons": dict(sorted(reasons.items())),
    }
    return kept, report


class PassRateTracker:
    """Empirical pass rates over the last ``window`` attempts per task (dynamic sampling).

    ``skip(task_id)`` is True once at least ``min_attempts`` of the last ``window`` attempts are
    recorded and they all passed or all failed (the group would have no signal).
    """

    def __init__(self, window: int = 8, min_attempts: int = 4):
        if window < 1 or not 1 <= min_attempts <= window:
            raise ValueError(
                f"PassRateTracker: need window >= 1 and 1 <= min_attempts <= window, got "
                f"{window}, {min_attempts}"
            )
        self.window = window
        self.min_attempts = min_attempts
        self._hist: dict[str, collections.deque[bool]] = {}

    def record(self, task_id: str, passed: Iterable[bool] | bool) -> None:
        h = self._hist.setdefault(task_id, collections.deque(maxlen=self.window))
        h.extend([bool(passed)] if isinstance(passed, bool) else [bool(p) for p in passed])

    def pass_rate(self, task_id: str) -> float | None:
        h = self._hist.get(task_id)
        return sum(h) / len(h) if h else None

    def skip(self, task_id: str) -> bool:
        h = self._hist.get(task_id)
        return bool(h) and len(h) >= self.min_attempts and len(set(h)) == 1

    def attempts(self, task_id: str) -> tuple[bool, ...]:
        return tuple(self._hist.get(task_id, ()))

    def saturated(self) -> list[str]:
        """The task ids ``skip`` is True for (sorted)."""
        return sorted(t for t in self._hist if self.skip(t))

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state (for a resumable loop): the window and each task's last attempts."""
        return {
            "window": self.window,
            "min_attempts": self.min_attempts,
            "attempts": {t: [bool(x) for x in h] for t, h in sorted(self._hist.items())},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PassRateTracker:
        tr = cls(int(state["window"]), int(state["min_attempts"]))
        for t, h in state.get("attempts", {}).items():
            tr.record(str(t), [bool(x) for x in h])
        return tr
