r"""Paired per-seed differences of whole-run means of train metrics between two modes.

    python scripts/paired_curves.py --root=runs/A --a=gagar_distinct --b=gagar --seeds=5

For each seed s, the mean of a metric over every train step of ROOT/A/seed<s> minus the same
for ROOT/B/seed<s> (the area between the two curves per step); prints the mean and standard
error over seeds and the per-seed values. Where the first/last windows of
``scripts/compare_runs.py`` compare the ends of two runs, this compares their whole paths:
how much sooner one reaches what the other does.
"""

import argparse
import json
import os

import numpy as np

METRICS = ("grading/t1_share", "quality", "response_length", "entropy", "pass_rate")


def curve(path, key):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return np.array([r[key] for r in rows if r.get("phase") == "train" and key in r])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--seeds", type=int, required=True)
    args = ap.parse_args(argv)
    print(f"whole-run means, {args.a} - {args.b}, paired over seeds 0..{args.seeds - 1}:")
    for key in METRICS:
        d = np.array(
            [
                curve(os.path.join(args.root, args.a, f"seed{s}"), key).mean()
                - curve(os.path.join(args.root, args.b, f"seed{s}"), key).mean()
                for s in range(args.seeds)
            ]
        )
        se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        print(f"- {key}: {d.mean():+.4f} ± {se:.4f} (per seed {np.round(d, 3).tolist()})")


if __name__ == "__main__":
    main()
