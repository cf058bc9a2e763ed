"""Real-package tasks: factory yield and throughput, validation time against bare pytest, and
environment build and reuse times.

Full measurement (the goals: 200 validated tasks from 8 packages in at most 60 minutes, 100
tasks validated with ``--runs 3`` in at most 10 minutes, both on 2 cores; needs a quiet machine,
at most about 70 minutes)::

    python benchmarks/tasks.py --out runs/bench_tasks_full

Short version (2 packages; 3.4 minutes on a 2-core machine at load average 9 to 14; its rates
are those of a short run with a larger share of per-package set-up)::

    python benchmarks/tasks.py --packages cachetools==8.0.2,toolz==1.0.0 \\
        --tasks-per-package 8 --validate-tasks 16 --compare 6 --out runs/bench_tasks_short

Steps, each printed with the machine's load average (``os.getloadavg``) and the CPU seconds
it took (this process and every finished child: the sandboxed runs), so a figure from a
loaded machine can be told from a quiet one:

1. environments: builds the packages' environment in a fresh cache (cold: resolution, install,
   bytecode), then looks it up again in a new process (reuse: the remembered resolution) and
   in the same process (memo);
2. the factory (``python -m gagar_jax.data.synth``) into ``OUT/pool``: tasks, tasks per hour,
   seconds per task, yield (kept / screened mutants), the transform mix, rejections by reason;
3. for ``--compare`` tasks: one sandboxed verification of the gold patch
   (``verify.verify_repo_patch``) against the bare ``pytest`` run of the same test ids on the
   same tree and environment, outside the sandbox, without the outcome plugin;
4. ``python -m gagar_jax.data.swe validate --runs 3`` over the first ``--validate-tasks`` rows:
   seconds per task, and the projection to 100 tasks.

Results go to ``OUT/tasks_bench.json`` and a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gagar_jax.data import repos, swe, synth  # noqa: E402
from gagar_jax.verify.repo import (  # noqa: E402
    env_site_packages,
    prepare_tree,
    verify_repo_patch,
    write_tree,
)
from gagar_jax.verify.sandbox import python_for_sandbox  # noqa: E402

# the Makefile's TASK_PACKAGES (make tasks)
DEFAULT_PACKAGES = (
    "toolz==1.0.0,cachetools==8.0.2,six==1.17.0,inflection==0.5.1,"
    "wcwidth==0.2.13,semver==3.1.2,boltons==26.2.0,idna==3.20,pathspec==1.1.1,"
    "more-itertools==11.2.1"
)


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def cpu_seconds() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Step:
    """Wall time, CPU seconds and load average around one step."""

    def __init__(self, name: str, res: dict):
        self.name, self.res = name, res

    def __enter__(self):
        self.t0, self.c0, self.l0 = time.monotonic(), cpu_seconds(), load()
        return self

    def __exit__(self, *exc):
        self.res.setdefault("steps", {})[self.name] = {
            "seconds": round(time.monotonic() - self.t0, 1),
            "cpu_seconds": round(cpu_seconds() - self.c0, 1),
            "load_start": self.l0,
            "load_end": load(),
        }
        s = self.res["steps"][self.name]
        print(
            f"[{self.name}] {s['seconds']} s wall, {s['cpu_seconds']} CPU-s, load "
            f"{s['load_start']} -> {s['load_end']}",
            flush=True,
        )


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


def env_figures(specs: list[str], cache: str, res: dict) -> None:
    """Cold build, new-process reuse and in-process reuse of the packages' environments."""
    reqs = []
    with tempfile.TemporaryDirectory(prefix="bench_sdists_") as d:
        for spec in specs:
            top = synth.extract_sdist(
                synth.download_sdist(spec, os.path.join(cache, "sdists")), tempfile.mkdtemp(dir=d)
            )
            deps = repos.package_requirements(synth._clean_tree(repos.read_text_tree(top)))
            if deps not in reqs:
                reqs.append(deps)
    out = []
    for deps in reqs:
        cold = repos.build_env(deps, cache_dir=cache)
        code = (
            "import json, sys; from gagar_jax.data import repos; "
            "e = repos.build_env(json.loads(sys.argv[1]), cache_dir=sys.argv[2]); "
            "print(json.dumps([e.seconds, e.reused, e.env_hash]))"
        )
        r = subprocess.run(
            [sys.executable, "-c", code, json.dumps(deps), cache],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": ROOT},
        )
        new_s, new_reused, new_hash = json.loads(r.stdout.strip().splitlines()[-1])
        memo = repos.build_env(deps, cache_dir=cache)
        out.append(
            {
                "requirements": deps,
                "env_hash": cold.env_hash,
                "cold_build_s": round(cold.seconds, 2),
                "cold_was_reused": cold.reused,
                "new_process_reuse_s": round(new_s, 3),
                "new_process_reused": new_reused and new_hash == cold.env_hash,
                "in_process_reuse_s": round(memo.seconds, 4),
            }
        )
    res["envs"] = out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packages", default=DEFAULT_PACKAGES)
    ap.add_argument("--tasks-per-package", type=int, default=25)
    ap.add_argument("--max-candidates", type=int, default=200)
    ap.add_argument(
        "--validate-tasks",
        type=int,
        default=100,
        help="rows of the pool validated with --runs 3 (the first ones)",
    )
    ap.add_argument(
        "--compare", type=int, default=10, help="tasks timed in the sandbox and with bare pytest"
    )
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--out", default="runs/bench_tasks")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    pool, cache = os.path.join(out, "pool"), os.path.join(out, "cache")
    shutil.rmtree(os.path.join(cache, "envs"), ignore_errors=True)  # a cold environment build
    os.makedirs(out, exist_ok=True)
    specs = [p.strip() for p in args.packages.split(",") if p.strip()]
    res: dict = {"packages": specs, "cores": os.cpu_count(), "load_start": load()}
    print(f"{len(specs)} packages, {os.cpu_count()} cores, load {load()}", flush=True)

    with Step("environments", res):
        env_figures(specs, cache, res)

    with Step("factory", res):
        cmd = [
            sys.executable,
            "-m",
            "gagar_jax.data.synth",
            "--packages",
            ",".join(specs),
            "--out",
            pool,
            "--tasks-per-package",
            str(args.tasks_per_package),
            "--max-candidates",
            str(args.max_candidates),
            "--cache",
            cache,
        ]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        print(r.stdout[-2000:], r.stderr[-2000:], sep="\n")
    with open(os.path.join(pool, "synth_stats.json")) as f:
        stats = json.load(f)
    keys = (
        "tasks",
        "packages_with_tasks",
        "seconds",
        "tasks_per_hour",
        "seconds_per_task",
        "yield",
        "transform_mix",
        "cpu_seconds",
        "workers",
    )
    res["factory"] = {k: stats.get(k) for k in keys}
    res["factory"]["rejected"] = {}
    for p in stats["per_package"]:
        for k, n in p["rejected"].items():
            res["factory"]["rejected"][k] = res["factory"]["rejected"].get(k, 0) + n
    keys = ("package", "kept", "screened", "suite_seconds", "seconds", "error")
    res["per_package"] = [{k: p[k] for k in keys} for p in stats["per_package"]]

    insts = swe.load_instances(os.path.join(pool, "instances.jsonl"))
    with Step("compare", res):
        rows = []
        for inst in insts[: args.compare]:
            t = swe.to_repo_task(inst, os.path.join(pool, "repos"), cache_dir=cache)
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

    n_val = min(args.validate_tasks, len(insts))
    subset = os.path.join(out, "validate_instances.jsonl")
    swe.write_instances(subset, insts[:n_val])
    with Step("validate", res):
        cmd = [sys.executable, "-m", "gagar_jax.data.swe", "validate", "--instances", subset,
               "--repos", os.path.join(pool, "repos"), "--runs", "3", "--out",
               os.path.join(out, "validate.jsonl"), "--cache", cache]  # fmt: skip  # argv pairs
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        v = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    vs = res["steps"]["validate"]
    res["validate"] = {
        "tasks": n_val,
        "rc": v.returncode,
        "seconds": vs["seconds"],
        "seconds_per_task": round(vs["seconds"] / max(n_val, 1), 2),
        "cpu_seconds_per_task": round(vs["cpu_seconds"] / max(n_val, 1), 2),
        "projected_100_tasks_s": round(vs["seconds"] / max(n_val, 1) * 100),
        "summary": v.stdout.strip().splitlines()[-1] if v.stdout.strip() else v.stderr[-500:],
    }
    res["load_end"] = load()
    with open(os.path.join(out, "tasks_bench.json"), "w") as f:
        json.dump(res, f, indent=1)

    fa, va, fs = res["factory"], res["validate"], res["steps"]["factory"]
    envs = res["envs"]
    print(
        f"\n| figure | value |\n|---|---|\n"
        f"| packages | {len(specs)} ({fa['packages_with_tasks']} gave tasks), "
        f"{os.cpu_count()} cores |\n"
        f"| factory | {fa['tasks']} tasks in {fa['seconds']} s: {fa['tasks_per_hour']} "
        f"tasks/hour, {fa['seconds_per_task']} s per task, {fa['cpu_seconds']} CPU-s "
        f"(load {fs['load_start']} -> {fs['load_end']}) |\n"
        f"| yield (kept / screened mutants) | {fa['yield']:.0%}; rejected "
        f"{fa['rejected']} |\n"
        f"| transform mix | {fa['transform_mix']} |\n"
        f"| env build, cold (s) | {[e['cold_build_s'] for e in envs]} |\n"
        f"| env reuse, new process / same process (s) | "
        f"{[(e['new_process_reuse_s'], e['in_process_reuse_s']) for e in envs]} |\n"
        f"| one sandboxed verification, median (s) | {res.get('verify_s_median')} |\n"
        f"| bare pytest, same tests, median (s) | {res.get('bare_pytest_s_median')} |\n"
        f"| validate --runs 3 | {va['tasks']} tasks in {va['seconds']} s: "
        f"{va['seconds_per_task']} s and {va['cpu_seconds_per_task']} CPU-s per task; "
        f"100 tasks -> {va['projected_100_tasks_s']} s (load {vs['load_start']} -> "
        f"{vs['load_end']}) |\n"
        f"| load average (1/5/15 min) start -> end | {res['load_start']} -> "
        f"{res['load_end']} |"
    )
    return 0 if fa["tasks"] and v.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
