"""An exported Qwen3 checkpoint serves in a real SGLang server and generates the embedded
sampler's greedy tokens (fp32, random weights, the session's locally trained tokenizer)."""

import shutil

import jax
import pytest
from flax import nnx
from sglang_fixtures import SGLANG

from gagar_jax.models import TransformerConfig, create_model, save_hf_safetensors
from gagar_jax.rollout import SamplingParams
from gagar_jax.rollout.sampler import Sampler

pytestmark = SGLANG

QWEN3 = TransformerConfig(
    vocab_size=1024,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,  # != hidden / heads: Qwen3's separate head_dim is exercised
    intermediate_size=128,
    rope_theta=10000.0,
    qkv_bias=False,
    qk_norm=True,
    initializer_range=0.2,  # peaked logits: greedy choices far from ties
    max_position_embeddings=2048,
)


def test_exported_qwen3_serves_same_greedy_tokens(tiny_sglang_model, sglang_workdir):
    from gagar_jax.rollout.sglang_client import SGLangClient
    from gagar_jax.rollout.sglang_server import SGLangServer

    model = create_model(QWEN3, seed=5)
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))  # non-trivial q/k norm weights
    nnx.update(
        model,
        jax.tree.unflatten(
            treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
        ),
    )
    out = sglang_workdir / "qwen3-export"
    save_hf_safetensors(model, QWEN3, str(out))
    for f in tiny_sglang_model.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    prompts = [[5, 17, 300, 42, 7], [900, 12, 3, 3, 3, 3, 800], [64] * 12]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ours = Sampler(model, batch_buckets=(4,), prompt_buckets=(16,), new_token_buckets=(16,))
    expected = [row[0].tokens for row in ours.generate(prompts, params)]
    server = SGLangServer(out, model_modules=("qwen3",), max_running_requests=4)
    server.start(timeout_s=400)
    try:
        client = SGLangClient(server.url, ignore_eos=True, vocab_size=1024)
        got = client.generate(prompts, params)
    finally:
        server.stop()
    assert [row[0].tokens for row in got] == expected
    for row, exp in zip(got, ours.generate(prompts, params)):
        assert row[0].logprobs == pytest.approx(exp[0].logprobs, abs=1e-4)
