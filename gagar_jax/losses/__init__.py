"""Losses: token log-probs/entropy, clipped policy-gradient loss with off-policy correction and
the rollout-correction toolbox (IcePop, sequence-masked TIS, outlier masks, a total-variation
trust region), KL estimators, aggregation;
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
from gagar_jax.losses.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    Correction,
    apply_rollout_correction,
    icepop,
    masked_fractions,
    outlier_mask,
    seq_mask_tis,
    tv_trust_region,
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
    "ROLLOUT_CORRECTIONS",
    "Correction",
    "apply_rollout_correction",
    "icepop",
    "masked_fractions",
    "outlier_mask",
    "seq_mask_tis",
    "tv_trust_region",
]
