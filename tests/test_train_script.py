"""End-to-end tests of the training entry point on the `:smoke` configs (real components:
the flax policy, the embedded JAX sampler, the toy verifier, the heuristic grading pool, orbax
checkpoints). Each run takes seconds on a quiet 2-core machine (mostly compilation)."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from configs import toy_gagar
from gagar_jax.analysis import writers
from gagar_jax.rl.config import ConfigError, RunConfig
from gagar_jax.rl.resume import read_loop_state

# Runs of scripts/train.py and of the whole loop: minutes on 2 cores (make test-unit skips them).
pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One persistent compilation cache for every run of this module (in-process and scripts): the
# three modes and the resume runs share the SFT step and sampler programs.
JAX_CACHE = os.path.join(tempfile.gettempdir(), "gagar_jax_test_train_jax_cache")


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    from gagar_jax.rl import train

    train.enable_compilation_cache(JAX_CACHE)


SCRIPT = os.path.join(ROOT, "scripts", "train.py")
CONFIG = os.path.join(ROOT, "configs", "toy_gagar.py")


def smoke_config(mode, **overrides):
    d = toy_gagar.get_config(f"{mode},smoke").to_dict()
    for dotted, value in overrides.items():
        section, field = dotted.split(".")
        d[section][field] = value
    return RunConfig.from_config_dict(d)


def train_rows(workdir):
    rows = writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return [r for r in rows if r["phase"] == "train"]


@pytest.mark.parametrize("mode", ["gagar", "binary", "discount_only", "gagar_token"])
def test_smoke_each_mode(mode, tmp_path, capsys):
    from gagar_jax.rl import train

    cfg = smoke_config(mode)
    summary = train.train_and_evaluate(cfg, str(tmp_path))
    out = capsys.readouterr().out
    rows = train_rows(tmp_path)
    G = cfg.rollout.num_prompts
    assert [r["step"] for r in rows] == list(range(cfg.loop.total_steps))
    # dynamic sampling is off in :smoke, so every step draws exactly G prompts
    assert [r["data_position"] for r in rows] == [G * (s + 1) for s in range(len(rows))]
    assert [r["policy_version"] for r in rows] == [s + 1 for s in range(len(rows))]
    for r in rows:
        for key in ("pass_rate", "response_length", "entropy", "pg_loss_mean", "step_time_s"):
            assert r[key] is not None, (key, r)
        assert 0 < r["response_length"] <= cfg.rollout.max_new_tokens
    evals = [r for r in writers.read_jsonl(str(tmp_path / "metrics.jsonl")) if r["phase"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == cfg.loop.total_steps
    assert any(r["phase"] == "sft" for r in writers.read_jsonl(str(tmp_path / "metrics.jsonl")))
    assert f"finished: {cfg.loop.total_steps} steps" in out and "ETA" in out
    assert os.path.getsize(summary["plot"]) > 10_000
    assert summary["update_traces"] == 1  # one compiled update for the whole run
    assert os.listdir(tmp_path / "tb")
    # the loop's bookkeeping is an item of the last checkpoint step
    last = cfg.loop.total_steps
    assert read_loop_state(tmp_path / "checkpoints", last).step == last


def _run_script(workdir, *extra, timeout=600):
    cmd = [
        sys.executable,
        SCRIPT,
        f"--config={CONFIG}:gagar,smoke",
        f"--workdir={workdir}",
        f"--compilation_cache={JAX_CACHE}",
        "--config.loop.total_steps=5",
        "--config.loop.checkpoint_every=1",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_script_sigkill_mid_run_resumes_exactly(tmp_path):
    """Killed with SIGKILL after checkpoint 2, the rerun continues without repeating or skipping
    a step, and produces the same figures as an uninterrupted run of the same config."""
    ref = tmp_path / "ref"
    r = _run_script(ref)
    assert r.returncode == 0, r.stderr[-3000:]

    run = tmp_path / "run"
    cmd = [
        sys.executable,
        SCRIPT,
        f"--config={CONFIG}:gagar,smoke",
        f"--workdir={run}",
        f"--compilation_cache={JAX_CACHE}",
        "--config.loop.total_steps=5",
        "--config.loop.checkpoint_every=1",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = run / "checkpoints" / "2"
    deadline = time.monotonic() + 600
    try:
        while not marker.exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)  # into step 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_rows = train_rows(run)
    assert len(killed_rows) < 5

    r = _run_script(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoint" in r.stdout + r.stderr
    rows, ref_rows = train_rows(run), train_rows(ref)
    assert [x["step"] for x in rows] == [0, 1, 2, 3, 4]
    for a, b in zip(rows, ref_rows):
        for key in ("data_position", "policy_version", "pass_rate", "response_length"):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["pg_loss_mean"] == pytest.approx(b["pg_loss_mean"], abs=1e-6)
    state = read_loop_state(run / "checkpoints", 5)
    assert state.step == 5 and state.sft_done and state.policy_version == 5


def test_sigterm_saves_at_the_step_boundary_and_resumes(tmp_path):
    """SIGTERM (a pod's preemption notice) mid-run: the loop finishes the step it is in, saves
    that step's checkpoint (none is due on the interval), exits with 128 + SIGTERM; the rerun
    resumes there, repeating no step and skipping none."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        SCRIPT,
        f"--config={CONFIG}:gagar,smoke",
        f"--workdir={run}",
        f"--compilation_cache={JAX_CACHE}",
        "--config.loop.total_steps=5",
        "--config.loop.checkpoint_every=100",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 600
    try:
        while not (run / "metrics.jsonl").exists() or not train_rows(run):
            assert proc.poll() is None, "the run ended before SIGTERM: " + proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # during step 1 (or at its end)
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    rows = train_rows(run)
    done = len(rows)
    assert 1 <= done < 5 and [r["step"] for r in rows] == list(range(done))
    steps = sorted(int(n) for n in os.listdir(run / "checkpoints") if n.isdigit())
    assert steps == [0, done]  # after SFT, and at the boundary after SIGTERM (not on interval)
    state = read_loop_state(run / "checkpoints", done)
    assert state.step == done and state.policy_version == done
    assert state.data_position == rows[-1]["data_position"]

    r = _run_script(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from checkpoint {done}" in r.stdout + r.stderr
    assert [x["step"] for x in train_rows(run)] == [0, 1, 2, 3, 4]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_rollout_server_is_a_clear_error_not_a_hang(tmp_path):
    """A real dead endpoint (nothing listens on the port): the run stops at once, naming it."""
    from gagar_jax.rl import train

    url = f"http://127.0.0.1:{_free_port()}"
    cfg = smoke_config("gagar", **{"rollout.engine": "sglang", "rollout.sglang_url": url})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rollout\.sglang_url") as e:
        train.train_and_evaluate(cfg, str(tmp_path))
    assert url in str(e.value)
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("kind", ["crash", "hang"])
def test_failing_grader_falls_back_and_training_continues(kind, tmp_path):
    """A grader that raises, or one that blocks forever: every group falls back to its original
    advantages (counted by reason), the run finishes, nothing hangs."""
    from gagar_jax.grading import testing as grading_testing
    from gagar_jax.rl import train

    grader = (
        grading_testing.CrashingGrader() if kind == "crash" else grading_testing.HangingGrader()
    )
    cfg = smoke_config("gagar", **{"grading.deadline_s": 1.0, "loop.total_steps": 2})
    t0 = time.monotonic()
    try:
        train.train_and_evaluate(cfg, str(tmp_path), grader=grader)
    finally:
        if kind == "hang":
            grader.release()
    rows = train_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    G = cfg.rollout.num_prompts
    reason = "grader_error" if kind == "crash" else "deadline"
    for r in rows:
        assert r["grading_fallbacks"] == G and r["grading_graded_frac"] == 0.0
        assert r[f"grading_fallback_{reason}"] == G
        assert r["pg_loss_mean"] is not None  # the update ran on the original advantages
    assert time.monotonic() - t0 < 300


def test_dead_agentic_grader_server_falls_back(tmp_path):
    """The agentic grader pointed at a real dead endpoint: groups fall back, the run finishes."""
    from gagar_jax.rl import train

    url = f"http://127.0.0.1:{_free_port()}"
    cfg = smoke_config(
        "gagar",
        **{
            "grading.grader": "agentic",
            "grading.sglang_url": url,
            "grading.deadline_s": 2.0,
            "loop.total_steps": 1,
        },
    )
    t0 = time.monotonic()
    train.train_and_evaluate(cfg, str(tmp_path))
    (row,) = train_rows(tmp_path)
    assert row["grading_fallbacks"] == cfg.rollout.num_prompts
    assert row["grading_graded_frac"] == 0.0
    assert time.monotonic() - t0 < 300


def test_refused_resume_leaves_the_run_untouched(tmp_path):
    from gagar_jax.rl import train

    train.train_and_evaluate(smoke_config("gagar", **{"loop.total_steps": 1}), str(tmp_path))
    before = (tmp_path / "config.json").read_text()
    for other in (
        smoke_config("binary", **{"loop.total_steps": 1}),
        smoke_config("gagar", **{"learner.learning_rate": 0.5, "loop.total_steps": 1}),
    ):
        with pytest.raises(train.ResumeMismatchError, match="fingerprint"):
            train.train_and_evaluate(other, str(tmp_path))
    assert (tmp_path / "config.json").read_text() == before


AGENT_CONFIG = os.path.join(ROOT, "configs", "toy_agent.py")


def _run_agent(workdir, steps=3):
    cmd = [
        sys.executable,
        SCRIPT,
        f"--config={AGENT_CONFIG}:gagar,smoke",
        f"--workdir={workdir}",
        f"--compilation_cache={JAX_CACHE}",
        f"--config.loop.total_steps={steps}",
        "--config.loop.checkpoint_every=1",
    ]
    return cmd


def test_toy_agent_multi_turn_sigkill_resumes_exactly(tmp_path):
    """The multi-turn toy agent through the entry point: episodes of several turns with parsed
    tool calls; killed with SIGKILL after checkpoint 1, the rerun repeats no step, skips none
    and reproduces the uninterrupted run's figures."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    ref = tmp_path / "ref"
    r = subprocess.run(
        _run_agent(ref), capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref_rows = train_rows(ref)
    assert [x["step"] for x in ref_rows] == [0, 1, 2]
    assert max(x["episode/turns_mean"] for x in ref_rows) > 1.0
    for x in ref_rows:
        assert 0 < x["episode/model_tokens_mean"] < x["response_length"]  # observations masked
        assert x["rollout/weight_version"] == x["policy_version"]
        assert abs(x["rollout/logprob_mismatch_k3"]) < 1e-5  # embedded sampler: same program

    run = tmp_path / "run"
    proc = subprocess.Popen(
        _run_agent(run), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    marker = run / "checkpoints" / "1"
    deadline = time.monotonic() + 600
    try:
        while not marker.exists():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    r = subprocess.run(
        _run_agent(run), capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from checkpoint" in r.stdout + r.stderr
    rows = train_rows(run)
    assert [x["step"] for x in rows] == [0, 1, 2]
    for a, b in zip(rows, ref_rows):
        for key in (
            "data_position",
            "policy_version",
            "pass_rate",
            "response_length",
            "episode/turns_mean",
            "episode/tool_calls_mean",
        ):
            assert a[key] == b[key], (key, a["step"], a[key], b[key])
        assert a["pg_loss_mean"] == pytest.approx(b["pg_loss_mean"], abs=1e-6)


def test_smoke_with_a_data_parallel_sampler(tmp_path, monkeypatch):
    """rollout.embedded_data_parallel=4: the loop's embedded sampler splits its rows over 4 of
    the process's devices (weight sync included) and the run trains as with one device: the
    same rollouts, hence the same pass rates and response lengths step by step (the figures
    agree to float rounding of the log-probs)."""
    import jax

    from gagar_jax.rl import engines, train

    if jax.local_device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    built = []
    original = engines.build_engine

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(engines, "build_engine", spy)
    runs = {}
    for devices in (1, 4):
        cfg = smoke_config(
            "gagar", **{"rollout.embedded_data_parallel": devices, "loop.total_steps": 3}
        )
        train.train_and_evaluate(cfg, str(tmp_path / f"dp{devices}"))
        runs[devices] = train_rows(tmp_path / f"dp{devices}")
    assert built[0].mesh is None and built[1].mesh.shape["data"] == 4
    assert built[1].policy_version == 3  # synced after every step
    one, dp = runs[1], runs[4]
    assert [r["step"] for r in dp] == [r["step"] for r in one] == [0, 1, 2]
    for a, b in zip(one, dp):
        assert a["pass_rate"] == b["pass_rate"] and a["response_length"] == b["response_length"]
        assert abs(a["pg_loss_mean"] - b["pg_loss_mean"]) < 1e-4


def test_embedded_data_parallel_names_the_field():
    from gagar_jax.rl import engines

    with pytest.raises(ValueError, match=r"rollout\.embedded_data_parallel=4096: this process"):
        engines.sampler_mesh(4096)
    with pytest.raises(ConfigError, match=r"rollout\.embedded_data_parallel"):
        smoke_config("gagar", **{"rollout.embedded_data_parallel": -1})
