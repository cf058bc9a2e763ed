"""Mapping a grader's tiers and ranks to discount factors `f_i in (0, 1]`.

Gagar's grader puts every passing candidate of a group in a quality tier (T1 best, T3 worst)
and ranks the candidates of the group (ties allowed: "no evidence" means a tie). The factors
then weight the candidates in the redistribution (`redistribution.py`).

The mapping used here, with `tier_factors = (c1, c2, c3)`:

* T3 gets the fixed factor `c3`: the strongest discount, whatever its rank (the paper: "T3
  takes the strongest fixed discount").
* T1 and T2 step down by rank inside the tier without reaching the next tier: with `r_min`
  and `r_max` the best and worst rank present in that tier of that group,
  `f = c_t - rank_decay * (c_t - c_{t+1}) * (r - r_min) / max(r_max - r_min, 1)`.
  The best-ranked candidate of T1 keeps full weight `c1`, the worst of a tier stays
  `(1 - rank_decay)(c_t - c_{t+1}) > 0` above the next tier's best, equal ranks get equal
  factors, and the map is monotone: a better (tier, rank) never gets a smaller factor.
* Slots that are not passing (or not valid) get factor 1; the redistribution ignores them.

Default `tier_factors = (1.0, 0.6, 0.3)`, `rank_decay = 0.5`: a T3 solution receives 30%
of the credit weight of the best T1 solution -- still positive (a passing solution always
keeps a positive advantage), but a clear signal; ranks move a candidate by at most half the
gap to the next tier, so the grader's tier decision dominates its finer ordering, which is
the less reliable judgement. Only the ratios matter for the sum-preserving mode (the common
scale `lambda` cancels any overall scale), so `c1 = 1` is a convention there; the
discount-only ablation uses the absolute values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from gagar_jax.advantages import _layout

Array = jax.Array

NUM_TIERS = 3


class Factors(NamedTuple):
    factors: Array  # [G, K] (or [N]) float32 in (0, 1]; 1 on non-passing slots and bad groups
    ok: Array  # [G] bool, False where a passing slot had an invalid tier or rank


def check_tier_factors(tier_factors: Sequence[float], rank_decay: float) -> tuple[float, ...]:
    """Validates the discount knobs; returns `tier_factors` as a tuple of floats."""
    tf = tuple(float(c) for c in tier_factors)
    if len(tf) != NUM_TIERS:
        raise ValueError(f"tier_factors: expected {NUM_TIERS} values (T1, T2, T3), got {len(tf)}")
    if not (1.0 >= tf[0] >= tf[1] >= tf[2] > 0.0):
        raise ValueError(
            f"tier_factors: expected 1 >= T1 >= T2 >= T3 > 0 (non-increasing, positive), got {tf}"
        )
    if not 0.0 <= rank_decay < 1.0:
        raise ValueError(f"rank_decay: expected a value in [0, 1), got {rank_decay}")
    return tf


def discount_factors(
    tier: Array,
    rank: Array,
    passed: Array,
    valid: Array,
    *,
    tier_factors: Sequence[float] = (1.0, 0.6, 0.3),
    rank_decay: float = 0.5,
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> Factors:
    """Discount factors `f_i in (0, 1]` from grader tiers and ranks.

    With `tier_factors = (c1, c2, c3)`, for a passing valid rollout i of tier t and rank r:

        f_i = c3                                                        if t = 3,
        f_i = c_t - rank_decay (c_t - c_{t+1}) (r - r_min) / max(r_max - r_min, 1)   if t < 3,

    `r_min`, `r_max` the best and worst rank of tier t in i's group; `f_i = 1` off the passing
    set. So the best T1 keeps weight c1, a tier never reaches the next one's factors, equal ranks
    get equal factors, and a better (tier, rank) never gets a smaller factor.

    Args:
      tier: [G, K] (or [N]) int32, 1..3 on passing valid slots (ignored elsewhere).
      rank: [G, K] (or [N]) int32 >= 1, rank within the group (1 best, ties allowed) on passing
        valid slots (ignored elsewhere).
      passed: [G, K] (or [N]) bool, which rollouts passed (after the cheat penalty).
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      tier_factors: (T1, T2, T3) Python floats, `1 >= T1 >= T2 >= T3 > 0`.
      rank_decay: Python float in [0, 1), the fraction of the gap to the next tier that ranks
        may use.
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      `Factors(factors, ok)`: `factors` [G, K] (or [N]) float32 in (0, 1] (1 off the passing
      set), `ok` [G] bool (the group's tiers and ranks were valid). With concrete inputs an
      invalid tier or rank on a passing valid slot raises a ValueError naming the field and
      slot; under `jit` the group is reported with `ok = False` and gets factors 1 (callers
      fall back to the original advantages).
    """
    tf = check_tier_factors(tier_factors, rank_decay)
    groups = _layout.Groups.make("tier", tier, group_ids, num_groups)
    tier = _layout.check_int("tier", tier)
    rank = _layout.check_int("rank", rank)
    passed = _layout.check_bool("passed", passed)
    valid = _layout.check_bool("valid", valid)
    for name, x in (("rank", rank), ("passed", passed), ("valid", valid)):
        groups.check(name, x)
    chex.assert_rank(tier, 1 if groups.flat else 2)
    chex.assert_equal_shape([tier, rank, passed, valid])

    graded = passed & valid
    bad_tier = graded & ((tier < 1) | (tier > NUM_TIERS))
    bad_rank = graded & (rank < 1)
    if _layout.is_concrete(tier, rank, passed, valid):
        for name, bad, values, want in (
            ("tier", bad_tier, tier, "1..3"),
            ("rank", bad_rank, rank, ">= 1"),
        ):
            bad = np.asarray(bad)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(
                    f"{name}: expected {want} on passing valid slots, got "
                    f"{int(np.asarray(values)[where])} at index {where} "
                    f"({int(bad.sum())} bad slot(s))"
                )
    return _discount_factors(groups, tier, rank, passed, valid, tf, rank_decay)


def _discount_factors(groups, tier, rank, passed, valid, tf, rank_decay) -> Factors:
    """`discount_factors` on inputs already checked (int32 tier/rank, bool masks)."""
    graded = passed & valid
    bad_tier = graded & ((tier < 1) | (tier > NUM_TIERS))
    bad_rank = graded & (rank < 1)
    ok = groups.sum((bad_tier | bad_rank).astype(jnp.float32)) == 0

    t = jnp.clip(tier, 1, NUM_TIERS)
    r = rank.astype(jnp.float32)
    factors = jnp.ones_like(r)  # *_like keeps the input sharding (Explicit axes)
    # A static loop over the three tiers (not over groups or rollouts).
    for k in range(1, NUM_TIERS + 1):
        member = graded & (t == k)
        hi = tf[k - 1]
        if k == NUM_TIERS:
            f_k = jnp.full_like(r, hi)
        else:
            lo = tf[k]
            r_min = groups.expand(groups.min(r, member, jnp.inf))
            r_max = groups.expand(groups.max(r, member, -jnp.inf))
            # Position of the rank inside the tier's range, in [0, 1]; a one-rank tier has span 0
            # and clamping the span to 1 keeps that a clean 0 instead of 0/0.
            span = jnp.where(member, r_max - r_min, 0.0)
            pos = jnp.where(member, (r - r_min) / jnp.maximum(span, 1.0), 0.0)
            f_k = hi - rank_decay * (hi - lo) * pos
        factors = jnp.where(member, f_k, factors)
    factors = jnp.where(groups.expand(ok), factors, 1.0)
    return Factors(factors=factors, ok=ok)
