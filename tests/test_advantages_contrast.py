"""Contrastive token credit: distinguishing tokens and the credit moved onto them.

NumPy references (tests/advantages_reference.py), hypothesis properties (conservation, signs,
direction, identities) and the worked example of the module docstring.
"""

import advantages_reference as ref
import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax import advantages as adv

STRENGTHS = (0.0, 0.5, 1.0)  # static: each value compiles once


@st.composite
def groups(draw):
    """tokens [G, K, T] from a 3-token alphabet (so prefixes collide), mask, factors, passed."""
    g = draw(st.sampled_from([1, 2]))
    k = draw(st.sampled_from([2, 4]))
    t = draw(st.sampled_from([3, 6]))
    tokens = draw(hnp.arrays(np.int32, (g, k, t), elements=st.integers(0, 2)))
    mask = draw(hnp.arrays(bool, (g, k, t), elements=st.booleans()))
    factors = draw(hnp.arrays(np.float32, (g, k), elements=st.sampled_from([1.0, 0.6, 0.3])))
    passed = draw(hnp.arrays(bool, (g, k), elements=st.booleans()))
    valid = draw(hnp.arrays(bool, (g, k), elements=st.booleans()))
    return tokens, mask, factors, passed, valid


@st.composite
def rows(draw):
    """seq A*, base A [N], distinguishing and mask [N, T], strength."""
    n = draw(st.sampled_from([1, 4]))
    t = draw(st.sampled_from([1, 5, 12]))
    vals = st.one_of(
        st.sampled_from([0.0, 0.5, -0.5, 1.0]), st.floats(-3, 3, width=32, allow_subnormal=False)
    )
    seq = draw(hnp.arrays(np.float32, (n,), elements=vals))
    base = draw(hnp.arrays(np.float32, (n,), elements=vals))
    dist = draw(hnp.arrays(bool, (n, t), elements=st.booleans()))
    mask = draw(hnp.arrays(bool, (n, t), elements=st.booleans()))
    return seq, base, dist, mask, draw(st.sampled_from(STRENGTHS))


def _run(seq, base, dist, mask, strength, **kw):
    return np.asarray(adv.contrastive_tokens(seq, base, dist, mask, strength=strength, **kw))


def test_worked_example():
    # A group of three passes: "1 : a = x * 3" (T1, f 1), "1 : a = x \n ..." (T2, f 0.6) and a
    # copy of the T1 patch; tokens 0..2 are shared by all, the T1 rows part from the T2 row at
    # position 3. Base advantage 0.5 for every pass; Gagar gives A* = 0.5 f / mean(f) =
    # 0.5 / 0.8667 = 0.5769 (T1) and 0.3462 (T2).
    toks = np.array([[[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 4, 5]]], np.int32)
    mask = np.ones_like(toks, bool)
    f = np.float32([[1.0, 0.6, 1.0]])
    ones = np.ones((1, 3), bool)
    dist = np.asarray(adv.distinguishing_tokens(toks, mask, f, ones, ones))
    np.testing.assert_array_equal(dist[0, :, :3], False)
    np.testing.assert_array_equal(dist[0, :, 3:], True)
    a_star = np.float32([0.5 / 0.8666667, 0.3 / 0.8666667, 0.5 / 0.8666667])
    base = np.float32([0.5, 0.5, 0.5])
    out = _run(a_star, base, dist[0], mask[0], 1.0)
    # strength 1: shared tokens keep the base 0.5; the change (A* - 0.5) * 5 lands on 2 tokens.
    np.testing.assert_allclose(out[:, :3], 0.5, rtol=1e-6)
    np.testing.assert_allclose(out[0, 3:], 0.5 + (a_star[0] - 0.5) * 2.5, rtol=1e-6)
    np.testing.assert_allclose(out[1, 3:], 0.5 + (a_star[1] - 0.5) * 2.5, rtol=1e-6)
    np.testing.assert_allclose(out.mean(-1), a_star, rtol=1e-6)
    # At the state both parts share (position 3) the T1 token now gets 0.69 more than the T2
    # token; sequence-level Gagar gave 0.23 (A*_1 - A*_2).
    assert out[0, 3] - out[1, 3] == pytest.approx(2.5 * (a_star[0] - a_star[1]), rel=1e-5)


@given(groups())
def test_distinguishing_matches_numpy_reference(batch):
    tokens, mask, factors, passed, valid = batch
    got = np.asarray(adv.distinguishing_tokens(tokens, mask, factors, passed, valid))
    np.testing.assert_array_equal(
        got, ref.distinguishing_tokens(tokens, mask, factors, passed, valid)
    )


@given(groups())
def test_distinguishing_is_a_suffix_of_each_row(batch):
    # Once a row has parted from every pass of another factor, it never rejoins them.
    tokens, mask, factors, passed, valid = batch
    got = np.asarray(adv.distinguishing_tokens(tokens, np.ones_like(mask), factors, passed, valid))
    assert np.all(np.diff(got.astype(int), axis=-1) >= 0)
    assert not got[~(passed & valid)].any()


@given(rows())
def test_matches_numpy_reference(batch):
    seq, base, dist, mask, s = batch
    for keep_sign in (True, False):
        want = ref.contrastive_tokens(seq, base, dist, mask, s, keep_sign=keep_sign)
        got = _run(seq, base, dist, mask, s, keep_sign=keep_sign)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@given(rows())
def test_conserves_every_sequence_credit(batch):
    seq, base, dist, mask, s = batch
    for keep_sign in (True, False):
        out = _run(seq, base, dist, mask, s, keep_sign=keep_sign)
        n = mask.sum(-1)
        live = n > 0
        scale = 1 + np.abs(seq) + np.abs(base)
        np.testing.assert_allclose(
            (out.sum(-1)[live] - n[live] * seq[live]) / (n[live] * scale[live]), 0, atol=2e-6
        )
        assert np.all(out[~mask] == 0)
        assert np.all(np.isfinite(out))


@given(rows())
def test_keep_sign_and_direction(batch):
    seq, base, dist, mask, s = batch
    out = _run(seq, base, dist, mask, s)
    a = np.broadcast_to(seq[:, None], out.shape)
    on = mask & (a > 0)
    assert np.all(out[on] >= -1e-6 * np.abs(a[on]))
    for r in range(len(seq)):
        m, dm = mask[r], dist[r] & mask[r]
        if not (seq[r] > 0 and base[r] > 0 and 0 < dm.sum() < m.sum()) or s == 0:
            continue
        hi, lo = out[r][dm].min(), out[r][m & ~dm].max()
        if seq[r] > base[r]:
            assert hi >= lo - 1e-6
        elif seq[r] < base[r]:
            assert out[r][dm].max() <= out[r][m & ~dm].min() + 1e-6


@given(rows(), st.sampled_from(["zero_strength", "negative", "no_dist", "all_dist", "no_change"]))
def test_identities_give_exactly_the_broadcast(batch, case):
    seq, base, dist, mask, s = batch
    if case == "zero_strength":
        s = 0.0
    elif case == "negative":
        seq = -np.abs(seq)
    elif case == "no_dist":
        dist = np.zeros_like(dist)
    elif case == "all_dist":
        dist = np.ones_like(dist)
    else:
        base = seq.copy()
    out = _run(seq, base, dist, mask, s)
    np.testing.assert_array_equal(out, np.asarray(adv.broadcast_to_tokens(seq, mask)))


def test_one_factor_groups_have_nothing_to_contrast():
    toks = np.array([[[1, 2, 3], [1, 2, 4]]], np.int32)
    mask = np.ones_like(toks, bool)
    ones = np.ones((1, 2), bool)
    dist = adv.distinguishing_tokens(toks, mask, np.float32([[0.6, 0.6]]), ones, ones)
    out = _run(np.float32([0.5, 0.5]), np.float32([0.4, 0.4]), dist[0], mask[0], 1.0)
    np.testing.assert_array_equal(out, np.full((2, 3), 0.5, np.float32))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strength=1.5), "strength"),
        (dict(strength=True), "strength"),
        (dict(base_advantages=np.zeros(3, np.float32)), "base_advantages"),
        (dict(distinguishing=np.zeros((2, 5), bool)), "distinguishing"),
        (dict(mask=np.zeros((2, 4, 1), bool)), "mask"),
    ],
)
def test_bad_input_names_the_field(kwargs, message):
    args = dict(
        seq_advantages=np.zeros(2, np.float32),
        base_advantages=np.zeros(2, np.float32),
        distinguishing=np.zeros((2, 4), bool),
        mask=np.zeros((2, 4), bool),
        strength=0.5,
    )
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        adv.contrastive_tokens(**args)


def test_distinguishing_bad_input_names_the_field():
    toks = np.zeros((1, 2, 3), np.int32)
    m, f, b = np.ones((1, 2, 3), bool), np.ones((1, 2), np.float32), np.ones((1, 2), bool)
    with pytest.raises(TypeError, match="tokens"):
        adv.distinguishing_tokens(toks.astype(np.float32), m, f, b, b)
    with pytest.raises(ValueError, match="factors"):
        adv.distinguishing_tokens(toks, m, np.ones((1, 3), np.float32), b, b)
    with pytest.raises(ValueError, match="mask"):
        adv.distinguishing_tokens(toks, m[..., :2], f, b, b)
