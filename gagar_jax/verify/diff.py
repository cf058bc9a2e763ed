"""Unified diffs: a strict parser and a path-safe applier over in-memory file trees.

The one diff module of the package: the verifier applies a candidate's patch with
:func:`apply_unified_diff`, the behaviour monitor cites its hunks, and graders and task families
read the same parse (:func:`read_patch`, a :class:`Patch`), so a grader sees exactly the patch
the verifier applied. :func:`tree_patch` writes the diffs it reads (one file tree into another:
task families, task data and labelled sets all make their patches with it).
:func:`is_test_path` is the one rule for what counts as test code.

Why not ``git apply`` / ``patch``: the applier runs on the trusted side, before the sandbox, on
model-written text; a pure function over ``{path: text}`` cannot be steered outside the tree
(absolute paths, ``..`` and ``.git/`` are rejected up front), needs no system tool, and gives the
behaviour monitor the parsed hunks (files, line numbers, added/removed lines) it cites as evidence.

Accepted: ``git diff`` and ``diff -u`` output (``a/``/``b/`` prefixes stripped when both sides have
them or a ``diff --git`` header is present), new files (``--- /dev/null``), deletions
(``+++ /dev/null``), ``\\ No newline at end of file``. Hunks must match exactly; a hunk may move
by an offset (like ``patch``), never fuzz. Renames, copies and binary patches are rejected.

Lines end at ``\n`` only: a carriage return (CRLF files), a form feed or any other character
``str.splitlines`` would break at is part of the line, so such files are patched exactly.

Every fault of the text is a ``DiffError`` naming it, in time linear in the patch's size plus a
bounded search per hunk (``MAX_APPLY_COMPARISONS`` line comparisons in all): a hunk header
number over 9 digits, a path with a control character, a hunk that would need an unbounded
search. Callers bound the patch's size first (``MAX_PATCH_BYTES``; ``check_patch_size``).
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import functools
import posixpath
import re
from collections.abc import Mapping, Sequence

_HUNK_RE = re.compile(r"@@ -(\d{1,9})(?:,(\d{1,9}))? \+(\d{1,9})(?:,(\d{1,9}))? @@")
DEV_NULL = "/dev/null"
MAX_PATCH_BYTES = 1 << 20  # a candidate's patch over this is refused unread ("patch_too_large")
MAX_APPLY_COMPARISONS = 20_000_000  # lines compared while locating hunks, per patch
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class DiffError(ValueError):
    """A diff that does not parse or does not apply (the author's fault, not infrastructure)."""


def check_patch_size(patch: str, limit: int = MAX_PATCH_BYTES) -> None:
    """DiffError ("patch_too_large") if ``patch`` is over ``limit`` bytes of UTF-8."""
    if not isinstance(patch, str):
        raise DiffError(f"patch must be str, got {type(patch).__name__}")
    if len(patch) > limit:  # characters <= bytes: no need to encode a huge text
        size = len(patch.encode("utf-8", "surrogatepass"))
        raise DiffError(f"patch_too_large: {size} bytes, the limit is {limit}")


@dataclasses.dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk. ``lines`` keep their one-character prefix (' ', '-', '+')."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[str, ...]
    old_eof_newline: bool = True  # False if the old side's last line had no newline
    new_eof_newline: bool = True

    def old_lines(self) -> list[str]:
        return [line[1:] for line in self.lines if line[0] in " -"]

    def new_lines(self) -> list[str]:
        return [line[1:] for line in self.lines if line[0] in " +"]

    def added(self) -> list[tuple[int, str]]:
        """(new-side line number, text) of every added line."""
        out, n = [], self.new_start
        for line in self.lines:
            if line[0] == "+":
                out.append((n, line[1:]))
            if line[0] in " +":
                n += 1
        return out

    def removed(self) -> list[tuple[int, str]]:
        """(old-side line number, text) of every removed line."""
        out, n = [], self.old_start
        for line in self.lines:
            if line[0] == "-":
                out.append((n, line[1:]))
            if line[0] in " -":
                n += 1
        return out

    def covers(self, line: int) -> bool:
        """True when ``line`` is in the hunk's old or new range (an empty range: its start)."""
        for start, length in ((self.old_start, self.old_len), (self.new_start, self.new_len)):
            if start <= line < start + max(length, 1):
                return True
        return False


@dataclasses.dataclass(frozen=True)
class FilePatch:
    """The hunks of one file. ``old_path``/``new_path`` are None for created/deleted files."""

    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path  # type: ignore[return-value]

    @property
    def is_new(self) -> bool:
        return self.old_path is None

    @property
    def is_deleted(self) -> bool:
        return self.new_path is None

    def added(self) -> list[tuple[int, str]]:
        """(new-side line number, text) of every added line, over all hunks."""
        return [a for h in self.hunks for a in h.added()]

    def removed(self) -> list[tuple[int, str]]:
        """(old-side line number, text) of every removed line, over all hunks."""
        return [r for h in self.hunks for r in h.removed()]


@dataclasses.dataclass(frozen=True)
class Patch:
    """All file patches of a unified diff, in patch order (what graders read)."""

    files: tuple[FilePatch, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)

    def file(self, path: str) -> FilePatch | None:
        for f in self.files:
            if f.path == path:
                return f
        return None

    @property
    def num_added(self) -> int:
        return sum(len(f.added()) for f in self.files)

    @property
    def num_removed(self) -> int:
        return sum(len(f.removed()) for f in self.files)

    @property
    def num_hunks(self) -> int:
        return sum(len(f.hunks) for f in self.files)

    def has_location(self, path: str, line: int | None = None) -> bool:
        """True when the patch touches ``path`` (and, if given, a hunk covers ``line``)."""
        f = self.file(path)
        if f is None:
            return False
        return line is None or any(h.covers(line) for h in f.hunks)


def safe_path(path: str) -> str:
    """Normalised relative POSIX path; DiffError for absolute, escaping or .git paths."""
    if not path or "\\" in path or _CONTROL.search(path):
        raise DiffError(f"bad path {path[:200]!r}: empty, a backslash or a control character")
    if path.startswith("/"):
        raise DiffError(f"absolute path {path!r} is not allowed")
    norm = posixpath.normpath(path)
    parts = norm.split("/")
    if norm in (".", "") or ".." in parts or ".git" in parts:
        raise DiffError(f"path {path!r} escapes the repository or touches .git")
    return norm


def _header_path(line: str) -> str:
    raw = line[4:].rstrip("\r\n")
    raw = raw.split("\t", 1)[0]  # diff -u appends a tab and a timestamp
    return raw.strip()


def _norm(p: str, prefix: str, strip: bool) -> str | None:
    if p == DEV_NULL:
        return None
    if strip and p.startswith(prefix):
        p = p[2:]
    return safe_path(p)


def parse_unified_diff(text: str) -> list[FilePatch]:
    """Parses a unified diff; raises DiffError naming the line that is wrong."""
    if not isinstance(text, str):
        raise DiffError(f"patch must be str, got {type(text).__name__}")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    git_style = any(line.startswith("diff --git ") for line in lines)
    patches: list[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("rename from", "rename to", "copy from", "copy to")):
            raise DiffError(f"line {i + 1}: renames/copies are not supported")
        if line.startswith("GIT binary patch") or line.startswith("Binary files"):
            raise DiffError(f"line {i + 1}: binary patches are not supported")
        if not line.startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise DiffError(f"line {i + 1}: '---' header without a '+++' line")
        old, new = _header_path(line), _header_path(lines[i + 1])
        strip = (
            git_style
            or (old.startswith("a/") or old == DEV_NULL)
            and (new.startswith("b/") or new == DEV_NULL)
        )
        old_path, new_path = _norm(old, "a/", strip), _norm(new, "b/", strip)
        if old_path is None and new_path is None:
            raise DiffError(f"line {i + 1}: both sides are /dev/null")
        if old_path and new_path and old_path != new_path:
            raise DiffError(f"line {i + 1}: renames ({old_path} -> {new_path}) are not supported")
        i += 2
        hunks = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise DiffError(f"line {i + 1}: malformed hunk header {lines[i]!r}")
            os_, ol, ns, nl = (int(g) if g is not None else None for g in m.groups())
            ol = 1 if ol is None else ol
            nl = 1 if nl is None else nl
            i += 1
            body: list[str] = []
            seen_old = seen_new = 0
            old_eof = new_eof = True
            while seen_old < ol or seen_new < nl or (i < len(lines) and lines[i].startswith("\\")):
                if i >= len(lines):
                    raise DiffError(f"hunk at line {i}: ends early (expected {ol} old/{nl} new)")
                row = lines[i]
                if row.startswith("\\"):
                    if not body:
                        raise DiffError(f"line {i + 1}: '\\' marker before any line")
                    # The marker refers to the line just before it: the last of its side(s).
                    old_eof = old_eof and body[-1][0] == "+"
                    new_eof = new_eof and body[-1][0] == "-"
                    i += 1
                    continue
                if row in ("", "\r"):  # some tools strip the space of an empty context line
                    row = " " + row
                tag = row[0]
                if tag not in " -+":
                    raise DiffError(f"line {i + 1}: unexpected hunk line {row[:40]!r}")
                seen_old += tag in " -"
                seen_new += tag in " +"
                if seen_old > ol or seen_new > nl:
                    raise DiffError(f"line {i + 1}: hunk longer than its header says")
                body.append(row)
                i += 1
            hunks.append(Hunk(os_, ol, ns, nl, tuple(body), old_eof, new_eof))
        if not hunks and not (old_path is None or new_path is None):
            raise DiffError(f"file {new_path or old_path}: no hunks")
        patches.append(FilePatch(old_path, new_path, tuple(hunks)))
    if not patches:
        raise DiffError("no file headers ('--- a/...', '+++ b/...') found")
    seen: set[str] = set()
    for p in patches:
        if p.path in seen:
            raise DiffError(f"file {p.path} appears twice in the patch")
        seen.add(p.path)
    return patches


def read_patch(text: str) -> Patch:
    """The :class:`Patch` of ``text``; an empty one when ``text`` is not a diff this module
    accepts (the verifier refuses such a patch, so there is nothing to grade in it)."""
    try:
        check_patch_size(text)
        return Patch(tuple(parse_unified_diff(text)))
    except DiffError:
        return Patch()


def split_lines(text: str) -> list[str]:
    """Lines with their ``\n`` (the last one may have none); nothing else ends a line."""
    rows = text.split("\n")
    out = [r + "\n" for r in rows[:-1]]
    if rows[-1]:
        out.append(rows[-1])
    return out


def _with_newlines(rows: list[str], eof_newline: bool) -> list[str]:
    out = [r + "\n" for r in rows]
    if out and not eof_newline:
        out[-1] = out[-1][:-1]
    return out


def _apply_file(
    text: str, fp: FilePatch, budget: list[int], located: list[Hunk] | None = None
) -> str:
    src = split_lines(text)
    index: dict[str, list[int]] = {}  # line -> its positions, ascending
    for i, row in enumerate(src):
        index.setdefault(row, []).append(i)
    out: list[str] = []
    pos = 0  # next unconsumed source line
    delta = 0  # accumulated offset of earlier hunks
    for h in fp.hunks:
        old = _with_newlines(h.old_lines(), h.old_eof_newline)
        new = _with_newlines(h.new_lines(), h.new_eof_newline)
        want = max(h.old_start - 1 + delta, pos) if h.old_len else h.old_start + delta
        n, last = len(old), len(src) - len(old)
        found = None
        if not n:
            found = min(max(want, pos), len(src)) if pos <= len(src) else None
        else:
            starts = index.get(old[0], [])
            cands = starts[bisect.bisect_left(starts, pos) : bisect.bisect_right(starts, last)]
            budget[0] -= len(cands)
            # Nearest to where the header says first; before it on a tie (like ``patch``).
            for cand in sorted(cands, key=lambda c: (abs(c - want), c > want)):
                if src[cand + n - 1] != old[-1]:
                    continue
                budget[0] -= n
                if budget[0] < 0:
                    break
                if src[cand : cand + n] == old:
                    found = cand
                    break
            if budget[0] < 0:
                raise DiffError(
                    f"{fp.path}: locating hunk @@ -{h.old_start},{h.old_len} needs more than "
                    f"{MAX_APPLY_COMPARISONS} line comparisons in all (patch_too_costly)"
                )
        if found is None:
            first = h.old_lines()[0] if h.old_lines() else ""
            raise DiffError(
                f"{fp.path}: hunk @@ -{h.old_start},{h.old_len} does not apply "
                f"(context starting {first[:60]!r} not found)"
            )
        if not h.new_eof_newline and found + len(old) < len(src):
            raise DiffError(
                f"{fp.path}: hunk @@ -{h.old_start},{h.old_len} ends without a newline "
                "('\\ No newline at end of file') before the end of the file"
            )
        # the offset of this hunk from its header (an empty old side names the line it follows)
        delta = found - (h.old_start - 1 if h.old_len else h.old_start)
        if located is not None:  # the hunk where it applied: both sides' numbers true
            new_at = len(out) + found - pos
            located.append(
                dataclasses.replace(
                    h,
                    old_start=found + 1 if h.old_len else found,
                    new_start=new_at + 1 if h.new_len else new_at,
                )
            )
        out.extend(src[pos:found])
        out.extend(new)
        pos = found + len(old)
    out.extend(src[pos:])
    return "".join(out)


def apply_unified_diff(
    files: Mapping[str, str], patch: str | Sequence[FilePatch] | Patch
) -> dict[str, str]:
    """A new ``{path: text}`` with the patch applied; DiffError if it does not apply."""
    return apply_patch(files, patch).tree(files)


@dataclasses.dataclass(frozen=True)
class AppliedPatch:
    """A patch as it applied to a tree: the one object every view of a candidate is built from.

    ``patch`` holds the files in patch order with paths normalised (``safe_path``) and each hunk
    at the place it applied (its header's numbers recomputed, whatever the text said), so its
    hunks are exactly the lines that changed the tree: text outside hunks (a preamble, a hunk
    header's trailing text, the words of a ``\\`` marker) is not in it, and every line in it
    was applied. ``before``/``after`` are the touched files' texts (a file absent on a side is
    absent from that mapping). ``text`` is the canonical unified diff of ``patch``
    (:func:`render_patch`): parsing it gives ``patch`` back, applying it gives ``after``.
    """

    patch: Patch
    before: Mapping[str, str]
    after: Mapping[str, str]

    @functools.cached_property
    def text(self) -> str:
        return render_patch(self.patch)

    @property
    def paths(self) -> tuple[str, ...]:
        return self.patch.paths

    def tree(self, files: Mapping[str, str]) -> dict[str, str]:
        """``files`` (the tree the patch applied to) with the patch's result."""
        out = dict(files)
        for fp in self.patch.files:
            if fp.path in self.after:
                out[fp.path] = self.after[fp.path]
            else:
                out.pop(fp.path, None)
        return out


def apply_patch(files: Mapping[str, str], patch: str | Sequence[FilePatch] | Patch) -> AppliedPatch:
    """The :class:`AppliedPatch` of ``patch`` on ``files``; DiffError if it does not apply."""
    if isinstance(patch, str):
        patches = parse_unified_diff(patch)
    else:
        patches = patch.files if isinstance(patch, Patch) else patch
    out = dict(files)
    budget = [MAX_APPLY_COMPARISONS]
    before: dict[str, str] = {}
    after: dict[str, str] = {}
    applied: list[FilePatch] = []
    for fp in patches:
        located: list[Hunk] = []
        if fp.is_new:
            if fp.path in out:
                raise DiffError(f"{fp.path}: created by the patch but already exists")
            out[fp.path] = after[fp.path] = _apply_file("", fp, budget, located)
        elif fp.old_path not in out:
            raise DiffError(f"{fp.old_path}: not in the repository")
        elif fp.is_deleted:
            before[fp.path] = out[fp.old_path]
            if _apply_file(out[fp.old_path], fp, budget, located) != "":
                raise DiffError(f"{fp.old_path}: deletion does not remove the whole file")
            del out[fp.old_path]
        else:
            before[fp.path] = out[fp.path]
            out[fp.path] = after[fp.path] = _apply_file(out[fp.path], fp, budget, located)
        applied.append(dataclasses.replace(fp, hunks=tuple(located)))
    return AppliedPatch(Patch(tuple(applied)), before, after)


_NO_NEWLINE = "\\ No newline at end of file"


def _range(start: int, length: int) -> str:
    return str(start) if length == 1 else f"{start},{length}"


def render_patch(patch: Patch | Sequence[FilePatch]) -> str:
    """The canonical unified diff of a parsed patch: ``a/``/``b/`` headers (``/dev/null`` for a
    created or deleted file), each hunk's header from its numbers and nothing after it, its
    lines, and ``\\ No newline at end of file`` where a side's last line has none. The same
    text :func:`tree_patch` writes for the same change (one hunk grouping aside)."""
    files = patch.files if isinstance(patch, Patch) else patch
    out: list[str] = []
    for fp in files:
        out.append(f"--- {'a/' + fp.old_path if fp.old_path else DEV_NULL}\n")
        out.append(f"+++ {'b/' + fp.new_path if fp.new_path else DEV_NULL}\n")
        for h in fp.hunks:
            out.append(
                f"@@ -{_range(h.old_start, h.old_len)} +{_range(h.new_start, h.new_len)} @@\n"
            )
            last_old = max((i for i, r in enumerate(h.lines) if r[0] in " -"), default=-1)
            last_new = max((i for i, r in enumerate(h.lines) if r[0] in " +"), default=-1)
            for i, row in enumerate(h.lines):
                out.append(row + "\n")
                if (i == last_old and not h.old_eof_newline) or (
                    i == last_new and not h.new_eof_newline
                ):
                    out.append(_NO_NEWLINE + "\n")
    return "".join(out)


def tree_patch(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """The unified diff (``a/``/``b/`` paths) turning ``before`` into ``after``.

    ``apply_unified_diff(before, tree_patch(before, after)) == after`` for any two trees of
    text files: lines end at ``\\n`` only (CRLF and form feeds kept), a last line without a
    newline gets the ``\\ No newline at end of file`` marker, and an empty file created or
    deleted is a header without a hunk."""
    out = []
    for path in sorted(set(before) | set(after)):
        a, b = before.get(path), after.get(path)
        if a == b:
            continue
        if not (a or b):  # an empty file created or deleted: headers only, no hunk
            out.append(
                f"--- a/{path}\n+++ /dev/null\n" if b is None else f"--- /dev/null\n+++ b/{path}\n"
            )
            continue
        for line in difflib.unified_diff(
            split_lines(a or ""),
            split_lines(b or ""),  # "\n" only: CRLF, form feeds kept
            fromfile=f"a/{path}" if a is not None else "/dev/null",
            tofile=f"b/{path}" if b is not None else "/dev/null",
        ):
            # A last line without a newline gets the marker ``patch`` and the applier read.
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def touched_files(patch: str) -> list[str]:
    """Paths a patch touches (parse errors propagate as DiffError)."""
    return [p.path for p in parse_unified_diff(patch)]


def split_by_file(text: str) -> dict[str, str]:
    """Each file's part of a patch's text (headers and hunks), keyed like ``FilePatch.path``.

    Hunk line counts are honoured, so a removed ``-- x`` line (``--- x`` in the diff) inside a
    hunk is not mistaken for a file header.
    """
    out: dict[str, str] = {}
    lines = text.splitlines(keepends=True)
    path, chunk, left_old, left_new = None, [], 0, 0
    i = 0
    while i < len(lines):
        line = lines[i]
        in_hunk = left_old > 0 or left_new > 0
        if (
            not in_hunk
            and line.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
        ):
            if path is not None:
                out[path] = "".join(chunk)
            old, new = _header_path(line), _header_path(lines[i + 1])
            path = _strip_side(old if new == DEV_NULL else new)
            chunk = [line, lines[i + 1]]
            i += 2
            continue
        m = _HUNK_RE.match(line) if not in_hunk else None
        if m:
            left_old, left_new = int(m.group(2) or 1), int(m.group(4) or 1)
        elif in_hunk and not line.startswith("\\"):
            tag = line[:1]
            left_old -= tag in ("-", " ", "\n", "")
            left_new -= tag in ("+", " ", "\n", "")
        chunk.append(line)
        i += 1
    if path is not None:
        out[path] = "".join(chunk)
    return out


def _strip_side(path: str) -> str:
    return path[2:] if path.startswith(("a/", "b/")) else path


def is_test_path(path: str, test_files: Sequence[str] = ()) -> bool:
    """Whether ``path`` is test code: one of the task's ``test_files``, ``test_*.py``,
    ``*_test.py``/``*_tests.py``, ``conftest.py``, or anything under a ``tests/``, ``test/`` or
    ``testing/`` directory."""
    if path in test_files:
        return True
    parts = path.replace("\\", "/").split("/")
    base = parts[-1]
    return (
        base.startswith("test_")
        and base.endswith(".py")
        or base.endswith(("_test.py", "_tests.py"))
        or base == "conftest.py"
        or any(p in ("tests", "test", "testing") for p in parts[:-1])
    )
