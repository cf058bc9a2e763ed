"""A bounded excerpt of pytest's output that keeps the failures, whatever else it printed.

A verdict's ``test_log`` carries a few thousand characters of pytest's output to the grader, the
agent and the task factory's issue writer. Its tail alone is not enough: with ``-rA`` pytest ends
with one ``PASSED`` line per passing test, so a run of a few hundred passing tests fills the tail
and pushes out the failure sections before it (the assertion lines and the failing test's
traceback), and an issue written from it would have no symptom to quote.

:func:`pytest_excerpt` keeps, in this order and within ``limit`` characters: the ``FAILURES`` and
``ERRORS`` sections (each test's section capped to its tail, where pytest prints the ``E`` lines
and the failing line; sections of hidden canaries, whose names are masked as ``[canary]``, only
after the others), then the end of the output with the ``PASSED`` lines of the short summary
counted rather than listed. An output that fits is returned whole.
"""

from __future__ import annotations

import re

_HEADER = re.compile(r"^=+ (.+?) =+$")
_SECTION = re.compile(r"^_{3,} (.+?) _{3,}$")
FAILURE_HEADERS = ("FAILURES", "ERRORS")


def _failure_sections(lines: list[str]) -> list[list[str]]:
    """Each test's section (its ``____ name ____`` line first) inside FAILURES/ERRORS."""
    sections: list[list[str]] = []
    inside = False
    for ln in lines:
        m = _HEADER.match(ln)
        if m:
            inside = m.group(1).strip() in FAILURE_HEADERS
            continue
        if not inside:
            continue
        if _SECTION.match(ln):
            sections.append([ln])
        elif sections:
            sections[-1].append(ln)
    return sections


def _tail(section: list[str], budget: int) -> str:
    """The section's header and as many of its last lines as fit ``budget`` characters."""
    head, body = section[0], section[1:]
    kept: list[str] = []
    used = len(head) + 60  # the header and the line saying what was cut
    for ln in reversed(body):
        if used + len(ln) + 1 > budget:
            break
        kept.append(ln)
        used += len(ln) + 1
    cut = len(body) - len(kept)
    out = [head] + ([f"[... {cut} lines of this section left out ...]"] if cut else [])
    return "\n".join(out + kept[::-1])


def pytest_excerpt(text: str, limit: int = 6000, summary_chars: int = 1500) -> str:
    """At most about ``limit`` characters of pytest output ``text`` that keep its failure
    sections (see the module docstring); ``summary_chars`` of them go to the output's end."""
    if len(text) <= limit:
        return text
    lines = text.splitlines()
    sections = _failure_sections(lines)
    real = [s for s in sections if "[canary]" not in s[0]]
    ordered = real + [s for s in sections if "[canary]" in s[0]]
    budget = max(0, limit - summary_chars)
    parts: list[str] = []
    for i, sec in enumerate(ordered):
        share = max(400, budget // max(1, len(ordered) - i))
        piece = _tail(sec, min(share, budget))
        if len(piece) > budget:
            break
        parts.append(piece)
        budget -= len(piece) + 1
    left = len(ordered) - len(parts)
    if left:
        parts.append(f"[... {left} more failure sections left out ...]")
    summary = [ln for ln in lines if not ln.startswith("PASSED ")]
    n_passed = len(lines) - len(summary)
    end = "\n".join(summary)[-summary_chars:]
    note = f"[... {n_passed} PASSED lines of the short test summary left out ...]"
    return "\n".join(["=== failure sections (excerpt) ===", *parts, note if n_passed else "", end])
