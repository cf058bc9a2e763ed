"""pytest plugin that reports test outcomes over a pipe only the verifier reads (issue 11).

Loaded into the sandboxed pytest with ``-p`` (before any conftest or test module is imported);
it must not import gagar_jax (the sandbox sees only this file, copied to a read-only directory).

At import it takes two inherited descriptors named in the environment: ``GAGAR_NONCE_FD`` (read
once and closed: a per-run secret) and ``GAGAR_OUTCOME_FD`` (the write end of a pipe whose read
end is held by the verifier only). It records every test's outcome from pytest's own reports
and, at the very end of the session, writes ONE line to the pipe and closes it::

  {"nonce": ..., "exitstatus": <pytest's exit status>, "outcomes": {nodeid: outcome}}

No file is involved: the code under test cannot rewrite this report after the fact (a file
named in ``sys.argv`` could be, from a ``__del__`` or at exit), and a second line, a wrong
nonce, or an exit status of the process different from the one recorded here is tampering.
"""

import json
import os

import pytest

_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
_OUTCOMES: dict = {}
_STATE = {"fd": -1, "nonce": ""}


def _take_fds() -> None:
    try:
        out_fd = int(os.environ.pop("GAGAR_OUTCOME_FD"))
        nonce_fd = int(os.environ.pop("GAGAR_NONCE_FD"))
    except (KeyError, ValueError):
        return
    chunks = []
    while True:
        b = os.read(nonce_fd, 256)
        if not b:
            break
        chunks.append(b)
    os.close(nonce_fd)
    _STATE["fd"], _STATE["nonce"] = out_fd, b"".join(chunks).decode("ascii", "replace")


_take_fds()


def pytest_runtest_logreport(report):
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
    prev = _OUTCOMES.get(report.nodeid)
    if prev is None or _RANK[outcome] >= _RANK[prev]:
        _OUTCOMES[report.nodeid] = outcome


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    fd = _STATE["fd"]
    if fd < 0:
        return
    _STATE["fd"] = -1
    line = json.dumps({"nonce": _STATE["nonce"], "exitstatus": int(exitstatus),
                       "outcomes": _OUTCOMES}) + "\n"  # fmt: skip
    data = line.encode()
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
