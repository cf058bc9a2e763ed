"""SWE-bench-format import, grading, log parsing, git snapshots and uv environments."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from gagar_jax.data import repos, swe
from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.repo import verify_repo_patch
from tests.swe_fixtures import make_instance, src_layout_row

# ---- rows ------------------------------------------------------------------------------------

ROW = {
    "instance_id": "a__b-1",
    "repo": "a/b",
    "base_commit": "abc1234",
    "patch": "",
    "test_patch": "",
    "problem_statement": "x",
    "hints_text": "",
    "created_at": "",
    "version": "1",
    "FAIL_TO_PASS": '["t.py::test_a"]',
    "PASS_TO_PASS": '["t.py::test_b"]',
    "environment_setup_commit": "abc1234",
}


def test_rows_round_trip_jsonl_json_parquet(tmp_path):
    listy = dict(ROW, instance_id="a__b-2", FAIL_TO_PASS=["t.py::c"], PASS_TO_PASS=[])
    insts = [swe.parse_instance(ROW), swe.parse_instance(listy)]
    assert insts[0].FAIL_TO_PASS == ("t.py::test_a",) and insts[1].FAIL_TO_PASS == ("t.py::c",)
    jl = str(tmp_path / "i.jsonl")
    swe.write_instances(jl, insts)
    assert swe.load_instances(jl) == insts
    js = str(tmp_path / "i.json")
    with open(js, "w") as f:
        json.dump([i.to_row() for i in insts], f)
    assert swe.load_instances(js) == insts
    import pyarrow as pa
    import pyarrow.parquet as pq

    pqp = str(tmp_path / "i.parquet")
    pq.write_table(pa.Table.from_pylist([i.to_row() for i in insts]), pqp)
    assert swe.load_instances(pqp) == insts


def test_empty_fail_to_pass_is_refused_by_name():
    for empty in ("[]", [], ""):
        with pytest.raises(swe.EmptyFailToPass, match="FAIL_TO_PASS is empty"):
            swe.parse_instance(dict(ROW, FAIL_TO_PASS=empty))
    with pytest.raises(swe.InstanceError, match="missing field 'base_commit'"):
        swe.parse_instance({k: v for k, v in ROW.items() if k != "base_commit"})
    with pytest.raises(swe.InstanceError, match="PASS_TO_PASS is not a JSON list"):
        swe.parse_instance(dict(ROW, PASS_TO_PASS="[oops"))
    with pytest.raises(swe.InstanceError, match="repo must be 'owner/name'"):
        swe.parse_instance(dict(ROW, repo="../etc"))


# ---- grading and the log parser ---------------------------------------------------------------


def test_grade_follows_swebench_rules():
    f2p, p2p = ["a::f"], ["a::p", "a::q"]
    assert (
        swe.grade({"a::f": "passed", "a::p": "passed", "a::q": "skipped"}, f2p, p2p)["resolved"]
        == swe.RESOLVED_FULL
    )  # a skipped P2P test is kept
    r = swe.grade({"a::f": "skipped", "a::p": "passed", "a::q": "passed"}, f2p, p2p)
    assert r["resolved"] == swe.RESOLVED_NO and r["FAIL_TO_PASS"]["failure"] == ["a::f"]
    assert swe.grade({"a::p": "PASSED", "a::q": "PASSED"}, f2p, p2p)["resolved"] == "RESOLVED_NO"
    assert (
        swe.grade({"a::f": "XFAIL", "a::p": "PASSED", "a::q": "PASSED"}, f2p, p2p)["resolved"]
        == swe.RESOLVED_FULL
    )
    two = swe.grade(
        {"a::f": "PASSED", "a::g": "FAILED", "a::p": "PASSED"}, ["a::f", "a::g"], ["a::p"]
    )
    assert two["resolved"] == swe.RESOLVED_PARTIAL
    # an id cut inside its parameters matches by prefix when the matches agree
    assert swe.grade({"a::f[x-1]": "PASSED"}, ["a::f[x-"], [])["resolved"] == swe.RESOLVED_FULL


def _swebench_parser():
    spec = importlib.util.find_spec("swebench")
    if spec is None:
        pytest.skip("swebench (test dependency) is not installed")
    root = os.path.dirname(spec.origin)
    # import only the log parser module: swebench's package __init__ pulls in docker
    saved = {k: v for k, v in sys.modules.items() if k.startswith("swebench")}
    for name, sub in (
        ("swebench", ""),
        ("swebench.harness", "harness"),
        ("swebench.harness.log_parsers", "harness/log_parsers"),
    ):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(root, sub)]
        sys.modules[name] = m
    try:
        from swebench.harness.log_parsers.python import parse_log_pytest

        return parse_log_pytest
    finally:
        for k in [k for k in sys.modules if k.startswith("swebench")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _recorded_log(tmp_path) -> str:
    """A real pytest -rA log: passed, failed (with a ' - ' message), error, skipped, xfail,
    xpass, parametrized ids with spaces and dashes."""
    (tmp_path / "test_rec.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup - broke')\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2, 'one - two'\n\n"
        "def test_err(broken):\n    pass\n\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skip():\n    pass\n\n"
        "@pytest.mark.xfail\ndef test_xf():\n    assert False\n\n"
        "@pytest.mark.xfail\ndef test_xp():\n    pass\n\n"
        "@pytest.mark.parametrize('v', ['a b', 'x-y', 1])\ndef test_p(v):\n    assert v != 1\n\n"
        "class TestK:\n    def test_m(self):\n        pass\n"
    )
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider",
                        "test_rec.py"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTEST_ADDOPTS": ""})  # fmt: skip  # argv pairs
    return r.stdout


def test_log_parser_equals_swebench_on_recorded_logs(tmp_path):
    theirs = _swebench_parser()
    logs = [
        _recorded_log(tmp_path),
        "PASSED a.py::t\nFAILED b.py::x - boom - again\nSKIPPED [2] a.py:3: why\n"
        "ERROR c.py::e - E\nXFAIL d.py::x\nPASSED\nPASSED [100%]\n  PASSED e.py::no\n"
        "FAILED b.py::x\n",
    ]
    for log in logs:
        mine = swe.parse_log_pytest(log)
        assert mine == theirs(log, None)
    rec = swe.parse_log_pytest(logs[0])
    assert rec["test_rec.py::test_ok"] == "PASSED" and rec["test_rec.py::test_bad"] == "FAILED"
    assert rec["test_rec.py::test_err"] == "ERROR" and rec["test_rec.py::test_xf"] == "XFAIL"


# ---- snapshots, environments and the verifier -------------------------------------------------


def test_snapshot_from_git_has_no_history_and_is_cached(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = src_layout_row(repos_dir)
    tree = repos.snapshot(repos_dir, "acme/srcpkg", row["base_commit"], cache)
    assert not os.path.exists(os.path.join(tree, ".git"))
    files = repos.read_text_tree(tree)
    assert "a - b" in files["src/srcpkg/__init__.py"] and "tests/test_add.py" not in files
    assert repos.snapshot(repos_dir, "acme/srcpkg", row["base_commit"][:10], cache) == tree
    # a bare store and a bundle give the same tree
    src = os.path.join(repos_dir, "acme__srcpkg")
    for kind in ("bare", "bundle"):
        d = str(tmp_path / kind)
        os.makedirs(d)
        if kind == "bare":
            repos.git("clone", "-q", "--bare", src, os.path.join(d, "acme__srcpkg.git"))
        else:
            repos.git(
                "bundle", "create", "-q", os.path.join(d, "acme__srcpkg.bundle"), "--all", cwd=src
            )
        t = repos.snapshot(d, "acme/srcpkg", row["base_commit"], str(tmp_path / f"c_{kind}"))
        assert repos.read_text_tree(t) == files
    with pytest.raises(repos.RepoNotFound, match="acme__nope"):
        repos.find_repo(repos_dir, "acme/nope")


def test_src_layout_with_third_party_test_dependency_verifies_right(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    inst = swe.parse_instance(src_layout_row(repos_dir))
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache)
    assert task.pythonpath == ("src",) and task.env_hash and os.path.isdir(task.env_path)
    assert "cachetools==5.5.0" in open(os.path.join(task.env_path, ".gagar-env")).read()
    # compiled to bytecode: the read-only environment never recompiles pytest in a run
    assert json.load(open(os.path.join(task.env_path, ".gagar-env")))["format"] == 2
    site = os.path.join(task.env_path, "lib")
    assert any(n.endswith(".pyc") for _, _, names in os.walk(site) for n in names)
    gold = verify_repo_patch(task, inst.patch)
    assert gold.status == "passed", gold.test_log
    # the task's own reference fix is never a leak
    assert not [f for f in gold.flags if f.rule == "leaked_solution"]
    empty = verify_repo_patch(task, "")
    assert empty.status == "failed"
    assert empty.tests == {
        "tests/test_add.py::test_add": "failed",
        "tests/test_neg.py::test_neg": "passed",
    }
    # without the environment the third-party import fails: the env is what made it pass
    bare = verify_repo_patch(dataclasses.replace(task, env_path=""), inst.patch, run_monitor=False)
    assert bare.status == "failed" and bare.tests["tests/test_add.py::test_add"] != "passed"
    # the environment is built once and reused
    again = repos.build_env(list(inst.python_deps), cache_dir=cache)
    assert again.reused and again.env_hash == task.env_hash and again.path == task.env_path


FILES = {
    "m.py": "def f():\n    return 1\n",
    "test_m.py": "import time\n\nimport pytest\n\nfrom m import f\n\n\n"
    "def test_f():\n    assert f() == 2\n\n\n"
    "@pytest.mark.skip(reason='platform')\ndef test_skipped():\n    pass\n\n\n"
    "def test_ok():\n    assert True\n\n\n"
    "def test_hangs():\n    time.sleep(60)\n",
}
FIX = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f():\n-    return 1\n+    return 2\n"


def test_skipped_p2p_kept_skipped_f2p_fails_and_per_test_timeout():
    t = RepoTask(
        "t",
        "f must return 2",
        FILES,
        ("test_m.py::test_f",),
        ("test_m.py::test_skipped", "test_m.py::test_ok"),
    )
    assert verify_repo_patch(t, FIX, run_monitor=False).status == "passed"
    skip_f2p = dataclasses.replace(
        t, fail_to_pass=("test_m.py::test_skipped",), pass_to_pass=("test_m.py::test_ok",)
    )
    assert verify_repo_patch(skip_f2p, FIX, run_monitor=False).status == "failed"
    # a hanging test fails that test, not the run
    hang = dataclasses.replace(
        t, pass_to_pass=("test_m.py::test_ok", "test_m.py::test_hangs"), test_timeout_s=2.0
    )
    v = verify_repo_patch(hang, FIX, run_monitor=False)
    assert v.status == "failed" and v.tests == {
        "test_m.py::test_f": "passed",
        "test_m.py::test_ok": "passed",
        "test_m.py::test_hangs": "failed",
    }, v.test_log


def test_relative_extra_pythonpath_is_a_tree_directory_not_an_infra_error():
    files = {  # a layout the task cannot detect: lib/ is named by the caller
        "lib/pkg/__init__.py": "X = 1\n",
        "tests/test_x.py": "from pkg import X\n\n\ndef test_x():\n    assert X == 1\n",
    }
    t = RepoTask("s", "x", files, ("tests/test_x.py::test_x",))
    assert verify_repo_patch(t, "", run_monitor=False).status == "failed"  # not importable
    v = verify_repo_patch(t, "", run_monitor=False, extra_pythonpath=("lib",))
    assert v.status == "passed", v.test_log
    v = verify_repo_patch(t, "", run_monitor=False, extra_pythonpath=("../escape",))
    assert v.status == "infra_error"


@pytest.mark.e2e  # runs the validate command-line tool in a process of its own
def test_validate_cli_writes_one_line_per_instance(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    base = {
        "m.py": "def f():\n    return 1\n",
        "test_old.py": "from m import f\n\n\ndef test_old():\n    assert f() in (1, 2)\n",
    }
    rows = [
        make_instance(
            repos_dir,
            "acme/flat",
            base,
            {"m.py": "def f():\n    return 2\n"},
            {"test_new.py": "from m import f\n\n\ndef test_new():\n    assert f() == 2\n"},
            ["test_new.py::test_new"],
            ["test_old.py::test_old"],
        ),
        dict(ROW, instance_id="missing-repo", repo="acme/absent"),
    ]
    inst = str(tmp_path / "instances.jsonl")
    with open(inst, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    out = str(tmp_path / "report.jsonl")
    r = subprocess.run([sys.executable, "-m", "gagar_jax.data.swe", "validate", "--instances",
                        inst, "--repos", repos_dir, "--runs", "2", "--out", out, "--cache",
                        cache], capture_output=True, text=True)  # fmt: skip  # argv pairs
    assert r.returncode == 1, r.stderr  # one row could not be validated
    assert "validated 1/2 instances" in r.stdout
    lines = [json.loads(x) for x in open(out)]
    assert [x["instance_id"] for x in lines] == ["acme__flat-1", "missing-repo"]
    good = lines[0]
    assert set(good) == {
        "instance_id",
        "gold",
        "empty",
        "flaky_tests",
        "infra_errors",
        "env_hash",
        "seconds",
    }
    assert good["gold"] == "passed" and good["empty"] == "failed" and good["flaky_tests"] == []
    assert good["infra_errors"] == 0 and len(good["env_hash"]) == 32
    assert "RepoNotFound" in lines[1]["error"]


# ---- leak kinds in the agent's tree -----------------------------------------------------------


def test_an_infra_error_run_is_counted_never_a_status():
    """A run the infrastructure failed says nothing of the patch: it is counted in
    ``infra_errors`` and left out of the statuses and of the flaky tests."""
    from gagar_jax.verify.repo import RepoVerification

    task = types.SimpleNamespace(task_id="t-1", env_hash="e")

    def run(status, outcome):
        return RepoVerification(status, {"t.py::test_a": outcome}, None, (), "", None)

    infra = run("infra_error", "missing")
    line = swe.summarise_runs(
        task,
        [
            ("gold", run("passed", "passed")),
            ("empty", infra),
            ("gold", infra),
            ("empty", run("failed", "failed")),
        ],
    )
    assert line == {
        "instance_id": "t-1",
        "gold": "passed",
        "empty": "failed",
        "flaky_tests": [],
        "infra_errors": 2,
        "env_hash": "e",
    }
    only_infra = swe.summarise_runs(task, [("gold", infra), ("empty", run("failed", "failed"))])
    assert only_infra["gold"] is None and only_infra["infra_errors"] == 1
    mixed = swe.summarise_runs(
        task, [("gold", run("passed", "passed")), ("gold", run("failed", "failed"))]
    )
    assert mixed["gold"] == "flaky" and mixed["flaky_tests"] == ["t.py::test_a"]


class _EveryCallLost:
    """A stand-in back-end (named as such: a fault that cannot be produced on demand here)
    whose infrastructure fails every call, as a cluster that lost all its nodes would."""

    name = "stand-in"
    max_inflight = 2

    def __init__(self):
        self.calls = 0

    def call(self, fn, *args, **kwargs):
        from gagar_jax.verify.execution import CallResult

        self.calls += 1
        return CallResult("infra_error", error="stand-in: node lost")


def test_a_row_whose_runs_all_failed_for_the_infrastructure_is_not_validated(tmp_path):
    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    row = make_instance(
        repos_dir,
        "acme/flat",
        {"m.py": "def f():\n    return 1\n"},
        {"m.py": "def f():\n    return 2\n"},
        {"test_new.py": "from m import f\n\n\ndef test_new():\n    assert f() == 2\n"},
        ["test_new.py::test_new"],
        [],
    )
    inst = str(tmp_path / "instances.jsonl")
    with open(inst, "w") as f:
        f.write(json.dumps(row) + "\n")
    backend, said = _EveryCallLost(), []
    lines, ok = swe.validate(
        inst, repos_dir, runs=2, cache_dir=cache, backend=backend, log=said.append
    )
    assert backend.calls == 4 and not ok
    (line,) = lines
    assert line["gold"] is None and line["empty"] is None and line["infra_errors"] == 4
    assert "no verdict for gold and empty" in line["error"]
    assert "1 not validated" in said[-1]


def test_each_planted_leak_kind_is_caught_by_name(tmp_path):
    from gagar_jax.data import audit

    repos_dir, cache = str(tmp_path / "repos"), str(tmp_path / "cache")
    inst = swe.parse_instance(src_layout_row(repos_dir))
    task = swe.to_repo_task(inst, repos_dir, cache_dir=cache, build_envs=False)
    tree = repos.snapshot(repos_dir, inst.repo, inst.base_commit, cache)
    assert audit.leak_kinds(task, tree_dir=tree) == {}  # the snapshot: no .git at all
    n = iter(range(100))

    def agent_tree():
        return repos.agent_git_repo(tree, str(tmp_path / f"agent{next(n)}"))

    clean = agent_tree()
    assert audit.leak_kinds(task, tree_dir=clean) == {}

    def plant(kind, how):
        d = agent_tree()
        how(d)
        kinds = audit.leak_kinds(task, tree_dir=d)
        assert kind in kinds, (kind, kinds)
        return kinds

    fixed = inst.patch
    assert plant(
        "git_objects",
        lambda d: repos.git("hash-object", "-w", "--stdin", cwd=d, input=fixed.encode()),
    ) == {"git_objects": [".git: 1 object(s) not reachable from HEAD"]}
    assert set(plant("tags", lambda d: repos.git("tag", "v2", cwd=d))) == {"tags"}

    def reflog(d):
        os.makedirs(os.path.join(d, ".git", "logs"))
        with open(os.path.join(d, ".git", "logs", "HEAD"), "w") as f:
            f.write("0" * 40 + " " + "1" * 40 + " a <a@b> 0 +0000\tcommit: the fix\n")

    assert set(plant("reflog", reflog)) == {"reflog"}

    def stray(d):
        with open(os.path.join(d, "src", "srcpkg", "__init__.py.orig"), "w") as f:
            f.write("x\n")

    assert set(plant("patch_files", stray)) == {"patch_files"}
    # the real store checked out at the base: the fix commit and its tag are readable
    full = str(tmp_path / "full")
    repos.git("clone", "-q", os.path.join(repos_dir, "acme__srcpkg"), full)
    repos.git("checkout", "-q", inst.base_commit, cwd=full)
    kinds = audit.leak_kinds(task, tree_dir=full)
    assert {"git_objects", "tags"} <= set(kinds)
    # the issue text quoting the fix
    told = dataclasses.replace(task, issue="Please change it to:\n    return a + b\n")
    assert set(audit.leak_kinds(told)) == {"issue_text"}
    rep = audit.leak_findings(told)
    assert rep == ["<issue text>: holds 1/1 distinctive lines of the gold patch"]


# ---- in the loop ------------------------------------------------------------------------------


def test_python_repo_family_trains_on_an_swe_pool(tmp_path, monkeypatch):
    """task.data_path = the instances file, task.repos_dir = the repositories: the family's
    episode submits the reference fix and the verdict passes with the task's environment."""
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_fixtures import make_tiny_tokenizer

    from gagar_jax.envs.family import Attempt, FamilySettings, make_family
    from gagar_jax.envs.hf_tokenizer import tool_call_text

    monkeypatch.setenv("GAGAR_REPO_CACHE", str(tmp_path / "cache"))
    repos_dir = str(tmp_path / "repos")
    path = str(tmp_path / "instances.jsonl")
    swe.write_instances(path, [swe.parse_instance(src_layout_row(repos_dir))])
    fam = make_family(
        "python_repo",
        FamilySettings(
            data_path=path,
            repos_dir=repos_dir,
            tokenizer_path=make_tiny_tokenizer(tmp_path / "tok"),
            num_eval=0,
            max_prompt_len=2048,
        ),
    )
    task = fam.train_task(0)
    assert task.task_id == "acme__srcpkg-1" and task.env_path and task.pythonpath == ("src",)
    assert "tests/test_add.py" not in task.files  # the hidden test is not in the agent's tree
    env = fam.make_env(task)
    for name, args in fam.demonstration_calls(task):
        env.step(tool_call_text(name, args))
    out = fam.verify(task, Attempt(env=env))
    assert out.passed and not out.cheat and not out.infra_error, out.test_log
    # the grader's checks of this task's group see the same tree layout and environment
    from gagar_jax.envs import repo as envs_repo
    from gagar_jax.envs.repo import TaskEnvCheckRunner

    ws = envs_repo.repo_workspace(task, "g0", [envs_repo.repo_candidate("r0", out.patch, out)])
    runner = TaskEnvCheckRunner({"g0": task})
    res = runner.run(
        ws, ws.candidates[0], "python -c 'import cachetools, srcpkg; assert srcpkg.add(2, 3) == 5'"
    )
    assert res.status == "passed", res.log
    plain = TaskEnvCheckRunner({}).run(ws, ws.candidates[0], "python -c 'import cachetools'")
    assert plain.status == "failed"


def test_editing_the_named_tests_does_not_pass_a_row_without_test_patch(tmp_path):
    """Factory rows carry their tests in the base tree (empty test_patch): the files of the
    named tests are reset, so rewriting the failing assertion earns nothing."""
    from gagar_jax.verify.diff import tree_patch

    repos_dir = str(tmp_path / "repos")
    base = {
        "m.py": "def f():\n    return 1\n",
        "test_m.py": "from m import f\n\n\ndef test_f():\n    assert f() == 2\n\n\n"
        "def test_g():\n    assert f() > 0\n",
    }
    row = make_instance(
        repos_dir,
        "acme/intree",
        base,
        {"m.py": "def f():\n    return 2\n"},
        {},
        ["test_m.py::test_f"],
        ["test_m.py::test_g"],
        future=False,
    )
    assert row["test_patch"] == ""
    task = swe.to_repo_task(
        swe.parse_instance(row), repos_dir, cache_dir=str(tmp_path / "c"), build_envs=False
    )
    assert task.test_files == ("test_m.py",)
    cheat = tree_patch(base, {**base, "test_m.py": base["test_m.py"].replace("== 2", "== 1")})
    v = verify_repo_patch(task, cheat, run_monitor=False)
    assert v.status == "failed" and v.reset_files == ("test_m.py",)
    assert verify_repo_patch(task, row["patch"], run_monitor=False).status == "passed"


def test_swesmith_layout_row_with_its_bug_branch(tmp_path):
    """A SWE-smith row: no base_commit, the bug on a branch named instance_id of the mirror,
    ``patch`` introduces the bug; the fix is derived and verifies."""
    from gagar_jax.verify.diff import tree_patch
    from tests.swe_fixtures import commit_all, write

    repos_dir = str(tmp_path / "repos")
    root = os.path.join(repos_dir, "swesmith__acme__calc.abc1234")
    os.makedirs(root)
    repos.git("init", "-q", "-b", "main", cwd=root)
    good = {
        "calc.py": "def add(a, b):\n    return a + b\n",
        "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
        "\n\ndef test_zero():\n    assert add(0, 0) == 0\n",
    }
    write(root, good)
    commit_all(root, "original")
    iid = "acme__calc.abc1234.func_pm_op_flip__x1"
    repos.git("checkout", "-q", "-b", iid, cwd=root)
    bad = {**good, "calc.py": "def add(a, b):\n    return a - b\n"}
    write(root, bad)
    commit_all(root, "bug")
    repos.git("checkout", "-q", "main", cwd=root)
    row = {
        "instance_id": iid,
        "repo": "swesmith/acme__calc.abc1234",
        "patch": tree_patch(good, bad),
        "FAIL_TO_PASS": ["test_calc.py::test_add"],
        "PASS_TO_PASS": ["test_calc.py::test_zero"],
        "image_name": "swesmith.x86_64.acme",
        "problem_statement": "add gives the wrong sum",
    }
    inst = swe.parse_instance(row)
    assert inst.layout == "swesmith" and inst.base_commit == iid
    assert swe.parse_instance(inst.to_row()) == inst  # round trip
    task = swe.to_repo_task(inst, repos_dir, cache_dir=str(tmp_path / "c"), build_envs=False)
    assert "a - b" in task.files["calc.py"] and "+    return a + b" in task.reference_patch
    assert verify_repo_patch(task, task.reference_patch, run_monitor=False).status == "passed"
    assert verify_repo_patch(task, "", run_monitor=False).status == "failed"
    wrong = swe.parse_instance(dict(row, patch=tree_patch(good, {**good, "calc.py": "x = 1\n"})))
    with pytest.raises(swe.InstanceError, match="not its parent plus the row's bug patch"):
        swe.to_repo_task(wrong, repos_dir, cache_dir=str(tmp_path / "c"), build_envs=False)


def test_a_relative_cache_dir_gives_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = src_layout_row(str(tmp_path / "repos"))
    tree = repos.snapshot("repos", "acme/srcpkg", row["base_commit"], "rel_cache")
    assert os.path.isabs(tree) and os.path.isdir(tree)
    env = repos.build_env(["cachetools==5.5.0"], cache_dir="rel_cache")
    assert os.path.isabs(env.path)


# ---- other layouts: recorded rows of tests/fixtures/swe_layouts ------------------------------


def _verdicts(task):
    return (
        verify_repo_patch(task, task.reference_patch, run_monitor=False).status,
        verify_repo_patch(task, "", run_monitor=False).status,
    )


def test_r2egym_row_reads_verifies_and_round_trips(tmp_path):
    from tests.swe_fixtures import LAYOUTS, calc_repo

    repos_dir = str(tmp_path / "repos")
    base, _ = calc_repo(repos_dir, "r2e-gym__calc")
    (inst,) = swe.load_instances(os.path.join(LAYOUTS, "r2egym_rows.jsonl"))
    assert (inst.layout, inst.repo, inst.base_commit) == ("r2egym", "r2e-gym/calc", base)
    assert inst.instance_id == "calc__b71c0e5a9d3f"
    assert inst.problem_statement.startswith("add() returns the difference")  # [ISSUE] dropped
    # expected to pass after the fix: failing in the old commit's log -> F2P, passing -> P2P
    assert inst.FAIL_TO_PASS == (
        "r2e_tests/test_1.py::test_add",
        "r2e_tests/test_1.py::test_add_negative",
    )
    assert inst.PASS_TO_PASS == ("r2e_tests/test_1.py::test_mul",)
    # the fix touches code only; the commit's test change and the hidden tests are test_patch
    from gagar_jax.verify.diff import touched_files

    assert touched_files(inst.patch) == ["calc.py"]
    assert sorted(touched_files(inst.test_patch)) == ["r2e_tests/test_1.py", "tests/test_calc.py"]
    assert swe.parse_instance(inst.to_row()) == inst  # round trip
    task = swe.to_repo_task(inst, repos_dir, cache_dir=str(tmp_path / "c"), build_envs=False)
    assert "r2e_tests/test_1.py" not in task.files  # hidden until the run
    assert _verdicts(task) == ("passed", "failed")
    with pytest.raises(swe.InstanceError, match="expected_output_json key 'test_add' is not"):
        swe.parse_instance(
            dict(
                json.loads(open(os.path.join(LAYOUTS, "r2egym_rows.jsonl")).readline()),
                expected_output_json='{"test_add": "PASSED"}',
            )
        )


def test_swesmith_recorded_row_reads_verifies_and_round_trips(tmp_path):
    from tests.swe_fixtures import LAYOUTS, calc_repo

    row = json.loads(open(os.path.join(LAYOUTS, "swesmith_rows.jsonl")).readline())
    repos_dir = str(tmp_path / "repos")
    _, tip = calc_repo(repos_dir, "swesmith__acme__calc.5e1f2a3b", bug_branch=row["instance_id"])
    (inst,) = swe.load_instances(os.path.join(LAYOUTS, "swesmith_rows.jsonl"))
    assert inst.layout == "swesmith" and inst.base_commit == row["instance_id"]
    assert swe.parse_instance(inst.to_row()) == inst
    task = swe.to_repo_task(inst, repos_dir, cache_dir=str(tmp_path / "c"), build_envs=False)
    assert "a - b" in task.files["calc.py"] and "+    return a + b" in task.reference_patch
    assert repos.resolve_commit(repos.git_dir(repos_dir, inst.repo), inst.base_commit) == tip
    assert _verdicts(task) == ("passed", "failed")


def test_harbor_task_directory_reads_verifies_and_round_trips(tmp_path):
    from tests.swe_fixtures import LAYOUTS, calc_repo

    harbor = os.path.join(LAYOUTS, "harbor")
    repos_dir = str(tmp_path / "repos")
    base, _ = calc_repo(repos_dir, "acme__calc")
    (inst,) = swe.load_instances(harbor)  # a directory of task directories
    assert (inst.layout, inst.instance_id, inst.base_commit) == ("harbor", "acme__calc-1", base)
    assert inst.problem_statement.startswith("# Task\n\nadd() returns")  # instruction.md
    row = swe.harbor_row(os.path.join(harbor, "acme__calc-1"))
    assert row["harbor"]["timeout_sec"] == 300.0 and row["harbor"]["metadata"]["category"]
    assert swe.load_instances(os.path.join(harbor, "acme__calc-1")) == [inst]  # one task dir
    assert swe.parse_instance(inst.to_row()) == inst
    task = swe.to_repo_task(inst, repos_dir, cache_dir=str(tmp_path / "c"), build_envs=False)
    assert _verdicts(task) == ("passed", "failed")
    empty = tmp_path / "not_harbor"
    (empty / "t").mkdir(parents=True)
    (empty / "t" / "task.toml").write_text('version = "1.0"\n')
    with pytest.raises(swe.InstanceError, match="no tests/config.json"):
        swe.load_instances(str(empty))


def test_a_jsonl_pool_mixes_repo_task_lines_and_swe_rows(tmp_path):
    from gagar_jax.envs.repo import load_repo_tasks

    repos_dir = str(tmp_path / "repos")
    row = src_layout_row(repos_dir)
    plain = RepoTask(
        "plain-1",
        "fix f",
        {
            "m.py": "def f():\n    return 1\n",
            "test_m.py": "from m import f\n\n\ndef test_f():\n    assert f() == 2\n",
        },
        ("test_m.py::test_f",),
    )
    pool = str(tmp_path / "pool.jsonl")
    with open(pool, "w") as f:
        f.write(json.dumps(plain.to_dict()) + "\n" + json.dumps(row) + "\n")
    a, b = load_repo_tasks(pool, repos_dir)
    assert a == plain and b.task_id == row["instance_id"] and b.env_path and b.env_hash
    # the snapshot, with the repository installed into it (its metadata at the root)
    snap = repos.snapshot_files(repos_dir, "acme/srcpkg", row["base_commit"])
    assert {p: t for p, t in b.files.items() if not p.startswith("srcpkg-1.0.dist-info/")} == snap
    assert "srcpkg-1.0.dist-info/METADATA" in b.files and set(b.files) > set(snap)
    with pytest.raises(ValueError, match=r"pool.jsonl:2: a SWE-bench-format row .* needs "):
        load_repo_tasks(pool)
    with open(pool, "a") as f:
        f.write(json.dumps(plain.to_dict()) + "\n")
    with pytest.raises(ValueError, match="pool.jsonl:3: duplicate task id 'plain-1'"):
        load_repo_tasks(pool, repos_dir)


def test_autosubmit_verifies_an_unsubmitted_episode_and_the_audit_log_names_its_env(
    tmp_path, monkeypatch
):
    """task.autosubmit: an episode that never called submit is verified on its final tree; the
    verification log ($GAGAR_VERIFY_LOG) names the environment the sandboxed run used."""
    sys.path.insert(0, os.path.dirname(__file__))
    from hf_fixtures import make_tiny_tokenizer

    from gagar_jax.envs.family import Attempt, FamilySettings, make_family
    from gagar_jax.envs.hf_tokenizer import tool_call_text
    from gagar_jax.envs.repo import VERIFY_LOG_ENV, tree_digest
    from gagar_jax.verify.repo import env_site_packages

    monkeypatch.setenv("GAGAR_REPO_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "verify_log.jsonl"
    monkeypatch.setenv(VERIFY_LOG_ENV, str(log))
    repos_dir = str(tmp_path / "repos")
    path = str(tmp_path / "instances.jsonl")
    swe.write_instances(path, [swe.parse_instance(src_layout_row(repos_dir))])
    tok = make_tiny_tokenizer(tmp_path / "tok")
    fams = {
        auto: make_family(
            "python_repo",
            FamilySettings(
                data_path=path,
                repos_dir=repos_dir,
                tokenizer_path=tok,
                num_eval=0,
                max_prompt_len=2048,
                extra={"autosubmit": True} if auto else {},
            ),
        )
        for auto in (False, True)
    }
    task = fams[True].train_task(0)
    outcomes = {}
    for auto, fam in fams.items():
        env = fam.make_env(task)
        for name, args in fam.demonstration_calls(task):
            if name != "submit":  # the fix is in the tree, but the episode never submits
                env.step(tool_call_text(name, args))
        assert not env.submitted
        outcomes[auto] = fam.verify(task, Attempt(env=env))
    assert not outcomes[False].passed and outcomes[False].test_log.startswith("episode ended")
    assert outcomes[True].passed, outcomes[True].test_log
    assert "final tree verified (task.autosubmit)" in outcomes[True].test_log
    records = [json.loads(line) for line in open(log)]
    (v,) = [r for r in records if r["kind"] == "verify"]
    assert v["autosubmit"] and v["phase"] == "rollout" and v["status"] == "passed"
    assert v["sandbox_pythonpath"] == list(env_site_packages(task.env_path))
    assert v["env_hash"] == task.env_hash and v["tree"] == tree_digest(task.files)
    assert {r["kind"] for r in records} == {"verify", "run_tests"}  # run_tests ran as well


def test_the_python_repo_family_reads_swe_pools_through_the_reader_data_registers(tmp_path):
    """``envs.repo`` imports no task data: SWE-bench-format pools are read by the reader
    ``data.swe`` registers when imported; without it the pool is an error naming the module."""
    pool = tmp_path / "rows.json"
    pool.write_text("[]")
    code = (
        "import pytest\n"
        "from gagar_jax.envs import repo\n"
        f"with pytest.raises(LookupError, match='import gagar_jax.data.swe'):\n"
        f"    repo.load_repo_tasks({str(pool)!r}, {str(tmp_path)!r})\n"
        "from gagar_jax.data import swe\n"
        "assert repo._swe_reader('p') == (swe.load_tasks, swe.row_task)\n"
        f"assert repo.load_repo_tasks({str(pool)!r}, {str(tmp_path)!r}) == []\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stdout + out.stderr
