"""Benchmark: the jitted Gagar advantage pipeline against NumPy and per-group Python loops.

Run: `make bench` (or `.venv/bin/python benchmarks/advantages.py [--quick]`).

Everything is measured in one run on the same machine, so the ratios are meaningful even when
the absolute times move with the machine's load. Rows:

* `jax pipeline`: `gagar_advantages` (cheat penalty, statistics, mixed mask, factors,
  sum-preserving redistribution, credit diagnostics), jitted, flat layout, on device arrays.
* `numpy vectorised`: the same pipeline with `np.bincount` segment sums (no Python loop).
* `python per-group loop`: the style of widely used PyTorch RL trainers -- a dict of lists
  keyed by group id, Python loops over rollouts and groups.
* token broadcast `[N, T]`: JAX `broadcast_to_tokens` creating a new array; the floors are
  NumPy writing into a preallocated buffer (`np.multiply(..., out=buf)`) and JAX filling a new
  array of the same size (`jnp.zeros`); and the fused form that matters in training: a jitted
  token-mean loss that consumes the broadcast without materialising it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from gagar_jax import advantages as adv

TIER_FACTORS = (1.0, 0.6, 0.3)
RANK_DECAY = 0.5


def make_batch(g: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = g * k
    rewards = (rng.random(n) < 0.4).astype(np.float32)
    return dict(
        rewards=rewards,
        passed=rewards > 0,
        cheat=rng.random(n) < 0.02,
        tier=rng.integers(1, 4, n).astype(np.int32),
        rank=rng.integers(1, k + 1, n).astype(np.int32),
        graded=rng.random(g) < 0.9,
        valid=rng.random(n) < 0.95,
        group_ids=np.repeat(np.arange(g, dtype=np.int32), k),
    )


def numpy_pipeline(b: dict[str, np.ndarray], g: int) -> np.ndarray:
    """The pipeline vectorised with np.bincount segment sums."""
    ids = b["group_ids"]
    valid = b["valid"] & np.isfinite(b["rewards"])
    cheat = b["cheat"] & valid
    r = np.where(valid & ~cheat, b["rewards"], 0.0).astype(np.float32)
    p = b["passed"] & ~cheat & valid
    cnt = np.bincount(ids, valid, g)
    mean = np.bincount(ids, r, g) / np.maximum(cnt, 1)
    a = np.where(valid, r - mean[ids], 0.0)
    mixed = (cnt > 0) & (mean > 1e-6) & (mean < 1 - 1e-6)
    f = np.ones(ids.shape, np.float32)
    t, rank = b["tier"], b["rank"].astype(np.float32)
    for k in (1, 2, 3):
        m = p & (t == k)
        if k == 3:
            f[m] = TIER_FACTORS[2]
            continue
        rmin = np.full(g, np.inf)
        rmax = np.full(g, -np.inf)
        np.minimum.at(rmin, ids[m], rank[m])
        np.maximum.at(rmax, ids[m], rank[m])
        span = np.maximum(rmax - rmin, 1.0)
        pos = (rank[m] - rmin[ids[m]]) / span[ids[m]]
        hi, lo = TIER_FACTORS[k - 1], TIER_FACTORS[k]
        f[m] = hi - RANK_DECAY * (hi - lo) * pos
    n_pass = np.bincount(ids, p, g)
    s_plus = np.bincount(ids, np.where(p, a, 0.0), g)
    denom = np.bincount(ids, np.where(p, f * a, 0.0), g)
    fmax = np.zeros(g)
    fmin = np.ones(g)
    np.maximum.at(fmax, ids[p], f[p])
    np.minimum.at(fmin, ids[p], f[p])
    applies = mixed & b["graded"] & (n_pass >= 2) & (fmax > fmin) & (denom > 0)
    lam = np.where(applies, s_plus / np.where(applies, denom, 1.0), 1.0)
    out = np.where(p & applies[ids], lam[ids] * f * a, a)
    return np.where(mixed[ids] & valid, out, 0.0)


def python_loop_pipeline(b: dict[str, np.ndarray], g: int) -> np.ndarray:
    """Per-group dictionary loops, in the style of common PyTorch GRPO trainers."""
    n = len(b["rewards"])
    members: dict[int, list[int]] = collections.defaultdict(list)
    for i in range(n):
        if b["valid"][i] and np.isfinite(b["rewards"][i]):
            members[int(b["group_ids"][i])].append(i)
    out = np.zeros(n, np.float32)
    for gid, idx in members.items():
        rewards = {i: (0.0 if b["cheat"][i] else float(b["rewards"][i])) for i in idx}
        passing = [i for i in idx if b["passed"][i] and not b["cheat"][i]]
        mean = sum(rewards.values()) / len(idx)
        if not 1e-6 < mean < 1 - 1e-6:
            continue
        a = {i: rewards[i] - mean for i in idx}
        f = {}
        for i in passing:
            t = int(b["tier"][i])
            if t == 3:
                f[i] = TIER_FACTORS[2]
                continue
            same = [float(b["rank"][j]) for j in passing if int(b["tier"][j]) == t]
            pos = (float(b["rank"][i]) - min(same)) / max(max(same) - min(same), 1.0)
            hi, lo = TIER_FACTORS[t - 1], TIER_FACTORS[t]
            f[i] = hi - RANK_DECAY * (hi - lo) * pos
        denom = sum(f[i] * a[i] for i in passing)
        if b["graded"][gid] and len(passing) >= 2 and len(set(f.values())) > 1 and denom > 0:
            lam = sum(a[i] for i in passing) / denom
            for i in passing:
                a[i] = lam * f[i] * a[i]
        for i in idx:
            out[i] = a[i]
    return out


def timeit(fn, repeats: int) -> float:
    """Median wall time in milliseconds over `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@jax.jit
def _token_mean_loss(seq, mask, logp):
    a = adv.broadcast_to_tokens(seq, mask)
    return -jnp.sum(a * logp) / jnp.maximum(jnp.sum(mask), 1.0)


def bench_broadcast(seq_np: np.ndarray, t: int, reps: int) -> list[tuple]:
    """Rows for the `[N, T]` token broadcast and its floors."""
    n = len(seq_np)
    mask_np = np.ones((n, t), np.float32)
    mask_np[:, : t // 4] = 0.0  # prompt tokens
    buf = np.empty((n, t), np.float32)
    mask, seq = jnp.asarray(mask_np), jnp.asarray(seq_np)
    logp = jnp.asarray(np.random.default_rng(1).standard_normal((n, t), np.float32) * 0.1)
    bcast = jax.jit(adv.broadcast_to_tokens)
    zeros = jax.jit(lambda: jnp.zeros((n, t), jnp.float32))
    floor = timeit(lambda: np.multiply(seq_np[:, None], mask_np, out=buf), reps)
    label = f"{n}x{t}"
    timed = [
        ("numpy into preallocated buffer (floor)", floor),
        (
            "jax new array (broadcast_to_tokens)",
            timeit(lambda: bcast(seq, mask).block_until_ready(), reps),
        ),
        (
            "jax fill new array (jnp.zeros, floor)",
            timeit(lambda: zeros().block_until_ready(), reps),
        ),
        (
            "jax fused token-mean loss (reads logp)",
            timeit(lambda: _token_mean_loss(seq, mask, logp).block_until_ready(), reps),
        ),
    ]
    return [(label, "broadcast", name, ms, floor) for name, ms in timed]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, T=1024 only")
    args = parser.parse_args()
    reps = 5 if args.quick else 20
    print(
        f"jax {jax.__version__}, numpy {np.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s)"
    )
    rows = []
    for g, k in ((128, 16), (1568, 16)):
        b = make_batch(g, k)
        dev = {name: jnp.asarray(x) for name, x in b.items()}
        flat = {name: x for name, x in dev.items() if name != "group_ids"}
        ids = dev["group_ids"]

        def run_jax(flat=flat, ids=ids, g=g):
            out = adv.gagar_advantages(**flat, group_ids=ids, num_groups=g)
            return out.advantages.block_until_ready()

        # The three implementations agree before anything is timed.
        want = numpy_pipeline(b, g)
        np.testing.assert_allclose(np.asarray(run_jax()), want, atol=1e-5)
        np.testing.assert_allclose(python_loop_pipeline(b, g), want, atol=1e-5)
        t_jax = timeit(run_jax, reps)
        t_np = timeit(lambda b=b, g=g: numpy_pipeline(b, g), reps)
        t_py = timeit(lambda b=b, g=g: python_loop_pipeline(b, g), max(2, reps // 5))
        size = f"{g}x{k}"
        rows.append((size, "pipeline", "jax jitted (gagar_advantages)", t_jax, t_np))
        rows.append((size, "pipeline", "numpy vectorised (bincount)", t_np, t_np))
        rows.append((size, "pipeline", "python per-group loop", t_py, t_np))

        for t in (1024,) if args.quick else (1024, 8192):
            rows.extend(bench_broadcast(want.astype(np.float32), t, reps))

    print()
    print("| size | stage | implementation | median ms | vs numpy row |")
    print("|---|---|---|---:|---:|")
    for size, stage, name, ms, base in rows:
        print(f"| {size} | {stage} | {name} | {ms:.3f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
