"""Feedback-span data: the schema of a trajectory with user feedback, validation, token spans.

A **record** (one JSON object per line of a feedback JSONL file) is a trajectory and the
feedback a user gave on it::

    {"record_id": "r-17", "task_id": "toy-d1-s0-3",
     "segments": [{"role": "prompt", "text": "program\\n1 : a = x + 2 ..."},
                  {"role": "model", "text": "1 : a = x + 3"},
                  {"role": "observation", "text": "PASS f(1) ..."},        # multi-turn only
                  {"role": "model", "text": "submit"}],
     "feedback": [{"text": "good, that was the failing line", "polarity": "positive",
                   "turn": 0, "char_range": [0, 13]},
                  {"text": "you submitted without running the tests", "polarity": "negative",
                   "turn": 1}],
     "meta": {"passed": true}}

* ``segments``: the trajectory in order; ``role`` is ``prompt`` | ``model`` | ``observation``.
  A segment may carry its ``tokens`` (the policy's own ids, e.g. as sampled: they are used as
  they are, never re-tokenised); otherwise its ``text`` is tokenised with the policy's tokenizer.
  ``model`` segments are the *response*: the only tokens a span may cover.
* ``feedback`` items: free ``text``, a ``polarity`` (``positive`` | ``neutral`` | ``negative``,
  or +1 / 0 / -1) and where it points: ``turn`` (the index among the ``model`` segments) with an
  optional ``char_range`` ``[start, end)`` into that turn's text, or a ``token_range``
  ``[start, end)`` into the whole trajectory's tokens. A ``turn`` without a range covers the turn.
* Derived **token spans**: each item becomes one contiguous token span. A character range maps
  to the tokens whose character interval (the tokenizer's offsets) intersects it. Response
  tokens no item covers form neutral spans, one per contiguous run (``uncovered="neutral"``,
  the paper's partition of the whole response into polarity-consistent spans), or stay in no
  span (``uncovered="ignore"``).

Validation raises :class:`FeedbackError` naming the record and the field: an unknown polarity,
a turn or range outside the response, an empty range, a range that covers no token, a span on
prompt or observation tokens, two items whose spans overlap (after mapping to tokens), a missing
or mistyped field.

Tokenizers: whatever ``gagar_jax.envs.tokenizer.encode_with_offsets`` reads offsets from:
anything with ``encode_with_offsets(text) -> (ids, [(start, end), ...])`` (the toy tokenizer has
it), a ``tokenizers.Tokenizer`` or a ``transformers`` fast tokenizer (their offsets).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from gagar_jax.envs.tokenizer import encode_with_offsets

ROLES = ("prompt", "model", "observation")
POLARITY_NAMES = {"positive": 1, "neutral": 0, "negative": -1}
UNCOVERED = ("neutral", "ignore")


class FeedbackError(ValueError):
    """A feedback record is malformed; the message names the record and the field."""


# ----------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FeedbackItem:
    text: str
    polarity: int  # +1 | 0 | -1
    turn: int | None = None
    char_range: tuple[int, int] | None = None
    token_range: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "text": self.text,
            "polarity": {1: "positive", 0: "neutral", -1: "negative"}[self.polarity],
        }
        if self.turn is not None:
            d["turn"] = self.turn
        if self.char_range is not None:
            d["char_range"] = list(self.char_range)
        if self.token_range is not None:
            d["token_range"] = list(self.token_range)
        return d


@dataclasses.dataclass(frozen=True)
class Segment:
    role: str
    text: str
    tokens: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "text": self.text}
        if self.tokens is not None:
            d["tokens"] = list(self.tokens)
        return d


@dataclasses.dataclass(frozen=True)
class FeedbackRecord:
    record_id: str
    segments: tuple[Segment, ...]
    feedback: tuple[FeedbackItem, ...]
    task_id: str = ""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "record_id": self.record_id,
            "task_id": self.task_id,
            "segments": [s.to_dict() for s in self.segments],
            "feedback": [f.to_dict() for f in self.feedback],
            "meta": dict(self.meta),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeedbackRecord:
        """Parses and type-checks one record (spans are checked by :func:`derive_spans`)."""
        if not isinstance(d, Mapping):
            raise FeedbackError(f"a feedback record must be a JSON object, got {type(d).__name__}")
        rid = d.get("record_id")
        if not isinstance(rid, str) or not rid:
            raise FeedbackError(f"record {rid!r}: record_id must be a non-empty string")
        where = f"record {rid!r}"
        segs = d.get("segments")
        if not isinstance(segs, list) or not segs:
            raise FeedbackError(f"{where}: segments must be a non-empty list")
        segments = []
        for i, s in enumerate(segs):
            if not isinstance(s, Mapping):
                raise FeedbackError(f"{where}: segments[{i}] must be an object")
            role = s.get("role")
            if role not in ROLES:
                raise FeedbackError(
                    f"{where}: segments[{i}].role must be one of {ROLES}, got {role!r}"
                )
            text = s.get("text", "")
            if not isinstance(text, str):
                raise FeedbackError(f"{where}: segments[{i}].text must be a string")
            toks = s.get("tokens")
            if toks is not None:
                if not isinstance(toks, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks
                ):
                    raise FeedbackError(
                        f"{where}: segments[{i}].tokens must be a list of non-negative ints"
                    )
                toks = tuple(toks)
            segments.append(Segment(role, text, toks))
        if not any(s.role == "model" for s in segments):
            raise FeedbackError(f"{where}: segments has no 'model' segment (no response)")
        items = d.get("feedback", [])
        if not isinstance(items, list):
            raise FeedbackError(f"{where}: feedback must be a list")
        feedback = [_parse_item(where, i, it) for i, it in enumerate(items)]
        meta = d.get("meta", {}) or {}
        if not isinstance(meta, Mapping):
            raise FeedbackError(f"{where}: meta must be an object")
        task_id = d.get("task_id", "")
        if not isinstance(task_id, str):
            raise FeedbackError(f"{where}: task_id must be a string")
        return cls(rid, tuple(segments), tuple(feedback), task_id, dict(meta))


def parse_polarity(value: Any, where: str = "polarity") -> int:
    """``positive|neutral|negative`` or ``+1|0|-1`` -> int; FeedbackError naming ``where``."""
    if isinstance(value, str) and value.lower() in POLARITY_NAMES:
        return POLARITY_NAMES[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in (-1, 0, 1):
        return int(value)
    raise FeedbackError(
        f"{where} must be one of positive|neutral|negative (or +1/0/-1), got {value!r}"
    )


def _range(where: str, value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise FeedbackError(f"{where} must be [start, end) of two ints, got {value!r}")
    a, b = int(value[0]), int(value[1])
    if not 0 <= a < b:
        raise FeedbackError(f"{where} must satisfy 0 <= start < end, got [{a}, {b})")
    return a, b


def _parse_item(where: str, i: int, it: Any) -> FeedbackItem:
    field = f"{where}: feedback[{i}]"
    if not isinstance(it, Mapping):
        raise FeedbackError(f"{field} must be an object")
    text = it.get("text", "")
    if not isinstance(text, str):
        raise FeedbackError(f"{field}.text must be a string")
    if "polarity" not in it:
        raise FeedbackError(f"{field}.polarity is missing")
    polarity = parse_polarity(it["polarity"], f"{field}.polarity")
    turn = it.get("turn")
    if turn is not None and (not isinstance(turn, int) or isinstance(turn, bool) or turn < 0):
        raise FeedbackError(f"{field}.turn must be a non-negative int, got {turn!r}")
    char_range = it.get("char_range")
    token_range = it.get("token_range")
    if char_range is not None:
        char_range = _range(f"{field}.char_range", char_range)
        if turn is None:
            raise FeedbackError(f"{field}.char_range needs the turn it indexes (turn)")
    if token_range is not None:
        token_range = _range(f"{field}.token_range", token_range)
        if char_range is not None:
            raise FeedbackError(f"{field}: give char_range or token_range, not both")
    if turn is None and token_range is None:
        raise FeedbackError(f"{field} must point somewhere: turn (+ char_range) or token_range")
    return FeedbackItem(text, polarity, turn, char_range, token_range)


# ----------------------------------------------------------------------------------------------
# Token spans
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FeedbackExample:
    """One record as token arrays (``L`` trajectory tokens, ``S`` spans)."""

    record_id: str
    task_id: str
    tokens: np.ndarray  # [L] int32
    roles: np.ndarray  # [L] int8: 0 prompt, 1 model, 2 observation
    span_ids: np.ndarray  # [L] int32, span index or -1
    span_polarity: np.ndarray  # [S] int32
    span_texts: tuple[str, ...]  # [S] the feedback text ('' for uncovered neutral runs)

    @property
    def response_mask(self) -> np.ndarray:
        return self.roles == 1

    @property
    def token_polarity(self) -> np.ndarray:
        """[L] int32: each token's span polarity (0 in no span)."""
        pol = np.zeros(len(self.tokens), np.int32)
        inside = self.span_ids >= 0
        pol[inside] = self.span_polarity[self.span_ids[inside]]
        return pol


def derive_spans(
    record: FeedbackRecord, tokenizer, *, uncovered: str = "neutral"
) -> FeedbackExample:
    """Tokenises the trajectory and maps every feedback item to one token span (validated).

    Raises:
      FeedbackError naming the record and field (see the module docstring).
    """
    if uncovered not in UNCOVERED:
        raise ValueError(f"uncovered must be one of {UNCOVERED}, got {uncovered!r}")
    where = f"record {record.record_id!r}"
    tokens: list[int] = []
    roles: list[int] = []
    turns: list[tuple[int, int, list[tuple[int, int]] | None, str]] = []  # model turns
    for seg in record.segments:
        if seg.tokens is not None:
            ids, offsets = list(seg.tokens), None
        else:
            ids, offsets = encode_with_offsets(tokenizer, seg.text)
        start = len(tokens)
        tokens += ids
        roles += [ROLES.index(seg.role)] * len(ids)
        if seg.role == "model":
            turns.append((start, len(tokens), offsets, seg.text))
    n = len(tokens)
    owner = -np.ones(n, np.int32)  # which feedback item owns each token
    spans: list[tuple[int, int, int, str]] = []  # (start, end, polarity, text)
    for k, item in enumerate(record.feedback):
        field = f"{where}: feedback[{k}]"
        if item.token_range is not None:
            a, b = item.token_range
            if b > n:
                raise FeedbackError(
                    f"{field}.token_range [{a}, {b}) is outside the trajectory "
                    f"({n} tokens): outside the response"
                )
            if item.turn is not None:
                t0, t1, _, _ = _turn(field, turns, item.turn)
                if a < t0 or b > t1:
                    raise FeedbackError(
                        f"{field}.token_range [{a}, {b}) is outside turn "
                        f"{item.turn} (tokens [{t0}, {t1}))"
                    )
        else:
            t0, t1, offsets, text = _turn(field, turns, item.turn)
            if item.char_range is None:
                a, b = t0, t1
            else:
                c0, c1 = item.char_range
                if offsets is None:
                    raise FeedbackError(
                        f"{field}.char_range needs character offsets, but turn "
                        f"{item.turn} was given as tokens: use token_range"
                    )
                if c1 > len(text):
                    raise FeedbackError(
                        f"{field}.char_range [{c0}, {c1}) is outside turn "
                        f"{item.turn}'s text ({len(text)} characters)"
                    )
                hit = [j for j, (s, e) in enumerate(offsets) if s < c1 and e > c0]
                if not hit:
                    raise FeedbackError(
                        f"{field}.char_range [{c0}, {c1}) covers no token of turn {item.turn}"
                    )
                a, b = t0 + hit[0], t0 + hit[-1] + 1
            if a >= b:
                raise FeedbackError(f"{field}: turn {item.turn} has no tokens")
        bad = [j for j in range(a, b) if roles[j] != 1]
        if bad:
            raise FeedbackError(
                f"{field} covers {ROLES[roles[bad[0]]]} tokens (position "
                f"{bad[0]}): spans may cover model (response) tokens only"
            )
        clash = owner[a:b][owner[a:b] >= 0]
        if clash.size:
            raise FeedbackError(f"{field} overlaps feedback[{int(clash[0])}] on tokens [{a}, {b})")
        owner[a:b] = k
        spans.append((a, b, item.polarity, item.text))
    if uncovered == "neutral":
        j = 0
        while j < n:
            if roles[j] == 1 and owner[j] < 0:
                e = j
                while e < n and roles[e] == 1 and owner[e] < 0:
                    e += 1
                spans.append((j, e, 0, ""))
                j = e
            else:
                j += 1
    spans.sort()
    span_ids = -np.ones(n, np.int32)
    for s, (a, b, _, _) in enumerate(spans):
        span_ids[a:b] = s
    return FeedbackExample(
        record_id=record.record_id,
        task_id=record.task_id,
        tokens=np.asarray(tokens, np.int32),
        roles=np.asarray(roles, np.int8),
        span_ids=span_ids,
        span_polarity=np.asarray([p for _, _, p, _ in spans], np.int32),
        span_texts=tuple(t for _, _, _, t in spans),
    )


def _turn(field: str, turns, turn: int | None):
    if turn is None or not 0 <= turn < len(turns):
        raise FeedbackError(
            f"{field}.turn {turn} is outside the response ({len(turns)} model turn(s))"
        )
    return turns[turn]


def read_jsonl(path: str) -> list[FeedbackRecord]:
    """Records of a feedback JSONL file; a malformed line raises naming file and line."""
    out, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = FeedbackRecord.from_dict(json.loads(line))
            except (json.JSONDecodeError, FeedbackError) as e:
                raise FeedbackError(f"{path}:{n}: {e}") from e
            if rec.record_id in seen:
                raise FeedbackError(f"{path}:{n}: duplicate record_id {rec.record_id!r}")
            seen.add(rec.record_id)
            out.append(rec)
    return out


def write_jsonl(path: str, records: Sequence[FeedbackRecord]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(r.to_json() + "\n")


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------
class FeedbackBatch(NamedTuple):
    """Static ``[N, T]`` / ``[N, S]`` arrays of feedback examples (right padded).

    ``span_ids[n, t]`` and ``token_polarity[n, t]`` describe token ``t`` itself (the log-prob
    of token ``t`` is predicted by the logits at ``t - 1``: the trainer shifts by one).
    """

    tokens: np.ndarray  # [N, T] int32
    positions: np.ndarray  # [N, T] int32
    attention_mask: np.ndarray  # [N, T] bool, False on padding
    response_mask: np.ndarray  # [N, T] bool, True on model (response) tokens
    span_ids: np.ndarray  # [N, T] int32, span index in [0, S) or -1
    span_polarity: np.ndarray  # [N, S] int32 in {-1, 0, +1}
    token_polarity: np.ndarray  # [N, T] int32, polarity of each token's span (0 outside)


def pack_examples(
    examples: Sequence[FeedbackExample], *, seq_len: int, max_spans: int, pad_id: int
) -> FeedbackBatch:
    """Packs examples into a :class:`FeedbackBatch`; an example that does not fit raises."""
    n = len(examples)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    positions = np.zeros((n, seq_len), np.int32)
    attn = np.zeros((n, seq_len), bool)
    resp = np.zeros((n, seq_len), bool)
    span_ids = -np.ones((n, seq_len), np.int32)
    span_pol = np.zeros((n, max_spans), np.int32)
    tok_pol = np.zeros((n, seq_len), np.int32)
    for i, ex in enumerate(examples):
        length = len(ex.tokens)
        if length > seq_len:
            raise ValueError(f"record {ex.record_id!r}: {length} tokens > seq_len={seq_len}")
        if len(ex.span_polarity) > max_spans:
            raise ValueError(
                f"record {ex.record_id!r}: {len(ex.span_polarity)} spans > max_spans={max_spans}"
            )
        tokens[i, :length] = ex.tokens
        positions[i, :length] = np.arange(length)
        attn[i, :length] = True
        resp[i, :length] = ex.response_mask
        span_ids[i, :length] = ex.span_ids
        span_pol[i, : len(ex.span_polarity)] = ex.span_polarity
        tok_pol[i, :length] = ex.token_polarity
    if n and (resp[:, 0].any()):
        bad = examples[int(np.argmax(resp[:, 0]))].record_id
        raise ValueError(
            f"record {bad!r}: the first token is a response token; a trajectory "
            "needs at least one prompt token (token 0 has no prediction)"
        )
    return FeedbackBatch(
        tokens=tokens,
        positions=positions,
        attention_mask=attn,
        response_mask=resp,
        span_ids=span_ids,
        span_polarity=span_pol,
        token_polarity=tok_pol,
    )
