r"""Summarises a discount-only sweep: ROOT/<condition>/<mode>/seed<s>/metrics.jsonl.

    python scripts/discount_sweep.py --root=runs/P2 --out=docs/results/discount_sweep

Per run: the steps it completed (a run whose dynamic sampling found no mixed group left stops
early: every group failed), entropy over the first 3 steps, its maximum and over the last 5
completed steps, the train pass rate over the first / last 5 steps, the held-out pass rate at
the SFT start and at the last evaluation, response length, the credit ratio and the share of
tokens clipped below (ratio < 1 - clip_low). Then per condition, mean and standard error over
seeds per mode, and the per-seed differences ``discount_only - gagar`` (mean +- SE). Writes
``<out>.md``, ``<out>.json`` and ``<out>.png`` (entropy, train pass rate and response length
per step, every run).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np

FIELDS = (
    ("steps", "steps done"),
    ("ent_first", "entropy first 3"),
    ("ent_max", "entropy max"),
    ("ent_last", "entropy last 5"),
    ("pass_first", "train pass first 5"),
    ("pass_last", "train pass last 5"),
    ("heldout_start", "held-out start"),
    ("heldout_last", "held-out last eval"),
    ("len_last", "length last 5"),
    ("ratio", "credit ratio"),
    ("clip_low", "clipped-low share"),
)


def summarise(path):
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    tr = [r for r in rows if r.get("phase") == "train"]
    ev = [r for r in rows if r.get("phase") == "eval" and "eval_pass_rate" in r]
    ent = np.array([r["entropy"] for r in tr])
    pas = np.array([r["pass_rate"] for r in tr])
    return {
        "steps": len(tr),
        "ent_first": float(ent[:3].mean()),
        "ent_max": float(ent.max()),
        "ent_last": float(ent[-5:].mean()),
        "pass_first": float(pas[:5].mean()),
        "pass_last": float(pas[-5:].mean()),
        "heldout_start": float(ev[0]["eval_pass_rate"]),
        "heldout_last": float(ev[-1]["eval_pass_rate"]),
        "len_last": float(np.mean([r["response_length"] for r in tr[-5:]])),
        "ratio": float(np.mean([r["credit/ratio"] for r in tr])),
        "clip_low": float(np.mean([r.get("clip_frac_low", np.nan) for r in tr])),
        "entropy_curve": ent.tolist(),
        "pass_curve": pas.tolist(),
        "length_curve": [r["response_length"] for r in tr],
    }


def unparseable_shares(run):
    """Per step, the share of a toy run's rollouts whose patch does not parse."""
    from gagar_jax.envs import toy

    by_step = {}
    with open(os.path.join(run, "rollouts.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            _, d, s, i = r["task_id"].split("-")
            task = toy.ToyTaskGenerator(seed=int(s[1:]), difficulty=int(d[1:])).task(int(i))
            try:
                toy.parse_patch(r["patch"], len(task.lines))
                bad = 0
            except toy.PatchError:
                bad = 1
            by_step.setdefault(r["step"], []).append(bad)
    return {k: float(np.mean(v)) for k, v in sorted(by_step.items())}


def _ms(x):
    x = np.asarray(x, float)
    if len(x) < 2:
        return f"{x.mean():.3g}"
    return f"{x.mean():.3g} ± {x.std(ddof=1) / np.sqrt(len(x)):.2g}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument(
        "--parse_check",
        default="",
        help="comma-separated run dirs: print the share of unparseable patches per step",
    )
    args = ap.parse_args(argv)
    for run in filter(None, args.parse_check.split(",")):
        shares = unparseable_shares(run)
        print(run, "unparseable share per step:", {k: round(v, 2) for k, v in shares.items()})
    if args.parse_check:
        return
    runs = {}
    for path in sorted(glob.glob(os.path.join(args.root, "*", "*", "seed*"))):
        if not os.path.exists(os.path.join(path, "metrics.jsonl")):
            continue
        cond, mode, seed = path.split(os.sep)[-3:]
        try:
            runs.setdefault(cond, {}).setdefault(mode, {})[int(seed[4:])] = summarise(path)
        except (ValueError, IndexError, KeyError):
            continue  # a run still in its SFT phase
    lines = []
    for cond, modes in runs.items():
        lines += [f"**{cond}**", "", "| mode | seeds | " + " | ".join(h for _, h in FIELDS) + " |"]
        lines.append("|---" * (len(FIELDS) + 2) + "|")
        for mode, seeds in sorted(modes.items()):
            vals = list(seeds.values())
            lines.append(
                f"| {mode} | {len(vals)} | "
                + " | ".join(_ms([v[k] for v in vals]) for k, _ in FIELDS)
                + " |"
            )
        a, b = modes.get("discount_only", {}), modes.get("gagar", {})
        shared = sorted(set(a) & set(b))
        if shared:
            lines.append("")
            lines.append(f"Per seed, discount_only - gagar (seeds {shared}):")
            for k, h in FIELDS:
                d = [a[s][k] - b[s][k] for s in shared]
                lines.append(f"- {h}: {_ms(d)}")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump(runs, f, indent=1)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        conds = list(runs)
        fig, axes = plt.subplots(3, len(conds), figsize=(4 * len(conds), 8.5), squeeze=False)
        for c, cond in enumerate(conds):
            for mode, color in (("gagar", "C0"), ("discount_only", "C3")):
                for s, v in runs[cond].get(mode, {}).items():
                    lab = mode if s == min(runs[cond][mode]) else None
                    axes[0, c].plot(v["entropy_curve"], color=color, alpha=0.7, label=lab)
                    axes[1, c].plot(v["pass_curve"], color=color, alpha=0.7, label=lab)
                    axes[2, c].plot(v["length_curve"], color=color, alpha=0.7, label=lab)
            axes[0, c].set_title(cond)
            axes[2, c].set_xlabel("RL step")
        axes[0, 0].set_ylabel("policy entropy")
        axes[1, 0].set_ylabel("train pass rate")
        axes[2, 0].set_ylabel("response length (tokens)")
        axes[0, 0].legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=100)


if __name__ == "__main__":
    main()
