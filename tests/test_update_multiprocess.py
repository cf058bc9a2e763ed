"""Two local processes under ``jax.distributed`` (gloo collectives on CPU) run the same sharded
update over one global batch and agree with the single-process run on the same mesh."""

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Several jax.distributed processes per test (make test-unit skips them).
pytestmark = pytest.mark.e2e

MESH = (2, 2, 2)
STEPS = 2


def _summaries(mesh_shape):
    """Metrics and per-leaf parameter sums of squares after STEPS updates (process-agnostic)."""
    from gagar_jax.update import create_train_state, jit_update, make_mesh, shard_batch
    from tests.update_fixtures import CONFIG, MODEL, make_batch

    mesh = make_mesh(mesh_shape)
    state = create_train_state(MODEL, CONFIG, mesh, seed=0)
    update = jit_update(MODEL, CONFIG, mesh)
    metrics = []
    for i in range(STEPS):
        state, m = update(state, shard_batch(make_batch(seed=i), mesh))
        metrics.append({k: float(v) for k, v in m.items()})
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    sums = jax.jit(lambda p: [jnp.sum(x * x) for x in jax.tree.leaves(p)], out_shardings=rep)(
        state.params
    )
    return {
        "metrics": metrics,
        "param_sq": [float(s) for s in sums],
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }


def _worker(process_id, port, out_path):
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id
    )
    result = _summaries(MESH)
    if process_id == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    jax.distributed.shutdown()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_single_process(tmp_path):
    port = _free_port()
    out = tmp_path / "result.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=root,
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.test_update_multiprocess", str(i), str(port), str(out)],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=420)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    multi = json.loads(out.read_text())
    assert multi["processes"] == 2 and multi["devices"] == 8
    single = _summaries(MESH)
    assert single["processes"] == 1 and single["devices"] == 8
    for ms, mm in zip(single["metrics"], multi["metrics"]):
        for k in ("loss", "pg_loss", "grad_norm", "entropy", "credit/moved", "tokens"):
            np.testing.assert_allclose(mm[k], ms[k], rtol=1e-5, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(multi["param_sq"], single["param_sq"], rtol=1e-5)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
