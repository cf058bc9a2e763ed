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

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclasses.dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk of a file diff.

    Attributes:
      old_start, old_len: the hunk's range in the original file (1-based; ``old_len`` may be 0).
      new_start, new_len: the hunk's range in the patched file.
      added: ``(new_line_number, text)`` for each ``+`` line.
      removed: ``(old_line_number, text)`` for each ``-`` line.
    """

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    added: tuple[tuple[int, str], ...]
    removed: tuple[tuple[int, str], ...]

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
                # Consume exactly the lines the header announces (a "---" line inside a hunk is
                # a removed "--" line, not a new file header).
                left_old, left_new = old_len, new_len
                while i < len(lines) and (left_old > 0 or left_new > 0):
                    body = lines[i]
                    if body.startswith("\\"):
                        i += 1
                        continue
                    tag, content = body[:1], body[1:]
                    if tag == "+":
                        added.append((n, content))
                        n += 1
                        left_new -= 1
                    elif tag == "-":
                        removed.append((o, content))
                        o += 1
                        left_old -= 1
                    elif tag == " " or body == "":
                        o += 1
                        n += 1
                        left_old -= 1
                        left_new -= 1
                    else:
                        break
                    i += 1
                hunks.append(
                    Hunk(old_start, old_len, new_start, new_len, tuple(added), tuple(removed))
                )
            files.append(FileDiff(path, tuple(hunks), is_new=is_new, is_deleted=is_deleted))
            old_path = None
            continue
        i += 1
    return ParsedPatch(tuple(files))


def split_by_file(text: str) -> dict[str, str]:
    """Each file's part of a patch (headers and hunks), keyed like ``FileDiff.path``."""
    out: dict[str, str] = {}
    lines = text.splitlines(keepends=True)
    starts = [
        i
        for i in range(len(lines) - 1)
        if lines[i].startswith("--- ") and lines[i + 1].startswith("+++ ")
    ]
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        old, new = _strip_prefix(lines[i][4:]), _strip_prefix(lines[i + 1][4:])
        out[old if new == "/dev/null" else new] = "".join(lines[i:end])
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
