"""The host facts: cgroup CPU quotas (v1 and v2), the instruction set, the description, the heap."""

import os
import subprocess
import sys

import pytest

from gagar_jax import host_cpu


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_the_smallest_along_the_path(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "jobs" / "cpu.max", "150000 100000\n")  # 1.5 CPUs
    _write(root / "jobs" / "one" / "cpu.max", "max 100000\n")
    proc = tmp_path / "cgroup"
    _write(proc, "0::/jobs/one\n")
    assert host_cpu.cgroup_cpu_quota(str(proc), root) == 1.5
    _write(root / "jobs" / "one" / "cpu.max", "50000 100000\n")
    assert host_cpu.cgroup_cpu_quota(str(proc), root) == 0.5


def test_v1_quota_and_no_quota(tmp_path):
    root = tmp_path / "cg"
    _write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(root / "cpu,cpuacct" / "a" / "cpu.cfs_quota_us", "-1\n")
    _write(root / "cpu,cpuacct" / "a" / "cpu.cfs_period_us", "100000\n")
    proc = tmp_path / "cgroup"
    _write(proc, "4:memory:/x\n3:cpu,cpuacct:/a\n0::/\n")
    assert host_cpu.cgroup_cpu_quota(str(proc), root) is None
    _write(root / "cpu,cpuacct" / "a" / "cpu.cfs_quota_us", "200000\n")
    _write(root / "cpu,cpuacct" / "a" / "cpu.cfs_period_us", "50000\n")
    assert host_cpu.cgroup_cpu_quota(str(proc), root) == 4.0


def test_missing_cgroup_files_read_as_no_quota(tmp_path):
    assert host_cpu.cgroup_cpu_quota(str(tmp_path / "absent"), tmp_path) is None
    proc = tmp_path / "cgroup"
    _write(proc, "0::/nowhere\n")
    assert host_cpu.cgroup_cpu_quota(str(proc), tmp_path) is None


def test_isa_names_the_widest_extension():
    assert host_cpu.isa({"sse2", "avx", "avx2", "avx512f", "amx_tile"}) == "AMX"
    assert host_cpu.isa({"avx", "avx2", "avx512f"}) == "AVX512"
    assert host_cpu.isa({"avx", "avx2"}) == "AVX2"
    assert host_cpu.isa({"sse2"}) == "SSE"


def test_facts_of_this_host_are_consistent():
    f = host_cpu.host_facts()
    assert 1 <= f["effective_cpus"] <= f["affinity"] <= (os.cpu_count() or 1)
    assert f["affinity"] == len(os.sched_getaffinity(0))
    line = host_cpu.describe(f)
    assert f"affinity {f['affinity']}" in line and "cgroup quota" in line


def test_describe_names_the_inherited_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=0")
    line = host_cpu.describe()
    assert "XLA_FLAGS='--xla_force_host_platform_device_count=8'" in line
    assert "GLIBC_TUNABLES='glibc.malloc.mmap_max=0'" in line


def _facts(**over):
    base = {
        "cpu_quota": None,
        "affinity": 2,
        "effective_cpus": 2,
        "env": {},
        "page_reporting": None,
    }
    base.update(over)
    return base


def test_cpu_warnings_name_each_slowing_fact():
    assert host_cpu.cpu_warnings(_facts(), keep_heap_applied=False) == []
    (w,) = host_cpu.cpu_warnings(_facts(cpu_quota=1.0, effective_cpus=1), keep_heap_applied=True)
    assert "quota (1 CPUs)" in w and "2 CPUs" in w
    (w,) = host_cpu.cpu_warnings(
        _facts(env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}),
        keep_heap_applied=True,
    )
    assert "8 simulated host devices on 2 CPUs" in w
    (w,) = host_cpu.cpu_warnings(
        _facts(env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}), keep_heap_applied=True
    )
    assert "JAX_DISABLE_MOST_OPTIMIZATIONS" in w
    (w,) = host_cpu.cpu_warnings(
        _facts(env={"XLA_FLAGS": "--xla_backend_optimization_level=0"}), keep_heap_applied=True
    )
    assert "unoptimised" in w
    reporting = {"page_reporting_order": 9, "balloon": True}
    assert host_cpu.cpu_warnings(_facts(page_reporting=reporting), keep_heap_applied=True) == []
    (w,) = host_cpu.cpu_warnings(_facts(page_reporting=reporting), keep_heap_applied=False)
    assert "free page reporting" in w


_PREPARED_REFAULT = """
import logging, resource, sys
import numpy as np
from gagar_jax import host_cpu
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
out = host_cpu.prepare_cpu_host(platform=sys.argv[1])
assert host_cpu.prepare_cpu_host(platform="cpu") is out  # once per process
a = np.ones(64 * 2**20, np.uint8); del a  # allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones(64 * 2**20, np.uint8)  # the same size again
print(out["keep_heap"], resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_prepare_cpu_host_keeps_the_heap_on_a_cpu_only():
    """On a CPU backend a 64 MB block freed and allocated again comes from the kept heap
    (almost no page faults), and the host line is logged; with GAGAR_MALLOC_KEEP_HEAP=0 the
    block is faulted in afresh (the accelerator default: tests/test_update_malloc.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(platform, **env):
        full = {k: v for k, v in os.environ.items() if k != "GAGAR_MALLOC_KEEP_HEAP"}
        full.update(env, PYTHONPATH=root, JAX_PLATFORMS="cpu")
        out = subprocess.run(
            [sys.executable, "-c", _PREPARED_REFAULT, platform],
            env=full,
            capture_output=True,
            text=True,
            check=True,
        )
        kept, faults = out.stdout.split()
        return kept == "True", int(faults), out.stderr

    kept, faults, log = run("cpu")
    assert kept and faults < 100, (faults, log)
    assert "host: cpu:" in log and "heap kept: True" in log
    kept_off, faults_off, _ = run("cpu", GAGAR_MALLOC_KEEP_HEAP="0")
    assert not kept_off and faults_off > 10 * max(faults, 1)


_LATE = """
import logging, sys
import jax
from gagar_jax import host_cpu
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
jax.devices()  # the backend starts before the setting
print(host_cpu.prepare_cpu_host(platform="cpu")["late"])
"""


def test_a_call_after_the_backend_started_is_flagged():
    """XLA:CPU's threads take their allocator arenas when the backend starts: a setting made
    after that is reported as late, with a warning that names the remedy."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "GAGAR_MALLOC_KEEP_HEAP"}
    env.update(PYTHONPATH=root, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", _LATE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split()[-1] == "True"
    assert "before the first JAX array" in out.stderr
