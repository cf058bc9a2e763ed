"""Verdict schema: valid verdicts round-trip; malformed ones are rejected with a named reason and
fall back to finite kernel inputs."""

import copy
import json
import math

import hypothesis.strategies as st
import numpy as np
import pytest
from grading_strategies import (
    BASE_REPO,
    FIX,
    apply_edits,
    json_values,
    run_kernels,
    valid_verdict_dicts,
    workspaces,
)
from hypothesis import HealthCheck, Phase, given, settings

from gagar_jax.grading import schema
from gagar_jax.grading.schema import FallbackReason, GradeResult, RejectReason, VerdictRejected

SETTINGS = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _parse(obj, ws):
    return schema.parse_verdict(obj, ws, grader_id="test", grader_version="0")


@SETTINGS
@given(st.data())
def test_valid_verdicts_round_trip(data):
    ws = data.draw(workspaces())
    obj = data.draw(valid_verdict_dicts(ws))
    v = _parse(obj, ws)
    assert {j.candidate_id for j in v.judgements} == {c.candidate_id for c in ws.passing}
    # JSON text round trip (what the cache stores) gives the same verdict.
    text = json.dumps(schema.verdict_to_dict(v))
    assert _parse(text, ws) == v
    assert schema.verdict_from_dict(json.loads(text), ws) == v
    tier, rank, graded, cheat = schema.to_arrays([GradeResult.accepted(ws, v)], K=8)
    assert graded[0]
    for k, c in enumerate(ws.candidates):
        j = v.judgement(c.candidate_id)
        if j is not None:
            assert tier[0, k] == j.tier and rank[0, k] == j.rank
            assert cheat[0, k] == (j.cheat or c.confirmed_cheat)


def _mutations(obj, ws):
    """(name, expected reason, mutated dict) for each mutation applicable to ``obj``."""
    items = obj["verdicts"]
    out = []
    if items:
        m = copy.deepcopy(obj)
        m["verdicts"].pop(0)
        out.append(("drop", RejectReason.MISSING_CANDIDATE, m))
        m = copy.deepcopy(obj)
        m["verdicts"].append(copy.deepcopy(m["verdicts"][0]))
        out.append(("duplicate", RejectReason.DUPLICATE_CANDIDATE, m))
        for bad_tier in (0, 4, -1, 2.5, "1", True, None):
            m = copy.deepcopy(obj)
            m["verdicts"][0]["tier"] = bad_tier
            out.append((f"tier={bad_tier!r}", RejectReason.MALFORMED, m))
        for bad_rank in (0, -3, 1.0, "first"):
            m = copy.deepcopy(obj)
            m["verdicts"][0]["rank"] = bad_rank
            out.append((f"rank={bad_rank!r}", RejectReason.MALFORMED, m))
        for bad in (float("nan"), float("inf"), -0.1, 1.5, "high", None):
            m = copy.deepcopy(obj)
            m["verdicts"][0]["scores"]["minimality"] = bad
            out.append((f"score={bad!r}", RejectReason.MALFORMED, m))
        m = copy.deepcopy(obj)
        del m["verdicts"][0]["scores"]["solution_fit"]
        out.append(("score missing", RejectReason.MALFORMED, m))
        m = copy.deepcopy(obj)
        m["verdicts"][0]["cheat"] = "yes"
        out.append(("cheat str", RejectReason.MALFORMED, m))
        m = copy.deepcopy(obj)
        m["verdicts"][0]["candidate"] = "nobody"
        out.append(("unknown id", RejectReason.EXTRA_CANDIDATE, m))
        # Negative judgement without its evidence.
        m = copy.deepcopy(obj)
        m["verdicts"][0]["scores"]["side_effect_avoidance"] = 0.1
        m["verdicts"][0]["evidence"] = [
            e for e in m["verdicts"][0]["evidence"] if e["claim"] != "side_effect_avoidance"
        ]
        out.append(("negative no evidence", RejectReason.MISSING_EVIDENCE, m))
        # Evidence pointing at nothing.
        for bad_ev in (
            {"kind": "patch", "file": "nope/never.py"},
            {"kind": "patch", "file": "pkg/core.py", "line": 10_000},
            {"kind": "trajectory", "event": 99},
            {"kind": "execution", "quote": "Segmentation fault in module zz"},
            {"kind": "patch", "candidate": "ghost", "file": "pkg/core.py"},
        ):
            m = copy.deepcopy(obj)
            m["verdicts"][0]["evidence"].append({"claim": "minimality"} | bad_ev)
            out.append((f"evidence {bad_ev}", RejectReason.NONEXISTENT_EVIDENCE, m))
        m = copy.deepcopy(obj)
        m["verdicts"][0]["evidence"].append({"claim": "beauty", "kind": "patch", "file": "x"})
        out.append(("bad claim", RejectReason.MALFORMED, m))
    tiers = {it["tier"] for it in items}
    if len(tiers) > 1:
        # Swap ranks between a better-tier and a worse-tier candidate.
        m = copy.deepcopy(obj)
        best = min(m["verdicts"], key=lambda it: it["tier"])
        worst = max(m["verdicts"], key=lambda it: it["tier"])
        best["rank"], worst["rank"] = worst["rank"], best["rank"]
        out.append(("rank swap", RejectReason.TIER_RANK_INCONSISTENT, m))
    fails = [c for c in ws.candidates if not c.passed]
    if fails and items:
        m = copy.deepcopy(obj)
        extra = copy.deepcopy(items[0])
        extra["candidate"] = fails[0].candidate_id
        extra["evidence"] = []
        m["verdicts"].append(extra)
        out.append(("failed judged", RejectReason.EXTRA_CANDIDATE, m))
    m = copy.deepcopy(obj)
    m["group_id"] = ws.group_id + "-other"
    out.append(("wrong group", RejectReason.WRONG_GROUP, m))
    m = copy.deepcopy(obj)
    del m["verdicts"]
    out.append(("no verdicts", RejectReason.MALFORMED, m))
    return out


@SETTINGS
@given(st.data())
def test_mutated_verdicts_rejected_with_named_reason(data):
    ws = data.draw(workspaces())
    obj = data.draw(valid_verdict_dicts(ws))
    results = [GradeResult.accepted(ws, _parse(obj, ws))]
    for name, reason, m in _mutations(obj, ws):
        with pytest.raises(VerdictRejected) as err:
            _parse(m, ws)
        assert err.value.reason == reason, (name, err.value)
        # The same through JSON text, where NaN/inf serialise as non-standard tokens.
        with pytest.raises(VerdictRejected):
            _parse("model says:\n" + json.dumps(m), ws)
        results.append(GradeResult.fallback(ws, FallbackReason(err.value.reason.value)))
    # Every rejection's fallback feeds the kernels: finite, and the group keeps its original
    # advantages (a malformed verdict is never a zero score).
    adv, orig = run_kernels(results, [ws] * len(results))
    assert np.isfinite(adv).all()
    np.testing.assert_array_equal(adv[1 : len(results)], orig[1 : len(results)])


@SETTINGS
@given(st.data())
def test_garbage_is_rejected_cleanly(data):
    ws = data.draw(workspaces())
    garbage = data.draw(
        st.one_of(
            json_values,
            st.text(max_size=200),
            json_values.map(lambda v: json.dumps(v)),
            json_values.map(lambda v: json.dumps({"verdicts": v})),
            json_values.map(lambda v: json.dumps({"verdicts": [v]})),
            st.binary(max_size=50).map(lambda b: b.decode("latin-1")),
        )
    )
    try:
        v = _parse(garbage, ws)
    except VerdictRejected as e:
        assert isinstance(e.reason, RejectReason)
        adv, orig = run_kernels([GradeResult.fallback(ws, FallbackReason(e.reason.value))], [ws])
        assert np.isfinite(adv).all() and (adv[0] == orig[0]).all()
        return
    # Anything accepted must really be valid (only possible with no passing candidates).
    assert not ws.passing and v.judgements == ()


def test_constructed_verdict_type_errors_are_rejections():
    ws = schema.GroupWorkspace(
        "g",
        "t",
        BASE_REPO,
        [schema.Candidate("a", apply_edits(BASE_REPO, [FIX]), True, "1 passed")],
    )
    good = {d: 1.0 for d in schema.DIMENSIONS}
    for bad in (
        None,
        "text",
        3,
        schema.Verdict("g", (schema.Judgement("a", np.float32(1.0), 1, good),), "x", "0"),
        schema.Verdict(
            "g", (schema.Judgement("a", 1, 1, good | {"minimality": math.nan}),), "x", "0"
        ),
        schema.Verdict("g", (schema.Judgement("a", 1, 1, good, cheat=True),), "x", "0"),
        schema.Verdict("g", ("not a judgement",), "x", "0"),
    ):
        with pytest.raises(VerdictRejected) as err:
            schema.validate(bad, ws)
        assert err.value.reason == RejectReason.MALFORMED


def test_ranks_made_dense_and_ties_kept():
    fix = apply_edits(BASE_REPO, [FIX])
    ws = schema.GroupWorkspace(
        "g", "t", BASE_REPO, [schema.Candidate(c, fix, True, "ok") for c in "abc"]
    )
    good = {d: 1.0 for d in schema.DIMENSIONS}
    v = schema.Verdict(
        "g", tuple(schema.Judgement(c, 1, r, good) for c, r in zip("abc", (1, 1, 3))), "x", "0"
    )
    assert [j.rank for j in schema.validate(v, ws).judgements] == [1, 1, 2]


def test_fallback_arrays_are_neutral_and_ungraded():
    ws = schema.GroupWorkspace(
        "g",
        "t",
        BASE_REPO,
        [
            schema.Candidate(
                "a",
                "",
                True,
                "ok",
                monitor_flags=[{"rule": "r", "evidence": "e", "confirmed": True}],
            ),
            schema.Candidate("b", "", False, "no"),
        ],
    )
    res = GradeResult.fallback(ws, FallbackReason.MALFORMED, "x")
    tier, rank, graded, cheat = schema.to_arrays([res, res], K=3)
    assert tier.shape == rank.shape == cheat.shape == (2, 3) and graded.shape == (2,)
    assert (tier == 1).all() and (rank == 1).all() and not graded.any()
    # The confirmed monitor flag still marks the slot (verification's verdict, not the grader's).
    assert cheat[:, 0].all() and not cheat[:, 1:].any()
    with pytest.raises(ValueError, match="more than K=1"):
        schema.to_arrays([res], K=1)
    with pytest.raises(ValueError, match="K must be a positive int"):
        schema.to_arrays([res], K=0)


def test_workspace_rejects_duplicate_ids_and_key_is_content_based():
    with pytest.raises(ValueError, match="candidate ids must be unique"):
        schema.GroupWorkspace(
            "g", "t", {}, [schema.Candidate("a", "", True), schema.Candidate("a", "", False)]
        )
    a = schema.GroupWorkspace("g", "t", {"f": "x"}, [schema.Candidate("a", "", True, "log")])
    b = schema.GroupWorkspace("g", "t", {"f": "x"}, [schema.Candidate("a", "", True, "log")])
    c = schema.GroupWorkspace("g", "t", {"f": "x"}, [schema.Candidate("a", "", True, "log2")])
    assert a.content_key() == b.content_key() != c.content_key()


# --- issue 11: every input is accepted or rejected by name, in bounded time ---------------------

_HUGE = st.sampled_from([10**400, -(10**400), 10**5000, 2**4000, float("inf"), float("nan")])


def _deep(depth: int, leaf=0):
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


def _hostile_mutation(obj, data):
    """Replaces one field of a valid verdict dict with a huge, deep or wrongly typed value."""
    obj = copy.deepcopy(obj)
    if not obj["verdicts"]:
        obj["verdicts"] = [
            {"candidate": "x", "tier": 1, "rank": 1, "scores": {d: 0.5 for d in schema.DIMENSIONS}}
        ]
    item = obj["verdicts"][data.draw(st.integers(0, len(obj["verdicts"]) - 1))]
    kind = data.draw(st.sampled_from(["huge", "deep", "json", "text", "deep_dict"]))
    if kind == "huge":
        bad = data.draw(_HUGE)
    elif kind == "json":
        bad = data.draw(json_values)
    elif kind == "text":
        bad = "fast"
    else:  # built here, not drawn: hypothesis would repr a 12,000-deep value
        depth = data.draw(st.integers(1, 12_000))
        bad = _deep(depth) if kind == "deep" else {"nested": _deep(depth)}
    where = data.draw(
        st.sampled_from(
            [
                "score",
                "tier",
                "rank",
                "cheat_reason",
                "note",
                "line",
                "event",
                "candidate",
                "top_votes",
                "top_agreement",
                "top_group",
                "evidence_list",
            ]
        )
    )
    if where == "score":
        item["scores"][data.draw(st.sampled_from(sorted(item["scores"])))] = bad
    elif where in ("tier", "rank", "cheat_reason", "candidate"):
        item[where] = bad
    elif where in ("note", "line", "event"):
        if item.get("evidence"):
            item["evidence"][0][where] = bad
        else:
            item["evidence"] = [{"claim": "minimality", "kind": "patch", where: bad}]
    elif where == "evidence_list":
        item["evidence"] = bad
    else:
        obj[where.removeprefix("top_") if where != "top_group" else "group_id"] = bad
    return obj


@settings(
    max_examples=200,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_fuzz_parse_and_validate_accept_or_reject_by_name(data):
    ws = data.draw(workspaces())
    obj = _hostile_mutation(data.draw(valid_verdict_dicts(ws)), data)
    as_text = data.draw(st.booleans())
    if as_text:
        try:
            text = json.dumps(obj)
        except (ValueError, RecursionError):
            text = '{"verdicts": ' + "[" * 10_000  # too deep to encode: deep text instead
        obj = text
    try:
        v = _parse(obj, ws)
    except VerdictRejected as e:
        assert isinstance(e.reason, RejectReason) and e.detail
        return
    schema.validate(v, ws)  # an accepted verdict validates again, without raising
    assert all(math.isfinite(s) for j in v.judgements for s in j.scores.values())


@pytest.mark.parametrize(
    "bad",
    [
        '{"verdicts": [{"candidate": "r0", "tier": 1, "rank": 1, "scores": {"solution_fit": '
        + "9" * 400
        + "}}]}",
        '{"verdicts": [{"candidate": "r0", "tier": ' + "7" * 5000 + ', "rank": 1}]}',
        '{"verdicts": [' * 10_000 + "]" * 10_000 + "}",
        {"verdicts": [{"candidate": "r0", "tier": 10**5000, "rank": 1, "scores": {}}]},
        {
            "verdicts": [
                {
                    "candidate": "r0",
                    "tier": 1,
                    "rank": 1,
                    "scores": {d: 10**400 for d in schema.DIMENSIONS},
                }
            ]
        },
        {
            "verdicts": [
                {
                    "candidate": "r0",
                    "tier": 1,
                    "rank": 1,
                    "scores": {d: 0.5 for d in schema.DIMENSIONS},
                    "evidence": [{"claim": "minimality", "kind": "patch", "note": _deep(10_000)}],
                }
            ]
        },
        {"verdicts": "x", "votes": 10**5000, "agreement": 10**400},
    ],
)
def test_the_reported_instances_are_named_rejections(bad):
    cand = schema.Candidate("r0", apply_edits(BASE_REPO, [FIX]), True, "1 passed")
    ws = schema.GroupWorkspace("g", "t", BASE_REPO, (cand,))
    with pytest.raises(VerdictRejected) as e:
        _parse(bad, ws)
    assert e.value.reason in set(RejectReason)
