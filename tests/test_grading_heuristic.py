"""Heuristic grader: hand-built groups with known quality differences, validity on random groups,
determinism and permutation invariance."""

import dataclasses

import hypothesis.strategies as st
from grading_strategies import BASE_REPO, EXTRA_EDITS, FIX, apply_edits, workspaces
from hypothesis import HealthCheck, given, settings

from gagar_jax.grading import schema
from gagar_jax.grading.heuristic import HeuristicConfig, HeuristicGrader, infer_scope

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PRINT, TEST_EDIT, CAMEL = EXTRA_EDITS[1], EXTRA_EDITS[2], EXTRA_EDITS[4]
UTIL = EXTRA_EDITS[0]


def _cand(cid, edits, passed=True, log="1 passed in 0.01s", **kw):
    return schema.Candidate(cid, apply_edits(BASE_REPO, edits), passed, log, **kw)


def _group():
    return schema.GroupWorkspace(
        "g1",
        "add() in pkg/core.py subtracts; make it add.",
        BASE_REPO,
        [
            _cand("minimal", [FIX]),
            _cand("twin", [FIX]),  # same patch as "minimal": no evidence to separate them
            _cand("debug", [FIX, PRINT]),
            _cand("sprawl", [FIX, UTIL, TEST_EDIT, CAMEL]),
            _cand("failed", [PRINT], passed=False, log="1 failed"),
        ],
    )


def test_hand_built_group_orders_by_quality():
    ws = _group()
    v = schema.validate(HeuristicGrader().grade(ws), ws)
    j = {x.candidate_id: x for x in v.judgements}
    assert set(j) == {"minimal", "twin", "debug", "sprawl"}  # the failed one is background only
    assert j["minimal"].tier == j["twin"].tier == 1
    assert j["minimal"].rank == j["twin"].rank == 1  # a tie: identical patches
    assert j["minimal"].scores == j["twin"].scores
    assert all(s == 1.0 for s in j["minimal"].scores.values())
    assert j["debug"].rank > 1 and j["debug"].scores["implementation_precision"] < 1.0
    # The debug print is cited at its exact line in the patch.
    (ev,) = [e for e in j["debug"].evidence if e.claim == "implementation_precision"]
    assert ev.kind == "patch" and ev.file == "pkg/core.py"
    added = {n: t for f in ws.candidate("debug").parsed_patch.files for n, t in f.added()}
    assert "print(path)" in added[ev.line]
    # Touching a test file and an unrelated module: tier 3, side effects cited per file.
    assert j["sprawl"].tier == 3 and j["sprawl"].rank == max(x.rank for x in j.values())
    cited = {e.file for e in j["sprawl"].evidence if e.claim == "side_effect_avoidance"}
    assert {"tests/test_core.py", "pkg/util.py", "pkg/new_helpers.py"} <= cited
    assert (
        j["sprawl"].scores["codebase_consistency"] < 1.0
    )  # helperFunction(X) in a snake_case repo
    assert j["debug"].scores["minimality"] < 1.0 == j["minimal"].scores["minimality"]
    assert not any(x.cheat for x in j.values())
    assert v.grader_id == "heuristic" and v.latency_s >= 0


def test_scope_inference_and_explicit_scope():
    ws = _group()
    assert infer_scope(ws) == {"pkg/core.py"}
    ws2 = dataclasses.replace(ws, scope_files=("pkg/core.py", "pkg/util.py"))
    j = {x.candidate_id: x for x in HeuristicGrader().grade(ws2).judgements}
    cited = {e.file for e in j["sprawl"].evidence if e.claim == "side_effect_avoidance"}
    assert "pkg/util.py" not in cited and "tests/test_core.py" in cited


def test_confirmed_monitor_flag_is_cheat_unconfirmed_is_penalty():
    flag = {
        "rule": "edit_tests",
        "evidence": "tests/test_core.py: assertion weakened",
        "confirmed": True,
    }
    soft = dict(flag, confirmed=False, rule="suspicious_io")
    ws = schema.GroupWorkspace(
        "g2",
        "fix add",
        BASE_REPO,
        [
            _cand("a", [FIX]),
            _cand("b", [FIX], monitor_flags=[flag]),
            _cand("c", [FIX], monitor_flags=[soft]),
        ],
    )
    v = schema.validate(HeuristicGrader().grade(ws), ws)
    j = {x.candidate_id: x for x in v.judgements}
    assert j["b"].cheat and j["b"].tier == 3 and "edit_tests" in j["b"].cheat_reason
    (ev,) = [e for e in j["b"].evidence if e.claim == "cheat"]
    assert ev.kind == "execution" and ev.quote in flag["evidence"]
    assert not j["c"].cheat and j["c"].scores["implementation_precision"] < 1.0
    assert j["a"].rank < j["c"].rank < j["b"].rank
    _, _, graded, cheat = schema.to_arrays([schema.GradeResult.accepted(ws, v)], K=3)
    assert graded.all() and cheat.tolist() == [[False, True, False]]


def test_test_log_warnings_and_effort_count():
    traj_short = [schema.TrajectoryEvent(0, "action", "edit", 100)]
    traj_long = [schema.TrajectoryEvent(t, "action", "look around", 400) for t in range(6)]
    ws = schema.GroupWorkspace(
        "g3",
        "fix add",
        BASE_REPO,
        [
            _cand("quick", [FIX], trajectory=traj_short),
            _cand("slow", [FIX], trajectory=traj_long),
            _cand(
                "warn",
                [FIX],
                log="1 passed, 1 warning\nDeprecationWarning: old api",
                trajectory=traj_short,
            ),
        ],
    )
    v = schema.validate(HeuristicGrader().grade(ws), ws)
    j = {x.candidate_id: x for x in v.judgements}
    assert j["slow"].scores["minimality"] < j["quick"].scores["minimality"] == 1.0
    assert any(e.kind == "trajectory" for e in j["slow"].evidence)
    assert j["warn"].scores["solution_fit"] < 1.0
    assert any(e.kind == "execution" and "warning" in e.quote for e in j["warn"].evidence)


def test_quality_features_blend_into_scores():
    ws = schema.GroupWorkspace(
        "g4",
        "fix add",
        BASE_REPO,
        [_cand("a", [FIX], quality={"minimality": 0.0}), _cand("b", [FIX])],
    )
    j = {x.candidate_id: x for x in HeuristicGrader().grade(ws).judgements}
    assert j["a"].scores["minimality"] == 0.5 and j["b"].scores["minimality"] == 1.0


@SETTINGS
@given(st.data())
def test_heuristic_verdicts_always_validate_and_are_permutation_invariant(data):
    ws = data.draw(workspaces())
    grader = HeuristicGrader()
    v = grader.grade(ws)
    schema.validate(v, ws)  # raises if not
    perm = data.draw(st.permutations(ws.candidates))
    v2 = grader.grade(dataclasses.replace(ws, candidates=tuple(perm)))
    by_id = {x.candidate_id: x for x in v.judgements}
    for x in v2.judgements:
        y = by_id[x.candidate_id]
        assert (x.tier, x.rank, x.scores, x.cheat) == (y.tier, y.rank, y.scores, y.cheat)


def test_config_validation_names_the_field():
    import pytest

    with pytest.raises(ValueError, match="weights"):
        HeuristicConfig(weights=(1.0, 1.0))
    with pytest.raises(ValueError, match="t3_below"):
        HeuristicConfig(t3_below=0.9, t1_at_least=0.8)
