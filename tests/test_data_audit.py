"""Task auditor: sandboxed pre-checks on planted tasks, the evaluator agent's schema, votes,
fallback and calibration, and the pool filters."""

import dataclasses
import difflib
import itertools
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax.data import audit as A
from gagar_jax.envs.repo import RepoTask
from gagar_jax.verify.sandbox import Limits

FAST = Limits(wall_s=60, cpu_s=60, memory_bytes=1 << 30, nproc=64)
CALC = "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return -a\n"
TESTS = (
    "from calc import add, neg\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_neg():\n    assert neg(2) == -2\n"
)
ISSUE = "calc.add(a, b) returns a - b instead of the sum a + b; add(2, 3) must be 5."


def _diff(path, old, new):
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


GOLD = _diff("calc.py", CALC, CALC.replace("a - b", "a + b"))


def _task(task_id="sound", **kw):
    base = dict(
        task_id=task_id,
        issue=ISSUE,
        files={"calc.py": CALC, "tests/test_calc.py": TESTS},
        fail_to_pass=("tests/test_calc.py::test_add",),
        pass_to_pass=("tests/test_calc.py::test_neg",),
        test_files=("tests/test_calc.py",),
        reference_patch=GOLD,
    )
    return RepoTask(**{**base, **kw})


FLAKY_TESTS = TESTS + "".join(
    f"\n\ndef test_coin_{k}():\n    import os\n    assert os.urandom(1)[0] % 2 == 0\n"
    for k in range(8)
)
PLANTED = {
    "sound": (_task(), ()),
    "gold_fails_f2p": (
        _task("wrong_gold", reference_patch=_diff("calc.py", CALC, CALC.replace("a - b", "a * b"))),
        ("gold_fails_f2p",),
    ),
    "gold_breaks_p2p": (
        _task(
            "breaks",
            reference_patch=_diff(
                "calc.py", CALC, CALC.replace("a - b", "a + b").replace("return -a", "return a")
            ),
        ),
        ("gold_breaks_p2p",),
    ),
    "empty_patch_passes": (
        _task(
            "free",
            fail_to_pass=("tests/test_calc.py::test_add", "tests/test_calc.py::test_neg"),
            pass_to_pass=(),
        ),
        ("empty_patch_passes",),
    ),
    "flaky": (
        _task(
            "flaky",
            files={"calc.py": CALC, "tests/test_calc.py": FLAKY_TESTS},
            pass_to_pass=tuple(f"tests/test_calc.py::test_coin_{k}" for k in range(8)),
        ),
        ("flaky",),
    ),
    "leaks_patch_file": (
        _task("leak1", files={"calc.py": CALC, "tests/test_calc.py": TESTS, "fix.diff": GOLD}),
        ("leaks_solution",),
    ),
    "leaks_copy": (
        _task(
            "leak2",
            files={
                "calc.py": CALC,
                "tests/test_calc.py": TESTS,
                "docs/notes.md": "Fixed version:\n    return a + b\n",
            },
        ),
        ("leaks_solution",),
    ),
    "leaks_backup": (
        _task("leak3", files={"calc.py": CALC, "tests/test_calc.py": TESTS, "calc.py.orig": CALC}),
        ("leaks_solution",),
    ),
}


@pytest.fixture(scope="module")
def reports():
    out = {}
    for name, (task, _) in PLANTED.items():
        if name.startswith("leaks_") and name != "leaks_patch_file":
            continue  # static findings: tested without the sandbox below
        # one run per patch suffices for the deterministic reasons; flakiness needs repeats
        out[name] = A.precheck(task, repeats=3 if name == "flaky" else 1, limits=FAST)
    return out


@pytest.mark.parametrize(
    "name", ["sound", "gold_fails_f2p", "gold_breaks_p2p", "empty_patch_passes", "leaks_patch_file"]
)
def test_precheck_names_each_planted_reason(reports, name):
    rep = reports[name]
    assert rep.reasons == PLANTED[name][1], (rep.reasons, rep.details)
    assert rep.ok == (name == "sound")
    assert len(rep.runs) == 2 and {r.patch for r in rep.runs} == {"gold", "empty"}
    assert all(r.status in ("passed", "failed") for r in rep.runs)


def test_precheck_flaky(reports):
    rep = reports["flaky"]
    # 8 coin-flip tests over 3 runs per patch: the chance that none varies is 0.25**16 per patch
    assert "flaky" in rep.reasons and not rep.ok
    assert "test_coin_" in rep.details["flaky"]


@pytest.mark.parametrize("name", ["leaks_copy", "leaks_backup", "leaks_patch_file"])
def test_leak_findings(name):
    task, _ = PLANTED[name]
    found = A.leak_findings(task)
    assert found, name
    assert A.leak_findings(PLANTED["sound"][0]) == []


def test_leak_in_version_control_history(tmp_path):
    """The fix was committed, then reverted: RepoTask drops .git, the audit reads the history."""
    repo = tmp_path / "task" / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    git = lambda *a: subprocess.run(
        ["git", "-C", str(repo), *a],
        check=True,  # noqa: E731
        capture_output=True,
    )
    git("init", "-q")
    git("config", "user.email", "a@b.c")
    git("config", "user.name", "a")
    (repo / "calc.py").write_text(CALC.replace("a - b", "a + b"))
    git("add", "-A")
    git("commit", "-qm", "working add")
    (repo / "calc.py").write_text(CALC)
    git("commit", "-qam", "break add")
    task = dataclasses.replace(
        RepoTask.from_dict(
            {**_task().to_dict(), "files": {"calc.py": CALC, "tests/test_calc.py": TESTS}}
        ),
        task_id="hist",
    )
    assert A.leak_findings(task) == []
    found = A.leak_findings(task, source_dir=tmp_path / "task")
    assert found and "version-control history" in found[0]


def test_precheck_accepts_json_dict_and_round_trips(reports):
    rep = reports["sound"]
    assert A.AuditReport.from_dict(rep.to_dict()) == rep
    with pytest.raises(ValueError, match="repeats"):
        A.precheck(_task().to_dict(), repeats=0)
    with pytest.raises(TypeError, match="RepoTask"):
        A.precheck(42)


# -- the evaluator agent ------------------------------------------------------------------


VOTE = {
    "underspecification": 0,
    "test_validity": 0,
    "difficulty": "<15m",
    "category": "bug_fix",
    "evidence": [],
}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"underspecification": 4}, "underspecification"),
        ({"test_validity": "1"}, "test_validity"),
        ({"test_validity": True}, "test_validity"),
        ({"difficulty": "1h"}, "difficulty"),
        ({"category": "bugfix"}, "category"),
        ({"extra": 1}, "unknown fields"),
        ({"underspecification": 2}, "needs at least one evidence"),
        ({"evidence": [{"kind": "issue", "quote": "not in the issue"}]}, "quote of the issue"),
        ({"evidence": [{"kind": "file", "path": "nope.py"}]}, "does not exist"),
        ({"evidence": [{"kind": "file", "path": "calc.py", "line": 99}]}, "outside"),
        (
            {"evidence": [{"kind": "file", "path": "calc.py", "line": 1, "quote": "return"}]},
            "quote not at",
        ),
        ({"evidence": [{"kind": "patch", "quote": "a + b"}]}, "not shown"),
        ({"evidence": [{"kind": "magic"}]}, "kind"),
    ],
)
def test_audit_schema_rejects(change, match):
    with pytest.raises(A.AuditRejected, match=match):
        A.parse_audit({**VOTE, **change}, _task(), gold_shown=False)


def test_audit_schema_accepts_existing_evidence():
    v = A.parse_audit(
        {
            **VOTE,
            "underspecification": 2,
            "evidence": [
                {"kind": "issue", "quote": "returns a - b"},
                {"kind": "file", "path": "calc.py", "line": 2, "quote": "a - b"},
                {"kind": "patch", "quote": "+    return a + b"},
            ],
        },
        _task(),
        gold_shown=True,
    )
    assert v.underspecification == 2 and len(v.evidence) == 3


votes_st = st.builds(
    A.AuditVote,
    st.integers(0, 3),
    st.integers(0, 3),
    st.sampled_from(A.DIFFICULTY_BUCKETS),
    st.sampled_from(A.CATEGORIES),
    st.lists(
        st.builds(
            A.AuditEvidence,
            st.just("issue"),
            st.none(),
            st.none(),
            st.sampled_from(["calc", "add"]),
        ),
        max_size=2,
    ).map(tuple),
)


@given(st.lists(votes_st, min_size=1, max_size=5), st.randoms())
def test_vote_aggregation_is_order_invariant_and_k1_is_raw(votes, rnd):
    for agg in A.AGGREGATIONS:
        merged = A.merge_audit_votes(votes, agg)
        shuffled = list(votes)
        rnd.shuffle(shuffled)
        assert A.merge_audit_votes(shuffled, agg) == merged
        assert A.merge_audit_votes(votes[:1], agg) == votes[0]
        u = [v.underspecification for v in votes]
        if agg == "max_severity":
            assert merged.underspecification == max(u)
        else:
            assert u.count(merged.underspecification) == max(u.count(x) for x in u)
        assert merged.underspecification <= max(u) and merged.test_validity <= max(
            v.test_validity for v in votes
        )


def test_majority_vs_max_severity():
    mk = lambda u: A.AuditVote(u, 0, "<15m", "bug_fix")  # noqa: E731
    votes = [mk(0), mk(0), mk(3)]
    assert A.merge_audit_votes(votes, "max_severity").underspecification == 3
    assert A.merge_audit_votes(votes, "majority").underspecification == 0
    assert A.merge_audit_votes([mk(1), mk(2)], "majority").underspecification == 2  # tie: severe


UNCLEAR = _task("unclear", issue="add is weird?")
OFF_TARGET = _task(
    "off_target",
    files={
        "calc.py": CALC,
        "tests/test_calc.py": "from calc import neg\n\n\ndef test_add():\n"
        "    assert neg(-1) == 1\n",
    },
)
CAL_LABELS = {
    "sound": {"unclear": False, "invalid_tests": False, "leaked": False},
    "unclear": {"unclear": True, "invalid_tests": False, "leaked": False},
    "off_target": {"unclear": False, "invalid_tests": True, "leaked": False},
    "leak1": {"unclear": False, "invalid_tests": False, "leaked": True},
}


def test_scripted_auditor_calibration_and_votes(reports):
    auditor = A.TaskAuditor(A.ScriptedAuditorPolicy(), votes=3)
    tasks = [_task(), UNCLEAR, OFF_TARGET, PLANTED["leaks_patch_file"][0]]
    audits = [auditor.audit(t) for t in tasks]
    assert all(a.vote is not None and len(a.votes) == 3 and a.fallbacks == 0 for a in audits)
    cal = A.auditor_calibration(
        audits, CAL_LABELS, prechecks=[reports["sound"], reports["leaks_patch_file"]]
    )
    print("\nauditor calibration (scripted policy):", cal)
    assert cal["unclear"]["precision"] == cal["unclear"]["recall"] == 1.0
    assert cal["invalid_tests"]["precision"] == cal["invalid_tests"]["recall"] == 1.0
    assert cal["leaked"] == {"precision": 1.0, "recall": 1.0, "tp": 1, "fp": 0, "fn": 0, "n": 2}
    # evidence pointers exist (validated), and the audit round-trips
    off = audits[2]
    assert off.vote.test_validity == 3 and off.vote.evidence[0].path == "tests/test_calc.py"
    assert A.TaskAudit.from_dict(off.to_dict()) == off


def test_auditor_reasks_then_accepts():
    policy = A.ScriptedAuditorPolicy(first_invalid=True)
    auditor = A.TaskAuditor(policy)
    a = auditor.audit(OFF_TARGET)
    assert a.vote is not None and a.vote.test_validity == 3
    assert auditor.metrics["rejections"] == 1


def test_auditor_falls_back_never_a_verdict():
    class Garbage:
        def chat_completions(self, messages, **kw):
            return {"choices": [{"message": {"role": "assistant", "content": "looks fine"}}]}

    class Down:
        def chat_completions(self, messages, **kw):
            raise ConnectionError("refused")

    for client in (Garbage(), Down()):
        auditor = A.TaskAuditor(client, votes=2, max_steps=3)
        a = auditor.audit(_task())
        assert a.vote is None and a.fallbacks == 2 and len(a.reasons) == 2
        assert auditor.metrics["tasks_fallback"] == 1
    # a fallback audit never filters a task out (unless an audit is required)
    kept, rep = A.filter_tasks([A.PoolEntry(_task(), audit=a)], {"max_underspecification": 0})
    assert len(kept) == 1
    kept, rep = A.filter_tasks([A.PoolEntry(_task(), audit=a)], {"require_audit": True})
    assert kept == [] and rep["reasons"] == {"audit:missing": 1}


def test_prompts_are_versioned():
    assert "underspecification" in A.load_audit_prompt("system", "v1")
    with pytest.raises(FileNotFoundError):
        A.load_audit_prompt("system", "v999")


# -- filters and pass rates -----------------------------------------------------------------


def test_filter_tasks_reports_per_threshold(reports, tmp_path):
    auditor = A.TaskAuditor(A.ScriptedAuditorPolicy())
    entries = [
        A.PoolEntry(_task(), reports["sound"], auditor.audit(_task()), (True, False) * 4),
        A.PoolEntry(UNCLEAR, reports["sound"], auditor.audit(UNCLEAR)),
        A.PoolEntry(OFF_TARGET, reports["gold_fails_f2p"], auditor.audit(OFF_TARGET)),
        A.PoolEntry(_task("solved"), reports["sound"], None, (True,) * 8),
    ]
    th = {
        "require_precheck": True,
        "max_underspecification": 1,
        "max_test_validity": 1,
        "skip_saturated": {"window": 8, "min_attempts": 8},
    }
    kept, rep = A.filter_tasks(entries, th)
    assert [e.task_id for e in kept] == ["sound"]
    assert rep["total"] == 4 and rep["kept"] == 1
    assert rep["per_threshold"] == {
        "require_precheck": 3,
        "max_underspecification": 3,
        "max_test_validity": 3,
        "skip_saturated": 3,
    }
    assert rep["reasons"]["precheck:gold_fails_f2p"] == 1
    assert rep["reasons"]["saturated:pass_rate=1"] == 1
    # stricter thresholds keep fewer (never more)
    kept0, _ = A.filter_tasks(entries, {**th, "max_test_validity": 0, "max_underspecification": 0})
    assert len(kept0) <= len(kept)
    path = tmp_path / "pool.jsonl"
    A.save_pool(path, entries)
    assert [dataclasses.asdict(e) for e in A.load_pool(path)][0]["attempts"] == entries[0].attempts
    with pytest.raises(ValueError, match="unknown thresholds"):
        A.filter_tasks(entries, {"max_clarity": 1})


def test_pass_rate_tracker():
    t = A.PassRateTracker(window=4, min_attempts=3)
    t.record("a", [True, True])
    assert not t.skip("a") and t.pass_rate("a") == 1.0
    t.record("a", True)
    assert t.skip("a")
    t.record("a", False)
    assert not t.skip("a") and t.pass_rate("a") == 0.75
    t.record("a", [False] * 4)
    assert t.skip("a") and t.attempts("a") == (False,) * 4
    assert t.pass_rate("zzz") is None and not t.skip("zzz")
    assert list(itertools.islice(iter(t.attempts("a")), 1)) == [False]
