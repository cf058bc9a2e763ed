"""The training loop on several hosts: two ``jax.distributed`` processes on CPU (one device each,
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID over loopback) run the toy smoke
config through the whole loop: SFT, rollouts, grading, the sharded update, the weight sync to
the embedded sampler, evaluation, checkpoints."""

import json
import os

import jax
import numpy as np

from gagar_jax.train import metrics_io
from tests import multihost_fixtures as mh


def test_local_params_is_device_to_device():
    """The sampler's full copy of sharded parameters, on the requested device, equal to them.

    (That no host gather is involved is what the two-process test proves: there the parameters
    span non-addressable devices and a ``device_get`` raises. CPU has no transfer guard.)"""
    from gagar_jax.models import TransformerConfig
    from gagar_jax.train import rl_adapter
    from gagar_jax.train.state import UpdateConfig, create_train_state, make_mesh

    mc = TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
    )
    mesh = make_mesh((2, 2, 2))
    state = create_train_state(mc, UpdateConfig(), mesh, seed=0)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.params))
    expected = jax.device_get(state.params)
    device = jax.local_devices()[3]
    out = rl_adapter.local_params(state.params, mesh, device)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(expected), strict=True):
        assert got.devices() == {device}
        np.testing.assert_array_equal(np.asarray(got), want)


def test_two_processes_run_the_whole_loop(tmp_path):
    workdir = str(tmp_path / "run")
    procs = mh.launch(workdir, num_processes=2)
    logs = mh.wait_all(procs, timeout=600)
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    rows = metrics_io.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [0, 1, 2]
    assert [r["policy_version"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["pg_loss_mean"] is not None and r["response_length"] > 0
    assert [r["step"] for r in rows if r["phase"] == "eval"] == [0, 2, 3]
    # only process 0 reports and writes the loop's bookkeeping; both wrote the checkpoint
    assert "(gagar) finished: 3 steps" in logs[0] and ") finished" not in logs[1]
    assert "step 1/3" not in logs[1]
    state = json.loads(open(os.path.join(workdir, "loop_state", "loop_state_00000003.json")).read())
    assert state["step"] == 3 and state["policy_version"] == 3
    assert "3" in os.listdir(os.path.join(workdir, "checkpoints"))
