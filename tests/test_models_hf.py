"""Safetensors import/export parity with Hugging Face ``transformers`` (CPU torch, fp32)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from gagar_jax.models import TransformerConfig, create_model
from gagar_jax.models.hf import load_hf_safetensors, save_hf_safetensors

TOL = 1e-4


def _hf_config(model_type, tie):
    common = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
    )
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common, head_dim=8)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 101, (2, 9)).astype(np.int64)
    mask = np.ones((2, 9), bool)
    mask[1, :3] = False  # left padding on row 1
    tokens[1, :3] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, positions, mask


def _hf_logits(hf_model, tokens, positions, mask):
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.from_numpy(tokens),
            attention_mask=torch.from_numpy(mask.astype(np.int64)),
            position_ids=torch.from_numpy(positions.astype(np.int64)),
        )
    return out.logits.float().numpy()


@nnx.jit
def _fwd(model, tokens, positions, mask):
    return model(tokens, positions, attention_mask=mask)


def _ours(model, tokens, positions, mask):
    return np.asarray(
        _fwd(
            model,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            jnp.asarray(mask),
        )
    )


@pytest.mark.parametrize("model_type,tie", [("qwen2", False), ("llama", True)])
def test_import_transformers_checkpoint(tmp_path, model_type, tie):
    torch.manual_seed(0)
    hf_model = (
        transformers.AutoModelForCausalLM.from_config(
            _hf_config(model_type, tie), attn_implementation="eager"
        )
        .float()
        .eval()
    )
    with torch.no_grad():  # random biases / norm weights so every tensor matters
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    config, model = load_hf_safetensors(str(tmp_path))
    assert config.qkv_bias == (model_type == "qwen2") and config.tie_embeddings == tie
    tokens, positions, mask = _inputs()
    ours = _ours(model, tokens, positions, mask)
    theirs = _hf_logits(hf_model, tokens, positions, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("qkv_bias,tie", [(True, False), (False, True)])
def test_export_loads_in_transformers(tmp_path, qkv_bias, tie):
    config = TransformerConfig(
        vocab_size=101,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
        rope_theta=10000.0,
        qkv_bias=qkv_bias,
        tie_embeddings=tie,
    )
    model = create_model(config, seed=3)
    # Non-zero biases and norm weights, the noise drawn on the host (drawn with jax.random op
    # by op, every leaf shape would compile a random-bits program of its own).
    rng = np.random.default_rng(7)
    nnx.update(
        model,
        jax.tree.map(
            lambda x: x + jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype),
            nnx.state(model, nnx.Param),
        ),
    )
    save_hf_safetensors(model, config, str(tmp_path))
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == ("qwen2" if qkv_bias else "llama")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    tokens, positions, mask = _inputs(1)
    ours = _ours(model, tokens, positions, mask)
    theirs = _hf_logits(hf_model, tokens, positions, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=TOL, rtol=TOL)
    # And back: our own loader reproduces the exported model exactly.
    _, again = load_hf_safetensors(str(tmp_path))
    np.testing.assert_array_equal(_ours(again, tokens, positions, mask), ours)


def test_missing_tensor_is_named(tmp_path):
    config = TransformerConfig(
        vocab_size=101,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,
    )
    save_hf_safetensors(create_model(config), config, str(tmp_path))
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="up_proj"):
        load_hf_safetensors(str(tmp_path))
