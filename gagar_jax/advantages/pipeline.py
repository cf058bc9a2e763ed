"""The whole Gagar advantage pipeline in one jitted call, and its typed configuration.

Order of operations (Gagar section 3, steps 1-5):

1. confirmed cheats get reward 0 and count as failed (`penalize_cheats`);
2. group statistics and the base advantages (`mean_centered` by default) are computed on the
   penalised rewards, so a group whose only pass was a cheat becomes all-fail;
3. dynamic sampling: only mixed groups (`0 < mean < 1`) keep non-zero advantages;
4. tiers and ranks become factors (`discount_factors`);
5. passing advantages are redistributed (`redistribute`) in groups that are mixed, graded and
   whose verdict mapped to valid factors; every other group falls back to its original
   advantages, and each fallback is counted by reason in the metrics.

Rollouts with a non-finite reward are treated as invalid (masked out, never NaN) and counted.
The pipeline's knobs form one frozen, validated `GagarConfig`; being hashable, it is a static
argument of the jitted function (a new config compiles once, new values never retrace).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from gagar_jax.advantages import _layout, discount, estimators, redistribution

Array = jax.Array

ESTIMATORS = ("mean_centered", "grpo", "rloo")


@dataclasses.dataclass(frozen=True)
class GagarConfig:
    """Knobs of `gagar_advantages`; validated on construction.

    Attributes:
      estimator: base advantage, "mean_centered" (Dr. GRPO, the paper's), "grpo" or "rloo".
      mode: redistribution, "sum_preserving" (Gagar), "discount_only" (ablation) or "none"
        (the binary-reward baseline).
      tier_factors: (T1, T2, T3) discount factors, `1 >= T1 >= T2 >= T3 > 0`.
      rank_decay: fraction of the gap to the next tier that ranks may use, in [0, 1).
      mixed_tol: tolerance of the dynamic-sampling test `tol < mean < 1 - tol`.
      filter_unmixed: zero the advantages of groups that are not mixed (dynamic sampling).
      cheat_reward: reward given to confirmed cheats.
      grpo_eps, grpo_min_std: denominator guards of the "grpo" estimator.
    """

    estimator: str = "mean_centered"
    mode: str = "sum_preserving"
    tier_factors: tuple[float, float, float] = (1.0, 0.6, 0.3)
    rank_decay: float = 0.5
    mixed_tol: float = 1e-6
    filter_unmixed: bool = True
    cheat_reward: float = 0.0
    grpo_eps: float = 1e-6
    grpo_min_std: float = 1e-2

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator: expected one of {ESTIMATORS}, got {self.estimator!r}")
        redistribution.check_mode(self.mode)
        # Normalise to a tuple of floats so equal configs hash equally (lists are unhashable).
        object.__setattr__(
            self, "tier_factors", discount.check_tier_factors(self.tier_factors, self.rank_decay)
        )
        if not 0.0 <= self.mixed_tol < 0.5:
            raise ValueError(f"mixed_tol: expected a value in [0, 0.5), got {self.mixed_tol}")
        if not 0.0 <= self.cheat_reward <= 1.0:
            raise ValueError(f"cheat_reward: expected a value in [0, 1], got {self.cheat_reward}")
        if not (
            self.grpo_eps >= 0 and self.grpo_min_std >= 0 and self.grpo_eps + self.grpo_min_std > 0
        ):
            raise ValueError(
                "grpo_eps, grpo_min_std: expected >= 0 with a positive sum, got "
                f"{self.grpo_eps}, {self.grpo_min_std}"
            )

    @classmethod
    def from_mapping(cls, mapping: Any) -> GagarConfig:
        """Builds from a dict or `ml_collections.ConfigDict`; unknown keys raise."""
        items = dict(mapping)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - names)
        if unknown:
            raise ValueError(
                f"advantages config: unknown keys {unknown}; expected some of {sorted(names)}"
            )
        if "tier_factors" in items:
            items["tier_factors"] = tuple(items["tier_factors"])
        return cls(**items)


class GagarOutput(NamedTuple):
    advantages: Array  # [G, K] (or [N]) f32, final advantages (0 on invalid slots, filtered groups)
    original: Array  # [G, K] (or [N]) f32, base estimator's advantages on the penalised rewards
    factors: Array  # [G, K] (or [N]) f32, discount factors (1 off the passing set)
    rewards: Array  # [G, K] (or [N]) f32, rewards after the cheat penalty
    passed: Array  # [G, K] (or [N]) bool, passing set after the cheat penalty
    keep: Array  # [G] bool, groups kept by dynamic sampling
    applied: Array  # [G] bool, groups whose advantages were redistributed
    metrics: dict[str, Array]  # flat dict of float32 scalars


def _base_advantages(config: GagarConfig, groups: _layout.Groups, rewards, valid) -> Array:
    if config.estimator == "mean_centered":
        return estimators._mean_centered(groups, rewards, valid)
    if config.estimator == "rloo":
        return estimators._rloo(groups, rewards, valid)
    return estimators._grpo_normalized(
        groups, rewards, valid, config.grpo_eps, config.grpo_min_std, 0
    )


@functools.partial(jax.jit, static_argnames=("config", "num_groups"))
def gagar_advantages(
    rewards: Array,
    passed: Array,
    cheat: Array,
    tier: Array,
    rank: Array,
    graded: Array,
    valid: Array,
    *,
    config: GagarConfig = GagarConfig(),
    group_ids: Array | None = None,
    num_groups: int | None = None,
) -> GagarOutput:
    """Gagar advantages for a batch of graded rollout groups, with per-group fallback.

    Per group (Gagar section 3, steps 1-5; `f` from `discount_factors`):

        R'  = cheat_reward on confirmed cheats, R elsewhere; passed' = passed and not cheat
        A   = estimator(R')                       (mean_centered: A_i = R'_i - mean_g R')
        A*  = redistribute(A, passed', f, mode)   (sum_preserving: lambda f_i A_i on P)
        out = A*  where the group is kept, mixed, graded, its verdict valid and mode != "none"
              A   where it is kept but not all of those (a fallback, counted per reason)
              0   where dynamic sampling drops it (0 < mean R' < 1 fails) or the slot is invalid

    Rollouts with a non-finite reward count as invalid. The inputs are validated once here; the
    kernels are called on the checked arrays (no re-validation), and the metrics are computed
    apart from the algorithm (`pipeline_metrics`).

    Args:
      rewards: [G, K] (or [N]) float32, executable-test reward per rollout (binary in the paper).
      passed: [G, K] (or [N]) bool, whether the rollout passed its tests.
      cheat: [G, K] (or [N]) bool, confirmed cheats (grader or behaviour monitor).
      tier: [G, K] (or [N]) int32, grader tier 1..3 of passing rollouts (ignored elsewhere).
      rank: [G, K] (or [N]) int32 >= 1, grader rank within the group (ignored off the passing
        set).
      graded: [G] bool, whether the group has a usable grader verdict; False falls back to the
        original advantages for that group.
      valid: [G, K] (or [N]) bool, which slots hold a usable rollout (False for padding and for
        rollouts lost to infrastructure errors).
      config: `GagarConfig` (static).
      group_ids: flat layout only, int32 [N] group ids in [0, num_groups).
      num_groups: flat layout only, static Python int G.

    Returns:
      `GagarOutput` (advantages, original, factors, rewards, passed [G, K] or [N]; keep,
      applied [G]; metrics, a flat dict of float32 scalars).
    """
    groups = _layout.Groups.make("rewards", rewards, group_ids, num_groups)
    rewards = _layout.check_float("rewards", rewards)
    valid = _layout.check_bool("valid", valid)
    graded = _layout.check_bool("graded", graded)
    passed = _layout.check_bool("passed", passed)
    cheat = _layout.check_bool("cheat", cheat)
    tier = _layout.check_int("tier", tier)
    rank = _layout.check_int("rank", rank)
    for name, x in (
        ("passed", passed),
        ("cheat", cheat),
        ("tier", tier),
        ("rank", rank),
        ("valid", valid),
    ):
        groups.check(name, x)
    groups.check_group("graded", graded)
    chex.assert_equal_shape([rewards, passed, cheat, tier, rank, valid])
    chex.assert_rank(graded, 1)
    out, aux = _gagar(config, groups, rewards, passed, cheat, tier, rank, graded, valid)
    return out._replace(metrics=pipeline_metrics(config, groups, out, **aux))


def _gagar(
    config: GagarConfig, groups: _layout.Groups, rewards, passed, cheat, tier, rank, graded, valid
):
    """The algorithm of `gagar_advantages` on checked inputs; returns (output, metric inputs)."""
    finite = jnp.isfinite(rewards)
    nonfinite = valid & ~finite
    valid = valid & finite
    cheat = cheat & valid
    # `penalize_cheats` on the checked arrays.
    rewards = jnp.where(cheat, jnp.float32(config.cheat_reward), jnp.where(valid, rewards, 0.0))
    passed = passed & ~cheat & valid

    original = _base_advantages(config, groups, rewards, valid)
    mixed = estimators._mixed_groups(groups, rewards, valid, config.mixed_tol)
    factors, ok = discount._discount_factors(
        groups, tier, rank, passed, valid, config.tier_factors, config.rank_decay
    )
    redistributed = redistribution._redistribute(groups, original, passed, factors, config.mode)
    present = groups.sum(valid.astype(jnp.float32)) > 0
    keep = mixed if config.filter_unmixed else present
    applied = keep & mixed & graded & ok & (config.mode != "none")
    advantages = jnp.where(groups.expand(applied), redistributed, original)
    advantages = jnp.where(groups.expand(keep) & valid, advantages, 0.0)
    out = GagarOutput(
        advantages=advantages,
        original=original,
        factors=factors,
        rewards=rewards,
        passed=passed,
        keep=keep,
        applied=applied,
        metrics={},
    )
    aux = dict(
        tier=tier,
        valid=valid,
        graded=graded,
        cheat=cheat,
        nonfinite=nonfinite,
        mixed=mixed,
        ok=ok,
        present=present,
    )
    return out, aux


def pipeline_metrics(
    config: GagarConfig,
    groups: _layout.Groups,
    out: GagarOutput,
    *,
    tier,
    valid,
    graded,
    cheat,
    nonfinite,
    mixed,
    ok,
    present,
) -> dict[str, Array]:
    """The flat metrics dict of `gagar_advantages` (float32 scalars): group and rollout counts
    by outcome and fallback reason, pass rate, tier shares, credit balance (`credit_balance` of
    the kept original vs the final advantages) and the mean |advantage|."""
    del config
    keep, applied, passed, factors = out.keep, out.applied, out.passed, out.factors
    kept_original = jnp.where(groups.expand(keep) & valid, out.original, 0.0)
    credit = redistribution._credit_balance(groups, kept_original, out.advantages, passed, valid)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    count = lambda x: jnp.sum(x.astype(jnp.float32))
    n_valid = count(valid)
    in_applied = passed & groups.expand(applied)
    tier_c = jnp.clip(tier, 1, discount.NUM_TIERS)
    graded_pass = passed & groups.expand(keep & graded & ok)
    n_graded_pass = jnp.maximum(count(graded_pass), 1.0)
    metrics = {
        "groups/present": count(present),
        "groups/mixed": count(mixed),
        "groups/kept": count(keep),
        "groups/applied": count(applied),
        "groups/fallback_ungraded": count(keep & mixed & ~graded),
        "groups/fallback_invalid_verdict": count(keep & mixed & graded & ~ok),
        "rollouts/valid": n_valid,
        "rollouts/nonfinite_reward": count(nonfinite),
        "rollouts/cheats": count(cheat),
        "rollouts/pass_rate": count(passed) / jnp.maximum(n_valid, 1.0),
        "grading/factor_mean": jnp.sum(jnp.where(in_applied, factors, 0.0))
        / jnp.maximum(count(in_applied), 1.0),
        "grading/t1_share": count(graded_pass & (tier_c == 1)) / n_graded_pass,
        "grading/t2_share": count(graded_pass & (tier_c == 2)) / n_graded_pass,
        "grading/t3_share": count(graded_pass & (tier_c == 3)) / n_graded_pass,
        "credit/positive": credit.positive_total,
        "credit/negative": credit.negative_total,
        "credit/ratio": credit.ratio_total,
        "credit/moved": credit.moved_total,
        "credit/max_conservation_error": credit.max_conservation_error,
        "advantages/abs_mean": jnp.sum(jnp.abs(out.advantages)) / jnp.maximum(n_valid, 1.0),
    }
    return {k: f32(v) for k, v in metrics.items()}
