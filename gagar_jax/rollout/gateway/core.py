"""The gateway's engine-facing core: a chat request of a session in, a recorded call out.

HTTP lives in ``gagar_jax.rollout.gateway.app``; this module knows sessions, the chat template,
the context limit, sampling parameters and the engine, and nothing of either API's wire format.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gagar_jax.rollout.gateway.engines import EngineUnavailable
from gagar_jax.rollout.gateway.render import (
    ChatRenderer,
    RequestError,
    parse_completion,
    prefix_keys,
    truncate_at_stop,
)
from gagar_jax.rollout.gateway.sessions import CallRecord, Session, SessionLimits, SessionStore
from gagar_jax.rollout.types import SamplingParams


class SessionNotFound(LookupError):
    """An unknown or finished session (HTTP 404)."""


@dataclasses.dataclass(frozen=True)
class GatewayConfig:
    """What the gateway serves and how it samples.

    Args:
    model_name: the name ``GET /v1/models`` lists (requests may name any model: there is one).
    context_limit: prompt + completion tokens of one call at most; a prompt at or over it is
      refused (400 with the limit), a completion is cut to what is left.
    default_max_tokens: completion tokens of a call that names no limit.
    max_tokens_cap: completion tokens of one call at most (the engine's budget).
    temperature: when set, every call samples at it whatever the request says (the update's
      temperature: behaviour and training log-probs are then of one distribution); the request's
      ``top_p`` and ``top_k`` are kept.
    """

    model_name: str = "policy"
    context_limit: int = 4096
    default_max_tokens: int = 512
    max_tokens_cap: int = 4096
    temperature: float | None = None

    def __post_init__(self):
        for name in ("context_limit", "default_max_tokens", "max_tokens_cap"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GatewayConfig.{name} must be an int >= 1, got {v!r}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(
                f"GatewayConfig.temperature must be >= 0 or None, got {self.temperature!r}"
            )


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One API's request in the gateway's terms (parsed and validated by the app)."""

    api: str
    messages: list[dict]
    tools: list[dict] | None
    parse_tools: bool
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: Sequence[str] = ()
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class ChatResult:
    record: CallRecord
    content: str
    tool_calls: list[dict]
    finish: str  # "stop" | "length" | "stop_string" | "tool_calls"
    stop_string: str | None


class Gateway:
    """Sessions, rendering and the engine behind both APIs.

    Args:
      backend: a gateway engine backend (``BatchingBackend`` for the embedded sampler,
        ``DirectBackend`` for SGLang).
      tokenizer: the policy's ``HFTokenizer`` (chat template, EOS).
      config: :class:`GatewayConfig`.
      record_dir: where finished sessions are written (None: memory only).
    """

    def __init__(self, backend, tokenizer, config: GatewayConfig | None = None, *, record_dir=None):
        self.backend = backend
        self.renderer = ChatRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.config = config or GatewayConfig()
        self.store = SessionStore(record_dir)
        self.stats = {"calls": 0, "linked_calls": 0, "engine_errors": 0, "refused": 0}

    # ------------------------------------------------------------------ sessions

    def open_session(
        self, episode_id: str | None = None, *, limits: SessionLimits | None = None, seed=None
    ) -> Session:
        return self.store.open(episode_id, limits=limits, seed=seed)

    def finish_session(self, token: str) -> dict:
        """Closes a session and returns its record (KeyError: unknown or already finished)."""
        return self.store.finish(token)

    def session(self, token: str | None) -> Session:
        s = self.store.get(token) if token else None
        if s is None:
            raise SessionNotFound("unknown or finished session")
        return s

    # ------------------------------------------------------------------ calls

    def _seed(self, session: Session, index: int, requested: int | None) -> int:
        if requested is not None:
            return int(requested) % 2**32
        return int(np.random.default_rng([session.seed, index]).integers(2**32))

    async def chat(self, session: Session, req: ChatRequest) -> ChatResult:
        """Renders, samples, records. Raises RequestError (400), SessionNotFound (404),
        EngineUnavailable (503: the session is then infra_error)."""
        cfg = self.config
        with session.lock:
            if session.status == "infra_error":
                raise EngineUnavailable(f"the episode ended on an engine failure: {session.reason}")
            if session.status != "open":
                raise SessionNotFound("unknown or finished session")
            spent = session.spent()
            if spent:
                session.limit_reason = spent
                self.stats["refused"] += 1
                raise RequestError(
                    "session", f"episode limit reached: {spent}", code="episode_limit"
                )
            session.in_flight += 1
            index_hint = len(session.calls) + session.in_flight - 1
            by_key = dict(session.by_key)
        counted = True  # this call is in session.in_flight
        try:
            rendered = self.renderer.render(req.messages, req.tools, by_key)
            n_prompt = len(rendered.prompt_ids)
            if n_prompt >= cfg.context_limit:
                # OpenAI's wording: client libraries (litellm, the SDKs' users) recognise it as
                # a context overflow and stop, where another 400 is retried until the wall time
                raise RequestError(
                    "messages",
                    f"This model's maximum context length is {cfg.context_limit} tokens "
                    f"(prompt + completion); the prompt is {n_prompt} tokens",
                    code="context_length_exceeded",
                )
            want = cfg.default_max_tokens if req.max_tokens is None else req.max_tokens
            max_tokens = max(1, min(want, cfg.max_tokens_cap, cfg.context_limit - n_prompt))
            if session.limits.max_completion_tokens:
                left = session.limits.max_completion_tokens - session.completion_tokens
                max_tokens = max(1, min(max_tokens, left))
            temperature = req.temperature if cfg.temperature is None else cfg.temperature
            params = SamplingParams(
                temperature=temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=max_tokens,
                stop_token_ids=(self.renderer.eos_id,),
            )
            t0 = time.perf_counter()
            try:
                sample = await self.backend.generate(
                    rendered.prompt_ids, params, self._seed(session, index_hint, req.seed)
                )
            except EngineUnavailable as e:
                self._infra_error(session, str(e))
                raise
            if sample.finish_reason == "abort":
                self._infra_error(session, "the engine aborted the generation")
                raise EngineUnavailable("the engine aborted the generation")
            latency = time.perf_counter() - t0
            ids, logprobs = [int(t) for t in sample.tokens], [float(x) for x in sample.logprobs]
            kept, text, stop = truncate_at_stop(self.renderer.completion_text, ids, req.stop)
            ids, logprobs = ids[:kept], logprobs[:kept]
            content, calls = parse_completion(text, tools=req.parse_tools)
            if calls:
                finish = "tool_calls"
            elif stop is not None:
                finish = "stop_string"
            else:
                finish = "stop" if sample.finish_reason == "stop" else "length"
            response = {"role": "assistant", "content": content}
            if calls:
                response["tool_calls"] = calls
            with session.lock:
                session.in_flight -= 1
                counted = False
                if session.status != "open":  # finished while the engine worked
                    raise SessionNotFound("unknown or finished session")
                record = CallRecord(
                    index=len(session.calls),
                    api=req.api,
                    prompt_ids=list(rendered.prompt_ids),
                    completion_ids=ids,
                    logprobs=logprobs,
                    policy_version=int(sample.policy_version),
                    finish_reason=sample.finish_reason if stop is None else "stop",
                    linked_call=rendered.linked_call,
                    temperature=float(temperature if temperature > 0 else 1.0),
                    messages=req.messages,
                    response=response,
                    tools=req.tools,
                    stop_string=stop,
                    latency_s=latency,
                )
                session.calls.append(record)
                key = prefix_keys(list(req.messages) + [response], req.tools)[-1]
                session.by_key[key] = record
            self.stats["calls"] += 1
            self.stats["linked_calls"] += rendered.linked_call is not None
            return ChatResult(record, content, calls, finish, stop)
        finally:
            if counted:
                with session.lock:
                    session.in_flight -= 1

    def _infra_error(self, session: Session, reason: str) -> None:
        self.stats["engine_errors"] += 1
        with session.lock:
            if session.status == "open":
                session.status, session.reason = "infra_error", reason

    def models(self) -> list[dict[str, Any]]:
        """The one model, in fields both APIs' model lists carry."""
        name = self.config.model_name
        return [
            {
                "id": name,
                "object": "model",
                "type": "model",
                "owned_by": "gagar_jax",
                "display_name": name,
                "created": 0,
                "created_at": "1970-01-01T00:00:00Z",
            }
        ]
