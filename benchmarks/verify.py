"""Benchmark: cost of the verifiers against unsandboxed baselines measured in the same run.

Run: `make bench` (or `.venv/bin/python benchmarks/verify.py [--quick]`), as root with bubblewrap.

Rows (median wall time per call; ratio to the row's baseline):

* sandbox start: `/bin/true` and `python3 -c pass` bare (`subprocess.run`) vs `run_sandboxed`
  under each available mechanism (SANDBOX.md measured about +6-10 ms for the bwrap chain).
* repo verifier: `verify_repo_patch` on the statkit fixture (copy, reset, sandboxed pytest,
  outcome report, monitor) vs plain `python -m pytest` of the same tree with no sandbox.
* verifier before/after: `verify_repo_patch` (monitor off) on each fixture repository with its
  minimal fix, the current code against a baseline revision (`--baseline`, default the verifier
  before the supervised runner, canaries and the private work tree). Both run in this one
  invocation, each in its own subprocess importing its own copy of the package (the baseline is
  extracted with `git archive`), in alternating rounds so that the machine's load falls on both
  alike; the table gives the median per run, the overhead over plain pytest, and new/old, in
  wall time and in CPU seconds (this process and its children: the sandbox chain, the runner,
  pytest), which a loaded machine does not inflate.
* verify chain per phase (``phase_table``; ``--only=phases`` runs just this table): the median
  time of each host-side phase of ``verify_repo_patch`` on each fixture (behaviour monitor,
  apply + pristine reset + shadowing scan, canaries, tree write, slot/cgroup setup, the
  sandboxed run, the verdict) measured by wrapping the module functions, and inside the sandboxed
  run the cost of each layer measured alone (bwrap start with ``/bin/true``, interpreter start,
  importing pytest through the runner's preflight, the whole runner session), with CPU seconds
  (this process and its children) next to wall time: CPU time is what a loaded machine cannot
  inflate.
* toy verifier and monitor: calls per second (in-process, no sandbox).
* behaviour monitor per rollout (``monitor_table``): milliseconds per rollout of ``monitor`` (the
  AST and text rules, leakage screen, a 40-event trajectory) on the fixture patches, and on the
  pathological inputs that used to backtrack (a 208 KB patch line, a 64 KB repeated action).
* container back-end against bwrap (``container_table``; ``--only=container`` runs just this
  table): ``verify_repo_patch`` (monitor off) on each fixture repository with its minimal fix,
  ``environment="uv"`` (bwrap) and ``environment="container"`` (podman/runc, the base image of
  ``verify.container``) in alternating rounds of one run, median wall and CPU seconds per
  verification and the container's extra time; the load average before and after.
* execution back-ends: tasks per second local vs Ray with one and two simulated nodes, and the
  per-call dispatch overhead (``execution_table``; ``--only=execution`` runs just this table).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gagar_jax.envs import ToyTaskGenerator, candidate_patches, verify  # noqa: E402
from gagar_jax.envs.repo import RepoTask  # noqa: E402
from gagar_jax.verify import sandbox as sb  # noqa: E402
from gagar_jax.verify.monitor import monitor, monitor_patch  # noqa: E402
from gagar_jax.verify.repo import context_for_repo_task, verify_repo_patch, write_tree  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "repos")
FIXTURE = os.path.join(FIXTURES, "statkit")
# The verifier before the supervised runner, canaries and private work tree.
BASELINE = "46fc02d"

_WORKER = r"""
import json, os, resource, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.repo import verify_repo_patch


def cpu():
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


out = {}
for name in sys.argv[3].split(","):
    d = os.path.join(sys.argv[2], name)
    task = RepoTask.from_dir(d)
    patch = open(os.path.join(d, "patches", "minimal.diff")).read()
    v = verify_repo_patch(task, patch, run_monitor=False)  # warm-up (preflight, caches)
    assert v.status == "passed", v.test_log
    samples = []
    for _ in range(int(sys.argv[4])):
        t0, c0 = time.perf_counter(), cpu()
        v = verify_repo_patch(task, patch, run_monitor=False)
        samples.append((time.perf_counter() - t0, cpu() - c0))
        assert v.status == "passed", v.test_log
    out[name] = samples
print(json.dumps(out))
"""


def _baseline_tree(ref: str) -> str | None:
    """The package at git revision ``ref``, extracted to a temporary directory (None: no git)."""
    d = tempfile.mkdtemp(prefix="gagar_bench_base_")
    try:
        data = subprocess.run(
            ["git", "-C", ROOT, "archive", ref, "gagar_jax"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", d], input=data, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"  (no baseline: git archive {ref} failed: {e})")
        shutil.rmtree(d, ignore_errors=True)
        return None
    return d


def _worker(src: str, names: list[str], n: int) -> dict[str, list[list[float]]]:
    r = subprocess.run(
        [sys.executable, "-c", _WORKER, src, FIXTURES, ",".join(names), str(n)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def before_after(ref: str, n: int, rounds: int) -> None:
    names = sorted(os.listdir(FIXTURES))
    base = _baseline_tree(ref)
    if base is None:
        return
    py, pythonpath = sb.python_for_sandbox()
    env = dict(os.environ, PYTHONPATH=":".join(pythonpath), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    samples: dict[str, dict[str, list[float]]] = {
        k: {m: [] for m in names} for k in ("old", "new", "bare")
    }
    cpu: dict[str, dict[str, list[float]]] = {k: {m: [] for m in names} for k in ("old", "new")}
    try:
        for _ in range(rounds):  # alternating: load drift falls on both sides alike
            for side, src in (("old", base), ("new", ROOT)):
                for m, xs in _worker(src, names, n).items():
                    samples[side][m] += [w for w, _ in xs]
                    cpu[side][m] += [c for _, c in xs]
            for m in names:
                task = RepoTask.from_dir(os.path.join(FIXTURES, m))
                plain = tempfile.mkdtemp(prefix="gagar_bench_plain_")
                write_tree(plain, task.files)
                for _ in range(n):
                    t0 = time.perf_counter()
                    subprocess.run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    *task.required_tests], cwd=plain, env=env,
                                   capture_output=True)  # fmt: skip  # argv pairs
                    samples["bare"][m].append(time.perf_counter() - t0)
                shutil.rmtree(plain, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(
        f"verifier before ({ref}) / after, minimal fix, monitor off "
        f"(median of {n * rounds}; load {os.getloadavg()[0]:.1f})"
    )
    print(
        f"  {'repo':10s} {'bare pytest':>12s} {'old':>10s} {'new':>10s} "
        f"{'old ovh':>10s} {'new ovh':>10s} {'new/old':>8s} {'ovh new/old':>12s}"
    )
    for m in names:
        bare, old, new = (statistics.median(samples[k][m]) for k in ("bare", "old", "new"))
        print(
            f"  {m:10s} {bare * 1e3:10.0f}ms {old * 1e3:8.0f}ms {new * 1e3:8.0f}ms "
            f"{(old - bare) * 1e3:8.0f}ms {(new - bare) * 1e3:8.0f}ms {new / old:7.2f}x "
            f"{(new - bare) / max(old - bare, 1e-3):11.2f}x"
        )
    print("  CPU seconds per run (this process + children; not inflated by load)")
    for m in names:
        old, new = (statistics.median(cpu[k][m]) for k in ("old", "new"))
        print(f"  {m:10s} old {old * 1e3:6.0f}ms cpu   new {new * 1e3:6.0f}ms cpu   "
              f"new/old {new / max(old, 1e-6):5.2f}x")  # fmt: skip  # argv pairs


def _cpu() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


# Host-side phases of verify_repo_patch: (module, function, label). Wrapped while the table runs.
_PHASES = (
    ("gagar_jax.verify.repo", "monitor", "behaviour monitor (AST + text rules)"),
    ("gagar_jax.verify.repo", "prepare_tree", "apply + pristine reset + shadowing scan"),
    ("gagar_jax.verify.repo", "shadowing_problem", "  of which: shadowing scan"),
    ("gagar_jax.verify.repo", "sandbox_pytest_problem", "preflight (cached)"),
    ("gagar_jax.verify.repo", "make_canaries", "canaries (one generated module)"),
    ("gagar_jax.verify.repo", "write_tree", "work tree written"),
    ("gagar_jax.verify.repo", "run_sandboxed", "sandboxed run (whole)"),
    ("gagar_jax.verify.sandbox", "_prepare_cgroups", "  of which: slot cgroups"),
    ("gagar_jax.verify.sandbox", "_kill_uid", "  of which: slot uid sweeps"),
    ("gagar_jax.verify.repo", "_judge", "verdict from the record"),
)


def phase_table(n: int) -> None:
    """Per-phase times of ``verify_repo_patch`` (module docstring), median of ``n`` per fixture."""
    from gagar_jax.verify import repo as vrepo

    print(
        f"verify chain per phase (median of {n}; load {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores)"
    )
    for name in sorted(os.listdir(FIXTURES)):
        d = os.path.join(FIXTURES, name)
        task = RepoTask.from_dir(d)
        with open(os.path.join(d, "patches", "minimal.diff")) as f:
            patch = f.read()
        times: dict[str, list[float]] = collections.defaultdict(list)
        saved = []
        for mod_name, fn_name, label in _PHASES:
            mod = importlib.import_module(mod_name)
            fn = getattr(mod, fn_name)
            saved.append((mod, fn_name, fn))

            def wrapped(*a, _fn=fn, _label=label, _times=times, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    _times[_label].append(time.perf_counter() - t0)

            setattr(mod, fn_name, functools.wraps(fn)(wrapped))
        try:
            verify_repo_patch(task, patch)  # warm-up
            times.clear()
            total, cpu = [], []
            for _ in range(n):
                t0, c0 = time.perf_counter(), _cpu()
                v = verify_repo_patch(task, patch)
                total.append(time.perf_counter() - t0)
                cpu.append(_cpu() - c0)
                assert v.status == "passed", v.test_log
        finally:
            for mod, fn_name, fn in saved:
                setattr(mod, fn_name, fn)
        print(
            f"  {name}: verify_repo_patch {statistics.median(total) * 1e3:.0f} ms wall, "
            f"{statistics.median(cpu) * 1e3:.0f} ms CPU"
        )
        for _, _, label in _PHASES:
            xs = times.get(label)
            if xs:
                per_run = sum(xs) / n
                print(f"    {label:44s} {per_run * 1e3:9.2f} ms")
        # Inside the sandboxed run: each layer alone, in a copy of the fixture's tree.
        py, _ = sb.python_for_sandbox()
        paths, _ = vrepo.sandbox_paths(task)
        work_parent = tempfile.mkdtemp(prefix="gagar_bench_phase_")
        os.chmod(work_parent, 0o711)
        work = os.path.join(work_parent, "repo")
        os.mkdir(work)
        write_tree(work, task.files)
        env = {"PYTHONPATH": ":".join(paths), "PYTHONNOUSERSITE": "1"}
        ro = (vrepo.plugin_dir(), *paths)
        layers = (
            ("sandbox start (/bin/true)", ["/bin/true"]),
            ("+ interpreter start (python -P)", [py, "-P", "-c", "pass"]),
            ("+ runner and pytest import (preflight)", [py, "-P", vrepo.runner_path(), "--check"]),
        )
        try:
            for label, argv in layers:

                def run(a=argv, w=work, e=env, r=ro):
                    return sb.run_sandboxed(
                        a, w, vrepo.DEFAULT_LIMITS, env=e, ro_paths=r, private_workdir=True
                    )

                c0 = _cpu()
                t = timed(run, n)
                print(
                    f"    in the sandbox: {label:38s} {t * 1e3:9.2f} ms wall "
                    f"{(_cpu() - c0) / (n + 1) * 1e3:7.1f} ms CPU"
                )
        finally:
            shutil.rmtree(work_parent, ignore_errors=True)
    print(
        "  (the rest of the sandboxed run is the pytest session: collection, the canaries "
        "and the task's tests)"
    )


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
        verdicts = backend.gather(
            [lambda t=t, p=p: execution.verify_repo_call(t, p, backend=backend) for t, p in jobs]
        )
        dt = time.perf_counter() - t0
        return len(jobs) / dt, sum(v.status == "passed" for v in verdicts)

    def overhead(backend) -> float:
        return timed(lambda: backend.call(os.getpid, deadline_s=60), n_noop)

    print(
        f"execution back-ends: {len(jobs)} verifications of the fixture tasks; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on "
        f"{os.cpu_count()} cores"
    )
    print(f"  {'back-end':34s} {'tasks/s':>9s} {'passed':>7s} {'dispatch ms':>12s}")
    local = execution.LocalBackend()
    tps, ok = throughput(local)
    print(
        f"  {'local (caller thread)':34s} {tps:9.2f} {ok:>4d}/{len(jobs):<2d} "
        f"{overhead(local) * 1e3:12.2f}"
    )
    iso = execution.LocalBackend(isolate=True)
    print(f"  {'local, isolated child per call':34s} {'':>9s} {'':>7s} {overhead(iso) * 1e3:12.2f}")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=0, object_store_memory=100 << 20, include_dashboard=False),
    )
    try:
        node_args = dict(
            num_cpus=2,
            resources={"verifier": 2},
            object_store_memory=100 << 20,
            env_vars={"PYTHONPATH": os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))},
        )
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        for nodes in (1, 2):
            if nodes == 2:
                cluster.add_node(**node_args)
                cluster.wait_for_nodes()
            with execution.RayBackend(
                max_inflight=8, resources=execution.CallResources(1.0, 0, {"verifier": 1})
            ) as rb:
                rb.call(os.getpid, deadline_s=120)  # warm the workers
                tps, ok = throughput(rb)
                over = overhead(rb)
                m = rb.metrics()
            print(
                f"  {f'ray, {nodes} simulated node(s)':34s} {tps:9.2f} {ok:>4d}/{len(jobs):<2d} "
                f"{over * 1e3:12.2f}   (queue wait mean {m['execution/queue_wait_s']:.2f} s)"
            )
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the old verifier")
    ap.add_argument("--only-before-after", action="store_true")
    ap.add_argument(
        "--only",
        choices=("all", "execution", "phases", "monitor", "container"),
        default="all",
        help="'execution': only the execution back-end table; 'phases': only the verify chain "
        "per phase; 'monitor': only the monitor's time per rollout",
    )
    args = ap.parse_args()
    if args.only == "container":
        container_table(3 if args.quick else 10)
        return
    if args.only == "execution":
        execution_table(args.quick)
        return
    if args.only == "phases":
        phase_table(3 if args.quick else 10)
        return
    if args.only == "monitor":
        monitor_table(5 if args.quick else 20)
        return
    if args.only_before_after:
        before_after(args.baseline, 3 if args.quick else 5, 2 if args.quick else 3)
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
        env=env, capture_output=True), max(3, n // 4))  # fmt: skip  # argv pairs
    row("pytest, no sandbox, no verification", base, None)
    t = timed(lambda: verify_repo_patch(task, patch), max(3, n // 4))
    row("verify_repo_patch (bwrap chain + outcome pipe + monitor)", t, base)

    before_after(args.baseline, 3 if args.quick else 5, 2 if args.quick else 3)
    phase_table(3 if args.quick else 10)

    print("in-process verifiers (calls per second)")
    tasks = ToyTaskGenerator(0, 2).tasks(50)
    pairs = [(t, p) for t in tasks for p in candidate_patches(t).values()]
    t0 = time.perf_counter()
    for t, p in pairs:
        verify(t, p)
    dt = time.perf_counter() - t0
    print(f"  toy verify (difficulty 2, all patch kinds)       {len(pairs) / dt:9.0f} /s")
    ctx = context_for_repo_task(task)
    patches = [
        open(os.path.join(FIXTURE, "patches", f)).read()
        for f in sorted(os.listdir(os.path.join(FIXTURE, "patches")))
    ]
    t0 = time.perf_counter()
    for _ in range(20):
        for p in patches:
            monitor_patch(p, ctx)
    dt = time.perf_counter() - t0
    print(f"  monitor_patch (statkit fixture patches)          {20 * len(patches) / dt:9.0f} /s")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(plain, ignore_errors=True)
    monitor_table(n)
    execution_table(args.quick)
    container_table(3 if args.quick else 10)


def container_table(rounds: int) -> None:
    """The container back-end's cost per verification against bwrap, both in this run.

    Each round verifies every fixture repository's minimal fix once under bwrap
    (``environment="uv"``) and once in a container (``environment="container"``), alternating,
    so the machine's load falls on both alike; a warm-up round first (the base image is built
    or found, the preflight checks run). Medians of wall time and of CPU seconds (this process
    and its children: for the container, the engine's client; conmon and runc are not its
    children, so the CPU column undercounts it)."""
    from gagar_jax.verify import container as ctr

    try:
        ctr.container_engine()
    except ctr.ContainerUnavailable as e:
        print(f"container back-end: skipped ({e})")
        return
    cache = os.environ.get(
        "GAGAR_CONTAINER_CACHE", os.path.expanduser("~/.cache/gagar_jax/containers")
    )
    ctr.build_base_image(ctr.DEFAULT_IMAGE, cache)
    names = sorted(n for n in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, n)))
    cases = []
    for name in names:
        d = os.path.join(FIXTURES, name)
        with open(os.path.join(d, "patches", "minimal.diff")) as f:
            cases.append((name, RepoTask.from_dir(d), f.read()))
    samples: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
    print(f"container back-end vs bwrap, minimal fixes (median of {rounds} rounds)")
    print(f"  load before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    for r in range(rounds + 1):
        for name, task, patch in cases:
            for env in ("uv", "container"):
                c0, t0 = _cpu(), time.perf_counter()
                v = verify_repo_patch(task, patch, run_monitor=False, environment=env)
                dt, dc = time.perf_counter() - t0, _cpu() - c0
                if v.status != "passed":
                    raise SystemExit(f"{name} under {env}: {v.status}\n{v.test_log[-1500:]}")
                if r:  # round 0 warms both up
                    samples[(name, env)].append((dt, dc))
    print(f"  {'fixture':10s} {'bwrap ms':>9s} {'container ms':>13s} {'extra ms':>9s} "
          f"{'ratio':>6s} {'bwrap cpu':>10s} {'ctr cpu':>8s}")  # fmt: skip
    for name, _, _ in cases:
        b = samples[(name, "uv")]
        c = samples[(name, "container")]
        bw, cw = statistics.median(x[0] for x in b), statistics.median(x[0] for x in c)
        bc, cc = statistics.median(x[1] for x in b), statistics.median(x[1] for x in c)
        print(
            f"  {name:10s} {bw * 1e3:9.0f} {cw * 1e3:13.0f} {(cw - bw) * 1e3:9.0f} "
            f"{cw / bw:5.2f}x {bc * 1e3:8.0f}ms {cc * 1e3:6.0f}ms"
        )
    print(f"  load after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")


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
    odd = {
        "208 KB line of digits": (head + "1" * 208_000 + "\n", []),
        "208 KB line except+spaces": (head + "except" + " " * 208_000 + "x\n", []),
        "64 KB repeated action": (
            patches["minimal"],
            [{"turn": 0, "kind": "tool_call", "text": "git log " * 8000}],
        ),
    }
    print(
        f"behaviour monitor per rollout (median of {n}; patch rules + 40-event trajectory; "
        f"load {os.getloadavg()[0]:.1f})"
    )
    for name, p in patches.items():
        row(f"monitor: statkit {name}", timed(lambda p=p: monitor(p, events, ctx), n), None)
    for name, (p, ev) in odd.items():
        row(f"monitor: {name}", timed(lambda p=p, ev=ev: monitor(p, ev, ctx), max(3, n // 4)), None)


if __name__ == "__main__":
    main()
