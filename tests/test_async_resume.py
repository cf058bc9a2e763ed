"""SIGKILL and resume of the asynchronous loop with work in flight, through the training script.

* Multi-turn (the toy-agent family), ``rollout.partial_rollout``: at every checkpoint one batch
  waits for its update (its episodes finished, its groups submitted for grading) and the next
  batch's episodes are interrupted after their first turn. Killed after a checkpoint, the rerun
  replays the saved episodes into fresh environments, resumes the interrupted ones and trains
  every batch once: the same figures step by step as the uninterrupted run, no group graded
  twice (the verdict cache is keyed by the trajectory's content) and none lost.
* Two ``jax.distributed`` processes (the toy family): both killed after a checkpoint, relaunched,
  and the same comparison with an uninterrupted two-process run (each host's own cache).
"""

import glob
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
from tests import multihost_fixtures as mh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_CACHE = os.path.join(tempfile.gettempdir(), "gagar_jax_test_train_jax_cache")
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
AGENT_CONFIG = os.path.join(ROOT, "configs", "toy_agent.py")
KEYS = (
    "data_position",
    "policy_version",
    "pass_rate",
    "response_length",
    "async/dispatch_index",
    "async/staleness",
    "async/version_spread",
    "async/offpolicy_token_frac",
    "async/masked_token_frac",
    "grading_fallbacks",
)


def _rows(workdir):
    return [
        r
        for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        if r["phase"] == "train"
    ]


def _cache_keys(workdir):
    keys = []
    for path in sorted(glob.glob(os.path.join(workdir, "grader_cache*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            keys += [json.loads(line)["key"] for line in f if line.strip()]
    return keys


def _kill_after(procs, marker, timeout=900):
    """SIGKILL every process once ``marker`` (a checkpoint directory) exists."""
    deadline = time.monotonic() + timeout
    try:
        while not os.path.exists(marker):
            assert all(p.poll() is None for p in procs), "the run ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()
    assert all(p.returncode == -signal.SIGKILL for p in procs)


def _compare(rows, ref_rows, steps):
    assert [x["step"] for x in rows] == list(range(steps))
    for a, b in zip(rows, ref_rows):
        for key in KEYS:
            if key in b:
                assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["pg_loss_mean"] == pytest.approx(b["pg_loss_mean"], abs=1e-6)


AGENT_ARGS = [
    "--config.loop.total_steps=4",
    "--config.loop.checkpoint_every=1",
    "--config.rollout.max_staleness=2",
    "--config.rollout.partial_rollout=True",
    "--config.rollout.mask_offpolicy_tokens=True",
    "--config.loop.plot=False",
]


def _agent_cmd(workdir):
    return [
        sys.executable,
        SCRIPT,
        f"--config={AGENT_CONFIG}:gagar,smoke",
        f"--workdir={workdir}",
        f"--compilation_cache={JAX_CACHE}",
        *AGENT_ARGS,
    ]


@pytest.mark.e2e
def test_multi_turn_partial_rollouts_sigkill_resume_exactly(tmp_path):
    ref = tmp_path / "ref"
    r = subprocess.run(_agent_cmd(ref), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    ref_rows = _rows(ref)
    # S = 2: batches 0 and 1 generated whole at version 0; batch 2 begun at version 0 before
    # the first sync, finished at 1; batch 3 begun at 1, finished at 2
    assert [x["async/staleness"] for x in ref_rows] == [0.0, 1.0, 2.0, 2.0]
    assert [x["async/partial_batch"] for x in ref_rows] == [0.0, 0.0, 1.0, 1.0]
    assert [x["async/version_spread"] for x in ref_rows] == [0.0, 0.0, 1.0, 1.0]
    assert [x["async/masked_token_frac"] == 0 for x in ref_rows] == [True, True, False, False]
    assert all(x["async/masked_token_frac"] < 1 for x in ref_rows)

    run = tmp_path / "run"
    proc = subprocess.Popen(
        _agent_cmd(run), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _kill_after([proc], run / "checkpoints" / "2")
    state = read_loop_state(run / "checkpoints", 2).extra["async"]["per_host"][0]
    # in flight at the checkpoint (after step 1): batch 2 waiting for its update (episodes
    # finished, groups submitted) and batch 3's episodes interrupted after their first turn
    assert [q["index"] for q in state["queued"]] == [2] and state["queued"][0]["groups"]
    assert all("episode" in r for g in state["queued"][0]["groups"] for r in g["rollouts"])
    started = state["started"]
    assert started["index"] == 3 and started["episodes"]["next_turn"] == 1
    assert not all(e["finish"] for e in started["episodes"]["episodes"])

    r = subprocess.run(_agent_cmd(run), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    _compare(_rows(run), ref_rows, 4)
    keys = _cache_keys(run)
    assert len(keys) == len(set(keys))  # no group graded twice
    assert set(keys) == set(_cache_keys(ref))  # and none lost


TWO_ARGS = (
    "--config.loop.total_steps=4",
    "--config.loop.checkpoint_every=1",
    "--config.rollout.max_staleness=1",
    "--config.loop.plot=False",
)


@pytest.mark.e2e
def test_two_processes_async_sigkill_resume_exactly(tmp_path):
    ref = str(tmp_path / "ref" / "run")
    procs = mh.launch(ref, *TWO_ARGS, num_processes=2)
    logs = mh.wait_all(procs, timeout=900)
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    ref_rows = _rows(ref)
    assert [x["async/staleness"] for x in ref_rows] == [0.0, 1.0, 1.0, 1.0]

    run = str(tmp_path / "run" / "run")
    procs = mh.launch(run, *TWO_ARGS, num_processes=2)
    try:
        _kill_after(procs, os.path.join(run, "checkpoints", "2"))
    finally:
        mh.wait_all(procs, timeout=5)
    per_host = read_loop_state(os.path.join(run, "checkpoints"), 2).extra["async"]["per_host"]
    assert len(per_host) == 2
    for h in per_host:  # each host's block of the batch in flight, with its trajectories
        assert [q["index"] for q in h["queued"]] == [2] and h["queued"][0]["groups"]

    procs = mh.launch(run, *TWO_ARGS, num_processes=2)
    logs = mh.wait_all(procs, timeout=900)
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    _compare(_rows(run), ref_rows, 4)
    keys = _cache_keys(run)
    assert len(keys) == len(set(keys))
    assert set(keys) == set(_cache_keys(ref))
