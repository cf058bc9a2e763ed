"""SIGKILL and resume of the asynchronous loop with work in flight, through the training script.

* Multi-turn (the toy-agent family), ``rollout.partial_rollout``: at every checkpoint one batch
  waits for its update (its episodes finished, its groups submitted for grading) and the next
  batch's episodes are interrupted after their first turn. Killed after a checkpoint, the rerun
  replays the saved episodes into fresh environments, resumes the interrupted ones and trains
  every batch once: the same figures step by step as the uninterrupted run, no group graded
  twice (the verdict cache is keyed by the trajectory's content) and none lost. The same with
  ``rollout.partial_chunk_tokens``, where the interrupted episodes stop in the middle of their
  first turn, and on the single-turn toy family, whose samples stop mid-sample.
* Two ``jax.distributed`` processes (the toy family): both killed after a checkpoint, relaunched,
  and the same comparison with an uninterrupted two-process run (each host's own cache).
* Two processes on the toy-agent family with partial rollouts and the off-policy mask: each
  host's queued batch and its block of interrupted episodes are saved in the one checkpoint,
  both processes are killed, and the relaunched pair replays, resumes and trains them as the
  uninterrupted pair did.
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
TOY_CONFIG = os.path.join(ROOT, "configs", "toy_gagar.py")
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


def _agent_cmd(workdir, *extra, config=AGENT_CONFIG):
    return [
        sys.executable,
        SCRIPT,
        f"--config={config}:gagar,smoke",
        f"--workdir={workdir}",
        f"--compilation_cache={JAX_CACHE}",
        *AGENT_ARGS,
        *extra,
    ]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "config,chunk",
    [(AGENT_CONFIG, 0), (AGENT_CONFIG, 8), (TOY_CONFIG, 8)],
    ids=["multi_turn_turn_boundary", "multi_turn_mid_turn", "single_turn_mid_sample"],
)
def test_partial_rollouts_sigkill_resume_exactly(tmp_path, config, chunk):
    """``chunk=8``: turns (or single-turn samples) generated in chunks of 8 tokens (the smoke
    configs' turns and responses take up to 16), and the batch that spans a sync stopped after
    the first chunk of its first turn, mid-turn."""
    multi_turn = config == AGENT_CONFIG
    extra = [f"--config.rollout.partial_chunk_tokens={chunk}"] if chunk else []

    def cmd(workdir):
        return _agent_cmd(workdir, *extra, config=config)

    ref = tmp_path / "ref"
    r = subprocess.run(cmd(ref), capture_output=True, text=True, timeout=900, cwd=ROOT)
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
        cmd(run), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    _kill_after([proc], run / "checkpoints" / "2")
    state = read_loop_state(run / "checkpoints", 2).extra["async"]["per_host"][0]
    # in flight at the checkpoint (after step 1): batch 2 waiting for its update (episodes
    # finished, groups submitted) and batch 3's episodes interrupted after their first turn
    # (chunked: after the first chunk of it, some in the middle of the turn)
    assert [q["index"] for q in state["queued"]] == [2] and state["queued"][0]["groups"]
    if multi_turn:
        assert all("episode" in r for g in state["queued"][0]["groups"] for r in g["rollouts"])
    started = state["started"]
    episodes = started["episodes"]
    assert started["index"] == 3
    if chunk:
        assert (episodes["next_turn"], episodes["next_chunk"]) == (0, 1)
        assert any(e["partial"]["tokens"] for e in episodes["episodes"])
    else:
        assert episodes["next_turn"] == 1
    assert not all(e["finish"] for e in episodes["episodes"])

    r = subprocess.run(cmd(run), capture_output=True, text=True, timeout=900, cwd=ROOT)
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


@pytest.mark.e2e
def test_two_processes_multi_turn_partial_rollouts_sigkill_resume_exactly(tmp_path):
    def launch(workdir):
        return mh.launch(workdir, *AGENT_ARGS, num_processes=2, config=AGENT_CONFIG + ":smoke")

    ref = str(tmp_path / "ref" / "run")
    procs = launch(ref)
    logs = mh.wait_all(procs, timeout=900)
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    ref_rows = _rows(ref)
    # as on one process (S = 2): batches 2 and 3 begun before a weight sync, finished after it
    assert [x["async/staleness"] for x in ref_rows] == [0.0, 1.0, 2.0, 2.0]
    assert [x["async/partial_batch"] for x in ref_rows] == [0.0, 0.0, 1.0, 1.0]
    assert [x["async/masked_token_frac"] == 0 for x in ref_rows] == [True, True, False, False]

    run = str(tmp_path / "run" / "run")
    procs = launch(run)
    try:
        _kill_after(procs, os.path.join(run, "checkpoints", "2"))
    finally:
        mh.wait_all(procs, timeout=5)
    per_host = read_loop_state(os.path.join(run, "checkpoints"), 2).extra["async"]["per_host"]
    assert len(per_host) == 2
    for h in per_host:  # each host: its block of batch 2 (finished episodes, submitted) and of
        # batch 3, whose episodes were interrupted after their first turn
        assert [q["index"] for q in h["queued"]] == [2] and h["queued"][0]["groups"]
        assert all("episode" in r for g in h["queued"][0]["groups"] for r in g["rollouts"])
        assert h["started"]["index"] == 3 and h["started"]["episodes"]["next_turn"] == 1
    # the hosts hold different episodes (their own blocks of the same draw)
    assert per_host[0]["started"]["idx"] == per_host[1]["started"]["idx"]
    assert per_host[0]["started"]["episodes"] != per_host[1]["started"]["episodes"]

    procs = launch(run)
    logs = mh.wait_all(procs, timeout=900)
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    _compare(_rows(run), ref_rows, 4)
    keys = _cache_keys(run)
    assert len(keys) == len(set(keys))
    assert set(keys) == set(_cache_keys(ref))
