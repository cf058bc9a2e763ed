r"""Discount-only's credit imbalance as a gradient: a decomposition and a tabular simulation.

    python scripts/discount_offset_sim.py --out=docs/results/discount_offset_sim

**Decomposition.** In a group of n rollouts with pass rate r (mean-centred binary advantages
`A = R - r`: `1 - r` on a pass, `-r` on a failure) and discount factors `f_i` on the passes
(mean `fbar` over the passes), Gagar gives a pass `A*_i = (1 - r) f_i / fbar` and
discount-only `f_i (1 - r) = fbar A*_i`; failures keep `-r` in both. Per rollout, exactly:

    A_discount = fbar A*  +  (1 - fbar) r A  -  c,        c = (1 - fbar) r (1 - r)

a zero-sum part (Gagar's quality preference at weight `fbar` plus a pass-vs-fail term at
weight `(1 - fbar) r`) and a constant offset `-c` on every rollout of the group. The offset is
the whole imbalance: the group's advantages sum to `-n c`, and the credit ratio is
`1 - (1 - fbar) = fbar`. Its policy gradient is `-c sum_i grad log pi(y_i)`, whose expectation
over on-policy samples is 0 (the score-function identity): on-policy, with one optimizer step
per batch, it adds only noise. Reusing the batch for several optimizer steps (PPO epochs,
mini-batches) makes it a systematic push: each step lowers the probability of the tokens that
were sampled, up to the clip, and what they lose goes to the tokens no rollout sampled --
entropy rises.

**Simulation.** A tabular softmax policy over V actions (one decision; `--pass_frac` of them
pass, one pass is T1 with factor 1, the other passes T2 with `--t2_factor`), groups of K
samples, mean-centred advantages, Gagar or discount-only, the PPO-clip surrogate (token-mean)
with Adam, for `--updates` batches, either one on-policy optimizer step per batch or
`--epochs` x `--minibatches` steps on the same batch. Prints and writes the mean entropy, pass
probability and T1 probability per setting (mean and standard error over `--seeds`).
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def group_advantages(passed, factor, mode):
    """[K] advantages of one group (mean-centred binary; Gagar / discount-only on passes)."""
    r = passed.mean()
    a = passed.astype(float) - r
    if mode == "binary" or r in (0.0, 1.0):
        return a
    f = np.where(passed, factor, 1.0)
    if mode == "discount_only":
        return np.where(passed, f * a, a)
    fbar = f[passed].mean()
    return np.where(passed, a * f / fbar, a)  # sum-preserving


def decomposition(passed, factor):
    """(A_discount, fbar A* + (1 - fbar) r A - c, c) for one group."""
    r = passed.mean()
    a = passed.astype(float) - r
    f = np.where(passed, factor, 1.0)
    fbar = f[passed].mean()
    c = (1 - fbar) * r * (1 - r)
    return (
        group_advantages(passed, factor, "discount_only"),
        fbar * group_advantages(passed, factor, "gagar") + (1 - fbar) * r * a - c,
        c,
    )


def measure_run(run, steps, tier_factors=(1.0, 0.6, 0.3)):
    """The decomposition on a toy run's own graded groups (``rollouts.jsonl``)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from token_credit_analysis import build_batch, load_groups

    from gagar_jax import advantages as adv

    b = build_batch(load_groups(run, steps))
    args = (
        b["rewards"],
        b["passed"],
        np.zeros_like(b["passed"]),
        b["tier"],
        b["rank"],
        np.ones(len(b["rewards"]), bool),
        b["valid"],
    )
    cfg = dict(tier_factors=tuple(tier_factors))
    g = adv.gagar_advantages(*args, config=adv.GagarConfig(mode="sum_preserving", **cfg))
    d = np.asarray(
        adv.gagar_advantages(*args, config=adv.GagarConfig(mode="discount_only", **cfg)).advantages
    )
    f = np.asarray(g.factors)
    rows = []
    for gi in range(len(f)):
        v, p = b["valid"][gi], b["passed"][gi] & b["valid"][gi]
        r = p.sum() / v.sum()
        fbar = f[gi][p].mean()
        c = (1 - fbar) * r * (1 - r)
        rows.append(
            (
                c,
                fbar,
                float(np.sum(c**2 * v)),
                float(np.sum(d[gi][v] ** 2)),
                float(np.abs(d[gi][v].sum() + c * v.sum())),
            )
        )
    rows = np.array(rows)
    return {
        "groups": len(rows),
        "mean offset c": float(rows[:, 0].mean()),
        "mean fbar": float(rows[:, 1].mean()),
        "offset share of sum A^2": float(rows[:, 2].sum() / rows[:, 3].sum()),
        "max |sum A_discount + n c|": float(rows[:, 4].max()),
        "credit ratio": float(d[d > 0].sum() / -d[d < 0].sum()),
    }


def simulate(
    mode,
    *,
    seed,
    vocab,
    pass_frac,
    t2_factor,
    k,
    groups,
    updates,
    epochs,
    minibatches,
    lr,
    init_scale=1.0,
    clip=(0.2, 0.28),
):
    rng = np.random.default_rng(seed)
    n_pass = max(2, int(round(pass_frac * vocab)))
    passes = np.zeros(vocab, bool)
    passes[:n_pass] = True
    factor = np.where(np.arange(vocab) == 0, 1.0, t2_factor)  # action 0 is the T1 pass
    z = rng.normal(scale=init_scale, size=vocab)
    z[0] -= 1.5  # the T1 pass starts rare
    m = np.zeros(vocab)
    v = np.zeros(vocab)
    t_adam = 0
    hist = []
    for _ in range(updates):
        p = np.exp(z - z.max())
        p /= p.sum()
        acts = rng.choice(vocab, size=(groups, k), p=p)
        adv = np.stack([group_advantages(passes[a], factor[a], mode) for a in acts]).ravel()
        acts = acts.ravel()
        old_lp = np.log(p[acts])
        order = np.arange(len(acts))
        for _ in range(epochs):
            rng.shuffle(order)
            for mb in np.array_split(order, minibatches):
                q = np.exp(z - z.max())
                q /= q.sum()
                ratio = np.exp(np.log(q[acts[mb]]) - old_lp[mb])
                a = adv[mb]
                live = np.where(a >= 0, ratio < 1 + clip[1], ratio > 1 - clip[0])
                # d/dz of -mean(min(ratio A, clip(ratio) A)): -ratio A (e_a - q) where unclipped
                g = np.zeros(vocab)
                for act, w in zip(acts[mb][live], (ratio * a)[live]):
                    g[act] -= w
                    g += w * q
                g /= len(mb)
                t_adam += 1
                m = 0.9 * m + 0.1 * g
                v = 0.999 * v + 0.001 * g * g
                z = z - lr * (m / (1 - 0.9**t_adam)) / (np.sqrt(v / (1 - 0.999**t_adam)) + 1e-8)
        p = np.exp(z - z.max())
        p /= p.sum()
        hist.append(
            (
                float(-(p * np.log(p + 1e-30)).sum()),
                float(p[passes].sum()),
                float(p[0]),
                float(adv[adv > 0].sum() / -adv[adv < 0].sum()) if (adv < 0).any() else np.nan,
            )
        )
    return np.array(hist)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=50)
    ap.add_argument("--pass_frac", type=float, default=0.2)
    ap.add_argument("--t2_factor", type=float, default=0.3)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--updates", type=int, default=60)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--init_scale", type=float, default=3.0, help="spread of the initial logits")
    ap.add_argument("--out", default="", help="write <out>.json and <out>.png")
    ap.add_argument("--runs", default="", help="toy run dirs (comma-separated) to measure c on")
    ap.add_argument("--steps", default="0-9", help="their steps, 'a-b'")
    ap.add_argument("--tier_factors", default="1.0,0.6,0.3")
    args = ap.parse_args(argv)

    # The decomposition, checked on random groups.
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(2000):
        passed = rng.random(args.k) < rng.random()
        if 0 < passed.sum() < args.k:
            factor = rng.choice([1.0, 0.6, 0.3], size=args.k)
            a, b, _ = decomposition(passed, factor)
            worst = max(worst, float(np.abs(a - b).max()))
    print(f"decomposition A_discount = fbar A* + (1 - fbar) r A - c: max error {worst:.2e}")

    measured = {}
    for run in filter(None, args.runs.split(",")):
        lo, _, hi = args.steps.partition("-")
        tf = tuple(float(x) for x in args.tier_factors.split(","))
        measured[run] = measure_run(run, range(int(lo), int(hi or lo) + 1), tf)
        print(run, ", ".join(f"{k} {v:.4g}" for k, v in measured[run].items()))

    settings = {
        "on-policy (1 step per batch)": dict(epochs=1, minibatches=1),
        "reused (4 epochs x 4 mini-batches)": dict(epochs=4, minibatches=4),
    }
    results = {}
    for sname, kw in settings.items():
        for mode in ("gagar", "discount_only"):
            runs = np.stack(
                [
                    simulate(
                        mode,
                        seed=s,
                        vocab=args.vocab,
                        pass_frac=args.pass_frac,
                        t2_factor=args.t2_factor,
                        k=args.k,
                        groups=args.groups,
                        updates=args.updates,
                        lr=args.lr,
                        init_scale=args.init_scale,
                        **kw,
                    )
                    for s in range(args.seeds)
                ]
            )  # [seeds, updates, 4]
            results[(sname, mode)] = runs
    lines = [
        f"V={args.vocab} actions, {args.pass_frac:.0%} pass, T2 factor {args.t2_factor}, "
        f"{args.groups} groups x {args.k}, Adam lr {args.lr}, {args.updates} batches, "
        f"{args.seeds} seeds (mean +- SE)",
        "",
        "| setting | mode | entropy start -> end | pass prob end | T1 prob end | credit ratio |",
        "|---|---|---|---|---|---|",
    ]
    out = {}
    for (sname, mode), runs in results.items():
        se = runs.std(0, ddof=1) / np.sqrt(len(runs))
        mu = runs.mean(0)
        row = {
            "entropy_start": float(mu[0, 0]),
            "entropy_end": float(mu[-1, 0]),
            "entropy_end_se": float(se[-1, 0]),
            "pass_end": float(mu[-1, 1]),
            "pass_end_se": float(se[-1, 1]),
            "t1_end": float(mu[-1, 2]),
            "t1_end_se": float(se[-1, 2]),
            "credit_ratio": float(np.nanmean(runs[..., 3])),
            "entropy_curve": mu[:, 0].tolist(),
        }
        out[f"{sname} | {mode}"] = row
        lines.append(
            f"| {sname} | {mode} | {row['entropy_start']:.3f} -> {row['entropy_end']:.3f} +- "
            f"{row['entropy_end_se']:.3f} | {row['pass_end']:.3f} +- {row['pass_end_se']:.3f} | "
            f"{row['t1_end']:.3f} +- {row['t1_end_se']:.3f} | {row['credit_ratio']:.2f} |"
        )
    lines.append("")
    for sname in settings:
        d = results[(sname, "discount_only")][:, -1, 0] - results[(sname, "gagar")][:, -1, 0]
        se = d.std(ddof=1) / np.sqrt(len(d))
        out[f"{sname} | paired entropy end, discount_only - gagar"] = [float(d.mean()), float(se)]
        lines.append(
            f"- {sname}: final entropy discount_only - gagar (paired by seed) "
            f"{d.mean():+.3f} +- {se:.3f}"
        )
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(
                {"args": vars(args), "decomposition_max_error": worst, "results": out}, f, indent=1
            )
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for ax, sname in zip(axes, settings):
            for mode, color in (("gagar", "C0"), ("discount_only", "C3")):
                runs = results[(sname, mode)][..., 0]
                mu, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(len(runs))
                x = np.arange(1, len(mu) + 1)
                ax.plot(x, mu, color=color, label=mode)
                ax.fill_between(x, mu - se, mu + se, color=color, alpha=0.2)
            ax.set_title(sname)
            ax.set_xlabel("batch")
        axes[0].set_ylabel("policy entropy (nats)")
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)


if __name__ == "__main__":
    main()
