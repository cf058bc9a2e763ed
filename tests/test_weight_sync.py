"""Verified weight sync: after every sync the engine reports the new version and a probe
prompt's log-probs on it equal the trainer's; adapter-only sync for LoRA; real failures (a
sampler left with stale weights, an adapter put on another base, an engine that skips the
update, an adapter the server refuses) are errors naming the engine."""

import http.server
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gagar_jax.models import Transformer, lora
from gagar_jax.rollout import weight_sync as ws
from gagar_jax.rollout.sampler import Sampler
from tests.update_fixtures import tiny_config

LORA = dict(lora_rank=4, lora_alpha=8.0, initializer_range=0.3)
BUCKETS = dict(batch_buckets=(1,), prompt_buckets=(16,), new_token_buckets=(8,))


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _trained(params, seed=1, scale=0.1):
    """``params`` with every adapter leaf moved at random (B too): a trained adapter."""
    ad, base = lora.split_adapters(params)
    leaves, tree = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return lora.combine(base, jax.tree.unflatten(tree, moved))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_only_sync_is_verified_and_moves_adapters_only(dtype):
    c = tiny_config(dtype=dtype, **LORA)
    model = Transformer(c, rngs=nnx.Rngs(0))
    sampler = Sampler(model, **BUCKETS)
    before = nnx.to_pure_dict(sampler.state)
    new = _trained(_params(model))
    assert ws.sync_sampler_adapters(sampler, lora.split_adapters(new)[0], 1) == 1
    after = nnx.to_pure_dict(sampler.state)
    for a, b in zip(
        jax.tree.leaves(lora.split_adapters(before)[1]),
        jax.tree.leaves(lora.split_adapters(after)[1]),
    ):
        assert a is b  # the base stayed in place: only the adapters moved
    m = ws.check_sync(sampler, new, c, 1)
    # the measured engine-trainer difference (docs/benchmarks.md, "Weight sync check")
    print(f"{dtype}: probe max |engine - trainer| = {m['sync/probe_max_abs_diff']:.3g}")
    assert m["sync/probe_max_abs_diff"] <= ws.default_tolerance(c)


def test_stale_sampler_is_caught_naming_the_engine():
    c = tiny_config(**LORA)
    model = Transformer(c, rngs=nnx.Rngs(0))
    sampler = Sampler(model, **BUCKETS)
    old = _params(model)
    new = _trained(old)
    sampler.sync_weights(old, 2)  # the engine says version 2 but holds the old weights
    with pytest.raises(ws.SyncCheckError, match=r"Sampler.*version 2.*differ"):
        ws.check_sync(sampler, new, c, 2)
    with pytest.raises(ws.SyncCheckError, match="reports version"):
        ws.check_sync(sampler, old, c, 3)
    sampler.sync_weights(new, 3)  # the full sync, verified the same way
    ws.check_sync(sampler, new, c, 3)


def test_adapter_on_another_base_is_caught():
    """The adapter reaches a sampler whose base is not the trainer's (built from another seed):
    the sync itself succeeds and the version is right, the probe is not."""
    c = tiny_config(**LORA)
    trainer = _trained(_params(Transformer(c, rngs=nnx.Rngs(0))))
    sampler = Sampler(Transformer(c, rngs=nnx.Rngs(1)), **BUCKETS)
    ws.sync_sampler_adapters(sampler, lora.split_adapters(trainer)[0], 1)
    with pytest.raises(ws.SyncCheckError, match="did not take effect"):
        ws.check_sync(sampler, trainer, c, 1)


class _SkippingSampler(Sampler):
    """An engine that acknowledges a sync and keeps its weights (the undelivered adapter)."""

    def sync_weights(self, params_or_path, version):
        self.policy_version = int(version)
        return self.policy_version


def test_acknowledged_but_skipped_sync_is_caught():
    c = tiny_config(**LORA)
    model = Transformer(c, rngs=nnx.Rngs(0))
    sampler = _SkippingSampler(model, **BUCKETS)
    new = _trained(_params(model))
    assert ws.sync_sampler_adapters(sampler, lora.split_adapters(new)[0], 1) == 1
    with pytest.raises(ws.SyncCheckError, match="_SkippingSampler"):
        ws.check_sync(sampler, new, c, 1)


def test_policy_sync_engine_sends_the_base_once_then_adapters(tmp_path):
    from gagar_jax.rl import policy
    from gagar_jax.rl.config import RunConfig
    from gagar_jax.update import make_mesh

    c = tiny_config(**LORA)
    model = Transformer(c, rngs=nnx.Rngs(0))
    sampler = Sampler(Transformer(c, rngs=nnx.Rngs(3)), **BUCKETS)  # another base at first
    cfg = RunConfig.from_config_dict({"model": {"lora_rank": 4, "lora_alpha": 8.0}})
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    device = jax.devices()[0]
    params = _trained(_params(model))
    metrics = {}
    policy.sync_engine(sampler, cfg, params, mesh=mesh, device=device, version=1, metrics=metrics)
    assert metrics["sync/probe_max_abs_diff"] <= ws.default_tolerance(c)
    base_leaves = jax.tree.leaves(lora.split_adapters(nnx.to_pure_dict(sampler.state))[1])
    params = _trained(params, seed=2)
    policy.sync_engine(sampler, cfg, params, mesh=mesh, device=device, version=2)
    now = jax.tree.leaves(lora.split_adapters(nnx.to_pure_dict(sampler.state))[1])
    assert all(a is b for a, b in zip(base_leaves, now))  # the second sync: adapters only


class _RefusingServer(http.server.BaseHTTPRequestHandler):
    """Answers /load_lora_adapter as SGLang does for an adapter it cannot load."""

    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(n))
        msg = {
            "success": False,
            "error_message": f"LoRA rank of {body['lora_name']} exceeds --max-lora-rank",
        }
        data = json.dumps(msg).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_refused_adapter_is_an_error_naming_the_server(tmp_path):
    from gagar_jax.rollout.sglang_client import SGLangClient

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RefusingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        c = tiny_config(**LORA)
        sync = ws.SGLangLoraSync(SGLangClient(url), c, str(tmp_path))
        params = _trained(_params(Transformer(c, rngs=nnx.Rngs(0))))
        with pytest.raises(ws.SyncCheckError, match=rf"{url}/load_lora_adapter refused.*rank"):
            sync.sync_weights(params, 1)
        assert sync.loaded_version() is None  # nothing is taken as served
        assert (tmp_path / "lora_v000001" / "adapter_model.safetensors").exists()
    finally:
        server.shutdown()
        server.server_close()


def test_trainer_logprobs_on_a_sharded_mesh_match_one_device():
    from gagar_jax.update import create_train_state, make_mesh
    from tests.update_fixtures import CONFIG

    c = tiny_config(**LORA)
    mesh = make_mesh((1, 4, 2))
    state = create_train_state(c, CONFIG, mesh, seed=0)
    tokens = ws.probe_prompt(c.vocab_size) + [3, 4, 5]
    sharded = ws.trainer_logprobs(state.params, c, tokens, 16)
    host = ws.trainer_logprobs(jax.device_get(state.params), c, tokens, 16)
    np.testing.assert_allclose(sharded, host, atol=1e-5)
    assert sharded.shape == (3,) and np.all(np.asarray(jnp.isfinite(sharded)))
