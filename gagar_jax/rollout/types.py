"""The rollout interface shared by every engine: sampling parameters, samples, the engine protocol.

An engine takes token ids in and gives token ids out (tokenisation belongs to the task family),
with the behaviour log-probability of every generated token, why generation stopped, and the policy
version that produced it. The PPO ratio in the update is `exp(logp_new - logp_behaviour)`, so each
engine's docstring says which distribution its log-probabilities are taken from.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. Validated on construction: a bad field raises naming the field and its range.

    Attributes:
        n: samples per prompt, >= 1.
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 (or -1) disables.
        max_tokens: new tokens per sample, >= 1.
        stop_token_ids: generation stops after emitting any of these (the stop token is kept in the
            sample and gets its log-probability; finish_reason is "stop").
        seed: optional base seed; engines that support it make sampling deterministic given it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.stop_token_ids, int) or self.stop_token_ids is None:
            raise TypeError(
                "SamplingParams.stop_token_ids must be a sequence of ints, got "
                f"{self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if int(self.n) != self.n or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if int(self.top_k) != self.top_k or self.top_k < -1:
            raise ValueError(
                f"SamplingParams.top_k must be an integer >= 0 (or -1 = off), got {self.top_k!r}"
            )
        if int(self.max_tokens) != self.max_tokens or self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be >= 0, got {self.stop_token_ids!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class Sample:
    """One generated continuation.

    Attributes:
        tokens: generated token ids (the prompt is not included), len L.
        logprobs: behaviour log-probability of each generated token, len L.
        finish_reason: "stop" (a stop token or EOS), "length" (max_tokens or context), "abort".
        policy_version: the weight version that produced the tokens.
        meta: engine-specific extras (request id, latency, retries, ...).
        routes: mixture-of-experts models, engines that record them (the embedded sampler
          with ``record_routes``, an SGLang client with ``record_routes``): ``[L, layers, K]``
          int16 experts each generated token was routed to in each MoE layer (when it was fed
          back to the model; -1 for a token never fed back: an SGLang sample's last); else
          None.
        prompt_routes: with ``routes``: ``[P', layers, K]`` the experts of the prompt tokens
          this call prefilled, the last ``P'`` of the prompt (all of it, but for the tokens a
          kept KV cache held: ``meta["cached_prefix"]``; SGLang: all of it).
    """

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    routes: Any = None
    prompt_routes: Any = None

    def __post_init__(self):
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(
                f"Sample.logprobs must have one entry per token: {len(self.tokens)} tokens, "
                f"{len(self.logprobs)} logprobs"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )


def validate_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int | None = None
) -> list[list[int]]:
    """Checks `prompts` is a non-empty list of non-empty token-id lists; returns plain int lists."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got {p!r:.80}")
        ids = [int(t) for t in p]
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(
                f"prompts[{i}] has token ids outside [0, {vocab_size or 'inf'}): {bad[:5]}"
            )
        out.append(ids)
    return out


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator: token ids in, samples with logprobs out."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Sample]]:
        """Returns `params.n` samples per prompt: outer list over prompts, inner over samples."""
        ...

    async def agenerate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[Sample]]:
        """As `generate`, awaitable: generation of one batch overlaps grading of another."""
        ...

    def sync_weights(self, params_or_path: Any, version: int) -> int:
        """Loads new policy weights (a params pytree or a safetensors dir); returns the version."""
        ...


async def run_in_thread(fn, *args, **kwargs):
    """Runs a blocking engine call off the event loop (the default `agenerate`)."""
    return await asyncio.to_thread(fn, *args, **kwargs)
