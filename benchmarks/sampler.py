"""Benchmark: the embedded JAX sampler against Hugging Face `transformers` `generate`, same weights.

Run: `make bench` (or `.venv/bin/python benchmarks/sampler.py [--quick]`). Needs the `parity`
extra (CPU torch + transformers), which `make setup` installs.

Both engines decode from the same random Qwen2-style model (exported with `save_hf_safetensors`
and loaded by `transformers`), the same prompts, the same number of new tokens (no early stop),
in float32 on the same CPU, one after the other in this process. Tables:

1. greedy rows per batch size: new tokens per second for each engine (median of `--repeats`
   timed runs after one warm-up that includes compilation), their ratio, and the fraction of
   greedy tokens on which the engines agree (random weights give near-ties, so a few late
   divergences are expected in fp32). Compile time of the JAX sampler is reported separately
   (paid once per shape bucket).
2. the RL-shaped workload: 16 prompts x 8 samples, 256-token prompts, 96 new tokens, T=1
   (`SamplingParams(n=8)` against `generate(num_return_sequences=8, do_sample=True, top_k=0)`).
3. a 4-turn episode (16 episodes; each turn 64 new tokens then a 32-token observation) through
   the JAX sampler with and without `prefix_cache` (re-prefilling the whole history each turn).
4. with `--tables ...,sglang`: the embedded sampler against a real SGLang server from
   `.venv-sglang` on the same model and the greedy / RL-shaped workloads (tokens/s both ways).
5. with `--tables ...,precision` (`--tables precision` alone skips the rest): the embedded
   sampler in each of `--precisions` (float32, bfloat16, int8, fp8: `Sampler(precision=...)`;
   `PRECISION:KV` adds a KV-cache dtype, e.g. `float32:int8` for float32 weights with an int8
   KV cache, `Sampler(kv_cache_dtype=...)`) on the RL-shaped workload, timed in interleaved
   rounds (the order alternating), with tokens per second against float32, the weights'
   bytes, the weight conversion of one sync, and how far each precision's log-probs of its own
   samples are from the float32 model's (mean and max |difference|, token-mean k3).

With two or more batch sizes the greedy table is followed by their scaling measured interleaved:
`--scaling-rounds` rounds, each calling the one-device sampler once per batch size (the order
alternating), so a slow phase of the machine hits every batch size alike. It prints each batch
size's median tokens per second against the smallest's, and the spread of the per-round ratios:
the table above times all repeats of one batch size before the next, and a drift of the
machine's speed between them moves its ratio. The same rounds time the decode's products alone
(projections and LM head chained as in the model, nothing else) at each batch size: their
FLOP/s against the GEMM peak, and the ratio the sampler would reach if everything else were free.

With `--profile`, the one-device sampler's greedy call at each batch size also runs under
`jax.profiler`, and its ops are summed by category (dots with their FLOP/s, elementwise, data
movement; `benchmarks/xla_profile.py`) with the top elementwise and data-movement ops.

The machine's load average (`os.getloadavg`) is printed before and after: on a shared machine
PyTorch slows down more than XLA, so compare ratios from one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import statistics
import sys
import tempfile
import time

# Measure the checkout this script lives in (run as a script, sys.path[0] is benchmarks/ and
# the venv's editable install may point at another checkout).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _profile_greedy(model, cfg, batches, args, params, dump_dir: str) -> None:
    """``--profile``: the one-device sampler's greedy call at each batch size under
    ``jax.profiler``, its ops summed by category against the GEMM peak, and the top
    elementwise and data-movement ops."""
    import glob
    import shutil

    import jax
    import xla_profile
    from rl_step import gemm_peak

    from gagar_jax.rollout.sampler import Sampler

    peak = gemm_peak()
    rng = np.random.default_rng(1)
    pattern = os.path.join(dump_dir, "*after_optimizations.txt")
    for b in batches:
        sampler = Sampler(
            model,
            batch_buckets=(b,),
            prompt_buckets=(args.prompt_len,),
            new_token_buckets=(args.new_tokens,),
        )
        prompts = rng.integers(1, cfg.vocab_size, (b, args.prompt_len)).tolist()
        before = set(glob.glob(pattern))
        jax.clear_caches()  # the greedy table compiled this program: compile it again
        sampler.generate(prompts, params)  # compiles: XLA writes the program's HLO
        new = set(glob.glob(pattern)) - before
        if not new:
            print(f"\n[profile] batch {b}: no HLO was written to {dump_dir}; no profile")
            continue
        with open(max(new, key=os.path.getsize)) as f:
            hlo = f.read()
        t0 = time.perf_counter()
        sampler.generate(prompts, params)
        wall = time.perf_counter() - t0
        run = functools.partial(sampler.generate, prompts, params)
        secs, count = xla_profile.trace_ops(run, reps=2)
        result = xla_profile.breakdown(secs, count, hlo)
        print(
            f"\n[profile] batch {b}: {wall * 1e3:.0f} ms per call untraced "
            f"({b * args.new_tokens / wall:.0f} tok/s); GEMM peak {peak / 1e9:.0f} GFLOP/s; "
            f"{_load()}"
        )
        xla_profile.print_breakdown(result, peak, top=6)
        rest = [o for o in result["ops"] if o[2].category in ("elementwise", "layout")][:6]
        print("top elementwise and data-movement ops (s/run, executions, result shape, source):")
        for sec, _, info, n in rest:
            print(f"  {sec:7.4f} {n:5.0f}x {info.shape[:32]:32} {info.source.split('/')[-1][:40]}")
    shutil.rmtree(dump_dir, ignore_errors=True)


def _jax_labels(mesh) -> list[str]:
    """The JAX columns: the one-device sampler, and with ``mesh`` the same sampler over it."""
    return ["jax"] + ([] if mesh is None else [f"jax dp{mesh.devices.size}"])


def _jax_engines(model, mesh, **kw) -> dict:
    """{label: Sampler} for the columns of `_jax_labels`."""
    from gagar_jax.rollout.sampler import Sampler

    return {
        label: Sampler(model, mesh=None if label == "jax" else mesh, **kw)
        for label in _jax_labels(mesh)
    }


def decode_products(cfg, rows: int, steps: int):
    """A jitted call of ``steps`` decode steps' worth of the model's products only, for
    ``rows`` rows: per layer the stacked q/k/v projection, the output projection, gate and up,
    down, then the LM head, each fed by the one before as in the model (the residual adds and
    the gate's product chain them; no attention, norm, RoPE or sampling). Random weights of
    ``cfg``'s shapes. Returns (call that blocks until done, FLOPs of one call, the compiled
    program's HLO text)."""
    import jax
    import jax.numpy as jnp

    e, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    q, kv, i = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    shapes = [(e, q + 2 * kv), (q, e), (e, i), (e, i), (i, e)]
    keys = iter(jax.random.split(jax.random.key(0), len(shapes) * cfg.num_layers + 2))
    layers = [
        [0.02 * jax.random.normal(next(keys), s, jnp.float32) for s in shapes]
        for _ in range(cfg.num_layers)
    ]
    head = 0.02 * jax.random.normal(next(keys), (e, v), jnp.float32)
    x0 = jax.random.normal(next(keys), (rows, e), jnp.float32)

    @jax.jit
    def run(x, layers, head):
        def step(_, x):
            for w_qkv, w_o, w_g, w_u, w_d in layers:
                x = x + (x @ w_qkv)[:, :q] @ w_o
                x = x + ((x @ w_g) * (x @ w_u)) @ w_d
            return x + 1e-3 * (x @ head)[:, :e]

        return jax.lax.fori_loop(0, steps, step, x)

    compiled = run.lower(x0, layers, head).compile()  # once: the calls and the HLO are its
    flops = 2 * rows * steps * (cfg.num_layers * sum(a * b for a, b in shapes) + e * v)
    return (lambda: compiled(x0, layers, head).block_until_ready()), flops, compiled.as_text()


def _interleaved_scaling(sampler, prompts_by_batch, params, args, cfg) -> None:
    """The one-device sampler's greedy throughput per batch size, the batch sizes interleaved
    round by round (the order alternating): each batch size's median tokens per second against
    the smallest batch size's, and the min / median / max of the per-round ratios.

    Each round also times the decode's products alone at each batch size
    (:func:`decode_products`, as many steps as the calls decode): the ratio the sampler would
    reach if everything but its projections and LM head cost nothing, and their FLOP/s against
    the machine's GEMM peak."""
    from rl_step import gemm_peak

    batches = sorted(prompts_by_batch)
    steps = args.new_tokens - 1  # the first token comes from the prefill
    products = {b: decode_products(cfg, b, steps) for b in batches}
    times = {b: [] for b in batches}
    ptimes = {b: [] for b in batches}
    start = _load()
    for r in range(args.scaling_rounds):
        for b in batches if r % 2 == 0 else batches[::-1]:
            t0 = time.perf_counter()
            sampler.generate(prompts_by_batch[b], params)
            times[b].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            products[b][0]()
            ptimes[b].append(time.perf_counter() - t0)
    peak = gemm_peak()
    small = batches[0]
    print(
        f"\n[greedy scaling] jax, one device: {args.scaling_rounds} interleaved rounds "
        f"(start: {start}; end: {_load()}); products alone: the decode's {steps} steps of "
        f"projections and LM head only; GEMM peak {peak / 1e9:.0f} GFLOP/s"
    )
    head = (
        f"{'batch':>5} | {'tok/s':>8} | {'vs batch ' + str(small):>13} | "
        f"{'per-round min / median / max':>28} | {'products ms/step':>16} | "
        f"{'GFLOP/s':>7} | {'of peak':>7} | {'vs batch ' + str(small):>13}"
    )
    print(head)
    print("-" * len(head))
    tps_small = small * args.new_tokens / statistics.median(times[small])
    p_small = small / statistics.median(ptimes[small])
    for b in batches:
        tps = b * args.new_tokens / statistics.median(times[b])
        rounds = sorted(
            (b / t) / (small / ts) for t, ts in zip(times[b], times[small], strict=True)
        )
        spread = " / ".join(f"{x:.2f}" for x in (rounds[0], statistics.median(rounds), rounds[-1]))
        pt = statistics.median(ptimes[b])
        gflops = products[b][1] / pt / 1e9
        print(
            f"{b:>5} | {tps:>8.0f} | {tps / tps_small:>12.2f}x | {spread:>28} | "
            f"{pt / steps * 1e3:>16.3f} | {gflops:>7.1f} | {gflops * 1e9 / peak:>6.1%} | "
            f"{(b / pt) / p_small:>12.2f}x",
            flush=True,
        )


def _median_time(fn, repeats):
    times = []
    out = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--tables",
        default="greedy,rl,multiturn",
        help="comma-separated: greedy, rl, multiturn, sglang (a real SGLang server), "
        "precision (the sampler in each of --precisions)",
    )
    ap.add_argument(
        "--precisions",
        default="float32,bfloat16,int8,float32:int8,bfloat16:int8",
        help="the precision table's sampler precisions (float32 first: the baseline), each "
        "PRECISION or PRECISION:KV_CACHE_DTYPE (float32:int8: an int8 KV cache)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens (CI smoke)")
    ap.add_argument(
        "--scaling-rounds",
        type=int,
        default=9,
        help="rounds of the interleaved batch-scaling measurement after the greedy table (0: none)",
    )
    ap.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        help="N > 1: the greedy and RL-shaped tables add a column for the sampler with its rows "
        "split over N devices (`Sampler(mesh=...)`; on CPU, N host devices via XLA_FLAGS)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="per-op profile of the one-device sampler's greedy call at each batch size",
    )
    args = ap.parse_args()
    tables = set(args.tables.split(","))
    dump_dir = None
    if args.profile:  # before jax is imported: the compiled programs' HLO, to name the ops
        dump_dir = tempfile.mkdtemp(prefix="sampler-hlo-")
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text "
            "--xla_dump_hlo_module_re=.*generate_program.*"
        ).strip()
    dp = args.data_parallel
    if dp < 1:
        ap.error(f"--data-parallel must be >= 1, got {dp}")
    if dp > 1:  # before jax is imported: N host (CPU) devices; other platforms keep theirs
        flags = re.sub(
            r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
        )
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={dp}".strip()

    import jax
    import torch
    import transformers

    from gagar_jax.models import TransformerConfig, create_model, save_hf_safetensors
    from gagar_jax.rollout import SamplingParams
    from gagar_jax.rollout.sampler import Sampler

    if args.quick:
        cfg = TransformerConfig(
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            rope_theta=10000.0,
        )
        args.new_tokens, args.repeats = 16, 1
        rl = dict(prompts=4, n=4, prompt_len=32, new=16)
        mt = dict(episodes=4, turns=4, new=16, obs=8, prompt_len=32)
    else:  # a small Qwen2-shaped model
        cfg = TransformerConfig(
            vocab_size=4096,
            hidden_size=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=704,
            rope_theta=10000.0,
        )
        rl = dict(prompts=16, n=8, prompt_len=256, new=96)
        mt = dict(episodes=16, turns=4, new=64, obs=32, prompt_len=128)
    batches = [int(b) for b in args.batches.split(",")]
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)

    model = create_model(cfg, seed=0)
    with tempfile.TemporaryDirectory() as d:
        save_hf_safetensors(model, cfg, d)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf.eval()
    # transformers runs where JAX does: the GPU when JAX found one (TF32 matmuls for float32,
    # JAX's default precision there).
    hf_dev = torch.device("cpu")
    if jax.default_backend() == "gpu" and torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        hf_dev = torch.device("cuda")
    hf.to(hf_dev)
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None

    mesh = None
    if dp > 1 and len(jax.local_devices()) < dp:  # e.g. one accelerator: no such column
        print(
            f"--data-parallel {dp}: only {len(jax.local_devices())} "
            f"{jax.devices()[0].platform} device(s) here, so no data-parallel column"
        )
    elif dp > 1:
        mesh = jax.sharding.Mesh(np.array(jax.local_devices()[:dp]), ("data",))

    rng = np.random.default_rng(0)
    print(
        f"model: {cfg.num_params / 1e6:.1f}M params (hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers, vocab {cfg.vocab_size}), float32; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, torch {torch.__version__} ({threads} threads), "
        f"transformers {transformers.__version__}"
    )
    if mesh is not None:
        print(f"jax dp{dp}: the sampler's rows split over {dp} {jax.devices()[0].platform} devices")
    print(f"start: {_load()}")

    if "greedy" in tables:
        kw = dict(
            batch_buckets=tuple(sorted(set(batches))),
            prompt_buckets=(args.prompt_len,),
            new_token_buckets=(args.new_tokens,),
        )
        engines = _jax_engines(model, mesh, **kw)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
        print(f"\n[greedy] prompt {args.prompt_len} tokens, {args.new_tokens} new tokens")
        head = f"{'batch':>5} | " + "".join(
            f"{name + ' tok/s':>14} | {name + '/hf':>10} | " for name in engines
        )
        head += f"{'hf tok/s':>10} | {'agree':>6} | {'jax compile s':>13}"
        print(head)
        print("-" * len(head))
        tps_by_batch, cpu_by_batch, prompts_by_batch = {}, {}, {}
        for b in batches:
            prompts = rng.integers(1, cfg.vocab_size, (b, args.prompt_len)).tolist()
            prompts_by_batch[b] = prompts
            compile_s = []
            for sampler in engines.values():
                t0 = time.perf_counter()
                sampler.generate(prompts, params)  # compiles this bucket
                compile_s.append(time.perf_counter() - t0)
            ids = torch.tensor(prompts, device=hf_dev)
            kw = dict(
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
            )
            with torch.inference_mode():
                hf.generate(ids, **kw)  # warm-up
                # Interleave the sides so load changes hit them alike.
                jt = {name: [] for name in engines}
                jc = {name: [] for name in engines}
                ht = []
                for _ in range(args.repeats):
                    for name, sampler in engines.items():
                        t0, c0 = time.perf_counter(), time.process_time()
                        out = sampler.generate(prompts, params)
                        jc[name].append(time.process_time() - c0)
                        jt[name].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    gen = hf.generate(ids, **kw)
                    if hf_dev.type == "cuda":
                        torch.cuda.synchronize()
                    ht.append(time.perf_counter() - t0)
            jax_tokens = np.array([row[0].tokens for row in out])
            hf_tokens = gen[:, args.prompt_len :].cpu().numpy()
            n_tok = b * args.new_tokens
            hf_tps = n_tok / statistics.median(ht)
            tps_by_batch[b] = {name: n_tok / statistics.median(t) for name, t in jt.items()}
            # Per CPU-second of this process (all its threads): what the machine's other load
            # does not stretch; cores = CPU seconds / wall seconds of a call.
            cpu_by_batch[b] = {
                name: (n_tok / statistics.median(c), statistics.median(c) / statistics.median(t))
                for (name, c), t in zip(jc.items(), jt.values())
            }
            agree = float((jax_tokens == hf_tokens).mean())
            row = f"{b:>5} | " + "".join(
                f"{tps:>14.0f} | {tps / hf_tps:>10.2f} | " for tps in tps_by_batch[b].values()
            )
            row += f"{hf_tps:>10.0f} | {agree:>6.3f} | "
            row += f"{' / '.join(f'{c:.1f}' for c in compile_s):>13}"
            print(row, flush=True)
        big, small = max(batches), min(batches)
        if big != small:
            print(
                f"throughput, batch {big} / batch {small}: "
                + ", ".join(
                    f"{name} {tps_by_batch[big][name] / tps_by_batch[small][name]:.2f}"
                    for name in engines
                ),
                flush=True,
            )
        print(
            "per CPU-second (load-robust; cores = CPU s / wall s): "
            + "; ".join(
                f"{name} "
                + ", ".join(
                    f"batch {b} {cpu_by_batch[b][name][0]:.0f} tok/cpu-s "
                    f"(cores {cpu_by_batch[b][name][1]:.2f})"
                    for b in batches
                )
                + (
                    f", batch {big} / batch {small} "
                    f"{cpu_by_batch[big][name][0] / cpu_by_batch[small][name][0]:.2f}"
                    if big != small
                    else ""
                )
                for name in engines
            ),
            flush=True,
        )
        if len(set(batches)) > 1 and args.scaling_rounds > 0:
            _interleaved_scaling(engines["jax"], prompts_by_batch, params, args, cfg)
        if dump_dir is not None:
            _profile_greedy(model, cfg, batches, args, params, dump_dir)

    if "rl" in tables:
        np_, n, pl, new = rl["prompts"], rl["n"], rl["prompt_len"], rl["new"]
        kw = dict(batch_buckets=(np_, np_ * n), prompt_buckets=(pl,), new_token_buckets=(new,))
        engines = _jax_engines(model, mesh, **kw)
        params = SamplingParams(n=n, temperature=1.0, max_tokens=new, seed=0)
        prompts = rng.integers(1, cfg.vocab_size, (np_, pl)).tolist()
        compile_s = []
        for sampler in engines.values():
            t0 = time.perf_counter()
            sampler.generate(prompts, params)
            compile_s.append(time.perf_counter() - t0)
        ids = torch.tensor(prompts, device=hf_dev)
        kw = dict(
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
        )
        with torch.inference_mode():
            hf.generate(ids, **kw)
            jt = {name: [] for name in engines}
            ht = []
            for _ in range(args.repeats):
                for name, sampler in engines.items():
                    t0 = time.perf_counter()
                    sampler.generate(prompts, params)
                    jt[name].append(time.perf_counter() - t0)
                ht.append(_median_time(lambda: hf.generate(ids, **kw), 1)[0])
        n_tok = np_ * n * new
        hf_tps = n_tok / statistics.median(ht)
        print(
            f"\n[RL-shaped] {np_} prompts x {n} samples, {pl}-token prompts, {new} new tokens, "
            "T=1 (HF: num_return_sequences)"
        )
        head = f"{'rows':>5} | " + "".join(
            f"{name + ' tok/s':>14} | {name + '/hf':>10} | " for name in engines
        )
        head += f"{'hf tok/s':>10} | {'jax compile s':>13}"
        print(head)
        print("-" * len(head))
        row = f"{np_ * n:>5} | " + "".join(
            f"{n_tok / statistics.median(t):>14.0f} | "
            f"{n_tok / statistics.median(t) / hf_tps:>10.2f} | "
            for t in jt.values()
        )
        row += f"{hf_tps:>10.0f} | {' / '.join(f'{c:.1f}' for c in compile_s):>13}"
        print(row, flush=True)

    if "multiturn" in tables:
        e, turns, new, obs, pl = (mt[k] for k in ("episodes", "turns", "new", "obs", "prompt_len"))
        total = pl + turns * (new + obs)
        pb = tuple(b for b in (32, 64, 128, 256, 512, 1024) if b < total) + (total,)
        params = SamplingParams(temperature=1.0, max_tokens=new, seed=1)
        print(
            f"\n[multi-turn] {e} episodes x {turns} turns: {pl}-token prompt, {new} new tokens "
            f"then a {obs}-token observation per turn (JAX sampler only)"
        )
        print(
            f"{'prefix_cache':>12} | {'episode s':>9} | {'tok/s':>8} | {'prefilled':>9} | "
            f"{'reused':>8} | {'1st run s (compiles)':>20}"
        )
        print("-" * 82)
        results = {}
        for keep in (0, 1):
            sampler = Sampler(
                model,
                batch_buckets=(e,),
                prompt_buckets=pb,
                new_token_buckets=(new,),
                prefix_cache=keep,
            )

            def episode(sampler=sampler):
                r = np.random.default_rng(5)
                ctx = r.integers(1, cfg.vocab_size, (e, pl)).tolist()
                for _ in range(turns):
                    out = sampler.generate(ctx, params)
                    ctx = [
                        c + s[0].tokens + r.integers(1, cfg.vocab_size, obs).tolist()
                        for c, s in zip(ctx, out)
                    ]
                return ctx

            t0 = time.perf_counter()
            episode()
            first = time.perf_counter() - t0
            before = dict(sampler.stats)
            t, _ = _median_time(episode, args.repeats)
            pre = (sampler.stats["prefill_tokens"] - before["prefill_tokens"]) // args.repeats
            reu = (sampler.stats["reused_tokens"] - before["reused_tokens"]) // args.repeats
            results[keep] = t
            print(
                f"{keep:>12} | {t:>9.2f} | {e * turns * new / t:>8.0f} | {pre:>9} | {reu:>8} | "
                f"{first:>20.1f}",
                flush=True,
            )
        print(f"speed-up of prefix_cache: {results[0] / results[1]:.2f}x")
    if "sglang" in tables:
        _sglang_table(model, cfg, batches, args, rl, rng, mesh)
    if "precision" in tables:
        _precision_table(model, cfg, args, rl, rng)

    print(f"\nend: {_load()}")


def _precision_table(model, cfg, args, rl, rng):
    """The embedded sampler in each precision on the RL-shaped workload (tokens/s against
    float32, interleaved rounds), its weights' bytes and sync conversion time, and its
    log-probs of its own samples against the float32 model's."""
    import jax
    from flax import nnx

    from gagar_jax.rollout import SamplingParams
    from gagar_jax.rollout.precision import weight_bytes
    from gagar_jax.rollout.sampler import Sampler, score_tokens

    precisions = args.precisions.split(",")
    np_, n, pl, new = rl["prompts"], rl["n"], rl["prompt_len"], rl["new"]
    kw = dict(batch_buckets=(np_, np_ * n), prompt_buckets=(pl,), new_token_buckets=(new,))

    def sampler_of(label):
        precision, _, kv = label.partition(":")
        return Sampler(model, precision=precision, kv_cache_dtype=kv or "auto", **kw)

    samplers = {p: sampler_of(p) for p in precisions}
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new, seed=0)
    prompts = rng.integers(1, cfg.vocab_size, (np_, pl)).tolist()
    print(
        f"\n[precision] {np_} prompts x {n} samples, {pl}-token prompts, {new} new tokens, "
        f"T=1; {max(args.repeats, 3)} interleaved rounds; {_load()}"
    )
    compile_s, outs = {}, {}
    for p, sampler in samplers.items():
        t0 = time.perf_counter()
        outs[p] = sampler.generate(prompts, params)
        compile_s[p] = time.perf_counter() - t0
    trainer = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    sync_s = {}
    for p, sampler in samplers.items():  # one weight sync: the conversion, once
        sampler.sync_weights(trainer, 1)
        jax.block_until_ready(sampler.state)
        t0 = time.perf_counter()
        sampler.sync_weights(trainer, 2)
        jax.block_until_ready(sampler.state)
        sync_s[p] = time.perf_counter() - t0
    times = {p: [] for p in precisions}
    for r in range(max(args.repeats, 3)):
        for p in precisions if r % 2 == 0 else precisions[::-1]:
            t0 = time.perf_counter()
            samplers[p].generate(prompts, params)
            times[p].append(time.perf_counter() - t0)
    n_tok = np_ * n * new
    tps = {p: n_tok / statistics.median(t) for p, t in times.items()}
    head = (
        f"{'precision:kv':>13} | {'tok/s':>8} | {'vs ' + precisions[0]:>10} | {'compile s':>9} | "
        f"{'weights MiB':>11} | {'sync s':>7} | {'mean |dlp|':>10} | {'max |dlp|':>9} | "
        f"{'k3':>9}"
    )
    print(head)
    print("-" * len(head))
    for p in precisions:
        diffs = []
        for prompt, row in zip(prompts, outs[p]):
            for smp in row[:2]:  # two samples of each prompt, scored by the float32 model
                ref = score_tokens(model, list(prompt) + smp.tokens, len(prompt), 1.0)
                diffs.append(ref - np.asarray(smp.logprobs))
        d = np.concatenate(diffs).astype(np.float64)
        k3 = np.mean(np.exp(d) - d - 1)
        print(
            f"{p:>13} | {tps[p]:>8.0f} | {tps[p] / tps[precisions[0]]:>10.2f} | "
            f"{compile_s[p]:>9.1f} | {weight_bytes(samplers[p].state) / 2**20:>11.2f} | "
            f"{sync_s[p]:>7.3f} | {np.abs(d).mean():>10.2e} | {np.abs(d).max():>9.2e} | "
            f"{k3:>9.2e}",
            flush=True,
        )


def _sglang_table(model, cfg, batches, args, rl, rng, mesh=None):
    """The embedded sampler against a real SGLang server (``.venv-sglang``) on the same model.

    The JAX model is exported with ``save_hf_safetensors`` next to a BPE tokenizer trained
    locally with the model's vocabulary size (SGLang needs one to start; token ids go in and come
    out as ids, ``ignore_eos``), served on CPU in float32 with the flags of
    ``gagar_jax.rollout.sglang_server``, and sent the same prompts as the greedy and RL-shaped
    tables through ``SGLangClient`` (all rows of a call in flight at once). Each row times the
    two engines alternately, after one warm-up call each. One server, killed at the end.
    """
    import shutil
    from pathlib import Path

    from gagar_jax.models import save_hf_safetensors
    from gagar_jax.rollout import SamplingParams
    from gagar_jax.rollout.sglang_client import SGLangClient
    from gagar_jax.rollout.sglang_server import SGLangServer, make_tiny_model

    np_, n, pl, new = rl["prompts"], rl["n"], rl["prompt_len"], rl["new"]
    rows = max(max(batches), np_ * n)
    workloads = [
        (
            f"greedy, batch {b}",
            rng.integers(1, cfg.vocab_size, (b, args.prompt_len)).tolist(),
            SamplingParams(temperature=0.0, max_tokens=args.new_tokens),
            b * args.new_tokens,
        )
        for b in batches
    ]
    workloads.append(
        (
            f"RL-shaped, {np_ * n} rows, T=1",
            rng.integers(1, cfg.vocab_size, (np_, pl)).tolist(),
            SamplingParams(n=n, temperature=1.0, max_tokens=new, seed=0),
            np_ * n * new,
        )
    )
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok = make_tiny_model(d / "tok", vocab_size=cfg.vocab_size)
        out = d / "export"
        save_hf_safetensors(model, cfg, str(out))
        for f in tok.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                shutil.copy(f, out / f.name)
        server = SGLangServer(
            out,
            max_running_requests=rows,
            max_total_tokens=rows * (max(pl, args.prompt_len) + max(new, args.new_tokens)) + 1024,
        )
        t0 = time.perf_counter()
        server.start(timeout_s=900)
        start_s = time.perf_counter() - t0
        try:
            client = SGLangClient(
                server.url,
                ignore_eos=True,
                vocab_size=cfg.vocab_size,
                max_concurrency=rows,
                request_timeout_s=1800.0,
            )
            print(
                f"\n[sglang] real SGLang server on CPU (float32, torch_native attention; "
                f"started in {start_s:.0f} s), same model and prompts"
            )
            names = _jax_labels(mesh)
            head = f"{'workload':>24} | " + "".join(f"{n + ' tok/s':>14} | " for n in names)
            head += f"{'sglang tok/s':>12} | " + " | ".join(f"{n + '/sglang':>14}" for n in names)
            print(head)
            print("-" * len(head))
            for name, prompts, params, n_tok in workloads:
                b = len(prompts) * params.n
                kw = dict(
                    batch_buckets=tuple(sorted({len(prompts), b})),
                    prompt_buckets=(len(prompts[0]),),
                    new_token_buckets=(params.max_tokens,),
                )
                engines = list(_jax_engines(model, mesh, **kw).values())
                for sampler in engines:
                    sampler.generate(prompts, params)  # compiles
                client.generate(prompts, params)  # warm-up
                jt, st = [[] for _ in engines], []
                for _ in range(args.repeats):
                    for times, sampler in zip(jt, engines):
                        t0 = time.perf_counter()
                        sampler.generate(prompts, params)
                        times.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = client.generate(prompts, params)
                    st.append(time.perf_counter() - t0)
                assert sum(len(s.tokens) for row in got for s in row) == n_tok
                jax_tps = [n_tok / statistics.median(t) for t in jt]
                sgl_tps = n_tok / statistics.median(st)
                print(
                    f"{name:>24} | "
                    + "".join(f"{t:>14.0f} | " for t in jax_tps)
                    + f"{sgl_tps:>12.0f} | "
                    + " | ".join(f"{t / sgl_tps:>14.2f}" for t in jax_tps),
                    flush=True,
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
