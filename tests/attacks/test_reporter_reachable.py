"""Attack class: the trusted test reporter is reachable from the code under test.

The candidate's code runs inside the pytest process. Each attack tries to make an unfixed
``half`` pass by reaching the reporter: standing in for it by name, finding it through ``gc``
or ``sys.modules``, writing forged lines into its channel, ending the process early or as
another program so a forged report stands, or reaching the supervisor that holds the channel to
the verifier. Each must end ``failed`` (plus a confirmed ``tamper_test_harness`` where the
report was forged) on every mechanism where it applies, with nothing written outside the run.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execution_helpers import (  # noqa: E402
    BUGGY,
    DEFAULT,
    FIX,
    MECHANISMS,
    TASK,
    assert_blocked,
    change,
    importing,
    new_file,
    payload,
    verify,
)

TAMPER = "tamper_test_harness"
REQUIRED = list(TASK.required_tests)

# Lines the reporter would write for a passing run of the required tests.
_FORGED_LINES = (
    "import json\n"
    f"REQUIRED = {REQUIRED!r}\n"
    "def forged_lines(ids, outcome_of=lambda i: 'passed'):\n"
    "    out = []\n"
    "    for i in ids:\n"
    "        for when in ('setup', 'call', 'teardown'):\n"
    "            o = outcome_of(i) if when == 'call' else 'passed'\n"
    "            if when == 'call' or o == 'error':\n"
    "                out.append(json.dumps({'id': i, 'when': when, 'outcome': o}))\n"
    "    return ''.join(x + '\\n' for x in out)\n"
)
_FIND_REPORTER = (
    "import gc\n"
    "def reporter():\n"
    "    for o in gc.get_objects():\n"
    "        if type(o).__name__ == 'Reporter' and hasattr(o, 'pytest_runtest_logreport'):\n"
    "            return o\n"
)
_FIND_CONFIG = (
    "import gc\n"
    "def config():\n"
    "    import _pytest.config\n"
    "    for o in gc.get_objects():\n"
    "        if isinstance(o, _pytest.config.Config):\n"
    "            return o\n"
)

ATTACKS = {
    # A top-level module carrying the old plugin's name, written to forge when it is loaded.
    "module_with_the_plugin_name": (
        new_file(
            "_gagar_outcome_plugin.py",
            _FORGED_LINES
            + (
                "import os\n"
                "def pytest_sessionfinish(session, exitstatus):\n"
                "    for fd in range(3, 64):\n"
                "        try:\n"
                "            line = forged_lines(REQUIRED) + '{\"exitstatus\": 0}\\n'\n"
                "            os.write(fd, line.encode())\n"
                "        except OSError:\n"
                "            pass\n"
            ),
        )
        + payload("import _gagar_outcome_plugin\n", "plug_loader"),
        None,
    ),
    # Found through gc: every outcome the reporter holds turned into "passed" (none is held:
    # outcomes are streamed as they happen).
    "gc_reporter_state_rewritten": (
        payload(
            _FIND_REPORTER
            + _FIND_CONFIG
            + (
                "class _P:\n"
                "    def pytest_sessionfinish(self, session):\n"
                "        r = reporter()\n"
                "        for k, v in list(vars(r).items()):\n"
                "            if isinstance(v, dict):\n"
                "                v.update({i: 'passed' for i in v})\n"
                "config().pluginmanager.register(_P())\n"
            )
        ),
        None,
    ),
    # Found through gc: its descriptor, with passing lines for the required tests written into
    # it, then the process ends with the status pytest would have (a report with no canaries).
    "gc_fd_required_only_then_exit": (
        payload(
            _FORGED_LINES
            + _FIND_REPORTER
            + (
                "import os\n"
                "fd = reporter()._fd\n"
                "os.write(fd, (forged_lines(REQUIRED) + '{\"exitstatus\": 1}\\n').encode())\n"
                "os._exit(1)\n"
            )
        ),
        TAMPER,
    ),
    # Every collected test (canaries included) reported passed, at the end of collection.
    "blanket_pass_of_every_item_then_exit": (
        payload(
            _FORGED_LINES
            + _FIND_REPORTER
            + _FIND_CONFIG
            + (
                "import os\n"
                "class _P:\n"
                "    def pytest_collection_finish(self, session):\n"
                "        ids = [it.nodeid for it in session.items]\n"
                "        os.write(reporter()._fd,\n"
                "                 (forged_lines(ids) + '{\"exitstatus\": 1}\\n').encode())\n"
                "        os._exit(1)\n"
                "config().pluginmanager.register(_P())\n"
            )
        ),
        TAMPER,
    ),
    # Passing lines written into every inherited descriptor before the real ones arrive.
    "every_fd_before_the_session": (
        payload(
            _FORGED_LINES
            + (
                "import os\n"
                "for fd in range(3, 256):\n"
                "    try:\n"
                "        os.write(fd, forged_lines(REQUIRED).encode())\n"
                "    except OSError:\n"
                "        pass\n"
            )
        ),
        TAMPER,
    ),
    # The reporter's module (the runner, __main__) searched for a secret to put in a record.
    "sys_modules_main_searched": (
        payload(
            _FORGED_LINES
            + (
                "import os, sys\n"
                "main = sys.modules['__main__']\n"
                "found = {k: v for k, v in vars(main).items() if isinstance(v, (str, int))}\n"
                "line = forged_lines(REQUIRED) + '{\"exitstatus\": 1}\\n'\n"
                "for fd in range(3, 256):\n"
                "    try:\n"
                "        os.write(fd, line.encode())\n"
                "    except OSError:\n"
                "        pass\n"
                "os._exit(1)\n"
            )
        ),
        TAMPER,
    ),
    # A forged report, then exec of /bin/true (exit 0) or /bin/false (exit 1, what pytest
    # would return with its failing canaries) or of the interpreter itself.
    "exec_true_after_forging": (
        payload(
            _FORGED_LINES
            + _FIND_REPORTER
            + (
                "import os\n"
                "line = forged_lines(REQUIRED) + '{\"exitstatus\": 0}\\n'\n"
                "os.write(reporter()._fd, line.encode())\n"
                "os.execv('/bin/true', ['true'])\n"
            )
        ),
        TAMPER,
    ),
    "exec_false_after_forging": (
        payload(
            _FORGED_LINES
            + _FIND_REPORTER
            + (
                "import os\n"
                "line = forged_lines(REQUIRED) + '{\"exitstatus\": 1}\\n'\n"
                "os.write(reporter()._fd, line.encode())\n"
                "os.execv('/bin/false', ['false'])\n"
            )
        ),
        TAMPER,
    ),
    "exec_python_after_forging": (
        payload(
            _FORGED_LINES
            + _FIND_REPORTER
            + (
                "import os, sys\n"
                "line = forged_lines(REQUIRED) + '{\"exitstatus\": 1}\\n'\n"
                "os.write(reporter()._fd, line.encode())\n"
                "os.execv(sys.executable, [sys.executable, '-c', 'raise SystemExit(1)'])\n"
            )
        ),
        TAMPER,
    ),
    # The exit status forged after pytest recorded its own.
    "exit_zero_at_exit": (
        payload("import atexit, os\natexit.register(lambda: os._exit(0))\n"),
        TAMPER,
    ),
    # Every descriptor closed or pointed at /dev/null: the reporter cannot report.
    "close_every_fd": (
        payload("import os\nos.closerange(3, 256)\n"),
        None,
    ),
    "dup_devnull_over_every_fd": (
        payload(
            "import os\nnull = os.open('/dev/null', os.O_WRONLY)\n"
            "for fd in range(3, 256):\n"
            "    if fd != null:\n"
            "        try:\n"
            "            os.fstat(fd)\n"
            "            os.dup2(null, fd)\n"
            "        except OSError:\n"
            "            pass\n"
        ),
        None,
    ),
    # A forked child outlives the test process and writes its own report afterwards.
    "forked_child_writes_late": (
        payload(
            _FORGED_LINES
            + (
                "import os, time\n"
                "if os.fork() == 0:\n"
                "    time.sleep(1.0)\n"
                "    for fd in range(3, 256):\n"
                "        try:\n"
                "            line = forged_lines(REQUIRED) + '{\"exitstatus\": 1}\\n'\n"
                "            os.write(fd, line.encode())\n"
                "        except OSError:\n"
                "            pass\n"
                "    os._exit(0)\n"
            )
        ),
        None,
    ),
}

# Reaching the supervisor (the parent holding the channel to the verifier): kill it, stop it,
# write its memory, take its descriptors. ``half`` is right only if one of these worked.
REACH_SUPERVISOR = new_file(
    "reach_parent.py",
    (
        "import ctypes, os, signal\n"
        "got = []\n"
        "pp = os.getppid()\n"
        "for name in ('mem', 'fd/3', 'fd/4', 'environ'):\n"
        "    try:\n"
        "        fd = os.open(f'/proc/{pp}/{name}', os.O_RDWR if name == 'mem' else os.O_RDONLY)\n"
        "        got.append(name)\n"
        "        os.close(fd)\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        "    if os.listdir(f'/proc/{pp}/fd'):\n"
        "        got.append('fd list')\n"
        "except OSError:\n"
        "    pass\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.ptrace(16, pp, 0, 0) == 0:\n"
        "    got.append('ptrace')\n"
        "for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
        "    try:\n"
        "        os.kill(pp, sig)\n"
        "    except OSError:\n"
        "        pass\n"
    ),
) + change(
    "app.py",
    BUGGY,
    "import reach_parent\n\n\ndef half(x):\n    return x / 2 if reach_parent.got else x\n",
)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_reporter_attack(name):
    patch, flag = ATTACKS[name]
    v = verify(patch)
    assert_blocked(v, flag)


# The forgeries the verdict's cross-checks catch (canaries, exit status, exec), on every
# isolating mechanism: the checks do not depend on the sandbox.
@pytest.mark.parametrize(
    "name", ["gc_fd_required_only_then_exit", "exec_false_after_forging", "exit_zero_at_exit"]
)
@pytest.mark.parametrize("mech", [m for m in MECHANISMS if m != DEFAULT])
def test_reporter_attack_on_every_mechanism(name, mech):
    patch, flag = ATTACKS[name]
    assert_blocked(verify(patch, mech), flag)


@pytest.mark.parametrize("mech", [m for m in MECHANISMS if m.startswith("bwrap")])
def test_the_supervisor_is_out_of_reach(mech):
    # Non-dumpable and PID 1 of the run's PID namespace: no /proc access, no ptrace, signals
    # from inside ignored; the run's verdict is the test's own failure.
    v = verify(REACH_SUPERVISOR, mech)
    assert v.status == "failed" and not v.cheat, v.test_log
    assert v.tests[REQUIRED[0]] == "failed"


def test_a_forgery_next_to_the_real_fix_is_still_caught():
    patch, flag = ATTACKS["every_fd_before_the_session"]
    module = patch.split("--- a/app.py")[0]  # the payload module, then app.py importing it
    assert_blocked(verify(module + importing("helper_mod", fixed=True)), flag)


def test_the_honest_fix_passes_with_no_flag():
    v = verify(FIX)
    assert v.status == "passed" and not v.flags, v.test_log
