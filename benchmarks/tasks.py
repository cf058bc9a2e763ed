"""Real-package tasks: factory yield and throughput, verification time against bare pytest, and
environment build and reuse times.

    python benchmarks/tasks.py --packages cachetools==8.0.2,toolz==1.0.0 --tasks-per-package 4 \
        --out runs/bench_tasks

1. runs the factory (``python -m gagar_jax.data.synth``) into ``OUT/pool`` with a fresh cache
   (so the environment build is measured), reporting its yield (kept / screened mutants),
   tasks per hour and the transform mix;
2. builds each package's environment again from the warm cache (the reuse time);
3. for every task: one sandboxed verification of the gold patch
   (``verify.verify_repo_patch``) against the bare ``pytest`` run of the same test ids on the
   same tree and environment, outside the sandbox, without the outcome plugin;
4. validates the pool (``python -m gagar_jax.data.swe validate --runs 3``) and reports its
   time per task.

Every figure is printed with the machine's load average (``os.getloadavg``) at the time: on a
shared machine the numbers move with it. Results go to ``OUT/tasks_bench.json`` and a markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gagar_jax.data import repos, swe  # noqa: E402
from gagar_jax.verify.repo import (  # noqa: E402
    env_site_packages,
    prepare_tree,
    verify_repo_patch,
    write_tree,  # noqa: E402
)
from gagar_jax.verify.sandbox import python_for_sandbox  # noqa: E402


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def bare_pytest_seconds(task) -> float:
    """Wall time of plain pytest on the task's tree (gold patch applied), same ids, same env."""
    files, _ = prepare_tree(task, task.reference_patch)
    exe, _ = python_for_sandbox()
    with tempfile.TemporaryDirectory(prefix="bare_pytest_") as d:
        write_tree(d, files)
        env = {
            **os.environ,
            "PYTHONPATH": ":".join(env_site_packages(task.env_path)),
            "PYTEST_ADDOPTS": "",
        }
        t0 = time.monotonic()
        subprocess.run([exe, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "-o", "pythonpath=" + " ".join((".", *task.pythonpath)), "--",
                        *task.required_tests], cwd=d, env=env, capture_output=True,
                       check=False)  # fmt: skip  # argv pairs
        return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packages", default="cachetools==8.0.2,toolz==1.0.0")
    ap.add_argument("--tasks-per-package", type=int, default=4)
    ap.add_argument("--max-candidates", type=int, default=60)
    ap.add_argument("--out", default="runs/bench_tasks")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    pool, cache = os.path.join(out, "pool"), os.path.join(out, "cache")
    os.makedirs(out, exist_ok=True)
    res: dict = {"packages": args.packages, "load_start": load()}

    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagar_jax.data.synth",
            "--packages",
            args.packages,
            "--out",
            pool,
            "--tasks-per-package",
            str(args.tasks_per_package),
            "--max-candidates",
            str(args.max_candidates),
            "--cache",
            cache,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    res["factory_seconds"] = round(time.monotonic() - t0, 1)
    res["factory_load_end"] = load()
    print(r.stdout[-3000:], r.stderr[-2000:], sep="\n")
    with open(os.path.join(pool, "synth_stats.json")) as f:
        stats = json.load(f)
    res["factory"] = {
        k: stats[k]
        for k in ("tasks", "tasks_per_hour", "seconds_per_task", "yield", "transform_mix")
    }
    res["env_build_seconds"] = {
        p["package"]: round(p["env_seconds"], 1) for p in stats["per_package"]
    }
    res["suite_seconds"] = {
        p["package"]: round(p["suite_seconds"], 1) for p in stats["per_package"]
    }

    insts = swe.load_instances(os.path.join(pool, "instances.jsonl"))
    tasks = [swe.to_repo_task(i, os.path.join(pool, "repos"), cache_dir=cache) for i in insts]
    reuse = []
    for t in tasks:
        t1 = time.monotonic()
        e = repos.build_env(
            list(next(i for i in insts if i.instance_id == t.task_id).python_deps), cache_dir=cache
        )
        reuse.append((time.monotonic() - t1, e.reused))
    res["env_reuse_seconds_median"] = round(statistics.median(s for s, _ in reuse), 2)
    res["env_reused_all"] = all(u for _, u in reuse)

    rows = []
    for t in tasks:
        t1 = time.monotonic()
        v = verify_repo_patch(t, t.reference_patch, run_monitor=False)
        ver = time.monotonic() - t1
        rows.append(
            {
                "task": t.task_id,
                "tests": len(t.required_tests),
                "verify_s": round(ver, 2),
                "bare_pytest_s": round(bare_pytest_seconds(t), 2),
                "status": v.status,
            }
        )
    res["per_task"] = rows
    if rows:
        res["verify_s_median"] = statistics.median(x["verify_s"] for x in rows)
        res["bare_pytest_s_median"] = statistics.median(x["bare_pytest_s"] for x in rows)
    res["verify_load_end"] = load()

    t1 = time.monotonic()
    v = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagar_jax.data.swe",
            "validate",
            "--instances",
            os.path.join(pool, "instances.jsonl"),
            "--repos",
            os.path.join(pool, "repos"),
            "--runs",
            "3",
            "--out",
            os.path.join(out, "validate.jsonl"),
            "--cache",
            cache,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    res["validate_seconds"] = round(time.monotonic() - t1, 1)
    res["validate_rc"] = v.returncode
    res["validate_summary"] = v.stdout.strip().splitlines()[-1] if v.stdout.strip() else ""
    res["validate_seconds_per_task"] = round(res["validate_seconds"] / max(len(tasks), 1), 1)
    res["load_end"] = load()
    with open(os.path.join(out, "tasks_bench.json"), "w") as f:
        json.dump(res, f, indent=1)

    f = res["factory"]
    print(
        f"\n| figure | value |\n|---|---|\n"
        f"| packages | {args.packages} |\n"
        f"| tasks made | {f['tasks']} in {res['factory_seconds']} s |\n"
        f"| yield (kept / screened mutants) | {f['yield']:.0%} |\n"
        f"| tasks per hour | {f['tasks_per_hour']} |\n"
        f"| transform mix | {f['transform_mix']} |\n"
        f"| env build (s, cold cache) | {res['env_build_seconds']} |\n"
        f"| env reuse (s, median) | {res['env_reuse_seconds_median']} |\n"
        f"| one verification, median (s) | {res.get('verify_s_median')} |\n"
        f"| bare pytest, same tests, median (s) | {res.get('bare_pytest_s_median')} |\n"
        f"| validate --runs 3, per task (s) | {res['validate_seconds_per_task']} |\n"
        f"| load average (1/5/15 min) start -> end | {res['load_start']} -> "
        f"{res['load_end']} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
