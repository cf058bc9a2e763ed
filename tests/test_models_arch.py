"""Qwen3, Llama 3.x and Qwen3-MoE: logits parity with Hugging Face ``transformers`` (random
models built from their configs, fp32), safetensors round trips, config refusals, the scanned
layer layout, sharded MoE == unsharded, router statistics and the load-balancing loss."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gagar_jax.models import (
    TransformerConfig,
    create_model,
    load_hf_safetensors,
    param_shardings,
    save_hf_safetensors,
    stack_layer_params,
    to_hf_tensors,
    unstack_layer_params,
)
from gagar_jax.models.hf import model_from_params
from gagar_jax.models.transformer import rope_inv_freq, rope_tables

TOL = 1e-4
COMMON = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _hf_configs():
    return {
        # head_dim 16 != hidden / heads = 8: Qwen3 allows it, and it must round-trip.
        "qwen3": transformers.Qwen3Config(
            **COMMON, head_dim=16, max_position_embeddings=256, rope_theta=10000.0
        ),
        # original_max_position_embeddings 64 puts head_dim 16's frequencies in all three
        # llama3 bands (kept, interpolated, divided by factor).
        "llama3": transformers.LlamaConfig(
            **COMMON,
            head_dim=16,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **COMMON,
            head_dim=8,
            max_position_embeddings=256,
            rope_theta=10000.0,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            router_aux_loss_coef=0.01,
        ),
    }


def _inputs(seed=0, offset=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 101, (2, 9)).astype(np.int64)
    mask = np.ones((2, 9), bool)
    mask[1, :3] = False  # left padding on row 1
    tokens[1, :3] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0) + offset
    return tokens, positions, mask


def _hf_forward(hf_model, tokens, positions, mask, **kw):
    with torch.no_grad():
        return hf_model(
            input_ids=torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(mask.astype(np.int64)),
            position_ids=torch.from_numpy(positions.astype(np.int64)),
            **kw,
        )


@nnx.jit
def _fwd(model, tokens, positions, mask):
    return model(tokens, positions, attention_mask=mask, return_aux=True)


def _ours(model, tokens, positions, mask):
    logits, aux = _fwd(
        model, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(mask)
    )
    return np.asarray(logits), jax.device_get(aux)


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """arch -> (directory of a saved random HF model, the HF model)."""
    out = {}
    for arch, cfg in _hf_configs().items():
        torch.manual_seed(0)
        hf_model = (
            transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
            .float()
            .eval()
        )
        with torch.no_grad():  # random norm weights (q_norm/k_norm included), larger router
            for name, p in hf_model.named_parameters():
                p.add_(
                    (0.3 if "gate" in name and "proj" not in name else 0.05) * torch.randn_like(p)
                )
        d = tmp_path_factory.mktemp(arch)
        hf_model.save_pretrained(d, safe_serialization=True)
        out[arch] = (str(d), hf_model)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "llama3", "qwen3_moe"])
def test_logits_parity_and_round_trip(hf_checkpoints, arch, tmp_path):
    directory, hf_model = hf_checkpoints[arch]
    config, model = load_hf_safetensors(directory)
    assert config.qkv_bias is False
    assert config.qk_norm == (arch != "llama3")
    assert config.num_experts == (6 if arch == "qwen3_moe" else 0)
    assert (config.rope_llama3_scaling is not None) == (arch == "llama3")
    # Positions offset by 40: the llama3-scaled frequencies change the logits visibly there.
    tokens, positions, mask = _inputs(offset=40)
    ours, aux = _ours(model, tokens, positions, mask)
    theirs = _hf_forward(
        hf_model,
        tokens,
        positions,
        mask,
        **({"output_router_logits": True} if arch == "qwen3_moe" else {}),
    )
    np.testing.assert_allclose(ours[mask], theirs.logits.numpy()[mask], atol=TOL, rtol=TOL)
    if arch == "qwen3_moe":
        # HF's load_balancing_loss_func over the same tokens (padding excluded).
        assert float(aux["router_aux_loss"]) == pytest.approx(float(theirs.aux_loss), rel=1e-4)
        assert 0 < float(aux["router_load_min"]) <= 1 <= float(aux["router_load_max"])
        assert 0 < float(aux["router_entropy"]) <= np.log(6) + 1e-5
    else:
        assert aux == {}
    if arch == "llama3":  # the scaling matters: plain RoPE of the same theta gives other logits
        plain = model_from_params(
            dataclasses.replace(config, rope_llama3_scaling=None),
            nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        )
        other, _ = _ours(plain, tokens, positions, mask)
        assert np.abs(other[mask] - ours[mask]).max() > 20 * TOL
    # Export: the same tensors under the same names, and transformers loads it back.
    from safetensors.numpy import load_file

    theirs_t = load_file(f"{directory}/model.safetensors")
    ours_t = to_hf_tensors(nnx.to_pure_dict(nnx.state(model, nnx.Param)), config)
    assert sorted(ours_t) == sorted(theirs_t)
    for k in ours_t:
        np.testing.assert_array_equal(ours_t[k], theirs_t[k], err_msg=k)
    save_hf_safetensors(model, config, str(tmp_path))
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(again) is type(hf_model)
    np.testing.assert_allclose(
        _hf_forward(again, tokens, positions, mask).logits.numpy()[mask],
        ours[mask],
        atol=TOL,
        rtol=TOL,
    )
    assert TransformerConfig.from_hf(config.to_hf()) == config


def test_llama3_inv_freq_matches_transformers():
    cfg = _hf_configs()["llama3"]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(16, 500000.0, (8.0, 1.0, 4.0, 64))
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    assert not np.allclose(ours, rope_inv_freq(16, 500000.0))


def test_from_hf_refuses_what_it_does_not_implement():
    qwen3 = TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        qkv_bias=False,
        qk_norm=True,
    ).to_hf()
    moe = TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        qkv_bias=False,
        qk_norm=True,
        num_experts=4,
        moe_intermediate_size=16,
    ).to_hf()
    llama = TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        qkv_bias=False,
    ).to_hf()
    cases = [
        ({**qwen3, "attention_bias": True}, "attention_bias"),
        ({**qwen3, "layer_types": ["sliding_attention"]}, "layer_types"),
        ({**moe, "mlp_only_layers": [0]}, "mlp_only_layers"),
        ({**moe, "decoder_sparse_step": 2}, "decoder_sparse_step"),
        ({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({**llama, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters"),
        ({**qwen3, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({**llama, "hidden_act": "gelu"}, "hidden_act"),
    ]
    for hf, field in cases:
        with pytest.raises(NotImplementedError, match=field):
            TransformerConfig.from_hf(hf)
    with pytest.raises(ValueError, match="llama3 lacks"):
        TransformerConfig.from_hf({**llama, "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        TransformerConfig.from_hf({**moe, "num_experts_per_tok": 5})


MOE = TransformerConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=48,
    qkv_bias=False,
    qk_norm=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    initializer_range=0.2,
)


def test_moe_sharded_equals_unsharded():
    """Experts split over the `tensor` mesh axis (2 x 2 x 2 mesh): same logits and aux."""
    from gagar_jax.update import make_mesh

    model = create_model(MOE, seed=1)
    graphdef, state = nnx.split(model)
    tokens, positions, mask = _inputs()
    tokens = jnp.asarray(np.concatenate([tokens, tokens[::-1]]) % 64, jnp.int32)
    positions = jnp.asarray(np.concatenate([positions, positions[::-1]]), jnp.int32)
    mask = jnp.asarray(np.concatenate([mask, mask[::-1]]))

    def fwd(state, t, p, m):
        return nnx.merge(graphdef, state)(t, p, attention_mask=m, return_aux=True)

    ref = jax.jit(fwd)(state, tokens, positions, mask)
    mesh = make_mesh((2, 2, 2))
    params = nnx.state(model, nnx.Param)
    shardings = param_shardings(params, mesh)
    assert shardings["layers"][0]["mlp"]["gate_proj"].spec == PartitionSpec("tensor", "fsdp", None)
    sharded = jax.device_put(nnx.to_pure_dict(params), shardings)
    placed = nnx.split(model_from_params(MOE, jax.device_get(sharded)))[1]
    nnx.replace_by_pure_dict(placed, sharded)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    got = jax.jit(fwd)(placed, *[jax.device_put(x, rows) for x in (tokens, positions, mask)])
    assert got[0].sharding.spec[0] == ("data", "fsdp") or got[0].sharding.mesh.size == 8
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), atol=1e-5, rtol=1e-5)
    for k in ref[1]:
        np.testing.assert_allclose(float(got[1][k]), float(ref[1][k]), rtol=1e-5, err_msg=k)


def test_router_statistics_reference():
    """Router metrics against a NumPy recomputation from the router's own logits."""
    model = create_model(dataclasses.replace(MOE, num_layers=1), seed=2)
    tokens, positions, mask = _inputs()
    tokens = tokens % 64
    _, aux = _ours(model, tokens, positions, mask)
    p = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    @nnx.jit
    def router_input(m, t, pos, msk):  # layer 0's MLP input, from the model's own modules
        layer = m.layers[0]
        x = m.embed_tokens[...][t]
        causal = jnp.tril(jnp.ones((9, 9), bool))[None] & msk[:, None]
        c = m.config
        tables = rope_tables(pos, jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta)))
        y, _ = layer.self_attn(layer.input_layernorm(x), tables, causal)
        return layer.post_attention_layernorm(x + y)

    h = np.asarray(
        router_input(
            model,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            jnp.asarray(mask),
        )
    )
    r = h.astype(np.float64) @ np.asarray(p["layers"][0]["mlp"]["router"], np.float64)
    probs = np.exp(r - r.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[..., :2]
    w = mask.astype(np.float64)
    counts = np.zeros(4)
    for e in range(4):
        counts[e] = ((top == e).any(-1) * w).sum()
    f, pm = counts / w.sum(), (probs * w[..., None]).sum((0, 1)) / w.sum()
    assert float(aux["router_aux_loss"]) == pytest.approx(4 * (f * pm).sum(), rel=1e-4)
    assert float(aux["router_load_max"]) == pytest.approx(counts.max() / counts.sum() * 4, 1e-5)
    ent = -(probs * np.log(probs)).sum(-1)
    assert float(aux["router_entropy"]) == pytest.approx((ent * w).sum() / w.sum(), rel=1e-4)


def test_scan_layers_equal_unrolled(tmp_path):
    """Stacked params + lax.scan == per-layer blocks (Qwen3-MoE: q/k norms and experts stacked
    too): forward, cached decode, gradients under a remat policy, and both layouts export the
    same safetensors."""
    config = dataclasses.replace(MOE, num_layers=3)
    model = create_model(config, seed=4)
    params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    scanned_cfg = dataclasses.replace(config, scan_layers=True)
    scanned = model_from_params(scanned_cfg, params)
    st = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    assert st["layers"]["self_attn"]["q_proj"].shape == (config.num_layers, 32, 4, 8)
    tokens, positions, mask = _inputs()
    tokens = jnp.asarray(tokens % 64, jnp.int32)
    positions, mask = jnp.asarray(positions, jnp.int32), jnp.asarray(mask)
    a, aux_a = _fwd(model, tokens, positions, mask)
    b, aux_b = _fwd(scanned, tokens, positions, mask)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    for k in aux_a:
        np.testing.assert_allclose(float(aux_a[k]), float(aux_b[k]), rtol=1e-5)

    def decode_all(m):
        cache = m.init_cache(2, 12)
        lg, cache = m.decode(tokens[:, :5], positions[:, :5], cache, attention_mask=mask[:, :5])
        outs = [lg]
        for t in range(5, 9):
            lg, cache = m.decode(tokens[:, t : t + 1], positions[:, t : t + 1], cache)
            outs.append(lg)
        return jnp.concatenate(outs, axis=1)

    da, db = nnx.jit(decode_all)(model), nnx.jit(decode_all)(scanned)
    np.testing.assert_allclose(np.asarray(da), np.asarray(db), atol=1e-5, rtol=1e-5)
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(db)[m], np.asarray(a)[m], atol=1e-5)

    def loss(mdl):
        return jnp.mean(mdl(tokens, positions, attention_mask=mask) ** 2)

    ga = nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(model))
    remat = model_from_params(
        dataclasses.replace(scanned_cfg, remat=True, remat_policy="dots"), params
    )
    gb = unstack_layer_params(nnx.to_pure_dict(nnx.jit(nnx.grad(loss))(remat)))
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree.leaves(gb)):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-4, err_msg=str(path)
        )
    # Export from either layout: identical tensors; stacking round-trips.
    ea = to_hf_tensors(params, config)
    eb = to_hf_tensors(jax.device_get(st), scanned_cfg)
    assert sorted(ea) == sorted(eb)
    assert all(np.array_equal(ea[k], eb[k]) for k in ea)
    jax.tree.map(
        np.testing.assert_array_equal, unstack_layer_params(stack_layer_params(params)), params
    )
    save_hf_safetensors(scanned, scanned_cfg, str(tmp_path))
    cfg2, loaded = load_hf_safetensors(str(tmp_path), scan_layers=True)
    assert cfg2 == scanned_cfg
    np.testing.assert_array_equal(
        np.asarray(_fwd(loaded, tokens, positions, mask)[0]), np.asarray(b)
    )


_COMPILE_NONCE = itertools.count(1)


def _grad_program(config):
    """The lowered ``jax.grad`` program of a small loss on ``config``'s model."""
    model = create_model(config, seed=0)
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, 32), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (2, 32))
    # A scale of its own in every program: the tests' persistent compilation cache
    # (tests/conftest.py) never answers one from an earlier compile, so each is compiled.
    scale = float(next(_COMPILE_NONCE))

    def loss(st):
        return scale * jnp.mean(nnx.merge(graphdef, st)(tokens, pos) ** 2)

    return jax.jit(jax.grad(loss)).lower(state)


def _instructions(module_text: str) -> int:
    return sum(1 for line in module_text.splitlines() if " = " in line)


def test_scanned_program_size_flat_in_depth():
    """What XLA compiles for 8 scanned layers is as large as for 2 (one loop body, the layers'
    weights stacked), so compile time is flat in depth; unrolled, the program grows with the
    layers. Instructions are counted, not seconds: deterministic under any load (the compile
    seconds are measured in benchmarks/update.py)."""
    base = TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        scan_layers=True,
    )
    deep = dataclasses.replace(base, num_layers=8)
    # After XLA's passes: it must not have unrolled the loop.
    compiled = [_instructions(_grad_program(c).compile().as_text()) for c in (base, deep)]
    assert compiled[0] > 100 and abs(compiled[1] - compiled[0]) <= 0.05 * compiled[0], compiled
    lowered = [
        _instructions(_grad_program(dataclasses.replace(c, scan_layers=s)).as_text())
        for s in (True, False)
        for c in (base, deep)
    ]
    assert abs(lowered[1] - lowered[0]) <= 0.05 * lowered[0], lowered
    assert lowered[3] > 2.5 * lowered[2], lowered  # unrolled: the measure sees the layers
