"""What the host gives a CPU-bound process: the facts, read from the kernel, that change its speed.

Two machines of the same type can run the same CPU step at very different speeds for reasons
that are not in the program: how many CPUs the process may use (its affinity and its cgroup's
CPU quota, which XLA:CPU's thread pool does not read), the instruction set XLA generates code
for, what ``XLA_FLAGS`` and thread variables the process inherited, and how expensive a page
fault is. The last one matters most for a step that allocates large buffers afresh every call:
on a virtual machine whose balloon device reports free memory to the hypervisor (free page
reporting), memory the process returned to the kernel is handed back to the host, and faulting
it in again costs a trip through the hypervisor; how long that trip takes depends on the host.
:func:`host_facts` collects these facts, :func:`describe` puts them on one line for a log or a
benchmark table's header, and :func:`effective_cpus` is the number of CPUs the process can
really keep busy.
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys
from pathlib import Path

_ENV_PREFIXES = ("XLA_", "JAX_", "TF_", "OMP_", "MKL_", "OPENBLAS_", "GLIBC_", "MALLOC_")
_ENV_SKIP = ("TF_CLI_CONFIG_FILE",)  # terraform's, not TensorFlow's
_TRUE = ("1", "true", "yes", "on")
_PAGE_REPORTING = Path("/sys/module/page_reporting/parameters")


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _cpuinfo() -> dict:
    """The first processor's ``model name`` and ``flags`` from ``/proc/cpuinfo``."""
    out = {}
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "flags", "vendor_id") and key not in out:
            out[key] = value.strip()
        if len(out) == 3:
            break
    return out


def isa(flags: set[str]) -> str:
    """The widest vector extension among the CPU's ``flags``: ``AMX``, ``AVX512``, ``AVX2``,
    ``AVX`` or ``SSE``."""
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX512"
    for name in ("avx2", "avx"):
        if name in flags:
            return name.upper()
    return "SSE"


def cgroup_cpu_quota(
    proc_cgroup: str = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup"
) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (``quota / period``), the smallest along
    its path up to the root; None when there is none. Reads cgroup v2's ``cpu.max`` and v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``."""
    root = Path(root)
    lines = (_read(proc_cgroup) or "").splitlines()
    best = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2
            base, quota_of = root, _v2_quota
        elif "cpu" in controllers.split(","):
            base, quota_of = root / controllers, _v1_quota
            if not base.exists():  # cpu,cpuacct may be mounted as cpu
                base = root / "cpu"
        else:
            continue
        node = base / rel
        while True:
            q = quota_of(node)
            if q is not None:
                best = q if best is None else min(best, q)
            if node == base or base not in node.parents:
                break
            node = node.parent
    return best


def _v2_quota(node: Path) -> float | None:
    text = _read(node / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _v1_quota(node: Path) -> float | None:
    quota, period = _read(node / "cpu.cfs_quota_us"), _read(node / "cpu.cfs_period_us")
    if not quota or not period or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def effective_cpus() -> int:
    """The CPUs this process can keep busy: its affinity, capped by its cgroup's CPU quota
    (rounded up). XLA:CPU and PyTorch size their thread pools from the affinity or the CPU
    count alone, so a quota below them oversubscribes the quota."""
    cpus = affinity_cpus()
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return cpus


def page_reporting() -> dict | None:
    """The kernel's free page reporting (memory it frees, handed back to the hypervisor
    through the balloon device): its block order and the KiB reported so far; None when the
    kernel has no such module."""
    if not _PAGE_REPORTING.is_dir():
        return None
    out = {}
    for name in ("page_reporting_order", "reported_kib", "min_free_ms"):
        value = _read(_PAGE_REPORTING / name)
        if value is not None and value.lstrip("-").isdigit():
            out[name] = int(value)
    return out


def _balloon_reporting() -> bool:
    """A virtio balloon with free page reporting is bound (feature bit 5)."""
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        if _read(dev / "device") == "0x0005":
            features = _read(dev / "features") or ""
            return len(features) > 5 and features[5] == "1"
    return False


def _thp() -> str | None:
    text = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text is None:
        return None
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else text


def host_facts() -> dict:
    """The facts of this host and process that change a CPU step's time (module docstring)."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(_ENV_PREFIXES) and k not in _ENV_SKIP
    }
    libc = " ".join(platform.libc_ver()).strip() or None
    reporting = page_reporting()
    return {
        "cpu": info.get("model name"),
        "isa": isa(flags) if flags else None,
        "hypervisor": "hypervisor" in flags,
        "cpu_count": os.cpu_count(),
        "affinity": affinity_cpus(),
        "cpu_quota": cgroup_cpu_quota(),
        "effective_cpus": effective_cpus(),
        "load": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "thp": _thp(),
        "libc": libc,
        "page_reporting": (
            dict(reporting, balloon=_balloon_reporting()) if reporting is not None else None
        ),
        "env": env,
    }


def describe(facts: dict | None = None) -> str:
    """:func:`host_facts` on one line."""
    f = host_facts() if facts is None else facts
    quota = "none" if f["cpu_quota"] is None else f"{f['cpu_quota']:g} CPUs"
    parts = [
        f"cpu: {f['cpu']} ({f['isa']}{', virtual' if f['hypervisor'] else ''})",
        f"cpus {f['cpu_count']}, affinity {f['affinity']}, cgroup quota {quota}",
        f"THP {f['thp']}",
        f"libc {f['libc']}",
    ]
    pr = f["page_reporting"]
    if pr is not None:
        parts.append(
            f"free page reporting order {pr.get('page_reporting_order')}"
            f"{' (balloon on)' if pr.get('balloon') else ''}"
        )
    else:
        parts.append("free page reporting none")
    env = ", ".join(f"{k}={v!r}" for k, v in f["env"].items()) or "none"
    parts.append(f"env: {env}")
    if f["load"] is not None:
        parts.append("load {:.2f} {:.2f} {:.2f}".format(*f["load"]))
    return "; ".join(parts)


_prepared: dict | None = None


def prepare_cpu_host(*, platform: str | None = None, log: logging.Logger | None = None) -> dict:
    """Readies this process for CPU steps, once per process; later calls return the first
    call's answer. Call it before JAX starts its backend (the first array, ``jax.devices()``).

    On a CPU it sets glibc's allocator to keep and reuse the memory the process frees
    (:func:`gagar_jax.update.malloc.keep_heap`; the environment variable
    ``GAGAR_MALLOC_KEEP_HEAP=0`` turns it off), so that an update step's temporary buffers are
    not returned to the kernel and faulted in afresh every step (about 145,000 minor faults per
    step of the race's ``rl`` shape otherwise). XLA:CPU's threads take their own allocator
    arenas when the backend starts; an arena taken before this call still maps and unmaps large
    buffers, so a call after the backend started keeps only part of them (it logs a warning).
    ``platform``: the backend the steps run on (``"cpu"``, ``"gpu"``, ``"tpu"``); None decides
    as :func:`~gagar_jax.update.malloc.keep_heap` does, without starting JAX (CPU unless
    ``JAX_PLATFORMS`` or an installed plugin names an accelerator).

    It logs :func:`describe` and a warning for each fact that slows CPU steps: a cgroup CPU
    quota below the CPUs XLA:CPU sizes its thread pool for (the affinity), more simulated host
    devices (``--xla_force_host_platform_device_count``) than CPUs to run them, XLA's
    optimisations turned off (``JAX_DISABLE_MOST_OPTIMIZATIONS``, which test suites export for
    fast compiles, or ``--xla_backend_optimization_level=0``), and freed memory handed back to
    the hypervisor (free page reporting) while the heap is not kept.

    Returns ``{"keep_heap": applied, "late": backend already started, "warnings": [...],
    "facts": host_facts()}``.
    """
    global _prepared
    if _prepared is not None:
        return _prepared
    malloc = _malloc()
    accelerator_plugin, keep_heap = malloc.accelerator_plugin, malloc.keep_heap
    log = log or logging.getLogger(__name__)
    on_cpu = accelerator_plugin() is None if platform is None else platform == "cpu"
    late = _backend_started()
    kept = keep_heap() if on_cpu else False
    facts = host_facts()
    warnings = cpu_warnings(facts, keep_heap_applied=kept) if on_cpu else []
    if kept and late:
        warnings.append(
            "the heap setting came after JAX started its backend: XLA's threads that already "
            "allocated keep mapping their large buffers afresh (call "
            "gagar_jax.host_cpu.prepare_cpu_host before the first JAX array)"
        )
    if on_cpu:
        log.info("host: %s; heap kept: %s", describe(facts), kept)
        for w in warnings:
            log.warning("%s", w)
    _prepared = {"keep_heap": kept, "late": late, "warnings": warnings, "facts": facts}
    return _prepared


def _malloc():
    """``gagar_jax.update.malloc``, loaded without its package (whose import brings in JAX and
    starts a thread that takes an allocator arena of its own before the setting is made)."""
    mod = sys.modules.get("gagar_jax.update.malloc")
    if mod is not None:
        return mod
    import importlib.util

    path = Path(__file__).resolve().parent / "update" / "malloc.py"
    spec = importlib.util.spec_from_file_location("gagar_jax._malloc_standalone", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _backend_started() -> bool:
    """Whether this process's JAX has started a backend (without starting one)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def cpu_warnings(facts: dict, *, keep_heap_applied: bool) -> list[str]:
    """What in ``facts`` (:func:`host_facts`) slows CPU steps, one sentence each."""
    out = []
    quota = facts["cpu_quota"]
    if quota is not None and quota < facts["affinity"]:
        out.append(
            f"the cgroup CPU quota ({quota:g} CPUs) is below the {facts['affinity']} CPUs "
            "XLA:CPU sizes its thread pool for: its threads will wait for the quota's next "
            f"period; an affinity of {facts['effective_cpus']} CPUs (taskset) matches them"
        )
    flags = facts["env"].get("XLA_FLAGS", "")
    for word in flags.split():
        if word.startswith("--xla_force_host_platform_device_count="):
            n = int(word.split("=", 1)[1] or 0)
            if n > facts["effective_cpus"]:
                out.append(
                    f"XLA_FLAGS asks for {n} simulated host devices on "
                    f"{facts['effective_cpus']} CPUs: every device program shares them"
                )
    if facts["env"].get("JAX_DISABLE_MOST_OPTIMIZATIONS", "").strip().lower() in _TRUE:
        out.append(
            "JAX_DISABLE_MOST_OPTIMIZATIONS is set (a test suite's fast-compile setting): XLA "
            "compiles without its backend optimisations and the step's fused loops run slower"
        )
    for word in flags.split():
        if word.startswith("--xla_backend_optimization_level=") and word.endswith("=0"):
            out.append(f"XLA_FLAGS holds {word}: the step's fused loops run unoptimised")
    pr = facts["page_reporting"]
    if pr is not None and pr.get("balloon") and not keep_heap_applied:
        out.append(
            "the kernel hands freed memory back to the hypervisor (free page reporting) and "
            "the heap is not kept (GAGAR_MALLOC_KEEP_HEAP=0): every step faults its temporary "
            "buffers in afresh, at a cost per fault that depends on the host"
        )
    return out
