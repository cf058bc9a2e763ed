"""The sharded update: mesh invariance, accumulation, single trace, leaf shardings, validation."""

import dataclasses

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from gagar_jax.models import logical_to_spec
from gagar_jax.update import (
    UpdateConfig,
    check_batch,
    create_train_state,
    jit_update,
    learning_rate_schedule,
    make_mesh,
    shard_batch,
    state_shardings,
)
from gagar_jax.update.state import abstract_model
from tests.update_fixtures import CONFIG, MODEL, make_batch

# A larger Adam eps keeps the first step's update proportional to the gradient (instead of
# ~sign(g)), so tiny cross-mesh reduction-order differences stay tiny in the parameters.
TEST_CONFIG = dataclasses.replace(CONFIG, eps=1e-3)
KEYS = (
    "loss",
    "pg_loss",
    "grad_norm",
    "entropy",
    "approx_kl",
    "clip_frac_low",
    "credit/moved",
    "tokens",
)


@pytest.fixture(scope="module")
def initial_state():
    """One initial state on the host; each mesh gets it by device_put (one init compile)."""
    one = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    return jax.device_get(create_train_state(MODEL, TEST_CONFIG, one, seed=0))


def _run(mesh_shape, host_state, config=TEST_CONFIG, steps=2, devices=None):
    mesh = make_mesh(mesh_shape, devices=devices)
    chex.clear_trace_counter()  # chex counts traces per function source, across closures
    _, shardings = state_shardings(MODEL, config, mesh)
    state = jax.device_put(host_state, shardings)
    update = jit_update(MODEL, config, mesh, wrap=chex.assert_max_traces(n=1))
    metrics = []
    for i in range(steps):  # a second batch with new values must not retrace
        state, m = update(state, shard_batch(make_batch(seed=i), mesh))
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


def _assert_same(params_a, metrics_a, params_b, metrics_b):
    for ma, mb in zip(metrics_a, metrics_b):
        for k in KEYS:
            np.testing.assert_allclose(ma[k], mb[k], rtol=2e-4, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6)


def test_meshes_agree(initial_state):
    """(1,1,1) [one device], (8,1,1), (2,2,2), (1,2,4): same metrics and updated parameters
    over two updates (the second one starts from different params and Adam moments)."""
    ref_state, ref_metrics = _run((1, 1, 1), initial_state, devices=jax.devices()[:1])
    ref_params = jax.device_get(ref_state.params)
    assert ref_metrics[0]["grad_norm"] > 0 and np.isfinite(ref_metrics[1]["loss"])
    moved = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(initial_state.params))
    )
    assert moved > 1e-3  # the update really changed the parameters
    for shape in ((8, 1, 1), (2, 2, 2), (1, 2, 4)):
        state, metrics = _run(shape, initial_state)
        _assert_same(ref_params, ref_metrics, jax.device_get(state.params), metrics)


def test_sharded_init_leaf_shardings():
    """Parameters created already sharded: every leaf has its logical-axis spec."""
    mesh = make_mesh((2, 2, 2))
    state = create_train_state(MODEL, CONFIG, mesh, seed=0)
    abstract = nnx.state(abstract_model(MODEL), nnx.Param)
    expected = nnx.to_pure_dict(
        jax.tree.map(
            lambda v: logical_to_spec(v.get_metadata()["logical_axes"], v.shape, mesh),
            abstract,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    )
    flat_exp = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
    assert len(leaves) == len(flat_exp)
    for path, leaf in leaves:
        assert leaf.sharding.spec == flat_exp[path], path
        assert leaf.sharding.mesh.shape == mesh.shape
    layer = state.params["layers"][0]
    assert layer["self_attn"]["q_proj"].sharding.spec == jax.P("fsdp", "tensor", None)
    assert layer["self_attn"]["k_proj"].sharding.spec == jax.P("fsdp", "tensor", None)
    assert layer["mlp"]["down_proj"].sharding.spec == jax.P("tensor", "fsdp")
    assert state.params["embed_tokens"].sharding.spec == jax.P("tensor", "fsdp")
    # Adam moments are sharded like their parameters; counters and step replicated.
    adam = state.opt_state[1][0]
    for p, mu, nu in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)
    ):
        assert mu.sharding.spec == p.sharding.spec == nu.sharding.spec
    assert adam.count.sharding.spec == jax.P()
    assert state.step.sharding.spec == jax.P()
    # Each device holds 1/(fsdp*tensor) of q_proj.
    q = layer["self_attn"]["q_proj"]
    assert q.addressable_shards[0].data.shape == (
        MODEL.hidden_size // 2,
        MODEL.num_heads // 2,
        MODEL.head_dim,
    )


def test_four_microbatches_equal_one_batch(initial_state):
    one = dataclasses.replace(TEST_CONFIG, num_minibatches=1, num_microbatches=1)
    four = dataclasses.replace(TEST_CONFIG, num_minibatches=1, num_microbatches=4)
    s1, m1 = _run((2, 2, 2), initial_state, one, steps=1)
    s4, m4 = _run((2, 2, 2), initial_state, four, steps=1)
    _assert_same(jax.device_get(s1.params), m1, jax.device_get(s4.params), m4)


def test_batch_validation_names_field():
    batch = make_batch()
    mesh = make_mesh((8, 1, 1))
    check_batch(batch, CONFIG, mesh)  # 16 rows / (2 minibatches * 8 shards) = 1
    with pytest.raises(ValueError, match="num_minibatches"):
        check_batch(batch, dataclasses.replace(CONFIG, num_microbatches=2), mesh)
    with pytest.raises(ValueError, match="old_logprobs"):
        check_batch(batch._replace(old_logprobs=batch.old_logprobs[:, :3]), CONFIG)
    with pytest.raises(ValueError, match="G \\* K"):
        check_batch(batch._replace(tokens=batch.tokens[:8]), CONFIG)
    with pytest.raises(ValueError, match="ref_logprobs"):
        check_batch(batch, dataclasses.replace(CONFIG, kl_coef=0.1))
    with pytest.raises(ValueError, match="aggregation"):
        dataclasses.replace(CONFIG, aggregation="mean")


def test_update_config_from_config_dict():
    import ml_collections

    cd = ml_collections.ConfigDict(
        {
            "learning_rate": 3e-6,
            "warmup_steps": 5,
            "schedule": "linear",
            "clip_high": 0.3,
            "num_microbatches": 2,
            "advantages": {"mode": "discount_only", "tier_factors": [1.0, 0.5, 0.25]},
        }
    )
    config = UpdateConfig.from_mapping(cd)
    assert config.learning_rate == 3e-6 and config.num_microbatches == 2
    assert config.advantages.mode == "discount_only"
    assert config.advantages.tier_factors == (1.0, 0.5, 0.25)
    hash(config)  # static jit argument
    with pytest.raises(ValueError, match="unknown keys"):
        UpdateConfig.from_mapping({"learning_rte": 1.0})
    # Warm-up then linear decay to end_lr_ratio * lr at decay_steps.
    sched = learning_rate_schedule(dataclasses.replace(config, decay_steps=105))
    np.testing.assert_allclose([sched(0), sched(5), sched(105)], [0.0, 3e-6, 3e-7], rtol=1e-5)


def test_kl_entropy_dual_clip_epochs_path(initial_state):
    """The reference-KL batch path with every loss option on, two PPO epochs of two
    mini-batches: finite metrics, the schedule's learning rate at the 4th optimizer step."""
    config = dataclasses.replace(
        TEST_CONFIG,
        kl_coef=0.1,
        entropy_coef=0.01,
        dual_clip=3.0,
        aggregation="seq-mean-token-mean",
        ppo_epochs=2,
        num_minibatches=2,
    )
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    _, shardings = state_shardings(MODEL, config, mesh)
    state = jax.device_put(initial_state, shardings)
    update = jit_update(MODEL, config, mesh, with_ref=True)
    batch = make_batch(seed=0)
    ref = np.where(batch.response_mask, batch.old_logprobs - 0.3, 0.0).astype(np.float32)
    state, m = update(state, shard_batch(batch._replace(ref_logprobs=ref), mesh))
    m = {k: float(v) for k, v in m.items()}
    assert all(np.isfinite(v) for v in m.values())
    assert m["kl"] > 0 and m["entropy"] > 0
    np.testing.assert_allclose(
        m["learning_rate"], float(learning_rate_schedule(config)(3)), rtol=1e-6
    )
    assert int(state.step) == 1 and int(state.opt_state[1][0].count) == 4
