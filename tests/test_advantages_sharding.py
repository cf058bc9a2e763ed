"""Sharded == unsharded for the advantage pipeline on 8 simulated CPU devices."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax import advantages as adv

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")


def _batch(g=16, k=8, seed=0):
    rng = np.random.default_rng(seed)
    rewards = (rng.random((g, k)) < 0.4).astype(np.float32)
    return dict(
        rewards=rewards,
        passed=rewards > 0,
        cheat=rng.random((g, k)) < 0.05,
        tier=rng.integers(1, 4, (g, k)).astype(np.int32),
        rank=rng.integers(1, k + 1, (g, k)).astype(np.int32),
        graded=rng.random(g) < 0.8,
        valid=rng.random((g, k)) < 0.9,
    )


def _assert_same(out, want):
    np.testing.assert_allclose(out.advantages, want.advantages, atol=1e-6)
    np.testing.assert_array_equal(out.applied, want.applied)
    for key in want.metrics:
        np.testing.assert_allclose(out.metrics[key], want.metrics[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("mode", ["sum_preserving", "discount_only"])
def test_dense_sharded_along_groups(mode):
    cfg = adv.GagarConfig(mode=mode)
    batch = _batch()
    want = adv.gagar_advantages(**batch, config=cfg)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    spec = {n: P("data") if n == "graded" else P("data", None) for n in batch}
    in_shardings = tuple(NamedSharding(mesh, spec[n]) for n in batch)
    fn = jax.jit(
        lambda *xs: adv.gagar_advantages(*xs, config=cfg),
        in_shardings=in_shardings,
    )
    out = fn(*batch.values())
    _assert_same(out, want)
    # Group reductions stay on the shard: the result keeps the group sharding.
    assert out.advantages.sharding.spec[0] == "data"


def test_flat_sharded_along_rollouts():
    batch = _batch(g=16, k=8, seed=1)
    want = adv.gagar_advantages(**batch)
    g, k = batch["valid"].shape
    perm = np.random.default_rng(2).permutation(g * k)
    flat = {n: x.reshape(-1)[perm] for n, x in batch.items() if n != "graded"}
    ids = np.repeat(np.arange(g), k)[perm].astype(np.int32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    rollout = NamedSharding(mesh, P(("data", "fsdp")))
    put = {n: jax.device_put(x, rollout) for n, x in flat.items()}
    graded = jax.device_put(batch["graded"], NamedSharding(mesh, P()))
    out = adv.gagar_advantages(
        **put, graded=graded, group_ids=jax.device_put(ids, rollout), num_groups=g
    )
    np.testing.assert_allclose(
        out.advantages, np.asarray(want.advantages).reshape(-1)[perm], atol=1e-6
    )
    for key in want.metrics:
        np.testing.assert_allclose(out.metrics[key], want.metrics[key], rtol=1e-5, err_msg=key)


def test_shard_map_per_shard_groups_match():
    # With whole groups on each shard, every shard can run the kernels on its local groups
    # alone (no collective) and the concatenation equals the global result. Batch-level
    # metrics differ by construction, so only per-rollout outputs are compared.
    batch = _batch(seed=3)
    want = adv.gagar_advantages(**batch)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    specs = tuple(P("data") if n == "graded" else P("data", None) for n in batch)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=specs, out_specs=P("data", None))
    def local(*xs):
        return adv.gagar_advantages(*xs).advantages

    np.testing.assert_allclose(jax.jit(local)(*batch.values()), want.advantages, atol=1e-6)


def test_dense_under_explicit_axes():
    # jax.make_mesh defaults to Explicit axes (sharding in types); the dense form's
    # reductions run along K, so a group-sharded batch needs no annotations.
    batch = _batch(seed=4)
    want = adv.gagar_advantages(**batch)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        put = {
            n: jax.device_put(
                x, NamedSharding(mesh, P("data") if n == "graded" else P("data", None))
            )
            for n, x in batch.items()
        }
        out = adv.gagar_advantages(**put)
    _assert_same(out, want)
