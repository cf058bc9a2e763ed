"""Containment tests for run_sandboxed: every probe of shared/SANDBOX.md, per mechanism.

Each probe runs under every mechanism available here (bwrap+cgroup, bwrap, unshare, rlimits);
the expected verdict is asserted, and so is what each mechanism does NOT isolate (rlimits-only has
no network or filesystem isolation and must say so). Run as root with bubblewrap installed, as CI
does (`apt-get install -y bubblewrap` in .ci/run); without bwrap `test_strongest_mechanism`
fails with the install hint.
"""

import os
import socket
import stat
import tempfile
import time
import uuid

import pytest

from gagar_jax.verify import sandbox as sb
from gagar_jax.verify.sandbox import Limits, SandboxConfig, SandboxUnavailable, run_sandboxed

AVAILABLE = sb.available_mechanisms()
ISOLATING = [m for m in ("bwrap+cgroup", "bwrap", "unshare", "rlimits") if AVAILABLE[m] is None]
PY, PYPATH = sb.python_for_sandbox()
FAST = Limits(
    wall_s=10, cpu_s=10, memory_bytes=256 << 20, nproc=32, file_bytes=4 << 20, output_bytes=8 << 10
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="uid-drop probes need root")


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="gagar_sb_test_") as d:
        yield d


@pytest.fixture(params=ISOLATING)
def mech(request):
    return request.param


def run(mech, argv, workdir, limits=FAST, **kw):
    return run_sandboxed(argv, workdir, limits, config=SandboxConfig(mechanism=mech), **kw)


def py(code):
    return [PY, "-c", code]


def _pids_with_cmdline(needle: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        out.append(int(name))
            except OSError:
                pass
    return out


# --- mechanism selection ----------------------------------------------------------------------


def test_strongest_mechanism_is_bwrap():
    mech = sb.select_mechanism()
    assert mech.startswith("bwrap"), (
        f"sandbox fell back to {mech!r}: {AVAILABLE}. Install bubblewrap (apt-get install -y "
        "bubblewrap) and run as root, as .ci/run does."
    )
    if os.geteuid() == 0 and os.path.exists("/sys/fs/cgroup/pids/cgroup.procs"):
        assert mech == "bwrap+cgroup"


def test_no_isolation_is_refused_unless_allowed(workdir):
    with pytest.raises(SandboxUnavailable, match="not allowed"):
        run_sandboxed(["/bin/true"], workdir, config=SandboxConfig(mechanism="none"))
    r = run_sandboxed(
        ["/bin/true"], workdir, config=SandboxConfig(mechanism="none", allow_unisolated=True)
    )
    assert r.status == "passed" and r.mechanism == "none" and "uid" not in r.isolation


def test_bad_arguments_name_the_field(workdir):
    with pytest.raises(ValueError, match="argv"):
        run_sandboxed([], workdir)
    with pytest.raises(ValueError, match="workdir"):
        run_sandboxed(["/bin/true"], os.path.join(workdir, "missing"))
    with pytest.raises(ValueError, match="Limits.wall_s"):
        Limits(wall_s=0)
    with pytest.raises(ValueError, match="mechanism"):
        SandboxConfig(mechanism="docker")


# --- basic verdicts ---------------------------------------------------------------------------


def test_pass_fail_and_output(mech, workdir):
    argv = ["/bin/sh", "-c", "echo out; echo err >&2; echo data > f.txt"]
    r = run(mech, argv, workdir, private_workdir=False)  # the opt-out: the file is read back
    assert (r.status, r.returncode, r.stdout, r.stderr) == ("passed", 0, "out\n", "err\n")
    assert r.mechanism == mech and r.isolation == sb.ISOLATION[mech]
    assert open(os.path.join(workdir, "f.txt")).read() == "data\n"
    r = run(mech, ["/bin/sh", "-c", "exit 3"], workdir, private_workdir=False)
    assert (r.status, r.returncode) == ("failed", 3)


def test_infra_error_when_the_sandbox_cannot_start(workdir):
    # A missing command inside the sandbox is the command's failure (sh: not found -> 127) ...
    r = run_sandboxed(["/nonexistent/cmd"], workdir, FAST)
    assert r.status == "failed" and r.returncode == 127
    if os.geteuid() != 0:
        return
    # ... but a sandbox that cannot be set up is an infra error: the start marker was never
    # written. (A bind source under a private 0700 directory no longer is one: issue 11 binds it
    # through a root mount namespace.) Here bwrap cannot create the mount point: /dev is
    # read-only inside.
    with tempfile.TemporaryDirectory(prefix="gagar_sb_mnt_", dir="/dev") as under_dev:
        r = run_sandboxed(["/bin/true"], workdir, FAST, ro_paths=[under_dev])
    if sb.select_mechanism().startswith("bwrap"):
        assert r.status == "infra_error" and "did not start" in r.error, r
    with tempfile.TemporaryDirectory(prefix="gagar_sb_private_") as private:
        os.chmod(private, 0o700)
        os.mkdir(os.path.join(private, "inner"))
        r = run_sandboxed(["/bin/true"], workdir, FAST, ro_paths=[private + "/inner"])
    assert r.status == "passed", r


def test_code_cannot_fake_an_infra_error(mech, workdir):
    # Printing bwrap-like errors and exiting 1, or closing/truncating stdin, is an ordinary failure.
    r = run(
        mech,
        ["/bin/sh", "-c", "echo 'bwrap: setting up uid map: denied' >&2; exec 0<&-; exit 1"],
        workdir,
    )
    assert r.status == "failed"


# --- containment probes -----------------------------------------------------------------------


def test_fork_bomb_is_contained(mech, workdir):
    tag = uuid.uuid4().hex  # unique: another xdist worker may run its own bomb meanwhile
    code = f"import os  # {tag}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
    code += "        pass"
    t0 = time.monotonic()
    r = run(mech, py(code), workdir, Limits(wall_s=1, cpu_s=10, nproc=32, memory_bytes=256 << 20))
    assert r.status == "timeout" and "wall" in r.limit_hits
    assert time.monotonic() - t0 < 20  # generous: CI cores are shared
    assert not _pids_with_cmdline(tag)  # nothing of the bomb survives


def test_memory_hog_is_contained(mech, workdir):
    code = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))\n"
    r = run(mech, py(code), workdir, Limits(wall_s=10, memory_bytes=128 << 20))
    if mech == "bwrap+cgroup":
        # The cgroup OOM-kills at 128 MiB resident, before the 256 MiB address-space backstop.
        assert r.status == "resource_killed" and "memory" in r.limit_hits, r
    else:
        # RLIMIT_AS (2 x memory_bytes) makes the allocation fail inside Python.
        assert r.status == "failed" and "MemoryError" in r.stderr, r


def test_cpu_spin_is_killed_by_the_cpu_limit(mech, workdir):
    r = run(mech, py("while True: pass"), workdir, Limits(wall_s=60, cpu_s=1))
    assert r.status == "resource_killed", r
    if mech == "rlimits":
        assert "cpu" in r.limit_hits and r.signal == 24, r  # SIGXCPU
    elif mech != "unshare":  # unshare cannot say which signal killed its child
        # Under bwrap the code is PID 1 of its namespace (--as-pid-1): SIGXCPU is not delivered
        # to an init without a handler; the hard limit's SIGKILL (cpu_s + 1) ends it.
        assert "cpu" in r.limit_hits and r.signal == 9, r
    assert r.wall_s < 60 and "wall" not in r.limit_hits  # the CPU limit fired, not the wall


def test_cpu_spin_under_wall_timeout(mech, workdir):
    r = run(mech, ["/bin/sh", "-c", "while :; do :; done"], workdir, Limits(wall_s=0.5, cpu_s=30))
    assert r.status == "timeout" and r.wall_s < 15


def test_setsid_escapee_is_killed_and_run_does_not_hang(mech, workdir):
    tag = f"31.{uuid.uuid4().int % 10**9}"
    cmd = f"setsid sh -c 'sleep {tag}; touch escaped' > /dev/null 2>&1 & echo started"
    t0 = time.monotonic()
    r = run(mech, ["/bin/sh", "-c", cmd], workdir)
    assert r.status == "passed" and r.stdout == "started\n"
    # The escapee sleeps 31 s: returning well before proves no pipe was held open by it.
    assert time.monotonic() - t0 < 15
    assert not _pids_with_cmdline(f"sleep {tag}")
    assert not os.path.exists(os.path.join(workdir, "escaped"))


def test_output_flood_is_capped(mech, workdir):
    # 200 MiB attempted; RLIMIT_FSIZE (4 MiB here) stops the writer; 8 KiB is read back.
    r = run(
        mech,
        py("import sys\nb = b'x' * (1 << 20)\nfor _ in range(200): sys.stdout.buffer.write(b)"),
        workdir,
    )
    assert r.status == "resource_killed" and "file_size" in r.limit_hits, r
    assert r.stdout_truncated and len(r.stdout) < 9 << 10 and "bytes elided" in r.stdout


def test_loopback_connection(mech, workdir):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    code = (
        f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
        f"try:\n    s.connect(('127.0.0.1', {port}))\n    print('CONNECTED')\n"
        f"except OSError as e:\n    print('BLOCKED', e)\n"
    )
    try:
        r = run(mech, py(code), workdir)
        try:
            conn, _ = srv.accept()
            conn.close()
            accepted = True
        except TimeoutError:
            accepted = False
    finally:
        srv.close()
    if "network" in sb.ISOLATION[mech]:
        assert "BLOCKED" in r.stdout and not accepted, r
    else:  # rlimits-only: no network isolation, and the result says so
        assert "CONNECTED" in r.stdout and "network" not in r.isolation


@needs_root
def test_write_outside_workdir(mech, workdir):
    # In /tmp itself: a TMPDIR under a private 0700 directory would hide it from every uid.
    with tempfile.TemporaryDirectory(prefix="gagar_sb_outside_", dir="/tmp") as outside:
        os.chmod(outside, 0o777)  # world-writable: only namespaces keep it out of reach
        target = os.path.join(outside, "pwned")
        cmd = f"echo x > {target}; echo x > /usr/pwned; echo x > /etc/pwned; echo x > ok"
        r = run(mech, ["/bin/sh", "-c", cmd], workdir, private_workdir=False)
        assert r.status == "passed"  # the last command (inside the workdir) succeeded
        assert not os.path.exists("/usr/pwned") and not os.path.exists("/etc/pwned")
        assert os.path.exists(os.path.join(workdir, "ok"))
        if "filesystem" in sb.ISOLATION[mech]:
            assert not os.path.exists(target)
        else:
            assert os.path.exists(target)  # rlimits/unshare: a world-writable dir is reachable


@needs_root
def test_root_only_file_is_unreadable(mech, workdir):
    with tempfile.TemporaryDirectory(prefix="gagar_sb_secret_") as d:
        os.chmod(d, 0o755)
        secret = os.path.join(d, "secret")
        with open(secret, "w") as f:
            f.write("TOPSECRET")
        os.chmod(secret, stat.S_IRUSR | stat.S_IWUSR)
        ro = [d] if mech.startswith("bwrap") else []
        r = run(
            mech,
            ["/bin/sh", "-c", f"cat {secret}; cat /etc/shadow; cat /root/.bashrc"],
            workdir,
            ro_paths=ro,
        )
        assert "TOPSECRET" not in r.stdout and "root:" not in r.stdout
        # Visible (bound read-only, or the real path) yet unreadable by the slot uid.
        assert r.status == "failed" and f"{secret}: Permission denied" in r.stderr, r.stderr


@needs_root
def test_kill_all_cannot_reach_the_caller(mech, workdir):
    r = run(mech, ["/bin/sh", "-c", "kill -9 -1; echo alive"], workdir)
    assert r.status in ("passed", "resource_killed")  # it may kill itself, never us
    os.kill(os.getpid(), 0)


def test_concurrent_runs_use_distinct_slots(workdir):
    import concurrent.futures

    def one(i):
        with tempfile.TemporaryDirectory(prefix="gagar_sb_conc_") as d:
            return run_sandboxed(["/bin/sh", "-c", "id -u; sleep 0.3"], d, FAST)

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(one, range(4)))
    uids = {r.stdout.strip() for r in results}
    assert all(r.status == "passed" for r in results) and len(uids) == 4
