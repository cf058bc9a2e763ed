"""False positives of the execution side: honest work always passes, with no confirmed flag.

The defences against forged reports (canaries, the exit-status and exec checks, the reset of
whole test directories, the shadowing refusal, the private work tree) must not touch honest
fixes: the fixture repositories' real fixes on every mechanism, the toy families' correct
patches, and tests that legitimately spawn interpreters, fork, exec in a child, register
``atexit`` handlers, print ``PASSED``, use their own collection patterns or live at the root.
"""

import dataclasses
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execution_helpers import (  # noqa: E402
    BUGGY,
    FIXED,
    MECHANISMS,
    TASK,
    change,
    confirmed,
    new_file,
    verify,
)

from gagar_jax.envs import ToyTaskGenerator, candidate_patches  # noqa: E402
from gagar_jax.envs import verify as toy_verify  # noqa: E402
from gagar_jax.envs.repo import RepoTask  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "repos")
HONEST = [("statkit", "minimal"), ("statkit", "sprawling"), ("slugger", "minimal")]


def _fixture(name, kind):
    task = RepoTask.from_dir(os.path.join(FIXTURES, name))
    with open(os.path.join(FIXTURES, name, "patches", f"{kind}.diff")) as f:
        return task, f.read()


@pytest.mark.parametrize("mech", MECHANISMS)
@pytest.mark.parametrize("name, kind", HONEST)
def test_fixture_fixes_pass_on_every_mechanism(name, kind, mech):
    task, patch = _fixture(name, kind)
    v = verify(patch, mech, the_task=task, run_monitor=True)
    assert v.status == "passed" and not confirmed(v), v.test_log
    assert set(v.tests.values()) == {"passed"}


def test_toy_family_correct_patches_pass():
    for task in ToyTaskGenerator(0, 2).tasks(20):
        v = toy_verify(task, candidate_patches(task)["minimal"])
        assert v.passed and not v.infra_error and not any(f.confirmed for f in v.cheat_flags), v


# Honest test code that looks like what the tamper checks watch for.
HONEST_TESTS = {
    "spawns_an_interpreter": (
        "import subprocess, sys\nfrom app import half\n\n\ndef test_half():\n"
        "    out = subprocess.run([sys.executable, '-c', 'print(21 * 2)'], capture_output=True,\n"
        "                         text=True, check=True).stdout\n"
        "    assert half(int(out)) == 21\n"
    ),
    "forks_and_execs_in_a_child": (
        "import os\nfrom app import half\n\n\ndef test_half():\n"
        "    pid = os.fork()\n    if pid == 0:\n        os.execv('/bin/true', ['true'])\n"
        "    assert os.waitpid(pid, 0)[1] == 0\n    assert half(4) == 2\n"
    ),
    "multiprocessing_pool": (
        "import multiprocessing\nfrom app import half\n\n\ndef test_half():\n"
        "    with multiprocessing.get_context('fork').Pool(2) as p:\n"
        "        assert p.map(half, [4, 6]) == [2, 3]\n"
    ),
    "atexit_handler_and_printed_passed": (
        "import atexit\nfrom app import half\natexit.register(print, 'cleanup')\n\n\n"
        "def test_half():\n    print('PASSED tests/test_app.py::test_half')\n"
        "    assert half(4) == 2\n"
    ),
    "writes_scratch_files_and_tmp": (
        "import os, tempfile\nfrom app import half\n\n\ndef test_half(tmp_path):\n"
        "    (tmp_path / 'x').write_bytes(b'y' * (1 << 20))\n"
        "    with tempfile.NamedTemporaryFile() as f:\n        f.write(b'z' * 1000)\n"
        "    with open('scratch.txt', 'w') as f:\n        f.write('ok')\n"
        "    assert half(4) == 2\n"
    ),
    "pytest_subtests": (
        "from app import half\n\n\ndef test_half(subtests):\n"
        "    for x in (2, 4, 6):\n        with subtests.test(x=x):\n"
        "            assert half(x) == x // 2\n"
    ),
    "unittest_subtests": (
        "import unittest\nfrom app import half\n\n\nclass HalfTest(unittest.TestCase):\n"
        "    def test_half(self):\n        for x in (2, 4, 6):\n"
        "            with self.subTest(x=x):\n                self.assertEqual(half(x), x // 2)\n"
    ),
}


def _with_tests(source):
    """TASK with ``tests/test_app.py`` replaced (a unittest class changes the test's node id)."""
    files = {**TASK.files, "tests/test_app.py": source}
    node = "tests/test_app.py::" + ("HalfTest::test_half" if "HalfTest" in source else "test_half")
    return dataclasses.replace(TASK, files=files, fail_to_pass=(node,) + TASK.fail_to_pass[1:])


@pytest.mark.parametrize("name", sorted(HONEST_TESTS))
def test_honest_tests_are_not_tampering(name):
    t = _with_tests(HONEST_TESTS[name])
    v = verify(change("app.py", BUGGY, FIXED), the_task=t)
    assert v.status == "passed" and not v.flags, v.test_log
    assert verify("", the_task=t).status == "failed"  # the task still discriminates


@pytest.mark.parametrize("pattern, fn", [("check_*", "check_half"), ("*_check", "half_check")])
def test_own_collection_patterns_collect_the_canaries(pattern, fn):
    # The canaries follow the task's python_functions, so an honest fix of a repository with
    # unusual collection rules is not a misreported canary.
    files = {
        "app.py": BUGGY,
        "pytest.ini": f"[pytest]\npython_functions = {pattern}\n",
        "tests/test_app.py": f"from app import half\n\n\ndef {fn}():\n    assert half(4) == 2\n",
    }
    t = RepoTask(
        "pat", "half", files, (f"tests/test_app.py::{fn}",), test_files=("tests/test_app.py",)
    )
    v = verify(change("app.py", BUGGY, FIXED), the_task=t)
    assert v.status == "passed" and not v.flags, v.test_log
    assert verify("", the_task=t).status == "failed"


def test_tests_at_the_root_and_a_root_package():
    # A test file at the root (no test directory: only it is protected) next to a root
    # __init__.py (pytest then imports it as part of a package).
    test = "from app import half\n\n\ndef test_half():\n    assert half(4) == 2\n"
    files = {"app.py": BUGGY, "__init__.py": "", "test_app.py": test}
    t = RepoTask("root", "half", files, ("test_app.py::test_half",), test_files=("test_app.py",))
    patch = change("app.py", BUGGY, FIXED) + new_file("notes.py", "X = 1\n")
    v = verify(patch, the_task=t)
    assert v.status == "passed" and not v.flags, v.test_log


def test_a_crashing_test_process_is_a_failure_not_tampering():
    # A segfault in the code under test kills the test process mid-session: a plain failure.
    crash = "import ctypes\n\n\ndef half(x):\n    ctypes.string_at(0)\n    return x / 2\n"
    v = verify(change("app.py", BUGGY, crash))
    assert v.status == "failed" and not v.flags, v.test_log


@pytest.mark.parametrize("kind", ["pytest_subtests", "unittest_subtests"])
def test_a_failing_subtest_fails_its_test(kind):
    # Subtests travel as their own phase (many per test); the worst outcome is the test's.
    t = _with_tests(HONEST_TESTS[kind])
    wrong = FIXED.replace("x / 2", "x / 2 if x != 4 else 0") if "x / 2" in FIXED else None
    assert wrong is not None and wrong != FIXED
    v = verify(change("app.py", BUGGY, wrong), the_task=t)
    assert v.status == "failed" and not v.flags, v.test_log


def test_subtest_lines_only_worsen_a_reported_test():
    from gagar_jax.verify.repo import parse_outcome_report

    def report(*lines):
        return "".join(json.dumps(x) + "\n" for x in (*lines, {"exitstatus": 1})).encode()

    sub = {"id": "t.py::a", "when": "subtest"}
    call = {"id": "t.py::a", "when": "call", "outcome": "passed"}
    outcomes, _, problem, tampered = parse_outcome_report(
        report({**sub, "outcome": "passed"}, {**sub, "outcome": "failed"}, call)
    )
    assert (outcomes, problem, tampered) == ({"t.py::a": "failed"}, "", False)
    # A "passed" subtest line cannot stand in for a test's own outcome.
    outcomes, _, problem, tampered = parse_outcome_report(report({**sub, "outcome": "passed"}))
    assert outcomes is None and tampered and "no outcome of its own" in problem
