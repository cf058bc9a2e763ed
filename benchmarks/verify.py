"""Benchmark: cost of the verifiers against unsandboxed baselines measured in the same run.

Run: `make bench` (or `.venv/bin/python benchmarks/verify.py [--quick]`), as root with bubblewrap.

Rows (median wall time per call; ratio to the row's baseline):

* sandbox start: `/bin/true` and `python3 -c pass` bare (`subprocess.run`) vs `run_sandboxed`
  under each available mechanism (SANDBOX.md measured about +6-10 ms for the bwrap chain).
* repo verifier: `verify_repo_patch` on the statkit fixture (copy, reset, sandboxed pytest,
  outcome report, monitor) vs plain `python -m pytest` of the same tree with no sandbox.
* toy verifier and monitor: calls per second (in-process, no sandbox).
* behaviour monitor per rollout (``monitor_table``): milliseconds per rollout of ``monitor`` (the
  AST and text rules, leakage screen, a 40-event trajectory) on the fixture patches, and on the
  pathological inputs that used to backtrack (a 208 KB patch line, a 64 KB repeated action).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gagar_jax.envs import ToyTaskGenerator, candidate_patches, verify  # noqa: E402
from gagar_jax.verify import sandbox as sb  # noqa: E402
from gagar_jax.verify.monitor import context_for_repo_task, monitor, monitor_patch  # noqa: E402
from gagar_jax.verify.repo import RepoTask, verify_repo_patch, write_tree  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "repos", "statkit")


def timed(fn, n: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def row(name: str, seconds: float, base: float | None) -> None:
    ratio = f"{seconds / base:6.2f}x" if base else "   base"
    print(f"  {name:46s} {seconds * 1e3:9.2f} ms  {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = 5 if args.quick else 20
    py, pythonpath = sb.python_for_sandbox()
    avail = [m for m, why in sb.available_mechanisms().items() if why is None]
    work = tempfile.mkdtemp(prefix="gagar_bench_")
    os.chmod(work, 0o755)

    print(f"sandbox start (median of {n}; mechanisms here: {', '.join(avail)})")
    for argv in (["/bin/true"], [py, "-c", "pass"]):
        label = " ".join(os.path.basename(a) for a in argv)
        base = timed(lambda a=argv: subprocess.run(a, check=True), n)
        row(f"{label}: bare subprocess", base, None)
        for m in avail:
            cfg = sb.SandboxConfig(mechanism=m)
            t = timed(lambda a=argv, c=cfg: sb.run_sandboxed(a, work, config=c), n)
            row(f"{label}: {m}", t, base)

    print(f"repo verifier, statkit fixture, minimal fix (median of {max(3, n // 4)})")
    task = RepoTask.from_dir(FIXTURE)
    with open(os.path.join(FIXTURE, "patches", "minimal.diff")) as f:
        patch = f.read()
    plain = tempfile.mkdtemp(prefix="gagar_bench_plain_")
    write_tree(plain, task.files)
    env = dict(os.environ, PYTHONPATH=":".join(pythonpath), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    base = timed(lambda: subprocess.run(
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *task.required_tests], cwd=plain,
        env=env, capture_output=True), max(3, n // 4))  # fmt: skip
    row("pytest, no sandbox, no verification", base, None)
    t = timed(lambda: verify_repo_patch(task, patch), max(3, n // 4))
    row("verify_repo_patch (bwrap chain + outcome pipe + monitor)", t, base)

    print("in-process verifiers (calls per second)")
    tasks = ToyTaskGenerator(0, 2).tasks(50)
    pairs = [(t, p) for t in tasks for p in candidate_patches(t).values()]
    t0 = time.perf_counter()
    for t, p in pairs:
        verify(t, p)
    dt = time.perf_counter() - t0
    print(f"  toy verify (difficulty 2, all patch kinds)       {len(pairs) / dt:9.0f} /s")
    ctx = context_for_repo_task(task)
    patches = [open(os.path.join(FIXTURE, "patches", f)).read()
               for f in sorted(os.listdir(os.path.join(FIXTURE, "patches")))]  # fmt: skip
    t0 = time.perf_counter()
    for _ in range(20):
        for p in patches:
            monitor_patch(p, ctx)
    dt = time.perf_counter() - t0
    print(f"  monitor_patch (statkit fixture patches)          {20 * len(patches) / dt:9.0f} /s")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(plain, ignore_errors=True)
    monitor_table(n)


def monitor_table(n: int) -> None:
    """Time of the behaviour monitor per rollout (median of ``n``), in the trainer's process."""
    task = RepoTask.from_dir(FIXTURE)
    ctx = context_for_repo_task(task)
    pdir = os.path.join(FIXTURE, "patches")
    patches = {f[:-5]: open(os.path.join(pdir, f)).read() for f in sorted(os.listdir(pdir))}
    kinds = ("tool_call", "observation")
    line = "cat /workdir/statkit/stats.py | head -{}\n"
    events = [{"turn": k // 2, "kind": kinds[k % 2], "text": line.format(k) * 3} for k in range(40)]
    head = "--- a/statkit/stats.py\n+++ b/statkit/stats.py\n@@ -1,0 +1,1 @@\n+"
    odd = {"208 KB line of digits": (head + "1" * 208_000 + "\n", []),
           "208 KB line except+spaces": (head + "except" + " " * 208_000 + "x\n", []),
           "64 KB repeated action": (patches["minimal"], [
               {"turn": 0, "kind": "tool_call", "text": "git log " * 8000}])}  # fmt: skip
    print(f"behaviour monitor per rollout (median of {n}; patch rules + 40-event trajectory)")
    for name, p in patches.items():
        row(f"monitor: statkit {name}", timed(lambda p=p: monitor(p, events, ctx), n), None)
    for name, (p, ev) in odd.items():
        row(f"monitor: {name}", timed(lambda p=p, ev=ev: monitor(p, ev, ctx), max(3, n // 4)), None)


if __name__ == "__main__":
    main()
