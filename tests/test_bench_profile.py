"""The per-op profile of the benchmarks (benchmarks/xla_profile.py) reads a compiled program
right: a dot's FLOPs are 2 x M x N x K from the HLO's shapes, a transpose-only copy counts as
layout work and an exponential as elementwise work, and the trace's op times land in those
categories."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location(
        "xla_profile", ROOT / "benchmarks" / "xla_profile.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("xla_profile", module)
    spec.loader.exec_module(module)
    return module


prof = _load()

M, K, N = 64, 48, 80


def _program():
    def f(x, w):
        y = x @ w  # [M, N]: 2 * M * N * K FLOPs
        # a transposed copy behind a barrier (no dot may absorb it), and an exponential
        t = jax.lax.optimization_barrier(y.T)
        return jnp.exp(t) + 1.0

    x = jnp.full((M, K), 0.01, jnp.float32)
    w = jnp.ones((K, N), jnp.float32)
    compiled = jax.jit(f).lower(x, w).compile()
    return compiled, x, w


def test_hlo_index_counts_dot_flops_and_categories():
    compiled, _, _ = _program()
    index = prof.hlo_index(compiled.as_text())
    dots = [i for i in index.values() if i.category == "dot" and i.flops]
    # One dot (a fusion or a plain instruction; a fusion's inner dot is indexed too).
    assert {i.flops for i in dots} == {2.0 * M * N * K}
    cats = {i.category for i in index.values()}
    assert "layout" in cats and "elementwise" in cats


def test_breakdown_of_a_traced_program():
    compiled, x, w = _program()
    secs, count = prof.trace_ops(lambda: jax.block_until_ready(compiled(x, w)), reps=2)
    result = prof.breakdown(secs, count, compiled.as_text())
    cats = result["categories"]
    assert cats["dot"]["flops"] == 2.0 * M * N * K  # one execution per run
    assert all(v["s"] >= 0 for v in cats.values())
    lines = []
    prof.print_breakdown(result, peak=1e9, out=lines.append)
    assert lines[0].split()[:2] == ["category", "s/run"]
    assert any(line.startswith("dot") for line in lines)
    np.testing.assert_allclose(compiled(x, w), np.exp(np.full((N, M), 0.01 * K)) + 1.0, rtol=1e-6)
