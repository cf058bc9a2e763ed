"""The rollout-correction toolbox against its NumPy reference, and its properties.

Log-probabilities are drawn on a grid of 1/64 nats and the ratio bands sit off it (at
``(j + 0.37) / 64``), so no token's ratio, and no sequence's geometric mean over at most 8
tokens, lies within float32 rounding of a band's edge: the JAX masks must equal the
reference's exactly. The total-variation radius is compared with a margin instead.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.losses import (
    ROLLOUT_CORRECTIONS,
    apply_rollout_correction,
    icepop,
    masked_fractions,
    outlier_mask,
    policy_loss,
    seq_mask_tis,
    tv_trust_region,
)
from tests import rollout_correction_reference as ref

B, T = 5, 8


def grid_data(seed, spread=24):
    """(logp, prox, behav, adv, mask): log-probs on a 1/64 grid, behav = prox + grid noise."""
    rng = np.random.default_rng(seed)
    prox = -rng.integers(1, 256, (B, T)) / 64.0
    behav = prox + rng.integers(-spread, spread + 1, (B, T)) / 64.0
    behav = np.minimum(behav, 0.0)
    logp = prox + rng.integers(-16, 17, (B, T)) / 64.0
    logp = np.minimum(logp, 0.0)
    adv = rng.normal(0, 1, (B,))
    mask = rng.uniform(size=(B, T)) < 0.75
    mask[-1] = False  # a sequence without response tokens
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return f32(logp), f32(prox), f32(behav), f32(adv), mask


def off_grid(j):
    return math.exp((j + 0.37) / 64.0)


def jx(*xs):
    return [jnp.asarray(x) for x in xs]


def run(kind, logp, prox, behav, adv, mask, low, high, cap, outl, delta, **norm):
    lp, px, bh, ad, mk = jx(logp, prox, behav, adv, mask)
    return apply_rollout_correction(
        kind,
        proximal_logprobs=px,
        behaviour_logprobs=bh,
        logprobs=lp,
        advantages=ad,
        mask=mk,
        low=low,
        high=high,
        cap=cap,
        outlier=outl,
        delta=delta,
        **norm,
    )


def reference(kind, logp, prox, behav, adv, mask, low, high, cap, outl, delta):
    if kind == "icepop":
        return ref.icepop(prox, behav, mask, low, high)
    if kind == "seq_mask_tis":
        return ref.seq_mask_tis(prox, behav, mask, low, high, cap)
    if kind in ("outlier_token", "outlier_veto"):
        return ref.outlier(prox, behav, mask, outl, kind == "outlier_veto")
    if kind == "tv_trust_region":
        return ref.tv_trust_region(logp, behav, adv, mask, delta)
    return ref._result(np.ones(mask.shape), np.array(mask, bool), mask)


settings_kw = dict(max_examples=30, deadline=None)
kinds = st.sampled_from(ROLLOUT_CORRECTIONS)
bands = st.tuples(st.integers(-64, -1), st.integers(0, 96)).map(
    lambda jk: (off_grid(jk[0]), off_grid(jk[1]))
)


@settings(**settings_kw)
@given(
    seed=st.integers(0, 2**16),
    kind=kinds,
    band=bands,
    cap=st.floats(1.0, 4.0),
    outl=st.integers(1, 80).map(lambda j: off_grid(j)),
    delta=st.floats(0.0, 0.6),
)
def test_masks_weights_and_fractions_match_numpy(seed, kind, band, cap, outl, delta):
    logp, prox, behav, adv, mask = grid_data(seed)
    low, high = band
    got = run(kind, logp, prox, behav, adv, mask, low, high, cap, outl, delta)
    w, keep, tok, seq = reference(kind, logp, prox, behav, adv, mask, low, high, cap, outl, delta)
    ok = np.ones(mask.shape, bool)
    if kind == "tv_trust_region":  # no margin on the grid: skip tokens at the radius
        tv = np.abs(np.exp(logp.astype(np.float64)) - np.exp(behav.astype(np.float64)))
        ok = np.abs(tv - delta) > 1e-5
        if not ok[mask].all():
            keep = np.where(ok, keep, np.asarray(got.keep))
            w, _, tok, seq = ref._result(np.ones(mask.shape), keep, mask)
    np.testing.assert_array_equal(np.asarray(got.keep), keep)
    np.testing.assert_allclose(np.asarray(got.weights), w, rtol=2e-6, atol=1e-7)
    assert float(got.token_frac) == pytest.approx(tok, abs=1e-6)
    assert float(got.seq_frac) == pytest.approx(seq, abs=1e-6)


@settings(**settings_kw)
@given(seed=st.integers(0, 2**16), kind=kinds, band=bands, cap=st.floats(1.0, 4.0))
def test_masks_stay_inside_the_response_and_the_bounds(seed, kind, band, cap):
    logp, prox, behav, adv, mask = grid_data(seed, spread=64)
    low, high = band
    got = run(kind, logp, prox, behav, adv, mask, low, high, cap, 3.0, 0.1)
    keep, w = np.asarray(got.keep), np.asarray(got.weights)
    assert not (keep & ~mask).any()  # a subset of the response
    assert (w[~keep] == 0).all() and np.isfinite(w).all() and (w >= 0).all()
    assert 0.0 <= float(got.token_frac) <= 1.0 and 0.0 <= float(got.seq_frac) <= 1.0
    r = np.exp(prox.astype(np.float64) - behav)
    if kind == "icepop":
        assert ((r[keep] >= low * (1 - 1e-6)) & (r[keep] <= high * (1 + 1e-6))).all()
        np.testing.assert_allclose(w[keep], r[keep], rtol=1e-5)
    if kind == "seq_mask_tis":
        assert (w <= cap * (1 + 1e-6)).all()
        kept_rows = keep.any(axis=1)
        assert (keep[kept_rows] == mask[kept_rows]).all()  # whole sequences, or nothing
    if kind == "outlier_veto":
        rows = (mask & ~keep).any(axis=1)
        assert not keep[rows].any()
    # a wider band (or radius) keeps at least as much
    wider = run(kind, logp, prox, behav, adv, mask, low / 2, high * 2, cap, 6.0, 0.2)
    assert not (keep & ~np.asarray(wider.keep)).any()


@settings(**settings_kw)
@given(
    seed=st.integers(0, 2**16),
    kind=kinds,
    band=bands,
    cap=st.floats(1.0, 4.0),
    outl=st.floats(1.01, 50.0),
    delta=st.floats(0.0, 1.0),
)
def test_identity_at_ratio_one(seed, kind, band, cap, outl, delta):
    """pi_prox == mu (and pi == mu): every response token kept with weight 1, nothing masked,
    and the corrected loss and its gradient are the plain ones bit for bit."""
    _, prox, _, adv, mask = grid_data(seed)
    low, high = band
    got = run(kind, prox, prox, prox, adv, mask, low, high, cap, outl, delta)
    np.testing.assert_array_equal(np.asarray(got.keep), mask)
    assert (np.asarray(got.weights)[mask] == 1.0).all()
    assert float(got.token_frac) == 0.0 and float(got.seq_frac) == 0.0
    lp, px, ad, mk = jx(prox, prox, adv, mask)
    decoupled = True
    plain = jax.value_and_grad(
        lambda x: policy_loss(x, px, ad, mk, proximal_logprobs=px, decoupled=decoupled).loss
    )(lp)
    corr = jax.value_and_grad(
        lambda x: (
            policy_loss(
                x,
                px,
                ad,
                mk,
                proximal_logprobs=px,
                decoupled=decoupled,
                rollout_correction=kind,
                rollout_correction_low=low,
                rollout_correction_high=high,
                rollout_correction_cap=cap,
                rollout_correction_outlier=outl,
                rollout_correction_delta=delta,
            ).loss
        )
    )(lp)
    assert float(corr[0]) == float(plain[0])
    np.testing.assert_array_equal(np.asarray(corr[1]), np.asarray(plain[1]))


@pytest.mark.parametrize("kind", ROLLOUT_CORRECTIONS)
def test_an_empty_mask_gives_zeros_not_nan(kind):
    logp, prox, behav, adv, _ = grid_data(0, spread=64)
    mask = np.zeros((B, T), bool)
    got = run(kind, logp, prox, behav, adv, mask, 0.9, 1.1, 1.0, 1.5, 0.01)
    assert float(got.token_frac) == 0.0 and float(got.seq_frac) == 0.0
    assert not np.asarray(got.keep).any() and np.isfinite(np.asarray(got.weights)).all()
    decoupled = True
    lp, px, bh, ad, mk = jx(logp, prox, behav, adv, mask)
    val, grad = jax.value_and_grad(
        lambda x: (
            policy_loss(
                x,
                bh,
                ad,
                mk,
                proximal_logprobs=px,
                decoupled=decoupled,
                rollout_correction=kind,
            ).loss
        )
    )(lp)
    assert float(val) == 0.0 and np.isfinite(np.asarray(grad)).all()
    # and the fractions' normalisers: 0 of 0 is 0
    tok, seq = masked_fractions(jnp.zeros((2, 3), bool), jnp.zeros((2, 3), bool))
    assert float(tok) == 0.0 and float(seq) == 0.0


def np_corrected_loss(logp, prox, behav, adv, mask, kind, low, high, cap, outl, delta):
    """Token-mean PPO-clip loss around pi_prox with the correction's weights and mask
    (normaliser: every response token)."""
    w, keep, _, _ = reference(kind, logp, prox, behav, adv, mask, low, high, cap, outl, delta)
    weighting = kind in ("icepop", "seq_mask_tis")
    total = 0.0
    for b, t in np.ndindex(mask.shape):
        if not keep[b, t]:
            continue
        r = math.exp(float(logp[b, t]) - float(prox[b, t]))
        loss = max(-adv[b] * r, -adv[b] * min(max(r, 0.8), 1.28))
        total += (w[b, t] if weighting else 1.0) * loss
    return total / max(mask.sum(), 1)


@pytest.mark.parametrize("kind", ROLLOUT_CORRECTIONS)
def test_corrected_loss_matches_numpy(kind):
    low, high, cap, outl, delta = off_grid(-9), off_grid(8), 1.2, off_grid(12), 0.05
    for seed in range(3):
        logp, prox, behav, adv, mask = grid_data(seed, spread=40)
        lp, px, bh, ad, mk = jx(logp, prox, behav, adv, mask)
        terms = jax.jit(
            lambda x: policy_loss(  # noqa: B023
                x,
                bh,  # noqa: B023
                ad,  # noqa: B023
                mk,  # noqa: B023
                proximal_logprobs=px,  # noqa: B023
                decoupled=True,
                rollout_correction=kind,
                rollout_correction_low=low,
                rollout_correction_high=high,
                rollout_correction_cap=cap,
                rollout_correction_outlier=outl,
                rollout_correction_delta=delta,
            )
        )(lp)
        want = np_corrected_loss(logp, prox, behav, adv, mask, kind, low, high, cap, outl, delta)
        np.testing.assert_allclose(float(terms.pg_loss), want, rtol=1e-5, atol=1e-6)
        _, keep, tok, seq = reference(
            kind, logp, prox, behav, adv, mask, low, high, cap, outl, delta
        )
        assert float(terms.correction_token_frac) == pytest.approx(tok, abs=1e-6)
        assert float(terms.correction_seq_frac) == pytest.approx(seq, abs=1e-6)
        if kind != "none" and seed == 0:
            assert tok > 0.0  # the data is off enough that each choice masks something


def test_functions_and_settings_validate():
    x = jnp.zeros((2, 3))
    m = jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match="icepop"):
        icepop(x, x, m, low=1.5, high=2.0)
    with pytest.raises(ValueError, match="cap"):
        seq_mask_tis(x, x, m, cap=0.5)
    with pytest.raises(ValueError, match="threshold"):
        outlier_mask(x, x, m, threshold=1.0)
    with pytest.raises(ValueError, match="delta"):
        tv_trust_region(x, x, jnp.zeros(2), m, delta=1.5)
    with pytest.raises(ValueError, match="rollout_correction must be one of"):
        policy_loss(x, x, jnp.zeros(2), m, rollout_correction="icepoop")
    with pytest.raises(ValueError, match="decoupled=True"):
        policy_loss(x, x, jnp.zeros(2), m, proximal_logprobs=x, rollout_correction="icepop")
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(x, x, jnp.zeros(2), m, rollout_correction="outlier_token")
    # tv_trust_region reads the current policy: no proximal pass needed
    policy_loss(x, x, jnp.zeros(2), m, rollout_correction="tv_trust_region")

    from gagar_jax.rl.config import ConfigError, RunConfig
    from gagar_jax.update import UpdateConfig

    with pytest.raises(ValueError, match="update.rollout_correction_outlier"):
        UpdateConfig(rollout_correction="outlier_token", rollout_correction_outlier=0.5)
    with pytest.raises(ValueError, match="decoupled"):
        UpdateConfig(rollout_correction="seq_mask_tis")
    with pytest.raises(ValueError, match="decoupled"):
        UpdateConfig(rollout_correction="icepop", decoupled=True, rollout_is="token")
    assert UpdateConfig(rollout_correction="icepop", decoupled=True).off_policy
    assert not UpdateConfig(rollout_correction="tv_trust_region").off_policy
    with pytest.raises(ConfigError, match="learner.rollout_correction"):
        RunConfig.from_config_dict({"learner": {"rollout_correction": "nope"}})


def own_logprobs(model_config, params, batch):
    """The trainer's log-prob of each token at its own position (0 off the response), as the
    rollout engine records them."""
    from flax import nnx

    from gagar_jax.update.state import abstract_model
    from gagar_jax.update.step import chunked_token_logprobs_and_entropy

    model = nnx.merge(nnx.graphdef(abstract_model(model_config)), jax.device_get(params))
    tokens = jnp.asarray(batch.tokens)
    hidden = model.hidden_states(
        tokens, jnp.asarray(batch.positions), attention_mask=jnp.asarray(batch.attention_mask)
    )
    lp, _ = chunked_token_logprobs_and_entropy(model, hidden, jnp.roll(tokens, -1, axis=1))
    lp = np.concatenate([np.zeros((lp.shape[0], 1)), np.asarray(lp)[:, :-1]], 1)
    return np.where(batch.response_mask, lp, 0.0).astype(np.float32)


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("icepop", dict(decoupled=True)),
        ("seq_mask_tis", dict(decoupled=True)),
        ("outlier_veto", {}),
        ("tv_trust_region", {}),
    ],
)
def test_the_update_applies_each_correction_and_reports_its_shares(kind, extra):
    """In the jitted update, on behaviour log-probs well away from the trainer's: the update
    runs, stays finite and reports the masked shares; the correction's share of masked tokens
    is the one the function gives on the proximal log-probs (before the parameters move)."""
    from gagar_jax.update import create_train_state, jit_update, make_mesh
    from tests.update_fixtures import CONFIG, MODEL, make_batch

    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    cfg = dataclasses.replace(
        CONFIG,
        num_minibatches=1,
        num_microbatches=2,
        rollout_correction=kind,
        rollout_correction_outlier=4.0,
        rollout_correction_low=0.8,
        rollout_correction_high=1.25,
        rollout_correction_delta=0.02,
        mismatch_metrics=True,
        **extra,
    )
    state = create_train_state(MODEL, cfg, mesh, seed=0)
    batch = make_batch(seed=1)
    own = own_logprobs(MODEL, state.params, batch)
    rng = np.random.default_rng(0)
    noisy = own + rng.normal(0, 0.7, own.shape) * batch.response_mask
    batch = batch._replace(old_logprobs=noisy.astype(np.float32))
    _, m = jit_update(MODEL, cfg, mesh)(state, batch)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    assert all(np.isfinite(v) for v in m.values())
    assert 0.0 < m["mismatch/masked_token_frac"] < 1.0
    assert 0.0 < m["mismatch/masked_seq_frac"] <= 1.0
    assert m["mismatch/k3"] > 0.1 and m["mismatch/logprob_max_abs_diff"] > 1.0
