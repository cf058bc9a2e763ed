"""Token-level credit redistribution: NumPy reference, properties, identities, sharding."""

import advantages_reference as ref
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import advantages as adv

GAMMAS = (0.0, 0.25, 0.5, 0.9, 1.0)  # static: each value compiles once


@st.composite
def token_batches(draw, rows=(1, 4), lengths=(1, 5, 12)):
    """seq [N], importance [N, T], mask [N, T] with ties, zeros, constant and empty rows."""
    n = draw(st.sampled_from(rows))
    t = draw(st.sampled_from(lengths))
    seq = draw(
        hnp.arrays(
            np.float32,
            (n,),
            elements=st.one_of(
                st.sampled_from([0.0, 0.5, -0.5, 1.0]),
                st.floats(-3, 3, width=32, allow_subnormal=False),
            ),
        )
    )
    kind = draw(st.sampled_from(["floats", "ties", "zeros", "constant"]))
    if kind == "floats":
        imp = draw(
            hnp.arrays(
                np.float32, (n, t), elements=st.floats(0, 10, width=32, allow_subnormal=False)
            )
        )
    elif kind == "ties":
        imp = draw(hnp.arrays(np.float32, (n, t), elements=st.sampled_from([0.0, 1.0, 2.5])))
    elif kind == "zeros":
        imp = np.zeros((n, t), np.float32)
    else:
        imp = np.full((n, t), draw(st.sampled_from([0.01, 0.1, 3.0])), np.float32)
    mask = draw(hnp.arrays(bool, (n, t), elements=st.booleans()))
    gamma = draw(st.sampled_from(GAMMAS))
    return seq, imp, mask, gamma


def _run(seq, imp, mask, gamma, **kw):
    return np.asarray(adv.redistribute_tokens(seq, imp, mask, gamma=gamma, **kw))


# ---------------------------------------------------------------------------------------------
# Hand-worked value.


def test_worked_example():
    # One sequence, A = 0.6, four tokens with importance (0, 1, 1, 2): mean 1, deviations
    # (-1, 0, 0, 1), max |dev| = 1, so z = (-1, 0, 0, 1); gamma = 0.5 gives weights
    # c = (0.5, 1, 1, 1.5) and token advantages 0.6 c = (0.3, 0.6, 0.6, 0.9), mean 0.6.
    out = _run(
        np.float32([0.6]), np.float32([[0, 1, 1, 2, 7]]), np.array([[1, 1, 1, 1, 0]], bool), 0.5
    )
    np.testing.assert_allclose(out, [[0.3, 0.6, 0.6, 0.9, 0.0]], rtol=1e-6)


def test_close_importances_keep_their_exact_weights():
    # Two importances 0.3% apart: z = (-1, +1) exactly, so gamma = 0.5 gives c = (0.5, 1.5).
    # The float32 mean of the values themselves is off by half an ulp of 6 (2.5e-5 of their
    # spread), which the kernel does not let into z.
    imp = np.float32([[6.0625, 6.0818706, 0.0]])
    out = _run(np.float32([0.5]), imp, np.array([[True, True, False]]), 0.5)
    np.testing.assert_allclose(out, [[0.25, 0.75, 0.0]], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# Properties.


@given(token_batches())
def test_matches_numpy_reference(batch):
    seq, imp, mask, gamma = batch
    for negative in adv.tokens.NEGATIVE_MODES:
        want = ref.redistribute_tokens(seq, imp, mask, gamma, negative=negative)
        got = _run(seq, imp, mask, gamma, negative=negative)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@given(token_batches())
def test_token_mean_conserves_sequence_advantage(batch):
    seq, imp, mask, gamma = batch
    for negative in adv.tokens.NEGATIVE_MODES:
        out = _run(seq, imp, mask, gamma, negative=negative)
        n_tok = mask.sum(-1)
        live = n_tok > 0
        mean = out.sum(-1)[live] / n_tok[live]
        np.testing.assert_allclose(mean, seq[live], rtol=1e-5, atol=1e-6)


@given(token_batches())
def test_signs_zero_off_mask_and_finite(batch):
    seq, imp, mask, gamma = batch
    out = _run(seq, imp, mask, gamma, negative="redistribute")
    assert np.all(np.isfinite(out))
    assert np.all(out[~mask] == 0.0)
    a = np.broadcast_to(seq[:, None], out.shape)
    on = mask & (a != 0)
    if gamma < 1:
        np.testing.assert_array_equal(np.sign(out[on]), np.sign(a[on]))
    else:  # gamma = 1 may zero the least important token, never flip its sign
        assert np.all(out[on] * a[on] >= 0)


@given(token_batches())
def test_weights_bounded(batch):
    seq, imp, mask, gamma = batch
    out = _run(seq, imp, mask, gamma, negative="redistribute")
    a = np.broadcast_to(seq[:, None], out.shape).astype(np.float64)
    on = mask & (np.abs(a) > 1e-6)
    c = out[on] / a[on]
    tol = 1e-6
    assert np.all(c >= 1 - gamma - tol) and np.all(c <= 1 + gamma + tol), (c, gamma)


@given(token_batches())
def test_more_important_never_less_credit(batch):
    seq, imp, mask, gamma = batch
    out = _run(seq, imp, mask, gamma)
    for n in np.flatnonzero(seq > 0):
        idx = np.flatnonzero(mask[n])
        w, a = imp[n, idx], out[n, idx]
        more = w[:, None] > w[None, :]
        # exact, not approximate: the kernel is monotone in float arithmetic
        assert np.all((a[:, None] >= a[None, :])[more])


@given(token_batches(), st.sampled_from(["zero_gamma", "constant", "zeros", "uniform"]))
def test_identities_give_exactly_the_broadcast(batch, case):
    seq, imp, mask, gamma = batch
    if case == "zero_gamma":
        gamma = 0.0
    elif case == "constant":
        imp = np.full_like(imp, 0.1)
    elif case == "zeros":
        imp = np.zeros_like(imp)
    else:
        imp = np.asarray(adv.UniformImportance()(adv.ImportanceInputs(mask=jnp.asarray(mask))))
    want = np.asarray(adv.broadcast_to_tokens(seq, mask))
    for negative in adv.tokens.NEGATIVE_MODES:
        np.testing.assert_array_equal(_run(seq, imp, mask, gamma, negative=negative), want)


@given(token_batches())
def test_negative_sequences_broadcast_by_default(batch):
    seq, imp, mask, gamma = batch
    out = _run(seq, imp, mask, gamma)
    want = np.asarray(adv.broadcast_to_tokens(seq, mask))
    np.testing.assert_array_equal(out[seq <= 0], want[seq <= 0])


@given(token_batches(), st.integers(0, 2**31 - 1))
def test_token_weights_variant_conserves_the_weighted_sum(batch, seed):
    seq, imp, mask, gamma = batch
    ow = np.random.default_rng(seed).random(imp.shape).astype(np.float32) * 3
    out = _run(seq, imp, mask, gamma, token_weights=ow)
    np.testing.assert_allclose(
        out, ref.redistribute_tokens(seq, imp, mask, gamma, token_weights=ow), rtol=1e-5, atol=1e-6
    )
    o = np.where(mask, ow, 0.0).astype(np.float64)
    np.testing.assert_allclose((o * out).sum(-1), seq * o.sum(-1), rtol=1e-5, atol=1e-5)
    # Unit weights on the mask are the default variant.
    np.testing.assert_array_equal(
        _run(seq, imp, mask, gamma, token_weights=np.ones_like(ow)), _run(seq, imp, mask, gamma)
    )


@given(token_batches(rows=(4,)))
def test_group_major_equals_flat(batch):
    seq, imp, mask, gamma = batch
    t = imp.shape[-1]
    dense = _run(seq.reshape(2, 2), imp.reshape(2, 2, t), mask.reshape(2, 2, t), gamma)
    np.testing.assert_array_equal(dense.reshape(4, t), _run(seq, imp, mask, gamma))


@given(token_batches())
def test_rows_are_independent_permutation_equivariant(batch):
    seq, imp, mask, gamma = batch
    perm = np.arange(seq.shape[0])[::-1]
    out = _run(seq, imp, mask, gamma)
    np.testing.assert_array_equal(_run(seq[perm], imp[perm], mask[perm], gamma), out[perm])


def test_empty_rows_and_degenerate_importance_are_finite():
    seq = np.float32([1.0, -1.0, 0.7, 0.7])
    mask = np.array([[0, 0, 0], [1, 1, 1], [1, 0, 1], [1, 1, 0]], bool)
    imp = np.float32([[5, 5, 5], [0, 0, 0], [3, 3, 3], [1e-30, 0, 9]])
    out = _run(seq, imp, mask, 1.0)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0], 0.0)  # empty row
    np.testing.assert_array_equal(out[2], np.float32([0.7, 0.0, 0.7]))  # constant on the mask
    # Row 3: importance (1e-30, 0) -> mean 5e-31, z = (+1, -1): weights (2, 0) at gamma 1.
    np.testing.assert_allclose(out[3], [1.4, 0.0, 0.0], rtol=1e-6)


def test_under_an_outer_jit_and_no_retrace_across_values():
    seq, imp = np.float32([0.5, 1.0]), np.float32([[1, 2, 3], [3, 2, 1]])
    mask = np.ones((2, 3), bool)
    fn = jax.jit(lambda s, i, m: adv.redistribute_tokens(s, i, m, gamma=0.5))
    np.testing.assert_allclose(fn(seq, imp, mask), _run(seq, imp, mask, 0.5), rtol=1e-6)
    before = adv.tokens._redistribute_tokens._cache_size()
    adv.redistribute_tokens(seq * 2, imp + 1, mask, gamma=0.5)
    adv.redistribute_tokens(seq * 3, imp * 2, mask, gamma=0.5)
    assert adv.tokens._redistribute_tokens._cache_size() <= before + 1


def test_gradient_flows_to_sequence_advantages_only_linearly():
    seq, imp = np.float32([0.5, -0.2]), np.float32([[1, 2, 4], [3, 2, 1]])
    mask = np.ones((2, 3), bool)
    g = jax.grad(lambda s: adv.redistribute_tokens(s, imp, mask, gamma=0.5).sum())(seq)
    np.testing.assert_allclose(g, [3.0, 3.0], rtol=1e-6)  # sum_t c_t = T


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq=np.zeros(3), imp=np.zeros((3, 4)), mask=np.ones((2, 4), bool)), "mask: expected"),
        (dict(seq=np.zeros(2), imp=np.zeros((2, 5)), mask=np.ones((2, 4), bool)), "importance:"),
        (dict(seq=np.zeros(2), imp=-np.ones((2, 4)), mask=np.ones((2, 4), bool)), ">= 0"),
        (
            dict(seq=np.zeros(2), imp=np.full((2, 4), np.nan), mask=np.ones((2, 4), bool)),
            "importance: expected finite",
        ),
        (
            dict(seq=np.zeros(2), imp=np.ones((2, 4)), mask=np.ones((2, 4), bool), gamma=1.5),
            "gamma",
        ),
        (
            dict(seq=np.zeros(2), imp=np.ones((2, 4)), mask=np.ones((2, 4), bool), negative="x"),
            "negative",
        ),
        (
            dict(seq=np.zeros(2), imp=np.ones((2, 4)), mask=np.ones((2, 4), bool), ow=np.ones(4)),
            "token_weights",
        ),
    ],
)
def test_bad_input_names_the_field(kwargs, message):
    kw = dict(gamma=kwargs.get("gamma", 0.5), negative=kwargs.get("negative", "broadcast"))
    if "ow" in kwargs:
        kw["token_weights"] = kwargs["ow"]
    with pytest.raises((ValueError, TypeError), match=message):
        adv.redistribute_tokens(kwargs["seq"], kwargs["imp"], kwargs["mask"], **kw)


def test_masked_off_garbage_is_ignored():
    seq, mask = np.float32([1.0]), np.array([[1, 1, 0]], bool)
    imp = np.float32([[1, 2, np.nan]])  # NaN off the mask: fine
    np.testing.assert_allclose(_run(seq, imp, mask, 0.5), [[0.5, 1.5, 0.0]], rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Providers and diagnostics.


def test_providers_follow_the_protocol():
    mask = jnp.asarray(np.array([[1, 1, 1, 0]], bool))
    inputs = adv.ImportanceInputs(
        mask=mask,
        entropy=jnp.float32([[0.1, 2.0, 0.5, 9.0]]),
        evidence=jnp.asarray(np.array([[0, 1, 0, 1]], bool)),
    )
    for name, provider in adv.IMPORTANCE_PROVIDERS.items():
        assert isinstance(provider, adv.ImportanceProvider) and provider.name == name
        imp = np.asarray(provider(inputs))
        assert imp.shape == (1, 4) and np.all(imp >= 0) and imp[0, 3] == 0  # 0 off the mask
    np.testing.assert_array_equal(adv.importance_provider("evidence")(inputs), [[1, 0, 1, 0]])
    np.testing.assert_allclose(adv.importance_provider("entropy")(inputs), [[0.1, 2.0, 0.5, 0]])
    with pytest.raises(ValueError, match="importance: expected one of"):
        adv.importance_provider("bogus")
    with pytest.raises(ValueError, match="evidence"):
        adv.EvidenceImportance()(adv.ImportanceInputs(mask=mask))


def test_evidence_moves_positive_credit_off_cited_tokens():
    # A = 0.4 on five tokens, tokens 1-2 cited: importance (1, 0, 0, 1, 1), mean 0.6,
    # deviations (0.4, -0.6, -0.6, 0.4, 0.4), max 0.6: z = (2/3, -1, -1, 2/3, 2/3); gamma 0.6
    # gives c = (1.4, 0.4, 0.4, 1.4, 1.4): cited share of the credit 0.8 / 5 = 0.16 (was 0.4).
    mask = np.ones((1, 5), bool)
    ev = np.array([[0, 1, 1, 0, 0]], bool)
    imp = adv.EvidenceImportance()(adv.ImportanceInputs(mask=jnp.asarray(mask), evidence=ev))
    out = adv.redistribute_tokens(np.float32([0.4]), imp, mask, gamma=0.6)
    np.testing.assert_allclose(out, [[0.56, 0.16, 0.16, 0.56, 0.56]], rtol=1e-5)
    tc = adv.token_credit(out, np.float32([0.4]), mask, ev)
    np.testing.assert_allclose(tc.positive_on_evidence / tc.positive, [0.16], rtol=1e-5)
    np.testing.assert_allclose(tc.error_sum, [0.0], atol=1e-6)


@given(token_batches())
def test_gini_matches_pairwise_reference(batch):
    seq, imp, mask, gamma = batch
    np.testing.assert_allclose(adv.token_gini(imp, mask), ref.gini(imp, mask), atol=1e-5)


def test_gini_of_the_broadcast_is_zero_and_grows_with_gamma():
    mask = np.ones((1, 8), bool)
    imp = np.arange(8, dtype=np.float32)[None]
    ginis = [float(adv.token_gini(_run(np.float32([1.0]), imp, mask, g), mask)[0]) for g in GAMMAS]
    assert ginis[0] == 0.0 and all(a < b for a, b in zip(ginis, ginis[1:]))


# ---------------------------------------------------------------------------------------------
# Sharded == unsharded (8 simulated CPU devices, rows along the data axis).


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_equals_unsharded():
    rng = np.random.default_rng(0)
    n, t = 16, 24
    seq = rng.normal(size=n).astype(np.float32)
    imp = rng.random((n, t)).astype(np.float32)
    mask = rng.random((n, t)) < 0.7
    want = _run(seq, imp, mask, 0.5)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None))
    put = lambda x, s: jax.device_put(x, s)
    out = adv.redistribute_tokens(
        put(seq, NamedSharding(mesh, P(("data", "fsdp")))),
        put(imp, rows),
        put(mask, rows),
        gamma=0.5,
    )
    np.testing.assert_array_equal(np.asarray(out), want)
    assert out.sharding.spec[0] == ("data", "fsdp")
    # Group-major [G, K, T] sharded along G.
    dense = adv.redistribute_tokens(
        put(seq.reshape(8, 2), NamedSharding(mesh, P(("data", "fsdp"), None))),
        put(imp.reshape(8, 2, t), NamedSharding(mesh, P(("data", "fsdp"), None, None))),
        put(mask.reshape(8, 2, t), NamedSharding(mesh, P(("data", "fsdp"), None, None))),
        gamma=0.5,
    )
    np.testing.assert_array_equal(np.asarray(dense).reshape(n, t), want)
