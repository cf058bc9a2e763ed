"""The host facts: cgroup CPU quotas (v1 and v2 trees), the instruction set, the one-line description."""

import os

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
