"""Constrained decoding of the agentic grader's verdict: the per-vote JSON schema, the request
payload, and the fallback when an endpoint refuses it (CPU, no server; seconds)."""

import copy
import dataclasses
import json

import jsonschema  # the test extras
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.grading import labelled, schema
from gagar_jax.grading import protocol_student as ps
from gagar_jax.grading.agentic import (
    AgenticGrader,
    AnonymisedView,
    verdict_json_schema,
    verdict_response_format,
)
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.pool import GradingPool
from gagar_jax.grading.schema import FallbackReason, RejectReason, VerdictRejected
from gagar_jax.rollout.sglang_client import SGLangRequestError


def _skeleton(node):
    """``node`` with the strings that no meta-schema rule reads made equal: the items of an
    ``enum`` list and the value of ``const``, ``title`` and ``description`` (the views differ
    only there and in counts)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "enum" and isinstance(v, list):
                out[k] = ["s" if isinstance(x, str) else _skeleton(x) for x in v]
            elif k in ("const", "title", "description") and isinstance(v, str):
                out[k] = "s"
            else:
                out[k] = _skeleton(v)
        return out
    if isinstance(node, list):
        return [_skeleton(x) for x in node]
    return node


_META_CHECKED: set[str] = set()


def _validator(sch):
    """A validator of ``sch``, which must itself be a valid Draft 2020-12 schema. The meta-schema
    check (~0.3 s each) runs once per skeleton: its verdict cannot depend on the strings the
    skeleton makes equal, since those keywords accept any string."""
    key = json.dumps(_skeleton(sch), sort_keys=True)
    if key not in _META_CHECKED:
        jsonschema.Draft202012Validator.check_schema(sch)
        _META_CHECKED.add(key)
    return jsonschema.Draft202012Validator(sch)


@pytest.fixture(scope="module")
def groups():
    return [g.workspace for g in labelled.load_set("toy").groups[:8]] + [
        g.workspace for g in labelled.load_set("repo").groups
    ]


def test_every_teacher_answer_satisfies_its_votes_schema(groups):
    grader = AgenticGrader(ps.ProtocolTeacher(HeuristicGrader()), prompt_version="c1", votes=3)
    n = 0
    for ws in groups:
        verdict = schema.validate(HeuristicGrader().grade(ws), ws)
        for vote in range(3):
            _, view = grader.episode_messages(ws, vote)
            answer = json.loads(ps.render_verdict(verdict, view))
            errors = list(_validator(verdict_json_schema(view)).iter_errors(answer))
            assert not errors, (ws.group_id, vote, errors[0].message)
            n += 1
    assert n == 3 * len(groups)


def _answer_and_validator(ws, vote=0):
    grader = AgenticGrader(ps.ProtocolTeacher(HeuristicGrader()), prompt_version="c1")
    _, view = grader.episode_messages(ws, vote)
    verdict = schema.validate(HeuristicGrader().grade(ws), ws)
    answer = json.loads(ps.render_verdict(verdict, view))
    return answer, _validator(verdict_json_schema(view)), view


def test_the_meta_schema_check_still_runs_for_each_new_skeleton(groups):
    """The checked-skeleton memo cannot hide a broken schema: a view's schema with one keyword
    made invalid is a new skeleton, and is refused."""
    _, _, view = _answer_and_validator(groups[0])
    broken = json.loads(json.dumps(verdict_json_schema(view)))
    broken["type"] = "objekt"
    with pytest.raises(jsonschema.SchemaError):
        _validator(broken)
    renamed = json.loads(json.dumps(verdict_json_schema(view)))
    renamed["description"] = "another view's text"  # the same skeleton: already checked
    assert _validator(renamed).is_valid({}) is False


def test_the_schema_refuses_what_a_verdict_cannot_hold(groups):
    ws = groups[0]
    answer, val, view = _answer_and_validator(ws)
    assert val.is_valid(answer)

    def bad(edit):
        a = copy.deepcopy(answer)
        edit(a)
        return val.is_valid(a)

    item = answer["verdicts"][0]
    failed = next(view.alias_of[c.candidate_id] for c in ws.candidates if not c.passed)
    assert not bad(lambda a: a["verdicts"][0]["scores"].update(implementation_precision=1.5))
    assert not bad(lambda a: a["verdicts"][0]["scores"].update(minimality=-0.1))
    assert not bad(lambda a: a["verdicts"][0]["scores"].pop("minimality"))
    assert not bad(lambda a: a["verdicts"][0]["scores"].update(extra=0.5))
    assert not bad(lambda a: a["verdicts"][0].update(tier=4))
    assert not bad(lambda a: a["verdicts"][0].update(rank=len(a["verdicts"]) + 1))
    assert not bad(lambda a: a["verdicts"][0].update(cheat="no"))
    assert not bad(lambda a: a["verdicts"][0].update(candidate=failed))  # a failed candidate
    assert not bad(lambda a: a["verdicts"].append(copy.deepcopy(item)))  # one item too many
    assert not bad(lambda a: a["verdicts"].pop())  # one too few
    assert not bad(lambda a: a["verdicts"].reverse())  # items in alias order only
    assert not bad(lambda a: a["verdicts"][0].update(cheat_reason="x" * 81))
    assert not bad(lambda a: a.update(group_id="other"))
    # Two rules of one item: a cheat has a reason (and only a cheat), a tier 2 or 3 or a cheat
    # cites evidence.
    assert not bad(lambda a: a["verdicts"][0].update(cheat=True))
    assert not bad(lambda a: a["verdicts"][0].update(cheat_reason="not a cheat"))
    lower = next(k for k, it in enumerate(answer["verdicts"]) if it["tier"] >= 2)
    assert not bad(lambda a: a["verdicts"][lower].update(evidence=[]))
    first = next(k for k, it in enumerate(answer["verdicts"]) if it["tier"] == 1)
    assert bad(lambda a: a["verdicts"][first].update(evidence=[]))
    assert bad(lambda a: a["verdicts"][lower].update(cheat=True, cheat_reason="hard-coded"))
    ev = {"claim": "minimality", "kind": "patch", "candidate": item["candidate"]}
    assert not bad(lambda a: a["verdicts"][0]["evidence"].append(ev | {"file": "nope.py"}))
    assert not bad(lambda a: a["verdicts"][0]["evidence"].append(ev | {"claim": "style"}))
    assert not bad(lambda a: a["verdicts"][0]["evidence"].append({**ev, "file": None}))
    own = ws.candidate(view.real_of[item["candidate"]]).parsed_patch.paths[0]
    assert bad(lambda a: a["verdicts"][0]["evidence"].append(ev | {"file": own}))
    assert not bad(lambda a: a["verdicts"][0].update(evidence=[ev | {"file": own}] * 7))


def test_a_permuted_group_gets_the_same_schema(groups):
    ws = groups[1]
    permuted = dataclasses.replace(ws, candidates=tuple(reversed(ws.candidates)))
    a, b = AnonymisedView(ws, 5), AnonymisedView(permuted, 5)
    assert verdict_json_schema(a) == verdict_json_schema(b)


class Recorder:
    """A chat client that answers with ``answer(messages)`` and keeps every call's kwargs."""

    def __init__(self, answer, refuse=None):
        self.answer, self.refuse, self.calls = answer, refuse, []

    def chat_completions(self, messages, **kw):
        self.calls.append(kw)
        if self.refuse is not None and "response_format" in kw:
            raise self.refuse
        return {"choices": [{"message": {"role": "assistant", "content": self.answer(messages)}}]}


def _teacher_graded(ws, refuse=None, **kw):
    """An agentic grader whose client answers as the protocol teacher (behind a Recorder)."""
    teacher = ps.ProtocolTeacher(HeuristicGrader())
    rec = Recorder(
        lambda messages: teacher.chat_completions(messages)["choices"][0]["message"]["content"],
        refuse=refuse,
    )
    grader = AgenticGrader(rec, prompt_version="c1", max_steps=1, **kw)
    teacher.index(grader, [ws])
    return grader, rec


def test_compact_prompts_send_the_votes_schema_and_tool_prompts_do_not(groups):
    ws = groups[0]
    grader, rec = _teacher_graded(ws, votes=2)
    assert grader.constrain_answer and not grader.use_tools
    v = grader.grade(ws)
    assert v.votes == 2 and grader.metrics["constrain/calls"] == 2
    for vote, kw in enumerate(rec.calls):
        _, view = grader.episode_messages(ws, vote)
        fmt = kw["response_format"]
        assert fmt == verdict_response_format(view)
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "verdict"
        assert fmt["json_schema"]["schema"] == verdict_json_schema(view)
        assert kw["tools"] is None
        json.dumps(fmt)  # serialisable as a request body
    plain, off = _teacher_graded(ws, constrain_answer=False)
    plain.grade(ws)
    assert "response_format" not in off.calls[0]
    with pytest.raises(ValueError, match="use_tools"):
        AgenticGrader(off, prompt_version="v2", constrain_answer=True)
    assert not AgenticGrader(off, prompt_version="v2").constrain_answer
    a = AgenticGrader(off, prompt_version="c1")
    b = AgenticGrader(off, prompt_version="c1", constrain_answer=False)
    assert a.cache_id != b.cache_id


@pytest.mark.parametrize(
    "refusal",
    [
        SGLangRequestError("/v1/chat/completions: HTTP 400: response_format not supported"),
        TypeError("chat_completions() got an unexpected keyword argument 'response_format'"),
    ],
)
def test_an_endpoint_refusing_the_schema_gets_the_call_without_it(groups, refusal):
    ws = groups[0]
    grader, rec = _teacher_graded(ws, refuse=refusal, votes=2)
    v = grader.grade(ws)
    assert v.votes == 2  # both votes accepted, unconstrained
    assert grader.metrics["constrain/rejected"] == 1
    # The first call carried the schema and was refused, its repeat and the next vote did not.
    assert ["response_format" in kw for kw in rec.calls] == [True, False, False]


def test_other_errors_propagate_and_the_pool_falls_back(groups):
    ws = groups[0]

    class Down:
        def chat_completions(self, messages, **kw):
            raise SGLangRequestError("HTTP 400: prompt too long")  # refused with or without it

    grader = AgenticGrader(Down(), prompt_version="c1", max_steps=1)
    with pytest.raises(SGLangRequestError):
        grader.grade(ws)
    assert grader.constrain_answer and grader._constrain  # not taken for a schema refusal
    assert grader.metrics["constrain/rejected"] == 0
    with GradingPool(grader, deadline_s=30) as pool:
        pool.submit(ws)
        (r,) = pool.results([ws.group_id], timeout=30)
    assert r.fallback_reason == FallbackReason.GRADER_ERROR


def _inconsistent_answer(ws):
    """The teacher's answer with its first candidate in tier 1 at the worst rank and every other
    candidate in tier 2 at rank 1 (each with evidence): schema-valid, ranks against tiers."""
    answer, val, view = _answer_and_validator(ws)
    n = len(answer["verdicts"])
    out = copy.deepcopy(answer)
    for k, item in enumerate(out["verdicts"]):
        item.update(tier=1 if k == 0 else 2, rank=n if k == 0 else 1)
        item["evidence"] = answer["verdicts"][k]["evidence"] or [
            {"claim": "minimality", "kind": "patch", "candidate": item["candidate"], "file": f}
            for f in ws.candidate(view.real_of[item["candidate"]]).parsed_patch.paths[:1]
        ]
    assert val.is_valid(out)
    return out, view


def test_schema_valid_answers_are_still_validated(groups):
    """The schema cannot express tier/rank consistency or evidence rules: ``parse_verdict``
    stays the authority, and a schema-valid but wrong verdict is rejected."""
    ws = groups[0]
    answer, val, view = _answer_and_validator(ws)
    inconsistent, _ = _inconsistent_answer(ws)
    unbacked = copy.deepcopy(answer)
    first = next(k for k, it in enumerate(answer["verdicts"]) if it["tier"] == 1)
    item = unbacked["verdicts"][first]
    item["scores"]["minimality"] = 0.1
    item["evidence"] = []
    assert not val.is_valid(unbacked)  # a negative score without evidence: refused by the schema
    # Evidence of another claim: which claim backs which score is validation's alone.
    path = ws.candidate(view.real_of[item["candidate"]]).parsed_patch.paths[0]
    item["evidence"] = [
        {"claim": "solution_fit", "kind": "patch", "candidate": item["candidate"], "file": path}
    ]
    for obj, reason in [
        (inconsistent, RejectReason.TIER_RANK_INCONSISTENT),
        (unbacked, RejectReason.MISSING_EVIDENCE),
    ]:
        assert val.is_valid(obj)
        rec = Recorder(lambda messages, obj=obj: json.dumps(obj, separators=(",", ":")))
        grader = AgenticGrader(rec, prompt_version="c1", max_steps=1)
        with pytest.raises(VerdictRejected) as err:
            grader.grade(ws)
        assert err.value.reason == reason
        assert "response_format" in rec.calls[0]


def test_tier_first_rank_order_renumbers_ranks_that_contradict_tiers(groups):
    """``rank_order="tier_first"`` keeps a vote's tiers and renumbers its ranks in (tier, rank)
    order (counted); every other rule still rejects, and ``strict`` (the default) rejects."""
    ws = next(w for w in groups if len(w.passing) >= 3)
    obj, view = _inconsistent_answer(ws)
    first = view.real_of[obj["verdicts"][0]["candidate"]]
    strict = AgenticGrader(Recorder(lambda m: json.dumps(obj)), prompt_version="c1", max_steps=1)
    with pytest.raises(VerdictRejected) as err:
        strict.grade(ws)
    assert err.value.reason == RejectReason.TIER_RANK_INCONSISTENT
    assert strict.rank_order == "strict" and strict.metrics["ranks_reordered"] == 0
    rec = Recorder(lambda m: json.dumps(obj))
    grader = AgenticGrader(rec, prompt_version="c1", max_steps=1, rank_order="tier_first")
    v = grader.grade(ws)
    assert grader.metrics["ranks_reordered"] == 1
    assert schema.ranks_follow_tiers(v)
    by = {j.candidate_id: j for j in v.judgements}
    assert (by[first].tier, by[first].rank) == (1, 1)
    assert {(j.tier, j.rank) for j in v.judgements if j.candidate_id != first} == {(2, 2)}
    # A consistent answer is not counted; a missing piece of evidence is still rejected.
    answer, _, _ = _answer_and_validator(ws)
    ok = AgenticGrader(
        Recorder(lambda m: json.dumps(answer)), prompt_version="c1", rank_order="tier_first"
    )
    ok.grade(ws)
    assert ok.metrics["ranks_reordered"] == 0 and ok.metrics["accepted"] == 1
    unbacked = copy.deepcopy(obj)
    unbacked["verdicts"][0]["scores"]["minimality"] = 0.1
    unbacked["verdicts"][0]["evidence"] = []
    bad = AgenticGrader(
        Recorder(lambda m: json.dumps(unbacked)), prompt_version="c1", rank_order="tier_first"
    )
    with pytest.raises(VerdictRejected) as err:
        bad.grade(ws)
    assert err.value.reason == RejectReason.MISSING_EVIDENCE
    assert grader.cache_id != strict.cache_id
    with pytest.raises(ValueError, match="rank_order"):
        AgenticGrader(rec, prompt_version="c1", rank_order="best_first")
    with pytest.raises(ValueError, match="ranks"):
        schema.validate(v, ws, ranks="loose")


def test_drop_uncited_scores_keeps_the_vote_and_its_tiers(groups):
    """``uncited_scores="drop_uncited"``: a low score whose evidence makes another claim is raised
    to the threshold and the vote is kept (counted), with its tiers, ranks and cited scores; a
    tier 2 without any evidence and a cheat without evidence are still rejected; ``cite`` (the
    default) rejects; relaxations combine with ``tier_first`` and are tried only when needed."""
    ws = next(w for w in groups if len(w.passing) >= 3)
    answer, val, view = _answer_and_validator(ws)
    miscited = copy.deepcopy(answer)
    k = next(i for i, it in enumerate(answer["verdicts"]) if it["tier"] == 1)
    item = miscited["verdicts"][k]
    path = ws.candidate(view.real_of[item["candidate"]]).parsed_patch.paths[0]
    item["scores"]["minimality"] = 0.1
    item["scores"]["solution_fit"] = 0.2
    item["evidence"] = [
        {"claim": "solution_fit", "kind": "patch", "candidate": item["candidate"], "file": path}
    ]
    assert val.is_valid(miscited)
    cite = AgenticGrader(Recorder(lambda m: json.dumps(miscited)), prompt_version="c1")
    with pytest.raises(VerdictRejected) as err:
        cite.grade(ws)
    assert err.value.reason == RejectReason.MISSING_EVIDENCE
    drop = AgenticGrader(
        Recorder(lambda m: json.dumps(miscited)), prompt_version="c1", uncited_scores="drop_uncited"
    )
    v = drop.grade(ws)
    assert drop.metrics["uncited_scores_dropped"] == 1 and drop.metrics["ranks_reordered"] == 0
    judged = v.judgement(view.real_of[item["candidate"]])
    assert judged.scores["minimality"] == schema.NEGATIVE_SCORE  # uncited: not believed
    assert judged.scores["solution_fit"] == 0.2  # cited: kept
    for it in answer["verdicts"]:
        j = v.judgement(view.real_of[it["candidate"]])
        assert (j.tier, j.rank) == (it["tier"], it["rank"])
    assert drop.cache_id != cite.cache_id
    # A consistent, cited answer is accepted under the strict rules: nothing counted.
    plain = AgenticGrader(
        Recorder(lambda m: json.dumps(answer)), prompt_version="c1", uncited_scores="drop_uncited"
    )
    plain.grade(ws)
    assert plain.metrics["uncited_scores_dropped"] == 0 and plain.metrics["accepted"] == 1
    # Ranks against tiers and an uncited low score: both relaxations, both counted.
    both_obj, _ = _inconsistent_answer(ws)
    both_obj["verdicts"][0]["scores"]["minimality"] = 0.1
    both_obj["verdicts"][0]["evidence"] = [  # every item has evidence (_inconsistent_answer)
        dict(ev, claim="solution_fit") for ev in both_obj["verdicts"][0]["evidence"]
    ]
    both = AgenticGrader(
        Recorder(lambda m: json.dumps(both_obj)),
        prompt_version="c1",
        rank_order="tier_first",
        uncited_scores="drop_uncited",
    )
    vb = both.grade(ws)
    assert both.metrics["ranks_reordered"] == 1 and both.metrics["uncited_scores_dropped"] == 1
    assert schema.ranks_follow_tiers(vb)
    only_ranks = AgenticGrader(
        Recorder(lambda m: json.dumps(both_obj)), prompt_version="c1", rank_order="tier_first"
    )
    with pytest.raises(VerdictRejected) as err:
        only_ranks.grade(ws)
    assert err.value.reason == RejectReason.MISSING_EVIDENCE
    # What still needs evidence: a cheat flag, and a tier 2 or 3.
    for change in ({"cheat": True, "cheat_reason": "x"}, {"tier": 2, "rank": 99}):
        bad = copy.deepcopy(answer)
        bad["verdicts"][k].update(change, evidence=[])
        bad["verdicts"][k]["scores"] = dict.fromkeys(schema.DIMENSIONS, 0.9)
        g = AgenticGrader(
            Recorder(lambda m, bad=bad: json.dumps(bad)),
            prompt_version="c1",
            rank_order="tier_first",
            uncited_scores="drop_uncited",
        )
        with pytest.raises(VerdictRejected) as err:
            g.grade(ws)
        assert err.value.reason == RejectReason.MISSING_EVIDENCE, change
    with pytest.raises(ValueError, match="uncited_scores"):
        AgenticGrader(Recorder(lambda m: ""), prompt_version="c1", uncited_scores="lenient")
    with pytest.raises(ValueError, match="scores"):
        schema.validate(v, ws, scores="lenient")


def test_seed_votes_seeds_each_call_from_content_vote_and_step(groups):
    """``seed_votes``: every call carries a seed; votes get different seeds; the same group
    with its candidates in another order gets the very same seeds (and prompts); another
    grader ``seed`` or another group changes them; off (the default) sends no seed."""
    ws = next(w for w in groups if len(w.passing) >= 3)
    permuted = dataclasses.replace(ws, candidates=tuple(reversed(ws.candidates)))
    answer, _, _ = _answer_and_validator(ws)

    def seeds_of(grader_seed, w, **kw):
        rec = Recorder(lambda m: "no verdict")
        g = AgenticGrader(
            rec, prompt_version="c1", votes=3, min_votes=1, max_steps=2, seed=grader_seed, **kw
        )
        with pytest.raises(VerdictRejected):
            g.grade(w)
        return [c.get("seed") for c in rec.calls], g

    base, g = seeds_of(0, ws, seed_votes=True)
    assert len(base) == 6 and all(isinstance(x, int) and 0 <= x < 2**31 for x in base)
    assert len(set(base)) == 6  # three votes of two steps: all different
    assert sorted(seeds_of(0, permuted, seed_votes=True)[0]) == sorted(base)
    assert g.call_seed(ws, 1, 2) == g.call_seed(permuted, 1, 2)
    assert set(seeds_of(1, ws, seed_votes=True)[0]).isdisjoint(base)
    other = next(w for w in groups if w.task_text != ws.task_text)
    assert g.call_seed(other, 0, 1) != g.call_seed(ws, 0, 1)
    off, g_off = seeds_of(0, ws)
    assert off == [None] * 6 and g_off.call_seed(ws, 0, 1) is None
    assert g.cache_id != g_off.cache_id
    # A client that answers: the seed does not change what is accepted.
    rec = Recorder(lambda m: json.dumps(answer))
    AgenticGrader(rec, prompt_version="c1", seed_votes=True).grade(ws)
    assert "seed" in rec.calls[0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.floats(0, 1), min_size=5, max_size=5),
            st.sets(st.sampled_from(schema.CLAIMS), max_size=3),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_drop_uncited_scores_raises_exactly_the_uncited_negatives(items):
    """Afterwards no uncited negative is left; cited scores and scores at or above the threshold
    are unchanged; a raised score is exactly the threshold."""
    ev = {c: schema.Evidence(c, "execution", "c0", quote="abc") for c in schema.CLAIMS}
    v = schema.Verdict(
        "g",
        tuple(
            schema.Judgement(
                f"c{k}", 1, 1, dict(zip(schema.DIMENSIONS, sc)), False, "", tuple(ev[c] for c in cl)
            )
            for k, (sc, cl) in enumerate(items)
        ),
        "x",
        "1",
    )
    out = schema.drop_uncited_scores(v)
    assert not any(schema.uncited_dimensions(j) for j in out.judgements)
    for a, b in zip(v.judgements, out.judgements):
        assert (a.tier, a.rank, a.cheat, a.evidence) == (b.tier, b.rank, b.cheat, b.evidence)
        claims = {e.claim for e in a.evidence}
        for d in schema.DIMENSIONS:
            if a.scores[d] >= schema.NEGATIVE_SCORE or d in claims:
                assert b.scores[d] == a.scores[d]
            else:
                assert b.scores[d] == schema.NEGATIVE_SCORE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6)), min_size=1, max_size=8))
def test_order_ranks_by_tier_keeps_each_tiers_order(pairs):
    """Ranks follow tiers afterwards; inside a tier every pair keeps its order (<, =, >); ranks
    are dense; a verdict whose ranks already follow its tiers keeps every pair's order."""
    scores = dict.fromkeys(schema.DIMENSIONS, 1.0)
    v = schema.Verdict(
        "g",
        tuple(
            schema.Judgement(f"c{k}", t, r, scores, False, "", ()) for k, (t, r) in enumerate(pairs)
        ),
        "x",
        "1",
    )
    out = schema.order_ranks_by_tier(v)
    assert schema.ranks_follow_tiers(out)
    assert [j.tier for j in out.judgements] == [j.tier for j in v.judgements]
    assert sorted({j.rank for j in out.judgements}) == list(
        range(1, len({j.rank for j in out.judgements}) + 1)
    )

    def sign(x):
        return (x > 0) - (x < 0)

    consistent = schema.ranks_follow_tiers(v)
    for a, a2 in zip(v.judgements, out.judgements):
        for b, b2 in zip(v.judgements, out.judgements):
            if a.tier == b.tier or consistent:
                assert sign(a.rank - b.rank) == sign(a2.rank - b2.rank)


def test_quotable_log_lines_need_no_escaping():
    """Candidate text becomes schema literals: only plain printable lines are offered."""
    from gagar_jax.grading.agentic import _quote_lines

    log = 'ok line\n"quoted" x\nback\\slash\n<untrusted-x>\n\x1b[31mred\nno\nfine 2'
    assert _quote_lines(schema.Candidate("a", "", True, log)) == ["ok line", "fine 2"]
