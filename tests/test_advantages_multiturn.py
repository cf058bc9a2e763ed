"""Per-turn advantages: the per-turn-index baseline's hidden bonus for extra turns, and the
stopping-invariant baseline without it; NumPy reference, layouts, identities."""

import hypothesis.extra.numpy as hnp
import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax.advantages import mean_centered
from gagar_jax.advantages import multiturn as mt

# Compiled once per shape and static argument (the hypothesis strategies draw from 8 shapes):
# eager calls re-trace the vmapped group sums and dispatch every operation on every example.
per_turn_jit = jax.jit(mt.per_turn_advantages, static_argnames=("baseline", "num_groups"))


def _episodes(lengths, rewards, max_turns):
    """One group: per-turn reward lists -> [1, K, L] rewards and prefix masks."""
    k = len(lengths)
    r = np.zeros((1, k, max_turns), np.float32)
    m = np.zeros((1, k, max_turns), bool)
    for i, (n, rs) in enumerate(zip(lengths, rewards)):
        assert len(rs) == n
        r[0, i, :n], m[0, i, :n] = rs, True
    return r, m


def _reference(r, m, baseline):
    """Loops: returns-to-go and each baseline, straight from the formulas."""
    r = np.where(m, r, 0.0).astype(np.float64)
    out = np.zeros_like(r)
    for g in range(r.shape[0]):
        lengths = m[g].sum(-1)
        live = lengths > 0
        rtg = np.array([[r[g, i, t:].sum() for t in range(r.shape[2])] for i in range(r.shape[1])])
        for i in np.flatnonzero(live):
            for t in range(lengths[i]):
                if baseline == "stopping_invariant":
                    b = rtg[live, t].mean()  # stopped episodes have rtg 0 there
                    out[g, i, t] = rtg[i, t] - b
                else:
                    mus = [r[g, m[g, :, s], s].mean() for s in range(t, lengths[i])]
                    out[g, i, t] = rtg[i, t] - sum(mus)
    return out


def test_per_turn_index_gives_extra_turns_a_hidden_bonus_the_fixed_baseline_does_not():
    # A group of 8 episodes where talking longer earns nothing: every turn costs 0.1 and the
    # final outcome (1 or 0 on the last turn) does not depend on the length. Four stop after
    # one turn (returns 1 - .1, 0 - .1, twice each), four take two turns (1 - .2, 0 - .2).
    # True return difference long - short: -0.1, the extra step's cost.
    short = [[0.9], [0.9], [-0.1], [-0.1]]
    long_ = [[-0.1, 0.9], [-0.1, 0.9], [-0.1, -0.1], [-0.1, -0.1]]
    r, m = _episodes([1] * 4 + [2] * 4, short + long_, 3)
    gap = {}
    for baseline in mt.BASELINES:
        a = np.asarray(mt.per_turn_advantages(r, m, baseline=baseline))
        np.testing.assert_allclose(a, _reference(r, m, baseline), atol=1e-6)
        gap[baseline] = a[0, 4:, 0].mean() - a[0, :4, 0].mean()  # turn 0: continue vs stop
    true_gap = -0.1
    np.testing.assert_allclose(gap["stopping_invariant"], true_gap, atol=1e-6)
    # Per-turn index: the extra turn's index-1 mean is mu_1 = mean(0.9, 0.9, -0.1, -0.1) = 0.4,
    # so the gap is -0.1 - 0.4 = -0.5 here (the final rewards at index 1 penalise length) ...
    np.testing.assert_allclose(gap["per_turn_index"], true_gap - 0.4, atol=1e-6)

    # ... and with a +-1 outcome (mean 0), the extra turn's index holds outcomes minus the step
    # cost, mu_1 = -0.1: the hidden bonus -mu_1 = +0.1 exactly cancels the step cost, and the
    # per-turn-index estimator sees no cost in taking another turn.
    short = [[0.9], [0.9], [-1.1], [-1.1]]
    long_ = [[-0.1, 0.9], [-0.1, 0.9], [-0.1, -1.1], [-0.1, -1.1]]
    r, m = _episodes([1] * 4 + [2] * 4, short + long_, 2)
    for baseline, want in (("stopping_invariant", -0.1), ("per_turn_index", 0.0)):
        a = np.asarray(mt.per_turn_advantages(r, m, baseline=baseline))
        np.testing.assert_allclose(a, _reference(r, m, baseline), atol=1e-6)
        np.testing.assert_allclose(a[0, 4:, 0].mean() - a[0, :4, 0].mean(), want, atol=1e-6)


@st.composite
def episode_groups(draw):
    g = draw(st.sampled_from([1, 3]))
    k = draw(st.sampled_from([2, 5]))
    lmax = draw(st.sampled_from([1, 4]))
    lengths = draw(hnp.arrays(np.int32, (g, k), elements=st.integers(0, lmax)))
    m = np.arange(lmax)[None, None, :] < lengths[..., None]
    r = draw(hnp.arrays(np.float32, (g, k, lmax), elements=st.floats(-1, 1, width=32)))
    return r, m


@given(episode_groups(), st.sampled_from(mt.BASELINES))
def test_matches_reference_and_flat_layout(batch, baseline):
    r, m = batch
    a = np.asarray(per_turn_jit(r, m, baseline=baseline))
    np.testing.assert_allclose(a, _reference(r, m, baseline), atol=1e-5)
    assert np.all(a[~m] == 0) and np.all(np.isfinite(a))
    g, k, lmax = r.shape
    perm = np.random.default_rng(0).permutation(g * k)
    flat = per_turn_jit(
        r.reshape(g * k, lmax)[perm],
        m.reshape(g * k, lmax)[perm],
        baseline=baseline,
        group_ids=np.repeat(np.arange(g), k)[perm],
        num_groups=g,
    )
    np.testing.assert_allclose(np.asarray(flat), a.reshape(g * k, lmax)[perm], atol=1e-6)


@given(episode_groups())
def test_first_turn_is_mean_centred_return_and_sums_to_zero(batch):
    r, m = batch
    a = np.asarray(per_turn_jit(r, m))
    live = m.any(-1)
    returns = np.where(m, r, 0).sum(-1)
    np.testing.assert_allclose(a[..., 0], mean_centered(returns, live), atol=1e-5)
    # Every turn's advantages sum to zero over the group (stopped episodes count as 0).
    rtg = np.flip(np.cumsum(np.flip(np.where(m, r, 0), -1), -1), -1)
    centred = rtg - rtg.sum(1, keepdims=True) / np.maximum(live.sum(1), 1)[:, None, None]
    np.testing.assert_allclose(np.where(m, centred, 0), a, atol=1e-5)


def test_turns_to_tokens_and_bad_input():
    a = np.float32([[0.5, -0.25]])
    tok = np.array([[0, 0, 1, 1, 7]])
    mask = np.array([[1, 1, 0, 1, 0]], bool)
    np.testing.assert_array_equal(mt.turns_to_tokens(a, tok, mask), [[0.5, 0.5, 0, -0.25, 0]])
    r = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="prefix"):
        mt.per_turn_advantages(r, np.array([[[0, 1, 0], [1, 0, 0]]], bool))
    with pytest.raises(ValueError, match="baseline"):
        mt.per_turn_advantages(r, np.zeros((1, 2, 3), bool), baseline="x")
    with pytest.raises(ValueError, match="turn_mask"):
        mt.per_turn_advantages(r, np.zeros((1, 2, 4), bool))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
@pytest.mark.parametrize("baseline", mt.BASELINES)
def test_sharded_equals_unsharded(baseline):
    rng = np.random.default_rng(3)
    g, k, lmax = 8, 4, 5
    lengths = rng.integers(0, lmax + 1, size=(g, k))
    m = np.arange(lmax)[None, None, :] < lengths[..., None]
    r = rng.normal(size=(g, k, lmax)).astype(np.float32)
    want = np.asarray(mt.per_turn_advantages(r, m, baseline=baseline))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    got = mt.per_turn_advantages(
        jax.device_put(r, rows), jax.device_put(m, rows), baseline=baseline
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    # Flat layout, episodes sharded along N (groups split over devices).
    flat_rows = NamedSharding(mesh, P(("data", "fsdp"), None))
    flat = mt.per_turn_advantages(
        jax.device_put(r.reshape(g * k, lmax), flat_rows),
        jax.device_put(m.reshape(g * k, lmax), flat_rows),
        baseline=baseline,
        group_ids=jax.device_put(
            np.repeat(np.arange(g), k), NamedSharding(mesh, P(("data", "fsdp")))
        ),
        num_groups=g,
    )
    np.testing.assert_allclose(np.asarray(flat), want.reshape(g * k, lmax), rtol=1e-6, atol=1e-6)
