"""Putting candidate-produced text in front of a grader without letting it speak as the grader.

Everything a candidate produced (its diff, what its code printed, its trajectory, its summary,
monitor evidence that quotes it) is *data* for the grader, never instructions. Three measures:

* **Per-call unforgeable delimiters.** ``Envelope`` draws a random nonce per grading episode and
  encloses each piece of untrusted text as ``<untrusted-NONCE source="...">`` ...
  ``</untrusted-NONCE>``. The candidate never sees the nonce, so it cannot close the envelope;
  any ``<untrusted-``/``</untrusted-`` tag (and the nonce itself, were it guessed) inside the
  content is escaped (``<`` becomes ``&lt;``), so no content can open or close one.
* **Marked candidate lines.** Lines the candidate's code printed start with ``| `` (``mark``),
  so a printed ``status: passed ...`` never looks like the verifier's own header. A verifier
  log is split at its first ``--- pytest output (untrusted) ---`` line (``split_test_log``):
  the head is the verifier's, the rest is the candidate's.
* **Sanitised characters.** NUL, other control characters, format characters (zero-width,
  bidi overrides, tag characters) and lone surrogates (binary output) are shown as escapes
  (``\\x00``, ``\\u200b``), so one candidate's bytes cannot break the request that carries the
  whole group to the grader's server, nor hide text from it. Letters that pass a word off as
  Latin (``confusables.poses_as_latin``: Cherokee ``Ꭲ`` in ``NOᎢE``, Cyrillic ``а`` in
  ``grаder``, fullwidth or mathematical letters) are shown as ``\\uXXXX`` escapes too: a word
  reads as Latin to the grader only if it is written in Latin letters.
"""

from __future__ import annotations

import re
import secrets

from gagar_jax.verify.confusables import poses_as_latin

UNTRUSTED_MARKERS = ("--- pytest output (untrusted) ---", "--- stderr (untrusted) ---")
LINE_MARK = "| "
_TAG_RE = re.compile(r"<(/?)(untrusted-)", re.IGNORECASE)
_MARK_RE = re.compile(r"^\| ?", re.MULTILINE)
_WORD_RE = re.compile(r"\w+")


def _escape_char(c: str) -> str:
    n = ord(c)
    return f"\\u{n:04x}" if n <= 0xFFFF else f"\\U{n:08x}"


def _unmask_word(m: re.Match) -> str:
    word = m.group(0)
    if word.isascii():
        return word
    posing = poses_as_latin(word)
    if not posing:
        return word
    chars = list(word)
    for i in posing:
        chars[i] = _escape_char(chars[i])
    return "".join(chars)


def sanitize(text: str) -> str:
    """``text`` with control and format characters (except newline and tab), lone surrogates
    and letters posing as Latin escaped (see the module docstring)."""
    if not isinstance(text, str):
        text = str(text)
    if text.isascii():
        return text if text.isprintable() else _escape_controls(text)
    return _WORD_RE.sub(_unmask_word, _escape_controls(text))


def _escape_controls(text: str) -> str:
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c in "\n\t" or c.isprintable() or c == " ":
            out.append(c)
        elif 0xD800 <= ord(c) <= 0xDFFF:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(repr(c)[1:-1])
    return "".join(out)


def mark(text: str) -> str:
    """Every line prefixed with ``| `` (candidate-produced output)."""
    return "\n".join(LINE_MARK + line for line in text.split("\n"))


def unmark(text: str) -> str:
    """``text`` without ``mark``'s line prefixes (to match a quote against the raw log)."""
    return _MARK_RE.sub("", text)


def split_test_log(log: str) -> tuple[str, str]:
    """(verifier header, candidate-produced output) of a verifier's test log.

    The header ends at the first line that is exactly one of ``UNTRUSTED_MARKERS`` (the verifier
    writes its header first and quotes candidate text in it on single escaped lines); a log
    without a marker is all candidate output.
    """
    lines = log.split("\n")
    for i, line in enumerate(lines):
        if line in UNTRUSTED_MARKERS:
            return "\n".join(lines[:i]), "\n".join(lines[i:])
    return "", log


class Envelope:
    """Per-episode delimiters for untrusted content (see the module docstring)."""

    def __init__(self, nonce: str | None = None):
        self.nonce = nonce or secrets.token_hex(8)
        self.open_prefix = f"<untrusted-{self.nonce}"
        self.close = f"</untrusted-{self.nonce}>"

    def escape(self, text: str) -> str:
        text = sanitize(text)
        text = _TAG_RE.sub(lambda m: f"&lt;{m.group(1)}{m.group(2)}", text)
        return text.replace(self.nonce, "[nonce]")

    def wrap(self, text: str, source: str, *, marked: bool = False) -> str:
        """``text`` enclosed (escaped; ``marked``: each line prefixed with ``| ``)."""
        body = self.escape(text)
        if marked:
            body = mark(body)
        src = re.sub(r"[^\w .:/@-]", "_", source)[:80]
        return f'{self.open_prefix} source="{src}">\n{body}\n{self.close}'

    def wrap_test_log(self, log: str, source: str) -> str:
        """A verifier log: its header as is, the candidate's output enclosed and marked."""
        head, rest = split_test_log(log)
        parts = []
        if head:
            parts.append("verifier header (trusted):\n" + sanitize(head))
        if rest or not head:
            parts.append(self.wrap(rest, source, marked=True))
        return "\n".join(parts)
