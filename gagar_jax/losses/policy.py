"""Token log-probabilities, entropy, the clipped policy-gradient loss, KL estimators, aggregation.

Axis vocabulary: ``B`` sequences in a micro-batch, ``T`` tokens, ``V`` vocabulary.

Aggregation across gradient accumulation
-----------------------------------------
Every aggregate here is a *sum* divided by a normaliser that the caller may fix for the whole
mini-batch (``num_tokens`` / ``num_seqs``). Summing the micro-batch results then gives exactly the
mini-batch aggregate -- for token-mean, ``sum over all mini-batch tokens / mini-batch token count``,
which is the Gagar / DAPO objective, and not the mean of micro-batch means (those weight a token
by the inverse size of its micro-batch). Left as ``None`` the normaliser is the local one.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from gagar_jax.losses.rollout_correction import (
    WEIGHTING_CORRECTIONS,
    apply_rollout_correction,
    check_correction_settings,
)

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k3")
ROLLOUT_IS = ("none", "token", "sequence")
ROLLOUT_RS = ("none", "token_k3", "geometric")


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array):
    """Log-probability of each target token and the entropy of each predictive distribution.

    ``log p(y) = z_y - logsumexp(z)``; ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.
    Both are row reductions over ``logits`` that XLA fuses, so the only ``[.., V]`` float32
    buffer is ``logits`` itself (and its cotangent in the backward pass); no log-softmax array is
    materialised.

    Args:
      logits: [..., T, V] float (promoted to float32).
      targets: [..., T] int token ids.
    Returns:
      (logprobs [..., T] float32, entropy [..., T] float32).
    """
    chex.assert_equal_shape_prefix([logits, targets], targets.ndim)
    logits = logits.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    shifted = logits - m
    sum_exp = jnp.sum(jnp.exp(shifted), axis=-1)
    lse = jnp.log(sum_exp)  # [..., T], of the shifted logits
    target = jnp.take_along_axis(shifted, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logprobs = target - lse
    # E_p[z] = sum exp(z - m) z / sum exp(z - m); shifted logits keep exp() in range.
    mean_logit = jnp.sum(jnp.exp(shifted) * shifted, axis=-1) / sum_exp
    entropy = lse - mean_logit
    return logprobs, entropy


def aggregate(
    values: jax.Array,
    mask: jax.Array,
    mode: str = "token-mean",
    *,
    num_tokens: jax.Array | float | None = None,
    num_seqs: jax.Array | float | None = None,
) -> jax.Array:
    """Reduces per-token ``values`` to a scalar.

    - ``token-mean``: ``sum(values * mask) / num_tokens`` (every token weighs the same).
    - ``seq-mean-token-mean``: ``sum_b [sum_t values*mask / sum_t mask] / num_seqs``.
    - ``seq-mean-token-sum``: ``sum_b [sum_t values*mask] / num_seqs``.

    Args:
      values: [B, T] float32.
      mask: [B, T] bool/float, 1 on tokens that count (response tokens).
      mode: one of :data:`AGGREGATIONS`.
      num_tokens: token-mean normaliser; default ``sum(mask)`` (pass the mini-batch count when
        accumulating over micro-batches).
      num_seqs: seq-mean normaliser; default the number of sequences with >= 1 token.
    Returns:
      [] float32.
    """
    chex.assert_rank([values, mask], 2)
    chex.assert_equal_shape([values, mask])
    mask = mask.astype(jnp.float32)
    values = values.astype(jnp.float32) * mask
    if mode == "token-mean":
        denom = jnp.sum(mask) if num_tokens is None else num_tokens
        # An all-masked batch contributes 0, not NaN.
        return jnp.sum(values) / jnp.maximum(denom, 1.0)
    seq_tokens = jnp.sum(mask, axis=-1)
    denom = jnp.sum(seq_tokens > 0) if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        per_seq = jnp.sum(values, axis=-1) / jnp.maximum(seq_tokens, 1.0)
    elif mode == "seq-mean-token-sum":
        per_seq = jnp.sum(values, axis=-1)
    else:
        raise ValueError(f"aggregation mode must be one of {AGGREGATIONS}, got {mode!r}")
    return jnp.sum(per_seq) / jnp.maximum(jnp.asarray(denom, jnp.float32), 1.0)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's estimators).

    With ``d = log pi_ref(y) - log pi(y)``: k1 = ``-d``; k3 = ``exp(d) - d - 1`` (>= 0, unbiased,
    low variance).

    Args:
      logprobs: [B, T] float32, current policy.
      ref_logprobs: [B, T] float32, reference policy.
      kind: "k1" or "k3".
    Returns:
      [B, T] float32.
    """
    chex.assert_equal_shape([logprobs, ref_logprobs])
    d = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
    if kind == "k1":
        return -d
    if kind == "k3":
        # Clamp the exponent: an extreme log-ratio would overflow exp(); at |d| = 20 the
        # estimate is already ~5e8, far past any useful penalty.
        d = jnp.clip(d, -20.0, 20.0)
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {kind!r}")


def delivered_credit(
    advantages: jax.Array,
    ratio: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> jax.Array:
    """Per-token credit the clipped surrogate of :func:`policy_loss` actually delivers.

    The negative gradient of ``l`` with respect to ``log pi(y_t)`` is ``A_t r_t`` where the
    unclipped branch is active and 0 where the clip (or the dual clip) holds the loss constant:

    - ``A > 0``: active iff ``r <= 1 + eps_high``;
    - ``A < 0``: active iff ``r >= 1 - eps_low`` and, with a dual clip ``c``, ``r <= c``.

    So ``delivered = A r [active]`` (0 where ``A = 0``). At ``r = 1`` (the first, on-policy
    step) nothing is clipped and ``delivered = A``. Clipping acts per token: a token-level
    redistribution that conserves ``sum_t A_t`` need not conserve ``sum_t delivered_t``.

    Args:
      advantages: [B, T] (or broadcastable) float32 token advantages.
      ratio: [B, T] float32 importance ratios ``pi / pi_old`` (no gradient is taken).
      clip_low, clip_high, dual_clip: as in :func:`policy_loss`.
    Returns:
      [B, T] float32.
    """
    a = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
    r = jax.lax.stop_gradient(jnp.asarray(ratio, jnp.float32))
    active = jnp.where(a > 0, r <= 1.0 + clip_high, r >= 1.0 - clip_low)
    if dual_clip is not None:
        active = active & ~((a < 0) & (r > dual_clip))
    return jnp.where(active, a * r, 0.0)


class OffPolicyWeights(NamedTuple):
    """Off-policy correction of one micro-batch: per-token weights, kept tokens, diagnostics."""

    weights: jax.Array  # [B, T] float32 truncated IS weight on each token (1: none)
    keep: jax.Array  # [B, T] bool, token not rejected by ``rollout_rs``
    log_ratio: jax.Array  # [B, T] float32 log pi_prox - log mu on response tokens (else 0)
    clipped: jax.Array  # [B, T] bool, the raw weight exceeded the threshold


def off_policy_weights(
    proximal_logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    mask: jax.Array,
    *,
    rollout_is: str = "none",
    rollout_is_threshold: float = 2.0,
    rollout_rs: str = "none",
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float = 0.5,
) -> OffPolicyWeights:
    """Truncated importance weights and rejection masks on the behaviour/trainer mismatch.

    With ``d_t = log pi_prox(y_t) - log mu(y_t)`` (the trainer's own log-prob at the start of
    the update against the engine's that sampled the token; both without gradient):

    - ``rollout_is="token"``: ``w_t = min(exp(d_t), C)`` (truncated IS, Ionides 2008; the
      "TIS" of slime / verl); ``"sequence"``: ``w_t = min(exp(sum_s d_s), C)`` on every token
      of the sequence (the sum over its response tokens); ``"none"``: ``w_t = 1``.
      ``C = rollout_is_threshold`` >= 1.
    - ``rollout_rs="token_k3"``: a token whose k3 estimate ``exp(d) - d - 1`` of
      KL(mu || pi_prox) (from mu's samples) exceeds ``rollout_rs_threshold`` is rejected
      (masked from the loss);
      ``"geometric"``: a sequence whose geometric-mean ratio ``exp(mean_t d_t)`` lies outside
      ``[rollout_rs_threshold_lower, rollout_rs_threshold]`` is rejected whole.

    Equal log-probs (``d = 0``) give ``w = 1`` and reject nothing for every valid setting
    (``C >= 1``, the k3 threshold >= 0, ``lower <= 1 <= upper``), so the corrected loss is the
    on-policy loss exactly.

    Args:
      proximal_logprobs: [B, T] float32, the trainer's log-probs before the update.
      behaviour_logprobs: [B, T] float32, the rollout engine's log-probs.
      mask: [B, T] bool, response tokens.
      rollout_is, rollout_is_threshold: one of :data:`ROLLOUT_IS` and the truncation ``C``.
      rollout_rs, rollout_rs_threshold, rollout_rs_threshold_lower: one of :data:`ROLLOUT_RS`
        and its bounds.
    Returns:
      :class:`OffPolicyWeights`.
    """
    chex.assert_rank([proximal_logprobs, behaviour_logprobs, mask], 2)
    chex.assert_equal_shape([proximal_logprobs, behaviour_logprobs, mask])
    if rollout_is not in ROLLOUT_IS:
        raise ValueError(f"rollout_is must be one of {ROLLOUT_IS}, got {rollout_is!r}")
    if rollout_rs not in ROLLOUT_RS:
        raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS}, got {rollout_rs!r}")
    if not rollout_is_threshold >= 1.0:
        raise ValueError(f"rollout_is_threshold must be >= 1, got {rollout_is_threshold}")
    if rollout_rs == "token_k3" and not rollout_rs_threshold >= 0.0:
        raise ValueError(
            f"rollout_rs_threshold (a k3 bound) must be >= 0, got {rollout_rs_threshold}"
        )
    if rollout_rs == "geometric" and not (
        rollout_rs_threshold_lower <= 1.0 <= rollout_rs_threshold
    ):
        raise ValueError(
            "rollout_rs bounds must satisfy rollout_rs_threshold_lower <= 1 <= "
            f"rollout_rs_threshold, got [{rollout_rs_threshold_lower}, "
            f"{rollout_rs_threshold}]"
        )
    sg = jax.lax.stop_gradient
    maskf = mask.astype(jnp.float32)
    # Clamp before exp(): past e^20 every weight is truncated anyway and exp would overflow.
    d = (
        jnp.clip(
            sg(proximal_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32)),
            -20.0,
            20.0,
        )
        * maskf
    )
    if rollout_is == "token":
        raw = jnp.exp(d)
    elif rollout_is == "sequence":
        raw = jnp.broadcast_to(
            jnp.exp(jnp.clip(jnp.sum(d, -1, keepdims=True), -20.0, 20.0)), d.shape
        )
    else:
        raw = jnp.ones_like(d)
    weights = jnp.minimum(raw, rollout_is_threshold)
    keep = mask.astype(bool)
    if rollout_rs == "token_k3":
        keep = keep & (jnp.exp(d) - d - 1.0 <= rollout_rs_threshold)
    elif rollout_rs == "geometric":
        n = jnp.maximum(jnp.sum(maskf, -1, keepdims=True), 1.0)
        geo = jnp.exp(jnp.sum(d, -1, keepdims=True) / n)
        keep = keep & (geo >= rollout_rs_threshold_lower) & (geo <= rollout_rs_threshold)
    return OffPolicyWeights(
        weights=weights,
        keep=keep,
        log_ratio=d,
        clipped=(raw > rollout_is_threshold) & mask.astype(bool),
    )


class PolicyLossTerms(NamedTuple):
    loss: jax.Array  # [] total loss (pg + kl_coef * kl - entropy_coef * entropy)
    pg_loss: jax.Array  # [] aggregated clipped policy-gradient loss
    entropy: jax.Array  # [] token-mean entropy
    kl: jax.Array  # [] aggregated KL to the reference (0 when no reference)
    approx_kl: jax.Array  # [] token-mean k3 estimate of KL(pi_old || pi)
    clip_frac_low: jax.Array  # [] fraction of tokens clipped below (A < 0, ratio < 1 - eps_low)
    clip_frac_high: jax.Array  # [] fraction of tokens clipped above (A > 0, ratio > 1 + eps_high)
    dual_clip_frac: jax.Array  # [] fraction of tokens hit by the dual clip
    ratio_mean: jax.Array  # [] token-mean importance ratio
    # Off-policy correction (all token means over the same normaliser; see off_policy_weights)
    mismatch_kl: jax.Array  # [] k3 estimate of KL(mu || pi_prox), behaviour vs trainer
    is_frac_clipped: jax.Array  # [] fraction of tokens whose IS weight was truncated
    is_weight_mean: jax.Array  # [] mean IS weight (is_ess = mean^2 / mean of squares)
    is_weight_sq_mean: jax.Array  # [] mean squared IS weight
    rs_frac_rejected: jax.Array  # [] fraction of response tokens rejected by rollout_rs
    credit_positive: jax.Array  # [] token mean of the positive advantages (the S+ delivered
    #                             on policy, with r = w = 1)
    credit_delivered: jax.Array  # [] token mean of w A r [clip active] over A > 0 tokens
    # rollout_correction (gagar_jax.losses.rollout_correction): masked response tokens over
    # the token normaliser, sequences with a masked token over the sequence normaliser
    correction_token_frac: jax.Array
    correction_seq_frac: jax.Array


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    entropy: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    num_tokens=None,
    num_seqs=None,
    proximal_logprobs: jax.Array | None = None,
    rollout_is: str = "none",
    rollout_is_threshold: float = 2.0,
    rollout_rs: str = "none",
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float = 0.5,
    decoupled: bool = False,
    rollout_correction: str = "none",
    rollout_correction_low: float = 0.5,
    rollout_correction_high: float = 2.0,
    rollout_correction_cap: float = 2.0,
    rollout_correction_outlier: float = 20.0,
    rollout_correction_delta: float = 0.2,
) -> PolicyLossTerms:
    """Clipped surrogate policy-gradient loss with clip-higher, optional dual clip and an
    off-policy correction.

    Per token, with ``r = exp(log pi - log pi_old)``::

        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))        (PPO, DAPO clip-higher)
        l = min(l, -A c)  where A < 0                                 (dual clip, c > 1)

    then ``loss = agg(l) + kl_coef * agg(KL(pi || pi_ref)) - entropy_coef * token_mean(H)``.

    Off-policy correction, given ``proximal_logprobs`` (``pi_prox``: the trainer's own log-probs
    before the update; ``old_logprobs`` are then the behaviour ``mu``'s, the engine's):

    - ``decoupled=True`` (AReaL's decoupled PPO, arXiv:2505.24298): the clip's ratio is
      ``pi / pi_prox``, a trust region around the policy the update starts from, separate
      from the (possibly several versions older) policy that sampled the tokens;
      ``decoupled=False``: ``pi / mu`` as without a correction.
    - ``rollout_is``: each token's ``l`` is multiplied by the truncated weight ``w`` of
      :func:`off_policy_weights` (``pi_prox / mu``); it needs ``decoupled=True`` (with the
      clip around ``mu`` the ratio already holds ``pi / mu`` and the weight would count the
      mismatch twice).
    - ``rollout_rs``: rejected tokens leave the loss (their mask is cleared; the normalisers
      are unchanged, so a rejected token counts as a zero, as a clipped one does).
    - ``rollout_correction``: one of :data:`~gagar_jax.losses.rollout_correction.
      ROLLOUT_CORRECTIONS` on top of the two above (its masked tokens leave the loss as
      rejected ones do; ``icepop`` and ``seq_mask_tis`` also weight the tokens, so they need
      ``decoupled=True`` and ``rollout_is="none"``), with its settings
      ``rollout_correction_low`` / ``_high`` (the ratio band), ``_cap`` (the TIS truncation of
      ``seq_mask_tis``), ``_outlier`` (the outlier ratio) and ``_delta`` (the trust region's
      radius). ``tv_trust_region`` reads the current ``logprobs`` against the behaviour's and
      needs no ``proximal_logprobs``.

    Without ``proximal_logprobs`` (or with ``pi_prox == mu``) the loss is the on-policy one
    exactly.
    Diagnostics (entropy, clip fractions, approximate KL, ratio) are token means with the same
    ``num_tokens`` normaliser, so they also sum exactly across micro-batches.

    Args:
      logprobs: [B, T] float32 under the current parameters (differentiated).
      old_logprobs: [B, T] float32 under the behaviour policy (no gradient).
      advantages: [B, T] or [B] float32 (a [B] array is broadcast over tokens inside this
        fused expression, so no separate [B, T] advantage array is needed).
      mask: [B, T] bool, True on response tokens.
      entropy: [B, T] float32 or None (no entropy term or metric).
      ref_logprobs: [B, T] float32 under the reference policy, or None (no KL term).
      clip_low, clip_high: eps_low, eps_high of the clip range.
      dual_clip: c > 1 or None.
      aggregation: one of :data:`AGGREGATIONS` for the pg and KL terms.
      kl_coef, kl_estimator: KL penalty weight and estimator ("k1" | "k3").
      entropy_coef: weight of the entropy bonus.
      num_tokens, num_seqs: mini-batch normalisers (see :func:`aggregate`).
      proximal_logprobs: [B, T] float32 of the trainer before the update, or None.
      rollout_is, rollout_is_threshold, rollout_rs, rollout_rs_threshold,
      rollout_rs_threshold_lower: see :func:`off_policy_weights`.
      decoupled: the clip around ``pi_prox`` instead of ``mu``.
    Returns:
      :class:`PolicyLossTerms` of scalars.
    """
    chex.assert_rank([logprobs, old_logprobs, mask], 2)
    check_correction_settings(
        rollout_correction,
        low=rollout_correction_low,
        high=rollout_correction_high,
        cap=rollout_correction_cap,
        outlier=rollout_correction_outlier,
        delta=rollout_correction_delta,
    )
    if rollout_correction in WEIGHTING_CORRECTIONS and (not decoupled or rollout_is != "none"):
        raise ValueError(
            f"rollout_correction={rollout_correction!r} weights tokens: it needs "
            "decoupled=True and rollout_is='none' (the weight would count the mismatch twice)"
        )
    needs_prox = rollout_correction not in ("none", "tv_trust_region")
    if (rollout_is != "none" or rollout_rs != "none" or decoupled or needs_prox) and (
        proximal_logprobs is None
    ):
        raise ValueError(
            "rollout_is / rollout_rs / decoupled / rollout_correction need proximal_logprobs (the "
            "trainer's log-probs before the update)"
        )
    if rollout_is != "none" and not decoupled:
        raise ValueError(
            f"rollout_is={rollout_is!r} needs decoupled=True: with the clip "
            "around the behaviour policy the ratio already carries pi / mu"
        )
    chex.assert_equal_shape([logprobs, old_logprobs, mask])
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    if advantages.ndim == 1:
        chex.assert_axis_dimension(advantages, 0, logprobs.shape[0])
        advantages = advantages[:, None]
    else:
        chex.assert_equal_shape([advantages, logprobs])
    advantages = jax.lax.stop_gradient(advantages.astype(jnp.float32))
    old_logprobs = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
    response = mask.astype(bool)
    if proximal_logprobs is not None:
        chex.assert_equal_shape([proximal_logprobs, logprobs])
        proximal_logprobs = jax.lax.stop_gradient(proximal_logprobs.astype(jnp.float32))
        opw = off_policy_weights(
            proximal_logprobs,
            old_logprobs,
            response,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold,
            rollout_rs_threshold_lower=rollout_rs_threshold_lower,
        )
        anchor = proximal_logprobs if decoupled else old_logprobs
        # the normalisers count every response token, rejected ones included
        respf0 = response.astype(jnp.float32)
        if num_tokens is None:
            num_tokens = jnp.sum(respf0)
        if num_seqs is None:
            num_seqs = jnp.sum(jnp.any(response, axis=-1).astype(jnp.float32))
        mask = opw.keep
    else:
        opw, anchor = None, old_logprobs
    corr, rs_keep = None, mask.astype(bool)
    if rollout_correction != "none":
        respf0 = response.astype(jnp.float32)
        if num_tokens is None:
            num_tokens = jnp.sum(respf0)
        if num_seqs is None:
            num_seqs = jnp.sum(jnp.any(response, axis=-1).astype(jnp.float32))
        corr = apply_rollout_correction(
            rollout_correction,
            proximal_logprobs=proximal_logprobs,
            behaviour_logprobs=old_logprobs,
            logprobs=logprobs,
            advantages=advantages,
            mask=response,
            low=rollout_correction_low,
            high=rollout_correction_high,
            cap=rollout_correction_cap,
            outlier=rollout_correction_outlier,
            delta=rollout_correction_delta,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        mask = mask.astype(bool) & corr.keep
    maskf = mask.astype(jnp.float32)

    log_ratio = logprobs - anchor
    # Clamp before exp(): the clipped objective never uses ratios past e^20 and the raw value
    # would overflow for a stale, very unlikely token.
    ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        dual = -advantages * dual_clip
        dual_hit = (advantages < 0) & (per_token > dual)
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, dual), per_token)
    else:
        dual_hit = jnp.zeros(per_token.shape, bool)
    if opw is not None and rollout_is != "none":
        per_token = per_token * opw.weights
    if rollout_correction in WEIGHTING_CORRECTIONS:
        per_token = per_token * corr.weights

    def tok_mean(x):
        return aggregate(x, maskf, "token-mean", num_tokens=num_tokens)

    pg_loss = aggregate(per_token, maskf, aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
    loss = pg_loss
    if ref_logprobs is not None:
        kl = aggregate(
            kl_estimate(logprobs, jax.lax.stop_gradient(ref_logprobs), kl_estimator),
            maskf,
            aggregation,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        loss = loss + kl_coef * kl
    else:
        kl = jnp.zeros((), jnp.float32)
    if entropy is not None:
        if isinstance(entropy_coef, (int, float)) and entropy_coef == 0:
            # A static zero weight: the entropy is a metric only. Without the stop_gradient the
            # backward pass would still run the entropy's [.., V] cotangent passes (x * 0 is not
            # simplified away for floats).
            ent = tok_mean(jax.lax.stop_gradient(entropy))
        else:
            ent = tok_mean(entropy)
            loss = loss - entropy_coef * ent
    else:
        ent = jnp.zeros((), jnp.float32)

    sg = jax.lax.stop_gradient
    ratio_sg = sg(ratio)
    adv_b = jnp.broadcast_to(advantages, ratio.shape)
    low = ((ratio_sg < 1.0 - clip_low) & (adv_b < 0)).astype(jnp.float32)
    high = ((ratio_sg > 1.0 + clip_high) & (adv_b > 0)).astype(jnp.float32)
    # k3 of KL(pi_old || pi) from pi_old samples: r - 1 - log r with r = pi / pi_old.
    d = jnp.clip(sg(log_ratio), -20.0, 20.0)
    respf = response.astype(jnp.float32)

    def resp_mean(x):  # over every response token, rejected ones included
        return aggregate(x, respf, "token-mean", num_tokens=num_tokens)

    if opw is not None:
        w, mism = opw.weights, opw.log_ratio
        clipped_is = opw.clipped.astype(jnp.float32)
    else:
        w, mism = jnp.ones_like(ratio_sg), jnp.zeros_like(ratio_sg)
        clipped_is = jnp.zeros_like(ratio_sg)
    if rollout_correction in WEIGHTING_CORRECTIONS:
        w = w * corr.weights
    zero = jnp.zeros((), jnp.float32)
    positive = jnp.where(adv_b > 0, adv_b, 0.0)
    delivered = (
        delivered_credit(
            positive, ratio_sg, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
        )
        * w
    )
    return PolicyLossTerms(
        loss=loss,
        pg_loss=pg_loss,
        entropy=sg(ent),
        kl=sg(kl),
        approx_kl=tok_mean(jnp.exp(d) - d - 1.0),
        clip_frac_low=tok_mean(low),
        clip_frac_high=tok_mean(high),
        dual_clip_frac=tok_mean(sg(dual_hit).astype(jnp.float32)),
        ratio_mean=tok_mean(ratio_sg),
        # k3 of KL(mu || pi_prox) from mu's samples, d = log pi_prox - log mu
        mismatch_kl=resp_mean(jnp.exp(mism) - mism - 1.0),
        is_frac_clipped=resp_mean(clipped_is),
        is_weight_mean=resp_mean(w),
        is_weight_sq_mean=resp_mean(w * w),
        rs_frac_rejected=resp_mean((response & ~rs_keep).astype(jnp.float32)),
        credit_positive=resp_mean(positive),
        credit_delivered=tok_mean(delivered),
        correction_token_frac=zero if corr is None else corr.token_frac,
        correction_seq_frac=zero if corr is None else corr.seq_frac,
    )
