"""Orbax checkpoints: bit-identical sharded round trip, keep-N, fingerprint refusal, and
SIGKILL-after-checkpoint resume reproducing an uninterrupted run. (SIGTERM is the RL loop's:
tests/test_train_script.py::test_sigterm_saves_at_the_step_boundary_and_resumes.)"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gagar_jax.update import create_train_state, jit_update, make_mesh, shard_batch
from gagar_jax.update.checkpoint import Checkpointer, abstract_train_state
from tests.update_fixtures import CONFIG, MODEL, make_batch


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bit-identical


def test_round_trip_keep_n_and_fingerprint(tmp_path):
    mesh = make_mesh((2, 2, 2))
    state = create_train_state(MODEL, CONFIG, mesh, seed=1)
    ckpt = Checkpointer(str(tmp_path), model_config=MODEL, update_config=CONFIG, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, state, data_position={"cursor": step * 10}, extra={"note": "x"})
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]
    restored, info = ckpt.restore(abstract_train_state(MODEL, CONFIG, mesh))
    assert info.step == 4 and info.data_position == {"cursor": 40} and info.extra == {"note": "x"}
    _leaves_equal(state, restored)
    assert type(restored.opt_state) is type(state.opt_state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.sharding.spec == b.sharding.spec
    # Restore onto a different mesh: same values, the new mesh's shardings.
    other = make_mesh((8, 1, 1))
    resharded, _ = ckpt.restore(abstract_train_state(MODEL, CONFIG, other), step=3)
    _leaves_equal(state, resharded)
    assert resharded.params["embed_tokens"].sharding.mesh.shape == other.shape
    ckpt.close()
    # A different config is refused with both fingerprints named.
    changed = dataclasses.replace(CONFIG, learning_rate=CONFIG.learning_rate * 2)
    other_ckpt = Checkpointer(str(tmp_path), model_config=MODEL, update_config=changed)
    with pytest.raises(ValueError, match="fingerprint"):
        other_ckpt.restore(abstract_train_state(MODEL, changed, mesh))
    forced, _ = other_ckpt.restore(
        abstract_train_state(MODEL, changed, mesh), allow_config_change=True
    )
    _leaves_equal(state.params, forced.params)
    other_ckpt.close()
    with pytest.raises(FileNotFoundError):
        Checkpointer(str(tmp_path / "empty"), model_config=MODEL, update_config=CONFIG).restore(
            abstract_train_state(MODEL, CONFIG, mesh)
        )


ONE = (1, 1, 1)


def _child(mode, directory, log_path, ready_path):
    """The training loop run in a child process (single device, mesh (1,1,1))."""
    assert mode == "kill"
    mesh = make_mesh(ONE)
    state = create_train_state(MODEL, CONFIG, mesh, seed=0)
    ckpt = Checkpointer(directory, model_config=MODEL, update_config=CONFIG, keep=5)
    update = jit_update(MODEL, CONFIG, mesh)
    with open(log_path, "w") as log:
        for step in range(1, 4):
            state, m = update(state, shard_batch(make_batch(seed=step), mesh))
            log.write(
                json.dumps(
                    {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])}
                )
                + "\n"
            )
            log.flush()
            ckpt.save(step, state, data_position=step)
    ckpt.wait()
    with open(ready_path, "w") as f:
        f.write("ready")
    while True:  # e.g. waiting for rollouts; killed by the parent
        time.sleep(0.1)


def _spawn(mode, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d = tmp_path / mode
    d.mkdir()
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=root,
    )
    paths = (str(d / "ckpt"), str(d / "log.jsonl"), str(d / "ready"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.test_checkpoint", mode, *paths],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, paths


def _wait_ready(proc, ready, timeout=420):
    start = time.time()
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise AssertionError(f"child exited early:\n{proc.stdout.read()[-3000:]}")
        if time.time() - start > timeout:
            proc.kill()
            raise AssertionError("child did not become ready")
        time.sleep(0.2)


@pytest.mark.e2e  # a child process, SIGKILLed and restarted
def test_sigkill_resume_matches(tmp_path):
    kill_proc, (kill_dir, kill_log, kill_ready) = _spawn("kill", tmp_path)
    try:
        # Meanwhile: the uninterrupted run of 5 updates in this process.
        mesh = make_mesh(ONE, devices=jax.devices()[:1])
        update = jit_update(MODEL, CONFIG, mesh)
        state = create_train_state(MODEL, CONFIG, mesh, seed=0)
        full, params_at = [], {0: jax.device_get(state.params)}
        for step in range(1, 6):
            state, m = update(state, shard_batch(make_batch(seed=step), mesh))
            full.append({"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])})
            params_at[step] = jax.device_get(state.params)

        _wait_ready(kill_proc, kill_ready)
        kill_proc.send_signal(signal.SIGKILL)
        assert kill_proc.wait(60) == -signal.SIGKILL
    finally:
        if kill_proc.poll() is None:
            kill_proc.kill()

    # The child's pre-kill metrics equal the uninterrupted run's.
    child = [json.loads(line) for line in open(kill_log)]
    assert [c["step"] for c in child] == [1, 2, 3]
    for c, f in zip(child, full):
        np.testing.assert_allclose(c["loss"], f["loss"], rtol=1e-6)

    # Resume after SIGKILL from the last checkpoint and replay steps 4 and 5.
    ckpt = Checkpointer(kill_dir, model_config=MODEL, update_config=CONFIG)
    state, info = ckpt.restore(abstract_train_state(MODEL, CONFIG, mesh))
    assert info.step == 3 and info.data_position == 3 and int(state.step) == 3
    _leaves_equal(state.params, params_at[3])
    for step in (4, 5):
        state, m = update(state, shard_batch(make_batch(seed=step), mesh))
        np.testing.assert_allclose(float(m["loss"]), full[step - 1]["loss"], rtol=1e-6)
        np.testing.assert_allclose(float(m["grad_norm"]), full[step - 1]["grad_norm"], rtol=1e-6)
    _leaves_equal(state.params, params_at[5])
    ckpt.close()


if __name__ == "__main__":
    _child(*sys.argv[1:5])


def _corrupt_data_files(step_dir, offsets=(0.1, 0.4, 0.7, 0.95), nbytes=64):
    """Flips ``nbytes`` bytes at a few relative offsets of every data file of the state item."""
    flipped = 0
    for root, _dirs, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if size < 4 * nbytes:
                continue
            with open(path, "r+b") as f:
                for frac in offsets:
                    f.seek(int(size * frac))
                    chunk = f.read(nbytes)
                    f.seek(int(size * frac))
                    f.write(bytes(b ^ 0xFF for b in chunk))
            flipped += 1
    return flipped


def test_corrupt_checkpoint_is_detected_and_falls_back(tmp_path, caplog):
    # issue 11: per-array checksums in the checkpoint, verified on restore.
    import shutil

    from gagar_jax.update.checkpoint import CheckpointCorruptError

    mesh = make_mesh((2, 2, 2))
    s1 = create_train_state(MODEL, CONFIG, mesh, seed=1)
    s2 = s1._replace(params=jax.tree.map(lambda x: x + 1, s1.params))
    ckpt = Checkpointer(str(tmp_path), model_config=MODEL, update_config=CONFIG, keep=3)
    ckpt.save(1, s1, data_position=1)
    ckpt.save(2, s2, data_position=2, wait=True)
    abstract = abstract_train_state(MODEL, CONFIG, mesh)
    # Data that decodes fine but is not what was saved (step 1's arrays under step 2, as a
    # partial copy or a mixed-up restore of files would leave it): only the checksums see it.
    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")
    with caplog.at_level("ERROR", logger="gagar_jax.update.checkpoint"):
        restored, info = ckpt.restore(abstract)
    assert info.step == 1 and info.data_position == 1
    _leaves_equal(s1, restored)  # the previous complete checkpoint, bit for bit
    msgs = [r.getMessage() for r in caplog.records]
    assert any("step 2 is corrupt" in m and "checksum mismatch" in m for m in msgs), msgs
    with pytest.raises(CheckpointCorruptError, match="step 2: checksum mismatch"):
        ckpt.restore(abstract, step=2)
    # Flipped bytes in step 1's data files: unreadable or mismatched, never loaded silently.
    assert _corrupt_data_files(str(tmp_path / "1")) > 0
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint.*step 2.*step 1"):
        ckpt.restore(abstract)
    ckpt.close()
