"""The update with the model options of issue 15: chunked LM head/log-softmax, scanned layers
(stacked parameters; checkpoints of that layout), Qwen3-MoE router metrics and aux loss."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gagar_jax.models import stack_layer_params, unstack_layer_params
from gagar_jax.update import create_train_state, jit_update, make_mesh, shard_batch
from gagar_jax.update.checkpoint import Checkpointer, abstract_train_state
from gagar_jax.update.step import ROUTER_METRICS, chunked_token_logprobs_and_entropy
from tests.update_fixtures import CONFIG, MODEL, make_batch

MESH = (2, 2, 2)


def _update(model_config, config, params=None, steps=1):
    mesh = make_mesh(MESH)
    state = create_train_state(model_config, config, mesh, seed=0, params=params)
    update = jit_update(model_config, config, mesh)
    out = []
    for i in range(steps):
        state, m = update(state, shard_batch(make_batch(seed=i), mesh))
        out.append({k: float(v) for k, v in m.items()})
    return state, out


def test_chunked_logprobs_reference():
    """Chunks of 5 over T=12 (padded to 15) == the whole sequence, values and gradients."""
    from gagar_jax.models import create_model

    model = create_model(dataclasses.replace(MODEL, tie_embeddings=True), seed=3)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 12, MODEL.hidden_size)), jnp.float32)
    y = jnp.asarray(rng.integers(0, MODEL.vocab_size, (2, 12)), jnp.int32)

    def f(hh, chunk):
        lp, ent = chunked_token_logprobs_and_entropy(model, hh, y, 0.7, chunk)
        return jnp.sum(lp * 1.3 + ent), (lp, ent)

    (va, (lpa, ea)), ga = jax.value_and_grad(f, has_aux=True)(h, 0)
    (vb, (lpb, eb)), gb = jax.value_and_grad(f, has_aux=True)(h, 5)
    logits = np.asarray(model.logits_from_hidden(h), np.float64) / 0.7
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))[..., None]
        - logits.max(-1, keepdims=True)
    )
    ref = np.take_along_axis(logp, np.asarray(y)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(lpb), ref, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lpb), np.asarray(lpa), atol=1e-6)
    np.testing.assert_allclose(np.asarray(eb), np.asarray(ea), atol=1e-6)
    np.testing.assert_allclose(np.asarray(gb), np.asarray(ga), atol=1e-6)


@pytest.mark.parametrize("tokens", [24, 96])  # dlogits^T h, and (h^T dlogits)^T
def test_head_logprobs_gradient_equals_autodiff(tokens):
    """The LM head's written-out backward == autodiff of the logits and the log-softmax."""
    from gagar_jax.losses import token_logprobs_and_entropy
    from gagar_jax.models import create_model

    model = create_model(MODEL, seed=1)
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, tokens // 2, MODEL.hidden_size)), jnp.float32)
    y = jnp.asarray(rng.integers(0, MODEL.vocab_size, h.shape[:2]), jnp.int32)
    w = model.head_weight()
    a, b = (jnp.asarray(rng.normal(size=y.shape), jnp.float32) for _ in range(2))

    def ours(hh, ww):  # a stand-in with the head ww (the function reads only these two)
        head = types.SimpleNamespace(config=MODEL, head_weight=lambda: ww)
        lp, ent = chunked_token_logprobs_and_entropy(head, hh, y, 0.7, 0)
        return jnp.sum(lp * a + ent * b)

    def autodiff(hh, ww):
        lp, ent = token_logprobs_and_entropy(jnp.einsum("bte,ve->btv", hh, ww) / 0.7, y)
        return jnp.sum(lp * a + ent * b)

    (va, ga), (vb, gb) = (jax.value_and_grad(f, (0, 1))(h, w) for f in (ours, autodiff))
    np.testing.assert_allclose(float(va), float(vb), rtol=1e-6)
    for x, ref in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_scanned_chunked_update_equals_baseline_and_checkpoints(tmp_path):
    """Stacked layers + chunked logits: the same update as the per-layer, whole-sequence one
    (sharded on a 2x2x2 mesh); the stacked state checkpoints and restores bit-identically."""
    model = dataclasses.replace(MODEL, num_layers=2)
    base_state, base_m = _update(model, CONFIG)
    init = create_train_state(model, CONFIG, make_mesh(MESH), seed=0)
    stacked = stack_layer_params(jax.device_get(init.params))
    scan_model = dataclasses.replace(model, scan_layers=True)
    chunked = dataclasses.replace(CONFIG, logits_chunk_size=5)
    state, m = _update(scan_model, chunked, params=stacked)
    q = state.params["layers"]["self_attn"]["q_proj"]
    assert q.shape[0] == 2 and q.sharding.spec == jax.P(None, "fsdp", "tensor", None)
    for k in ("loss", "pg_loss", "entropy", "grad_norm", "ratio_mean_first"):
        np.testing.assert_allclose(m[0][k], base_m[0][k], rtol=2e-4, atol=1e-6, err_msg=k)
    got = unstack_layer_params(jax.device_get(state.params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.device_get(base_state.params))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)
    ckpt = Checkpointer(str(tmp_path), model_config=scan_model, update_config=chunked)
    ckpt.save(1, state)
    ckpt.wait()
    restored, _ = ckpt.restore(abstract_train_state(scan_model, chunked, make_mesh(MESH)))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    ckpt.close()


def test_moe_update_router_metrics_and_aux_loss():
    """Qwen3-MoE in the update: router metrics are reported; the aux-loss coefficient adds its
    gradient to the router (and only changes the loss by coef * aux)."""
    moe = dataclasses.replace(
        MODEL,
        qkv_bias=False,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        initializer_range=0.2,
    )
    s0, m0 = _update(moe, CONFIG)
    s1, m1 = _update(moe, dataclasses.replace(CONFIG, router_aux_loss_coef=1.0))
    for k in ROUTER_METRICS:
        assert np.isfinite(m0[0][k]) and k in m1[0]
    assert m0[0]["router_aux_loss"] >= 2.0 - 1e-4  # >= top_k, equality at perfect balance
    assert m0[0]["router_load_max"] >= 1.0 >= m0[0]["router_load_min"] > 0
    assert m0[0]["router_aux_loss"] == pytest.approx(m1[0]["router_aux_loss"], rel=1e-5)
    r0 = np.asarray(jax.device_get(s0.params["layers"][0]["mlp"]["router"]))
    r1 = np.asarray(jax.device_get(s1.params["layers"][0]["mlp"]["router"]))
    assert np.abs(r0 - r1).max() > 1e-6
    dense = {k for k in _update(MODEL, CONFIG)[1][0] if k.startswith("router")}
    assert dense == set()
