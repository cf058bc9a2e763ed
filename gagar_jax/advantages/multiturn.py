"""Per-turn advantages for multi-turn episodes, with a baseline that ignores when an episode stops.

An episode of a group has turns `t = 0 .. L_i - 1` with per-turn rewards `r_{i,t}` (intermediate
rewards, step costs, the final outcome at its last turn). The turn-level credit of turn t is its
return-to-go minus a baseline:

    G_{i,t} = sum_{s = t}^{L_i - 1} r_{i,s}          (0 for t >= L_i: nothing is left to earn)
    A_{i,t} = G_{i,t} - b_t,     b_t = (1 / n) sum_{j in group} G_{j,t}     ("stopping_invariant")

Every episode of the group enters every `b_t` (an episode that has stopped contributes 0), so the
baseline of a turn has the same `n` terms whatever turn the episode itself stops at; it is the
group's mean return-to-go, Dr. GRPO's mean-centring applied per turn (at `t = 0` it is exactly
`mean_centered` of the episode returns).

The per-turn-index normalisation of MT-GRPO-style estimators (verl RFC #7244) instead centres
each reward on the mean of its own turn index over the episodes that reached it and sums:

    a_{i,s} = r_{i,s} - mu_s,    mu_s = mean_{j : L_j > s} r_{j,s}
    A_{i,t} = sum_{s=t}^{L_i - 1} a_{i,s} = G_{i,t} - sum_{s=t}^{L_i - 1} mu_s  ("per_turn_index")

Its baseline has `L_i - t` terms: it depends on the episode's own stopping turn, which the
policy chooses, so it is action-dependent and the gradient is biased. Between an episode that
stops after turn t and one that takes turn t + 1, the advantage at turn t differs by the true
return difference minus `mu_{t+1}`: a hidden bonus of `-mu_{t+1}` (minus the group mean reward at
the extra turn's index) for every extra turn; with step costs (`mu < 0`) it cancels them, so an
agent sees no cost in talking longer. `tests/test_advantages_multiturn.py` measures both on a
synthetic episode set. "per_turn_index" is kept only to show that bias.

Layout: dense `[G, K, L]` (G groups, K episodes, up to L turns) with a `turn_mask`, or flat
`[N, L]` with `group_ids` and a static `num_groups` like the other kernels.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from gagar_jax.advantages import _layout

Array = jax.Array

BASELINES = ("stopping_invariant", "per_turn_index")


def _returns_to_go(r: Array) -> Array:
    """`G_t = sum_{s >= t} r_s` along the last axis (a reversed cumulative sum, no loop)."""
    return jnp.flip(jnp.cumsum(jnp.flip(r, -1), axis=-1), -1)


def per_turn_advantages(
    turn_rewards: Array,
    turn_mask: Array,
    *,
    baseline: str = "stopping_invariant",
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> Array:
    """Turn-level advantages `A_{i,t}` of multi-turn episodes.

    With `L_i` the turns episode i took, `G_{i,t} = sum_{s=t}^{L_i - 1} r_{i,s}` its return-to-go
    (0 for `t >= L_i`) and n the group's episodes:

        "stopping_invariant":  A_{i,t} = G_{i,t} - (1/n) sum_j G_{j,t}
        "per_turn_index":      A_{i,t} = sum_{s=t}^{L_i - 1} (r_{i,s} - mu_s),
                               mu_s = mean_{j : L_j > s} r_{j,s}

    The first baseline has n terms at every turn (a stopped episode contributes `G = 0`), so it
    never depends on the episode's own length; at `t = 0` it is `mean_centered` of the returns.
    The second has `L_i - t` terms, a baseline that depends on the episode's stopping turn: a
    hidden bonus of `-mu_{t+1}` per extra turn (verl RFC #7244), kept only to show that bias.

    Args:
      turn_rewards: [G, K, L] (or [N, L]) float32, reward of each turn (0 off the mask).
      turn_mask: [G, K, L] (or [N, L]) bool, True on the turns an episode took; the taken turns
        of an episode must be a prefix (turn t taken implies turns < t taken).
      baseline: one of `BASELINES`.
      group_ids: flat layout only, int [N] group of each episode, in [0, num_groups).
      num_groups: flat layout only, static number of groups G.

    Returns:
      [G, K, L] (or [N, L]) float32 advantages, 0 on turns not taken and in empty episodes.

    Raises:
      ValueError: a shape that does not match, an unknown baseline, or (concrete inputs) a
        `turn_mask` that is not a prefix.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline: expected one of {BASELINES}, got {baseline!r}")
    r = _layout.check_float("turn_rewards", turn_rewards)
    m = _layout.check_bool("turn_mask", turn_mask)
    _layout.check_shape("turn_mask", m, r.shape, "turn_rewards.shape")
    if r.ndim < 2:
        raise ValueError(f"turn_rewards: expected [G, K, L] or [N, L], got shape {list(r.shape)}")
    groups = _layout.Groups.make("turn_rewards", r[..., 0], group_ids, num_groups)
    chex.assert_rank(r, 2 if groups.flat else 3)
    chex.assert_equal_shape([r, m])
    if _layout.is_concrete(m):
        mv = np.asarray(m)
        if (mv[..., 1:] & ~mv[..., :-1]).any():
            raise ValueError("turn_mask: taken turns must be a prefix of each episode")
    return _per_turn(r, m, groups, baseline)


def _per_turn(r: Array, m: Array, groups: _layout.Groups, baseline: str) -> Array:
    r = jnp.where(m, r, 0.0)
    g = _returns_to_go(r)  # [.., L], 0 past the episode's end
    mf = m.astype(jnp.float32)
    live = jnp.any(m, axis=-1)  # [..] episodes with at least one turn
    # Per-group sums of a [.., L] array: the layout reduces [..] -> [G]; vmap over turns.
    gsum = jax.vmap(groups.sum, in_axes=-1, out_axes=-1)
    gexp = jax.vmap(groups.expand, in_axes=-1, out_axes=-1)
    if baseline == "stopping_invariant":
        n = groups.sum(live.astype(jnp.float32))  # [G], the same n for every turn
        b = gsum(g) / jnp.maximum(n, 1.0)[..., None]  # empty group: divide by 1, masked below
        return jnp.where(m, g - gexp(b), 0.0)
    reached = gsum(mf)  # [G, L], episodes that took turn s
    mu = gsum(r) / jnp.maximum(reached, 1.0)
    return jnp.where(m, _returns_to_go(jnp.where(m, r - gexp(mu), 0.0)), 0.0)


def turns_to_tokens(turn_advantages: Array, token_turn: Array, mask: Array) -> Array:
    """Broadcasts per-turn advantages onto the tokens of each turn.

    Args:
      turn_advantages: [N, L] float32 (e.g. `per_turn_advantages` in the flat layout).
      token_turn: [N, T] int, the turn each token belongs to (any value off the mask).
      mask: [N, T] bool, the response tokens the loss trains on.

    Returns:
      [N, T] float32, `turn_advantages[n, token_turn[n, t]]` on the mask, 0 elsewhere.
    """
    a = _layout.check_float("turn_advantages", turn_advantages)
    tt = _layout.check_int("token_turn", token_turn)
    mask = _layout.check_bool("mask", mask)
    _layout.check_shape("mask", mask, tt.shape, "token_turn.shape")
    if a.ndim != 2 or tt.ndim != 2 or a.shape[0] != tt.shape[0]:
        raise ValueError(
            f"turn_advantages [N, L] and token_turn [N, T] must share N, got "
            f"{list(a.shape)} and {list(tt.shape)}"
        )
    chex.assert_rank([a, tt, mask], 2)
    chex.assert_equal_shape([tt, mask])
    idx = jnp.clip(tt, 0, a.shape[-1] - 1)
    return jnp.where(mask, jnp.take_along_axis(a, idx, axis=-1), 0.0)
