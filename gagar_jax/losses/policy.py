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

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k3")


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


def aggregate(values: jax.Array, mask: jax.Array, mode: str = "token-mean", *,
              num_tokens: jax.Array | float | None = None,
              num_seqs: jax.Array | float | None = None) -> jax.Array:
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


def delivered_credit(advantages: jax.Array, ratio: jax.Array, *, clip_low: float = 0.2,
                     clip_high: float = 0.28, dual_clip: float | None = None) -> jax.Array:
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


class PolicyLossTerms(NamedTuple):
    loss: jax.Array            # [] total loss (pg + kl_coef * kl - entropy_coef * entropy)
    pg_loss: jax.Array         # [] aggregated clipped policy-gradient loss
    entropy: jax.Array         # [] token-mean entropy
    kl: jax.Array              # [] aggregated KL to the reference (0 when no reference)
    approx_kl: jax.Array       # [] token-mean k3 estimate of KL(pi_old || pi)
    clip_frac_low: jax.Array   # [] fraction of tokens clipped below (A < 0, ratio < 1 - eps_low)
    clip_frac_high: jax.Array  # [] fraction of tokens clipped above (A > 0, ratio > 1 + eps_high)
    dual_clip_frac: jax.Array  # [] fraction of tokens hit by the dual clip
    ratio_mean: jax.Array      # [] token-mean importance ratio


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                mask: jax.Array, entropy: jax.Array | None = None,
                ref_logprobs: jax.Array | None = None, *,
                clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None,
                aggregation: str = "token-mean", kl_coef: float = 0.0, kl_estimator: str = "k3",
                entropy_coef: float = 0.0, num_tokens=None, num_seqs=None) -> PolicyLossTerms:
    """Clipped surrogate policy-gradient loss with clip-higher and optional dual clip.

    Per token, with ``r = exp(log pi - log pi_old)``::

        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))        (PPO, DAPO clip-higher)
        l = min(l, -A c)  where A < 0                                 (dual clip, c > 1)

    then ``loss = agg(l) + kl_coef * agg(KL(pi || pi_ref)) - entropy_coef * token_mean(H)``.
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
    Returns:
      :class:`PolicyLossTerms` of scalars.
    """
    chex.assert_rank([logprobs, old_logprobs, mask], 2)
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
    maskf = mask.astype(jnp.float32)

    log_ratio = logprobs - old_logprobs
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

    def tok_mean(x):
        return aggregate(x, maskf, "token-mean", num_tokens=num_tokens)

    pg_loss = aggregate(per_token, maskf, aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
    loss = pg_loss
    if ref_logprobs is not None:
        kl = aggregate(kl_estimate(logprobs, jax.lax.stop_gradient(ref_logprobs), kl_estimator),
                       maskf, aggregation, num_tokens=num_tokens, num_seqs=num_seqs)
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
    )
