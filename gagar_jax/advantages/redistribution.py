"""Sum-preserving advantage redistribution, token broadcast, credit diagnostics.

Gagar (Dong et al. 2026, section 3) reweights the advantages of a group's passing set `P` by
quality factors `f_i` without changing the group's credit balance:

    A*_i = lambda * f_i * A_i   for i in P,      lambda = S+ / sum_{j in P} f_j A_j,
    A*_i = A_i                  for i not in P,  S+ = sum_{j in P} A_j.

So `sum_P A* = S+` (the total positive credit is preserved), the failed side is untouched,
the group still sums to zero, and `A*_i / A*_j = f_i / f_j` for equal `A_i = A_j` (binary
rewards). With binary rewards and mean-centred advantages this is
`A*_i = (1 - mean R) * f_i / mean_P(f)`: candidates above the passing set's mean factor gain
credit, those below give it up.

The "discount only" ablation `A*_i = f_i A_i` shrinks the positive side while the negative
side stays, which is what destabilised training in the paper (entropy 0.359 -> 0.905 in 30
steps); `credit_balance` measures exactly that imbalance.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from gagar_jax.advantages import _layout

Array = jax.Array

# The redistribution modes of the kernels (training modes are
# `gagar_jax.rl.config.TRAINING_MODES`).
REDISTRIBUTION_MODES = ("sum_preserving", "discount_only", "none")


def check_mode(mode: str) -> str:
    if mode not in REDISTRIBUTION_MODES:
        raise ValueError(f"mode: expected one of {REDISTRIBUTION_MODES}, got {mode!r}")
    return mode


class _Prepared(NamedTuple):
    groups: _layout.Groups
    advantages: Array
    passed: Array  # passing AND valid
    valid: Array


def _prepare(advantages, passed, valid, group_ids, num_groups, name="advantages"):
    groups = _layout.Groups.make(name, advantages, group_ids, num_groups)
    advantages = _layout.check_float(name, advantages)
    passed = _layout.check_bool("passed", passed)
    valid = _layout.check_bool("valid", valid)
    groups.check("passed", passed)
    groups.check("valid", valid)
    chex.assert_equal_shape([advantages, passed, valid])
    advantages = jnp.where(valid, advantages, 0.0)
    return _Prepared(groups, advantages, passed & valid, valid)


def redistribute(
    advantages: Array,
    passed: Array,
    factors: Array,
    valid: Array,
    *,
    mode: str = "sum_preserving",
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> Array:
    """Reweights the passing set's advantages by quality factors.

    Per group, with `P` its passing valid rollouts:

      "sum_preserving" (Gagar, Dong et al. 2026 eq. 2-4):
          A*_i = lambda f_i A_i  (i in P),   lambda = sum_{j in P} A_j / sum_{j in P} f_j A_j,
          A*_i = A_i             (i not in P),
        so `sum_P A* = sum_P A` (positive credit kept), the failed side is unchanged and
        `A*_i / A*_j = f_i / f_j` for equal `A_i = A_j`.
      "discount_only" (the ablation): `A*_i = f_i A_i` on P; the positive total shrinks by
        `sum_P (1 - f_i) A_i` while the negative side stays.
      "none": `A*_i = A_i` (plain GRPO / Dr. GRPO).

    A group is returned unchanged, exactly, by "sum_preserving" when the redistribution is
    undefined or the identity: fewer than two passing rollouts, all passing factors equal, or a
    passing advantage that is not strictly positive (then `S+` is not a positive credit and
    `lambda` could be unbounded; with every passing `A_i > 0`, `1 <= lambda <= 1 / min f`).

    Args:
      advantages: [G, K] (or [N]) float32, the original advantages (e.g. `mean_centered`).
      passed: [G, K] (or [N]) bool, the passing set (after the cheat penalty).
      factors: [G, K] (or [N]) float32 in (0, 1], quality factors (`discount_factors`);
        values on non-passing slots are ignored.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      mode: one of `REDISTRIBUTION_MODES`.
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      [G, K] (or [N]) float32 redistributed advantages, 0 on invalid slots.
    """
    check_mode(mode)
    p = _prepare(advantages, passed, valid, group_ids, num_groups)
    factors = _layout.check_float("factors", factors)
    p.groups.check("factors", factors)
    if _layout.is_concrete(factors, p.passed):
        f_p = jnp.where(p.passed, factors, 1.0)
        if not bool(jnp.all((f_p > 0) & (f_p <= 1))):
            raise ValueError("factors: expected values in (0, 1] on passing valid slots")
    return _redistribute(p.groups, p.advantages, p.passed, factors, mode)


def _redistribute(g: _layout.Groups, a: Array, passed: Array, factors: Array, mode: str):
    """`redistribute` on inputs already checked (`a` zero and `passed` False off `valid`)."""
    if mode == "none":
        return a
    if mode == "discount_only":
        return jnp.where(passed, factors * a, a)

    p = _Prepared(g, a, passed, None)
    n_pass = g.sum(p.passed.astype(jnp.float32))
    s_plus = g.sum(jnp.where(p.passed, a, 0.0))
    denom = g.sum(jnp.where(p.passed, factors * a, 0.0))
    f_max = g.max(factors, p.passed, 0.0)
    f_min = g.min(factors, p.passed, 1.0)
    a_min = g.min(a, p.passed, jnp.inf)
    applies = (n_pass >= 2) & (f_max > f_min) & (a_min > 0) & (denom > 0)
    # Guarded division: groups that do not apply divide by 1 and are discarded by the where.
    lam = jnp.where(applies, s_plus / jnp.where(applies, denom, 1.0), 1.0)
    return jnp.where(p.passed & g.expand(applies), g.expand(lam) * factors * a, a)


def broadcast_to_tokens(seq_advantages: Array, response_mask: Array) -> Array:
    """Broadcasts one advantage per sequence to its response tokens.

    Gagar trains with sequence-level advantages spread uniformly over the response tokens and a
    token-mean loss. Inside a jitted loss this multiply fuses into its consumer, so no separate
    `[N, T]` array is materialised.

    `A_{n,t} = A_n * response_mask[n, t]`.

    Args:
      seq_advantages: [N] (or [G, K]) float32, one advantage per sequence.
      response_mask: [N, T] (or [G, K, T]) bool or float, 1 on tokens the policy generated,
        0 on prompt, observation and padding tokens.

    Returns:
      [..., T] float32, `seq_advantages[..., None] * response_mask`.
    """
    seq = _layout.check_float("seq_advantages", seq_advantages)
    mask = jnp.asarray(response_mask)
    if mask.ndim != seq.ndim + 1 or mask.shape[:-1] != seq.shape:
        raise ValueError(
            f"response_mask: expected shape {list(seq.shape) + ['T']} (seq_advantages.shape + [T]),"
            f" got {list(mask.shape)}"
        )
    chex.assert_rank(mask, seq.ndim + 1)
    return seq[..., None] * mask.astype(jnp.float32)


class CreditBalance(NamedTuple):
    """Credit bookkeeping of a redistribution, per group and for the batch."""

    positive: Array  # [G] f32, sum of positive advantages after
    negative: Array  # [G] f32, sum of negative advantages after (<= 0)
    ratio: Array  # [G] f32, positive / |negative| (1 where there is no negative credit)
    moved: Array  # [G] f32, credit given up by passing rollouts (sum_P max(A - A*, 0))
    net_change: Array  # [G] f32, sum_P (A* - A): 0 when the positive total is preserved
    conservation_error: Array  # [G] f32, max(|sum_P A* - sum_P A|, max_F |A* - A|)
    positive_total: Array  # [] f32
    negative_total: Array  # [] f32
    ratio_total: Array  # [] f32, positive_total / |negative_total| (1 if the latter is 0)
    moved_total: Array  # [] f32
    max_conservation_error: Array  # [] f32


def _ratio(pos: Array, neg: Array) -> Array:
    # No negative credit (an empty, unmixed or filtered group): report balance 1, not x/0.
    return jnp.where(neg < 0, pos / jnp.where(neg < 0, -neg, 1.0), 1.0)


def credit_balance(
    before: Array,
    after: Array,
    passed: Array,
    valid: Array,
    *,
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> CreditBalance:
    """Positive/negative credit, their ratio, credit moved and conservation error.

    Per group, with `A` before, `A*` after, `P` passing and `F` failed valid rollouts:

        positive = sum_i max(A*_i, 0)        negative = sum_i min(A*_i, 0)
        ratio    = positive / |negative|     (1 without negative credit)
        moved    = sum_P max(A_i - A*_i, 0)  net_change = sum_P (A*_i - A_i)
        conservation_error = max(|net_change|, max_F |A*_i - A_i|)

    and the batch totals of positive, negative, moved, their ratio and the maximum error. For
    "sum_preserving", `net_change` and `conservation_error` are 0 up to float rounding and
    `ratio` stays 1 on mixed groups; for "discount_only", `net_change < 0` and `ratio < 1`.

    Args:
      before: [G, K] (or [N]) float32, advantages before redistribution.
      after: [G, K] (or [N]) float32, advantages after.
      passed: [G, K] (or [N]) bool, the passing set.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      `CreditBalance`.
    """
    p = _prepare(before, passed, valid, group_ids, num_groups, name="before")
    after = _layout.check_float("after", after)
    p.groups.check("after", after)
    return _credit_balance(p.groups, p.advantages, after, p.passed, p.valid)


def _credit_balance(g: _layout.Groups, b: Array, after: Array, passed: Array, valid: Array):
    """`credit_balance` on inputs already checked (`b` zero and `passed` False off `valid`)."""
    p = _Prepared(g, b, passed, valid)
    a = jnp.where(p.valid, after, 0.0)
    failed = p.valid & ~p.passed
    positive = g.sum(jnp.maximum(a, 0.0))
    negative = g.sum(jnp.minimum(a, 0.0))
    delta = a - b
    moved = g.sum(jnp.where(p.passed, jnp.maximum(-delta, 0.0), 0.0))
    net_change = g.sum(jnp.where(p.passed, delta, 0.0))
    failed_err = g.max(jnp.abs(delta), failed, 0.0)
    conservation_error = jnp.maximum(jnp.abs(net_change), failed_err)
    positive_total, negative_total = jnp.sum(positive), jnp.sum(negative)
    return CreditBalance(
        positive=positive,
        negative=negative,
        ratio=_ratio(positive, negative),
        moved=moved,
        net_change=net_change,
        conservation_error=conservation_error,
        positive_total=positive_total,
        negative_total=negative_total,
        ratio_total=_ratio(positive_total, negative_total),
        moved_total=jnp.sum(moved),
        max_conservation_error=jnp.max(conservation_error, initial=0.0),
    )


def equivalent_rewards(
    rewards: Array,
    advantages: Array,
    valid: Array,
    *,
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> Array:
    """Rewards whose mean-centred advantages are the given (redistributed) advantages.

    Gagar appendix A.3: a target advantage assignment can be expressed as a reward transform.
    Mean-centring is invariant to a per-group constant, so the equivalent rewards are unique up
    to one; choosing the group's original mean reward, `R*_i = mean(R) + A*_i`, keeps the
    group mean (pass rate, dynamic-sampling mask) unchanged. For binary rewards and
    sum-preserving redistribution: `R*_i = mean(R) + (1 - mean(R)) f_i / mean_P(f)` on the
    passing set and `R*_i = R_i = 0` on the failed side. `mean_centered(R*) == A*` exactly when
    each group's advantages sum to zero (true for every mode but "discount_only").

    Args:
      rewards: [G, K] (or [N]) float32, the original rewards.
      advantages: [G, K] (or [N]) float32, the target advantages.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      [G, K] (or [N]) float32 equivalent rewards, 0 on invalid slots.
    """
    groups = _layout.Groups.make("rewards", rewards, group_ids, num_groups)
    rewards = _layout.check_float("rewards", rewards)
    advantages = _layout.check_float("advantages", advantages)
    valid = _layout.check_bool("valid", valid)
    groups.check("advantages", advantages)
    groups.check("valid", valid)
    w = valid.astype(jnp.float32)
    mean = groups.sum(jnp.where(valid, rewards, 0.0)) / jnp.maximum(groups.sum(w), 1.0)
    return jnp.where(valid, groups.expand(mean) + advantages, 0.0)
