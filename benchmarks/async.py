r"""Steps per hour of the asynchronous loop at rollout.max_staleness 0 / 1 / 2 with a slow grader.

    XLA_FLAGS= python benchmarks/async.py --steps=8 --out=runs/bench_async
    XLA_FLAGS= python benchmarks/async.py --family=toy_agent --steps=8 --out=runs/bench_agent

The grader is a sleeping stand-in for a remote grader (``SleepingStandInGrader``): 2-5 s per
group (drawn from the group id, so every run sleeps the same), then the heuristic grader's
verdict. The toy family (or the multi-turn toy agent) with the embedded sampler, the ``smoke``
model (plumbing scale: the
point is the overlap of grading with generation and the update, not learning), dynamic sampling
off so every step trains the same number of groups. Prints one row per staleness: steps per
hour (after the first step, which compiles), the mean staleness, the grading wait, the
KS figures and the machine's load average, and writes them to ``<out>/async.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import threading
import time

from gagar_jax.grading import HeuristicGrader
from gagar_jax.rl import train, writers
from gagar_jax.rl.config import RunConfig


class SleepingStandInGrader:
    """A sleeping stand-in for a remote grader: ``lo``-``hi`` seconds per group (from the group
    id's hash), interruptible by ``cancel``, then the heuristic grader's verdict."""

    version = "1"

    def __init__(self, lo: float = 2.0, hi: float = 5.0):
        self.lo, self.hi = lo, hi
        self.inner = HeuristicGrader()
        self.grader_id = f"sleep{lo:g}-{hi:g}+{self.inner.grader_id}"

    def seconds(self, group_id: str) -> float:
        h = int(hashlib.sha256(group_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return self.lo + (self.hi - self.lo) * h

    def grade(self, workspace, cancel: threading.Event | None = None):
        s = self.seconds(workspace.group_id)
        if cancel is not None:
            if cancel.wait(s):
                raise TimeoutError("cancelled")
        else:
            time.sleep(s)
        return self.inner.grade(workspace)


def config(staleness: int, steps: int, seed: int, family: str = "toy_gagar") -> RunConfig:
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    cd = importlib.import_module(f"configs.{family}").get_config("smoke").to_dict()
    cd["seed"] = seed
    cd["rollout"]["max_staleness"] = staleness
    cd["grading"].update(max_concurrency=4, deadline_s=30.0, max_inflight_groups=16)
    cd["loop"].update(total_steps=steps, eval_every=10_000, checkpoint_every=10_000, plot=False)
    return RunConfig.from_config_dict(cd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--staleness", default="0,1,2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_async")
    ap.add_argument(
        "--family",
        default="toy_gagar",
        choices=("toy_gagar", "toy_agent"),
        help="the config: the toy family or the multi-turn toy agent",
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for s in (int(x) for x in args.staleness.split(",")):
        workdir = os.path.join(args.out, f"s{s}")
        shutil.rmtree(workdir, ignore_errors=True)
        cfg = config(s, args.steps, args.seed, args.family)
        train.train_and_evaluate(cfg, workdir, grader=SleepingStandInGrader())
        ms = [
            r
            for r in writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if r.get("phase", "train") == "train" and "step_time_s" in r
        ]
        timed = ms[1:] or ms  # the first step compiles the update
        per_step = sum(r["step_time_s"] for r in timed) / len(timed)

        def mean(key, rows=ms):
            vals = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
            return sum(vals) / len(vals) if vals else float("nan")

        rows.append(
            {
                "max_staleness": s,
                "steps": len(ms),
                "step_time_s": per_step,
                "steps_per_hour": 3600.0 / per_step,
                "grade_wait_s": mean("grade_wait_s", timed),
                "staleness_mean": mean("async/staleness") if s else 0.0,
                "ks_length": mean("async/ks_length"),
                "ks_grading_latency": mean("async/ks_grading_latency"),
                "pass_rate": mean("pass_rate"),
                "load": os.getloadavg()[0],
            }
        )
    base = rows[0]["steps_per_hour"]
    print(
        f"{'S':>2} {'steps/h':>9} {'x sync':>7} {'wait s':>7} {'stale':>6} {'ks_len':>7} "
        f"{'ks_lat':>7} {'load':>5}"
    )
    for r in rows:
        r["speedup"] = r["steps_per_hour"] / base
        print(
            f"{r['max_staleness']:>2} {r['steps_per_hour']:9.0f} {r['speedup']:7.2f} "
            f"{r['grade_wait_s']:7.2f} {r['staleness_mean']:6.2f} {r['ks_length']:7.3f} "
            f"{r['ks_grading_latency']:7.3f} {r['load']:5.2f}"
        )
    with open(os.path.join(args.out, "async.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
