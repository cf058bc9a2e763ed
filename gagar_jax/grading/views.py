"""What a grader is shown of a candidate, built from the one parsed, applied patch.

Every grader view of a candidate's change (the agentic grader's ``show_diff``, its compact
prompt, the summaries' file lists, the heuristic grader's and the schema's evidence locations)
reads ``Candidate.parsed_patch``: the ``verify.diff.AppliedPatch`` the workspace located on its
snapshot (hunks where they applied, header numbers recomputed, paths normalised). The views
here render from it and never from the text the policy wrote, so:

* text outside hunks (a preamble, words after a hunk header, the words of a ``\\`` line) never
  reaches a grader: it is not in the parse;
* a hunk header cannot lie about where a change is: the numbers shown (and checked as evidence)
  are where the applier put it;
* a compact view cannot show lines that were never applied, nor hide applied ones: it lists
  the hunks' ``+``/``-`` lines, nothing split from raw text.

Every string the candidate chose is inside the untrusted envelope: the diff, file paths (in
summaries and compact headers), and the parts of the verifier's log header that quote the
candidate (``verifier_log``): only header lines of a fixed grammar that carry nothing the
candidate chose (the status line, per-test outcome lines, the canary count) stay outside it;
a reset path, a monitor flag's evidence, a sandbox error or any other note goes inside.
"""

from __future__ import annotations

import re

from gagar_jax.verify import diff
from gagar_jax.verify.untrusted import Envelope, sanitize, split_test_log

__all__ = [
    "changed_lines",
    "changed_sections",
    "file_list",
    "files_not_listed",
    "patch_text",
    "verifier_log",
]

# Header lines of ``verify.repo``'s log that carry nothing the candidate chose.
_TRUSTED_HEADER = (
    re.compile(
        r"status: (?:passed|failed|timeout|resource_killed|infra_error) "
        r"\(sandbox: [a-z_]{1,32}, [a-z_+-]{0,64}\)"
    ),
    re.compile(r"(?:PASSED|FAILED|ERROR|SKIPPED|MISSING|XFAIL|XPASS) {1,8}[\w./:\[\]-]{1,400}"),
    re.compile(
        r"\(\d{1,3} hidden canary tests ran with the required ones: \d{1,3} fail and one "
        r"errors by design\)"
    ),
)


def patch_text(patch: diff.Patch, file: str | None = None) -> str:
    """The canonical unified diff of ``patch`` (one file of it with ``file``); KeyError when the
    patch does not touch ``file``."""
    if file is None:
        return diff.render_patch(patch)
    fp = patch.file(file)
    if fp is None:
        raise KeyError(file)
    return diff.render_patch([fp])


def changed_lines(patch: diff.Patch) -> str:
    """The ``+``/``-`` lines of every hunk, in patch order."""
    rows = (row for fp in patch.files for h in fp.hunks for row in h.lines)
    return "\n".join(row for row in rows if row[0] != " ")


MIN_SECTION_CHARS = 150  # the least share of a file a compact view shows (else: counted)
# Suffixes of files whose changes a compact view shows first (code before data and docs).
CODE_SUFFIXES = (".py", ".pyi", ".pyx", ".c", ".h", ".cc", ".cpp", ".js", ".ts", ".go", ".rs")


def changed_sections(patch: diff.Patch, budget: int) -> str:
    """The ``+``/``-`` lines of each file under a header line naming it (``@ path``), within
    ``budget`` characters in all (what a compact view shows): changes to the repository's
    existing files before new files (a candidate's filler, however many files of it, cannot
    push its change to the module under test out), code files first within each, each file its
    own share (a file needing less leaves the rest to the others), a file cut where its share
    ends and the number of its lines not shown said; files beyond the budget are counted.
    Lines of two files never sit side by side, and no file crowds another out."""
    sections = []
    for fp in patch.files:
        rows = [row for h in fp.hunks for row in h.lines if row[0] != " "]
        if rows:
            created = fp.is_new or all(h.old_len == 0 for h in fp.hunks)
            sections.append((created, not fp.path.endswith(CODE_SUFFIXES), fp.path, rows))
    sections.sort(key=lambda s: s[:2])  # stable: patch order kept within a kind
    sections = [(path, rows) for _, _, path, rows in sections]
    shown, left = [], budget
    room = max(1, budget // MIN_SECTION_CHARS)  # files that get a readable share
    for i, (path, rows) in enumerate(sections):
        if i >= room:
            shown.append(f"... {len(sections) - i} more changed file(s) not shown")
            break
        share = left // (min(len(sections), room) - i)
        header = f"@ {path}"
        body, used, cut = [header], len(header) + 1, 0
        for k, row in enumerate(rows):
            if used + len(row) + 1 > share:
                room = share - used - 1
                if room > 20:
                    body.append(row[:room] + " [...]")
                cut = len(rows) - k
                break
            body.append(row)
            used += len(row) + 1
        if cut:
            body.append(f"... {cut} more changed line(s) of this file not shown")
        text = "\n".join(body)
        shown.append(text)
        left -= min(len(text), share)
    return "\n".join(shown)


def file_list(patch: diff.Patch, limit: int | None = None) -> str:
    """The touched paths, one a line (candidate-chosen: callers put it in an envelope), the
    repository's existing files first; with ``limit``, the first ``limit`` of them
    (``files_not_listed`` says how many more)."""
    paths = _existing_first(patch)
    return "\n".join(paths if limit is None else paths[: max(0, limit)])


def _existing_first(patch: diff.Patch) -> list[str]:
    """The touched paths, the repository's existing files before new ones (patch order kept
    within each): a list cut short never hides a change to the repository behind new files."""
    created = {fp.path for fp in patch.files if fp.is_new or all(h.old_len == 0 for h in fp.hunks)}
    return sorted(patch.paths, key=lambda p: p in created)


def files_not_listed(patch: diff.Patch, limit: int) -> str:
    """The note a view built with ``file_list(patch, limit)`` adds (empty when it lists every
    path): a count, nothing the candidate chose."""
    more = len(patch.paths) - max(0, limit)
    return f"... and {more} more files (not listed)" if more > 0 else ""


def _trusted(line: str) -> bool:
    return any(p.fullmatch(line) for p in _TRUSTED_HEADER)


def verifier_log(envelope: Envelope, log: str, source: str, verdict: tuple[str, ...] = ()) -> str:
    """A verifier log as a grader reads it: trusted lines, then every other header line (reset
    paths, monitor evidence, notes) and everything the code printed in envelopes, the printed
    lines marked ``| ``.

    ``verdict``: the verdict as lines the family built from the verifier's structured result
    (``Candidate.verdict_lines``): then they are the trusted lines and the whole header of the
    log is quoted (a note holding a newline cannot add a trusted line). Without it, the header's
    lines of a fixed grammar (status, per-test outcome, canary count) are the trusted ones."""
    head, rest = split_test_log(log)
    parts: list[str] = []
    if verdict:
        parts.append("verifier verdict (trusted):\n" + sanitize("\n".join(verdict)))
        if head:
            parts.append(
                "verifier notes (they quote the candidate's paths and text):\n"
                + envelope.wrap(head, f"{source} verifier notes")
            )
    elif head:
        trusted, quoted = [], []
        for line in head.split("\n"):
            (trusted if _trusted(line) else quoted).append(line)
        if trusted:
            parts.append("verifier header (trusted):\n" + sanitize("\n".join(trusted)))
        if quoted:
            parts.append(
                "verifier notes (they quote the candidate's paths and text):\n"
                + envelope.wrap("\n".join(quoted), f"{source} verifier notes")
            )
    if rest or not head:
        parts.append(envelope.wrap(rest, source, marked=True))
    return "\n".join(parts)
