"""The dot ceiling (benchmarks/gemm_shapes.py) times the dots an update step runs: its list of
dots is checked against the dot instructions of the compiled update of small models that take
each of its branches (weight gradients by either product, the LM head's two forms, attention
blocks of two lengths)."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from gagar_jax.models import TransformerConfig

ROOT = Path(__file__).resolve().parents[1]


def _load_bench():
    # benchmarks/ is on the path while loading only. benchmarks/update.py (which gemm_shapes
    # imports) rewrites XLA_FLAGS for its own runs: the flags this test process hands to its
    # children are put back.
    flags = os.environ.get("XLA_FLAGS")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_gemm_shapes", ROOT / "benchmarks" / "gemm_shapes.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up
        spec.loader.exec_module(module)
        import xla_profile  # the HLO reader the check counts the program's dots with

        return module, xla_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


gs, xla_profile = _load_bench()


@pytest.mark.parametrize(
    "hidden, batch, length",
    [
        (32, 4, 64),  # tokens >= 2 x width: the head's weight gradient as (h^T dz)^T; 2 blocks
        (64, 1, 48),  # tokens < 2 x width: dz^T h; a short last block
    ],
)
def test_listed_dots_are_the_compiled_update_step_dots(hidden, batch, length):
    c = TransformerConfig(
        vocab_size=256,
        hidden_size=hidden,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=48,  # > hidden: the down projection's I > O weight gradient
        rope_theta=1e4,
    )
    compiled = []
    gs.ub.bench_jax(c, batch, length, compiled_out=compiled)
    in_program = sorted(xla_profile.dot_instruction_flops(compiled[0].as_text()))
    listed = sorted(
        d.flops / d.count for d in gs.update_dots(c, batch, length) for _ in range(d.count)
    )
    assert len(in_program) == len(listed) and in_program == pytest.approx(listed), (
        in_program,
        listed,
    )


def test_dot_instruction_flops_reads_shapes_and_contracted_dims():
    text = """
ENTRY %main (p0: f32[4,2,64,8], p1: f32[4,2,32,8], x: f32[16,5], y: f32[16,7]) -> f32[5,7] {
  %p0 = f32[4,2,64,8]{3,2,1,0} parameter(0)
  %p1 = f32[4,2,32,8]{3,2,1,0} parameter(1)
  ROOT %d = f32[4,2,64,32]{3,2,1,0} dot(%p0, %p1), lhs_batch_dims={0,1}, lhs_contracting_dims={3}, rhs_batch_dims={0,1}, rhs_contracting_dims={3}
  %x = f32[16,5]{1,0} parameter(2)
  %y = f32[16,7]{1,0} parameter(3)
  %dw = f32[5,7]{1,0} dot(%x, %y), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}
"""  # noqa: E501
    assert xla_profile.dot_instruction_flops(text) == [2.0 * 4 * 2 * 64 * 32 * 8, 2.0 * 5 * 7 * 16]
