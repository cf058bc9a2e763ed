"""The RL step of ``benchmarks/rl_step.py`` under different process environments, A/B interleaved.

    XLA_FLAGS= .venv/bin/python benchmarks/rl_step_env.py     # the default set of variants
    XLA_FLAGS= .venv/bin/python benchmarks/rl_step_env.py \
        --variants gagar_jax:default,gagar_jax:quota1,trl:default --rounds 6

Each variant is a framework (``gagar_jax``, ``trl``, ``tunix``: the race's workers) started in
an environment of its own: ``default`` (the race's: gagar_jax keeps its heap as its trainer
does, TRL and Tunix run with glibc's defaults), ``glibc`` (gagar_jax with glibc's defaults too:
``GAGAR_MALLOC_KEEP_HEAP=0``), ``keep_heap`` (glibc keeps the memory it frees:
``GLIBC_TUNABLES``), ``keep_heap_arenas`` (the same without limiting glibc to one arena),
``quota1`` (a cgroup CPU quota of one CPU while both CPUs stay visible; needs root and a
writable cgroup ``cpu`` controller), ``taskset1`` (one CPU by
affinity), ``devices8`` (``--xla_force_host_platform_device_count=8``, as users set for
simulated devices), ``avx2`` (XLA's code generation limited to AVX2: ``--xla_cpu_max_isa``),
``noopt`` (``JAX_DISABLE_MOST_OPTIMIZATIONS=1``, which the test suite exports to the
processes it starts), ``omp1`` (``OMP_NUM_THREADS=1``) and ``hot`` (the same as
``default``, but each timed step follows another step at once, with no idle time before
it). All variants' workers live at the same time; each round runs one step of each in turn,
so a variant waits through the others' steps as a race's worker does, and the machine's load
hits all alike. ``a+b`` combines two variants (``glibc+quota1``).

Per variant and step it prints the medians of the wall seconds, the CPU seconds (user and
kernel), the minor page faults and the context switches (voluntary, involuntary) the kernel
counted for the worker (``getrusage``; all its threads), and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import rl_step  # noqa: E402

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
CGROUP_V2 = Path("/sys/fs/cgroup")


def _quota_prefix(cpus: float) -> list[str]:
    """A command prefix that moves the process into a cgroup with a CPU quota of ``cpus``."""
    period = 100_000
    name = f"gagar_bench_quota{cpus:g}".replace(".", "_")
    if (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        group = CGROUP_CPU / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(period))
        (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        procs = group / "cgroup.procs"
    elif (CGROUP_V2 / "cgroup.controllers").exists():
        group = CGROUP_V2 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        procs = group / "cgroup.procs"
    else:
        raise SystemExit("no writable cgroup cpu controller for a quota variant")
    return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh"]


def variant_setup(name: str) -> tuple[dict, list[str]]:
    """(environment additions, command prefix) of a variant; ``a+b`` combines two."""
    if "+" in name:
        env, prefix = {}, []
        for part in name.split("+"):
            e, p = variant_setup(part)
            if "XLA_FLAGS" in e and "XLA_FLAGS" in env:
                e = dict(e, XLA_FLAGS=env["XLA_FLAGS"] + " " + e["XLA_FLAGS"])
            env.update(e)
            prefix += p
        return env, prefix
    if name in ("default", "hot"):
        return {}, []
    if name == "keep_heap":
        return {"GLIBC_TUNABLES": rl_step.KEEP_HEAP_TUNABLES}, []
    if name == "keep_heap_arenas":  # the heap kept, glibc's arenas left as they are
        return {
            "GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
        }, []
    if name == "glibc":  # gagar_jax's worker without its trainer's kept heap
        return {"GAGAR_MALLOC_KEEP_HEAP": "0"}, []
    if name.startswith("quota"):
        return {}, _quota_prefix(float(name[len("quota") :]))
    if name.startswith("taskset"):
        n = int(name[len("taskset") :])
        return {}, ["taskset", "-c", ",".join(str(i) for i in range(n))]
    if name == "devices8":
        return {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, []
    if name == "avx2":
        return {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}, []
    if name == "noopt":  # what the test suite's conftest exports for fast compiles
        return {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}, []
    if name == "omp1":
        return {"OMP_NUM_THREADS": "1"}, []
    if name.startswith("xla:"):  # any XLA_FLAGS, e.g. xla:--xla_cpu_multi_thread_eigen=false
        return {"XLA_FLAGS": name[len("xla:") :]}, []
    raise SystemExit(f"--variants: unknown variant {name!r}")


COLUMNS = ("total", "user_s", "sys_s", "minflt", "vcsw", "ivcsw", "generate", "update", "sync")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants",
        default="gagar_jax:glibc,gagar_jax:default,gagar_jax:glibc+quota1,"
        "gagar_jax:glibc+devices8,gagar_jax:glibc+avx2,trl:default,trl:quota1,tunix:default",
        help="comma list of framework:variant",
    )
    parser.add_argument("--shape", default="rl")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    variants = [tuple(v.split(":", 1)) for v in args.variants.split(",") if v]
    for fw, _ in variants:
        if fw not in ("gagar_jax", "trl", "tunix"):
            raise SystemExit(f"--variants: unknown framework {fw!r}")
        if fw != "gagar_jax":
            rl_step.ensure_venv(fw)
    assets = rl_step.make_assets("small")
    spec = dict(
        assets=str(assets),
        shape_name=args.shape,
        **rl_step.SHAPES[args.shape],
        lr=rl_step.LEARNING_RATE,
        epsilon=rl_step.EPSILON,
        max_grad_norm=rl_step.MAX_GRAD_NORM,
        keep_heap=False,
        mode="race",
    )
    from gagar_jax.host_cpu import describe

    print(describe())
    logdir = rl_step.RUNS / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    workers = {}
    try:
        for fw, var in variants:
            env, prefix = variant_setup(var)
            workers[(fw, var)] = rl_step.WorkerProc(
                fw, spec, logdir / f"env-{fw}-{var}.log", env_extra=env, prefix=prefix
            )
        for w in workers.values():
            w.read()
        rl_step.progress("workers set up")
        for w in workers.values():  # the first steps compile
            w.post("step")
        for w in workers.values():
            w.read()
        rl_step.progress("first steps done")
        load_before = os.getloadavg()
        recs = {k: [] for k in workers}
        for i in range(args.rounds):
            for (fw, var), w in workers.items():
                if var == "hot":
                    w.send("step")
                rec = w.send("step")
                recs[(fw, var)].append(rec)
                print(
                    f"round {i + 1} {fw}:{var} "
                    + " ".join(f"{c} {rec.get(c, 0.0):.3f}" for c in COLUMNS),
                    flush=True,
                )
            rl_step.progress(f"round {i + 1} of {args.rounds} done")
        load_after = os.getloadavg()
    finally:
        for w in workers.values():
            w.close()
    print(
        f"\n[{args.shape}] medians of {args.rounds} interleaved rounds per step; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    head = f"{'variant':24} " + " ".join(f"{c:>9}" for c in COLUMNS) + f" {'cpu s':>7}"
    print(head)
    print("-" * len(head))
    for (fw, var), rs in recs.items():
        med = {c: statistics.median(r.get(c, 0.0) for r in rs) for c in COLUMNS}
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in rs)
        print(
            f"{fw + ':' + var:24} "
            + " ".join(
                f"{med[c]:9.0f}" if c in ("minflt", "vcsw", "ivcsw") else f"{med[c]:9.3f}"
                for c in COLUMNS
            )
            + f" {cpu:7.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "load": [load_before, load_after],
                    "recs": {f"{fw}:{var}": rs for (fw, var), rs in recs.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
