"""benchmarks/xla_flags.py: every XLA flag setting runs in a process of its own, a setting XLA
rejects is reported and left out, and the numbers each setting computes are compared with the
baseline's, so a setting that changes the arithmetic cannot pass for a faster equal."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "bench_xla_flags", ROOT / "benchmarks" / "xla_flags.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _save(path, *arrays):
    np.savez(path, *arrays)
    return str(path)


def test_numbers_diff_reads_the_largest_difference_and_any_change_of_shape(tmp_path):
    a = _save(tmp_path / "a.npz", np.array([1.0, 2.0, 3.0]), np.array([5.0]))
    same = _save(tmp_path / "same.npz", np.array([1.0, 2.0, 3.0]), np.array([5.0]))
    moved = _save(tmp_path / "moved.npz", np.array([1.0, 2.5, 3.0]), np.array([4.0]))
    longer = _save(tmp_path / "longer.npz", np.array([1.0, 2.0, 3.0, 4.0]), np.array([5.0]))
    fewer = _save(tmp_path / "fewer.npz", np.array([1.0, 2.0, 3.0]))
    assert bench.numbers_diff(a, same) == 0.0
    assert bench.numbers_diff(a, moved) == 1.0
    assert bench.numbers_diff(a, longer) == float("inf")
    assert bench.numbers_diff(a, fewer) == float("inf")


@pytest.mark.parametrize("flag", ["--rounds", "--calls", "--batch", "--new-tokens"])
def test_counts_below_one_are_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.e2e
def test_settings_run_apart_and_a_rejected_flag_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    args = bench.parse_args(
        [
            "--config=tiny",
            "--rounds=2",
            "--calls=1",
            "--setting=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
            "--setting=--xla_no_such_flag_here=1",
            f"--json={tmp_path / 'rows.json'}",
        ]
    )
    rows = {r["setting"]: r for r in bench.run(args)}
    base = rows["(baseline)"]
    assert base["max_abs_diff"] == 0.0 and base["vs_baseline"] == 1.0
    sched = rows["--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"]
    # Another schedule of the same program: the same parameters after a step, timed apart.
    assert sched["error"] is None and sched["median_s"] > 0 and sched["max_abs_diff"] == 0.0
    bad = rows["--xla_no_such_flag_here=1"]
    assert "median_s" not in bad and "no_such_flag_here" in bad["error"]
    assert (tmp_path / "rows.json").exists()


@pytest.mark.e2e
def test_the_sampler_setting_compares_tokens_and_log_probabilities(tmp_path):
    args = bench.parse_args(
        [
            "--what=sampler",
            "--config=tiny",
            "--batch=2",
            "--prompt-len=8",
            "--new-tokens=4",
            "--rounds=1",
            "--calls=1",
            "--setting=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
        ]
    )
    rows = bench.run(args)
    assert [r["setting"] for r in rows] == [
        "(baseline)",
        "--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    ]
    assert all(r["error"] is None and r["max_abs_diff"] == 0.0 for r in rows)
