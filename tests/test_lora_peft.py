"""LoRA export parity with Hugging Face ``peft`` (the ``parity`` extra: CPU torch, fp32).

The adapter written by :func:`gagar_jax.models.lora.save_peft_adapter`, applied by
``peft.PeftModel.from_pretrained`` to the base written by ``save_hf_safetensors``, gives the
logits of the merged export loaded by ``transformers`` (within 1e-5) and of our JAX model with
the adapters (within the float32 tolerance of the two frameworks' kernels); the gradient of the
adapters under PEFT equals ours.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from gagar_jax.models import Transformer, lora, model_from_params
from gagar_jax.models.hf import save_hf_safetensors
from tests.update_fixtures import tiny_config

PARITY = 1e-5  # merged export vs the adapter applied by peft (both in torch)
CROSS = 1e-4  # our JAX logits vs torch's (kernels differ in float32 summation order)


def _setup(tmp_path, **overrides):
    c = tiny_config(
        vocab_size=101, qk_norm=True, qkv_bias=False, lora_rank=4, lora_alpha=8.0, **overrides
    )
    plain = dataclasses.replace(c, lora_rank=0)
    params = nnx.to_pure_dict(nnx.state(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param))
    ad, base = lora.split_adapters(params)
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    ad = jax.tree.unflatten(
        tree, [0.1 * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)]
    )
    params = lora.combine(base, ad)
    base_dir = save_hf_safetensors(base, plain, str(tmp_path / "base"))
    adapter_dir = lora.save_peft_adapter(params, c, str(tmp_path / "adapter"))
    merged_dir = save_hf_safetensors(lora.merged_params(params, c), plain, str(tmp_path / "merged"))
    return c, params, base_dir, adapter_dir, merged_dir


def _tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, 101, (2, 9)).astype(np.int64)


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj", "down_proj")])
def test_merged_export_equals_peft_adapter(tmp_path, targets):
    extra = {} if targets is None else {"lora_targets": targets}
    c, params, base_dir, adapter_dir, merged_dir = _setup(tmp_path, **extra)
    tokens = _tokens()
    with torch.no_grad():
        with_adapter = peft.PeftModel.from_pretrained(_load(base_dir), adapter_dir).eval()
        got = with_adapter(input_ids=torch.from_numpy(tokens)).logits.numpy()
        merged = _load(merged_dir)(input_ids=torch.from_numpy(tokens)).logits.numpy()
        base = _load(base_dir)(input_ids=torch.from_numpy(tokens)).logits.numpy()
    assert np.max(np.abs(got - base)) > 1e-2  # peft applied the adapter: it changes the logits
    np.testing.assert_allclose(got, merged, atol=PARITY, rtol=0)
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    ours = np.asarray(
        model_from_params(c, params)(jnp.asarray(tokens, jnp.int32), jnp.asarray(pos))
    )
    np.testing.assert_allclose(ours, got, atol=CROSS, rtol=0)


def test_adapter_gradient_equals_peft(tmp_path):
    c, params, base_dir, adapter_dir, _ = _setup(tmp_path)
    tokens = _tokens()
    targets = np.roll(tokens, -1, axis=1)
    model = peft.PeftModel.from_pretrained(_load(base_dir), adapter_dir, is_trainable=True)
    logits = model(input_ids=torch.from_numpy(tokens)).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1)
    )
    loss.backward()
    want = {
        n.replace(".default", ""): p.grad.numpy()
        for n, p in model.named_parameters()
        if "lora_" in n
    }
    graphdef = nnx.graphdef(model_from_params(c, params))
    ad, base = lora.split_adapters(params)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    def our_loss(ad):
        m = nnx.merge(graphdef, lora.combine(base, ad))
        logp = jax.nn.log_softmax(m(jnp.asarray(tokens, jnp.int32), pos), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1))

    got = lora.peft_tensors(lora.combine(base, jax.grad(our_loss)(ad)), c)
    assert sorted(got) == sorted(want)
    for name in got:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6, rtol=1e-3, err_msg=name)
