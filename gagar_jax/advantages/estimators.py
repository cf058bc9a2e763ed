"""Group statistics, group-relative advantage estimators, dynamic sampling and cheat penalty.

All functions take a dense `[G, K]` batch with a `valid: bool [G, K]` mask (ragged groups:
empty slots are `False`), or a flat `[N]` batch with `group_ids: int [N]` and a static
`num_groups` (see `_layout.py`); both forms give the same numbers. Results are float32 and
exactly zero on invalid slots.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from gagar_jax.advantages import _layout

Array = jax.Array


class GroupStats(NamedTuple):
    """Per-group statistics over the valid rollouts of each group."""

    count: Array  # [G] float32, number of valid rollouts
    mean: Array  # [G] float32, mean reward (0 for an empty group)
    std: Array  # [G] float32, reward standard deviation (0 for fewer than ddof+1 rollouts)
    pass_count: Array  # [G] float32, number of valid passing rollouts


def _stats(
    groups: _layout.Groups, rewards: Array, valid: Array, passed: Array, ddof: int
) -> GroupStats:
    w = valid.astype(jnp.float32)
    count = groups.sum(w)
    # An empty group has count 0: clamp the denominator so its mean is 0, never 0/0.
    mean = groups.sum(rewards * w) / jnp.maximum(count, 1.0)
    # Two-pass variance: subtracting the mean first keeps float32 accurate for rewards with a
    # large common offset, where E[R^2] - E[R]^2 would cancel catastrophically.
    centred = (rewards - groups.expand(mean)) * w
    var = groups.sum(centred * centred) / jnp.maximum(count - ddof, 1.0)
    std = jnp.where(count > ddof, jnp.sqrt(var), 0.0)
    pass_count = groups.sum((passed & valid).astype(jnp.float32))
    return GroupStats(count=count, mean=mean, std=std, pass_count=pass_count)


def _prepare(rewards, valid, group_ids, num_groups):
    groups = _layout.Groups.make("rewards", rewards, group_ids, num_groups)
    rewards = _layout.check_float("rewards", rewards)
    valid = _layout.check_bool("valid", valid)
    groups.check("valid", valid)
    chex.assert_rank(rewards, 1 if groups.flat else 2)
    chex.assert_equal_shape([rewards, valid])
    # Masked slots may hold garbage (NaN padding); zero them so they never leak into sums.
    rewards = jnp.where(valid, rewards, 0.0)
    return groups, rewards, valid


def group_stats(
    rewards: Array,
    valid: Array,
    passed: Array | None = None,
    *,
    ddof: int = 0,
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> GroupStats:
    """Count, mean, standard deviation and pass count of each group's valid rollouts.

    `mean_g = sum_i v_i R_i / max(n_g, 1)`, `std_g = sqrt(sum_i v_i (R_i - mean_g)^2 /
    max(n_g - ddof, 1))`, with `n_g = sum_i v_i`.

    Args:
      rewards: [G, K] (or [N]) float32 (any real dtype, accumulated in float32), the reward of
        each rollout slot.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      passed: optional [G, K] (or [N]) bool, which rollouts passed their tests; defaults to
        `rewards > 0` (binary executable-test rewards).
      ddof: int, delta degrees of freedom of the standard deviation (0: population, 1: sample).
      group_ids: flat layout only, int32 [N], the group of each rollout, in [0, num_groups).
      num_groups: flat layout only, static Python int, the number of groups G.

    Returns:
      `GroupStats` of [G] float32 arrays.
    """
    groups, rewards, valid = _prepare(rewards, valid, group_ids, num_groups)
    if passed is None:
        passed = rewards > 0
    else:
        passed = _layout.check_bool("passed", passed)
        groups.check("passed", passed)
    return _stats(groups, rewards, valid, passed, ddof)


def mean_centered(
    rewards: Array, valid: Array, *, group_ids: Array | None = None, num_groups: int | None = None
) -> Array:
    """Dr. GRPO advantages `A_i = R_i - mean(R)`, the estimator Gagar builds on.

    No division by the group's standard deviation, so the advantage scale reflects the group's
    pass rate and each group's advantages sum to zero (Liu et al. 2025, "Understanding R1-Zero-
    Like Training"; Gagar section 3). The Gagar notes print the mean with a `1/(n-1)`
    normaliser; that is a typo: only `1/n` gives the zero group sum all its derivations use.

    Args:
      rewards: [G, K] (or [N]) float32, the reward of each rollout slot.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      [G, K] (or [N]) float32 advantages `R_i - mean_g(R)`, 0 on invalid slots.
    """
    groups, rewards, valid = _prepare(rewards, valid, group_ids, num_groups)
    return _mean_centered(groups, rewards, valid)


def _mean_centered(groups: _layout.Groups, rewards: Array, valid: Array) -> Array:
    """`mean_centered` on inputs already checked (float32 rewards zeroed off `valid`)."""
    stats = _stats(groups, rewards, valid, valid, 0)
    return jnp.where(valid, rewards - groups.expand(stats.mean), 0.0)


def grpo_normalized(
    rewards: Array,
    valid: Array,
    *,
    eps: float = 1e-6,
    min_std: float = 1e-2,
    ddof: int = 0,
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> Array:
    """GRPO advantages `A_i = (R_i - mean(R)) / (max(std(R), min_std) + eps)`.

    The original GRPO normalisation (Shao et al. 2024, DeepSeekMath). A group whose rewards
    differ only by float noise has a tiny std; dividing by it would turn the noise into
    advantages of size 1. `min_std` floors the denominator so such groups stay near zero
    (1e-2 is far below the smallest std of a mixed binary group, sqrt(1/K - 1/K^2) >= 0.24 for
    K <= 16, so it never changes a real group), and `eps` keeps a zero std finite.

    Std convention: the default here is the population std (`ddof=0`, `std = sqrt(sum (R -
    mean)^2 / n)`). TRL's `GRPOTrainer` and verl's `compute_grpo_outcome_advantage` both use
    `torch.std`, which is unbiased (`ddof=1`, divide by `n - 1`); pass `ddof=1` to match them.
    The two differ by the factor `sqrt(n / (n - 1))` on every advantage of a group (1.033 for
    n = 16), which changes only the scale of the update.

    Args:
      rewards: [G, K] (or [N]) float32, the reward of each rollout slot.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      eps: float >= 0, added to the floored std.
      min_std: float >= 0, floor of the std in the denominator (`eps + min_std > 0`).
      ddof: int, delta degrees of freedom of the std (0 here by default; TRL and verl use 1).
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      [G, K] (or [N]) float32 advantages, 0 on invalid slots.
    """
    if not (eps >= 0 and min_std >= 0 and eps + min_std > 0):
        raise ValueError(
            f"eps, min_std: expected >= 0 with eps + min_std > 0, got {eps}, {min_std}"
        )
    groups, rewards, valid = _prepare(rewards, valid, group_ids, num_groups)
    return _grpo_normalized(groups, rewards, valid, eps, min_std, ddof)


def _grpo_normalized(groups, rewards, valid, eps: float, min_std: float, ddof: int) -> Array:
    """`grpo_normalized` on inputs already checked."""
    stats = _stats(groups, rewards, valid, valid, ddof)
    scale = 1.0 / (jnp.maximum(stats.std, min_std) + eps)
    return jnp.where(valid, (rewards - groups.expand(stats.mean)) * groups.expand(scale), 0.0)


def rloo(
    rewards: Array, valid: Array, *, group_ids: Array | None = None, num_groups: int | None = None
) -> Array:
    """REINFORCE leave-one-out advantages `A_i = R_i - mean_{j != i} R_j`.

    (Kool et al. 2019; Ahmadian et al. 2024.) On a group of n rollouts this equals
    `n / (n - 1) * (R_i - mean(R))`. A group with a single rollout has no baseline and gets 0.

    Args:
      rewards: [G, K] (or [N]) float32, the reward of each rollout slot.
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      [G, K] (or [N]) float32 advantages, 0 on invalid slots and in single-rollout groups.
    """
    groups, rewards, valid = _prepare(rewards, valid, group_ids, num_groups)
    return _rloo(groups, rewards, valid)


def _rloo(groups: _layout.Groups, rewards: Array, valid: Array) -> Array:
    """`rloo` on inputs already checked."""
    count = groups.expand(groups.sum(valid.astype(jnp.float32)))
    total = groups.expand(groups.sum(rewards))
    # Leave-one-out baseline; n - 1 is clamped so a lone rollout divides by 1, then zeroed.
    baseline = (total - rewards) / jnp.maximum(count - 1.0, 1.0)
    return jnp.where(valid & (count > 1.0), rewards - baseline, 0.0)


def mixed_groups(
    rewards: Array,
    valid: Array,
    *,
    tol: float = 1e-6,
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> Array:
    """Dynamic-sampling mask: groups whose mean reward lies strictly inside (0, 1).

    DAPO's dynamic sampling (Yu et al. 2025) keeps only groups with both passing and failing
    rollouts; for rewards in [0, 1] that is `tol < mean < 1 - tol`. The tolerance absorbs float
    rewards that are 0 or 1 up to rounding (e.g. a bf16 reward of 0.99999).

    Args:
      rewards: [G, K] (or [N]) float32, the reward of each rollout slot, expected in [0, 1].
      valid: [G, K] (or [N]) bool, which slots hold a rollout.
      tol: float in [0, 0.5), the margin inside (0, 1).
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      [G] bool, True for mixed groups (an empty group is never mixed).
    """
    if not 0.0 <= tol < 0.5:
        raise ValueError(f"tol: expected a value in [0, 0.5), got {tol}")
    groups, rewards, valid = _prepare(rewards, valid, group_ids, num_groups)
    return _mixed_groups(groups, rewards, valid, tol)


def _mixed_groups(groups: _layout.Groups, rewards: Array, valid: Array, tol: float) -> Array:
    """`mixed_groups` on inputs already checked."""
    stats = _stats(groups, rewards, valid, valid, 0)
    return (stats.count > 0) & (stats.mean > tol) & (stats.mean < 1.0 - tol)


class Penalized(NamedTuple):
    rewards: Array  # [G, K] (or [N]) float32, cheats set to `cheat_reward`
    passed: Array  # [G, K] (or [N]) bool, cheats marked failed


def penalize_cheats(
    rewards: Array, passed: Array, cheat: Array, *, cheat_reward: float = 0.0
) -> Penalized:
    """Sets confirmed cheats to reward `cheat_reward` (0) and marks them failed.

    Gagar step 1: a solution the grader or the behaviour monitor confirms as a cheat (e.g. it
    relies on a leaked answer) is scored as a failure. Group statistics and the mixed-group mask
    must be computed *after* this, since a mixed group can become all-fail.

    `R'_i = cheat_reward if cheat_i else R_i`, `passed'_i = passed_i and not cheat_i`.

    Args:
      rewards: [G, K] (or [N], any shape) float32, the reward of each rollout.
      passed: bool, same shape, whether the rollout passed its tests.
      cheat: bool, same shape, whether the rollout is a confirmed cheat.
      cheat_reward: float, the reward a cheat gets.

    Returns:
      `Penalized(rewards float32, passed bool)`, both with the input shape.
    """
    rewards = _layout.check_float("rewards", rewards)
    passed = _layout.check_bool("passed", passed)
    cheat = _layout.check_bool("cheat", cheat)
    _layout.check_shape("passed", passed, rewards.shape, "rewards.shape")
    _layout.check_shape("cheat", cheat, rewards.shape, "rewards.shape")
    return Penalized(
        rewards=jnp.where(cheat, jnp.float32(cheat_reward), rewards), passed=passed & ~cheat
    )
