"""A verdict's cited evidence mapped to the response tokens that wrote it.

Gagar's grader must back every negative judgement with evidence: a patch location, a trajectory
event or an execution output (``schema.Evidence``). Token-level credit
(``gagar_jax.advantages.redistribute_tokens`` with ``EvidenceImportance``) needs the same
evidence as a token mask: which of a rollout's response tokens produced the cited artefact.

A task family describes where its artefacts live in one rollout's response tokens with a
:class:`TokenSpans` (computed on the host, once per rollout); :func:`evidence_token_mask` then
turns any list of evidence into a ``[R]`` bool mask over the response tokens:

* ``patch`` evidence ``(file, line)`` -> the tokens of the edits that wrote line ``line`` of the
  patched file; if no edit wrote it, the edits that removed or replaced line ``line`` of the
  original (unified-diff hunks cover both numberings, and the heuristic grader cites the first
  *added* line, or the first removed one for a pure deletion). ``line=None`` cites the whole file
  patch: every token of every edit of that file.
* ``trajectory`` evidence ``event=i`` -> the tokens the policy generated for event ``i`` (none
  for observations).
* ``execution`` evidence cites output the tests produced, which no response token wrote: it
  maps to no token.

Only evidence a judgement cites about *its own* candidate counts (``ev.candidate_id ==
judgement.candidate_id``): a judgement cannot move credit on another candidate's tokens, and
evidence that points at something the rollout did not write maps to nothing. Validation
(``schema.validate``) has already checked that every cited location exists.

Toy family (``gagar_jax.envs.toy``): the response is a line-edit patch, one edit per line
(``N : stmt``, ``ins N : stmt``, ``del N``) separated by newline tokens and ended by EOS; the
workspace renders it as a unified diff of ``program.toy`` (``adapters.toy_candidate``), whose
line numbers :func:`toy_token_spans` reproduces from the edits (the edit order of
``toy.apply_edits``). An edit's tokens are the tokens of its patch line, without the newline
that ends it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gagar_jax.grading import schema

TOY_PROGRAM = "program.toy"


@dataclasses.dataclass(frozen=True)
class EditSpan:
    """One edit of a rollout's patch and the response tokens that wrote it.

    Attributes:
      file: the edited file's path (as in the unified diff).
      new_lines: 1-based lines of the patched file the edit wrote (empty for a deletion).
      old_lines: 1-based lines of the original the edit removed or replaced (empty for an insert).
      tokens: indices into the response tokens.
    """

    file: str
    new_lines: tuple[int, ...]
    old_lines: tuple[int, ...]
    tokens: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TokenSpans:
    """Where one rollout's artefacts live in its ``length`` response tokens."""

    length: int
    edits: tuple[EditSpan, ...] = ()
    events: tuple[tuple[int, ...], ...] = ()  # trajectory event i -> response token indices

    def patch_tokens(self, file: str | None, line: int | None) -> set[int]:
        """Tokens of the edits a ``patch`` citation ``(file, line)`` points at."""
        in_file = [e for e in self.edits if e.file == file]
        if line is None:
            return {t for e in in_file for t in e.tokens}
        wrote = [e for e in in_file if line in e.new_lines]
        if not wrote:
            wrote = [e for e in in_file if line in e.old_lines]
        return {t for e in wrote for t in e.tokens}


def evidence_token_mask(
    evidence: Iterable[schema.Evidence], candidate_id: str, spans: TokenSpans
) -> np.ndarray:
    """``[R]`` bool mask of the response tokens that wrote the cited artefacts.

    Args:
      evidence: the evidence of the candidate's judgement.
      candidate_id: the judged candidate; evidence about other candidates is ignored.
      spans: the candidate's :class:`TokenSpans`.

    Returns:
      ``np.ndarray`` bool ``[spans.length]``.
    """
    mask = np.zeros(spans.length, bool)
    for ev in evidence:
        if ev.candidate_id != candidate_id:
            continue
        if ev.kind == "patch":
            idx = spans.patch_tokens(ev.file, ev.line)
        elif ev.kind == "trajectory" and ev.event is not None and 0 <= ev.event < len(spans.events):
            idx = set(spans.events[ev.event])
        else:  # execution output: no response token wrote it
            idx = set()
        idx = [i for i in idx if 0 <= i < spans.length]
        mask[idx] = True
    return mask


def verdict_token_masks(
    verdict: schema.Verdict | None, spans: Mapping[str, TokenSpans]
) -> dict[str, np.ndarray]:
    """Per judged candidate with spans, its evidence token mask (``{}`` without a verdict)."""
    if verdict is None:
        return {}
    out = {}
    for j in verdict.judgements:
        s = spans.get(j.candidate_id)
        if s is not None:
            out[j.candidate_id] = evidence_token_mask(j.evidence, j.candidate_id, s)
    return out


def _split_lines(tokens: Sequence[int], newline_id: int, eos_id: int) -> list[list[int]]:
    """Response token indices per line (newline and everything from EOS on excluded)."""
    lines: list[list[int]] = [[]]
    for i, t in enumerate(tokens):
        if t == eos_id:
            break
        if t == newline_id:
            lines.append([])
        else:
            lines[-1].append(i)
    return lines


def toy_token_spans(task: Any, response_tokens: Sequence[int], tokenizer: Any = None) -> TokenSpans:
    """The :class:`TokenSpans` of a toy rollout's line-edit patch.

    Lines that do not parse as an edit (or a patch that edits a line twice, which fails
    verification) contribute no span. Line numbers follow ``toy.apply_edits``: original lines in
    order, an ``ins N`` edit's lines just before original line N, in patch order.

    Args:
      task: the ``gagar_jax.envs.ToyTask``.
      response_tokens: the rollout's response token ids (EOS and anything after it ignored).
      tokenizer: the toy tokenizer (default ``gagar_jax.envs.TOKENIZER``).
    """
    from gagar_jax.envs import toy
    from gagar_jax.envs.tokenizer import TOKENIZER

    tok = tokenizer or TOKENIZER
    ids = [int(t) for t in response_tokens]
    num_lines = len(task.lines)
    parsed = []  # (edit, token indices) in patch order
    for idx in _split_lines(ids, tok.newline_id, tok.eos_id):
        if not idx:
            continue
        text = tok.decode([ids[i] for i in idx], stop_at_eos=False)
        try:
            edits = toy.parse_patch(text, num_lines)
        except toy.PatchError:
            continue
        if len(edits) == 1:
            parsed.append((edits[0], tuple(idx)))
    replaced = [e.line for e, _ in parsed if e.op != "insert"]
    if len(replaced) != len(set(replaced)):
        parsed = []  # an original line edited twice: the patch does not apply
    new_of: dict[int, list[int]] = {}  # parsed edit index -> new lines it wrote
    new_line = 0
    for n in range(1, num_lines + 2):
        for k, (e, _) in enumerate(parsed):
            if e.op == "insert" and e.line == n:
                new_line += 1
                new_of.setdefault(k, []).append(new_line)
        if n <= num_lines:
            k = next(
                (k for k, (e, _) in enumerate(parsed) if e.op != "insert" and e.line == n), None
            )
            if k is None or parsed[k][0].op == "replace":
                new_line += 1
                if k is not None:
                    new_of.setdefault(k, []).append(new_line)
    edits = tuple(
        EditSpan(
            file=TOY_PROGRAM,
            new_lines=tuple(new_of.get(k, ())),
            old_lines=() if e.op == "insert" else (e.line,),
            tokens=idx,
        )
        for k, (e, idx) in enumerate(parsed)
    )
    return TokenSpans(length=len(ids), edits=edits)
