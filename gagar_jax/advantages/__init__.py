"""Pure, jittable, shardable advantage kernels for group-relative RL (Gagar).

Layouts: dense `[G, K]` (G groups, K rollout slots) with a `valid` mask, or flat `[N]` with
`group_ids` and a static `num_groups`; every function accepts both and gives the same result.
This package imports nothing else from gagar_jax, so other JAX RL code can reuse it alone.
"""

from gagar_jax.advantages.contrast import contrastive_tokens, distinguishing_tokens
from gagar_jax.advantages.discount import NUM_TIERS, Factors, discount_factors
from gagar_jax.advantages.estimators import (
    GroupStats,
    Penalized,
    group_stats,
    grpo_normalized,
    mean_centered,
    mixed_groups,
    penalize_cheats,
    rloo,
)
from gagar_jax.advantages.multiturn import BASELINES, per_turn_advantages, turns_to_tokens
from gagar_jax.advantages.pipeline import (
    ESTIMATORS,
    GagarConfig,
    GagarOutput,
    gagar_advantages,
)
from gagar_jax.advantages.redistribution import (
    REDISTRIBUTION_MODES,
    CreditBalance,
    broadcast_to_tokens,
    credit_balance,
    equivalent_rewards,
    redistribute,
)
from gagar_jax.advantages.segments import redistribute_segment_tokens, segment_advantages
from gagar_jax.advantages.tokens import (
    IMPORTANCE_PROVIDERS,
    EntropyImportance,
    EvidenceImportance,
    ImportanceInputs,
    ImportanceProvider,
    TokenCredit,
    UniformImportance,
    importance_provider,
    redistribute_tokens,
    token_credit,
    token_gini,
)

__all__ = [
    "BASELINES",
    "ESTIMATORS",
    "IMPORTANCE_PROVIDERS",
    "NUM_TIERS",
    "REDISTRIBUTION_MODES",
    "CreditBalance",
    "Factors",
    "GagarConfig",
    "GagarOutput",
    "GroupStats",
    "Penalized",
    "broadcast_to_tokens",
    "contrastive_tokens",
    "distinguishing_tokens",
    "credit_balance",
    "discount_factors",
    "EntropyImportance",
    "EvidenceImportance",
    "ImportanceInputs",
    "ImportanceProvider",
    "TokenCredit",
    "UniformImportance",
    "importance_provider",
    "redistribute_tokens",
    "token_credit",
    "token_gini",
    "equivalent_rewards",
    "gagar_advantages",
    "group_stats",
    "grpo_normalized",
    "mean_centered",
    "mixed_groups",
    "penalize_cheats",
    "per_turn_advantages",
    "turns_to_tokens",
    "redistribute",
    "redistribute_segment_tokens",
    "rloo",
    "segment_advantages",
]
