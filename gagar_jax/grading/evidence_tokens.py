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

Each family computes its spans (``TaskFamily.token_spans``): the toy family's line edits in
``gagar_jax.envs.toy_grading.toy_token_spans``, an episode's turns in the family default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from gagar_jax.grading import schema


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
