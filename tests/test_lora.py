"""LoRA: the adapters' forward and merge, the adapter-only update and optimizer state, a NumPy
reference of the gradient, checkpoints with the base's hash, and the PEFT export's layout."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gagar_jax.models import Transformer, TransformerConfig, lora, model_from_params
from gagar_jax.update import (
    Checkpointer,
    abstract_train_state,
    create_train_state,
    make_mesh,
)
from tests.update_fixtures import CONFIG, make_batch, run_updates, tiny_config

LORA = dict(lora_rank=4, lora_alpha=8.0)


def _params(config, seed=0):
    return nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(seed)), nnx.Param))


def _random_adapters(params, scale=0.1, seed=1):
    """``params`` with every adapter leaf (B too) drawn at random: a trained-looking adapter."""
    ad, base = lora.split_adapters(params)
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    ad = jax.tree.unflatten(
        tree, [scale * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)]
    )
    return lora.combine(base, ad)


def _inputs(vocab, b=2, t=10, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def test_config_validation():
    with pytest.raises(ValueError, match="lora_targets"):
        tiny_config(lora_rank=2, lora_targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="lora_rank"):
        tiny_config(lora_rank=-1)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        tiny_config(lora_rank=2, num_experts=4)
    c = tiny_config(lora_rank=2, lora_targets="q_proj, v_proj")  # a command-line override
    assert c.lora_targets == ("q_proj", "v_proj")
    assert c.num_lora_params == 2 * 2 * (32 + 32 + 32 + 16)


@pytest.mark.parametrize("scan", [False, True])
def test_fresh_adapter_is_identity_and_merge_is_exact(scan):
    c = tiny_config(qk_norm=True, qkv_bias=False, scan_layers=scan, **LORA)
    plain = dataclasses.replace(c, lora_rank=0)
    params = _params(c)
    ad, base = lora.split_adapters(params)
    assert c.num_lora_params == sum(x.size for x in jax.tree.leaves(ad))
    tokens, pos = _inputs(c.vocab_size)
    fresh = model_from_params(c, params)(tokens, pos)
    np.testing.assert_array_equal(fresh, model_from_params(plain, base)(tokens, pos))
    trained = _random_adapters(params)
    y = model_from_params(c, trained)(tokens, pos)
    merged = model_from_params(plain, lora.merged_params(trained, c))(tokens, pos)
    assert float(jnp.max(jnp.abs(y - fresh))) > 1e-2  # the adapters act
    np.testing.assert_allclose(y, merged, atol=2e-5)
    # merge_and_reset: the same model, the merged weights as the new base, B zero
    reset = lora.merge_and_reset(trained, c)
    np.testing.assert_allclose(model_from_params(c, reset)(tokens, pos), y, atol=2e-5)
    assert all(
        not np.any(np.asarray(v["lora_b"]))
        for v in jax.tree.leaves(lora.split_adapters(reset)[0], is_leaf=lambda x: "lora_b" in x)
    )


def test_gradient_matches_numpy_reference():
    """d loss / d (A, B) of every adapter equals a NumPy forward+backward of the same model
    written out by hand (one layer, no biases, attention in float64)."""
    c = tiny_config(num_layers=1, qkv_bias=False, vocab_size=40, **LORA)
    params = _random_adapters(_params(c), scale=0.2)
    tokens, pos = _inputs(c.vocab_size, b=2, t=6)
    targets = np.asarray(jnp.roll(tokens, -1, axis=1))
    graphdef = nnx.graphdef(model_from_params(c, params))
    ad, base = lora.split_adapters(params)

    def loss(ad):
        model = nnx.merge(graphdef, lora.combine(base, ad))
        logp = jax.nn.log_softmax(model(tokens, pos), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1))

    got = jax.grad(loss)(ad)
    want = _numpy_grads(c, jax.tree.map(np.asarray, params), np.asarray(tokens), targets)
    for (path, g), (_, w) in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves_with_path(want)
    ):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))


def _numpy_grads(c, p, tokens, targets):
    """Reverse-mode by hand (float64) of the mean NLL of a 1-layer LoRA decoder: the adapters'
    gradients, in the layout of ``split_adapters(params)[0]``."""
    s = c.lora_alpha / c.lora_rank
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    layer = p["layers"][0]
    at, ml = layer["self_attn"], layer["mlp"]
    n, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
    b, t = tokens.shape
    g = n // kv
    emb = f64(p["embed_tokens"])
    x0 = emb[tokens]  # [b, t, e]

    def rms(x, w):
        r = 1.0 / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps)
        return x * r * f64(w), r

    def rms_bwd(dy, x, w, r):
        xn = x * r
        dxn = dy * f64(w)
        return r * (dxn - xn * np.mean(dxn * xn, -1, keepdims=True))

    def proj(x, w, ad):  # x [.., I] -> [.., O] with w flattened [I, O]
        a, bb = f64(ad["lora_a"]), f64(ad["lora_b"])
        w2 = f64(w).reshape(a.shape[0], -1)
        return x @ w2 + s * (x @ a) @ bb, (x, w2, a, bb)

    def proj_bwd(dy, cache):
        x, w2, a, bb = cache
        xa = x @ a
        da = s * x.reshape(-1, x.shape[-1]).T @ (dy @ bb.T).reshape(-1, a.shape[1])
        db = s * xa.reshape(-1, a.shape[1]).T @ dy.reshape(-1, dy.shape[-1])
        dx = dy @ w2.T + s * (dy @ bb.T) @ a.T
        return dx, {"lora_a": da, "lora_b": db}

    inv = 1.0 / (c.rope_theta ** (np.arange(0, d, 2) / d))
    ang = np.arange(t)[:, None] * inv[None]  # [t, d/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[None, :, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[None, :, None]

    def rot(x):
        h = x.shape[-1] // 2
        return np.concatenate([-x[..., h:], x[..., :h]], -1)

    def rope(x):
        return x * cos + rot(x) * sin

    def rope_bwd(dy):  # rot^T = -rot
        return dy * cos - rot(dy * sin)

    h1, r1 = rms(x0, layer["input_layernorm"]["weight"])
    q, cq = proj(h1, at["q_proj"], at["q_proj_lora"])
    k, ck = proj(h1, at["k_proj"], at["k_proj_lora"])
    v, cv = proj(h1, at["v_proj"], at["v_proj_lora"])
    q, k, v = q.reshape(b, t, n, d), k.reshape(b, t, kv, d), v.reshape(b, t, kv, d)
    qr, kr = rope(q), rope(k)
    kh, vh = np.repeat(kr, g, axis=2), np.repeat(v, g, axis=2)  # [b, t, n, d]
    sc = np.einsum("bqnd,bknd->bnqk", qr, kh) / np.sqrt(d)
    sc = np.where(np.tril(np.ones((t, t), bool)), sc, -1e30)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    att = np.einsum("bnqk,bknd->bqnd", pr, vh).reshape(b, t, n * d)
    o, co = proj(att, at["o_proj"], at["o_proj_lora"])
    x1 = x0 + o
    h2, r2 = rms(x1, layer["post_attention_layernorm"]["weight"])
    gt, cg = proj(h2, ml["gate_proj"], ml["gate_proj_lora"])
    up, cu = proj(h2, ml["up_proj"], ml["up_proj_lora"])
    sg = 1.0 / (1.0 + np.exp(-gt))
    act = gt * sg * up
    dn, cd = proj(act, ml["down_proj"], ml["down_proj_lora"])
    x2 = x1 + dn
    hf, rf = rms(x2, p["norm"]["weight"])
    head = f64(p["lm_head"])
    logits = hf @ head.T
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    # backward
    onehot = np.eye(c.vocab_size)[targets]
    dlogits = (np.exp(lp) - onehot) / (b * t)
    dx2 = rms_bwd(dlogits @ head, x2, p["norm"]["weight"], rf)
    dact, g_down = proj_bwd(dx2, cd)
    dgt = dact * up * sg * (1 + gt * (1 - sg))
    dup = dact * gt * sg
    dh2a, g_gate = proj_bwd(dgt, cg)
    dh2b, g_up = proj_bwd(dup, cu)
    dx1 = dx2 + rms_bwd(dh2a + dh2b, x1, layer["post_attention_layernorm"]["weight"], r2)
    datt, g_o = proj_bwd(dx1, co)
    datt = datt.reshape(b, t, n, d)
    dpr = np.einsum("bqnd,bknd->bnqk", datt, vh)
    dvh = np.einsum("bnqk,bqnd->bknd", pr, datt)
    dsc = pr * (dpr - np.sum(dpr * pr, -1, keepdims=True)) / np.sqrt(d)
    dqr = np.einsum("bnqk,bknd->bqnd", dsc, kh)
    dkh = np.einsum("bnqk,bqnd->bknd", dsc, qr)
    dkr = dkh.reshape(b, t, kv, g, d).sum(3)
    dv = dvh.reshape(b, t, kv, g, d).sum(3)
    dq, dk = rope_bwd(dqr), rope_bwd(dkr)
    _, g_q = proj_bwd(dq.reshape(b, t, n * d), cq)
    _, g_k = proj_bwd(dk.reshape(b, t, kv * d), ck)
    _, g_v = proj_bwd(dv.reshape(b, t, kv * d), cv)
    attn = {"k_proj_lora": g_k, "o_proj_lora": g_o, "q_proj_lora": g_q, "v_proj_lora": g_v}
    mlp = {"down_proj_lora": g_down, "gate_proj_lora": g_gate, "up_proj_lora": g_up}
    return {"layers": {0: {"mlp": mlp, "self_attn": attn}}}


def test_update_trains_adapters_only_with_their_optimizer_state():
    model = tiny_config(vocab_size=64, num_layers=1, **LORA)
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state = create_train_state(model, CONFIG, mesh, seed=0)
    ad, base = lora.split_adapters(state.params)
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in opt_leaves) == 2 * model.num_lora_params  # Adam's mu and nu
    params, metrics = run_updates(model, CONFIG, [make_batch(seed=0), make_batch(seed=1)])
    ad1, base1 = lora.split_adapters(params)
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(base1)):
        np.testing.assert_array_equal(a, b)  # the base is untouched, bit for bit
    moved = [
        float(np.max(np.abs(np.asarray(a) - b)))
        for a, b in zip(jax.tree.leaves(ad), jax.tree.leaves(ad1))
    ]
    assert min(moved) > 0
    assert all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)


def test_update_agrees_across_meshes():
    model = tiny_config(vocab_size=64, num_layers=1, **LORA)
    config = dataclasses.replace(CONFIG, eps=1e-3)
    batches = [make_batch(seed=0)]
    one, m1 = run_updates(model, config, batches)
    many, m8 = run_updates(model, config, batches, mesh_shape=(2, 2, 2))
    np.testing.assert_allclose(m1[0]["loss"], m8[0]["loss"], rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(lora.split_adapters(one)[0]), jax.tree.leaves(lora.split_adapters(many)[0])
    ):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_checkpoint_holds_adapters_and_refuses_another_base(tmp_path):
    model = tiny_config(vocab_size=64, num_layers=1, **LORA)
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state = create_train_state(model, CONFIG, mesh, seed=0)
    state = state._replace(params=_random_adapters(jax.device_get(state.params)))
    ckpt = Checkpointer(str(tmp_path / "ck"), model_config=model, update_config=CONFIG)
    ckpt.save(3, state, data_position={"i": 1}, wait=True)
    # the step holds the adapters only (and their Adam moments); the base is written once
    import orbax.checkpoint as ocp

    meta = ckpt.manager.restore(3, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    params_saved = [k for k in meta["checksums"] if k.startswith(".params")]
    assert params_saved and all("_lora" in k for k in params_saved)
    assert len(meta["lora_base_hash"]) == 16
    assert (tmp_path / "ck" / "lora_base" / "hash").exists()
    abstract = abstract_train_state(model, CONFIG, mesh)
    restored, info = ckpt.restore(abstract)
    assert info.step == 3
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(a, b)
    # the caller's base: the same one restores, another is refused naming both hashes
    restored, _ = ckpt.restore(abstract, base_params=state.params)
    other = _params(model, seed=5)
    with pytest.raises(ValueError, match="another base"):
        ckpt.restore(abstract, base_params=other)
    ckpt.close()


def test_peft_adapter_layout(tmp_path):
    c = tiny_config(num_layers=2, **LORA)
    params = _random_adapters(_params(c))
    out = lora.save_peft_adapter(params, c, str(tmp_path / "ad"), extra_metadata={"v": 3})
    with open(os.path.join(out, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    from safetensors.numpy import load_file

    t = load_file(os.path.join(out, "adapter_model.safetensors"))
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    assert t[q + ".lora_A.weight"].shape == (4, 32)
    assert t[q + ".lora_B.weight"].shape == (32, 4)
    assert t["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 64)
    assert len(t) == 2 * 7 * 2
    back = lora.load_peft_adapter(out, c)
    for a, b in zip(jax.tree.leaves(lora.split_adapters(params)[0]), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="lora_rank"):
        lora.load_peft_adapter(out, dataclasses.replace(c, lora_rank=8))


def test_base_hash_ignores_adapters_and_sees_the_base():
    c = tiny_config(**LORA)
    p = _params(c)
    assert lora.base_hash(p) == lora.base_hash(_random_adapters(p))
    assert lora.base_hash(p) != lora.base_hash(_params(c, seed=1))
    assert isinstance(TransformerConfig, type)
