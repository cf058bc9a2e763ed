"""The asynchronous loop end to end through the training script: real policy, embedded sampler,
toy verifier, heuristic grading pool, orbax checkpoints.

* ``rollout.max_staleness=1``, killed with SIGKILL after a checkpoint: the rerun trains every
  dispatched batch once, grades no group twice and reproduces the uninterrupted run's figures.
* ``max_staleness=0`` on ``make train``'s configuration (fewer steps): the asynchronous
  scheduler forced on (``rollout.async_scheduler``: dispatch queue, admission, grading pool
  across steps) writes the synchronous loop's ``metrics.jsonl`` row for row, time fields aside,
  and ends with the same parameters and optimizer state, bit for bit."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import pytest

from gagar_jax.analysis import writers
from gagar_jax.rl import policy
from gagar_jax.rl.collect import build_family
from gagar_jax.rl.config import RunConfig
from gagar_jax.rl.resume import read_loop_state
from gagar_jax.update import make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_CACHE = os.path.join(tempfile.gettempdir(), "gagar_jax_test_train_jax_cache")
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
CONFIG = os.path.join(ROOT, "configs", "toy_gagar.py")
ARGS = [
    "--config.loop.total_steps=5",
    "--config.loop.checkpoint_every=1",
    "--config.rollout.max_staleness=1",
    "--config.loop.plot=False",
]


def _cmd(workdir):
    return [
        sys.executable,
        SCRIPT,
        f"--config={CONFIG}:gagar,smoke",
        f"--workdir={workdir}",
        f"--compilation_cache={JAX_CACHE}",
        *ARGS,
    ]


def _rows(workdir):
    return [
        r
        for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        if r["phase"] == "train"
    ]


def _cache_keys(workdir):
    with open(os.path.join(workdir, "grader_cache.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["key"] for line in f if line.strip()]


@pytest.mark.e2e
def test_async_sigkill_resumes_with_queued_groups_exactly(tmp_path):
    ref = tmp_path / "ref"
    r = subprocess.run(_cmd(ref), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    ref_rows = _rows(ref)
    assert [x["async/staleness"] for x in ref_rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [x["async/dispatch_index"] for x in ref_rows] == [0.0, 1.0, 2.0, 3.0, 4.0]

    run = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(run), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    marker = run / "checkpoints" / "2"
    deadline = time.monotonic() + 900
    try:
        while not marker.exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    state = read_loop_state(run / "checkpoints", 2)
    queued = state.extra["async"]["per_host"][0]["queued"]
    assert [q["index"] for q in queued] == [2] and queued[0]["groups"]  # a batch in flight

    r = subprocess.run(_cmd(run), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(run)
    assert [x["step"] for x in rows] == [0, 1, 2, 3, 4]
    for a, b in zip(rows, ref_rows):
        for key in (
            "data_position",
            "policy_version",
            "pass_rate",
            "response_length",
            "async/dispatch_index",
            "async/staleness",
            "grading_fallbacks",
        ):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["pg_loss_mean"] == pytest.approx(b["pg_loss_mean"], abs=1e-6)
    keys = _cache_keys(run)
    assert len(keys) == len(set(keys))  # no group graded twice
    assert set(keys) == set(_cache_keys(ref))  # and none lost


# ``make train``: XLA_FLAGS= python scripts/train.py --config=configs/toy_gagar.py (its
# default argument), here with a shorter warm start and 4 RL steps, checkpointed after step 2
MAKE_TRAIN_ARGS = [
    "--config.sft.steps=60",
    "--config.loop.total_steps=4",
    "--config.loop.checkpoint_every=2",
    "--config.loop.plot=False",
]
# Wall-clock figures, and the execution back-end's gauges of calls in flight at an instant
# (how many verifier and grader calls overlap depends on thread timing, not on the run).
TIMING_GAUGES = {
    "execution/calls_in_flight",
    "execution/calls_in_flight_max",
    "execution/grader_slots_held",
}


def _timeless(row):
    return {
        k: v
        for k, v in row.items()
        if k != "time" and not k.endswith("_s") and k not in TIMING_GAUGES
    }


def _final_state(workdir):
    """The run's last checkpoint (train state: parameters and optimizer state) as NumPy."""
    with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
        cfg = RunConfig.from_config_dict(json.load(f))
    model_config, _ = policy.build_model(cfg, _vocab(cfg))
    ckpt = policy.checkpointer(cfg, str(workdir), model_config)
    try:
        state, step, _ = policy.restore(ckpt, cfg, model_config, make_mesh(cfg.mesh.shape))
    finally:
        ckpt.close()
    return step, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def _vocab(cfg):
    return build_family(cfg).tokenizer.vocab_size


@pytest.mark.e2e
def test_async_scheduler_at_staleness_zero_reproduces_make_train_exactly(tmp_path):
    env = {**os.environ, "XLA_FLAGS": ""}  # as the Makefile's train target runs it

    def run(workdir, *extra):
        cmd = [
            sys.executable,
            SCRIPT,
            f"--config={CONFIG}",
            f"--workdir={workdir}",
            f"--compilation_cache={JAX_CACHE}",
            *MAKE_TRAIN_ARGS,
            *extra,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        return writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))

    sync_rows = run(tmp_path / "sync")
    async_rows = run(tmp_path / "async", "--config.rollout.async_scheduler=True")
    train_rows = [r for r in async_rows if r["phase"] == "train"]
    # the scheduler ran: one batch dispatched and trained per step, at staleness 0
    assert [r["async/dispatch_index"] for r in train_rows] == [0.0, 1.0, 2.0, 3.0]
    assert all(r["async/staleness"] == 0 and r["async/queued_batches"] == 0 for r in train_rows)
    assert [(r["step"], r["phase"]) for r in async_rows] == [
        (r["step"], r["phase"]) for r in sync_rows
    ]
    assert {r["phase"] for r in sync_rows} == {"sft", "eval", "train"}
    for a, s in zip(async_rows, sync_rows):
        extra = {k for k in a if k.startswith("async/")}
        assert set(a) - extra == set(s), (a["step"], a["phase"])
        a = _timeless({k: v for k, v in a.items() if k not in extra})
        assert a == _timeless(s), (s["step"], s["phase"])
    step_a, state_a = _final_state(tmp_path / "async")
    step_s, state_s = _final_state(tmp_path / "sync")
    assert step_a == step_s == 4
    assert len(state_a) == len(state_s)
    assert all(np.array_equal(x, y) for x, y in zip(state_a, state_s))
    # the scheduler saved its (empty) queue with every checkpoint
    saved = read_loop_state(tmp_path / "async" / "checkpoints", 2).extra["async"]["per_host"]
    assert saved[0]["queued"] == [] and saved[0]["dispatched"] == 2
