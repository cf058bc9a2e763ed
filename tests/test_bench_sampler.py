"""The sampler benchmark's products-alone ceiling (benchmarks/sampler.py ``decode_products``)
runs the products a decode step of the sampler runs: the projections and the LM head of the
compiled generation program, at the decode's row count, are the ones it times."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import gagar_jax.rollout.sampler as sampler_module
from gagar_jax.models import TransformerConfig, create_model
from gagar_jax.rollout import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


# benchmarks/ is on the path while loading only: the HLO reader and the sampler benchmark.
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import xla_profile

    _spec = importlib.util.spec_from_file_location(
        "bench_sampler", ROOT / "benchmarks" / "sampler.py"
    )
    bench = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(bench)
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def _row_products(hlo: str, rows: int) -> set[tuple[int, int]]:
    """(contracted size, output width) of every plain 2-D dot of ``rows`` rows in ``hlo``."""
    found = set()
    for body in xla_profile._computations(hlo).values():
        for _, shape, op, rest in body:
            out = xla_profile._dims(shape)
            if op != "dot" or len(out) != 2 or out[0] != rows:
                continue
            flops = xla_profile._single_dot_flops(shape, rest, body)
            found.add((round(flops / (2 * out[0] * out[1])), out[1]))
    return found


@pytest.mark.parametrize("rows", [4, 8])
def test_decode_products_are_the_sampler_decode_products(monkeypatch, rows):
    cfg = TransformerConfig(
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=56,
        rope_theta=1e4,
    )
    texts = []
    program = sampler_module._generate_program

    def spy(*args, **kwargs):
        texts.append(program.lower(*args, **kwargs).compile().as_text())
        return program(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "_generate_program", spy)
    sampler = sampler_module.Sampler(
        create_model(cfg, seed=0),
        batch_buckets=(rows,),
        prompt_buckets=(8,),
        new_token_buckets=(4,),
    )
    prompts = np.random.default_rng(0).integers(1, cfg.vocab_size, (rows, 8)).tolist()
    sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))
    (hlo,) = texts
    in_sampler = _row_products(hlo, rows)
    _, flops, products_hlo = bench.decode_products(cfg, rows, steps=3)
    listed = _row_products(products_hlo, rows)
    e, q, kv, i = 32, 32, 16, 56
    assert listed == {(e, q + 2 * kv), (q, e), (e, i), (i, e), (e, cfg.vocab_size)}
    assert in_sampler == listed, (in_sampler, listed)
    per_row_step = cfg.num_layers * (e * (q + 2 * kv) + q * e + 2 * e * i + i * e) + e * 96
    assert flops == 2 * rows * 3 * per_row_step
