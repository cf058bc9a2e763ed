"""The rollout-correction toolbox: masks and weights on the trainer/rollout mismatch.

The sampler that drew a batch (``mu``: another engine, another precision, older weights) and
the trainer that scores it (``pi``) never agree exactly. Each function here turns the two
log-probabilities of the sampled tokens into per-token loss weights and a keep mask; one is
chosen by ``UpdateConfig.rollout_correction`` (the run config's ``learner.rollout_correction``)
and applied on top of today's truncated IS and rejection (``rollout_is`` / ``rollout_rs`` of
:func:`gagar_jax.losses.off_policy_weights`):

================== ======================================================================
choice             per response token ``t`` of a sequence, ``r_t = pi_prox(y_t) / mu(y_t)``
================== ======================================================================
``icepop``         IcePop (Ring-1T): masked IS, weight ``r_t`` where ``low <= r_t <= high``,
                   the token masked (weight 0) outside that band, on both sides
``seq_mask_tis``   sequence-masked TIS: weight ``min(r_t, cap)``; a sequence whose
                   geometric-mean ratio ``exp(mean_t log r_t)`` lies outside
                   ``[low, high]`` is masked whole
``outlier_token``  outlier tokens masked: ``|log r_t| > log(outlier)`` (ratio outside
                   ``[1 / outlier, outlier]``)
``outlier_veto``   the same outliers veto their whole sequence (verl's token veto)
``tv_trust_region`` a binary total-variation trust region (DPPO style): with
                   ``tv_t = |pi(y_t) - mu(y_t)|`` (the total variation between the two
                   policies' Bernoulli distributions over "this token or another"), a token
                   is masked where ``tv_t > delta`` and its advantage pushes ``pi`` further
                   from ``mu`` (``A > 0`` and ``pi > mu``, or ``A < 0`` and ``pi < mu``);
                   ``pi`` is the current policy (no gradient through the mask)
================== ======================================================================

Every function is pure JAX (jittable, no Python control flow on values), takes ``[B, T]``
arrays with a response ``mask``, and returns a :class:`Correction`: the weights (1 where the
choice does not weight), the keep mask (a subset of ``mask``) and the fractions of response
tokens and of sequences it masked. At ``r = 1`` everywhere (``pi_prox == mu``) every choice
keeps every token with weight 1, for every valid setting; an empty ``mask`` gives fractions 0,
never NaN. ``tests/rollout_correction_reference.py`` holds the loop-by-loop NumPy reference.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

ROLLOUT_CORRECTIONS = (
    "none",
    "icepop",
    "seq_mask_tis",
    "outlier_token",
    "outlier_veto",
    "tv_trust_region",
)
# The choices that weight tokens (an importance weight, as ``rollout_is`` does): they need the
# decoupled objective (the clip around pi_prox), and exclude ``rollout_is``.
WEIGHTING_CORRECTIONS = ("icepop", "seq_mask_tis")
# Log-ratios are clamped here before exp(): past e^20 every setting has masked or truncated.
_CLAMP = 20.0


class Correction(NamedTuple):
    """One correction of a micro-batch."""

    weights: jax.Array  # [B, T] float32 loss weight of each token (1: not weighted; 0 off-mask)
    keep: jax.Array  # [B, T] bool, response tokens the correction keeps
    token_frac: jax.Array  # [] masked response tokens / num_tokens
    seq_frac: jax.Array  # [] sequences with a masked response token / num_seqs


def masked_fractions(keep, mask, *, num_tokens=None, num_seqs=None):
    """(masked tokens / ``num_tokens``, sequences with a masked token / ``num_seqs``).

    ``num_tokens`` / ``num_seqs`` default to the response tokens and the sequences with at
    least one (pass the mini-batch's counts when accumulating micro-batches: the sums then add
    up exactly); a denominator of 0 gives 0, not NaN.
    """
    mask = mask.astype(bool)
    dropped = mask & ~keep.astype(bool)
    if num_tokens is None:
        num_tokens = jnp.sum(mask.astype(jnp.float32))
    if num_seqs is None:
        num_seqs = jnp.sum(jnp.any(mask, axis=-1).astype(jnp.float32))
    tok = jnp.sum(dropped.astype(jnp.float32)) / jnp.maximum(num_tokens, 1.0)
    seq = jnp.sum(jnp.any(dropped, axis=-1).astype(jnp.float32)) / jnp.maximum(num_seqs, 1.0)
    return tok, seq


def _log_ratio(proximal_logprobs, behaviour_logprobs, mask):
    chex.assert_rank([proximal_logprobs, behaviour_logprobs, mask], 2)
    chex.assert_equal_shape([proximal_logprobs, behaviour_logprobs, mask])
    d = jax.lax.stop_gradient(
        proximal_logprobs.astype(jnp.float32) - behaviour_logprobs.astype(jnp.float32)
    )
    return jnp.where(mask.astype(bool), jnp.clip(d, -_CLAMP, _CLAMP), 0.0)


def _finish(weights, keep, mask, num_tokens, num_seqs) -> Correction:
    mask = mask.astype(bool)
    keep = keep & mask
    tok, seq = masked_fractions(keep, mask, num_tokens=num_tokens, num_seqs=num_seqs)
    return Correction(
        weights=jnp.where(keep, weights, 0.0).astype(jnp.float32),
        keep=keep,
        token_frac=tok,
        seq_frac=seq,
    )


def _check_band(low, high, what):
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"{what}: need 0 <= low <= 1 <= high, got [{low}, {high}]")


def icepop(
    proximal_logprobs,
    behaviour_logprobs,
    mask,
    *,
    low=0.5,
    high=2.0,
    num_tokens=None,
    num_seqs=None,
) -> Correction:
    """IcePop: masked importance sampling, ``w_t = r_t`` on tokens with
    ``low <= r_t <= high`` and 0 (masked) outside that band, on either side.

    Args:
      proximal_logprobs: [B, T] trainer log-probs of the sampled tokens (no gradient).
      behaviour_logprobs: [B, T] the rollout engine's.
      mask: [B, T] bool, response tokens.
      low, high: the band, ``0 <= low <= 1 <= high``.
      num_tokens, num_seqs: normalisers of the fractions (:func:`masked_fractions`).
    """
    _check_band(low, high, "icepop")
    d = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    r = jnp.exp(d)
    keep = (r >= low) & (r <= high)
    return _finish(r, keep, mask, num_tokens, num_seqs)


def seq_mask_tis(
    proximal_logprobs,
    behaviour_logprobs,
    mask,
    *,
    low=0.5,
    high=2.0,
    cap=2.0,
    num_tokens=None,
    num_seqs=None,
) -> Correction:
    """Sequence-masked TIS: token weights ``min(r_t, cap)``, and every token of a sequence
    whose geometric-mean ratio ``exp(sum_t log r_t / n)`` (over its ``n`` response tokens) is
    outside ``[low, high]`` masked.

    Args: as :func:`icepop`, with ``cap >= 1`` the truncation of the token weights.
    """
    _check_band(low, high, "seq_mask_tis")
    if not cap >= 1.0:
        raise ValueError(f"seq_mask_tis: cap must be >= 1, got {cap}")
    d = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    n = jnp.maximum(jnp.sum(mask.astype(jnp.float32), axis=-1, keepdims=True), 1.0)
    geo = jnp.exp(jnp.sum(d, axis=-1, keepdims=True) / n)
    keep = jnp.broadcast_to((geo >= low) & (geo <= high), d.shape)
    return _finish(jnp.minimum(jnp.exp(d), cap), keep, mask, num_tokens, num_seqs)


def outlier_mask(
    proximal_logprobs,
    behaviour_logprobs,
    mask,
    *,
    threshold=20.0,
    veto=False,
    num_tokens=None,
    num_seqs=None,
) -> Correction:
    """Outlier tokens: ratio outside ``[1 / threshold, threshold]`` (``|log r| > log
    threshold``). ``veto=False`` masks those tokens; ``veto=True`` masks every token of a
    sequence that holds one. Weights 1.

    Args: as :func:`icepop`, with ``threshold > 1``.
    """
    if not threshold > 1.0:
        raise ValueError(f"outlier mask: threshold must be > 1, got {threshold}")
    d = _log_ratio(proximal_logprobs, behaviour_logprobs, mask)
    out = (jnp.abs(d) > jnp.log(jnp.float32(threshold))) & mask.astype(bool)
    if veto:
        out = jnp.broadcast_to(jnp.any(out, axis=-1, keepdims=True), d.shape)
    return _finish(jnp.ones_like(d), ~out, mask, num_tokens, num_seqs)


def tv_trust_region(
    logprobs,
    behaviour_logprobs,
    advantages,
    mask,
    *,
    delta=0.2,
    num_tokens=None,
    num_seqs=None,
) -> Correction:
    """A binary total-variation trust region (DPPO style) around the rollout policy.

    ``tv_t = |pi(y_t) - mu(y_t)|`` is the total variation between the Bernoulli distributions
    "token ``y_t`` or another" under the two policies (a lower bound on the full one). A token
    is masked where ``tv_t > delta`` *and* its advantage would push ``pi`` further out
    (``A > 0`` with ``pi > mu``, ``A < 0`` with ``pi < mu``); a token whose gradient pulls
    ``pi`` back towards ``mu`` is kept, as PPO's clip keeps it. Weights 1.

    Args:
      logprobs: [B, T] the current policy's log-probs (no gradient through the mask).
      behaviour_logprobs: [B, T] the rollout engine's.
      advantages: [B, T] or [B] (broadcast over tokens).
      mask: [B, T] bool response tokens.
      delta: the trust region's radius in ``[0, 1]``.
      num_tokens, num_seqs: normalisers of the fractions.
    """
    if not 0.0 <= delta <= 1.0:
        raise ValueError(f"tv_trust_region: delta must be in [0, 1], got {delta}")
    chex.assert_equal_shape([logprobs, behaviour_logprobs, mask])
    sg = jax.lax.stop_gradient
    p = jnp.exp(sg(logprobs.astype(jnp.float32)))
    q = jnp.exp(behaviour_logprobs.astype(jnp.float32))
    a = sg(jnp.asarray(advantages, jnp.float32))
    if a.ndim == 1:
        a = a[:, None]
    a = jnp.broadcast_to(a, p.shape)
    outward = ((a > 0) & (p > q)) | ((a < 0) & (p < q))
    keep = ~((jnp.abs(p - q) > delta) & outward)
    return _finish(jnp.ones_like(p), keep, mask, num_tokens, num_seqs)


def apply_rollout_correction(
    kind: str,
    *,
    proximal_logprobs,
    behaviour_logprobs,
    logprobs,
    advantages,
    mask,
    low=0.5,
    high=2.0,
    cap=2.0,
    outlier=20.0,
    delta=0.2,
    num_tokens=None,
    num_seqs=None,
) -> Correction:
    """The correction ``kind`` (one of :data:`ROLLOUT_CORRECTIONS`) with its settings.

    ``"none"`` keeps every response token with weight 1. ``logprobs`` (the current policy's)
    and ``advantages`` are read by ``tv_trust_region`` only; the others compare
    ``proximal_logprobs`` with ``behaviour_logprobs``.
    """
    if kind not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout_correction must be one of {ROLLOUT_CORRECTIONS}, got {kind!r}")
    norm = dict(num_tokens=num_tokens, num_seqs=num_seqs)
    if kind == "icepop":
        return icepop(proximal_logprobs, behaviour_logprobs, mask, low=low, high=high, **norm)
    if kind == "seq_mask_tis":
        return seq_mask_tis(
            proximal_logprobs, behaviour_logprobs, mask, low=low, high=high, cap=cap, **norm
        )
    if kind in ("outlier_token", "outlier_veto"):
        return outlier_mask(
            proximal_logprobs,
            behaviour_logprobs,
            mask,
            threshold=outlier,
            veto=kind == "outlier_veto",
            **norm,
        )
    if kind == "tv_trust_region":
        return tv_trust_region(logprobs, behaviour_logprobs, advantages, mask, delta=delta, **norm)
    mask = mask.astype(bool)
    return _finish(jnp.ones(mask.shape, jnp.float32), mask, mask, num_tokens, num_seqs)


def check_correction_settings(kind, *, low, high, cap, outlier, delta, prefix="") -> None:
    """Raises a ``ValueError`` naming the field (with ``prefix``) for a setting that cannot
    work with ``kind``: an unknown choice, a band without 1 in it, a cap below 1, an outlier
    threshold of 1 or less, a radius outside ``[0, 1]``."""
    if kind not in ROLLOUT_CORRECTIONS:
        raise ValueError(
            f"{prefix}rollout_correction must be one of {ROLLOUT_CORRECTIONS}, got {kind!r}"
        )
    if kind in ("icepop", "seq_mask_tis") and not 0.0 <= low <= 1.0 <= high:
        raise ValueError(
            f"{prefix}rollout_correction_low <= 1 <= {prefix}rollout_correction_high "
            f"(and low >= 0) expected for {kind!r}, got [{low}, {high}]"
        )
    if kind == "seq_mask_tis" and not cap >= 1.0:
        raise ValueError(f"{prefix}rollout_correction_cap must be >= 1, got {cap}")
    if kind in ("outlier_token", "outlier_veto") and not outlier > 1.0:
        raise ValueError(f"{prefix}rollout_correction_outlier must be > 1, got {outlier}")
    if kind == "tv_trust_region" and not 0.0 <= delta <= 1.0:
        raise ValueError(f"{prefix}rollout_correction_delta must be in [0, 1], got {delta}")
