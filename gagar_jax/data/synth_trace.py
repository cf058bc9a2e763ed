"""pytest plugin of the task factory: which functions of the repository each test calls.

Loaded with ``-p _gagar_synth_trace`` into the sandboxed pytest (copied alone to a read-only
directory: it must not import gagar_jax). During each test's call phase a profile hook records
every Python function called whose file lies under the working directory; at the end of the
session it writes ``{"calls": {nodeid: [[path, first line], ...]}, "outcomes": {nodeid:
outcome}}`` to the file named by ``GAGAR_TRACE_OUT`` (relative to the working directory).
"""

import json
import os
import sys
import threading

_ROOT = os.getcwd() + os.sep
_CALLS: dict = {}
_OUTCOMES: dict = {}
_CURRENT: list = [None]


def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    name = code.co_filename
    if name.startswith(_ROOT) and _CURRENT[0] is not None:
        _CALLS[_CURRENT[0]].add((name[len(_ROOT) :], code.co_firstlineno))


def pytest_runtest_call(item):
    _CURRENT[0] = item.nodeid
    _CALLS.setdefault(item.nodeid, set())
    sys.setprofile(_profile)
    threading.setprofile(_profile)


def pytest_runtest_teardown(item):
    sys.setprofile(None)
    threading.setprofile(None)
    _CURRENT[0] = None


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        prev = _OUTCOMES.get(report.nodeid)
        if prev is None or prev == "passed":
            _OUTCOMES[report.nodeid] = (
                report.outcome
                if report.when == "call"
                else ("error" if report.failed else report.outcome)
            )


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("GAGAR_TRACE_OUT")
    if not out:
        return
    with open(out, "w") as f:
        json.dump({"calls": {k: sorted(v) for k, v in _CALLS.items()}, "outcomes": _OUTCOMES}, f)
