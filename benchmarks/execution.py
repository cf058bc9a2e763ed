"""Benchmark: verification throughput on the execution back-ends, and the cost of a dispatch.

Run (as root with bubblewrap, ``ray`` installed; about 4 minutes on a quiet 2-core machine,
under a minute with ``--quick``)::

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python benchmarks/execution.py [--quick]

Tasks: real-package tasks in SWE-bench form (``tests/swe_fixtures.py``: a ``src/`` layout package
whose hidden test imports ``cachetools`` from the package registry), built as the loader builds
them (a git snapshot and a uv environment resolved to a lockfile), each verified with its gold
patch (passes) and with an empty patch (fails).

Rows:

* ``local``: ``verify_repo_call`` in the caller's thread, one call after the other (the default
  back-end).
* ``ray, N node(s)``: the same calls on a simulated cluster (``ray.cluster_utils.Cluster``: a
  head without CPUs and N worker nodes of 2 CPUs that advertise ``verifier``), all submitted at
  once (at most 8 in flight). ``cold``: the first pass, in which each node builds the task's
  environment from its lockfile (``execution/env_builds``); ``warm``: the passes after it.
* ``dispatch ms``: the median round trip of a call that does nothing (``os.getpid``): in the
  caller's thread, in an isolated child process (what every Ray call also runs), as a Ray task.

The simulated nodes share this machine's cores, so two nodes cannot beat one when the cores are
busy: the table measures what going through Ray costs, not the scaling of a real cluster. The
load average is printed before and after; a figure taken under load is not a quiet-machine one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def package_jobs(tmp: str, copies: int) -> list[tuple]:
    """``copies`` x (the gold patch, the empty patch) of the real-package task."""
    from swe_fixtures import src_layout_row

    from gagar_jax.data import swe

    repos_dir, cache = os.path.join(tmp, "repos"), os.path.join(tmp, "cache")
    inst = swe.parse_instance(src_layout_row(repos_dir))
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache)
    return [(task, inst.patch, "passed"), (task, "", "failed")] * copies


def throughput(backend, jobs) -> tuple[float, int]:
    """Tasks per second of the jobs on ``backend`` (all submitted at once), and how many gave
    the expected verdict."""
    from gagar_jax.verify import execution

    t0 = time.perf_counter()
    verdicts = backend.gather(
        [lambda t=t, p=p: execution.verify_repo_call(t, p, backend=backend) for t, p, _ in jobs]
    )
    dt = time.perf_counter() - t0
    return len(jobs) / dt, sum(v.status == want for v, (_, _, want) in zip(verdicts, jobs))


def dispatch_s(backend, n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = backend.call(os.getpid, deadline_s=120)
        samples.append(time.perf_counter() - t0)
        assert r.ok, r.error
    return statistics.median(samples)


def line(name: str, tps: float | None, ok: str, ms: float | None, note: str = "") -> None:
    t = f"{tps:9.3f}" if tps is not None else " " * 9
    d = f"{ms:12.1f}" if ms is not None else " " * 12
    print(f"  {name:30s} {t} {ok:>7s} {d}   {note}", flush=True)


def run(quick: bool = False) -> None:
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        print("execution back-ends: ray is not installed (pip install -e '.[ray]'); skipped")
        return
    from gagar_jax.verify import execution

    copies, warm_passes, n_noop = (1, 1, 5) if quick else (4, 2, 20)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gagar_bench_exec_") as tmp:
        os.chmod(tmp, 0o755)
        jobs = package_jobs(tmp, copies)
        print(
            f"execution back-ends: {len(jobs)} verifications of a real-package task per pass "
            f"(gold and empty patch); load average {_load()}",
            flush=True,
        )
        print(f"  {'back-end':30s} {'tasks/s':>9s} {'right':>7s} {'dispatch ms':>12s}")
        local = execution.LocalBackend()
        throughput(local, jobs[:2])  # warm-up: the sandbox's preflight, caches
        tps, ok = throughput(local, jobs)
        line("local (caller thread)", tps, f"{ok}/{len(jobs)}", dispatch_s(local, n_noop) * 1e3)
        iso = execution.LocalBackend(isolate=True)
        line("local, isolated child", None, "", dispatch_s(iso, n_noop) * 1e3)

        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(num_cpus=0, object_store_memory=100 << 20, include_dashboard=False),
        )
        try:

            def add_node(i: int) -> None:
                cluster.add_node(
                    num_cpus=2,
                    resources={"verifier": 2},
                    object_store_memory=100 << 20,
                    env_vars={
                        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
                        "GAGAR_ENV_CACHE": os.path.join(tmp, f"node{i}-envs"),
                    },
                )
                cluster.wait_for_nodes()

            add_node(0)
            ray.init(address=cluster.address, log_to_driver=False)
            for nodes in (1, 2):
                if nodes == 2:
                    add_node(1)
                with execution.RayBackend(
                    max_inflight=8, resources=execution.CallResources(1.0, 0, {"verifier": 1})
                ) as rb:
                    rb.call(os.getpid, deadline_s=120)  # start the workers
                    rb.metrics()
                    tps, ok = throughput(rb, jobs)
                    m = rb.metrics()
                    line(
                        f"ray, {nodes} node(s), cold",
                        tps,
                        f"{ok}/{len(jobs)}",
                        None,
                        f"env builds {m['execution/env_builds']:.0f} "
                        f"({m['execution/env_build_s']:.1f} s)",
                    )
                    rates, right = [], 0
                    for _ in range(warm_passes):
                        tps, ok = throughput(rb, jobs)
                        rates.append(tps)
                        right += ok
                    m = rb.metrics()
                    line(
                        f"ray, {nodes} node(s), warm",
                        statistics.median(rates),
                        f"{right}/{len(jobs) * warm_passes}",
                        dispatch_s(rb, n_noop) * 1e3,
                        f"queue wait mean {m['execution/queue_wait_s']:.2f} s, "
                        f"env builds {m['execution/env_builds']:.0f}",
                    )
        finally:
            ray.shutdown()
            cluster.shutdown()
    print(f"  load average after: {_load()}; {time.monotonic() - t_start:.0f} s in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one copy of the jobs, 5 no-op calls")
    run(ap.parse_args().quick)


if __name__ == "__main__":
    main()
