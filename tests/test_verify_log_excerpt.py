"""The verdict's pytest output keeps the failures, whatever the length of the passed list; the
factory's issue texts quote them; the factory rejects every leak kind the audit finds."""

from __future__ import annotations

from gagar_jax.data import synth
from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.log_excerpt import pytest_excerpt
from gagar_jax.verify.repo import verify_repo_patch
from gagar_jax.verify.sandbox import Limits

FAST = Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)


def _output(n_passed: int, traceback_lines: int = 5) -> str:
    tb = [f"    line_{i} = {i}" for i in range(traceback_lines)]
    return "\n".join(
        [
            "============================= test session starts =============================",
            "=================================== FAILURES ===================================",
            "__________________________________ test_sum __________________________________",
            *tb,
            ">       assert total(3) == 6",
            "E       assert 5 == 6",
            "E        +  where 5 = total(3)",
            "",
            "tests/test_m.py:9: AssertionError",
            "=========================== short test summary info ============================",
            *(f"PASSED tests/test_m.py::test_many[{i}]" for i in range(n_passed)),
            "FAILED tests/test_m.py::test_sum - assert 5 == 6",
            f"1 failed, {n_passed} passed in 0.50s",
        ]
    )


def test_a_short_output_is_kept_whole():
    text = _output(3)
    assert pytest_excerpt(text) == text


def test_the_failure_section_survives_a_long_passed_list():
    text = _output(2000)
    out = pytest_excerpt(text)
    assert len(out) < 7000 < len(text)
    assert "E       assert 5 == 6" in out and "tests/test_m.py:9: AssertionError" in out
    assert "1 failed, 2000 passed" in out and "FAILED tests/test_m.py::test_sum" in out
    assert "2000 PASSED lines" in out and "PASSED tests/test_m.py::test_many[7]" not in out
    # a traceback longer than the budget keeps its tail: the E lines and the failing line
    out = pytest_excerpt(_output(2000, traceback_lines=3000))
    assert "E       assert 5 == 6" in out and "line_2999" in out and "line_0 " not in out
    assert "lines of this section left out" in out


MODULE = "def total(n):\n    return sum(range(n))\n"
TESTS = (
    "import pytest\n\nfrom m import total\n\n\n"
    "@pytest.mark.parametrize('i', range(400))\n"
    "def test_many(i):\n    assert i >= 0\n\n\n"
    "def test_sum():\n    assert total(3) == 6, 'total(3) must count 1, 2 and 3'\n"
)


def test_an_issue_text_quotes_the_assertion_of_a_long_passing_run():
    task = RepoTask(
        "long-run",
        "x",
        {"m.py": MODULE, "tests/test_m.py": TESTS},
        ("tests/test_m.py::test_sum",),
        tuple(f"tests/test_m.py::test_many[{i}]" for i in range(400)),
        test_files=("tests/test_m.py",),
    )
    v = verify_repo_patch(task, "", limits=FAST, run_monitor=False)
    assert v.status == "failed" and v.tests["tests/test_m.py::test_sum"] == "failed"
    issue = synth.issue_text("m", ["tests/test_m.py::test_sum"], v.test_log)
    assert "total(3) must count 1, 2 and 3" in issue, issue
    assert "without an assertion message" not in issue


def test_the_factory_rejects_every_leak_kind_by_name():
    assert synth.leak_reason({"file_text": ["a.py: ..."]}) == "leaks_file_text"
    assert synth.leak_reason({"issue_text": ["<issue text>"]}) == "issue_leaks_fix"
    assert synth.leak_reason({"patch_files": ["x.orig"], "file_text": ["y"]}) == "leaks_patch_files"
    # a fix line found verbatim in a sibling file is a file_text leak the factory rejects
    fix = "-    return sum(range(n))\n+    return sum(range(1, n + 1))\n"
    patch = f"--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def total(n):\n{fix}"
    files = {
        "m.py": MODULE,
        "notes.py": "# the old total:\n#    return sum(range(1, n + 1))\n",
        "tests/test_m.py": TESTS,
    }
    task = RepoTask("leaky", "total is wrong", files, ("tests/test_m.py::test_sum",),
                    reference_patch=patch)  # fmt: skip
    from gagar_jax.data import audit

    kinds = audit.leak_kinds(task)
    assert "file_text" in kinds
    assert synth.leak_reason(kinds) == "leaks_file_text"
