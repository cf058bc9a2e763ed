"""The gateway's HTTP surface (FastAPI): OpenAI chat completions, Anthropic messages, models.

Routes (each under ``/v1`` with the session token as the API key -- ``Authorization: Bearer``
or ``x-api-key`` -- and under ``/sessions/<token>/v1`` as a base URL):

* ``POST .../chat/completions``: ``messages``, ``tools``/``tool_calls``, ``tool_choice``
  ("auto" or "none"), ``stream`` (server-sent events, ``stream_options.include_usage``),
  ``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop``, ``seed``;
* ``POST .../messages``: content blocks, ``tool_use``/``tool_result``, ``system``,
  ``stop_sequences``, ``top_k``, ``stream`` (Anthropic's event stream);
* ``GET .../models``.

The trainer's routes take the admin key (``Authorization: Bearer <admin key>``):
``POST /admin/sessions`` ({"episode_id", "max_calls", "max_completion_tokens", "max_wall_s"} ->
{"token", "episode_id", "base_url"}), ``POST /admin/sessions/<token>/finish`` (the record),
``GET /admin/episodes/<episode_id>`` (a finished episode's record, also after a restart).

Errors: malformed JSON, a field of the wrong type or value, or a field the gateway does not
support (``n > 1``, penalties, ``logprobs``, image parts, ...) is a 400 naming the field; a
prompt over the context limit is a 400 with the limit; an unknown or finished session a 404;
an engine that cannot answer a 503 (the episode is then ``infra_error``). Each API answers in its
own error shape, so the official SDKs raise their usual exceptions. A completion is generated
whole before the first event is sent: a streamed answer carries the same tokens as a plain one.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gagar_jax.rollout.gateway.core import ChatRequest, ChatResult, Gateway, SessionNotFound
from gagar_jax.rollout.gateway.engines import EngineUnavailable
from gagar_jax.rollout.gateway.render import (
    RequestError,
    anthropic_messages,
    anthropic_tools,
    openai_messages,
    openai_tools,
)
from gagar_jax.rollout.gateway.sessions import SessionLimits

OPENAI_FIELDS = frozenset(
    {
        "model", "messages", "tools", "tool_choice", "stream", "stream_options", "temperature",
        "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed", "user", "metadata",
        "parallel_tool_calls", "store", "logprobs", "frequency_penalty", "presence_penalty",
        "response_format",
    }
)  # fmt: skip  # one set, read as a list
ANTHROPIC_FIELDS = frozenset(
    {
        "model", "max_tokens", "messages", "system", "tools", "tool_choice", "stream",
        "temperature", "top_p", "top_k", "stop_sequences", "metadata", "thinking",
    }
)  # fmt: skip


# ---------------------------------------------------------------------------- field checks


def _number(body, field, lo, hi, *, default, lo_open=False):
    v = body.get(field)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(field, f"expected a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise RequestError(
            field, f"expected a value in {'(' if lo_open else '['}{lo}, {hi}], got {v}"
        )
    return float(v)


def _int(body, field, lo, *, default=None):
    v = body.get(field)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise RequestError(field, f"expected an integer >= {lo}, got {v!r}")
    return v


def _stops(v, field) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise RequestError(field, "expected a non-empty string or a list of up to 16 of them")
    return v


def _unknown(body: Mapping, allowed: frozenset) -> None:
    extra = sorted(k for k in body if k not in allowed)
    if extra:
        raise RequestError(extra[0], "this field is not supported by the gateway")


def parse_openai(body: Mapping[str, Any]) -> tuple[ChatRequest, bool, bool]:
    """(request, stream, include_usage) of a chat-completions body."""
    _unknown(body, OPENAI_FIELDS)
    if body.get("n") not in (None, 1):
        raise RequestError("n", f"only n = 1 is supported, got {body.get('n')!r}")
    for f in ("frequency_penalty", "presence_penalty"):
        if body.get(f) not in (None, 0, 0.0):
            raise RequestError(f, "penalties change the sampled distribution: only 0 is supported")
    if body.get("logprobs") not in (None, False):
        raise RequestError("logprobs", "not supported (the gateway records them itself)")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, Mapping) or rf.get("type") != "text"):
        raise RequestError("response_format", "only {'type': 'text'} is supported")
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise RequestError("model", "expected a string")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise RequestError("tool_choice", f"only 'auto' and 'none' are supported, got {choice!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "expected a boolean")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise RequestError("stream_options", "expected an object")
    tools = openai_tools(body.get("tools"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    seed = _int(body, "seed", 0)
    req = ChatRequest(
        api="openai",
        messages=openai_messages(body.get("messages")),
        tools=tools,
        parse_tools=bool(tools) and choice == "auto",
        temperature=_number(body, "temperature", 0.0, 2.0, default=1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
        max_tokens=max_tokens,
        stop=_stops(body.get("stop"), "stop"),
        seed=seed,
    )
    return req, stream, bool(opts.get("include_usage"))


def parse_anthropic(body: Mapping[str, Any]) -> tuple[ChatRequest, bool]:
    _unknown(body, ANTHROPIC_FIELDS)
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens", "required")
    thinking = body.get("thinking")
    if thinking is not None and (
        not isinstance(thinking, Mapping) or thinking.get("type") != "disabled"
    ):
        raise RequestError("thinking", "extended thinking is not supported")
    if body.get("model") is not None and not isinstance(body.get("model"), str):
        raise RequestError("model", "expected a string")
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "none"):
        raise RequestError(
            "tool_choice", "only {'type': 'auto'} and {'type': 'none'} are supported"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "expected a boolean")
    tools = anthropic_tools(body.get("tools"))
    req = ChatRequest(
        api="anthropic",
        messages=anthropic_messages(body.get("system"), body.get("messages")),
        tools=tools,
        parse_tools=bool(tools) and choice.get("type") == "auto",
        temperature=_number(body, "temperature", 0.0, 1.0, default=1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, default=0),
        max_tokens=_int(body, "max_tokens", 1),
        stop=_stops(body.get("stop_sequences"), "stop_sequences"),
    )
    return req, stream


# ---------------------------------------------------------------------------- responses


def _sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _openai_tool_calls(result: ChatResult, call_id: str) -> list[dict]:
    return [
        {
            "id": f"call_{call_id}_{k}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for k, c in enumerate(result.tool_calls)
    ]


def _openai_finish(result: ChatResult) -> str:
    return {"tool_calls": "tool_calls", "length": "length"}.get(result.finish, "stop")


def openai_response(result: ChatResult, model: str, include_usage: bool, stream: bool):
    rec = result.record
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    usage = {
        "prompt_tokens": len(rec.prompt_ids),
        "completion_tokens": len(rec.completion_ids),
        "total_tokens": len(rec.prompt_ids) + len(rec.completion_ids),
    }
    calls = _openai_tool_calls(result, cid[-12:])
    if not stream:
        message = {
            "role": "assistant",
            "content": result.content if result.content or not calls else None,
        }
        if calls:
            message["tool_calls"] = calls
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {"index": 0, "message": message, "finish_reason": _openai_finish(result)}
                ],
                "usage": usage,
            }
        )

    def chunk(delta, finish=None, **extra):
        return _sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **extra,
            }
        )

    def events():
        yield chunk({"role": "assistant", "content": ""})
        if result.content:
            yield chunk({"content": result.content})
        for k, c in enumerate(calls):
            yield chunk({"tool_calls": [{"index": k, **c}]})
        yield chunk({}, _openai_finish(result))
        if include_usage:
            yield _sse(
                {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            )
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def anthropic_response(result: ChatResult, model: str, stream: bool):
    rec = result.record
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    blocks: list[dict] = []
    if result.content:
        blocks.append({"type": "text", "text": result.content})
    for k, c in enumerate(result.tool_calls):
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{mid[-12:]}_{k}",
                "name": c["name"],
                "input": c["arguments"],
            }
        )
    stop_reason = {
        "tool_calls": "tool_use",
        "length": "max_tokens",
        "stop_string": "stop_sequence",
    }.get(result.finish, "end_turn")
    usage = {"input_tokens": len(rec.prompt_ids), "output_tokens": len(rec.completion_ids)}
    message = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": result.stop_string,
        "usage": usage,
    }
    if not stream:
        return JSONResponse(message)

    def events():
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": 0}
        yield _sse({"type": "message_start", "message": start}, "message_start")
        for i, b in enumerate(blocks):
            if b["type"] == "text":
                first, delta = (
                    {"type": "text", "text": ""},
                    {"type": "text_delta", "text": b["text"]},
                )
            else:
                first = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(b["input"])}
            yield _sse(
                {"type": "content_block_start", "index": i, "content_block": first},
                "content_block_start",
            )
            yield _sse(
                {"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta"
            )
            yield _sse({"type": "content_block_stop", "index": i}, "content_block_stop")
        yield _sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": result.stop_string},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
            "message_delta",
        )
        yield _sse({"type": "message_stop"}, "message_stop")

    return StreamingResponse(events(), media_type="text/event-stream")


# ---------------------------------------------------------------------------- errors


def openai_error(status: int, message: str, *, param=None, kind="invalid_request_error", code=None):
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
    )


def anthropic_error(status: int, message: str, kind: str = "invalid_request_error"):
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}}, status_code=status
    )


def _error(api: str, status: int, message: str, *, param=None, code=None):
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "overloaded_error"}.get(
        status, "api_error"
    )
    if api == "anthropic":
        return anthropic_error(status, message, kind)
    return openai_error(status, message, param=param, kind=kind, code=code)


# ---------------------------------------------------------------------------- the app


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


MAX_BODY_BYTES = 32 << 20


async def _json_body(request: Request) -> dict:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError("body", f"larger than {MAX_BODY_BYTES} bytes")
    raw = bytearray()
    async for chunk in request.stream():
        raw.extend(chunk)
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError("body", f"larger than {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, deep nesting
        raise RequestError("body", f"malformed JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise RequestError("body", "expected a JSON object")
    return body


def create_app(gateway: Gateway, *, admin_key: str | None = None) -> FastAPI:
    """The FastAPI app over ``gateway``; ``admin_key`` enables the ``/admin`` routes."""
    app = FastAPI(title="gagar_jax gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    async def handle(api: str, request: Request, token: str | None):
        try:
            session = gateway.session(token if token is not None else _bearer(request))
            body = await _json_body(request)
            if api == "openai":
                req, stream, usage = parse_openai(body)
                result = await gateway.chat(session, req)
                return openai_response(result, gateway.config.model_name, usage, stream)
            req, stream = parse_anthropic(body)
            result = await gateway.chat(session, req)
            return anthropic_response(result, gateway.config.model_name, stream)
        except SessionNotFound as e:
            return _error(api, 404, str(e))
        except RequestError as e:
            return _error(api, 400, str(e), param=e.field, code=e.code)
        except EngineUnavailable as e:
            return _error(api, 503, f"the model engine is unavailable: {e}")

    async def models(request: Request, token: str | None):
        try:
            gateway.session(token if token is not None else _bearer(request))
        except SessionNotFound as e:
            return _error("openai", 404, str(e))
        data = gateway.models()
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "has_more": False,
                "first_id": data[0]["id"],
                "last_id": data[-1]["id"],
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_key(request: Request):
        return await handle("openai", request, None)

    @app.post("/sessions/{token}/v1/chat/completions")
    async def chat_path(token: str, request: Request):
        return await handle("openai", request, token)

    @app.post("/v1/messages")
    async def messages_key(request: Request):
        return await handle("anthropic", request, None)

    @app.post("/sessions/{token}/v1/messages")
    async def messages_path(token: str, request: Request):
        return await handle("anthropic", request, token)

    @app.get("/v1/models")
    async def models_key(request: Request):
        return await models(request, None)

    @app.get("/sessions/{token}/v1/models")
    async def models_path(token: str, request: Request):
        return await models(request, token)

    @app.get("/health")
    async def health():
        return {"ok": True, "open_sessions": len(gateway.store.open_sessions()), **gateway.stats}

    def admin_ok(request: Request) -> bool:
        import hmac

        got = _bearer(request) or ""
        return bool(admin_key) and hmac.compare_digest(got.encode(), admin_key.encode())

    @app.post("/admin/sessions")
    async def admin_open(request: Request):
        if not admin_ok(request):
            return openai_error(404, "not found", kind="not_found_error")
        try:
            body = await _json_body(request)
            limits = SessionLimits(
                max_calls=_int(body, "max_calls", 0, default=0),
                max_completion_tokens=_int(body, "max_completion_tokens", 0, default=0),
                max_wall_s=_number(body, "max_wall_s", 0.0, 1e9, default=0.0),
            )
            s = gateway.open_session(
                body.get("episode_id"), limits=limits, seed=_int(body, "seed", 0)
            )
        except RequestError as e:
            return openai_error(400, str(e), param=e.field)
        except ValueError as e:
            return openai_error(400, str(e), param="episode_id")
        base = str(request.base_url).rstrip("/")
        return {
            "token": s.token,
            "episode_id": s.episode_id,
            "base_url": f"{base}/sessions/{s.token}/v1",
        }

    @app.post("/admin/sessions/{token}/finish")
    async def admin_finish(token: str, request: Request):
        if not admin_ok(request):
            return openai_error(404, "not found", kind="not_found_error")
        try:
            return gateway.finish_session(token)
        except KeyError:
            return openai_error(404, "unknown or finished session", kind="not_found_error")

    @app.get("/admin/episodes/{episode_id}")
    async def admin_episode(episode_id: str, request: Request):
        if not admin_ok(request):
            return openai_error(404, "not found", kind="not_found_error")
        rec = gateway.store.finished(episode_id)
        if rec is None:
            return openai_error(404, f"no finished episode {episode_id!r}", kind="not_found_error")
        return rec

    return app
