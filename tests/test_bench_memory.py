"""benchmarks/memory.py: XLA's memory analysis of the update at a tiny Qwen3-structured shape
(full fine-tuning against LoRA over 8 simulated devices), the formula beside it, and one
executed step checked against the process's RSS; benchmarks/accelerator.sh's CPU dry run."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_qwen3_shapes_have_the_published_sizes():
    # Qwen3-0.6B: 0.60B parameters (tied), 1.7B: 1.72B, 4B: 4.02B (model cards)
    for shape, want in (("0.6b", 0.596e9), ("1.7b", 1.72e9), ("4b", 4.02e9)):
        got = bench.qwen3_config(shape).num_params
        assert abs(got - want) / want < 0.01, (shape, got)


def test_lora_needs_less_state_than_full_and_the_formula_tracks_the_analysis(tmp_path):
    rows = bench.main(
        [
            "--shapes=tiny",
            "--seqs=16",
            "--seq-len=64",
            "--micro=2",
            "--rank=4",
            "--vocab=4096",
            "--execute=tiny:lora",
            "--execute-seqs=16",
            "--execute-seq-len=64",
            f"--json={tmp_path / 'm.json'}",
        ]
    )
    full, lo, ex = rows
    assert full["mode"] == "full" and lo["mode"] == "lora"
    assert lo["argument_gib"] < full["argument_gib"]  # no Adam moments for the base
    for row in (full, lo):
        assert 0.5 < row["predicted_gib"] / row["peak_gib"] < 2.0, row
    run = ex["executed"]
    assert run["loss"] == run["loss"]  # finite
    # the whole process's growth covers the 8 devices' analysed peak (plus allocator slack)
    assert run["rss_peak_growth_gib"] > 0.5 * run["analysis_all_devices_gib"]
    assert json.loads((tmp_path / "m.json").read_text())[0]["shape"] == "tiny"


@pytest.mark.e2e
def test_accelerator_script_dry_run(tmp_path):
    """The per-stage table's script at tiny shapes on CPU: every part finishes and reports."""
    env = dict(os.environ, DRY="1", XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "accelerator.sh"), str(tmp_path), sys.executable],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    parts = {r["part"] for r in rows}
    assert parts == {"peak", "sampler", "update", "sync", "step", "tunix"}, proc.stdout[-3000:]
    by = {(r["part"], i): r for i, r in enumerate(rows)}
    assert all(r["shape"] == "tiny" for r in rows)
    for r in by.values():
        if r["part"] == "update":
            assert r["full"]["tokens_per_s"] > 0 and r["lora"]["mfu"] > 0
        if r["part"] == "sync":
            assert r["lora"]["sync/probe_max_abs_diff"] < 1e-3
        if r["part"] == "step":
            assert r["step_s"] > 0
    assert "rc=124" not in proc.stdout  # no part ran past its limit
