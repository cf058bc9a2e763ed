"""Off-policy correction of the policy loss against plain NumPy references (loops here only)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.losses import policy_loss
from gagar_jax.losses.policy import off_policy_weights


def np_weights(prox, behav, mask, rollout_is, c, rollout_rs, hi, lo):
    """(weights, keep) by loops: truncated IS and rejection on d = log pi_prox - log mu."""
    B, T = prox.shape
    w = np.ones((B, T))
    keep = mask.astype(bool).copy()
    for b in range(B):
        d = [(prox[b, t] - behav[b, t]) if mask[b, t] else 0.0 for t in range(T)]
        n = max(sum(bool(x) for x in mask[b]), 1)
        for t in range(T):
            if rollout_is == "token":
                w[b, t] = min(np.exp(d[t]), c)
            elif rollout_is == "sequence":
                w[b, t] = min(np.exp(sum(d)), c)
            if rollout_rs == "token_k3" and np.exp(d[t]) - d[t] - 1 > hi:
                keep[b, t] = False
            if rollout_rs == "geometric":
                g = np.exp(sum(d) / n)
                if not lo <= g <= hi:
                    keep[b, t] = False
    return w, keep


def np_loss(
    logp,
    prox,
    behav,
    adv,
    mask,
    *,
    rollout_is,
    c,
    rollout_rs,
    hi,
    lo,
    decoupled,
    clip_low=0.2,
    clip_high=0.28,
):
    """Token-mean corrected PPO-clip loss; normaliser: every response token."""
    w, keep = np_weights(prox, behav, mask, rollout_is, c, rollout_rs, hi, lo)
    anchor = prox if decoupled else behav
    total, n = 0.0, mask.sum()
    for idx in np.ndindex(logp.shape):
        if not keep[idx]:
            continue
        a = adv[idx[0]]
        r = np.exp(logp[idx] - anchor[idx])
        loss = max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
        total += w[idx] * loss if rollout_is != "none" else loss
    return total / max(n, 1)


def _data(seed, b=5, t=6, spread=0.5):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.05, 1.0, (b, t)))
    prox = logp + rng.normal(0, 0.3, (b, t))
    behav = prox + rng.normal(0, spread, (b, t))
    adv = rng.normal(0, 1, (b,))
    mask = rng.uniform(size=(b, t)) < 0.75
    mask[-1] = False
    return logp, prox, behav, adv, mask


def _loss(lp, *, behav, adv, mask, prox, **kw):
    return policy_loss(
        lp,
        jnp.asarray(behav, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask),
        proximal_logprobs=jnp.asarray(prox, jnp.float32),
        **kw,
    )


SETTINGS = [
    dict(rollout_is="none", rollout_rs="none", decoupled=True),
    dict(rollout_is="token", rollout_rs="none", decoupled=True),
    dict(rollout_is="sequence", rollout_rs="none", decoupled=True),
    dict(rollout_is="none", rollout_rs="token_k3", decoupled=False),
    dict(rollout_is="token", rollout_rs="geometric", decoupled=True),
    dict(rollout_is="none", rollout_rs="geometric", decoupled=False),
]


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("setting", SETTINGS)
def test_corrected_loss_matches_numpy(jit, setting):
    for s in (0, 1):
        logp, prox, behav, adv, mask = _data(s)
        c, hi, lo = 1.5, (0.05 if setting["rollout_rs"] == "token_k3" else 1.3), 0.8
        fn = functools.partial(
            _loss,
            behav=behav,
            adv=adv,
            mask=mask,
            prox=prox,
            rollout_is_threshold=c,
            rollout_rs_threshold=hi,
            rollout_rs_threshold_lower=lo,
            **setting,
        )
        terms = (jax.jit(fn) if jit else fn)(jnp.asarray(logp, jnp.float32))
        want = np_loss(logp, prox, behav, adv, mask, c=c, hi=hi, lo=lo, **setting)
        np.testing.assert_allclose(float(terms.pg_loss), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("setting", SETTINGS)
def test_weights_and_metrics_match_numpy(setting):
    logp, prox, behav, adv, mask = _data(3, spread=0.8)
    c, hi, lo = 1.5, (0.05 if setting["rollout_rs"] == "token_k3" else 1.3), 0.8
    opw = off_policy_weights(
        jnp.asarray(prox, jnp.float32),
        jnp.asarray(behav, jnp.float32),
        jnp.asarray(mask),
        rollout_is=setting["rollout_is"],
        rollout_is_threshold=c,
        rollout_rs=setting["rollout_rs"],
        rollout_rs_threshold=hi,
        rollout_rs_threshold_lower=lo,
    )
    w, keep = np_weights(prox, behav, mask, setting["rollout_is"], c, setting["rollout_rs"], hi, lo)
    np.testing.assert_allclose(np.asarray(opw.weights)[mask], w[mask], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(opw.keep), keep)
    terms = policy_loss(
        jnp.asarray(logp, jnp.float32),
        jnp.asarray(behav, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask),
        proximal_logprobs=jnp.asarray(prox, jnp.float32),
        rollout_is_threshold=c,
        rollout_rs_threshold=hi,
        rollout_rs_threshold_lower=lo,
        **setting,
    )
    d = (prox - behav)[mask]
    np.testing.assert_allclose(float(terms.mismatch_kl), np.mean(np.exp(d) - d - 1), rtol=1e-5)
    np.testing.assert_allclose(float(terms.rs_frac_rejected), np.mean(~keep[mask]), atol=1e-7)
    if setting["rollout_is"] == "token":
        np.testing.assert_allclose(float(terms.is_frac_clipped), np.mean(np.exp(d) > c), atol=1e-7)
        # ESS from the token means: (sum w)^2 / (n sum w^2)
        ess = float(terms.is_weight_mean) ** 2 / float(terms.is_weight_sq_mean)
        np.testing.assert_allclose(
            ess, w[mask].sum() ** 2 / (mask.sum() * (w[mask] ** 2).sum()), rtol=1e-5
        )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rollout_is=st.sampled_from(["token", "sequence", "none"]),
    rollout_rs=st.sampled_from(["none", "token_k3", "geometric"]),
    c=st.floats(1.0, 5.0),
    hi=st.floats(1.0, 3.0),
    lo=st.floats(0.1, 1.0),
)
def test_equal_logprobs_give_the_on_policy_loss_exactly(seed, rollout_is, rollout_rs, c, hi, lo):
    """pi_prox == mu: weights 1, nothing rejected, the same loss and gradient bit for bit."""
    logp, prox, _, adv, mask = _data(seed)
    args = [jnp.asarray(x, jnp.float32) for x in (logp, prox, adv)] + [jnp.asarray(mask)]
    base = jax.value_and_grad(lambda lp: policy_loss(lp, *args[1:]).loss)(args[0])
    corr = jax.value_and_grad(
        lambda lp: (
            policy_loss(
                lp,
                *args[1:],
                proximal_logprobs=args[1],
                rollout_is=rollout_is,
                decoupled=True,
                rollout_is_threshold=c,
                rollout_rs=rollout_rs,
                rollout_rs_threshold=hi,
                rollout_rs_threshold_lower=lo,
            ).loss
        )
    )(args[0])
    assert float(corr[0]) == float(base[0])
    np.testing.assert_array_equal(np.asarray(corr[1]), np.asarray(base[1]))
    terms = policy_loss(
        *args,
        proximal_logprobs=args[1],
        rollout_is=rollout_is,
        decoupled=True,
        rollout_is_threshold=c,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=hi,
        rollout_rs_threshold_lower=lo,
    )
    assert float(terms.mismatch_kl) == 0.0 and float(terms.is_frac_clipped) == 0.0
    assert float(terms.rs_frac_rejected) == 0.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), c=st.floats(1.0, 4.0))
def test_truncated_weights_bounded_and_monotone_in_threshold(seed, c):
    _, prox, behav, _, mask = _data(seed, spread=1.5)
    args = (jnp.asarray(prox, jnp.float32), jnp.asarray(behav, jnp.float32), jnp.asarray(mask))
    w1 = np.asarray(off_policy_weights(*args, rollout_is="token", rollout_is_threshold=c).weights)
    w2 = np.asarray(
        off_policy_weights(*args, rollout_is="token", rollout_is_threshold=c + 1.0).weights
    )
    assert (w1 <= c + 1e-6).all() and (w1 >= 0).all() and (w1 <= w2 + 1e-7).all()


def test_delivered_ratio_on_policy_is_one_and_drops_with_truncation():
    logp, prox, behav, adv, mask = _data(5, spread=1.0)
    f = lambda **kw: policy_loss(
        jnp.asarray(prox, jnp.float32),
        jnp.asarray(behav, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask),
        **kw,
    )
    on = policy_loss(*(jnp.asarray(x, jnp.float32) for x in (prox, prox, adv)), jnp.asarray(mask))
    assert float(on.credit_delivered) == pytest.approx(float(on.credit_positive), rel=1e-6)
    # decoupled at the start of the update (pi == pi_prox): r = 1, so delivered = S+ * w
    t = f(
        proximal_logprobs=jnp.asarray(prox, jnp.float32),
        rollout_is="token",
        rollout_is_threshold=1.0,
        decoupled=True,
    )
    w = np.minimum(np.exp(prox - behav), 1.0)
    pos = np.where(adv[:, None] > 0, adv[:, None], 0.0) * mask
    np.testing.assert_allclose(
        float(t.credit_delivered) / float(t.credit_positive), (pos * w).sum() / pos.sum(), rtol=1e-5
    )
    assert float(t.credit_delivered) < float(t.credit_positive)


def test_bad_settings_name_the_field():
    x = jnp.zeros((2, 3))
    m = jnp.ones((2, 3), bool)
    with pytest.raises(ValueError, match="rollout_is"):
        policy_loss(x, x, jnp.zeros(2), m, proximal_logprobs=x, rollout_is="tokn", decoupled=True)
    with pytest.raises(ValueError, match="decoupled=True"):
        policy_loss(x, x, jnp.zeros(2), m, proximal_logprobs=x, rollout_is="token")
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(x, x, jnp.zeros(2), m, decoupled=True)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        off_policy_weights(x, x, m, rollout_is="token", rollout_is_threshold=0.5)
    with pytest.raises(ValueError, match="rollout_rs"):
        off_policy_weights(x, x, m, rollout_rs="geometric", rollout_rs_threshold=0.9)


def test_update_with_corrections_on_own_logprobs_equals_the_plain_update():
    """The update's proximal pass (the trainer's own log-probs) against behaviour log-probs
    that are those same log-probs: the corrected update is the plain one (up to rounding);
    against another behaviour it reports the mismatch."""
    import dataclasses

    from flax import nnx

    from gagar_jax.update import UpdateConfig, create_train_state, jit_update, make_mesh
    from gagar_jax.update.state import abstract_model
    from gagar_jax.update.step import chunked_token_logprobs_and_entropy
    from tests.update_fixtures import CONFIG, MODEL, make_batch

    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    base = dataclasses.replace(CONFIG, eps=1e-3, num_minibatches=1)
    state0 = jax.device_get(create_train_state(MODEL, base, mesh, seed=0))
    batch = make_batch(seed=0)
    model = nnx.merge(nnx.graphdef(abstract_model(MODEL)), state0.params)
    hidden = model.hidden_states(
        jnp.asarray(batch.tokens),
        jnp.asarray(batch.positions),
        attention_mask=jnp.asarray(batch.attention_mask),
    )
    own, _ = chunked_token_logprobs_and_entropy(
        model, hidden, jnp.roll(jnp.asarray(batch.tokens), -1, axis=1), 1.0, 0
    )
    # behaviour log-prob of token t sits at t (the update reads old_logprobs[:, 1:])
    own = np.concatenate([np.zeros((own.shape[0], 1)), np.asarray(own)[:, :-1]], 1)
    on_policy = batch._replace(
        old_logprobs=np.where(batch.response_mask, own, 0.0).astype(np.float32)
    )
    corr = dataclasses.replace(
        base,
        decoupled=True,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k3",
        rollout_rs_threshold=0.5,
    )
    assert isinstance(corr, UpdateConfig) and corr.off_policy
    # behaviour less likely than the trainer finds its tokens: weights above the truncation
    shift = np.random.default_rng(0).uniform(0.0, 2.0, batch.old_logprobs.shape)
    shifted = batch._replace(
        old_logprobs=(on_policy.old_logprobs - shift * batch.response_mask).astype(np.float32)
    )
    fns = {id(cfg): jit_update(MODEL, cfg, mesh) for cfg in (base, corr)}
    out = {}
    for name, cfg, b in (
        ("plain", base, on_policy),
        ("corr", corr, on_policy),
        ("off", corr, shifted),
    ):
        state, m = fns[id(cfg)](jax.device_put(state0), b)
        out[name] = (jax.device_get(state.params), {k: float(v) for k, v in m.items()})
    for a, b in zip(jax.tree.leaves(out["plain"][0]), jax.tree.leaves(out["corr"][0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    m = out["corr"][1]
    assert m["mismatch_kl"] < 1e-5 and m["is_frac_clipped"] == 0.0
    assert m["is_ess"] == pytest.approx(1.0, abs=1e-5)
    assert m["credit/delivered_ratio"] == pytest.approx(1.0, abs=1e-4)
    off = out["off"][1]  # a large mismatch: weights truncated, tokens rejected
    assert off["mismatch_kl"] > 0.1 and off["is_frac_clipped"] > 0.0
    assert 0.0 < off["is_ess"] < 1.0 and off["rs_frac_rejected"] > 0.0
    assert np.isfinite(off["loss"]) and off["credit/delivered_ratio"] < 1.0
