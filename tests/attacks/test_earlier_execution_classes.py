"""The execution-side classes of the previous security round, kept in the catalogue.

Replacing pytest's configuration, forging the report through files rewritten at exit, reaching
the process that holds the start marker, and colliding with the tree the verifier writes: each
must still end ``failed`` (never ``passed`` or ``infra_error``) with the new runner and the
private work tree, with nothing written outside the run. The full per-mechanism probes stay in
``tests/test_verify_sandbox_escapes.py`` and ``tests/test_verify_repo_escapes.py``.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execution_helpers import (  # noqa: E402
    MECHANISMS,
    assert_blocked,
    change,
    new_file,
    payload,
    verify,
)

ATTACKS = {
    # A configuration of its own: every file pytest would read is pristine, -c names the task's.
    "pytest_toml_at_root": new_file("pytest.toml", '[pytest]\naddopts = ["-p", "no:python"]\n'),
    "config_edited": change("pytest.ini", "[pytest]\n", "[pytest]\naddopts = --co\n"),
    "conftest_at_root": new_file("conftest.py", "import app\napp.half = lambda x: x / 2\n"),
    "setup_cfg_in_tests": new_file("tests/setup.cfg", "[tool:pytest]\naddopts = --co\n"),
    # Report files rewritten at exit (there are none to rewrite: the report is a stream).
    "files_rewritten_at_exit": payload(
        "import atexit, glob\n\n\n@atexit.register\ndef _f():\n"
        "    for p in glob.glob('*') + glob.glob('/tmp/*'):\n"
        "        try:\n            open(p, 'w').write('<testsuite/>')\n"
        "        except OSError:\n            pass\n"
    ),
    # The start marker's holder and the exit status: stdin reopened, PID 1 signalled.
    "marker_reopened_and_init_killed": payload(
        "import os, signal\n"
        "for path in ('/proc/1/fd/0', '/proc/self/fd/0'):\n"
        "    try:\n        fd = os.open(path, os.O_RDWR)\n        os.ftruncate(fd, 0)\n"
        "    except OSError:\n        pass\n"
        "for pid in (1, os.getppid()):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
    ),
    # Tree collisions the verifier has to write: the candidate's failure.
    "file_where_a_directory_goes": new_file("app.py/x.py", "x = 1\n"),
    "name_over_255_bytes": new_file("pkg/" + "a" * 300 + ".py", "x = 1\n"),
    # A setsid escapee that outlives the run and writes to the host.
    "setsid_escapee": payload(
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        "    if os.fork() == 0:\n        time.sleep(2)\n"
        "        for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):\n"
        "            try:\n                open(d + '/escaped', 'w').write('x')\n"
        "            except OSError:\n                pass\n"
        "        os._exit(0)\n    os._exit(0)\n"
    ),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_earlier_attack(name):
    assert_blocked(verify(ATTACKS[name]))


@pytest.mark.parametrize("mech", [m for m in MECHANISMS if not m.startswith("bwrap")])
@pytest.mark.parametrize("name", ["conftest_at_root", "marker_reopened_and_init_killed"])
def test_earlier_attack_on_the_fallback_mechanisms(name, mech):
    assert_blocked(verify(ATTACKS[name], mech))
