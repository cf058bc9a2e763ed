"""Unified-diff parsing for graders: which files and line ranges a patch touches.

Every grader works on unified diffs (``git diff`` / ``difflib.unified_diff`` output). Task
families whose patches have another form (the toy family's line edits) render them as a unified
diff of the edited file before grading, so one parser serves every family.

The parser is lenient about what it cannot use (commit headers, ``index`` lines, binary notices,
``\\ No newline at end of file``) and never raises on arbitrary text: text that holds no hunk
yields an empty ``ParsedPatch``.
"""

from __future__ import annotations

import dataclasses
import re

# At most 9 digits per number: a header with more is not a hunk (``int`` of thousands of digits
# raises, and no real file has a billion lines).
_HUNK_RE = re.compile(r"^@@ -(\d{1,9})(?:,(\d{1,9}))? \+(\d{1,9})(?:,(\d{1,9}))? @@")


@dataclasses.dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk of a file diff.

    Attributes:
      old_start, old_len: the hunk's range in the original file (1-based; ``old_len`` may be 0).
      new_start, new_len: the hunk's range in the patched file.
      added: ``(new_line_number, text)`` for each ``+`` line.
      removed: ``(old_line_number, text)`` for each ``-`` line.
      body: ``(tag, text)`` for every line in order, tag one of ``" "``, ``"-"``, ``"+"``.
    """

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    added: tuple[tuple[int, str], ...]
    removed: tuple[tuple[int, str], ...]
    body: tuple[tuple[str, str], ...] = ()

    def covers(self, line: int) -> bool:
        """True when ``line`` is in the hunk's old or new range (an empty range: its start)."""
        for start, length in ((self.old_start, self.old_len), (self.new_start, self.new_len)):
            if start <= line < start + max(length, 1):
                return True
        return False


@dataclasses.dataclass(frozen=True)
class FileDiff:
    """The hunks of one file; ``path``: new path (old one for a deletion), ``a/``/``b/`` cut."""

    path: str
    hunks: tuple[Hunk, ...]
    is_new: bool = False
    is_deleted: bool = False

    @property
    def added(self) -> list[tuple[int, str]]:
        return [a for h in self.hunks for a in h.added]

    @property
    def removed(self) -> list[tuple[int, str]]:
        return [r for h in self.hunks for r in h.removed]


@dataclasses.dataclass(frozen=True)
class ParsedPatch:
    """All file diffs of a patch, in patch order."""

    files: tuple[FileDiff, ...]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)

    def file(self, path: str) -> FileDiff | None:
        for f in self.files:
            if f.path == path:
                return f
        return None

    @property
    def num_added(self) -> int:
        return sum(len(f.added) for f in self.files)

    @property
    def num_removed(self) -> int:
        return sum(len(f.removed) for f in self.files)

    @property
    def num_hunks(self) -> int:
        return sum(len(f.hunks) for f in self.files)

    def has_location(self, path: str, line: int | None = None) -> bool:
        """True when the patch touches ``path`` (and, if given, a hunk covers ``line``)."""
        f = self.file(path)
        if f is None:
            return False
        return line is None or any(h.covers(line) for h in f.hunks)


def _strip_prefix(path: str) -> str:
    path = path.split("\t", 1)[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    return path


def parse_unified_diff(text: str) -> ParsedPatch:
    """Parses a unified diff into files and hunks; never raises (see module docstring)."""
    files: list[FileDiff] = []
    lines = text.splitlines() if isinstance(text, str) else []
    i = 0
    old_path: str | None = None
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- "):
            old_path = _strip_prefix(line[4:])
            i += 1
            continue
        if line.startswith("+++ ") and old_path is not None:
            new_path = _strip_prefix(line[4:])
            is_new = old_path == "/dev/null"
            is_deleted = new_path == "/dev/null"
            path = old_path if is_deleted else new_path
            i += 1
            hunks: list[Hunk] = []
            while i < len(lines) and not lines[i].startswith(("--- ", "diff ")):
                m = _HUNK_RE.match(lines[i])
                if not m:
                    i += 1
                    continue
                old_start, old_len = int(m.group(1)), int(m.group(2) or 1)
                new_start, new_len = int(m.group(3)), int(m.group(4) or 1)
                i += 1
                o, n = old_start, new_start
                added: list[tuple[int, str]] = []
                removed: list[tuple[int, str]] = []
                body: list[tuple[str, str]] = []
                # Consume exactly the lines the header announces (a "---" line inside a hunk is
                # a removed "--" line, not a new file header).
                left_old, left_new = old_len, new_len
                while i < len(lines) and (left_old > 0 or left_new > 0):
                    body_line = lines[i]
                    if body_line.startswith("\\"):
                        i += 1
                        continue
                    tag, content = body_line[:1], body_line[1:]
                    if tag in "+- " and body_line:
                        body.append((tag, content))
                    elif body_line == "":
                        body.append((" ", ""))
                    if tag == "+":
                        added.append((n, content))
                        n += 1
                        left_new -= 1
                    elif tag == "-":
                        removed.append((o, content))
                        o += 1
                        left_old -= 1
                    elif tag == " " or body_line == "":
                        o += 1
                        n += 1
                        left_old -= 1
                        left_new -= 1
                    else:
                        break
                    i += 1
                hunks.append(
                    Hunk(
                        old_start,
                        old_len,
                        new_start,
                        new_len,
                        tuple(added),
                        tuple(removed),
                        tuple(body),
                    )
                )
            files.append(FileDiff(path, tuple(hunks), is_new=is_new, is_deleted=is_deleted))
            old_path = None
            continue
        i += 1
    return ParsedPatch(tuple(files))


class PatchApplyError(ValueError):
    """A hunk's context or removed lines do not match the file it is applied to."""


def apply_file_diff(original: str, fd: FileDiff) -> str:
    """The text of ``fd.path`` after applying ``fd`` to ``original`` (strict: context must match).

    A trailing newline is kept if the original had one (or the file is new).
    """
    old = original.splitlines()
    out: list[str] = []
    pos = 0  # 0-based index of the next unconsumed original line
    for h in fd.hunks:
        # An empty old range names the line *after which* the hunk goes.
        start = h.old_start if h.old_len == 0 else h.old_start - 1
        if start < pos or start > len(old):
            raise PatchApplyError(f"{fd.path}: hunk at line {h.old_start} out of order or range")
        out += old[pos:start]
        pos = start
        for tag, text in h.body:
            if tag == "+":
                out.append(text)
                continue
            if pos >= len(old) or old[pos] != text:
                raise PatchApplyError(f"{fd.path}:{pos + 1}: hunk expects {text!r}")
            if tag == " ":
                out.append(old[pos])
            pos += 1
    out += old[pos:]
    trailing = original.endswith("\n") or not original
    return "\n".join(out) + ("\n" if out and trailing else "")


def apply_patch(repo_files: dict[str, str], patch: ParsedPatch) -> dict[str, str]:
    """The repository snapshot after ``patch`` (deleted files removed). Raises PatchApplyError."""
    out = dict(repo_files)
    for fd in patch.files:
        if fd.is_deleted:
            out.pop(fd.path, None)
            continue
        out[fd.path] = apply_file_diff("" if fd.is_new else out.get(fd.path, ""), fd)
    return out


def split_by_file(text: str) -> dict[str, str]:
    """Each file's part of a patch (headers and hunks), keyed like ``FileDiff.path``.

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
            old, new = _strip_prefix(line[4:]), _strip_prefix(lines[i + 1][4:])
            path, chunk = (old if new == "/dev/null" else new), [line, lines[i + 1]]
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


def is_test_path(path: str) -> bool:
    """Test-file heuristic: ``tests/``/``test/`` directories, ``test_*.py``, ``*_test.py``."""
    parts = path.replace("\\", "/").split("/")
    name = parts[-1]
    return (
        any(p in ("tests", "test", "testing") for p in parts[:-1])
        or name.startswith("test_")
        or name.endswith(("_test.py", "_tests.py"))
        or name == "conftest.py"
    )
