"""Routing replay for mixture-of-experts models (``learner.routing_replay``).

The embedded sampler records the experts each token went to (``record_routes``); the update
routes every token to those experts, with gate weights from its current router over them.
The proof: a tiny Qwen3-MoE sampled in bfloat16 with the previous step's weights (one step of
staleness) and updated in float32: without replay the update's own routes differ from the
recorded ones on some tokens and its log-probs from the behaviour's (``mismatch/route_diff_frac``,
``mismatch/k3_no_replay``); with replay the routes it uses are the recorded ones on every token,
its gradients are finite, and the update on 8 (simulated) devices equals the one-device update.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gagar_jax.models import create_model
from gagar_jax.rollout import SamplingParams
from gagar_jax.rollout.sampler import Sampler
from gagar_jax.update import (
    UpdateBatch,
    UpdateConfig,
    check_batch,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)
from tests.update_fixtures import tiny_config

MOE = tiny_config(
    vocab_size=61,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    qk_norm=True,
    qkv_bias=False,
    initializer_range=0.3,
)
G, K, P, R = 4, 4, 6, 10
CONFIG = UpdateConfig(
    learning_rate=3e-2,
    num_minibatches=2,
    num_microbatches=2,
    mismatch_metrics=True,
    decoupled=True,
    rollout_is="token",
)


@pytest.fixture(scope="module")
def model():
    return create_model(MOE, seed=0)


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def sampled_batch(sampler: Sampler, seed: int = 3) -> UpdateBatch:
    """G groups of K samples with their recorded routes, packed as the loop packs them."""
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(1, MOE.vocab_size, P)] for _ in range(G)]
    out = sampler.generate(prompts, SamplingParams(n=K, temperature=1.0, max_tokens=R, seed=seed))
    n, t = G * K, P + R
    tokens = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    attn = np.zeros((n, t), bool)
    resp = np.zeros((n, t), bool)
    old = np.zeros((n, t), np.float32)
    routes = np.zeros((n, t, MOE.num_layers, MOE.num_experts_per_tok), np.int16)
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


def buckets():
    return dict(batch_buckets=(16,), prompt_buckets=(8,), new_token_buckets=(16,))


def run_update(params, batch, config, mesh_shape=(1, 1, 1)):
    n = int(np.prod(mesh_shape))
    mesh = make_mesh(mesh_shape, devices=jax.devices()[:n])
    check_batch(batch, config, mesh)
    state = create_train_state(MOE, config, mesh, params=params)
    new, m = jit_update(MOE, config, mesh, with_routes=batch.routes is not None)(
        state, shard_batch(batch, mesh)
    )
    return jax.device_get(new.params), {k: float(v) for k, v in jax.device_get(m).items()}


@pytest.fixture(scope="module")
def stale_bf16_rollout(model):
    """(trainer params one step ahead, a batch sampled in bfloat16 with the previous
    step's weights, its routes recorded)."""
    params0 = params_of(model)
    fresh = sampled_batch(Sampler(model, record_routes=True, **buckets()), seed=1)
    params1, _ = run_update(params0, fresh, dataclasses.replace(CONFIG, routing_replay=True))
    stale = Sampler(model, precision="bfloat16", record_routes=True, **buckets())
    return params1, sampled_batch(stale, seed=2)


def test_without_replay_routes_and_logprobs_differ(stale_bf16_rollout):
    params1, batch = stale_bf16_rollout
    _, m = run_update(params1, batch, CONFIG)
    assert m["mismatch/route_diff_frac"] > 0.02
    assert m["mismatch/k3_no_replay"] > 1e-4
    assert m["mismatch/k3"] == m["mismatch/k3_no_replay"]  # the loss saw the free routes
    assert "mismatch/route_replay_match_frac" not in m


def test_with_replay_the_update_uses_the_recorded_routes_on_every_token(stale_bf16_rollout):
    params1, batch = stale_bf16_rollout
    new, m = run_update(params1, batch, dataclasses.replace(CONFIG, routing_replay=True))
    assert m["mismatch/route_replay_match_frac"] == 1.0
    assert m["mismatch/route_diff_frac"] > 0.02  # measured without replay, as before
    assert m["mismatch/k3_replay"] == m["mismatch/k3"]
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(new))
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), new, params1)
    assert moved["layers"][0]["mlp"]["router"] > 0  # the router still learns under replay


def test_replay_is_the_same_sharded_as_on_one_device(stale_bf16_rollout):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    params1, batch = stale_bf16_rollout
    # Adam's first step is about lr * sign(g), which turns the float rounding of a gradient
    # near 0 into a whole step; with eps = 1 the step is about lr * g and the comparison is
    # of the gradients
    config = dataclasses.replace(CONFIG, routing_replay=True, eps=1.0, learning_rate=1.0)
    one, m1 = run_update(params1, batch, config)
    many, m8 = run_update(params1, batch, config, mesh_shape=(2, 2, 2))
    for a, b, p in zip(jax.tree.leaves(one), jax.tree.leaves(many), jax.tree.leaves(params1)):
        np.testing.assert_allclose(a - p, b - p, rtol=1e-3, atol=1e-7)
    assert m8["mismatch/route_replay_match_frac"] == 1.0
    assert m8["mismatch/route_diff_frac"] == m1["mismatch/route_diff_frac"]
    assert m8["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-6)


def test_replaying_a_models_own_routes_is_its_forward_exactly(model):
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, MOE.vocab_size, (3, 9)))
    pos = jnp.broadcast_to(jnp.arange(9), (3, 9))
    h, routes = model.hidden_states(tokens, pos, return_routes=True)
    assert routes.shape == (3, 9, MOE.num_layers, MOE.num_experts_per_tok)
    h2, used = model.hidden_states(tokens, pos, routes=routes, return_routes=True)
    np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(used), np.asarray(routes))
    # other experts: another forward; the gate weights are the router's probabilities over
    # the given experts, renormalised
    other = (routes + 1) % MOE.num_experts
    h3, used3 = model.hidden_states(tokens, pos, routes=other, return_routes=True)
    np.testing.assert_array_equal(np.asarray(used3), np.asarray(other))
    assert float(jnp.abs(h3 - h).max()) > 1e-3


def test_moe_gate_weights_under_replay_match_numpy():
    from gagar_jax.models.transformer import MoE

    moe = MoE(MOE, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, MOE.hidden_size))
    routes = jnp.asarray(np.random.default_rng(0).integers(0, MOE.num_experts, (2, 3, 2)))
    routes = routes.at[..., 1].set((routes[..., 0] + 3) % MOE.num_experts)  # distinct experts
    y, stats = moe(x, routes=routes)
    xn, r = np.asarray(x, np.float64), np.asarray(routes)
    w = np.asarray(moe.router[...], np.float64)
    gate, up, down = (
        np.asarray(p[...], np.float64) for p in (moe.gate_proj, moe.up_proj, moe.down_proj)
    )
    want = np.zeros_like(xn)
    for b in range(2):
        for t in range(3):
            logits = xn[b, t] @ w
            p = np.exp(logits - logits.max())
            p /= p.sum()
            chosen = p[r[b, t]] / p[r[b, t]].sum()
            for e, g in zip(r[b, t], chosen):
                a = xn[b, t] @ gate[e]
                want[b, t] += g * ((a / (1 + np.exp(-a))) * (xn[b, t] @ up[e])) @ down[e]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(stats["routes"]), r)
    # the router's gradient flows through the replayed gate weights
    g = jax.grad(lambda m: jnp.sum(m(x, routes=routes)[0] ** 2))(moe)
    assert float(jnp.abs(g.router[...]).max()) > 0


def test_sampler_records_each_tokens_experts(model):
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7]]
    for kw in (dict(), dict(shared_prefix=False)):
        sampler = Sampler(model, record_routes=True, **buckets(), **kw)
        out = sampler.generate(prompts, SamplingParams(n=3, max_tokens=8, seed=0))
        for p, row in zip(prompts, out):
            for s in row:
                assert s.prompt_routes.shape == (len(p), MOE.num_layers, 2)
                assert s.routes.shape == (len(s.tokens), MOE.num_layers, 2)
                toks = jnp.asarray([p + s.tokens])
                _, own = model.hidden_states(
                    toks, jnp.arange(toks.shape[1])[None], return_routes=True
                )
                rec = np.concatenate([s.prompt_routes, s.routes])
                np.testing.assert_array_equal(np.sort(rec, -1), np.sort(np.asarray(own[0]), -1))
    plain = Sampler(model, **buckets()).generate(prompts, SamplingParams(n=3, max_tokens=8, seed=0))
    assert plain[0][0].routes is None and plain[0][0].prompt_routes is None


def test_batch_routes_are_checked():
    from tests.update_fixtures import make_batch

    batch = make_batch()
    n, t = batch.tokens.shape
    with pytest.raises(ValueError, match="batch.routes"):
        check_batch(batch._replace(routes=np.zeros((n, t, 2))), CONFIG)
    check_batch(batch._replace(routes=np.zeros((n, t, 2, 2), np.int16)), CONFIG)
