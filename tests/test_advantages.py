"""Tests of gagar_jax.advantages against NumPy references, invariants and identities."""

import functools

import advantages_reference as ref
import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax import advantages as adv

ATOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Random ragged groups.


@st.composite
def graded_groups(draw, binary=None, max_groups=6, max_k=8):
    """A dense batch of ragged groups with grader outputs, as numpy arrays."""
    # A few fixed sizes (ragged groups come from `valid`): each new shape costs a jit compile.
    g = draw(st.sampled_from([1, max_groups]))
    k = draw(st.sampled_from([1, 4, max_k]))
    shape = (g, k)
    valid = draw(hnp.arrays(bool, shape, elements=st.booleans()))
    if binary is None:
        binary = draw(st.booleans())
    if binary:
        rewards = draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([0.0, 1.0])))
        passed = rewards > 0.5
    else:
        rewards = draw(hnp.arrays(np.float32, shape, elements=st.floats(0, 1, width=32)))
        passed = draw(hnp.arrays(bool, shape, elements=st.booleans()))
    cheat = draw(hnp.arrays(bool, shape, elements=st.sampled_from([False, False, False, True])))
    tier = draw(hnp.arrays(np.int32, shape, elements=st.integers(1, 3)))
    rank = draw(hnp.arrays(np.int32, shape, elements=st.integers(1, k)))
    graded = draw(hnp.arrays(bool, (g,), elements=st.booleans()))
    return dict(
        rewards=rewards,
        passed=passed,
        cheat=cheat,
        tier=tier,
        rank=rank,
        graded=graded,
        valid=valid,
    )


def flatten(batch, seed=0):
    """The same batch in the flat layout, rollouts shuffled across groups."""
    g, k = batch["valid"].shape
    perm = np.random.default_rng(seed).permutation(g * k)
    flat = {name: batch[name].reshape(-1)[perm] for name in batch if name != "graded"}
    flat["graded"] = batch["graded"]
    ids = np.repeat(np.arange(g), k)[perm]
    return flat, ids, perm


def assert_finite(*xs):
    for x in xs:
        assert np.all(np.isfinite(np.asarray(x))), x


# ---------------------------------------------------------------------------------------------
# Hand-worked values.


def test_worked_example_binary():
    # One group of 5: three passes (T1 rank 1, T2 rank 2, T3 rank 3), two failures.
    # mean = 3/5, so A = +0.4 on passes and -0.6 on failures. Factors (1.0, 0.6, 0.3);
    # mean_P(f) = 1.9/3, and A*_i = (1 - mean) f_i / mean_P(f) = 0.4 * 3 f_i / 1.9:
    # 1.2/1.9 = 0.631579, 0.72/1.9 = 0.378947, 0.36/1.9 = 0.189474 (sum 1.2 = S+).
    r = np.array([[1, 1, 1, 0, 0]], np.float32)
    group = dict(
        rewards=r,
        passed=r > 0,
        cheat=np.zeros_like(r, bool),
        tier=np.array([[1, 2, 3, 1, 1]]),
        rank=np.array([[1, 2, 3, 4, 4]]),
        graded=np.array([True]),
        valid=np.ones_like(r, bool),
    )
    out = adv.gagar_advantages(**group)
    np.testing.assert_allclose(
        out.advantages, [[1.2 / 1.9, 0.72 / 1.9, 0.36 / 1.9, -0.6, -0.6]], atol=1e-6
    )
    np.testing.assert_allclose(out.factors, [[1.0, 0.6, 0.3, 1.0, 1.0]])
    assert float(out.metrics["credit/max_conservation_error"]) < 1e-6
    # Discount only: 0.4 * (1, 0.6, 0.3) = (0.4, 0.24, 0.12): positive credit falls 1.2 -> 0.76
    # while the negative side stays -1.2, a credit ratio of 0.76 / 1.2 = 0.6333.
    out = adv.gagar_advantages(**group, config=adv.GagarConfig(mode="discount_only"))
    np.testing.assert_allclose(out.advantages, [[0.4, 0.24, 0.12, -0.6, -0.6]], atol=1e-6)
    np.testing.assert_allclose(out.metrics["credit/ratio"], 0.76 / 1.2, rtol=1e-6)


def test_rank_steps_within_tier():
    # T1 ranks 1, 2, 3 and T2 ranks 4, 4. T1 spans [1, 3]: positions 0, 0.5, 1, so with
    # rank_decay 0.5 and the T1->T2 gap 0.4: 1.0, 1.0 - 0.5*0.4*0.5 = 0.9, 1.0 - 0.2 = 0.8.
    # T2 ties at rank 4: both keep 0.6. Never below the next tier's 0.6.
    f = adv.discount_factors(
        np.array([[1, 1, 1, 2, 2]]),
        np.array([[1, 2, 3, 4, 4]]),
        np.ones((1, 5), bool),
        np.ones((1, 5), bool),
    )
    np.testing.assert_allclose(f.factors, [[1.0, 0.9, 0.8, 0.6, 0.6]], atol=1e-7)
    assert bool(f.ok[0])


def test_cheat_turns_mixed_group_all_fail():
    r = np.array([[1.0, 0.0, 0.0, 0.0]], np.float32)
    cheat = np.array([[True, False, False, False]])
    out = adv.gagar_advantages(
        r,
        r > 0,
        cheat,
        np.ones((1, 4), np.int32),
        np.ones((1, 4), np.int32),
        np.array([True]),
        np.ones((1, 4), bool),
    )
    assert not bool(out.keep[0])
    np.testing.assert_array_equal(out.advantages, 0.0)
    assert float(out.metrics["rollouts/cheats"]) == 1.0
    assert float(out.metrics["groups/mixed"]) == 0.0


# ---------------------------------------------------------------------------------------------
# Each kernel against its NumPy reference, with and without jit, dense and flat.


@functools.cache
def _pipeline_with_config(estimator, mode):
    """One callable per config, so the jitted variant compiles once for both seeds."""
    return functools.partial(
        adv.gagar_advantages, config=adv.GagarConfig(estimator=estimator, mode=mode)
    )


class KernelsTest(chex.TestCase, parameterized.TestCase):
    def _batch(self, seed, g=5, k=7):
        rng = np.random.default_rng(seed)
        valid = rng.random((g, k)) < 0.8
        rewards = (rng.random((g, k)) < 0.5).astype(np.float32)
        return rewards, valid, rng

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_group_stats(self, seed):
        r, v, _ = self._batch(seed)
        out = self.variant(adv.group_stats)(r, v)
        for got, want in zip(out, ref.stats(r, v), strict=True):
            np.testing.assert_allclose(got, want, atol=ATOL)
            self.assertEqual(got.dtype, jnp.float32)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_estimators(self, seed):
        r, v, _ = self._batch(seed)
        for fn, want in (
            (adv.mean_centered, ref.mean_centered),
            (adv.grpo_normalized, ref.grpo_normalized),
            (adv.rloo, ref.rloo),
        ):
            np.testing.assert_allclose(
                self.variant(fn)(r, v), want(r, v), atol=ATOL, err_msg=fn.__name__
            )

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_mixed_groups(self, seed):
        r, v, _ = self._batch(seed, g=12, k=3)
        np.testing.assert_array_equal(self.variant(adv.mixed_groups)(r, v), ref.mixed(r, v))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_discount_factors(self, seed):
        r, v, rng = self._batch(seed)
        tier = rng.integers(1, 4, r.shape)
        rank = rng.integers(1, 8, r.shape)
        out = self.variant(adv.discount_factors)(tier, rank, r > 0, v)
        want_f, want_ok = ref.factors(tier, rank, r > 0, v)
        np.testing.assert_allclose(out.factors, want_f, atol=1e-6)
        np.testing.assert_array_equal(out.ok, want_ok)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=(0, 1), mode=adv.REDISTRIBUTION_MODES)
    def test_redistribute(self, seed, mode):
        r, v, rng = self._batch(seed)
        a = ref.mean_centered(r, v)
        f = rng.uniform(0.2, 1.0, r.shape).astype(np.float32)
        fn = self.variant(functools.partial(adv.redistribute, mode=mode))
        np.testing.assert_allclose(
            fn(a, r > 0, f, v), ref.redistribute(a, r > 0, f, v, mode), atol=ATOL
        )

    @chex.variants(with_jit=True, without_jit=True)
    def test_broadcast_to_tokens(self):
        seq = np.array([0.5, -0.25, 0.0], np.float32)
        mask = np.array([[0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
        out = self.variant(adv.broadcast_to_tokens)(seq, mask)
        np.testing.assert_array_equal(out, seq[:, None] * mask)
        # Leading dims of any rank: a [G, K] advantage with a [G, K, T] mask.
        out = self.variant(adv.broadcast_to_tokens)(seq.reshape(1, 3), mask.reshape(1, 3, 4))
        self.assertEqual(out.shape, (1, 3, 4))

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=(0, 1), estimator=adv.ESTIMATORS, mode=adv.REDISTRIBUTION_MODES)
    def test_pipeline(self, seed, estimator, mode):
        r, v, rng = self._batch(seed, g=8, k=6)
        cheat = rng.random(r.shape) < 0.1
        tier, rank = rng.integers(1, 4, r.shape), rng.integers(1, 6, r.shape)
        graded = rng.random(r.shape[0]) < 0.7
        fn = self.variant(_pipeline_with_config(estimator, mode))
        out = fn(r, r > 0, cheat, tier, rank, graded, v)
        want, original, keep, applied = ref.pipeline(
            r, r > 0, cheat, tier, rank, graded, v, estimator=estimator, mode=mode
        )
        np.testing.assert_allclose(out.advantages, want, atol=ATOL)
        np.testing.assert_allclose(out.original, original, atol=ATOL)
        np.testing.assert_array_equal(out.keep, keep)
        np.testing.assert_array_equal(out.applied, applied)


# ---------------------------------------------------------------------------------------------
# Invariants over random ragged groups (hypothesis).


def _redistributed(batch, mode="sum_preserving"):
    out = adv.gagar_advantages(**batch, config=adv.GagarConfig(mode=mode))
    return out, np.asarray(out.original), np.asarray(out.advantages)


@given(graded_groups())
def test_invariants_sum_preserving(batch):
    out, before, after = _redistributed(batch)
    assert_finite(after, *out.metrics.values())
    valid, passed = batch["valid"], np.asarray(out.passed)
    keep, applied = np.asarray(out.keep), np.asarray(out.applied)
    # Masked slots and filtered groups are exactly zero.
    assert np.all(after[~valid] == 0.0)
    assert np.all(after[~keep] == 0.0)
    for g in np.flatnonzero(keep):
        p, f = passed[g] & valid[g], valid[g] & ~passed[g]
        # Sum over the passing set preserved; failed side unchanged (bit-exact); group sum zero.
        np.testing.assert_allclose(after[g][p].sum(), before[g][p].sum(), atol=1e-5)
        np.testing.assert_array_equal(after[g][f], before[g][f])
        np.testing.assert_allclose(after[g].sum(), 0.0, atol=1e-5)
        if applied[g]:
            # Ratios: A*_i / A*_j = f_i A_i / (f_j A_j) (= f_i / f_j for binary rewards).
            fac = np.asarray(out.factors)[g][p]
            base = before[g][p]
            if p.any() and np.all(base > 0):
                np.testing.assert_allclose(
                    after[g][p] / after[g][p][0], fac * base / (fac[0] * base[0]), rtol=1e-4
                )
    assert float(out.metrics["credit/max_conservation_error"]) < 1e-5


@given(graded_groups(binary=True))
def test_binary_closed_form(batch):
    # For binary rewards: A*_i = (1 - mean R) f_i / mean_P(f) on the passing set of applied groups.
    out, _, after = _redistributed(batch)
    passed, valid = np.asarray(out.passed), batch["valid"]
    rewards = np.asarray(out.rewards)
    for g in np.flatnonzero(np.asarray(out.applied)):
        p = passed[g] & valid[g]
        mean = rewards[g][valid[g]].mean()
        f = np.asarray(out.factors)[g][p]
        np.testing.assert_allclose(after[g][p], (1 - mean) * f / f.mean(), rtol=1e-5, atol=1e-6)


@given(graded_groups(binary=True))
def test_discount_only_shrinks_positive_credit(batch):
    # Binary rewards: every passing advantage is positive, so discounting only removes credit.
    out, before, after = _redistributed(batch, mode="discount_only")
    passed = np.asarray(out.passed)
    assert_finite(after)
    # Every passing advantage is scaled by f in (0, 1]: never grows in magnitude.
    assert np.all(np.abs(after[passed]) <= np.abs(before[passed]) + 1e-7)
    assert float(out.metrics["credit/ratio"]) <= 1.0 + 1e-6


@given(graded_groups(), st.integers(0, 2**31 - 1))
def test_permutation_equivariance(batch, seed):
    # Shuffling rollouts inside each group shuffles the advantages the same way.
    rng = np.random.default_rng(seed)
    g, k = batch["valid"].shape
    perm = np.stack([rng.permutation(k) for _ in range(g)])
    shuffled = {n: (np.take_along_axis(x, perm, 1) if x.ndim == 2 else x) for n, x in batch.items()}
    a = np.asarray(adv.gagar_advantages(**batch).advantages)
    b = np.asarray(adv.gagar_advantages(**shuffled).advantages)
    np.testing.assert_allclose(np.take_along_axis(a, perm, 1), b, atol=1e-6)


@given(graded_groups())
def test_flat_equals_dense(batch):
    dense = adv.gagar_advantages(**batch)
    flat, ids, perm = flatten(batch)
    out = adv.gagar_advantages(**flat, group_ids=ids, num_groups=batch["valid"].shape[0])
    np.testing.assert_allclose(
        out.advantages, np.asarray(dense.advantages).reshape(-1)[perm], atol=1e-6
    )
    np.testing.assert_array_equal(out.keep, dense.keep)
    np.testing.assert_array_equal(out.applied, dense.applied)
    for key in dense.metrics:
        np.testing.assert_allclose(out.metrics[key], dense.metrics[key], atol=1e-5, err_msg=key)


@functools.partial(jax.jit, static_argnames="num_groups")
def _each_kernel_flat_and_dense(flat, ids, dense, num_groups):
    """Every kernel on the flat layout and on the dense one: one program per batch shape."""
    lay = dict(group_ids=ids, num_groups=num_groups)
    fr, fv, r, v = flat["rewards"], flat["valid"], dense["rewards"], dense["valid"]
    kernels = (adv.mean_centered, adv.grpo_normalized, adv.rloo)
    return dict(
        estimators=[(fn(fr, fv, **lay), fn(r, v)) for fn in kernels],
        stats=(adv.group_stats(fr, fv, **lay), adv.group_stats(r, v)),
        mixed=(adv.mixed_groups(fr, fv, **lay), adv.mixed_groups(r, v)),
        factors=(
            adv.discount_factors(flat["tier"], flat["rank"], flat["passed"], fv, **lay),
            adv.discount_factors(dense["tier"], dense["rank"], dense["passed"], v),
        ),
    )


@given(graded_groups())
def test_flat_equals_dense_each_kernel(batch):
    flat, ids, perm = flatten(batch, seed=1)
    g = batch["valid"].shape[0]
    dense = {name: batch[name] for name in ("rewards", "valid", "tier", "rank", "passed")}
    flat = {name: flat[name] for name in dense}
    out = _each_kernel_flat_and_dense(flat, ids, dense, num_groups=g)
    for got, want in out["estimators"]:
        np.testing.assert_allclose(got, np.asarray(want).reshape(-1)[perm], atol=1e-5)
    for got, want in zip(*out["stats"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(*out["mixed"])
    f_flat, f_dense = out["factors"]
    np.testing.assert_allclose(f_flat.factors, np.asarray(f_dense.factors).reshape(-1)[perm])
    np.testing.assert_array_equal(f_flat.ok, f_dense.ok)


@given(graded_groups())
def test_pipeline_matches_reference(batch):
    out = adv.gagar_advantages(**batch)
    want, *_ = ref.pipeline(**batch)
    np.testing.assert_allclose(out.advantages, want, atol=1e-5)


@given(graded_groups(), st.sampled_from([0.0, 0.3, 0.5, 0.9]))
def test_factors_in_range_and_monotone(batch, rank_decay):
    out = adv.discount_factors(
        batch["tier"], batch["rank"], batch["passed"], batch["valid"], rank_decay=rank_decay
    )
    f = np.asarray(out.factors)
    assert np.all((f > 0) & (f <= 1))
    p = batch["passed"] & batch["valid"]
    tier, rank = batch["tier"], batch["rank"]
    for g in range(f.shape[0]):
        idx = np.flatnonzero(p[g])
        for i in idx:
            for j in idx:
                better = (tier[g, i], rank[g, i]) <= (tier[g, j], rank[g, j])
                if better and tier[g, i] <= tier[g, j]:
                    assert f[g, i] >= f[g, j] - 1e-7  # a better (tier, rank) never gets less weight
                if tier[g, i] < tier[g, j]:
                    assert f[g, i] > f[g, j]  # ranks never cross into the next tier
                if (tier[g, i], rank[g, i]) == (tier[g, j], rank[g, j]):
                    assert f[g, i] == f[g, j]  # ties get equal factors


@given(graded_groups())
def test_equivalent_rewards_reproduce_advantages(batch):
    out = adv.gagar_advantages(**batch)
    r_star = adv.equivalent_rewards(out.rewards, out.advantages, batch["valid"])
    keep = np.asarray(out.keep)
    recovered = np.asarray(adv.mean_centered(r_star, batch["valid"]))
    np.testing.assert_allclose(recovered[keep], np.asarray(out.advantages)[keep], atol=1e-5)
    # The group mean reward is unchanged.
    np.testing.assert_allclose(
        adv.group_stats(r_star, batch["valid"]).mean,
        adv.group_stats(out.rewards, batch["valid"]).mean,
        atol=1e-5,
    )


# ---------------------------------------------------------------------------------------------
# Identities between functions.


@given(graded_groups(), st.floats(0.05, 1.0))
def test_equal_factors_is_identity(batch, c):
    a = adv.mean_centered(batch["rewards"], batch["valid"])
    f = np.full(batch["valid"].shape, c, np.float32)
    out = adv.redistribute(a, batch["passed"], f, batch["valid"])
    np.testing.assert_array_equal(out, a)  # exactly, not approximately


def test_single_passing_rollout_unchanged():
    a = np.array([[0.75, -0.25, -0.25, -0.25]], np.float32)
    passed = np.array([[True, False, False, False]])
    out = adv.redistribute(a, passed, np.array([[0.3, 1, 1, 1]], np.float32), np.ones((1, 4), bool))
    np.testing.assert_array_equal(out, a)


@jax.jit  # one program per shape, not one per operation and shape
def _rloo_and_mean_centered(r, v):
    return adv.rloo(r, v), adv.mean_centered(r, v)


@given(st.sampled_from([1, 3]), st.sampled_from([2, 5, 9]), st.integers(0, 2**31 - 1))
def test_rloo_is_scaled_mean_centered(g, k, seed):
    r = np.random.default_rng(seed).random((g, k)).astype(np.float32)
    v = np.ones((g, k), bool)
    rloo, centered = _rloo_and_mean_centered(r, v)
    np.testing.assert_allclose(rloo, k / (k - 1) * np.asarray(centered), atol=1e-5)


def test_mode_none_and_ungraded_fall_back():
    r = np.array([[1, 1, 0, 0]], np.float32)
    batch = dict(
        rewards=r,
        passed=r > 0,
        cheat=np.zeros_like(r, bool),
        tier=np.array([[1, 3, 1, 1]]),
        rank=np.array([[1, 2, 3, 3]]),
        valid=np.ones_like(r, bool),
    )
    base = adv.mean_centered(r, batch["valid"])
    ungraded = adv.gagar_advantages(**batch, graded=np.array([False]))
    np.testing.assert_array_equal(ungraded.advantages, base)
    assert float(ungraded.metrics["groups/fallback_ungraded"]) == 1.0
    none = adv.gagar_advantages(
        **batch, graded=np.array([True]), config=adv.GagarConfig(mode="none")
    )
    np.testing.assert_array_equal(none.advantages, base)


# ---------------------------------------------------------------------------------------------
# Degenerate and bad input.


@pytest.mark.parametrize("case", ["all_pass", "all_fail", "single", "empty", "nan"])
def test_degenerate_groups_finite(case):
    k = 4
    r = {
        "all_pass": [1, 1, 1, 1],
        "all_fail": [0, 0, 0, 0],
        "single": [1, 0, 0, 0],
        "empty": [1, 0, 1, 0],
        "nan": [np.nan, 1, 0, np.inf],
    }[case]
    r = np.array([r], np.float32)
    valid = np.array([[True, False, False, False]]) if case == "single" else np.ones((1, k), bool)
    if case == "empty":
        valid[:] = False
    out = adv.gagar_advantages(
        r,
        np.nan_to_num(r) > 0,
        np.zeros((1, k), bool),
        np.ones((1, k), np.int32),
        np.ones((1, k), np.int32),
        np.array([True]),
        valid,
    )
    for x in (out.advantages, out.original, out.factors, *out.metrics.values()):
        assert_finite(x)
    if case == "nan":
        # The NaN/inf rollouts are masked out and counted; the rest is a mixed group of 2.
        assert float(out.metrics["rollouts/nonfinite_reward"]) == 2.0
        np.testing.assert_allclose(out.advantages, [[0.0, 0.5, -0.5, 0.0]])
    else:
        np.testing.assert_array_equal(out.advantages, 0.0)


def test_invalid_verdict_raises_eagerly_and_falls_back_under_jit():
    r = np.array([[1, 1, 0, 0]], np.float32)
    tier = np.array([[1, 7, 1, 1]])
    with pytest.raises(ValueError, match=r"tier: expected 1..3 .* got 7 at index \(0, 1\)"):
        adv.discount_factors(tier, np.ones((1, 4), int), r > 0, np.ones((1, 4), bool))
    with pytest.raises(ValueError, match=r"rank: expected >= 1"):
        adv.discount_factors(
            np.ones((1, 4), int), np.zeros((1, 4), int), r > 0, np.ones((1, 4), bool)
        )
    out = jax.jit(adv.discount_factors)(tier, np.ones((1, 4), int), r > 0, np.ones((1, 4), bool))
    assert not bool(out.ok[0])
    np.testing.assert_array_equal(out.factors, 1.0)
    # The pipeline is jitted: the bad group falls back to its original advantages and is counted.
    full = adv.gagar_advantages(
        r,
        r > 0,
        np.zeros((1, 4), bool),
        tier,
        np.ones((1, 4), np.int32),
        np.array([True]),
        np.ones((1, 4), bool),
    )
    np.testing.assert_array_equal(full.advantages, [[0.5, 0.5, -0.5, -0.5]])
    assert float(full.metrics["groups/fallback_invalid_verdict"]) == 1.0
    # A tier outside the passing set is ignored.
    adv.discount_factors(
        np.array([[1, 1, 9, 9]]), np.ones((1, 4), int), r > 0, np.ones((1, 4), bool)
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: adv.mean_centered(np.zeros((2, 3)), np.ones((2, 4), bool)),
            r"valid: expected shape \[G, K\]=\[2, 3\], got \[2, 4\]",
        ),
        (
            lambda: adv.mean_centered(np.zeros(6), np.ones(6, bool)),
            r"rewards: expected shape \[G, K\]",
        ),
        (
            lambda: adv.mean_centered(np.zeros(6), np.ones(6, bool), group_ids=np.zeros(6, int)),
            r"num_groups: expected a static Python int",
        ),
        (
            lambda: adv.mean_centered(
                np.zeros(3), np.ones(3, bool), group_ids=np.array([0, 1, 5]), num_groups=2
            ),
            r"group_ids: expected values in \[0, num_groups=2\)",
        ),
        (
            lambda: adv.redistribute(
                np.zeros((1, 2)), np.ones((1, 2), bool), np.zeros((1, 2)), np.ones((1, 2), bool)
            ),
            r"factors: expected values in \(0, 1\]",
        ),
        (
            lambda: adv.redistribute(
                np.zeros((1, 2)),
                np.ones((1, 2), bool),
                np.ones((1, 2)),
                np.ones((1, 2), bool),
                mode="sum",
            ),
            r"mode: expected one of",
        ),
        (
            lambda: adv.broadcast_to_tokens(np.zeros(3), np.ones((4, 5))),
            r"response_mask: expected shape \[3, 'T'\]",
        ),
        (lambda: adv.mean_centered(np.zeros((1, 2)), np.array([[0, 2]])), r"valid: expected 0/1"),
        (lambda: adv.GagarConfig(tier_factors=(1.0, 0.3, 0.6)), r"tier_factors: expected 1 >= T1"),
        (lambda: adv.GagarConfig(rank_decay=1.0), r"rank_decay: expected a value in \[0, 1\)"),
        (lambda: adv.GagarConfig(estimator="ppo"), r"estimator: expected one of"),
        (lambda: adv.GagarConfig.from_mapping({"modee": "none"}), r"unknown keys \['modee'\]"),
        (
            lambda: adv.gagar_advantages(
                np.zeros((2, 3)),
                np.zeros((2, 3), bool),
                np.zeros((2, 3), bool),
                np.ones((2, 3), int),
                np.ones((2, 3), int),
                np.ones(3, bool),
                np.ones((2, 3), bool),
            ),
            r"graded: expected shape \[G\]=\[2\]",
        ),
    ],
)
def test_bad_input_names_the_field(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_config_is_hashable_and_normalised():
    a = adv.GagarConfig.from_mapping({"tier_factors": [1.0, 0.5, 0.25]})
    b = adv.GagarConfig(tier_factors=(1, 0.5, 0.25))
    assert a == b and hash(a) == hash(b)


def test_dtypes_accumulate_in_float32():
    r = jnp.array([[1, 0, 1, 0]], jnp.bfloat16)
    a = adv.mean_centered(r, jnp.ones((1, 4), bool))
    assert a.dtype == jnp.float32
    out = adv.gagar_advantages(
        r,
        r > 0,
        jnp.zeros((1, 4), bool),
        jnp.ones((1, 4), jnp.int8),
        jnp.ones((1, 4), jnp.int16),
        jnp.array([True]),
        jnp.ones((1, 4), bool),
    )
    assert out.advantages.dtype == jnp.float32


def test_no_retrace_across_new_values():
    fn = chex.assert_max_traces(adv.gagar_advantages.__wrapped__, n=1)
    jitted = jax.jit(fn, static_argnames=("config", "num_groups"))
    rng = np.random.default_rng(0)
    for _ in range(4):
        r = (rng.random((4, 8)) < 0.5).astype(np.float32)
        jitted(
            r,
            r > 0,
            rng.random((4, 8)) < 0.1,
            rng.integers(1, 4, (4, 8)).astype(np.int32),
            rng.integers(1, 9, (4, 8)).astype(np.int32),
            rng.random(4) < 0.5,
            rng.random((4, 8)) < 0.9,
        )


def test_differentiable_wrt_rewards():
    # Kernels are usable under grad (e.g. for learned reward models); gradients are finite.
    r = np.array([[1.0, 0.6, 0.0, 0.2]], np.float32)

    def loss(rewards):
        out = adv.gagar_advantages(
            rewards,
            np.array([[True, True, False, False]]),
            np.zeros((1, 4), bool),
            np.array([[1, 2, 1, 1]], np.int32),
            np.array([[1, 2, 3, 3]], np.int32),
            np.array([True]),
            np.ones((1, 4), bool),
        )
        return jnp.sum(out.advantages**2)

    assert_finite(jax.grad(loss)(r))
