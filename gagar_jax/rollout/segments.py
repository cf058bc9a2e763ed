"""Linked segments: the training samples of an episode driven through the gateway.

A harness's calls become rows of the batch. A call whose prompt ids start with a segment's
tokens so far (the previous call's prompt + completion, when the harness appended to its
history) extends that segment: the ids between (tool results, a new user turn) join it with
response mask 0, the completion with mask 1 and its behaviour log-probs. Any other call (the
history was edited, compacted or re-rendered, a sub-agent began) starts a new segment of the
same episode. Extension is checked against the most recent segment first and then the earlier
ones, so a main agent that resumes after a sub-agent's calls continues its own segment.

Every model token of the episode lies in exactly one segment, with its recorded log-prob and
policy version, so the update's log-probs at the sampling weights equal the recorded ones row by
row. The episode's reward and advantage reach every segment
(``gagar_jax.advantages.segments``); :func:`segment_metrics` reports ``episode/segments``,
``episode/calls`` and ``episode/tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Segment:
    """One training row of an episode.

    Attributes:
      tokens: [T] the row's ids (its first call's prompt, then completions and what came between).
      response_mask: [T] 1 on model tokens only.
      logprobs: [T] behaviour log-probs on model tokens, 0.0 elsewhere.
      token_versions: [T] policy version of each model token, -1 elsewhere.
      prompt_len: tokens of the first call's prompt.
      calls: the indices of the session's calls merged into it, in order.
    """

    tokens: list[int]
    response_mask: list[int]
    logprobs: list[float]
    token_versions: list[int]
    prompt_len: int
    calls: list[int]

    @property
    def model_tokens(self) -> int:
        return int(sum(self.response_mask))


def _field(call: Any, name: str):
    return call[name] if isinstance(call, Mapping) else getattr(call, name)


def build_segments(calls: Sequence[Any]) -> list[Segment]:
    """The linked segments of one episode's calls (``CallRecord``s or their dicts), in order.

    Raises:
      ValueError: a call whose log-probs do not match its completion ids.
    """
    segments: list[Segment] = []
    for n, call in enumerate(calls):
        prompt = [int(t) for t in _field(call, "prompt_ids")]
        completion = [int(t) for t in _field(call, "completion_ids")]
        logprobs = [float(x) for x in _field(call, "logprobs")]
        version = int(_field(call, "policy_version"))
        index = int(_field(call, "index")) if _has(call, "index") else n
        if len(logprobs) != len(completion):
            raise ValueError(
                f"calls[{n}]: {len(completion)} completion ids but {len(logprobs)} log-probs"
            )
        seg = next(
            (
                s
                for s in reversed(segments)
                if len(s.tokens) <= len(prompt) and prompt[: len(s.tokens)] == s.tokens
            ),
            None,
        )
        if seg is None:
            seg = Segment([], [], [], [], len(prompt), [])
            segments.append(seg)
        gap = prompt[len(seg.tokens) :]
        seg.tokens += gap + completion
        seg.response_mask += [0] * len(gap) + [1] * len(completion)
        seg.logprobs += [0.0] * len(gap) + logprobs
        seg.token_versions += [-1] * len(gap) + [version] * len(completion)
        seg.calls.append(index)
    return segments


def _has(call: Any, name: str) -> bool:
    return name in call if isinstance(call, Mapping) else hasattr(call, name)


def segment_metrics(episodes: Sequence[Sequence[Segment]]) -> dict[str, float]:
    """Means over episodes (each a list of its segments): ``episode/segments``,
    ``episode/calls`` (model calls), ``episode/tokens`` (tokens over its rows, what the update
    processes) and ``episode/model_tokens`` (tokens the model generated)."""
    if not episodes:
        return {}
    return {
        "episode/segments": float(np.mean([len(e) for e in episodes])),
        "episode/calls": float(np.mean([sum(len(s.calls) for s in e) for e in episodes])),
        "episode/tokens": float(np.mean([sum(len(s.tokens) for s in e) for e in episodes])),
        "episode/model_tokens": float(np.mean([sum(s.model_tokens for s in e) for e in episodes])),
    }


def pack_segments(
    episodes: Sequence[Sequence[Segment]], length: int | None = None
) -> dict[str, np.ndarray]:
    """The rows of several episodes' segments as right-padded arrays: ``tokens`` [S, T] int32,
    ``response_mask`` [S, T] bool, ``logprobs`` [S, T] float32, ``segment_episode`` [S] int32
    (the episode's position in ``episodes``), ``prompt_len`` [S] int32. ``length``: T (default
    the longest row; a longer row is a ValueError)."""
    rows = [(e, s) for e, segs in enumerate(episodes) for s in segs]
    t = max((len(s.tokens) for _, s in rows), default=1) if length is None else int(length)
    out = {
        "tokens": np.zeros((len(rows), t), np.int32),
        "response_mask": np.zeros((len(rows), t), bool),
        "logprobs": np.zeros((len(rows), t), np.float32),
        "segment_episode": np.array([e for e, _ in rows], np.int32),
        "prompt_len": np.array([s.prompt_len for _, s in rows], np.int32),
    }
    for i, (_, s) in enumerate(rows):
        if len(s.tokens) > t:
            raise ValueError(f"segment {i} has {len(s.tokens)} tokens, more than length={t}")
        n = len(s.tokens)
        out["tokens"][i, :n] = s.tokens
        out["response_mask"][i, :n] = np.asarray(s.response_mask, bool)
        out["logprobs"][i, :n] = s.logprobs
    return out
