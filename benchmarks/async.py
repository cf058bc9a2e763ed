r"""Steps per hour of the asynchronous loop at rollout.max_staleness 0 / 1 / 2 with a slow grader,
over several seeds, with the held-out pass rate, the KS figures and the machine's load.

The full comparison (both families, three seeds, staleness 0 / 1 / 2 and 2 with partial
rollouts on the toy agent, 12 steps per run: 21 runs; see docs/async.md for the time it
takes)::

    XLA_FLAGS= python benchmarks/async.py --out=runs/bench_async

A short check that it runs (one family, one seed, 3 steps)::

    XLA_FLAGS= python benchmarks/async.py --families=toy_gagar --seeds=0 --steps=3 \
        --out=runs/bench_async_short

The grader is a sleeping stand-in for a remote grader (``SleepingStandInGrader``): 2-5 s per
group (drawn from the group id, so every run sleeps the same), then the heuristic grader's
verdict. The families: the toy family and the multi-turn toy agent, both with the embedded
sampler and the ``smoke`` policy warm-started on demonstrations (``--sft_steps``; enough that
groups are mixed and the held-out pass rate is not zero), dynamic sampling off so every step
trains the same number of groups. The staleness list may hold ``<S>p`` entries: ``S`` with
``rollout.partial_rollout`` and ``rollout.mask_offpolicy_tokens`` (multi-turn families only).

Per (family, staleness, seed) one run; per (family, staleness) one row: steps per hour (mean
and standard deviation over the seeds, after the first step of each run, which compiles) and
its ratio to the synchronous run, the final held-out pass rate (mean and per seed) and whether
the mean lies within the spread (min..max) of the synchronous seeds, the mean staleness and
grading wait, the KS distances, the training-inference log-prob mismatch, the share of tokens
older than their batch's newest version, and the load average. ``<out>/async.json`` holds
every run's figures and the rows.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from gagar_jax.analysis import writers  # noqa: E402
from gagar_jax.grading import HeuristicGrader  # noqa: E402
from gagar_jax.rl import train  # noqa: E402
from gagar_jax.rl.config import RunConfig  # noqa: E402


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


def parse_staleness(item: str) -> tuple[int, bool]:
    """``"1"`` -> (1, False); ``"1p"`` -> (1, True): partial rollouts and the off-policy mask."""
    partial = item.endswith("p")
    return int(item[:-1] if partial else item), partial


def config(
    staleness: int,
    steps: int,
    seed: int,
    family: str = "toy_gagar",
    *,
    partial: bool = False,
    sft_steps: int = 200,
) -> RunConfig:
    cd = importlib.import_module(f"configs.{family}").get_config("smoke").to_dict()
    cd["seed"] = seed
    cd["rollout"]["max_staleness"] = staleness
    if partial:
        cd["rollout"].update(partial_rollout=True, mask_offpolicy_tokens=True)
    cd["grading"].update(max_concurrency=4, deadline_s=30.0, max_inflight_groups=16)
    # the warm start of the multi-process comparison tests: mixed groups, a held-out pass rate
    cd["sft"].update(steps=sft_steps, lr=1e-2, batch_size=32)
    cd["learner"]["entropy_coef"] = 0.01
    cd["loop"].update(
        total_steps=steps,
        eval_every=10_000,  # held-out evaluation before RL and after the last step only
        eval_rollouts=4,
        checkpoint_every=10_000,
        plot=False,
    )
    return RunConfig.from_config_dict(cd)


def _mean(vals) -> float:
    vals = [v for v in vals if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def run_one(family: str, item: str, seed: int, steps: int, out: str, sft_steps: int) -> dict:
    s, partial = parse_staleness(item)
    workdir = os.path.join(out, family, f"s{item}", f"seed{seed}")
    shutil.rmtree(workdir, ignore_errors=True)
    cfg = config(s, steps, seed, family, partial=partial, sft_steps=sft_steps)
    t0 = time.monotonic()
    train.train_and_evaluate(cfg, workdir, grader=SleepingStandInGrader())
    wall = time.monotonic() - t0
    rows = writers.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    ms = [r for r in rows if r.get("phase", "train") == "train" and "step_time_s" in r]
    evals = [r for r in rows if r.get("phase") == "eval" and "eval_pass_rate" in r]
    timed = ms[1:] or ms  # the first step compiles the update
    per_step = sum(r["step_time_s"] for r in timed) / len(timed)

    def mean(key, rows=ms):
        return _mean([r.get(key) for r in rows])

    return {
        "family": family,
        "staleness": item,
        "max_staleness": s,
        "partial_rollout": partial,
        "seed": seed,
        "steps": len(ms),
        "wall_s": wall,
        "step_time_s": per_step,
        "steps_per_hour": 3600.0 / per_step,
        "grade_wait_s": mean("grade_wait_s", timed),
        "staleness_mean": mean("async/staleness") if s else 0.0,
        "ks_length": mean("async/ks_length"),
        "ks_grading_latency": mean("async/ks_grading_latency"),
        "logprob_mismatch_k3": mean("rollout/logprob_mismatch_k3"),
        "offpolicy_token_frac": mean("async/offpolicy_token_frac") if s else 0.0,
        "pass_rate": mean("pass_rate"),
        "eval_pass_rate_start": evals[0]["eval_pass_rate"] if evals else float("nan"),
        "eval_pass_rate": evals[-1]["eval_pass_rate"] if evals else float("nan"),
        "load": os.getloadavg()[0],
    }


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (family, staleness): means over the seeds, the ratio to the synchronous
    steps per hour, and whether the mean held-out pass rate lies within the synchronous seeds'
    spread."""
    rows = []
    for family in dict.fromkeys(r["family"] for r in runs):
        fam = [r for r in runs if r["family"] == family]
        sync = [r for r in fam if r["staleness"] == "0"]
        base = _mean([r["steps_per_hour"] for r in sync]) if sync else float("nan")
        lo = min((r["eval_pass_rate"] for r in sync), default=float("nan"))
        hi = max((r["eval_pass_rate"] for r in sync), default=float("nan"))
        for item in dict.fromkeys(r["staleness"] for r in fam):
            rs = [r for r in fam if r["staleness"] == item]
            sph = [r["steps_per_hour"] for r in rs]
            evals = [r["eval_pass_rate"] for r in rs]
            row = {
                "family": family,
                "staleness": item,
                "seeds": [r["seed"] for r in rs],
                "steps_per_hour": _mean(sph),
                "steps_per_hour_sd": statistics.stdev(sph) if len(sph) > 1 else 0.0,
                "speedup": _mean(sph) / base,
                "eval_pass_rate": _mean(evals),
                "eval_pass_rate_seeds": evals,
                "sync_eval_spread": [lo, hi],
                "eval_within_sync_spread": bool(lo <= _mean(evals) <= hi),
            }
            for key in (
                "grade_wait_s",
                "staleness_mean",
                "ks_length",
                "ks_grading_latency",
                "logprob_mismatch_k3",
                "offpolicy_token_frac",
                "load",
                "wall_s",
            ):
                row[key] = _mean([r[key] for r in rs])
            rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'family':<10} {'S':>3} {'steps/h':>8} {'sd':>6} {'x sync':>6} {'eval':>6} "
        f"{'in spread':>9} {'wait s':>7} {'stale':>5} {'ks_len':>6} {'ks_lat':>6} "
        f"{'mm_k3':>8} {'old tok':>7} {'load':>5}"
    )
    for r in rows:
        print(
            f"{r['family']:<10} {r['staleness']:>3} {r['steps_per_hour']:8.0f} "
            f"{r['steps_per_hour_sd']:6.0f} {r['speedup']:6.2f} {r['eval_pass_rate']:6.3f} "
            f"{str(r['eval_within_sync_spread']):>9} {r['grade_wait_s']:7.2f} "
            f"{r['staleness_mean']:5.2f} {r['ks_length']:6.3f} {r['ks_grading_latency']:6.3f} "
            f"{r['logprob_mismatch_k3']:8.1e} {r['offpolicy_token_frac']:7.3f} {r['load']:5.2f}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--staleness",
        default="0,1,2,2p",
        help="comma-separated max_staleness values; '<S>p' adds partial rollouts and the "
        "off-policy token mask (multi-turn families only)",
    )
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="toy_gagar,toy_agent")
    ap.add_argument("--sft_steps", type=int, default=200)
    ap.add_argument("--out", default="runs/bench_async")
    args = ap.parse_args()
    families = args.families.split(",")
    for f in families:
        if f not in ("toy_gagar", "toy_agent"):
            raise SystemExit(f"--families: toy_gagar|toy_agent, got {f!r}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    runs = []
    for family in families:
        for item in args.staleness.split(","):
            if item.endswith("p") and family != "toy_agent":
                continue  # partial rollouts interrupt episodes between turns
            for seed in (int(x) for x in args.seeds.split(",")):
                runs.append(run_one(family, item, seed, args.steps, args.out, args.sft_steps))
                print(json.dumps(runs[-1]), flush=True)
    rows = summarize(runs)
    total = time.monotonic() - t0
    print_rows(rows)
    print(
        f"total {total:.0f} s; load average {load0:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end"
    )
    with open(os.path.join(args.out, "async.json"), "w", encoding="utf-8") as f:
        json.dump({"args": vars(args), "total_s": total, "runs": runs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
