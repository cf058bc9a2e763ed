"""The sampling temperature is part of the policy: the update scores softmax(logits / T).

Rollouts drawn by the real embedded sampler at T = 0.6 and 1.3 are packed exactly as the loop
packs them; at the first optimizer step (the parameters that drew them) the importance ratio is
1 and the k3 KL is 0 when ``UpdateConfig.temperature = T``, and visibly not when the update
scores at temperature 1 (the bug this guards against).
"""

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
from tests.update_fixtures import tiny_config

MODEL = tiny_config(vocab_size=61, num_layers=1, initializer_range=0.3)
G, K, P, R = 2, 4, 6, 10  # groups, rollouts per group, prompt and response budgets


@pytest.fixture(scope="module")
def model():
    return create_model(MODEL, seed=1)


def sampled_batch(model, temperature: float) -> UpdateBatch:
    sampler = Sampler(model, batch_buckets=(8,), prompt_buckets=(8,), new_token_buckets=(16,))
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
    passed[:, 0] = True  # mixed groups: nonzero advantages, so the loss has a gradient
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


def first_step_metrics(model, batch, temperature):
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    config = UpdateConfig(learning_rate=1e-2, temperature=temperature, num_minibatches=2)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = create_train_state(MODEL, config, mesh, params=params)
    _, m = jit_update(MODEL, config, mesh)(state, shard_batch(batch, mesh))
    return {k: float(v) for k, v in jax.device_get(m).items()}


@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_sampler_rollouts_are_on_policy_at_the_first_step(model, temperature):
    batch = sampled_batch(model, temperature)
    assert batch.response_mask.sum() > G * K  # real responses, not just stop tokens
    m = first_step_metrics(model, batch, temperature)
    assert m["ratio_mean_first"] == pytest.approx(1.0, abs=2e-5)
    assert abs(m["approx_kl_first"]) < 1e-6
    if temperature != 1.3:
        return
    # the same rollouts scored at temperature 1 (what the update did before): off-policy
    off = first_step_metrics(model, batch, 1.0)
    assert abs(off["ratio_mean_first"] - 1.0) > 1e-3 or off["approx_kl_first"] > 1e-3
    assert off["approx_kl_first"] > 100 * max(abs(m["approx_kl_first"]), 1e-7)


def test_temperature_is_validated_and_taken_from_the_rollout_config():
    with pytest.raises(ValueError, match="update.temperature"):
        UpdateConfig(temperature=0.0)
    from gagar_jax.rl.config import ConfigError, RunConfig

    cfg = RunConfig.from_config_dict({"rollout": {"temperature": 0.7}})
    assert cfg.learner.temperature == 0.7  # the update's own config, as the loop passes it
    with pytest.raises(ConfigError, match="learner.temperature"):  # never two temperatures
        RunConfig.from_config_dict(
            {"rollout": {"temperature": 0.7}, "learner": {"temperature": 1.0}}
        )
