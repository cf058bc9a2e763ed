"""Before/after in one process: the sampler's and the update's compiled programs of two checkouts.

    git worktree add /tmp/before <commit>          # the checkout to compare against
    XLA_FLAGS= .venv/bin/python benchmarks/compare_trees.py --trees /tmp/before,.
    XLA_FLAGS= .venv/bin/python benchmarks/compare_trees.py --trees /tmp/before,. \\
        --what update --configs small,100m --rounds 5

Each checkout's ``gagar_jax`` is imported in turn (the modules of the previous one dropped
from ``sys.modules``) and its programs compiled: the greedy sampler of ``benchmarks/sampler.py``
(5.1M Qwen2-shaped model, 32-token prompts, 64 new tokens) at each ``--batches`` size, and the
update step of ``benchmarks/update.py``'s configs. Then the programs run in rounds, every
checkout once per round and the order reversed every other round, so a change of the machine's
load hits both sides alike; each call is timed on the wall clock and on this process's CPU time
(``time.process_time``, all its threads). Reported: medians, the cores a call kept busy (CPU
seconds over wall seconds), the sampler's tokens per second and per CPU-second with the
largest batch's throughput over the smallest's, the update's MFU against a jitted f32
1024^3 GEMM timed in the same rounds (wall-clock and per CPU-second), and the load average
at the start and the end. Before timing it checks that the two checkouts compute the same
thing: the same greedy tokens and log-probabilities within 1e-5, and the parameters after one
update step within 1e-5.

The process runs with glibc's allocator set to keep freed memory (``gagar_jax.update.malloc``,
as ``scripts/train.py`` does; ``GAGAR_MALLOC_KEEP_HEAP=0`` turns it off), for both checkouts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# One host device (the test suite's 8 simulated devices would split threads).
os.environ["XLA_FLAGS"] = " ".join(
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
)

# Process-wide, so both checkouts run under it: the allocator keeps the update's temporary
# buffer between steps (gagar_jax.update.malloc of the checkout holding this script;
# GAGAR_MALLOC_KEEP_HEAP=0 turns it off).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gagar_jax.update.malloc import keep_heap  # noqa: E402

KEEP_HEAP = keep_heap()
sys.path.pop(0)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _import_tree(tree: str):
    """(gagar_jax package, benchmarks/update.py module) of checkout ``tree``."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("gagar_jax", "update")]:
        del sys.modules[name]
    paths = [tree, os.path.join(tree, "benchmarks")]
    sys.path[:0] = paths
    try:
        import update

        import gagar_jax.rollout.sampler  # noqa: F401
    finally:
        for p in paths:
            sys.path.remove(p)
    pkg = sys.modules["gagar_jax"]
    if not os.path.abspath(pkg.__file__).startswith(os.path.abspath(tree)):
        raise RuntimeError(f"imported {pkg.__file__}, not the checkout {tree}")
    return pkg, update


def sampler_programs(pkg, batches, prompt_len=32, new_tokens=64):
    """{batch: (compiled program, its arguments, the call's samples)} of one checkout."""
    s_mod = sys.modules["gagar_jax.rollout.sampler"]
    models = sys.modules["gagar_jax.models"]
    SamplingParams = sys.modules["gagar_jax.rollout"].SamplingParams
    cfg = models.TransformerConfig(
        vocab_size=4096,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=704,
        rope_theta=10000.0,
    )
    model = models.create_model(cfg, seed=0)
    program = s_mod._generate_program
    seen = {}

    def capture(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return program(*args, **kwargs)

    out = {}
    rng = np.random.default_rng(0)
    s_mod._generate_program = capture
    try:
        for b in batches:
            sampler = s_mod.Sampler(
                model,
                batch_buckets=tuple(batches),
                prompt_buckets=(prompt_len,),
                new_token_buckets=(new_tokens,),
            )
            prompts = rng.integers(1, cfg.vocab_size, (b, prompt_len)).tolist()
            samples = sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64))
            compiled = program.lower(*seen["args"], **seen["kwargs"]).compile()
            out[b] = (compiled, seen["args"], samples)
    finally:
        s_mod._generate_program = program
    return out


def update_program(update, name):
    """(step function, XLA FLOPs, parameters after one step) of one config in one checkout."""
    c, batch, length = update.CONFIGS[name]
    mesh = update.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state = update.create_train_state(c, update.UPDATE, mesh, seed=0)
    data = update.shard_batch(update.make_batch(c, batch, length), mesh)
    compiled = update.jit_update(c, update.UPDATE, mesh).lower(state, data).compile()
    state, metrics = compiled(state, data)
    jax.block_until_ready(metrics)
    params = jax.tree.leaves(jax.device_get(state.params))
    box = {"state": state}

    def step():
        box["state"], m = compiled(box["state"], data)
        jax.block_until_ready(m)

    return step, update.xla_flops(compiled), params


_GEMM = jax.jit(lambda x: x @ x)


def gemm_flops_per_s(n=1024, reps=5):
    """(wall, CPU) FLOP/s of the best of ``reps`` jitted f32 n^3 GEMMs."""
    a = jnp.ones((n, n), jnp.float32)
    _GEMM(a).block_until_ready()
    best_w = best_c = float("inf")
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        _GEMM(a).block_until_ready()
        best_c = min(best_c, time.process_time() - c)
        best_w = min(best_w, time.perf_counter() - t)
    return 2 * n**3 / best_w, 2 * n**3 / max(best_c, 1e-9)


def interleave(fns: dict, rounds: int, with_peak: bool = False):
    """{key: ([wall s], [cpu s])} over ``rounds`` rounds, order reversed every other round;
    with ``with_peak`` also ``"peak"``: the GEMM's (wall, CPU) FLOP/s measured each round."""
    times = {k: ([], []) for k in fns}
    times["peak"] = ([], [])
    keys = list(fns)
    for r in range(rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            t, c = time.perf_counter(), time.process_time()
            fns[k]()
            times[k][1].append(time.process_time() - c)
            times[k][0].append(time.perf_counter() - t)
        if with_peak:
            w, c = gemm_flops_per_s()
            times["peak"][0].append(w)
            times["peak"][1].append(c)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", required=True, help="two checkouts: before,after")
    ap.add_argument("--what", default="sampler,update", help="sampler, update or both")
    ap.add_argument("--batches", default="16,64", help="sampler batch sizes")
    ap.add_argument("--configs", default="small", help="update configs (benchmarks/update.py)")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    if len(trees) != 2:
        ap.error(f"--trees takes two checkouts, got {args.trees!r}")
    what = set(args.what.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    print(
        f"start: {_load()}; jax {jax.__version__} on {jax.devices()[0].platform}; malloc "
        f"keep_heap {'on' if KEEP_HEAP else 'off'}",
        flush=True,
    )

    samplers, updates = {}, {}
    for tree in trees:
        pkg, update = _import_tree(tree)
        if "sampler" in what:
            t = time.perf_counter()
            samplers[tree] = sampler_programs(pkg, batches)
            print(f"{tree}: sampler programs in {time.perf_counter() - t:.1f} s", flush=True)
        if "update" in what:
            for name in configs:
                t = time.perf_counter()
                updates[tree, name] = update_program(update, name)
                print(f"{tree}: {name} update in {time.perf_counter() - t:.1f} s", flush=True)

    if samplers:
        for b in batches:
            (_, _, before), (_, _, after) = samplers[trees[0]][b], samplers[trees[1]][b]
            tok = [np.array([r[0].tokens for r in s]) for s in (before, after)]
            lps = [np.array([r[0].logprobs for r in s]) for s in (before, after)]
            agree, diff = float((tok[0] == tok[1]).mean()), float(np.abs(lps[0] - lps[1]).max())
            print(f"sampler batch {b}: greedy tokens agree {agree:.4f}, max |d logprob| {diff:.2e}")
            if agree < 1.0 or diff > 1e-5:
                raise SystemExit("the two checkouts sample differently: not the same work")
        fns = {}
        for tree in trees:
            for b in batches:
                compiled, call_args, _ = samplers[tree][b]
                fns[tree, b] = lambda c=compiled, a=call_args: jax.block_until_ready(c(*a))
        times = interleave(fns, args.rounds)
        print(f"\nsampler, greedy, 64 new tokens, median of {args.rounds} rounds; {_load()}")
        print(
            f"{'checkout':40} {'batch':>5} {'wall ms':>8} {'tok/s':>7} {'cpu ms':>8} "
            f"{'tok/cpu-s':>9} {'cores':>5}"
        )
        for tree in trees:
            med = {}
            for b in batches:
                w, c = (statistics.median(x) for x in times[tree, b])
                med[b] = (w, c)
                print(
                    f"{tree[-40:]:40} {b:5d} {w * 1e3:8.1f} {b * 64 / w:7.0f} {c * 1e3:8.1f} "
                    f"{b * 64 / c:9.0f} {c / w:5.2f}"
                )
            big, small = max(batches), min(batches)
            if big != small:
                print(
                    f"{'':40} batch {big} / batch {small} throughput: wall "
                    f"{big * med[small][0] / (small * med[big][0]):.3f}, per CPU-second "
                    f"{big * med[small][1] / (small * med[big][1]):.3f}"
                )

    for name in configs if updates else []:
        (_, flops, p0), (_, _, p1) = updates[trees[0], name], updates[trees[1], name]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(p0, p1))
        print(f"\n{name} update: parameters after one step, max |diff| {diff:.2e}")
        if diff > 1e-5:
            raise SystemExit("the two checkouts update differently: not the same work")
        times = interleave({t: updates[t, name][0] for t in trees}, args.rounds, with_peak=True)
        print(
            f"{name} update, {flops / 1e9:.1f} GFLOP (XLA), median of {args.rounds} rounds; "
            f"GEMM peak {statistics.median(times['peak'][0]) / 1e9:.0f} GFLOP/s wall, "
            f"{statistics.median(times['peak'][1]) / 1e9:.0f} per CPU-second; {_load()}"
        )
        print(f"{'checkout':40} {'wall s':>7} {'cpu s':>7} {'cores':>5} {'MFU':>6} {'MFU cpu':>7}")
        for tree in trees:
            w, c = times[tree]
            mfu = statistics.median(flops / t / p for t, p in zip(w, times["peak"][0]))
            mfu_c = statistics.median(flops / t / p for t, p in zip(c, times["peak"][1]))
            mw, mc = statistics.median(w), statistics.median(c)
            print(f"{tree[-40:]:40} {mw:7.3f} {mc:7.3f} {mc / mw:5.2f} {mfu:6.1%} {mfu_c:7.1%}")
    print(f"\nend: {_load()}")


if __name__ == "__main__":
    main()
