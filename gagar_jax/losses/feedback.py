"""Losses from user feedback spans: re-weighted SFT and span-level KTO (verification-signals paper).

Process-level feedback splits a response into contiguous, polarity-consistent spans (positive,
neutral, negative). Two objectives learn from them:

* **Re-weighted SFT** (:func:`rw_sft_loss`): cross-entropy with a float weight per token chosen by
  the polarity of the span the token is in, ``L = -E_t[w(p_t) log pi(y_t)]``.
* **Span-level KTO** (:func:`span_kto_loss`): each polar span ``S_k`` is one KTO example whose
  implicit reward is the summed log-ratio to a frozen reference policy,
  ``r_k = sum_{t in S_k} (log pi(y_t) - log pi_ref(y_t))``, judged against a reference point
  ``z_ref``: ``l_k = -lambda_w sigmoid(beta (r_k - z_ref))`` for positive spans and
  ``-lambda_l sigmoid(-beta (r_k - z_ref))`` for negative ones; neutral spans keep a plain
  cross-entropy term. The paper's reference point is an online EMA of the batch's span rewards.

Reference-point modes (``reference_point``), so the three published choices can be compared:

* ``ema`` (the paper): ``a_k = r_k - z_ref`` with the *incoming* ``z_ref``; then
  ``new_z_ref = alpha z_ref + (1 - alpha) mean_k r_k`` over the batch's polar spans.
* ``batch_kl`` (TRL ``KTOTrainer``): ``z_ref`` is this batch's clamped mean log-ratio of
  *mismatched* (prompt, completion) pairs, computed by :func:`kto_kl_reference_point` and passed
  in; it is returned unchanged as ``new_z_ref`` (kept in the train state for logging only).
* ``cumulative`` (TRL ``BCOTrainer``'s ``RunningMoments``): a running mean of the per-batch mean
  span reward over all batches so far, *including* this one (TRL updates before it uses it);
  the count of batches lives beside ``z_ref`` (``ref_count`` in, ``metrics["ref_count"]`` out).
  TRL's BCO keeps ``delta`` in ``beta``-scaled units; here ``z_ref = delta / beta`` so the same
  ``beta (r - z_ref)`` form serves every mode.

Span layout: ``span_ids[n, t]`` is the index ``k`` (``0 <= k < S``) of the span of row ``n`` that
token ``t`` belongs to, or ``-1`` for tokens in no span (prompt, observations, padding, and
response tokens without feedback); ``span_polarity[n, k]`` is that span's polarity. A span slot
that owns no token (row padding of the ``[N, S]`` array) does not exist, whatever its polarity.
Span sums are one ``jax.ops.segment_sum`` over ``N * S`` flat segments (no Python loop over
spans or rows). Tokens in no span are selected away with ``jnp.where`` before any arithmetic, so
even a NaN or ``-inf`` log-prob there changes neither the loss nor the gradient.

Sharding: every reduction is over the global ``[N, T]`` arrays inside ``jit``, so with the batch
sharded over devices the means (loss normalisers and the ``z_ref`` update) are global-batch
means; GSPMD inserts the all-reduces. Pass ``num_polar_spans`` / ``num_neutral_tokens`` /
``num_tokens`` (the mini-batch totals) to sum micro-batch losses into the mini-batch loss, as
``gagar_jax.losses.policy`` does for ``num_tokens``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from gagar_jax.losses.policy import aggregate

REFERENCE_POINTS = ("ema", "batch_kl", "cumulative")
REWARD_NORMS = ("sum", "mean_per_token")
POSITIVE, NEUTRAL, NEGATIVE = 1, 0, -1


def polarity_weights(polarity: jax.Array, *, w_pos: float, w_neu: float, w_neg: float) -> jax.Array:
    """Float weight of each token from its polarity: ``w_pos`` / ``w_neu`` / ``w_neg``.

    Args:
      polarity: [N, T] int, -1 / 0 / +1 (the sign decides: any positive value is positive).
    Returns:
      [N, T] float32 (never cast to an integer mask: ``w_neg = -0.5`` stays ``-0.5``).
    """
    w = jnp.where(
        polarity > 0,
        jnp.float32(w_pos),
        jnp.where(polarity < 0, jnp.float32(w_neg), jnp.float32(w_neu)),
    )
    return w.astype(jnp.float32)


def rw_sft_loss(
    logprobs: jax.Array,
    polarity: jax.Array,
    mask: jax.Array,
    *,
    w_pos: float,
    w_neu: float,
    w_neg: float,
    num_tokens: jax.Array | float | None = None,
):
    """Re-weighted SFT: ``loss = -sum_t mask_t w(p_t) log pi_t / sum_t mask_t``.

    The paper's ``L_RW-SFT = -E_t[w(p_t) log pi(y_t | x, y_<t)]`` with the expectation over the
    trained (masked) tokens. The denominator counts every masked token whatever its weight, so
    all-ones weights give plain token-mean cross-entropy bit for bit
    (``aggregate(-logprobs, mask, "token-mean")``), ``w_neg = 0`` keeps negative tokens in the
    denominator (unlike dropping them), and a negative ``w_neg`` pushes their probability down.

    Args:
      logprobs: [N, T] float32 log-probabilities of the target tokens (differentiated).
      polarity: [N, T] int in {-1, 0, +1}: polarity of the span each token is in (0 outside
        any span).
      mask: [N, T] bool, True on tokens to train on (response tokens).
      w_pos, w_neu, w_neg: weights of positive / neutral / negative tokens.
      num_tokens: the normaliser (default ``sum(mask)``; the mini-batch count when accumulating).
    Returns:
      ``(loss [] float32, metrics)``; metrics: ``rw_sft_loss``, ``ce`` (unweighted token-mean
      cross-entropy), ``tokens_pos|neu|neg`` (masked token counts), ``logp_pos|neu|neg`` (mean
      log-prob of each polarity's masked tokens, 0 where there are none).
    """
    chex.assert_rank([logprobs, polarity, mask], 2)
    chex.assert_equal_shape([logprobs, polarity, mask])
    logprobs = logprobs.astype(jnp.float32)
    w = polarity_weights(polarity, w_pos=w_pos, w_neu=w_neu, w_neg=w_neg)
    maskb = mask.astype(bool)
    # Masked-out tokens are selected away first: a NaN/-inf log-prob on padding stays out.
    loss = aggregate(
        jnp.where(maskb, -(w * logprobs), 0.0), mask, "token-mean", num_tokens=num_tokens
    )
    sg = jax.lax.stop_gradient
    metrics = {
        "rw_sft_loss": sg(loss),
        "ce": sg(
            aggregate(jnp.where(maskb, -logprobs, 0.0), mask, "token-mean", num_tokens=num_tokens)
        ),
    }
    for name, sel in (("pos", polarity > 0), ("neu", polarity == 0), ("neg", polarity < 0)):
        m = maskb & sel
        n = jnp.sum(m.astype(jnp.float32))
        metrics[f"tokens_{name}"] = n
        metrics[f"logp_{name}"] = sg(jnp.sum(jnp.where(m, logprobs, 0.0)) / jnp.maximum(n, 1.0))
    return loss, metrics


def span_rewards(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    span_ids: jax.Array,
    num_spans: int,
    *,
    reward_norm: str = "sum",
):
    """Per-span implicit rewards ``r_k = sum_{t in S_k} (log pi_t - log pi_ref_t)`` (segment sums).

    Args:
      logprobs: [N, T] float32 policy log-probs (differentiated).
      ref_logprobs: [N, T] float32 frozen-reference log-probs (stop-gradient applied here).
      span_ids: [N, T] int, span index in [0, S) or -1 (no span).
      num_spans: S, the static width of the ``[N, S]`` span arrays.
      reward_norm: ``sum`` (the paper) or ``mean_per_token`` (the sum over the span's length;
        long spans otherwise saturate the sigmoid).
    Returns:
      ``(rewards [N, S] float32, counts [N, S] float32 tokens per span)``.
    """
    chex.assert_rank([logprobs, ref_logprobs, span_ids], 2)
    chex.assert_equal_shape([logprobs, ref_logprobs, span_ids])
    if reward_norm not in REWARD_NORMS:
        raise ValueError(f"reward_norm must be one of {REWARD_NORMS}, got {reward_norm!r}")
    n, _ = logprobs.shape
    s = int(num_spans)
    in_span = (span_ids >= 0) & (span_ids < s)
    # One flat segment per (row, span); every token in no span goes to a spare last segment.
    seg = jnp.where(in_span, jnp.arange(n, dtype=jnp.int32)[:, None] * s + span_ids, n * s)
    ratio = jnp.where(
        in_span,
        logprobs.astype(jnp.float32) - jax.lax.stop_gradient(ref_logprobs.astype(jnp.float32)),
        0.0,
    )
    sums = jax.ops.segment_sum(ratio.reshape(-1), seg.reshape(-1), num_segments=n * s + 1)
    counts = jax.ops.segment_sum(
        in_span.reshape(-1).astype(jnp.float32), seg.reshape(-1), num_segments=n * s + 1
    )
    sums, counts = sums[:-1].reshape(n, s), counts[:-1].reshape(n, s)
    if reward_norm == "mean_per_token":
        sums = sums / jnp.maximum(counts, 1.0)  # an empty span slot stays 0
    return sums, counts


def kto_kl_reference_point(
    kl_logprobs: jax.Array,
    kl_ref_logprobs: jax.Array,
    kl_mask: jax.Array,
    *,
    reward_norm: str = "sum",
) -> jax.Array:
    """TRL KTO's reference point ``clamp(mean_i sum_t (log pi - log pi_ref), min=0)``, no gradient.

    The rows are *mismatched* pairs (row i's prompt with another row's completion, TRL's
    ``KL_completion``); the mean is over the rows with at least one masked token (the global
    batch under sharding, as TRL's ``gather_for_metrics(kl).mean()``).

    Args:
      kl_logprobs, kl_ref_logprobs: [M, T] float32 log-probs of the mismatched completions.
      kl_mask: [M, T] bool, True on the completion tokens.
      reward_norm: ``sum`` (TRL) or ``mean_per_token`` (per-row mean, matching that span
        normalisation).
    Returns:
      [] float32 >= 0.
    """
    chex.assert_rank([kl_logprobs, kl_ref_logprobs, kl_mask], 2)
    chex.assert_equal_shape([kl_logprobs, kl_ref_logprobs, kl_mask])
    m = kl_mask.astype(bool)
    ratio = jnp.where(m, kl_logprobs.astype(jnp.float32) - kl_ref_logprobs.astype(jnp.float32), 0.0)
    per_row = jnp.sum(ratio, axis=-1)
    counts = jnp.sum(m.astype(jnp.float32), axis=-1)
    if reward_norm == "mean_per_token":
        per_row = per_row / jnp.maximum(counts, 1.0)
    rows = (counts > 0).astype(jnp.float32)
    kl = jnp.sum(per_row * rows) / jnp.maximum(jnp.sum(rows), 1.0)
    return jax.lax.stop_gradient(jnp.maximum(kl, 0.0))


def span_kto_loss(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    span_ids: jax.Array,
    span_polarity: jax.Array,
    z_ref: jax.Array,
    *,
    beta: float,
    lambda_w: float,
    lambda_l: float,
    alpha: float,
    neutral_coef: float,
    reference_point: str = "ema",
    reward_norm: str = "sum",
    ref_count: jax.Array | None = None,
    num_polar_spans: jax.Array | float | None = None,
    num_neutral_tokens: jax.Array | float | None = None,
):
    """Span-level KTO with an online reference point, plus cross-entropy on neutral spans.

    ::

        r_k = sum_{t in S_k} (log pi_t - log pi_ref_t)          (segment sums; / |S_k| if
                                                                  reward_norm="mean_per_token")
        a_k = r_k - z                                            (z: no gradient)
        l_k = -lambda_w sigmoid(beta a_k)    if p_k = +1
              -lambda_l sigmoid(-beta a_k)   if p_k = -1
        loss = mean_{polar k} l_k + neutral_coef * (-mean_{t in neutral spans} log pi_t)

    An empty part (no polar span, no neutral token) contributes 0. ``z`` is ``z_ref`` itself for
    ``ema`` and ``batch_kl``, and the running mean after this batch's update for ``cumulative``
    (module docstring). ``new_z_ref = alpha z_ref + (1 - alpha) mean_{polar k} r_k`` for ``ema``
    (unchanged when the batch has no polar span).

    Args:
      logprobs: [N, T] float32 policy log-probs of the target tokens (differentiated).
      ref_logprobs: [N, T] float32 frozen-reference log-probs (no gradient).
      span_ids: [N, T] int, span index in [0, S) or -1 for tokens in no span.
      span_polarity: [N, S] int in {-1, 0, +1}, polarity of each span slot.
      z_ref: [] float32 incoming reference point (no gradient).
      beta: KTO temperature (> 0).
      lambda_w, lambda_l: weights of positive (desirable) and negative (undesirable) spans.
      alpha: EMA decay of the reference point, in [0, 1].
      neutral_coef: weight of the neutral cross-entropy term.
      reference_point: ``ema`` | ``batch_kl`` | ``cumulative``.
      reward_norm: ``sum`` | ``mean_per_token``.
      ref_count: [] float32 batches averaged so far (``cumulative`` only; default 0).
      num_polar_spans, num_neutral_tokens: normalisers (default: this batch's counts; pass the
        mini-batch totals when accumulating micro-batches).
    Returns:
      ``(loss [] float32, new_z_ref [] float32, metrics)``; metrics (all scalars, no gradient):
      ``pref_loss``, ``neutral_loss``, ``num_pos_spans``, ``num_neg_spans``,
      ``num_neutral_tokens``, ``reward_pos_mean``, ``reward_neg_mean``, ``polar_reward_sum``,
      ``z_used`` (the point the advantages used), ``new_z_ref``, ``ref_count`` (batches counted
      by the ``cumulative`` mean; passed through otherwise), ``pos_win_rate`` / ``neg_win_rate``
      (fraction of positive spans with ``a > 0`` / negative spans with ``a < 0``).
    """
    chex.assert_rank([logprobs, ref_logprobs, span_ids, span_polarity], 2)
    chex.assert_equal_shape([logprobs, ref_logprobs, span_ids])
    chex.assert_axis_dimension(span_polarity, 0, logprobs.shape[0])
    chex.assert_rank(z_ref, 0)
    if reference_point not in REFERENCE_POINTS:
        raise ValueError(
            f"reference_point must be one of {REFERENCE_POINTS}, got {reference_point!r}"
        )
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    sg = jax.lax.stop_gradient
    f32 = jnp.float32
    s = span_polarity.shape[1]
    rewards, counts = span_rewards(logprobs, ref_logprobs, span_ids, s, reward_norm=reward_norm)
    exists = counts > 0
    pos = exists & (span_polarity > 0)
    neg = exists & (span_polarity < 0)
    polar = pos | neg
    n_pos, n_neg = jnp.sum(pos.astype(f32)), jnp.sum(neg.astype(f32))
    n_polar = n_pos + n_neg
    r_sg = sg(rewards)
    polar_sum = jnp.sum(jnp.where(polar, r_sg, 0.0))
    batch_mean = polar_sum / jnp.maximum(n_polar, 1.0)
    has_polar = n_polar > 0
    z_in = sg(jnp.asarray(z_ref, f32))
    count_in = jnp.zeros((), f32) if ref_count is None else sg(jnp.asarray(ref_count, f32))

    if reference_point == "cumulative":
        # TRL RunningMoments over per-batch means, updated before use; a batch without polar
        # spans adds nothing.
        count_out = count_in + has_polar.astype(f32)
        z_used = jnp.where(
            has_polar, z_in + (batch_mean - z_in) / jnp.maximum(count_out, 1.0), z_in
        )
        new_z = z_used
    else:
        count_out = count_in
        z_used = z_in
        if reference_point == "ema":
            new_z = jnp.where(has_polar, alpha * z_in + (1.0 - alpha) * batch_mean, z_in)
        else:  # batch_kl: the point is this batch's own, recomputed every step
            new_z = z_in

    adv = rewards - z_used
    per_span = jnp.where(
        pos,
        -lambda_w * jax.nn.sigmoid(beta * adv),
        jnp.where(neg, -lambda_l * jax.nn.sigmoid(-beta * adv), 0.0),
    )
    denom_polar = n_polar if num_polar_spans is None else num_polar_spans
    pref_loss = jnp.sum(per_span) / jnp.maximum(jnp.asarray(denom_polar, f32), 1.0)

    in_span = (span_ids >= 0) & (span_ids < s)
    tok_pol = jnp.take_along_axis(span_polarity, jnp.clip(span_ids, 0, s - 1), axis=1)
    neutral_tok = in_span & (tok_pol == 0)
    n_neu = jnp.sum(neutral_tok.astype(f32))
    denom_neu = n_neu if num_neutral_tokens is None else num_neutral_tokens
    neutral_loss = -jnp.sum(jnp.where(neutral_tok, logprobs.astype(f32), 0.0)) / jnp.maximum(
        jnp.asarray(denom_neu, f32), 1.0
    )

    loss = pref_loss + neutral_coef * neutral_loss
    adv_sg = sg(adv)
    metrics = {
        "pref_loss": sg(pref_loss),
        "neutral_loss": sg(neutral_loss),
        "num_pos_spans": n_pos,
        "num_neg_spans": n_neg,
        "num_neutral_tokens": n_neu,
        "reward_pos_mean": jnp.sum(jnp.where(pos, r_sg, 0.0)) / jnp.maximum(n_pos, 1.0),
        "reward_neg_mean": jnp.sum(jnp.where(neg, r_sg, 0.0)) / jnp.maximum(n_neg, 1.0),
        "polar_reward_sum": polar_sum,
        "z_used": z_used,
        "new_z_ref": new_z,
        "ref_count": count_out,
        "pos_win_rate": jnp.sum((pos & (adv_sg > 0)).astype(f32)) / jnp.maximum(n_pos, 1.0),
        "neg_win_rate": jnp.sum((neg & (adv_sg < 0)).astype(f32)) / jnp.maximum(n_neg, 1.0),
    }
    return loss, new_z, metrics
