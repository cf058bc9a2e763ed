"""One part of the per-stage accelerator table (benchmarks/accelerator.sh runs each part in a
process of its own, under its own time limit).

    python benchmarks/accelerator.py PART [--shape 0.6b|1.7b|tiny] [--dry] [--json OUT]

Parts (bfloat16 compute and parameters, random weights at Qwen3 shapes):

- ``peak``: the chip's measured bf16 matmul peak (a chain of square products, FLOP/s);
- ``sampler``: the embedded sampler's generated tokens/s at batch 64 (8 prompts x 8 samples,
  128-token prompts) with 1,024 new tokens (no stop token: every row runs the whole budget);
- ``update``: the update's tokens/s (64 sequences of 1,152 tokens) and its MFU against
  ``--peak`` (model FLOPs ``6 P`` per token for full fine-tuning, ``4 P`` for LoRA, whose
  weight gradients are never formed; attention's FLOPs left out), full and LoRA;
- ``sync``: weight-sync seconds to the embedded sampler, whole weights and the LoRA adapters
  alone, each followed by its verification (``gagar_jax.rollout.weight_sync.check_sync``,
  timed apart);
- ``step``: the whole RL step in one process: sample (batch 64, 1k new tokens), pack, update,
  sync, with random rewards (LoRA, the adapter sync);
- ``tunix``: whether Tunix imports here (its numbers at the same shapes need its own script on
  the same chip; not measured where it does not install).

``--dry`` runs any part at the ``tiny`` shape with small batches and budgets (CPU, seconds):
what the test runs. Each part prints one JSON line (``RESULT {...}``) with its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.memory import host_batch, qwen3_config  # noqa: E402
from gagar_jax.models import Transformer, lora  # noqa: E402
from gagar_jax.rollout import SamplingParams  # noqa: E402
from gagar_jax.rollout import weight_sync as ws  # noqa: E402
from gagar_jax.rollout.sampler import Sampler  # noqa: E402
from gagar_jax.update import (  # noqa: E402
    UpdateBatch,
    UpdateConfig,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)

RANK = 16


def geometry(dry: bool) -> dict:
    """Batch geometry of the parts: the table's, or the dry run's tiny one."""
    if dry:
        return dict(prompts=2, n=4, prompt_len=16, new=16, seqs=8, matmul=256, iters=4)
    return dict(prompts=8, n=8, prompt_len=128, new=1024, seqs=64, matmul=8192, iters=20)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def part_peak(g, _shape) -> dict:
    n = g["matmul"]
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16) / np.sqrt(n)

    @jax.jit
    def chain(a, b):
        for _ in range(g["iters"]):
            a = a @ b
        return a

    timed(chain, a, b)  # compile
    best = min(timed(chain, a, b)[1] for _ in range(5))
    flops = 2 * n**3 * g["iters"]
    return dict(matmul=n, bf16_tflops=flops / best / 1e12)


def _model(shape, lora_rank=0, seed=0):
    c = qwen3_config(shape, lora_rank=lora_rank, remat=False, scan_layers=False)
    return c, Transformer(c, rngs=nnx.Rngs(seed))


def _sampler(model, g):
    rows = g["prompts"] * g["n"]
    return Sampler(
        model,
        batch_buckets=(g["prompts"], rows),
        prompt_buckets=(g["prompt_len"],),
        new_token_buckets=(g["new"],),
    )


def _prompts(g, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(1, vocab, g["prompt_len"]))) for _ in range(g["prompts"])]


def _generate(sampler, g, vocab, seed=0):
    sp = SamplingParams(n=g["n"], temperature=1.0, max_tokens=g["new"], seed=seed)
    return sampler.generate(_prompts(g, vocab, seed), sp)


def part_sampler(g, shape) -> dict:
    c, model = _model(shape)
    sampler = _sampler(model, g)
    _generate(sampler, g, c.vocab_size)  # compile
    t0 = time.perf_counter()
    out = _generate(sampler, g, c.vocab_size, seed=1)
    dt = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for row in out for s in row)
    return dict(batch=g["prompts"] * g["n"], new_tokens=g["new"], tokens_per_s=tokens / dt)


def _update_cfg():
    return UpdateConfig(learning_rate=1e-5, num_minibatches=1, num_microbatches=1)


def part_update(g, shape, peak_tflops: float) -> dict:
    out = {}
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    t = g["prompt_len"] + g["new"]
    for mode in ("full", "lora"):
        c = qwen3_config(shape, lora_rank=RANK if mode == "lora" else 0)
        cfg = _update_cfg()
        state = create_train_state(c, cfg, mesh, seed=0)
        update = jit_update(c, cfg, mesh)
        batch = shard_batch(host_batch(g["seqs"], t, c.vocab_size), mesh)
        (state, _), _ = timed(update, state, batch)  # compile + one step
        (state, _), dt = timed(update, state, batch)
        tokens = g["seqs"] * t
        flops = (6 if mode == "full" else 4) * c.num_params * tokens
        out[mode] = dict(
            tokens_per_s=tokens / dt,
            step_s=dt,
            mfu=(flops / dt / 1e12 / peak_tflops) if peak_tflops else None,
        )
        del state
    return out


def part_sync(g, shape) -> dict:
    out = {}
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    c, model = _model(shape, lora_rank=RANK)
    sampler = _sampler(model, g)
    device = jax.devices()[0]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    from gagar_jax.rl.policy import local_params

    state = create_train_state(c, _update_cfg(), mesh, seed=1)
    ad = lora.split_adapters(state.params)[0]
    # full weights: every leaf to the sampler; then the adapters alone
    for name, fn in (
        ("full", lambda v: sampler.sync_weights(local_params(state.params, mesh, device), v)),
        ("lora", lambda v: ws.sync_sampler_adapters(sampler, local_params(ad, mesh, device), v)),
    ):
        version = len(out) + 1
        fn(version)  # warm (first transfer)
        t0 = time.perf_counter()
        fn(version + 10)
        jax.block_until_ready(sampler.state)
        sync_s = time.perf_counter() - t0
        ws.check_sync(sampler, state.params, c, version + 10)  # warm (compiles)
        t0 = time.perf_counter()
        m = ws.check_sync(sampler, state.params, c, version + 10)
        out[name] = dict(sync_s=sync_s, check_s=time.perf_counter() - t0, **m)
    del params
    return out


def part_step(g, shape) -> dict:
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    c = qwen3_config(shape, lora_rank=RANK)
    cfg = _update_cfg()
    state = create_train_state(c, cfg, mesh, seed=0)
    sampler = _sampler(
        nnx.merge(nnx.graphdef(Transformer(c, rngs=nnx.Rngs(0))), jax.device_get(state.params)), g
    )
    update = jit_update(c, cfg, mesh)
    device = jax.devices()[0]
    from gagar_jax.rl.policy import local_params

    def step(state, seed, version):
        t = {}
        t0 = time.perf_counter()
        out = _generate(sampler, g, c.vocab_size, seed)
        t["generate_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        batch = _pack(out, g, c.vocab_size, seed)
        state, m = update(state, shard_batch(batch, mesh))
        jax.block_until_ready(m)
        t["update_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ad = lora.split_adapters(state.params)[0]
        ws.sync_sampler_adapters(sampler, local_params(ad, mesh, device), version)
        ws.check_sync(sampler, state.params, c, version)
        t["sync_s"] = time.perf_counter() - t0
        return state, t

    state, _ = step(state, 0, 1)  # compiles
    state, t = step(state, 1, 2)
    t["step_s"] = sum(t.values())
    return t


def _pack(out, g, vocab, seed) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    prompts = _prompts(g, vocab, seed)
    k = g["n"]
    n = len(prompts) * k
    t = g["prompt_len"] + g["new"]
    tokens = np.zeros((n, t), np.int32)
    att = np.zeros((n, t), bool)
    resp = np.zeros((n, t), bool)
    old = np.zeros((n, t), np.float32)
    for i, row in enumerate(out):
        for j, s in enumerate(row):
            r = i * k + j
            ids = prompts[i] + list(s.tokens)
            tokens[r, : len(ids)] = ids
            att[r, : len(ids)] = True
            p = len(prompts[i])
            resp[r, p : len(ids)] = True
            old[r, p : len(ids)] = s.logprobs
    base = host_batch(n, t, vocab, k=k, seed=seed)
    passed = rng.uniform(size=(len(prompts), k)) < 0.5
    passed[:, 0], passed[:, 1] = True, False
    return base._replace(
        tokens=tokens,
        attention_mask=att,
        response_mask=resp,
        old_logprobs=old,
        positions=np.maximum(np.cumsum(att, axis=1) - 1, 0).astype(np.int32),
        rewards=passed.astype(np.float32),
        passed=passed,
    )


def part_tunix(_g, _shape) -> dict:
    try:
        import tunix  # noqa: F401
    except Exception as e:  # noqa: BLE001 - report why, do not fail the run
        return dict(installed=False, reason=f"{type(e).__name__}: {e}"[:200])
    return dict(
        installed=True, note="Tunix imports; its table needs benchmarks/rl_step.py's worker"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("peak", "sampler", "update", "sync", "step", "tunix"))
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--dry", action="store_true", help="tiny shapes and batches (CPU)")
    ap.add_argument("--peak", type=float, default=0.0, help="measured bf16 TFLOP/s (for MFU)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    g = geometry(args.dry)
    shape = "tiny" if args.dry else args.shape
    fn = {
        "peak": part_peak,
        "sampler": part_sampler,
        "update": lambda g, s: part_update(g, s, args.peak),
        "sync": part_sync,
        "step": part_step,
        "tunix": part_tunix,
    }[args.part]
    t0 = time.perf_counter()
    res = dict(
        part=args.part, shape=shape, device=str(jax.devices()[0].device_kind), **fn(g, shape)
    )
    res["part_s"] = time.perf_counter() - t0
    line = json.dumps(res, default=float)
    print("RESULT " + line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return res


if __name__ == "__main__":
    main()
