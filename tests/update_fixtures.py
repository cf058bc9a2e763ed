"""The tests' shared tiny model and update batch (the update, checkpoint, sampler, model and
multi-process tests; a plain module so that the multi-process tests' children import it too)."""

import jax
import numpy as np

from gagar_jax.models import TransformerConfig
from gagar_jax.update import (
    UpdateBatch,
    UpdateConfig,
    check_batch,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
    state_shardings,
)


def tiny_config(**overrides) -> TransformerConfig:
    """The tests' tiny decoder: vocabulary 97, hidden 32, 2 layers, 4 query and 2 KV heads of 8,
    MLP 64, RoPE base 1e4; ``overrides`` replace fields (``initializer_range=0.3``: peaked
    logits)."""
    fields = dict(
        vocab_size=97,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


MODEL = tiny_config(vocab_size=64, num_layers=1)
CONFIG = UpdateConfig(
    learning_rate=1e-2,
    warmup_steps=1,
    decay_steps=10,
    schedule="cosine",
    max_grad_norm=1.0,
    num_minibatches=2,
    num_microbatches=1,
    ppo_epochs=1,
)


def make_batch(seed=0, groups=4, k=4, length=12, prompt=4) -> UpdateBatch:
    """G groups of K rollouts: left-padded prompts, responses of random length, mixed groups."""
    rng = np.random.default_rng(seed)
    n = groups * k
    tokens = rng.integers(1, MODEL.vocab_size, (n, length)).astype(np.int32)
    attention = np.ones((n, length), bool)
    response = np.zeros((n, length), bool)
    for i in range(n):
        pad = int(rng.integers(0, 2))
        attention[i, :pad] = False
        tokens[i, :pad] = 0
        resp_len = int(rng.integers(2, length - prompt + 1))
        response[i, prompt : prompt + resp_len] = True
        attention[i, prompt + resp_len :] = False
        tokens[i, prompt + resp_len :] = 0
    positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32)
    old = np.where(response, np.log(rng.uniform(0.01, 0.5, (n, length))), 0.0).astype(np.float32)
    passed = rng.uniform(size=(groups, k)) < 0.5
    passed[:, 0], passed[:, 1] = True, False  # every group mixed
    valid = np.ones((groups, k), bool)
    valid[-1, -1] = False  # a lost rollout
    return UpdateBatch(
        tokens=tokens,
        positions=positions,
        attention_mask=attention,
        response_mask=response,
        old_logprobs=old,
        rewards=passed.astype(np.float32),
        passed=passed,
        cheat=np.zeros((groups, k), bool),
        tier=rng.integers(1, 4, (groups, k)).astype(np.int32),
        rank=rng.integers(1, 3, (groups, k)).astype(np.int32),
        valid=valid,
        graded=np.array([True] * (groups - 1) + [False]),
    )


# Loss options under which the update's speed-only variants (score window, shared prefix) must
# give the plain update.
LOSS_VARIANTS = {
    "plain": dict(),
    "kl-entropy-dual-clip-epochs": dict(
        kl_coef=0.1,
        entropy_coef=0.01,
        dual_clip=3.0,
        aggregation="seq-mean-token-mean",
        ppo_epochs=2,
    ),
    "token-credit-entropy": dict(token_credit="entropy", token_gamma=0.7),
    "off-policy": dict(decoupled=True, rollout_is="token", rollout_rs="geometric"),
}


def run_updates(model, config, batches, *, mesh_shape=(1, 1, 1), with_ref=False):
    """One update per batch (host NumPy, checked with ``check_batch``) from the seed-0 state,
    on a mesh of ``mesh_shape`` (one device for (1, 1, 1)); ``ref_logprobs`` are dropped
    unless ``with_ref``. Returns (host params, the updates' metrics as floats)."""
    devices = jax.devices()[:1] if mesh_shape == (1, 1, 1) else None
    mesh = make_mesh(mesh_shape, devices=devices)
    one = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    host = jax.device_get(create_train_state(model, config, one, seed=0))
    _, shardings = state_shardings(model, config, mesh)
    state = jax.device_put(host, shardings)
    update = jit_update(model, config, mesh, with_ref=with_ref)
    metrics = []
    for batch in batches:
        if not with_ref:
            batch = batch._replace(ref_logprobs=None)
        check_batch(batch, config, mesh)
        state, m = update(state, shard_batch(batch, mesh))
        metrics.append({k: float(v) for k, v in m.items()})
    return jax.device_get(state.params), metrics
