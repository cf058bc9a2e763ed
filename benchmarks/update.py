"""Policy-update throughput: gagar_jax's jitted update vs a straightforward PyTorch step.

    .venv/bin/python benchmarks/update.py                 # small and ~100M configs
    .venv/bin/python benchmarks/update.py --configs small --steps 3

Both sides run one optimizer step on the same model (Qwen2 architecture, fp32) and the same
loss (per-token log-probs, PPO-clip token-mean) with AdamW and global-norm clipping:

- JAX: ``gagar_jax.update.jit_update`` (advantage kernels included) on a one-device mesh;
- PyTorch: ``transformers.Qwen2ForCausalLM`` (SDPA attention) + ``log_softmax``/``gather`` +
  the clipped loss + ``torch.optim.AdamW`` -- the straightforward implementation.

Each implementation runs in a process of its own (``--in-process``: all in this one, so that what
sharing a process with PyTorch's threads and heap costs can be measured). Their steps are timed
interleaved (one step of each per round, ``--steps`` rounds after a warm-up), so a change of the
machine's load hits all of them alike; each round also measures the machine's GEMM peak in every
implementation's process (the best of a few jitted f32 1024^3 matmuls for JAX, ``torch.mm`` for
PyTorch). Reported: median step time, tokens/s, the step's FLOPs as XLA's cost analysis of the
compiled update counts them (``compiled.cost_analysis()``, of the per-layer program: a scanned loop
body is counted once), achieved FLOP/s, and the FLOP utilisation ``MFU`` = (XLA FLOPs / step
seconds) / (the same round's GEMM peak), median over rounds, so a load change between the peak and
the step does not skew it. JAX rows: ``jax`` (per-layer blocks, whole-sequence logits) and
``jax-scan`` (``scan_layers=True``, logits in chunks of ``--chunk`` tokens), each with its compile
seconds and XLA's temporary-buffer size of the compiled step (``temp MB``: what the logits chunking
saves). A second table gives compile seconds per depth (``--depths`` layers of each config) for
both layer layouts. A third table isolates what the logits chunking saves: the compiled update's
temporary buffers with whole and chunked logits, same model, per vocabulary size up to Qwen's
151,936 (``--logits-vocabs``). The machine's load average is printed before and after. Model FLOPs
(the PyTorch rows' count) = 6 x (matmul params) x tokens + the attention score/value matmuls (12 x
layers x T^2 x heads x head_dim per sequence). On an accelerator the MFU column is against that
device's measured GEMM peak (an 8192^3 product of random values), every row's FLOPs are the
model-FLOPs formula (XLA's cost analysis on a GPU leaves out the dots it hands to cuBLAS),
PyTorch runs on the same GPU and float32 products run at TF32 on both sides (JAX's default
precision there). ``--dtype bfloat16`` computes in bfloat16 on both sides (parameters stay
float32; PyTorch autocasts), and ``--batch-scale N`` multiplies every config's batch (an
accelerator needs more sequences than a CPU step takes to be filled).

``--profile CONFIG`` adds a per-op profile of one config's update (``benchmarks/xla_profile.py``:
``jax.profiler`` trace matched to the compiled HLO): the time in dots (with their achieved
FLOP/s against the GEMM peak), in elementwise ops and reductions, and in layout copies
(transposes, slices, pads, concatenations), and the slowest ops.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import functools
import multiprocessing
import os
import signal
import statistics
import sys
import time

# Measure the checkout this script lives in (run as a script, sys.path[0] is benchmarks/ and
# the venv's editable install may point at another checkout).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The allocator keeps the update's temporary buffer between steps instead of faulting it in
# again each step (gagar_jax.update.malloc; GAGAR_MALLOC_KEEP_HEAP=0 measures without).
from gagar_jax.update.malloc import keep_heap  # noqa: E402

KEEP_HEAP = keep_heap()

# The race's timestamped progress lines (benchmarks/ is on sys.path for a script).
from rl_step import progress  # noqa: E402

# One host device for the benchmark (the test suite's 8 simulated devices would split threads).
os.environ["XLA_FLAGS"] = " ".join(
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
)
# On an accelerator the driver and each implementation's process share one device: none of them
# takes most of its memory up front (read when JAX starts its backend, not at import).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gagar_jax.models import TransformerConfig  # noqa: E402
from gagar_jax.update import (  # noqa: E402
    UpdateBatch,
    UpdateConfig,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)

CONFIGS = {
    # name: (model config, batch sequences, sequence length)
    "small": (
        TransformerConfig(
            vocab_size=4096,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=704,
            rope_theta=10000.0,
        ),
        8,
        256,
    ),
    "100m": (
        TransformerConfig(
            vocab_size=32000,
            hidden_size=768,
            num_layers=10,
            num_heads=12,
            num_kv_heads=4,
            intermediate_size=2048,
            rope_theta=10000.0,
        ),
        4,
        256,
    ),
}
# On an accelerator the GEMM peak is measured with a product that fills it.
ACCEL = jax.default_backend() != "cpu"
PEAK_N = 8192 if ACCEL else 1024
UPDATE = UpdateConfig(
    learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, num_minibatches=1, num_microbatches=1
)


# Run options every process applies to ``CONFIGS``: the compute dtype (parameters stay float32;
# PyTorch autocasts to the same dtype) and a factor on the batch (an accelerator is filled only
# by more sequences than a CPU step takes).
OPTS = {"dtype": "float32", "batch_scale": 1}


def config_of(name: str):
    """``CONFIGS[name]`` under the run options ``OPTS``: (model config, batch, length)."""
    c, batch, length = CONFIGS[name]
    return dataclasses.replace(c, dtype=OPTS["dtype"]), batch * OPTS["batch_scale"], length


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def model_flops(c: TransformerConfig, batch: int, length: int) -> float:
    h, d = c.hidden_size, c.head_dim
    per_layer = h * d * (c.num_heads + 2 * c.num_kv_heads) + c.num_heads * d * h
    per_layer += 3 * h * c.intermediate_size
    matmul_params = c.num_layers * per_layer + c.vocab_size * h  # + lm head
    dense = 6.0 * matmul_params * batch * length
    attention = 12.0 * c.num_layers * length * length * c.num_heads * d * batch
    return dense + attention


def make_batch(c: TransformerConfig, batch: int, length: int, seed=0) -> UpdateBatch:
    rng = np.random.default_rng(seed)
    k = 2 if batch % 2 == 0 else 1
    g = batch // k
    tokens = rng.integers(1, c.vocab_size, (batch, length)).astype(np.int32)
    response = np.zeros((batch, length), bool)
    response[:, length // 4 :] = True
    passed = np.zeros((g, k), bool)
    passed[:, 0] = True
    return UpdateBatch(
        tokens=tokens,
        positions=np.tile(np.arange(length, dtype=np.int32), (batch, 1)),
        attention_mask=np.ones((batch, length), bool),
        response_mask=response,
        old_logprobs=np.where(response, -8.0, 0.0).astype(np.float32),
        rewards=passed.astype(np.float32),
        passed=passed,
        cheat=np.zeros((g, k), bool),
        tier=np.ones((g, k), np.int32),
        rank=np.ones((g, k), np.int32),
        valid=np.ones((g, k), bool),
        graded=np.ones((g,), bool),
    )


def best_time(fn, reps: int, clock=time.perf_counter) -> float:
    """The shortest of ``reps`` calls of ``fn`` (after one warm-up) on ``clock``."""
    fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


_GEMM = jax.jit(lambda x: x @ x)


def jax_peak(n=0, reps=15, clock=time.perf_counter, dtype="float32") -> float:
    """The fastest of ``reps`` jitted GEMMs of random ``dtype`` values at JAX's default matmul
    precision (a peak: one slow repeat must not lower it), FLOP per second of ``clock``
    (``time.process_time``: per CPU-second of this process). ``n`` defaults to ``PEAK_N``."""
    n = n or PEAK_N
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
    return 2 * n**3 / best_time(lambda: _GEMM(a).block_until_ready(), reps, clock)


def torch_device():
    """PyTorch's side runs where JAX's does: the GPU when JAX found one (TF32 matmuls for
    float32, JAX's default precision there)."""
    import torch

    if ACCEL and torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        return torch.device("cuda")
    return torch.device("cpu")


def _torch_sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def torch_peak(n=0, reps=15, clock=time.perf_counter, dtype="float32") -> float:
    import torch

    n = n or PEAK_N
    dev = torch_device()
    a = torch.randn((n, n), device=dev, dtype=getattr(torch, dtype))

    def mm():
        torch.mm(a, a)
        _torch_sync(dev)

    return 2 * n**3 / best_time(mm, reps, clock)


def interleaved(steps_by_impl: dict, steps: int, peaks: dict | None = None) -> dict:
    """Per impl, the seconds of each round's step, timed in rounds that run every impl once
    (after one warm-up each), so a load change during the run hits all sides alike. With
    ``peaks`` ({name: peak function of a clock}), each round also measures every peak (FLOP/s)
    right after the steps, under the same load; they come back under their names. Each entry
    has a twin ``"<name> cpu"`` on this process's CPU time (``time.process_time``, all its
    threads): seconds a step kept the cores busy, and the peak per CPU-second, which a
    machine's other load does not stretch the way it stretches wall-clock time."""
    for k, fn in steps_by_impl.items():
        fn()
        progress(f"warm-up step of {k} done")
    names = list(steps_by_impl) + list(peaks or {})
    times = {k: [] for k in names + [f"{k} cpu" for k in names]}
    for _ in range(steps):
        for k, fn in steps_by_impl.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            times[f"{k} cpu"].append(time.process_time() - c)
            times[k].append(time.perf_counter() - t)
        for k, fn in (peaks or {}).items():
            times[k].append(fn(time.perf_counter))
            times[f"{k} cpu"].append(fn(time.process_time))
    return times


def _serve(conn, impl: str, name: str, chunk: int, opts: dict) -> None:
    """One implementation's process: builds its step for config ``name`` and sends its info,
    then answers the driver's ``"step"`` (wall and CPU seconds of one step) and ``"peak"`` (this
    process's GEMM peak, per wall and per CPU second) until ``"stop"``."""
    OPTS.update(opts)
    c, batch, length = config_of(name)
    info = {"compile_s": None, "temp_mb": None, "flops": model_flops(c, batch, length)}
    if impl == "torch":
        import torch

        torch.set_num_threads(os.cpu_count())
        fn, peak = bench_torch(c, batch, length), functools.partial(torch_peak, dtype=c.dtype)
    else:
        config, update_config = c, UPDATE
        if impl == "jax-scan":
            config = dataclasses.replace(c, scan_layers=True)
            update_config = dataclasses.replace(UPDATE, logits_chunk_size=chunk)
        compiled = []
        fn, info["compile_s"], info["temp_mb"] = bench_jax(
            config, batch, length, update_config, compiled_out=compiled
        )
        info["flops"] = xla_flops(compiled[0])
        peak = functools.partial(jax_peak, dtype=c.dtype)
    fn()  # warm-up
    conn.send(info)
    while (cmd := conn.recv()) != "stop":
        if cmd == "step":
            t, c0 = time.perf_counter(), time.process_time()
            fn()
            conn.send((time.perf_counter() - t, time.process_time() - c0))
        else:
            conn.send(
                (peak(reps=5, clock=time.perf_counter), peak(reps=5, clock=time.process_time))
            )


def interleaved_processes(name: str, impls, steps: int, chunk: int) -> tuple[dict, dict]:
    """``interleaved`` with every implementation in a process of its own (``_serve``): per
    round one step of each, then each process's GEMM peak (``"peak <impl>"``). Returns (times,
    {impl: info})."""
    ctx = multiprocessing.get_context("spawn")
    procs = {}
    try:
        for impl in impls:  # one at a time: a compile does not overlap another's
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(theirs, impl, name, chunk, dict(OPTS)), daemon=True
            )
            proc.start()
            procs[impl] = (proc, ours)
            procs[impl] += (ours.recv(),)
        names = list(impls) + [f"peak {i}" for i in impls]
        times = {k: [] for k in names + [f"{k} cpu" for k in names]}
        for _ in range(steps):
            for cmd, key in (("step", "{}"), ("peak", "peak {}")):
                for impl, (_, conn, _) in procs.items():
                    conn.send(cmd)
                    wall, cpu = conn.recv()
                    times[key.format(impl)].append(wall)
                    times[key.format(impl) + " cpu"].append(cpu)
        return times, {impl: info for impl, (_, _, info) in procs.items()}
    finally:
        for proc, conn, *_ in procs.values():
            try:
                conn.send("stop")
            except OSError:
                pass
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def xla_flops(compiled) -> float:
    """FLOPs of one call of a compiled program, as XLA's cost analysis counts them (dots,
    elementwise ops and reductions; a while loop's body once, whatever its trip count)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per partition
        cost = cost[0]
    return float(cost.get("flops", float("nan")))


def bench_jax(c, batch, length, update_config=UPDATE, compiled_out=None):
    """(step function, compile seconds, temp MB of the compiled step); ``compiled_out`` (a
    list) receives the compiled program."""
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state = create_train_state(c, update_config, mesh, seed=0)
    update = jit_update(c, update_config, mesh)
    data = shard_batch(make_batch(c, batch, length), mesh)
    t0 = time.perf_counter()
    compiled = update.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    progress(f"compiled the update in {compile_s:.1f} s")
    mem = compiled.memory_analysis()
    temp_mb = getattr(mem, "temp_size_in_bytes", float("nan")) / 2**20
    if compiled_out is not None:
        compiled_out.append(compiled)
    box = {"state": state}

    def step():
        box["state"], m = compiled(box["state"], data)
        jax.block_until_ready(m)

    return step, compile_s, temp_mb


def _compile_abstract(c, batch, length, update_config):
    """The update compiled for an abstract train state (nothing allocated); its seconds."""
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state = jax.eval_shape(lambda: create_train_state(c, update_config, mesh, seed=0))
    data = shard_batch(make_batch(c, batch, length), mesh)
    t0 = time.perf_counter()
    compiled = jit_update(c, update_config, mesh).lower(state, data).compile()
    return compiled, time.perf_counter() - t0


def compile_seconds(c, batch, length, update_config=UPDATE) -> float:
    return _compile_abstract(c, batch, length, update_config)[1]


def logits_memory_table(chunk: int, vocabs, batch=8, length=256):
    """XLA's temporary buffers of the compiled update with whole-sequence logits and with
    logits in chunks of ``chunk`` tokens, same model otherwise (the small config's widths, 2
    scanned layers), per vocabulary size: what ``logits_chunk_size`` saves, next to the size
    of one whole ``[tokens, vocab]`` float32 buffer. Compiled only (nothing runs)."""
    base, _, _ = CONFIGS["small"]
    tokens = batch * length
    print(
        f"\nlogits memory: temp MB of the compiled update, {tokens} tokens, hidden "
        f"{base.hidden_size}, 2 scanned layers (compile only)"
    )
    header = (
        f"{'vocab':>7} {'[T, V] f32 MB':>13} {'whole MB':>9} {f'chunk {chunk} MB':>12} "
        f"{'saved MB':>9}"
    )
    print(header)
    print("-" * len(header))
    for v in vocabs:
        c = dataclasses.replace(base, vocab_size=v, num_layers=2, scan_layers=True)
        mem = []
        for size in (0, chunk):
            compiled, _ = _compile_abstract(
                c, batch, length, dataclasses.replace(UPDATE, logits_chunk_size=size)
            )
            mem.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
        print(
            f"{v:7d} {tokens * v * 4 / 2**20:13.1f} {mem[0]:9.1f} {mem[1]:12.1f} "
            f"{mem[0] - mem[1]:9.1f}",
            flush=True,
        )


def bench_torch(c, batch, length):
    """The PyTorch step function."""
    import torch
    import transformers

    torch.manual_seed(0)
    dev = torch_device()
    model = (
        transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                vocab_size=c.vocab_size,
                hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads,
                rope_theta=c.rope_theta,
                tie_word_embeddings=c.tie_embeddings,
            ),
        )
        .float()
        .train()
        .to(dev)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=UPDATE.learning_rate, weight_decay=0.01)
    b = make_batch(c, batch, length)
    tokens = torch.from_numpy(b.tokens.astype(np.int64)).to(dev)
    mask = torch.from_numpy(b.response_mask[:, 1:]).float().to(dev)
    old = torch.from_numpy(b.old_logprobs[:, 1:]).to(dev)
    adv = torch.from_numpy(np.where(b.passed.reshape(-1), 0.5, -0.5).astype(np.float32))[:, None]
    adv = adv.to(dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=c.dtype == "bfloat16")

    def step():
        with autocast:
            logits = model(input_ids=tokens).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
        ratio = torch.exp(logp - old)
        per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28))
        loss = (per_tok * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), UPDATE.max_grad_norm)
        opt.step()
        _torch_sync(dev)

    return step


def profile_update(name: str, reps: int = 2) -> None:
    """Per-op profile of the per-layer update of config ``name`` (see xla_profile)."""
    import xla_profile

    c, batch, length = config_of(name)
    compiled = []
    step, _, _ = bench_jax(c, batch, length, compiled_out=compiled)
    step()
    t = time.perf_counter()
    secs, count = xla_profile.trace_ops(step, reps)
    wall = (time.perf_counter() - t) / reps
    peak = jax_peak(reps=5, dtype=c.dtype)
    result = xla_profile.breakdown(secs, count, compiled[0].as_text())
    print(
        f"\nprofile: {name} update (per-layer), {reps} traced steps, {wall:.3f} s per step "
        f"traced; GEMM peak {peak / 1e9:.1f} GFLOP/s; {_load()}"
    )
    xla_profile.print_breakdown(result, peak)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="small,100m", help="'' for none")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=64, help="logits_chunk_size of jax-scan")
    parser.add_argument("--depths", default="2,4,8", help="layers for the compile table ('' off)")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every implementation in this one process (default: a process each)",
    )
    parser.add_argument("--no-scan", action="store_true", help="no jax-scan row")
    parser.add_argument(
        "--logits-vocabs",
        default="4096,32000,151936",
        help="vocabularies of the logits-memory table ('' off)",
    )
    parser.add_argument(
        "--profile",
        default="",
        help="config whose update gets a per-op profile (dots / elementwise / layout copies)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="compute dtype of both sides (parameters stay float32; PyTorch autocasts)",
    )
    parser.add_argument(
        "--batch-scale", type=int, default=1, help="multiply every config's batch by this"
    )
    args = parser.parse_args()
    OPTS.update(dtype=args.dtype, batch_scale=args.batch_scale)
    # A run stopped by a time limit (``timeout`` sends SIGTERM) prints where every thread was.
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    backend = jax.default_backend()
    print(f"start: {_load()}; malloc keep_heap {'on' if KEEP_HEAP else 'off'}")
    progress(f"jax backend {jax.default_backend()}; measuring the GEMM peak")
    peak_j = jax_peak(dtype=args.dtype)
    have_torch = not args.no_torch
    if have_torch:
        try:
            import torch

            if args.in_process:
                torch.set_num_threads(os.cpu_count())
                peak_t = torch_peak(dtype=args.dtype)
            else:
                del torch  # measured in its own process
        except ImportError:
            have_torch = False
    progress("peaks measured")
    print(
        f"backend={backend} devices={jax.devices()[0].device_kind!r} cpus={os.cpu_count()} "
        f"dtype={args.dtype} batch x{args.batch_scale}"
    )
    print(
        f"matmul peak at the start: jax {peak_j / 1e9:.1f} GFLOP/s"
        + (f", torch {peak_t / 1e9:.1f} GFLOP/s" if have_torch and args.in_process else "")
        + " (each row's MFU uses the peaks measured in its own rounds"
        + (", in this one process)" if args.in_process else ", in the row's own process)")
    )
    header = (
        f"{'config':8} {'params':>8} {'tokens':>7} {'impl':8} {'step s':>8} {'tok/s':>9} "
        f"{'GFLOP':>7} {'GFLOP/s':>8} {'peak':>7} {'MFU':>6} {'cores':>5} {'MFU cpu':>7} "
        f"{'compile s':>9} {'temp MB':>8} {'vs torch':>8}"
    )
    print(header)
    print("-" * len(header))
    scan_update = dataclasses.replace(UPDATE, logits_chunk_size=args.chunk)
    configs = [name for name in args.configs.split(",") if name]
    peaks = {"peak jax": lambda clock: jax_peak(reps=5, clock=clock, dtype=args.dtype)}
    if have_torch:
        peaks["peak torch"] = lambda clock: torch_peak(reps=5, clock=clock, dtype=args.dtype)
    for name in configs:
        c, batch, length = config_of(name)
        tokens = batch * length
        impls = ["jax"] + ([] if args.no_scan else ["jax-scan"]) + (["torch"] if have_torch else [])
        if args.in_process:
            fns, info, compiled = {}, {}, []
            progress(f"{name}: compiling jax")
            fns["jax"], *info["jax"] = bench_jax(c, batch, length, compiled_out=compiled)
            if not args.no_scan:
                progress(f"{name}: compiling jax-scan")
                fns["jax-scan"], *info["jax-scan"] = bench_jax(
                    dataclasses.replace(c, scan_layers=True), batch, length, scan_update
                )
            flops_xla = xla_flops(compiled[0])
            if have_torch:
                progress(f"{name}: building torch")
                fns["torch"], info["torch"] = bench_torch(c, batch, length), (None, None)
            progress(f"{name}: {args.steps} interleaved rounds")
            times = interleaved(fns, args.steps, peaks)
            for impl in impls:
                key = "peak torch" if impl == "torch" else "peak jax"
                times[f"peak {impl}"], times[f"peak {impl} cpu"] = times[key], times[key + " cpu"]
        else:
            progress(f"{name}: a process per implementation, {args.steps} interleaved rounds")
            times, infos = interleaved_processes(name, impls, args.steps, args.chunk)
            info = {i: (infos[i]["compile_s"], infos[i]["temp_mb"]) for i in impls}
            flops_xla = infos["jax"]["flops"]
        # XLA's count of the per-layer program (the scanned one counts its loop body once);
        # the model-FLOPs formula for PyTorch, which has no such count.
        med = {k: statistics.median(times[k]) for k in impls}
        t_torch = med.get("torch")
        for impl in impls:
            # On a GPU, XLA's count leaves out the dots it hands to cuBLAS (custom calls): every
            # row there uses the model-FLOPs formula.
            flops = model_flops(c, batch, length) if impl == "torch" or ACCEL else flops_xla
            peak_key = f"peak {impl}"
            mfu = statistics.median(flops / t / p for t, p in zip(times[impl], times[peak_key]))
            # Per CPU-second: the step's FLOPs per second its threads ran, against the GEMM's.
            mfu_cpu = statistics.median(
                flops / t / p for t, p in zip(times[f"{impl} cpu"], times[f"{peak_key} cpu"])
            )
            cores = statistics.median(times[f"{impl} cpu"]) / med[impl]
            comp, mem = info[impl]
            ratio = f"{med[impl] / t_torch:7.2f}x" if t_torch is not None else ""
            comp_s = f"{comp:9.1f}" if comp is not None else f"{'':9}"
            mem_s = f"{mem:8.1f}" if mem is not None else f"{'':8}"
            print(
                f"{name:8} {c.num_params / 1e6:7.1f}M {tokens:7d} {impl:8} {med[impl]:8.4f} "
                f"{tokens / med[impl]:9.0f} {flops / 1e9:7.1f} {flops / med[impl] / 1e9:8.1f} "
                f"{statistics.median(times[peak_key]) / 1e9:7.1f} {mfu:6.1%} {cores:5.2f} "
                f"{mfu_cpu:7.1%} {comp_s} "
                f"{mem_s} {ratio:>8}",
                flush=True,
            )
        print(
            f"  {name}: XLA counts {flops_xla / 1e9:.1f} GFLOP per step, the model-FLOPs formula "
            f"{model_flops(c, batch, length) / 1e9:.1f}"
            + (
                " (every row uses the formula here: XLA's count leaves out cuBLAS dots)"
                if ACCEL
                else ""
            )
            + f"; peak = median of the rounds' GEMM "
            f"peaks ({statistics.median(times['peak jax cpu']) / 1e9:.1f} GFLOP per CPU-second "
            f"for jax); cores = CPU seconds / wall seconds of a step; {_load()}",
            flush=True,
        )
    if args.profile:
        profile_update(args.profile)
    if args.depths and configs:
        depths = [int(d) for d in args.depths.split(",")]
        print("\ncompile seconds of the update step per depth (same widths as the config)")
        print(f"{'config':8} {'layout':9} " + " ".join(f"{f'L={d}':>7}" for d in depths))
        for name in configs:
            c, batch, length = config_of(name)
            for layout, scan in (("unrolled", False), ("scan", True)):
                secs = [
                    compile_seconds(
                        dataclasses.replace(c, num_layers=d, scan_layers=scan),
                        batch,
                        length,
                        scan_update if scan else UPDATE,
                    )
                    for d in depths
                ]
                print(f"{name:8} {layout:9} " + " ".join(f"{x:7.1f}" for x in secs), flush=True)
    if args.logits_vocabs:
        logits_memory_table(args.chunk, [int(v) for v in args.logits_vocabs.split(",")])
    print(f"end: {_load()}")


if __name__ == "__main__":
    main()
