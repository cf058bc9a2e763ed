"""The sandboxed test runner: a supervisor, the pytest process, and the outcome reporter.

The verifier runs this file by absolute path (``python -P /abs/runner.py CTL_FD``) from a
read-only directory; it is never imported by name, so no module of the repository under test can
stand in for it, and it must not import gagar_jax (the sandbox sees only this file).

Before anything of the tree is importable it reads its control record (the pytest arguments and
the number of the outcome descriptor) from the inherited descriptor ``CTL_FD`` and closes it, marks
itself non-dumpable (``PR_SET_DUMPABLE 0``: its memory and descriptors are then out of reach of
processes of the same uid, through ``/proc/<pid>/mem``, ``/proc/<pid>/fd`` or ``ptrace``), and
forks:

- the **child** closes the outcome descriptor, renames itself (``PR_SET_NAME``) to a per-run name
  the supervisor chose, imports pytest and runs the session with the reporter registered as a
  plugin *object*. The reporter streams every outcome as pytest reports it, one line per
  phase, ``{"id": nodeid, "when": "setup"|"call"|"subtest"|"teardown", "outcome": ...}``, to a
  pipe read by
  the supervisor (what was sent cannot be taken back by changing the process's memory later);
  after ``pytest.main`` returns, the child writes a last line ``{"exitstatus": ...}`` and exits
  with pytest's exit status (its own ``atexit`` handlers and those of the code under test still
  run);
- the **supervisor** (PID 1 of the sandbox's PID namespace under bwrap, which ignores signals from
  inside it) holds the only copy of the outcome descriptor. It collects what arrives on the
  child's pipe until the child has exited, reads the exited child's name before reaping it (an
  ``exec`` of another program renames the process after the program), and writes ONE line to the
  verifier: ``{"report": <the child's bytes>, "exit": <the child's exit status>, "named": <its
  name was still the one given>}``. It exits with the child's exit status.

No secret sits in the pytest process: the record carries nothing the code under test could steal
to forge another one. The verifier trusts the report only as far as it agrees with what the
supervisor saw (the exit status, the process's name at exit) and with the canary tests, hidden
tests of unpredictable names whose outcomes the verifier knows in advance.
"""

import json
import os
import secrets
import select
import signal
import sys

_MAX_REPORT = 16 << 20
PR_SET_NAME = 15
PR_SET_DUMPABLE = 4


class Reporter:
    """pytest plugin object: streams every test phase's outcome from pytest's reports."""

    def __init__(self, fd):
        self._fd = fd

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            if hasattr(report, "wasxfail"):  # xfail counts as skipped, a strict xpass failed
                outcome = "skipped" if report.skipped else "failed"
            else:
                outcome = report.outcome
        elif report.failed:
            outcome = "error"  # setup or teardown failed
        elif report.skipped:
            outcome = "skipped"
        else:
            return
        when = report.when
        if when == "call" and hasattr(report, "context"):
            # A subtest (pytest's ``subtests`` fixture, unittest's ``subTest``): one test may
            # report many, so they travel as their own phase; the worst outcome still counts.
            when = "subtest"
        line = {"id": report.nodeid, "when": when, "outcome": outcome}
        _write_all(self._fd, (json.dumps(line) + "\n").encode())


def _read_all(fd, cap=_MAX_REPORT):
    chunks, total = [], 0
    while total <= cap:
        b = os.read(fd, 1 << 16)
        if not b:
            break
        chunks.append(b)
        total += len(b)
    return b"".join(chunks)


def _write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


def _prctl(option, arg):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def _child(args, report_fd, name):
    _prctl(PR_SET_NAME, name.encode())
    import pytest

    ret = int(pytest.main(list(args), plugins=[Reporter(report_fd)]))
    line = json.dumps({"exitstatus": ret}) + "\n"
    try:
        _write_all(report_fd, line.encode())
        os.close(report_fd)
    except OSError:
        pass
    return ret


def _supervise(pid, report_r, out_fd, name):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pidfd = os.pidfd_open(pid)
    chunks, total = [], 0
    while True:
        ready, _, _ = select.select([report_r, pidfd], [], [])
        if report_r in ready:
            b = os.read(report_r, 1 << 16)
            if b and total <= _MAX_REPORT:
                chunks.append(b)
                total += len(b)
            elif not b:
                ready = [pidfd]  # every writer closed: the child has exited or is about to
        if pidfd in ready:
            break
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    os.set_blocking(report_r, False)
    try:
        while total <= _MAX_REPORT:  # what the child wrote before it exited
            b = os.read(report_r, 1 << 16)
            if not b:
                break
            chunks.append(b)
            total += len(b)
    except BlockingIOError:
        pass
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            seen = f.read().strip().decode("ascii", "replace")
    except OSError:
        seen = ""
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    record = {
        "report": b"".join(chunks).decode("utf-8", "replace"),
        "exit": code,
        "named": seen == name,
        "name": seen,
    }
    _write_all(out_fd, (json.dumps(record) + "\n").encode())
    os.close(out_fd)
    os._exit(code if code >= 0 else 128 - code)


def main(argv):
    if argv[1:] == ["--check"]:  # preflight: everything the run needs is importable
        import ctypes  # noqa: F401

        import pytest  # noqa: F401

        return 0
    ctl_fd = int(argv[1])
    ctl = json.loads(_read_all(ctl_fd))
    os.close(ctl_fd)
    out_fd = int(ctl["out_fd"])
    _prctl(PR_SET_DUMPABLE, 0)  # inherited by the child: neither is reachable through /proc
    name = "t" + secrets.token_hex(7)
    report_r, report_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        os.close(out_fd)
        del ctl["out_fd"]
        sys.exit(_child(ctl["args"], report_w, name))
    os.close(report_w)
    _supervise(pid, report_r, out_fd, name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
