"""Attacks on the sandbox's own verdict (issue 11): each class tried as the sandboxed code would.

Classes: (1) reaching the process that holds the start marker or decides the exit status
(ptrace, pidfd_getfd, process_vm_*, /proc/<pid>/mem, /proc/<pid>/fd reopen, with umask 000);
(2) filling the disk through many files below the per-file cap; (3) /dev/shm, /dev and nested
user-namespace tmpfs. Every probe asserts a status of ``failed`` or ``resource_killed`` (never
``passed`` or ``infra_error``) and that nothing was written outside the temporary tree.
"""

import errno
import os
import struct
import tempfile

import pytest

from gagar_jax.verify import sandbox as sb
from gagar_jax.verify import seccomp
from gagar_jax.verify.sandbox import Limits, SandboxConfig, run_sandboxed

AVAILABLE = sb.available_mechanisms()
ISOLATING = [m for m in ("bwrap+cgroup", "bwrap", "unshare", "rlimits") if AVAILABLE[m] is None]
PY, _ = sb.python_for_sandbox()
FAST = Limits(
    wall_s=20,
    cpu_s=20,
    memory_bytes=256 << 20,
    nproc=32,
    file_bytes=4 << 20,
    output_bytes=16 << 10,
    disk_bytes=24 << 20,
    disk_files=500,
    shm_bytes=8 << 20,
)


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="gagar_esc_") as d:
        os.chmod(d, 0o755)
        yield d


@pytest.fixture(params=ISOLATING)
def mech(request):
    return request.param


def run(mech, code, workdir, limits=FAST, **kw):
    return run_sandboxed(
        [PY, "-c", code], workdir, limits, config=SandboxConfig(mechanism=mech), **kw
    )


def _files_outside(workdir: str, before: set[str]) -> set[str]:
    """Entries owned by a sandbox uid in /tmp, /var/tmp and /dev/shm (the host places a run
    could write to), outside ``workdir``, that were not there ``before``."""
    cfg = SandboxConfig()
    uids = range(cfg.uid_base, cfg.uid_base + cfg.num_slots)
    now = set()
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        with os.scandir(d) as it:
            for e in it:
                if e.name.startswith(("gagar_", "gagar-")):
                    continue  # the verifier's own temporary trees (of any concurrent run)
                try:
                    if e.stat(follow_symlinks=False).st_uid in uids:
                        now.add(e.path)
                except OSError:
                    pass
    return {p for p in now - before if not workdir or not p.startswith(workdir)}


def _snapshot() -> set[str]:
    return _files_outside("", set())


# --- (1) the process holding the outcome is out of reach ----------------------------------------

ATTACK_INIT = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (434, 438, 310, 311), "aarch64": (434, 438, 270, 271)}[os.uname().machine]
me = os.getpid()
targets = sorted({p for p in (1, os.getppid()) if p not in (me, 0)})
# Every process of our uid that is not ours (a reaper, a parent holding the marker).
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) != me:
        try:
            if os.stat("/proc/" + name).st_uid == os.getuid():
                targets.append(int(name))
        except OSError:
            pass
got = []
for pid in sorted(set(targets)):
    if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
        got.append(f"ptrace {pid}")
    pidfd = libc.syscall(NR[0], pid, 0)
    if pidfd >= 0:
        for fd in range(0, 8):
            new = libc.syscall(NR[1], pidfd, fd, 0)
            if new >= 0:
                got.append(f"pidfd_getfd {pid}:{fd}")
                os.ftruncate(new, 0) if os.fstat(new).st_size else None
    buf = ctypes.create_string_buffer(8)
    iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
    if libc.syscall(NR[2], pid, iov, 1, iov, 1, 0) >= 0:
        got.append(f"process_vm_readv {pid}")
    for path, mode in ((f"/proc/{pid}/mem", os.O_RDWR), (f"/proc/{pid}/fd/0", os.O_RDWR)):
        try:
            fd = os.open(path, mode)
        except OSError:
            continue
        got.append(f"open {path}")
        if path.endswith("/0"):
            with open(fd, "r+b") as f:
                f.truncate(0)
print("GOT", got) if got else print("NOTHING", targets)
sys.exit(1)
"""


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_code_cannot_reach_the_process_that_holds_its_outcome(mech, workdir, umask):
    before = _snapshot()
    old = os.umask(umask)
    try:
        r = run(mech, ATTACK_INIT, workdir)
    finally:
        os.umask(old)
    assert "GOT" not in r.stdout, r
    assert r.status == "failed" and r.returncode == 1, r  # not passed, not infra_error
    assert not _files_outside(workdir, before)


@pytest.mark.skipif(seccomp.host_filter() is None, reason="no seccomp table for this machine")
def test_seccomp_filter_is_loaded_under_bwrap(workdir):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "pid = os.fork()\nif pid == 0:\n    os.pause()\n"
        "r = libc.ptrace(16, pid, 0, 0)\nprint(r, ctypes.get_errno())\n"
        "os.kill(pid, 9)\n"
    )
    for mech in [m for m in ISOLATING if m.startswith("bwrap")]:
        r = run(mech, code, workdir)
        # Even our own child cannot be traced: the call is refused before any permission check.
        assert r.status == "passed" and r.stdout.split() == ["-1", str(errno.EPERM)], r


def _bpf_run(prog: bytes, arch: int, nr: int) -> int:
    """A reference interpreter of the classic-BPF subset the filter uses."""
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("=iI", nr, arch) + bytes(56)
    pc, acc = 0, 0
    for _ in range(len(insns) + 1):
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35):
            hit = acc == k if code == 0x15 else acc >= k
            pc += 1 + (jt if hit else jf)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("program did not return")


@pytest.mark.parametrize("machine", sorted(seccomp.SYSCALLS))
def test_seccomp_program_denies_exactly_the_listed_calls(machine):
    prog = seccomp.build_filter(machine)
    arch = seccomp.AUDIT_ARCH[machine]
    deny = seccomp.SECCOMP_RET_ERRNO | errno.EPERM
    denied = set(seccomp.SYSCALLS[machine].values())
    for nr in range(0, 600):
        want = deny if nr in denied else seccomp.SECCOMP_RET_ALLOW
        assert _bpf_run(prog, arch, nr) == want, (machine, nr)
    other = 0x40000003  # AUDIT_ARCH_I386: another ABI is refused whatever the number
    assert _bpf_run(prog, other, 39) == deny
    if machine == "x86_64":  # the x32 ABI reaches ptrace as 0x40000000 | 101
        assert _bpf_run(prog, arch, 0x40000000 | 101) == deny
    with pytest.raises(ValueError, match="architecture"):
        seccomp.build_filter("sparc")


@pytest.mark.parametrize("machine", sorted(seccomp.EXEC_SYSCALLS))
def test_exec_filter_hands_exactly_the_exec_calls_to_the_supervisor(machine):
    prog = seccomp.exec_notify_filter(machine)
    arch = seccomp.AUDIT_ARCH[machine]
    deny = seccomp.SECCOMP_RET_ERRNO | errno.EPERM
    execs = set(seccomp.EXEC_SYSCALLS[machine].values())
    for nr in range(0, 600):
        want = seccomp.SECCOMP_RET_USER_NOTIF if nr in execs else seccomp.SECCOMP_RET_ALLOW
        assert _bpf_run(prog, arch, nr) == want, (machine, nr)
    assert _bpf_run(prog, 0x40000003, 11) == deny  # i386's execve: another ABI, refused
    if machine == "x86_64":  # x32's execve (520) and the x32 alias of the x86_64 number
        assert _bpf_run(prog, arch, 0x40000000 | 520) == deny
        assert _bpf_run(prog, arch, 0x40000000 | 59) == deny
    with pytest.raises(ValueError, match="architecture"):
        seccomp.exec_notify_filter("sparc")


# --- (2) total disk quota of the workdir ---------------------------------------------------------

DISK_CASES = {
    # 12 files of 3 MiB: each below file_bytes (4 MiB), 36 MiB in all against 24 MiB.
    "many_files": "for i in range(12):\n    open(f'f{i}', 'wb').write(b'x' * (3 << 20))\n",
    # nested directories, written by a forked child while the parent exits 0 at once
    "child_fills_subdirs": (
        "import os, time\nif os.fork() == 0:\n    os.makedirs('a/b/c', exist_ok=True)\n"
        "    for i in range(12):\n        open(f'a/b/c/{i}', 'wb').write(b'y' * (3 << 20))\n"
        "    os._exit(0)\nos.wait()\n"
    ),
    # an inode flood: tiny files past disk_files (500 here)
    "inode_flood": "for i in range(1500):\n    open(f'n{i}', 'w').close()\n",
}


@pytest.mark.parametrize("private", [True, False], ids=["private", "accounted"])
@pytest.mark.parametrize("case", sorted(DISK_CASES))
def test_total_disk_use_is_capped(mech, workdir, case, private):
    before = _snapshot()
    r = run(mech, DISK_CASES[case], workdir, private_workdir=private)
    killed = r.status == "resource_killed" and "disk" in r.limit_hits
    if "disk" in r.isolation and case == "inode_flood":
        # A tmpfs bounds bytes, not inodes: entries past disk_files are seen only by the 0.1 s
        # poll (a flood that ends sooner is bounded by the memory cgroup, not by disk_files).
        assert r.status in ("passed", "resource_killed"), r
    elif "disk" in r.isolation:
        # The private work tree (the default under bwrap) is a tmpfs of the quota: a write past
        # it fails (ENOSPC) as it happens, or the full tree is seen while the run goes.
        assert killed or "No space left on device" in r.stderr, r
    else:
        assert killed, r
    assert not _files_outside(workdir, before)


def test_disk_use_under_the_limit_passes(mech, workdir):
    r = run(
        mech,
        "open('a', 'wb').write(b'x' * (3 << 20))\nopen('s', 'wb').truncate(4 << 19)\n",
        workdir,
    )
    assert r.status == "passed" and "disk" not in r.limit_hits, r  # 5 MiB of 24 MiB
    sparse = "open('s', 'wb').truncate((4 << 20) - 1)\nopen('t', 'wb').truncate((4 << 20) - 1)\n"
    r = run(mech, sparse, workdir)
    assert r.status == "passed", r  # sparse files count at their apparent size: 11 MiB in all


# --- (3) /dev/shm, /dev and nested namespaces under bwrap ----------------------------------------

SHM_ATTACKS = {
    "dev_shm": "open('/dev/shm/big', 'wb').write(b'x' * (32 << 20))\n",
    "dev_itself": "open('/dev/big', 'wb').write(b'x' * (1 << 20))\n",
    "nested_userns_tmpfs": (
        "import subprocess, sys\n"
        "r = subprocess.run(['unshare', '-Urm', 'sh', '-c', 'mount -t tmpfs none /tmp && "
        "head -c 33554432 /dev/zero > /tmp/x && echo MOUNTED'], capture_output=True, text=True)\n"
        "print(r.stdout, r.stderr)\nsys.exit(0 if 'MOUNTED' in r.stdout else 1)\n"
    ),
}


@pytest.mark.parametrize("attack", sorted(SHM_ATTACKS))
def test_dev_shm_and_namespaces_are_bounded_under_bwrap(workdir, attack):
    for mech in [m for m in ISOLATING if m.startswith("bwrap")]:
        before = _snapshot()
        r = run(mech, SHM_ATTACKS[attack], workdir)
        assert r.status in ("failed", "resource_killed"), (mech, r)
        assert "MOUNTED" not in r.stdout
        assert not _files_outside(workdir, before)
    r = run(ISOLATING[0], "open('/dev/shm/small', 'wb').write(b'x' * (1 << 20))\n", workdir)
    assert r.status == "passed", r  # 1 MiB fits under shm_bytes (8 MiB)


# --- infrastructure errors are not the code's to make --------------------------------------------

FAKE_INFRA = {
    "close_every_fd": "import os\nos.closerange(0, 1024)\nos._exit(1)\n",
    "kill_everything": "import os, signal\nos.kill(-1, signal.SIGKILL)\nos._exit(1)\n",
    "remove_own_workdir": "import os, shutil\nshutil.rmtree(os.getcwd(), ignore_errors=True)\n"
    "os._exit(1)\n",
    "stdout_is_a_fifo": "import os\nos.mkfifo('out')\nos._exit(1)\n",
}


@pytest.mark.parametrize("case", sorted(FAKE_INFRA))
def test_code_cannot_turn_its_failure_into_an_infra_error(mech, workdir, case):
    r = run(mech, FAKE_INFRA[case], workdir)
    assert r.status == "failed", r
