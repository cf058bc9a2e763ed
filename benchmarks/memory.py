"""The update's memory at Qwen3-0.6B/1.7B/4B shapes: full fine-tuning against LoRA, per device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py \\
        [--shapes 0.6b,1.7b,4b] [--modes full,lora] [--execute 0.6b:lora] [--json out.json]

Random weights (no hub is reachable), bfloat16 parameters and compute, float32 Adam moments
(``learner.opt_state_dtype``; LoRA adapters are float32 anyway), rematerialisation of every
layer (``remat``, scanned layers), FSDP over the mesh (``mesh (1, N, 1)``: every parameter and
moment split over N devices on its embedding axis). Each row is XLA's own memory analysis of
the compiled update (``jax.jit(update).lower(state, batch).compile().memory_analysis()``, per
device): nothing is executed, so the 4B step is sized without 4B of memory.

Per device, peak = arguments + outputs - aliased + temporaries (the state is donated: its
outputs alias its arguments). The rows print beside the formula of docs/benchmarks.md
("Memory at real sizes"):

    peak     = max(backward, step)
    backward = state + grads + acts + logits + head + layer
    step     = state + grads + [full] 16 P / N        (f32 gradient, parameters, new moments)
    state    = [full] (2 + 8) P / N   [lora] (2 P + 12 P_lora) / N
    grads    = [full] 2 P / N         [lora] 4 P_lora / N
    acts     = L b T E 2      logits = 3 b T V 4      head = V E 2 (the tied embedding, whole)
    layer    = 2 (P - V E) / L + b T (6 E + 4 F + 3 N_h D) 4

with P the parameters, N the devices, b the sequences per device and micro-batch, T the tokens
per sequence (docs/benchmarks_scale.md).

``--execute SHAPE:MODE`` runs that one update (after compiling it) and compares the analysis,
summed over the devices of this one process, with the process's measured peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gagar_jax.models import TransformerConfig  # noqa: E402
from gagar_jax.update import (  # noqa: E402
    UpdateBatch,
    UpdateConfig,
    abstract_train_state,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)
from gagar_jax.update.step import batch_shardings  # noqa: E402

# Qwen3 dense shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -4B): tied embeddings, q/k norm,
# no q/k/v bias, head_dim 128, vocabulary 151936.
_QWEN3_DIMS = {  # hidden, layers, heads, KV heads, MLP width
    "0.6b": (1024, 28, 16, 8, 3072),
    "1.7b": (2048, 28, 16, 8, 6144),
    "4b": (2560, 36, 32, 8, 9728),
}
_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
QWEN3 = {k: dict(zip(_FIELDS, v)) for k, v in _QWEN3_DIMS.items()}
# Tiny stand-ins with the same structure, for the dry run and the test.
TINY = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
}
GIB = 1 << 30


def qwen3_config(shape: str, *, lora_rank: int = 0, vocab: int | None = None, **over):
    dims = {**QWEN3, **TINY}[shape]
    tiny = shape in TINY
    fields = dict(
        vocab_size=vocab or (512 if tiny else 151936),
        head_dim=16 if tiny else 128,
        rope_theta=1_000_000.0,
        qkv_bias=False,
        qk_norm=True,
        tie_embeddings=True,
        max_position_embeddings=40960,
        dtype="bfloat16",
        param_dtype="bfloat16",
        remat=True,
        scan_layers=True,
        lora_rank=lora_rank,
        lora_alpha=2.0 * max(lora_rank, 1),
        **dims,
    )
    fields.update(over)
    return TransformerConfig(**fields)


def update_config(micro: int) -> UpdateConfig:
    return UpdateConfig(
        learning_rate=1e-5, num_minibatches=1, num_microbatches=micro, opt_state_dtype="float32"
    )


def abstract_batch(mesh, n: int, t: int, k: int = 8):
    sh = batch_shardings(mesh)
    g = n // k

    def s(shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return UpdateBatch(
        tokens=s((n, t), jnp.int32, sh.tokens),
        positions=s((n, t), jnp.int32, sh.positions),
        attention_mask=s((n, t), jnp.bool_, sh.attention_mask),
        response_mask=s((n, t), jnp.bool_, sh.response_mask),
        old_logprobs=s((n, t), jnp.float32, sh.old_logprobs),
        rewards=s((g, k), jnp.float32, sh.rewards),
        passed=s((g, k), jnp.bool_, sh.passed),
        cheat=s((g, k), jnp.bool_, sh.cheat),
        tier=s((g, k), jnp.int32, sh.tier),
        rank=s((g, k), jnp.int32, sh.rank),
        valid=s((g, k), jnp.bool_, sh.valid),
        graded=s((g,), jnp.bool_, sh.graded),
    )


def host_batch(n: int, t: int, vocab: int, k: int = 8, seed: int = 0) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    g = n // k
    resp = np.zeros((n, t), bool)
    resp[:, t // 4 :] = True
    passed = rng.uniform(size=(g, k)) < 0.5
    passed[:, 0], passed[:, 1] = True, False
    return UpdateBatch(
        tokens=rng.integers(1, vocab, (n, t)).astype(np.int32),
        positions=np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)).copy(),
        attention_mask=np.ones((n, t), bool),
        response_mask=resp,
        old_logprobs=np.full((n, t), -2.0, np.float32),
        rewards=passed.astype(np.float32),
        passed=passed,
        cheat=np.zeros((g, k), bool),
        tier=np.ones((g, k), np.int32),
        rank=np.ones((g, k), np.int32),
        valid=np.ones((g, k), bool),
        graded=np.ones((g,), bool),
    )


def formula(c: TransformerConfig, n_dev: int, b: int, t: int, lora: bool) -> dict[str, float]:
    """The predicted per-device bytes, by term (docs/benchmarks_scale.md): the peak is the larger
    of the backward's and the optimizer step's live sets."""
    p, p_lora = c.num_params, c.num_lora_params
    e, v, L = c.hidden_size, c.vocab_size, c.num_layers
    f, nd = c.intermediate_size, c.num_heads * c.head_dim
    if lora:
        state = (2 * p + 12 * p_lora) / n_dev  # bf16 base; f32 adapters and their two moments
        grads = 4 * p_lora / n_dev
        opt = 0.0
    else:
        state = (2 + 8) * p / n_dev  # bf16 parameters, f32 Adam moments
        grads = 2 * p / n_dev  # the accumulated bf16 gradient
        opt = 16 * p / n_dev  # f32 copies of gradient and parameters, the new moments
    acts = L * b * t * e * 2  # each layer's input, kept for the rematerialised backward
    logits = 3 * b * t * v * 4  # f32 logits, their softmax and gradient
    head = v * e * 2  # the tied embedding gathered whole for the LM head
    layer = 2 * (p - v * e) / L + b * t * (6 * e + 4 * f + 3 * nd) * 4  # one layer, gathered
    backward = state + grads + acts + logits + head + layer
    step = state + grads + opt
    total = max(backward, step)
    return dict(
        state=state, grads=grads, acts=acts, logits=logits, head=head, layer=layer,
        opt=opt, backward=backward, step=step, total=total,
    )  # fmt: skip


def analyse(shape, mode, *, n_dev, seqs, seq_len, micro, rank, vocab=None):
    lora = mode == "lora"
    c = qwen3_config(shape, lora_rank=rank if lora else 0, vocab=vocab)
    cfg = update_config(micro)
    mesh = make_mesh((1, n_dev, 1), devices=jax.devices()[:n_dev])
    state = abstract_train_state(c, cfg, mesh)
    batch = abstract_batch(mesh, seqs, seq_len)
    t0 = time.perf_counter()
    compiled = jit_update(c, cfg, mesh).lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    peak = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    b = seqs // n_dev // micro  # sequences per device per micro-batch
    pred = formula(c, n_dev, b, seq_len, lora)
    row = dict(
        shape=shape,
        mode=mode,
        params=c.num_params,
        lora_params=c.num_lora_params,
        devices=n_dev,
        seqs=seqs,
        seq_len=seq_len,
        micro=micro,
        argument_gib=m.argument_size_in_bytes / GIB,
        output_gib=m.output_size_in_bytes / GIB,
        alias_gib=m.alias_size_in_bytes / GIB,
        temp_gib=m.temp_size_in_bytes / GIB,
        peak_gib=peak / GIB,
        predicted_gib=pred["total"] / GIB,
        predicted_terms_gib={k: round(x / GIB, 3) for k, x in pred.items()},
        compile_s=compile_s,
    )
    return row, (c, cfg, mesh, compiled)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def execute(row, c, cfg, mesh, compiled) -> dict:
    """Runs the compiled update once on random weights; the process's peak RSS growth against
    the analysis summed over this process's devices."""
    base = rss_bytes()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = create_train_state(c, cfg, mesh, seed=0)
    jax.block_until_ready(state)
    after_state = rss_bytes()
    batch = shard_batch(host_batch(row["seqs"], row["seq_len"], c.vocab_size), mesh)
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    step_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss = float(metrics["loss"])
    n = row["devices"]
    return dict(
        step_s=step_s,
        loss=loss,
        rss_state_gib=(after_state - base) / GIB,
        rss_peak_growth_gib=(max(peak, peak0) - base) / GIB,
        analysis_all_devices_gib=row["peak_gib"] * n,
        analysis_state_all_devices_gib=row["argument_gib"] * n,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0.6b,1.7b,4b")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=64, help="sequences per update (all devices)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per update")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=0, help="override the vocabulary (0: Qwen3's)")
    ap.add_argument("--execute", default="", help="SHAPE:MODE to run once (RSS check)")
    ap.add_argument("--execute-seqs", type=int, default=8)
    ap.add_argument("--execute-seq-len", type=int, default=128)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows = []
    common = dict(n_dev=args.devices, micro=args.micro, rank=args.rank, vocab=args.vocab or None)
    print(
        f"{'shape':>5} {'mode':>4} {'params':>8} {'state':>7} {'temp':>7} {'peak':>7} "
        f"{'formula':>7} {'ratio':>5}  (GiB per device; {args.devices} devices, "
        f"{args.seqs} x {args.seq_len} tokens, {args.micro} micro-batches)"
    )
    for shape in [s for s in args.shapes.split(",") if s]:
        for mode in [m for m in args.modes.split(",") if m]:
            row, _ = analyse(shape, mode, seqs=args.seqs, seq_len=args.seq_len, **common)
            rows.append(row)
            print(
                f"{shape:>5} {mode:>4} {row['params'] / 1e9:>7.2f}B {row['argument_gib']:>7.3f} "
                f"{row['temp_gib']:>7.3f} {row['peak_gib']:>7.3f} {row['predicted_gib']:>7.3f} "
                f"{row['predicted_gib'] / row['peak_gib']:>5.2f}  compile {row['compile_s']:.0f}s",
                flush=True,
            )
    if args.execute:
        shape, mode = args.execute.split(":")
        row, rest = analyse(
            shape, mode, seqs=args.execute_seqs, seq_len=args.execute_seq_len, **common
        )
        row["executed"] = execute(row, *rest)
        rows.append(row)
        ex = row["executed"]
        print(
            f"executed {shape}:{mode} ({args.execute_seqs} x {args.execute_seq_len}): step "
            f"{ex['step_s']:.1f}s loss {ex['loss']:.3f}; analysis x {args.devices} devices "
            f"{ex['analysis_all_devices_gib']:.3f} GiB "
            f"(state {ex['analysis_state_all_devices_gib']:.3f}) "
            f"vs measured RSS growth {ex['rss_peak_growth_gib']:.3f} GiB (state "
            f"{ex['rss_state_gib']:.3f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
