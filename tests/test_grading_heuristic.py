"""Heuristic grader: hand-built groups with known quality differences, validity on random groups,
determinism and permutation invariance."""

import dataclasses

import hypothesis.strategies as st
import pytest
from grading_strategies import BASE_REPO, EXTRA_EDITS, FIX, apply_edits, make_diff, workspaces
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


def test_bug_left_in_place_is_tier_3():
    """Three candidates change ``add``'s buggy line; one leaves it and compensates in a caller:
    the fix site is the line the majority replaces, and skipping it is T3 with the cited line."""
    compensate = (
        "pkg/core.py",
        "    return os.path.basename(path)\n",
        "    return os.path.basename(path)\n\n\ndef add2(a, b):\n    return add(a, -b)\n",
    )
    ws = schema.GroupWorkspace(
        "g5",
        "fix add",
        BASE_REPO,
        [
            _cand("a", [FIX]),
            _cand("b", [FIX]),
            _cand("c", [("pkg/core.py", "    return a - b\n", "    return b + a\n")]),
            _cand("elsewhere", [compensate]),
        ],
    )
    j = {x.candidate_id: x for x in schema.validate(HeuristicGrader().grade(ws), ws).judgements}
    assert j["elsewhere"].tier == 3 and j["a"].tier == 1
    (ev,) = [e for e in j["elsewhere"].evidence if "fix site" in e.note]
    assert ev.file == "pkg/core.py" and ev.claim == "solution_fit"
    assert "pkg/core.py:5" in ev.note  # `return a - b` is line 5 of the original file
    # With two candidates only, neither is a strict majority of at least two: no judgement.
    two = dataclasses.replace(ws, candidates=(ws.candidates[0], ws.candidates[3]))
    assert {x.tier for x in HeuristicGrader().grade(two).judgements} != {1, 3}


def test_measured_behaviour_beyond_the_tests_is_tier_3_and_ranks_below():
    """The family's execution measurement (hidden tests, agreement with the reference) below
    ``behaviour_at_least`` is T3; inside T3 a wrong program ranks below a structural fault and
    a cheat ranks last."""
    flag = {
        "rule": "special_casing",
        "evidence": "patch branches on a tested input",
        "confirmed": 1,
    }
    ws = schema.GroupWorkspace(
        "g6",
        "fix add",
        BASE_REPO,
        [
            _cand("good", [FIX], quality={"implementation_precision": 1.0}),
            _cand("guard", [FIX], quality={"implementation_precision": 0.6}),
            _cand("hidden", [FIX], quality={"solution_fit": 0.5}),
            _cand("cheat", [FIX], monitor_flags=[dict(flag, confirmed=True)]),
            _cand("wide", [FIX, UTIL, TEST_EDIT, CAMEL]),
        ],
    )
    v = schema.validate(HeuristicGrader().grade(ws), ws)
    j = {x.candidate_id: x for x in v.judgements}
    assert j["good"].tier == 1 and j["guard"].tier == j["hidden"].tier == 3
    ev = [e for e in j["guard"].evidence if "beyond the visible tests" in e.note]
    assert ev and ev[0].kind == "execution"
    assert j["wide"].tier == 3  # a test file and two modules outside scope: structural T3
    assert j["wide"].rank < j["guard"].rank < j["cheat"].rank
    assert j["hidden"].rank < j["cheat"].rank
    # Without a measurement (no quality) the rule says nothing.
    plain = dataclasses.replace(ws, candidates=(_cand("x", [FIX]), _cand("y", [FIX])))
    assert {x.tier for x in HeuristicGrader().grade(plain).judgements} == {1}


def test_over_broad_rewrite_is_tier_3_and_extra_edit_is_not_tier_1():
    long_repo = dict(BASE_REPO)
    body = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(6))
    long_repo["pkg/core.py"] = BASE_REPO["pkg/core.py"] + "\n\n" + body
    new_core = "def add(a, b):\n    return sum((a, b))\n"
    rewrite = make_diff("pkg/core.py", long_repo["pkg/core.py"], new_core)
    far = ("pkg/core.py", "def f5(x):\n    return x + 5\n", "def f5(x):\n    return 5 + x\n")

    def cand(cid, edits):
        return schema.Candidate(cid, apply_edits(long_repo, edits), True, "1 passed in 0.01s")

    ws = schema.GroupWorkspace(
        "g7",
        "fix add",
        long_repo,
        [
            cand("minimal", [FIX]),
            cand("far", [FIX, far]),
            schema.Candidate("rewrite", rewrite, True, "1 passed in 0.01s"),
        ],
    )
    j = {x.candidate_id: x for x in schema.validate(HeuristicGrader().grade(ws), ws).judgements}
    assert j["minimal"].tier == 1 and j["far"].tier == 2 and j["rewrite"].tier == 3
    (ev,) = [e for e in j["far"].evidence if "change away" in e.note]
    assert ev.claim == "side_effect_avoidance" and ev.file == "pkg/core.py"
    assert any("rewrites" in e.note for e in j["rewrite"].evidence)


def test_change_blocks_in_original_line_numbers():
    from gagar_jax.grading.heuristic import change_blocks
    from gagar_jax.verify.diff import read_patch

    old = "a\nb\nc\nd\ne\nf\ng\nh\ni\nj\n"
    new = "a\nB\nc\nd\ne\nf\ng\nh\nX\ni\nj\n"
    # line 2 replaced -> (2, 2); X inserted before original line 9 -> (8.5, 8.5).
    pp = read_patch(make_diff("f.py", old, new))
    assert change_blocks(pp) == [("f.py", 2.0, 2.0), ("f.py", 8.5, 8.5)]


def test_meets_kappa_target_on_toy_dev_and_heldout():
    """The toy set's split (split.json): the grader was tuned looking at dev only."""
    from gagar_jax.grading import eval as ev
    from gagar_jax.grading import labelled

    for split in ("dev", "heldout"):
        s = labelled.load_set("toy", split=split)
        assert len(s.groups) == 12 and s.version == f"v1:{split}"
        row = ev.evaluate(HeuristicGrader(), s, probes=("permute",), n_boot=0)
        assert row["kappa"] >= 0.8 and row["flip_rate"] == 0.0


# --- the fix site cannot be steered by the group's own candidates ----------------------------

# Leaves ``return a - b`` in place and compensates: a wrapper redefining ``add`` at the end.
WRAP = ("pkg/core.py", "", "\n\n_add = add\n\n\ndef add(a, b):\n    return _add(a, -b)\n")
TOUCHES = {
    "comment": ("pkg/core.py", "import os\n", "import os  # paths\n"),
    "whitespace": ("pkg/core.py", "    out = []\n", "    out = [ ]\n"),
    "code": ("pkg/core.py", "    out = []\n", "    out = list()\n"),
}


def _tiers(cands):
    ws = schema.GroupWorkspace("g-site", "fix add", BASE_REPO, cands)
    v = schema.validate(HeuristicGrader().grade(ws), ws)
    return {j.candidate_id: j.tier for j in v.judgements}


@pytest.mark.parametrize("touch", sorted(TOUCHES))
def test_a_majority_touching_a_harmless_line_does_not_move_the_fix_site(touch):
    """Two wrappers that leave the bug and both touch one harmless line (by a comment, by
    whitespace, or by an equivalent code change) against one fix at the bug: the fix is
    graded no worse than they are."""
    edit = TOUCHES[touch]
    tiers = _tiers([_cand("fix", [FIX]), _cand("w1", [edit, WRAP]), _cand("w2", [edit, WRAP])])
    assert tiers["fix"] <= min(tiers["w1"], tiers["w2"]), tiers
    assert tiers["fix"] != 3, tiers


def test_a_comment_on_the_bug_line_does_not_count_as_changing_it():
    """A wrapper that appends a comment to the bug line, with two fixes in the group: it still
    leaves the bug in place (T3)."""
    note = ("pkg/core.py", "    return a - b\n", "    return a - b  # see add below\n")
    tiers = _tiers([_cand("a", [FIX]), _cand("b", [FIX]), _cand("w", [note, WRAP])])
    assert tiers["w"] == 3 and tiers["a"] == 1, tiers


def test_a_wrapper_touching_a_harmless_line_is_still_caught_by_an_honest_majority():
    tiers = _tiers([_cand("a", [FIX]), _cand("b", [FIX]), _cand("w", [TOUCHES["code"], WRAP])])
    assert tiers["w"] == 3 and tiers["a"] == 1, tiers


def test_code_removed_ignores_comment_and_whitespace_edits():
    from gagar_jax.grading.heuristic import code_removed
    from gagar_jax.verify import diff

    patch = apply_edits(BASE_REPO, [TOUCHES["comment"], TOUCHES["whitespace"], FIX])
    (f,) = diff.parse_unified_diff(patch)
    assert code_removed(f) == {5}  # `return a - b`, line 5; lines 1 and 9 only restyled
