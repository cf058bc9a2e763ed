"""Losses: token log-probs/entropy, clipped policy-gradient loss with off-policy correction, KL
estimators, aggregation;
feedback-span losses (re-weighted SFT, span-level KTO)."""

from gagar_jax.losses.feedback import (
    REFERENCE_POINTS,
    REWARD_NORMS,
    kto_kl_reference_point,
    polarity_weights,
    rw_sft_loss,
    span_kto_loss,
    span_rewards,
)
from gagar_jax.losses.policy import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    ROLLOUT_IS,
    ROLLOUT_RS,
    OffPolicyWeights,
    PolicyLossTerms,
    aggregate,
    delivered_credit,
    kl_estimate,
    off_policy_weights,
    policy_loss,
    token_logprobs_and_entropy,
)

__all__ = [
    "REFERENCE_POINTS",
    "REWARD_NORMS",
    "kto_kl_reference_point",
    "polarity_weights",
    "rw_sft_loss",
    "span_kto_loss",
    "span_rewards",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "ROLLOUT_IS",
    "ROLLOUT_RS",
    "OffPolicyWeights",
    "PolicyLossTerms",
    "aggregate",
    "delivered_credit",
    "kl_estimate",
    "off_policy_weights",
    "policy_loss",
    "token_logprobs_and_entropy",
]
