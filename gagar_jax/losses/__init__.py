"""Losses: token log-probs/entropy, clipped policy-gradient loss, KL estimators, aggregation."""

from gagar_jax.losses.policy import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    PolicyLossTerms,
    aggregate,
    delivered_credit,
    kl_estimate,
    policy_loss,
    token_logprobs_and_entropy,
)

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "PolicyLossTerms",
    "aggregate",
    "delivered_credit",
    "kl_estimate",
    "policy_loss",
    "token_logprobs_and_entropy",
]
