"""Routing replay of an SGLang server's routes: a tiny Qwen3-MoE served by a real SGLang
server (CPU, float32, ``--enable-return-routed-experts``) samples with its routes recorded
(``SGLangClient(record_routes=...)``); the update replays them.

At the served weights the update's own routes are the server's on (almost) every token (the
layout is right); one update step later (the server's weights one step stale) they differ on
some tokens without replay, and with replay the update routes every recorded token to the
server's experts (``mismatch/route_replay_match_frac`` 1), with finite gradients. Each
sample's last token was never fed to the server's model: it has no recorded route and
routes freely (``mismatch/route_recorded_frac`` below 1 by exactly those tokens).
"""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from sglang_fixtures import SGLANG

from gagar_jax.models import create_model, save_hf_safetensors
from gagar_jax.rollout import SamplingParams
from gagar_jax.update import (
    UpdateBatch,
    UpdateConfig,
    check_batch,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)
from tests.test_sglang_routes import MOE, SHAPE

pytestmark = SGLANG

G, K, P, R = 4, 4, 6, 10
CONFIG = UpdateConfig(
    learning_rate=3e-2,
    num_minibatches=2,
    num_microbatches=2,
    mismatch_metrics=True,
    decoupled=True,
    rollout_is="token",
)


def sampled_batch(client, seed: int) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(1, MOE.vocab_size, P)] for _ in range(G)]
    out = client.generate(prompts, SamplingParams(n=K, temperature=1.0, max_tokens=R, seed=seed))
    n, t = G * K, P + R
    tokens = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    attn = np.zeros((n, t), bool)
    resp = np.zeros((n, t), bool)
    old = np.zeros((n, t), np.float32)
    routes = np.full((n, t, MOE.num_layers, MOE.num_experts_per_tok), -1, np.int16)
    for g, samples in enumerate(out):
        for k, s in enumerate(samples):
            i, L = g * K + k, len(s.tokens)
            tokens[i, :P], tokens[i, P : P + L] = prompts[g], s.tokens
            positions[i, : P + L] = np.arange(P + L)
            attn[i, : P + L] = True
            resp[i, P : P + L] = True
            old[i, P : P + L] = s.logprobs
            routes[i, :P], routes[i, P : P + L] = s.prompt_routes, s.routes
    passed = np.zeros((G, K), bool)
    passed[:, :2] = True
    return UpdateBatch(
        tokens=tokens,
        positions=positions,
        attention_mask=attn,
        response_mask=resp,
        old_logprobs=old,
        rewards=passed.astype(np.float32),
        passed=passed,
        cheat=np.zeros((G, K), bool),
        tier=np.ones((G, K), np.int32),
        rank=np.ones((G, K), np.int32),
        valid=np.ones((G, K), bool),
        graded=np.ones((G,), bool),
        routes=routes,
    )


def run_update(params, batch, config):
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    check_batch(batch, config, mesh)
    state = create_train_state(MOE, config, mesh, params=params)
    new, m = jit_update(MOE, config, mesh, with_routes=True)(state, shard_batch(batch, mesh))
    return jax.device_get(new.params), {k: float(v) for k, v in jax.device_get(m).items()}


@pytest.fixture(scope="module")
def moe_server(tiny_sglang_model, sglang_workdir):
    from gagar_jax.rollout.sglang_client import SGLangClient
    from gagar_jax.rollout.sglang_server import SGLangServer

    model = create_model(MOE, seed=0)
    out = sglang_workdir / "qwen3-moe"
    save_hf_safetensors(model, MOE, str(out))
    for f in tiny_sglang_model.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    server = SGLangServer(
        out, model_modules=("qwen3_moe",), max_running_requests=16, return_routes=True
    )
    server.start(timeout_s=500)
    try:
        client = SGLangClient(
            server.url, ignore_eos=True, vocab_size=MOE.vocab_size, record_routes=SHAPE
        )
        yield model, client
    finally:
        server.stop()


def test_replaying_sglangs_routes_makes_the_update_route_as_the_server_did(moe_server):
    model, client = moe_server
    params0 = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    replay = dataclasses.replace(CONFIG, routing_replay=True)
    first = sampled_batch(client, seed=1)
    n_tokens = first.attention_mask.sum()
    # at the served weights: the update's own routes are the server's (up to near-ties)
    params1, m0 = run_update(params0, first, replay)
    print("served weights:", {k: v for k, v in m0.items() if k.startswith("mismatch/")})
    assert m0["mismatch/route_diff_frac"] <= 0.05
    assert m0["mismatch/route_replay_match_frac"] == 1.0
    # every token but each sample's last has the server's route
    assert m0["mismatch/route_recorded_frac"] == pytest.approx((n_tokens - G * K) / n_tokens)
    # one step of staleness: the server still serves params0, the update starts at params1
    stale = sampled_batch(client, seed=2)
    _, free = run_update(params1, stale, CONFIG)
    new, m = run_update(params1, stale, replay)
    print("one step stale:", {k: v for k, v in m.items() if k.startswith("mismatch/")})
    assert free["mismatch/route_diff_frac"] > 0.0
    assert free["mismatch/k3_no_replay"] > 0.0
    assert m["mismatch/route_replay_match_frac"] == 1.0
    assert m["mismatch/route_diff_frac"] == free["mismatch/route_diff_frac"]
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(new))
