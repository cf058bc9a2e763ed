"""The Python-repo test verifier on small real repositories (tests/fixtures/repos)."""

import dataclasses
import difflib
import os

import pytest

from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify import repo as repo_mod
from gagar_jax.verify.repo import parse_junit, prepare_tree, verify_repo_patch
from gagar_jax.verify.sandbox import Limits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "repos")
FAST = Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)


def _task(name):
    return RepoTask.from_dir(os.path.join(FIXTURES, name))


def _patch(name, kind):
    with open(os.path.join(FIXTURES, name, "patches", f"{kind}.diff")) as f:
        return f.read()


def _new_file_diff(path, text):
    return "".join(difflib.unified_diff([], text.splitlines(True), "/dev/null", f"b/{path}"))


# (repo, patch kind or None for the pristine repo, expected status, expected test-file reset)
CASES = [
    ("statkit", None, "failed", ()),
    ("statkit", "minimal", "passed", ()),
    ("statkit", "sprawling", "passed", ()),
    ("statkit", "edit_tests", "failed", ("tests/test_stats.py",)),
    ("statkit", "edit_tests_with_fix", "passed", ("tests/test_stats.py",)),
    ("statkit", "delete_tests", "failed", ("tests/test_stats.py",)),
    ("statkit", "skip_failing", "failed", ("tests/test_stats.py",)),
    ("statkit", "exit_at_import", "failed", ()),
    ("statkit", "fake_passed", "failed", ()),
    ("statkit", "conftest_hack", "failed", ("conftest.py",)),
    ("slugger", None, "failed", ()),
    ("slugger", "minimal", "passed", ()),
    ("slugger", "special_case", "passed", ()),  # passes the tests: the monitor's job
    ("slugger", "network", "failed", ()),
]


# Patches whose monitor flags are confirmed (reward 0 through the cheat penalty).
CHEATS = {
    "edit_tests",
    "edit_tests_with_fix",
    "delete_tests",
    "skip_failing",
    # (exit_at_import fails by construction: no end-of-run record; os._exit is evidence only)
    "fake_passed",
    "conftest_hack",
    "special_case",
    "network",
}


@pytest.mark.parametrize("name, kind, status, reset", CASES)
def test_fixture_verdicts(name, kind, status, reset):
    task = _task(name)
    v = verify_repo_patch(task, _patch(name, kind) if kind else "", limits=FAST)
    assert v.status == status, v.test_log
    assert v.cheat == (kind in CHEATS), v.flags
    assert v.reset_files == reset
    assert v.sandbox is not None and v.sandbox.mechanism.startswith("bwrap")
    if status == "passed":
        assert set(v.tests.values()) == {"passed"}
    if kind == "exit_at_import":
        # pytest exited 0 (os._exit at import) without a report: the exit code proves nothing.
        assert v.sandbox.returncode == 0 and v.sandbox.status == "passed"
        assert set(v.tests.values()) == {"missing"} and "no test report" in v.test_log
    if kind == "fake_passed":
        assert "PASSED tests/test_stats.py::test_median_even" in v.sandbox.stdout  # printed only
        assert v.tests["tests/test_stats.py::test_median_even"] == "failed"
    if name == "slugger" and kind is None:
        # The fail-to-pass test comes from the hidden test_patch, not from the repository.
        assert "test_collapses_runs" not in task.files["tests/test_slug.py"]
        assert v.tests["tests/test_slug.py::test_collapses_runs"] == "failed"


def test_shadowing_pytest_with_a_fake_module_does_not_work():
    fake = (
        "import sys\n"
        "path = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--junitxml=')][0]\n"
        "open(path, 'w').write('<testsuites><testsuite>' + ''.join(\n"
        '    \'<testcase file="tests/test_stats.py" classname="tests.test_stats" \'\n'
        "    'name=\"%s\"/>'\n"
        "    % n for n in ['test_median_even', 'test_mean', 'test_mean_empty',\n"
        "                  'test_median_odd', 'test_spread']) + '</testsuite></testsuites>')\n"
    )
    for path in ("pytest.py", "_pytest/__init__.py"):
        v = verify_repo_patch(_task("statkit"), _new_file_diff(path, fake), limits=FAST)
        # Refused before the run: the module would shadow the test framework.
        assert v.status == "failed" and v.sandbox is None and "shadowing" in v.patch_error


def test_patch_that_does_not_apply_fails_without_running():
    v = verify_repo_patch(_task("statkit"), "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    assert v.status == "failed" and v.patch_error and v.sandbox is None
    assert "not in the repository" in v.test_log


def test_infinite_loop_times_out():
    loop = _new_file_diff("statkit/loop.py", "while True:\n    pass\n")
    imp = (
        "--- a/statkit/__init__.py\n+++ b/statkit/__init__.py\n@@ -1,2 +1,3 @@\n"
        ' """statkit: small descriptive statistics."""\n+import statkit.loop  # noqa\n \n'
    )
    v = verify_repo_patch(_task("statkit"), loop + imp, limits=Limits(wall_s=3, cpu_s=30))
    assert v.status == "timeout" and not v.passed and not v.infra_error


def test_missing_pytest_in_the_sandbox_is_an_infra_error(monkeypatch):
    # A real fault: the sandboxed interpreter without the site-packages that hold pytest.
    exe, _ = repo_mod.python_for_sandbox()
    monkeypatch.setattr(repo_mod, "python_for_sandbox", lambda: (exe, ()))
    monkeypatch.setattr(repo_mod, "_PREFLIGHT", {})
    v = verify_repo_patch(_task("statkit"), _patch("statkit", "minimal"), limits=FAST)
    assert v.status == "infra_error" and v.infra_error and "not importable" in v.test_log


def test_a_busy_moment_is_not_remembered_as_an_infra_error(tmp_path):
    """Load turned a sound task's validation into infra_error: the check that pytest runs in the
    sandbox (once per environment) could not run on a busy machine, and its failure was kept,
    so every later verification of the process came back infra_error (an empty patch
    included; two first calls at once also raced to set it). Reproduced for real here: every
    sandbox slot is busy while the check runs. That call is the infrastructure's (masked);
    once the slot is free, the verdicts are the code's."""
    import threading

    from gagar_jax.verify import sandbox
    from gagar_jax.verify.sandbox import SandboxConfig, run_sandboxed

    cfg = SandboxConfig(num_slots=1, slot_wait_s=0.5, uid_base=61950)  # a pool of its own
    unprobed = dataclasses.replace(cfg, slot_wait_s=0.4)  # the same slots, never probed yet
    strongest = sandbox.select_mechanism(cfg)  # probed while the slot is free
    work = tmp_path / "holder"
    work.mkdir()
    os.chmod(work, 0o755)
    holder = threading.Thread(
        target=run_sandboxed,
        args=(["/bin/sleep", "6"], str(work)),
        kwargs={"limits": Limits(wall_s=60), "config": cfg},
    )
    holder.start()
    try:
        for _ in range(600):  # until the holder has the only slot
            if sandbox._local_slots:
                break
            threading.Event().wait(0.05)
        busy = verify_repo_patch(_task("statkit"), "", config=cfg, limits=FAST)
        assert busy.status == "infra_error" and "could not run the pytest check" in busy.test_log
        # a mechanism probe on the busy machine: this run is the infrastructure's, not a raise
        r = run_sandboxed(["/bin/true"], str(work), config=unprobed)
        assert r.status == "infra_error" and "probing the sandbox" in r.error
    finally:
        holder.join()
    assert sandbox.select_mechanism(unprobed) == strongest  # not downgraded, not remembered
    assert verify_repo_patch(_task("statkit"), "", config=cfg, limits=FAST).status == "failed"
    fix = verify_repo_patch(_task("statkit"), _patch("statkit", "minimal"), config=cfg, limits=FAST)
    assert fix.status == "passed", fix.test_log


def test_prepare_tree_resets_protected_files_and_applies_hidden_tests():
    task = _task("slugger")
    hack = _new_file_diff("tests/conftest.py", "x = 1\n")
    hack += _new_file_diff("pytest.ini", "[pytest]\n")
    files, reset = prepare_tree(task, hack)
    assert reset == ("pytest.ini", "tests/conftest.py")
    assert "tests/conftest.py" not in files and "pytest.ini" not in files
    assert "test_collapses_runs" in files["tests/test_slug.py"]


def test_parse_junit_node_ids_and_worst_outcome():
    xml = b"""<testsuites><testsuite>
      <testcase file="tests/t.py" classname="tests.t" name="test_a"/>
      <testcase file="tests/t.py" classname="tests.t.TestK" name="test_b[1-x]"><failure/></testcase>
      <testcase file="tests/t.py" classname="tests.t" name="test_c"><skipped/></testcase>
      <testcase file="tests/t.py" classname="tests.t" name="test_d"/>
      <testcase file="tests/t.py" classname="tests.t" name="test_d"><error/></testcase>
    </testsuite></testsuites>"""
    assert parse_junit(xml) == {
        "tests/t.py::test_a": "passed",
        "tests/t.py::TestK::test_b[1-x]": "failed",
        "tests/t.py::test_c": "skipped",
        "tests/t.py::test_d": "error",
    }


def test_task_validation_and_json_round_trip():
    task = _task("statkit")
    assert RepoTask.from_dict(task.to_dict()) == task
    with pytest.raises(ValueError, match="fail_to_pass"):
        RepoTask("t", "i", {"a.py": ""}, ())
    with pytest.raises(ValueError, match="not 'file::name'"):
        RepoTask("t", "i", {"a.py": ""}, ("test_a",))
    with pytest.raises(ValueError, match="missing field 'files'"):
        RepoTask.from_dict({"task_id": "t", "issue": "", "fail_to_pass": []})


@pytest.mark.parametrize(
    "patch",
    [
        "",
        "garbage",
        "--- a/../../etc/passwd\n+++ b/../../etc/passwd\n@@ -1 +1 @@\n-x\n+y\n",
        "--- a/statkit/stats.py\n+++ b/statkit/stats.py\n@@ -1,99999999 +1,99999999 @@\n-x\n",
        "diff --git a/x b/y\nrename from x\nrename to y\n",
        "GIT binary patch\nliteral 0\n",
        "--- /dev/null\n+++ b/statkit/stats.py\n@@ -0,0 +1 @@\n+x = 1\n",
    ],
)
def test_garbage_patches_fail_and_are_never_infra_errors(patch):
    v = verify_repo_patch(_task("statkit"), patch, limits=FAST)
    assert v.status == "failed" and not v.infra_error and not v.passed


def test_a_broken_task_is_an_infra_error_not_a_failure():
    import dataclasses

    bad = dataclasses.replace(
        _task("slugger"), test_patch="--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    v = verify_repo_patch(bad, _patch("slugger", "minimal"), limits=FAST)
    assert v.status == "infra_error" and "test_patch does not apply" in v.test_log


def test_task_dependencies_via_extra_pythonpath():
    import pathlib
    import shutil
    import tempfile

    base = pathlib.Path(tempfile.mkdtemp(prefix="gagar_deps_"))  # /tmp/pytest-of-root is 0700
    dep = base / "deps"
    dep.mkdir()
    (dep / "helperlib.py").write_text("def double(x):\n    return 2 * x\n")
    for p in (base, dep):
        os.chmod(p, 0o755)
    os.chmod(dep / "helperlib.py", 0o644)
    task = RepoTask(
        "dep-task",
        "use helperlib",
        {
            "app.py": "import helperlib\n\n\ndef quad(x):\n    return helperlib.double(2 * x)\n",
            "tests/test_app.py": "from app import quad\n\n\ndef test_quad():\n"
            "    assert quad(3) == 12\n",
        },
        ("tests/test_app.py::test_quad",),
        test_files=("tests/test_app.py",),
    )
    assert verify_repo_patch(task, "", limits=FAST).status == "failed"  # helperlib not visible
    v = verify_repo_patch(task, "", limits=FAST, extra_pythonpath=[str(dep)])
    shutil.rmtree(base)
    assert v.status == "passed", v.test_log


def test_fifos_left_in_the_tree_do_not_hang_the_verifier(tmp_path):
    # At exit, leave FIFOs where a report or a kept file could be: a blocking open would hang.
    # (The report itself travels through a pipe the code has no path to: issue 11.)
    hack = (
        "import atexit, os\n\n\n@atexit.register\ndef _swap():\n"
        "    for name in ('report.xml', 'statkit/fifo'):\n        os.mkfifo(name)\n"
    )
    imp = (
        "--- a/statkit/__init__.py\n+++ b/statkit/__init__.py\n@@ -1,2 +1,3 @@\n"
        ' """statkit: small descriptive statistics."""\n+import statkit.swap  # noqa\n \n'
    )
    patch = _new_file_diff("statkit/swap.py", hack) + imp + _patch("statkit", "minimal")
    v = verify_repo_patch(_task("statkit"), patch, limits=FAST, keep_dir=str(tmp_path / "kept"))
    assert v.status == "passed", v.test_log  # the fix is right; FIFOs are no outcome
    assert (tmp_path / "kept" / "statkit" / "swap.py").exists()
    assert not (tmp_path / "kept" / "statkit" / "fifo").exists()
