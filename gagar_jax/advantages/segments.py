"""Episode credit over linked segments: one episode trained as several rows.

A harness that edits its own history (a compaction, a sub-agent, a template that drops old
reasoning) leaves an episode as `S_e >= 1` segments, each a row of the batch with its own prompt
and its own model tokens. The episode is still one rollout of its group: its reward enters the
group statistics once, and the advantage `A_e` that Gagar's sum-preserving redistribution gives
it reaches every one of its segments:

    A_s = A_{e(s)}                                   (segment_advantages)

With the token-mean loss an episode's credit is `sum over its model tokens of A_t`: broadcast,
that is `A_e |M_e|` whether the episode is one row or several, since the segments' model tokens
partition the episode's. Token-level credit (`redistribute_tokens`) conserves each row's sum,
so per-segment redistribution conserves the episode's too, but centres and scales the
importance per segment. `redistribute_segment_tokens` instead takes the statistics over the
episode's masked tokens across all its segments (segment sums over the rows of one episode), so
every token gets the weight it would get were the episode one row:

    w_bar_e = sum_{t in M_e} o_t w_t / sum_{t in M_e} o_t,   M_e = union of its segments' masks
    z_t = (w_t - w_bar_e) / max_{u in M_e} |w_u - w_bar_e|,  A_t = A_e (1 + gamma z_t)

Conservation, signs, order and the bound of `redistribute_tokens` hold per episode; with one
segment per episode both functions are the same. Layout: flat rows `[S, T]` with
`segment_episode [S]` in `[0, num_episodes)` (static), like the flat form of the other kernels.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from gagar_jax.advantages import _layout
from gagar_jax.advantages.tokens import NEGATIVE_MODES, _check_gamma

Array = jax.Array


def _check_ids(segment_episode, num_episodes: int, rows: int) -> Array:
    if isinstance(num_episodes, bool) or not isinstance(num_episodes, int) or num_episodes < 1:
        raise ValueError(f"num_episodes: expected a static int >= 1, got {num_episodes!r}")
    ids = _layout.check_int("segment_episode", segment_episode)
    if ids.shape != (rows,):
        raise ValueError(f"segment_episode: expected shape [{rows}], got {list(ids.shape)}")
    if _layout.is_concrete(ids):
        v = np.asarray(ids)
        if v.size and (v.min() < 0 or v.max() >= num_episodes):
            raise ValueError(
                f"segment_episode: expected values in [0, {num_episodes}), got "
                f"[{v.min()}, {v.max()}]"
            )
    return ids


def segment_advantages(episode_advantages: Array, segment_episode: Array) -> Array:
    """Each segment's advantage: its episode's, `A_s = A_{e(s)}`.

    Args:
      episode_advantages: [E] float32, one advantage per episode (e.g. the flattened
        `gagar_advantages(...).advantages`).
      segment_episode: [S] int, the episode of each segment, in [0, E).

    Returns:
      [S] float32.
    """
    adv = _layout.check_float("episode_advantages", episode_advantages)
    chex.assert_rank(adv, 1)
    segment_episode = jnp.asarray(segment_episode)
    ids = _check_ids(segment_episode, adv.shape[0], segment_episode.shape[0])
    return adv[ids]


@functools.partial(jax.jit, static_argnames=("num_episodes", "gamma", "negative"))
def _redistribute(seq, imp, mask, ids, ow, *, num_episodes, gamma, negative):
    e = num_episodes
    w = jnp.where(mask & jnp.isfinite(imp), jnp.maximum(imp, 0.0), 0.0)
    o = mask.astype(jnp.float32) if ow is None else jnp.where(mask & jnp.isfinite(ow), ow, 0.0)
    o = jnp.maximum(o, 0.0)
    o_sum = jax.ops.segment_sum(jnp.sum(o, axis=-1), ids, num_segments=e)
    row_hi = jnp.max(jnp.where(mask, w, -jnp.inf), axis=-1, initial=-jnp.inf)
    row_lo = jnp.min(jnp.where(mask, w, jnp.inf), axis=-1, initial=jnp.inf)
    # An episode without masked tokens has -inf / +inf here: guarded below as in tokens.py.
    w_hi = jax.ops.segment_max(row_hi, ids, num_segments=e)
    w_lo = jax.ops.segment_min(row_lo, ids, num_segments=e)
    lo = w_lo[ids]
    # Deviations from the episode's minimum first (see tokens._credit_weights: exact spreads).
    s = jnp.where(mask, w - jnp.where(jnp.isfinite(lo), lo, 0.0)[:, None], 0.0)
    s_bar = jax.ops.segment_sum(jnp.sum(o * s, axis=-1), ids, num_segments=e)
    s_bar = s_bar / jnp.where(o_sum > 0, o_sum, 1.0)
    dev = jnp.where(mask, s - s_bar[ids][:, None], 0.0)
    row_scale = jnp.max(jnp.abs(dev), axis=-1, initial=0.0)
    scale = jax.ops.segment_max(row_scale, ids, num_segments=e)
    varies = (w_hi > w_lo) & (o_sum > 0)
    z = jnp.clip(dev / jnp.where(varies, scale, 1.0)[ids][:, None], -1.0, 1.0)
    z = jnp.where(varies[ids][:, None] & mask, z, 0.0)
    c = 1.0 + gamma * z
    a = seq[ids]
    apply = a > 0 if negative == "broadcast" else a != 0
    c = jnp.where(apply[:, None], c, 1.0)
    return (a[:, None] * c) * mask.astype(jnp.float32)


def redistribute_segment_tokens(
    episode_advantages: Array,
    importance: Array,
    mask: Array,
    segment_episode: Array,
    *,
    gamma: float,
    token_weights: Array | None = None,
    negative: str = "broadcast",
) -> Array:
    """`redistribute_tokens` with each episode's statistics over all of its segments.

    Args:
      episode_advantages: [E] float32, one advantage per episode.
      importance: [S, T] float32 >= 0, token importance of each segment row.
      mask: [S, T] bool, the model tokens of each segment (response mask).
      segment_episode: [S] int in [0, E), the episode of each row.
      gamma: static float in [0, 1] (see `redistribute_tokens`).
      token_weights: optional [S, T] float32 >= 0, the loss's per-token weights `o_t`.
      negative: "broadcast" or "redistribute" (see `redistribute_tokens`).

    Returns:
      [S, T] float32 token advantages: `A_t = A_e (1 + gamma z_t)` on the mask, 0 off it, with
      `sum_{t in M_e} o_t A_t = A_e sum_{t in M_e} o_t` for every episode.
    """
    gamma = _check_gamma(gamma)
    if negative not in NEGATIVE_MODES:
        raise ValueError(f"negative: expected one of {NEGATIVE_MODES}, got {negative!r}")
    seq = _layout.check_float("episode_advantages", episode_advantages)
    chex.assert_rank(seq, 1)
    m = _layout.check_bool("mask", mask)
    if m.ndim != 2:
        raise ValueError(f"mask: expected [S, T], got shape {list(m.shape)}")
    imp = _layout.check_float("importance", importance)
    _layout.check_shape("importance", imp, m.shape, "mask.shape")
    ow = None
    if token_weights is not None:
        ow = _layout.check_float("token_weights", token_weights)
        _layout.check_shape("token_weights", ow, m.shape, "mask.shape")
    ids = _check_ids(segment_episode, seq.shape[0], m.shape[0])
    return _redistribute(
        seq, imp, m, ids, ow, num_episodes=seq.shape[0], gamma=gamma, negative=negative
    )
