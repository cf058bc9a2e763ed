"""``learner.opt_state_dtype``: float32 Adam moments for bfloat16 parameters, the update
computed in float32 and returned in each parameter's dtype; the default keeps the parameters'
dtype and the fingerprints of the runs from before the option."""

import dataclasses
import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gagar_jax.update import UpdateConfig, make_optimizer
from gagar_jax.update.state import config_fingerprint
from tests.update_fixtures import tiny_config


def test_float32_moments_for_bfloat16_params():
    params = {"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.zeros((3,), jnp.float32)}
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
    tx = make_optimizer(UpdateConfig(learning_rate=0.1, opt_state_dtype="float32"))
    state = tx.init(params)
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    assert moments and all(x.dtype == jnp.float32 for x in moments)
    updates, _ = tx.update(grads, state, params)
    assert updates["w"].dtype == jnp.bfloat16 and updates["b"].dtype == jnp.float32
    # the same step as AdamW on float32 copies, rounded to bfloat16
    ref_tx = make_optimizer(UpdateConfig(learning_rate=0.1))
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    ref, _ = ref_tx.update(
        jax.tree.map(lambda x: x.astype(jnp.float32), grads), ref_tx.init(f32), f32
    )
    np.testing.assert_allclose(
        np.asarray(updates["w"], np.float32), np.asarray(ref["w"].astype(jnp.bfloat16), np.float32)
    )
    plain = make_optimizer(UpdateConfig(learning_rate=0.1)).init(params)
    assert any(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(plain) if x.ndim > 0)
    assert isinstance(tx, optax.GradientTransformation)


def test_default_keeps_the_fingerprint_and_bad_values_are_refused():
    model = tiny_config()
    base = UpdateConfig()
    assert config_fingerprint(model, base) != config_fingerprint(
        model, dataclasses.replace(base, opt_state_dtype="float32")
    )
    # The payload of the runs from before the option and LoRA: neither key at its default.
    m = dataclasses.asdict(model)
    for k in ("lora_rank", "lora_alpha", "lora_targets"):
        m.pop(k)
    u = dataclasses.asdict(base)
    for k in ("score_window", "shared_prefix", "opt_state_dtype"):
        u.pop(k)
    payload = json.dumps({"model": m, "update": u}, sort_keys=True, default=str)
    assert config_fingerprint(model, base) == hashlib.sha256(payload.encode()).hexdigest()[:16]
    with pytest.raises(ValueError, match="opt_state_dtype"):
        UpdateConfig(opt_state_dtype="float64")
