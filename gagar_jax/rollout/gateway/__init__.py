"""The token-exact OpenAI/Anthropic gateway: any agent harness drives a rollout engine.

A harness (mini-swe-agent, an Agents-SDK program, a CLI) talks to the policy as to an OpenAI or
Anthropic model; the gateway renders its messages with the policy's chat template into ids, sends
the ids to the engine (the embedded sampler directly, SGLang with ``input_ids``), and records per
call the prompt ids, completion ids, behaviour log-probabilities and policy version of the
episode's session. Generated text is never tokenised again (``render``); the calls become
training samples as linked segments (``gagar_jax.rollout.segments``).

    python -m gagar_jax.rollout.gateway --engine embedded --model-dir DIR --port 8000
    python -m gagar_jax.rollout.gateway --engine sglang --sglang-url URL --tokenizer DIR

In a Python process: ``Gateway(BatchingBackend(sampler), tokenizer)`` behind
``GatewayServer(gateway).start()``; ``gateway.open_session(episode_id)`` gives the session
whose ``server.session_url(session)`` the harness uses, ``gateway.finish_session(token)`` its
record.
"""

from gagar_jax.rollout.gateway.app import create_app
from gagar_jax.rollout.gateway.core import (
    ChatRequest,
    ChatResult,
    Gateway,
    GatewayConfig,
    SessionNotFound,
)
from gagar_jax.rollout.gateway.engines import BatchingBackend, DirectBackend, EngineUnavailable
from gagar_jax.rollout.gateway.render import ChatRenderer, RequestError, parse_completion
from gagar_jax.rollout.gateway.server import GatewayServer
from gagar_jax.rollout.gateway.sessions import CallRecord, Session, SessionLimits, SessionStore

__all__ = [
    "BatchingBackend",
    "CallRecord",
    "ChatRenderer",
    "ChatRequest",
    "ChatResult",
    "DirectBackend",
    "EngineUnavailable",
    "Gateway",
    "GatewayConfig",
    "GatewayServer",
    "RequestError",
    "Session",
    "SessionLimits",
    "SessionNotFound",
    "SessionStore",
    "create_app",
    "parse_completion",
]
