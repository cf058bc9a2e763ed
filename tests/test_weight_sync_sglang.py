"""Adapter-only sync to a real SGLang server (its LoRA API), verified by the probe; an adapter
the server refuses is an error naming the server.

On the CPU server of the test suite SGLang 0.5.23 cannot run LoRA at all: its LoRA layers
allocate pinned host memory (``torch.tensor(..., pin_memory=True)`` in
``sglang/srt/lora/layers.py``), which needs a CUDA driver. So here the refusal is the real
server refusing ``/load_lora_adapter`` while it runs without ``--enable-lora``; the verified
round trip (load, probe, refuse a rank above ``--max-lora-rank``, keep serving the previous
adapter) runs where the SGLang venv has CUDA.
"""

import dataclasses
import json
import shutil
import subprocess

import jax
import pytest
from flax import nnx
from sglang_fixtures import SGLANG

from gagar_jax.models import Transformer, TransformerConfig, lora, save_hf_safetensors
from gagar_jax.rollout import weight_sync as ws
from gagar_jax.rollout.sglang_server import sglang_python
from tests.test_models_sglang import QWEN3

pytestmark = SGLANG


def _sglang_has_cuda() -> bool:
    try:
        out = subprocess.run(
            [str(sglang_python()), "-c", "import torch; print(torch.cuda.is_available())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "True"


def test_adapter_refused_by_the_server_is_an_error_naming_it(
    sglang_server, sglang_client, tiny_sglang_model, tmp_path
):
    """The session's server runs without --enable-lora: it refuses the adapter, the sync raises
    naming its URL, and nothing is taken as served."""
    with open(tiny_sglang_model / "config.json") as f:
        c = TransformerConfig.from_hf(json.load(f), lora_rank=4, lora_alpha=8.0)
    params = nnx.to_pure_dict(nnx.state(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param))
    sync = ws.SGLangLoraSync(sglang_client, c, str(tmp_path))
    with pytest.raises(ws.SyncCheckError, match=sglang_server.url):
        sync.sync_weights(params, 1)
    assert sync.loaded_version() is None and sglang_client.lora_name is None
    with pytest.raises(ws.SyncCheckError, match="reports version"):
        ws.check_sync(sync, params, c, 1)


@pytest.mark.skipif(
    not _sglang_has_cuda(), reason="SGLang's LoRA layers need CUDA (pinned host memory)"
)
def test_lora_sync_to_sglang_is_verified_and_a_refused_adapter_is_caught(
    tiny_sglang_model, sglang_workdir
):
    from gagar_jax.rollout.sglang_client import SGLangClient
    from gagar_jax.rollout.sglang_server import SGLangServer

    c = dataclasses.replace(QWEN3, lora_rank=4, lora_alpha=8.0)
    params = nnx.to_pure_dict(nnx.state(Transformer(c, rngs=nnx.Rngs(0)), nnx.Param))
    ad, base = lora.split_adapters(params)
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    ad = jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    )
    params = lora.combine(base, ad)
    out = sglang_workdir / "qwen3-lora-base"
    save_hf_safetensors(base, dataclasses.replace(c, lora_rank=0), str(out))
    for f in tiny_sglang_model.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    server = SGLangServer(
        out,
        model_modules=("qwen3",),
        max_running_requests=4,
        extra_args=("--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "all"),
    )
    server.start(timeout_s=400)
    try:
        sync = ws.SGLangLoraSync(
            SGLangClient(server.url, ignore_eos=True, vocab_size=1024),
            c,
            str(sglang_workdir / "lora-sync"),
        )
        assert sync.sync_weights(params, 1) == 1
        m = ws.check_sync(sync, params, c, 1, tolerance=1e-3)
        print(f"SGLang LoRA probe max |engine - trainer| = {m['sync/probe_max_abs_diff']:.3g}")
        wide = dataclasses.replace(c, lora_rank=8)  # above the server's --max-lora-rank
        big = nnx.to_pure_dict(nnx.state(Transformer(wide, rngs=nnx.Rngs(0)), nnx.Param))
        refusing = ws.SGLangLoraSync(sync.client, wide, str(sglang_workdir / "lora-sync-8"))
        with pytest.raises(ws.SyncCheckError, match=server.url):
            refusing.sync_weights(big, 2)
        ws.check_sync(sync, params, c, 1, tolerance=1e-3)  # version 1 still serves
    finally:
        server.stop()
