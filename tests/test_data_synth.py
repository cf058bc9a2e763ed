"""The task factory: each libcst transform, the issue template, and a small real run."""

import json
import os
import subprocess
import sys

import pytest

from gagar_jax.data import synth

SRC = """\
import functools


@functools.lru_cache
def f(a, b, xs, flag=True):
    y = a - b
    if a < b and xs:
        return xs[1:3]
    else:
        y = -y
    for i in range(len(xs)):
        y += i * 2
    while y > 100:
        y //= 2
    return y == 0


def untouched():
    return 1 + 2
"""
F = 4  # the first decorator's line: what co_firstlineno reports


def changes(transform):
    """{(removed lines) -> (added lines)} of every site of ``transform`` in ``f``."""
    out = []
    for i in range(synth.function_sites(SRC, F, transform)):
        m = synth.mutate(SRC, F, transform, i)
        assert m is not None and m != SRC
        compile(m, "m", "exec")
        assert m.split("def untouched")[1] == SRC.split("def untouched")[1]  # only f changes
        a, b = SRC.splitlines(), m.splitlines()
        out.append(
            (tuple(x.strip() for x in a if x not in b), tuple(x.strip() for x in b if x not in a))
        )
    return out


def test_functions_are_found_by_their_first_line():
    names = synth.functions_at(SRC)
    assert names[F] == "f" and names[F + 1] == "f" and names[18] == "untouched"


def test_flip_operator():
    c = changes("flip_operator")
    assert (("y = a - b",), ("y = a + b",)) in c
    assert (("if a < b and xs:",), ("if a < b or xs:",)) in c
    assert (("y += i * 2",), ("y += i // 2",)) in c


def test_flip_comparison():
    c = changes("flip_comparison")
    assert (("if a < b and xs:",), ("if a <= b and xs:",)) in c
    assert (("return y == 0",), ("return y != 0",)) in c
    assert (("while y > 100:",), ("while y >= 100:",)) in c


def test_invert_condition():
    c = changes("invert_condition")
    assert (("if a < b and xs:",), ("if not (a < b and xs):",)) in c
    assert (("while y > 100:",), ("while not (y > 100):",)) in c


def test_change_constant():
    c = changes("change_constant")
    assert (("return xs[1:3]",), ("return xs[2:3]",)) in c
    assert (("return y == 0",), ("return y == 1",)) in c
    assert (("def f(a, b, xs, flag=True):",), ("def f(a, b, xs, flag=False):",)) in c


def test_swap_operands():
    c = changes("swap_operands")
    assert c[0] == (("y = a - b",), ("y = b - a",))
    assert (("y //= 2",), ("y //= 2",)) not in c  # augmented assignments have no operands


def test_remove_assignment():
    c = changes("remove_assignment")
    assert (("y = a - b",), ("pass",)) in c and (("y = -y",), ("pass",)) in c


def test_remove_branch():
    c = changes("remove_branch")
    assert c == [(("else:", "y = -y"), ())]  # the else clause goes; an if without one goes whole


def test_remove_loop():
    c = changes("remove_loop")
    assert (("for i in range(len(xs)):", "y += i * 2"), ("pass",)) in c
    assert (("while y > 100:", "y //= 2"), ("pass",)) in c


def test_off_by_one():
    c = changes("off_by_one")
    assert (("return xs[1:3]",), ("return xs[1:3 - 1]",)) in c
    assert (("for i in range(len(xs)):",), ("for i in range(len(xs) - 1):",)) in c
    src = "def g(n):\n    return list(range(2, n)) + [0][1:]\n"
    outs = {synth.mutate(src, 1, "off_by_one", i) for i in range(2)}
    assert "range(2, n + 1)" in "".join(outs) and "[0][1 + 1:]" in "".join(outs)


def test_no_site_outside_the_function_and_bad_index():
    assert synth.function_sites(SRC, 999, "flip_operator") == 0
    assert synth.mutate(SRC, F, "flip_operator", 99) is None


def test_issue_names_the_symptom_never_the_code():
    log = (
        "    def test_x():\n>       assert f(2, 3) == 5\nE       assert -1 == 5\n"
        "E        +  where -1 = f(2, 3)\nsrc/m.py:3: AssertionError\n"
        "    y = a - b\n"
    )
    text = synth.issue_text("pkg", ["tests/test_m.py::test_x"], log)
    assert "assert -1 == 5" in text and "`tests/test_m.py::test_x`" in text
    assert "y = a - b" not in text and "a + b" not in text


def test_issue_evidence_only_from_the_failing_tests_sections():
    # a -rA log with the verifier's canary sections around the real failure
    log = (
        "=================================== FAILURES ===================================\n"
        "________________________________ test_c1a2b3c4 _________________________________\n"
        "E       assert (915143967 + 1) == 915143969\n"
        "_____________________________ ERROR at setup of test_c9 _____________________________\n"
        "E       RuntimeError: 664051692\n"
        "__________________________ Outer.test_merge_sorted __________________________\n"
        "E       assert [1, 2, 3] == [1, 2, 3, 4]\n"
        "________________________________ test_other _________________________________\n"
        "E       assert 0 == 1\n"
        "=========================== short test summary info ============================\n"
        "FAILED [canary] - assert (338031356 + 1) == 3...\n"
    )
    ev = synth.failure_evidence(log, ["pkg/tests/test_m.py::Outer::test_merge_sorted"])
    assert ev == "assert [1, 2, 3] == [1, 2, 3, 4]"
    assert "915143967" not in synth.issue_text("pkg", ["t.py::test_x"], log)


def test_run_ids_sample_the_covering_tests_and_add_same_file_tests():
    import random

    covering = [f"a.py::test_{i:04d}" for i in range(500)]
    passing = set(covering) | {"a.py::test_other", "b.py::test_far"}
    ids = synth._run_ids(covering, passing, random.Random(0), max_p2p=5, max_covering=40)
    # 40 sampled covering tests, then 5 other tests of a.py (unsampled covering ones included)
    assert len(ids) == 45 and len(set(ids)) == 45 and set(ids[:40]) <= set(covering)
    assert "b.py::test_far" not in ids  # another file is never collected
    few = synth._run_ids(covering[:3], passing, random.Random(0), max_p2p=2)
    assert few[:3] == tuple(covering[:3]) and len(few) == 5


ORDER_FILES = {
    "m.py": "def f():\n    return 2\n",
    "tests/test_m.py": "from m import f\n\n\ndef test_f():\n    assert f() == 1\n\n\n"
    "def test_g():\n    assert True\n",
}
ORDER_FIX = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 2\n+    return 1\n"


def test_validation_stops_at_the_first_run_that_rules_a_candidate_out():
    import threading

    from gagar_jax.envs.repo import RepoTask
    from gagar_jax.verify.repo import verify_repo_patch

    calls = []

    def verify(task, patch):  # the real sandboxed verifier, counted
        calls.append(patch)
        return verify_repo_patch(task, patch, run_monitor=False)

    gate = threading.Lock()
    good = RepoTask(
        "t",
        "",
        ORDER_FILES,
        ("tests/test_m.py::test_f",),
        ("tests/test_m.py::test_g",),
        reference_patch=ORDER_FIX,
    )
    screen = verify(good, "")
    assert screen.status == "failed"
    rep, gold = synth._validate_early(good, screen, 2, verify, gate)
    # the screening run was the first empty run: gold, empty, gold after it
    assert rep["gold"] == "passed" and rep["empty"] == "failed" and not rep["flaky_tests"]
    assert calls == ["", ORDER_FIX, "", ORDER_FIX] and gold.status == "passed"
    calls.clear()
    broken = RepoTask(
        "t",
        "",
        ORDER_FILES,
        ("tests/test_m.py::test_f",),
        ("tests/test_m.py::test_g",),
        reference_patch="",
    )
    rep, gold = synth._validate_early(broken, screen, 3, verify, gate)
    assert rep["gold"] == "failed" and calls == [""]  # one gold run, then no more
    # every fail-to-pass test failed: nothing is blamed on the order of the tests
    assert (
        synth._order_dependent(gold, ("tests/test_m.py::test_f",), ("tests/test_m.py::test_g",))
        == set()
    )


@pytest.mark.e2e
def test_factory_run_on_two_real_packages_validates(tmp_path):
    """pip-downloads two small pure-Python packages, makes a few tasks of each and validates
    them with ``python -m gagar_jax.data.swe validate``."""
    out = str(tmp_path / "out")
    cache = os.environ.get("GAGAR_REPO_CACHE") or str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-m", "gagar_jax.data.synth", "--packages",
                        "cachetools==8.0.2,toolz==1.0.0", "--out", out, "--tasks-per-package",
                        "2", "--max-candidates", "40", "--cache", cache],
                       capture_output=True, text=True, timeout=3000)  # fmt: skip  # argv pairs
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in open(os.path.join(out, "instances.jsonl"))]
    assert len({row["repo"] for row in rows}) == 2 and len(rows) >= 3
    for row in rows:
        assert json.loads(row["FAIL_TO_PASS"]) and json.loads(row["PASS_TO_PASS"])
        assert row["synth"]["transform"] in synth.TRANSFORMS
    stats = json.load(open(os.path.join(out, "synth_stats.json")))
    assert stats["tasks"] == len(rows) and sum(stats["transform_mix"].values()) == len(rows)
    report = str(tmp_path / "report.jsonl")
    v = subprocess.run([sys.executable, "-m", "gagar_jax.data.swe", "validate", "--instances",
                        os.path.join(out, "instances.jsonl"), "--repos",
                        os.path.join(out, "repos"), "--runs", "2", "--out", report,
                        "--cache", cache],
                       capture_output=True, text=True, timeout=3000)  # fmt: skip  # argv pairs
    assert v.returncode == 0, v.stdout + v.stderr
    lines = [json.loads(x) for x in open(report)]
    assert [x["instance_id"] for x in lines] == [row["instance_id"] for row in rows]
    assert all(x["gold"] == "passed" and x["empty"] == "failed" for x in lines), lines


def test_one_pass_site_counts_equal_the_mutator():
    sites = synth.all_sites(SRC)
    for t in synth.TRANSFORMS:
        assert sites.get((F, t), 0) == synth.function_sites(SRC, F, t), t
        assert sites.get((18, t), 0) == synth.function_sites(SRC, 18, t), t
