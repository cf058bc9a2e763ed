"""Rollout engines: the `RolloutEngine` protocol, multi-turn episodes, the SGLang client.

The embedded JAX sampler lives in `gagar_jax.rollout.sampler` (imported on use: it pulls in the
model).
"""

from gagar_jax.rollout.episode import (
    CodeAgentEnv,
    Episode,
    EpisodeBatch,
    StepResult,
    ToolCall,
    ToolEnvironment,
    Turn,
    advance_episodes,
    finish_episodes,
    parse_action,
    restore_episodes,
    run_episode,
    run_episodes,
    start_episodes,
)
from gagar_jax.rollout.sglang_client import (
    SGLangClient,
    SGLangError,
    SGLangRequestError,
    SGLangUnavailableError,
)
from gagar_jax.rollout.sglang_engine import SGLangEngine, WeightSyncError
from gagar_jax.rollout.types import FINISH_REASONS, RolloutEngine, Sample, SamplingParams

__all__ = [
    "FINISH_REASONS",
    "CodeAgentEnv",
    "Episode",
    "EpisodeBatch",
    "RolloutEngine",
    "SGLangClient",
    "SGLangEngine",
    "SGLangError",
    "SGLangRequestError",
    "SGLangUnavailableError",
    "Sample",
    "SamplingParams",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "Turn",
    "WeightSyncError",
    "advance_episodes",
    "finish_episodes",
    "parse_action",
    "restore_episodes",
    "run_episode",
    "run_episodes",
    "start_episodes",
]
