"""The alignment check: what the sampler samples is what the update trains.

Rollouts drawn by the real embedded sampler are packed as the loop packs them; at equal weights
the update's own log-probs of the sampled tokens (its proximal pass, ``mismatch/*`` metrics)
are compared with the behaviour log-probs the rollout recorded:

* ``rollout.bitwise_onpolicy`` (the behaviour log-probs recomputed by the update's own program
  with the sampler's weights, ``gagar_jax.update.alignment``): exactly 0, on one device and on
  a sharded mesh;
* the sampler's own log-probs, per precision and per KV-cache dtype: within a bound measured
  on this model (below, with what was measured when it was set);
* an SGLang server's (marked ``sglang``): within its measured bound.

Each check must fail when the alignment breaks: a weight of the sampler off the trainer's, or
a temperature the update does not score at, turns it red (the ``*_red`` tests show it).
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from gagar_jax.models import create_model
from gagar_jax.rollout import SamplingParams
from gagar_jax.rollout.sampler import Sampler
from gagar_jax.update import (
    UpdateBatch,
    UpdateConfig,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)
from gagar_jax.update.alignment import jit_behaviour_logprobs
from tests.update_fixtures import tiny_config

MODEL = tiny_config(vocab_size=61, num_layers=2, initializer_range=0.3)
G, K, P, R = 2, 4, 6, 10
CONFIG = UpdateConfig(
    learning_rate=1e-2, num_minibatches=2, num_microbatches=2, mismatch_metrics=True
)
# (max |update - behaviour| log-prob, token-mean k3) allowed per sampler precision against the
# float32 update, on MODEL (2 layers, width 32, peaked logits: initializer_range 0.3) at
# temperatures 1.0 and 0.7. Measured when set (max abs, k3 at T = 0.7, the larger): float32
# 3.8e-6, 0.0; bfloat16 0.24, 1.1e-3; int8 0.31, 4.2e-3; fp8 0.86, 3.4e-2. Each bound is
# about twice that; a temperature the update does not score at (0.7 sampled, 1.0 scored)
# gives k3 0.12-0.13 under every precision.
BOUNDS = {
    "float32": (1e-4, 1e-8),
    "bfloat16": (0.5, 3e-3),
    "int8": (0.75, 1e-2),
    "fp8": (1.75, 6e-2),
}
# The same, per KV-cache dtype of a float32 sampler (float32 weights and compute, only the
# cached keys and values rounded). Measured when set (max abs, k3; T = 1.0 / 0.7): bfloat16
# 0.029 / 0.057, 4.3e-5 / 1.1e-4; int8 (one scale per token and KV head) 0.097 / 0.078,
# 3.0e-4 / 3.6e-4. The wrong-temperature and scaled-head checks gave k3 0.14-0.19.
KV_BOUNDS = {
    "bfloat16": (0.12, 2.5e-4),
    "int8": (0.2, 8e-4),
}


@pytest.fixture(scope="module")
def model():
    return create_model(MODEL, seed=1)


def trainer_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def sampled_batch(sampler: Sampler, temperature: float) -> UpdateBatch:
    """G groups of K samples of the sampler, packed as ``rl.collect.pack_groups`` packs them
    (prompt, response, right padding; behaviour log-prob of a token at its own position)."""
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, MODEL.vocab_size, P)) for _ in range(G)]
    out = sampler.generate(
        prompts, SamplingParams(n=K, temperature=temperature, max_tokens=R, seed=3)
    )
    n, t = G * K, P + R
    tokens = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    attn = np.zeros((n, t), bool)
    resp = np.zeros((n, t), bool)
    old = np.zeros((n, t), np.float32)
    for g, samples in enumerate(out):
        for k, s in enumerate(samples):
            i, L = g * K + k, len(s.tokens)
            tokens[i, :P], tokens[i, P : P + L] = prompts[g], s.tokens
            positions[i, : P + L] = np.arange(P + L)
            attn[i, : P + L] = True
            resp[i, P : P + L] = True
            old[i, P : P + L] = s.logprobs
    passed = np.zeros((G, K), bool)
    passed[:, 0] = True
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
    )


def mismatch(params, batch, *, temperature=1.0, mesh=None, behaviour_params=None, behaviour_t=None):
    """The update's ``mismatch/*`` metrics at ``params`` (its first step: equal weights). With
    ``behaviour_params`` the batch's behaviour log-probs are first recomputed the bitwise way
    (``jit_behaviour_logprobs``, at ``behaviour_t``, default the update's temperature)."""
    mesh = mesh or make_mesh((1, 1, 1), devices=jax.devices()[:1])
    config = dataclasses.replace(CONFIG, temperature=temperature)
    sharded = shard_batch(batch, mesh)
    if behaviour_params is not None:
        t = temperature if behaviour_t is None else behaviour_t
        fn = _compiled(jit_behaviour_logprobs, config, mesh, temperature=t)
        sharded = sharded._replace(old_logprobs=fn(behaviour_params, sharded))
    state = create_train_state(MODEL, config, mesh, params=params)
    _, m = _compiled(jit_update, config, mesh)(state, sharded)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    return m["mismatch/logprob_max_abs_diff"], m["mismatch/k3"]


@functools.cache
def _compiled(make, config, mesh, **kw):
    """One jitted function per (maker, config, mesh, options): compiled once per module."""
    return make(MODEL, config, mesh, **kw)


def within(measured, precision, bounds=BOUNDS):
    (diff, k3), (max_diff, max_k3) = measured, bounds[precision]
    return diff <= max_diff and k3 <= max_k3


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 1)])
def test_bitwise_mode_is_exactly_aligned(model, mesh_shape):
    if np.prod(mesh_shape) > jax.device_count():
        pytest.skip("needs more devices")
    devices = jax.devices()[: int(np.prod(mesh_shape))]
    mesh = make_mesh(mesh_shape, devices=devices)
    sampler = Sampler(model, batch_buckets=(8,), prompt_buckets=(8,), new_token_buckets=(16,))
    batch = sampled_batch(sampler, 1.0)
    assert batch.response_mask.sum() > G * K
    sampler_params = nnx.to_pure_dict(sampler.state)
    diff, k3 = mismatch(trainer_params(model), batch, mesh=mesh, behaviour_params=sampler_params)
    assert diff == 0.0 and k3 == 0.0
    # the sampler's own log-probs are off by float rounding only: the bitwise mode is needed
    # for an exact 0
    own = mismatch(trainer_params(model), batch, mesh=mesh)
    assert 0.0 < own[0] <= BOUNDS["float32"][0]


def test_bitwise_check_turns_red(model):
    """One weight of the sampler off by one part in a million, or the sampler's temperature
    not the update's: no longer 0."""
    sampler = Sampler(model, batch_buckets=(8,), prompt_buckets=(8,), new_token_buckets=(16,))
    batch = sampled_batch(sampler, 1.0)
    params = trainer_params(model)
    off = jax.tree.map(np.array, params)
    off["lm_head"][3, 5] *= 1 + 1e-6
    assert mismatch(params, batch, behaviour_params=off)[0] > 0.0
    # sampled and rescored at 0.9, the update scoring at 1.0
    assert mismatch(params, batch, behaviour_params=params, behaviour_t=0.9)[0] > 0.0
    assert mismatch(params, batch, behaviour_params=params) == (0.0, 0.0)


@pytest.mark.parametrize("precision", list(BOUNDS))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_each_precision_is_within_its_measured_bound(model, precision, temperature):
    sampler = Sampler(
        model,
        precision=precision,
        batch_buckets=(8,),
        prompt_buckets=(8,),
        new_token_buckets=(16,),
    )
    batch = sampled_batch(sampler, temperature)
    measured = mismatch(trainer_params(model), batch, temperature=temperature)
    assert within(measured, precision), (precision, temperature, measured, BOUNDS[precision])
    if precision != "float32":  # a low precision is a measurable mismatch, not a rounding one
        assert measured[1] > BOUNDS["float32"][1]


@pytest.mark.parametrize("precision", list(BOUNDS))
def test_each_precision_check_turns_red(model, precision):
    """Sampled at 0.7, scored at 1.0 (the bug the update's temperature guards against), or
    the sampler's LM head scaled by 1.5: outside every precision's bound."""
    sampler = Sampler(
        model,
        precision=precision,
        batch_buckets=(8,),
        prompt_buckets=(8,),
        new_token_buckets=(16,),
    )
    params = trainer_params(model)
    assert not within(mismatch(params, sampled_batch(sampler, 0.7), temperature=1.0), precision)
    off = jax.tree.map(np.array, params)
    off["lm_head"] *= 1.5
    sampler.sync_weights(off, 1)
    assert not within(mismatch(params, sampled_batch(sampler, 1.0)), precision)


@pytest.mark.parametrize("kv_cache_dtype", list(KV_BOUNDS))
def test_each_kv_cache_dtype_is_within_its_measured_bound_and_turns_red(model, kv_cache_dtype):
    """A float32 sampler with a bfloat16 or int8 KV cache: within the cache dtype's bound at
    both temperatures, above float32's rounding, and outside the bound when the temperature
    or the sampler's weights are wrong."""
    buckets = dict(batch_buckets=(8,), prompt_buckets=(8,), new_token_buckets=(16,))
    sampler = Sampler(model, kv_cache_dtype=kv_cache_dtype, **buckets)
    params = trainer_params(model)
    for temperature in (1.0, 0.7):
        measured = mismatch(params, sampled_batch(sampler, temperature), temperature=temperature)
        assert within(measured, kv_cache_dtype, KV_BOUNDS), (kv_cache_dtype, measured)
        assert measured[1] > BOUNDS["float32"][1]
    wrong_t = mismatch(params, sampled_batch(sampler, 0.7), temperature=1.0)
    assert not within(wrong_t, kv_cache_dtype, KV_BOUNDS)
    off = jax.tree.map(np.array, params)
    off["lm_head"] *= 1.5
    sampler.sync_weights(off, 1)
    assert not within(mismatch(params, sampled_batch(sampler, 1.0)), kv_cache_dtype, KV_BOUNDS)
