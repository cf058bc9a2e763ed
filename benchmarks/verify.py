"""Benchmark: cost of the verifiers against unsandboxed baselines measured in the same run.

Run: `make bench` (or `.venv/bin/python benchmarks/verify.py [--quick]`), as root with bubblewrap.

Rows (median wall time per call; ratio to the row's baseline):

* sandbox start: `/bin/true` and `python3 -c pass` bare (`subprocess.run`) vs `run_sandboxed`
  under each available mechanism (SANDBOX.md measured about +6-10 ms for the bwrap chain).
* repo verifier: `verify_repo_patch` on the statkit fixture (copy, reset, sandboxed pytest,
  outcome report, monitor) vs plain `python -m pytest` of the same tree with no sandbox.
* toy verifier and monitor: calls per second (in-process, no sandbox).
* execution back-ends: tasks per second local vs Ray with one and two simulated nodes, and the
  per-call dispatch overhead (``execution_table``; ``--only=execution`` runs just this table).
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
from gagar_jax.verify.monitor import context_for_repo_task, monitor_patch  # noqa: E402
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


def execution_table(quick: bool = False) -> None:
    """Verification throughput on the execution back-ends and the per-call dispatch overhead.

    Tasks per second of ``verify_repo_call`` on the fixture tasks (statkit and slugger with their
    minimal fixes) for ``local`` (the trainer's process, one call after the other) and ``ray``
    on a simulated cluster (``ray.cluster_utils.Cluster``: a head without CPUs plus one, then
    two, worker nodes of 2 CPUs each that advertise ``verifier``), every call submitted at once
    (at most 8 in flight). Dispatch overhead: the median round trip of a call that does nothing
    (``os.getpid``), in the caller's thread, in an isolated child process, and as a Ray task
    (which also runs an isolated child). Simulated nodes share this machine's cores: the load
    average is printed with the table, and two nodes cannot beat one when the cores are busy.
    """
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        print("execution back-ends: ray not installed (pip install -e '.[ray]'); skipped")
        return
    from gagar_jax.verify import execution

    fixtures = os.path.join(os.path.dirname(FIXTURE))
    jobs = []
    for name in ("statkit", "slugger"):
        task = RepoTask.from_dir(os.path.join(fixtures, name))
        with open(os.path.join(fixtures, name, "patches", "minimal.diff")) as f:
            jobs.append((task, f.read()))
    jobs = jobs * (2 if quick else 4)
    n_noop = 5 if quick else 20

    def throughput(backend) -> tuple[float, int]:
        t0 = time.perf_counter()
        verdicts = backend.gather([
            lambda t=t, p=p: execution.verify_repo_call(t, p, backend=backend) for t, p in jobs])
        dt = time.perf_counter() - t0
        return len(jobs) / dt, sum(v.status == "passed" for v in verdicts)

    def overhead(backend) -> float:
        return timed(lambda: backend.call(os.getpid, deadline_s=60), n_noop)

    print(f"execution back-ends: {len(jobs)} verifications of the fixture tasks; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} cores")
    print(f"  {'back-end':34s} {'tasks/s':>9s} {'passed':>7s} {'dispatch ms':>12s}")
    local = execution.LocalBackend()
    tps, ok = throughput(local)
    print(f"  {'local (caller thread)':34s} {tps:9.2f} {ok:>4d}/{len(jobs):<2d} "
          f"{overhead(local) * 1e3:12.2f}")
    iso = execution.LocalBackend(isolate=True)
    print(f"  {'local, isolated child per call':34s} {'':>9s} {'':>7s} "
          f"{overhead(iso) * 1e3:12.2f}")
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, object_store_memory=100 << 20, include_dashboard=False))
    try:
        node_args = dict(num_cpus=2, resources={"verifier": 2}, object_store_memory=100 << 20,
                         env_vars={"PYTHONPATH": os.path.abspath(
                             os.path.join(os.path.dirname(__file__), ".."))})
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        for nodes in (1, 2):
            if nodes == 2:
                cluster.add_node(**node_args)
                cluster.wait_for_nodes()
            with execution.RayBackend(max_inflight=8, resources=execution.CallResources(
                    1.0, 0, {"verifier": 1})) as rb:
                rb.call(os.getpid, deadline_s=120)  # warm the workers
                tps, ok = throughput(rb)
                over = overhead(rb)
                m = rb.metrics()
            print(f"  {f'ray, {nodes} simulated node(s)':34s} {tps:9.2f} {ok:>4d}/{len(jobs):<2d} "
                  f"{over * 1e3:12.2f}   (queue wait mean {m['execution/queue_wait_s']:.2f} s)")
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("all", "execution"), default="all",
                    help="'execution': only the execution back-end table")
    args = ap.parse_args()
    if args.only == "execution":
        execution_table(args.quick)
        return
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
    execution_table(args.quick)


if __name__ == "__main__":
    main()
