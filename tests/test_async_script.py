"""The asynchronous loop end to end through the training script (``rollout.max_staleness=1``):
real policy, embedded sampler, toy verifier, heuristic grading pool, orbax checkpoints; killed
with SIGKILL after a checkpoint, the rerun trains every dispatched batch once, grades no group
twice and reproduces the uninterrupted run's figures."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from gagar_jax.analysis import writers
from gagar_jax.rl.resume import read_loop_state

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
