"""Agentic grader tool loop, driven by ScriptedGraderPolicy (a deterministic policy that reads only
the tool outputs), plus budgets, anonymisation, votes and the pool integration."""

import dataclasses
import json
import threading

import pytest
from grading_strategies import BASE_REPO, EXTRA_EDITS, FIX, apply_edits

from gagar_jax.grading import schema
from gagar_jax.grading.agentic import TOOL_NAMES, AgenticGrader, CheckResult, load_prompt
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.pool import GradingPool
from gagar_jax.grading.schema import FallbackReason, RejectReason, VerdictRejected
from gagar_jax.grading.scripted import ScriptedGraderPolicy

PRINT, TEST_EDIT, UTIL = EXTRA_EDITS[1], EXTRA_EDITS[2], EXTRA_EDITS[0]


def group(gid="g-agentic"):
    traj = [
        schema.TrajectoryEvent(0, "action", "open pkg/core.py", 20),
        schema.TrajectoryEvent(1, "observation", "def add(a, b): return a - b", 0),
    ]
    c = [
        schema.Candidate("alpha-minimal", apply_edits(BASE_REPO, [FIX]), True, "1 passed", traj),
        schema.Candidate("bravo-debug", apply_edits(BASE_REPO, [FIX, PRINT]), True, "1 passed"),
        schema.Candidate(
            "charlie-sprawl",
            apply_edits(BASE_REPO, [FIX, UTIL, TEST_EDIT, PRINT]),
            True,
            "1 passed",
        ),
        schema.Candidate("delta-failed", apply_edits(BASE_REPO, [PRINT]), False, "1 failed"),
    ]
    return schema.GroupWorkspace(
        gid, "Fix add() in pkg/core.py (alpha-minimal knows)", BASE_REPO, c
    )


class RecordingPolicy(ScriptedGraderPolicy):
    """The scripted policy, also keeping every conversation it was sent (to check anonymity)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sent = []

    def chat_completions(self, messages, **kw):
        self.sent.append(json.dumps(messages))
        return super().chat_completions(messages, **kw)


def test_tool_loop_produces_validated_verdict_with_real_ids():
    ws = group()
    policy = RecordingPolicy()
    grader = AgenticGrader(policy, max_steps=8)
    v = grader.grade(ws)
    schema.validate(v, ws)
    j = {x.candidate_id: x for x in v.judgements}
    assert set(j) == {"alpha-minimal", "bravo-debug", "charlie-sprawl"}
    assert j["alpha-minimal"].tier == 1 and j["alpha-minimal"].rank == 1
    assert j["alpha-minimal"].rank < j["bravo-debug"].rank < j["charlie-sprawl"].rank
    assert j["charlie-sprawl"].tier == 3
    (ev,) = j["charlie-sprawl"].evidence
    assert ev.kind == "patch" and ev.candidate_id == "charlie-sprawl"
    assert {
        "read_summaries",
        "show_diff",
        "read_test_log",
        "read_trajectory",
        "read_file",
        "submit_verdict",
    } <= set(policy.tools_called)
    assert v.grader_id == "agentic" and v.grader_version == "v2" and v.latency_s >= 0
    # Anonymity: no real id ever reached the model (the task text mentions one: it is replaced).
    for convo in policy.sent:
        for cid in ("alpha-minimal", "bravo-debug", "charlie-sprawl", "delta-failed"):
            assert cid not in convo
    assert grader.metrics["tool/submit_verdict"] == 1 and grader.metrics["accepted"] == 1


def test_shuffle_changes_aliases_not_the_verdict():
    ws = group()
    orders, verdicts = set(), []
    for seed in range(4):
        policy = RecordingPolicy()
        v = AgenticGrader(policy, seed=seed).grade(ws)
        verdicts.append({j.candidate_id: (j.tier, j.rank) for j in v.judgements})
        summaries = [m for m in json.loads(policy.sent[-1]) if m.get("tool_call_id") == "summaries"]
        cands = json.loads(summaries[0]["content"])["candidates"]
        orders.add(
            tuple(c["patch"]["added_lines"] + 10 * c["patch"]["removed_lines"] for c in cands)
        )
    assert len(orders) > 1  # the model saw different orders
    assert all(v == verdicts[0] for v in verdicts)  # a position-free policy gives one verdict


def test_rejected_submission_is_fed_back_and_repaired():
    ws = group()
    policy = RecordingPolicy(first_submission_error=True)
    grader = AgenticGrader(policy, max_steps=8)
    v = grader.grade(ws)
    assert schema.validate(v, ws) is not None
    assert policy.tools_called.count("submit_verdict") == 2
    assert "nonexistent_evidence" in policy.sent[-1]


def test_text_answer_without_tools():
    ws = group()
    v = AgenticGrader(ScriptedGraderPolicy(answer_as_text=True), use_tools=False).grade(ws)
    assert len(v.judgements) == 3


def test_step_budget_and_cancel_reject():
    ws = group()
    with pytest.raises(VerdictRejected) as err:
        AgenticGrader(ScriptedGraderPolicy(), max_steps=2).grade(ws)
    assert err.value.reason == RejectReason.BUDGET_EXHAUSTED
    # Repeatedly broken submissions: the last rejection's reason is reported.
    with pytest.raises(VerdictRejected) as err:
        AgenticGrader(ScriptedGraderPolicy(first_submission_error=True), max_steps=3).grade(ws)
    assert err.value.reason == RejectReason.NONEXISTENT_EVIDENCE
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(VerdictRejected):
        AgenticGrader(ScriptedGraderPolicy()).grade(ws, cancel=cancel)


class RecordingCheckRunner:
    """A real (trivial) check runner: reports which files the candidate's patch touches."""

    def __init__(self):
        self.ran = []

    def run(self, workspace, candidate, command):
        self.ran.append((candidate.candidate_id, command))
        files = ", ".join(candidate.parsed_patch.paths)
        return CheckResult("passed", f"$ {command}\nchecked files: {files}\nOK")


def test_run_check_output_counts_as_execution_evidence():
    ws = group()
    runner = RecordingCheckRunner()
    policy = ScriptedGraderPolicy(use_check=True)
    v = AgenticGrader(policy, check_runner=runner).grade(ws)
    assert len(runner.ran) == 1 and "run_check" in policy.tools_called
    # Evidence quoting the check's output validates only when that check log is supplied.
    cid = runner.ran[0][0]
    obj = schema.verdict_to_dict(v)
    for item in obj["verdicts"]:
        if item["candidate"] == cid:
            item["scores"]["solution_fit"] = 0.2
            item["evidence"].append(
                {
                    "claim": "solution_fit",
                    "kind": "execution",
                    "candidate": cid,
                    "quote": "checked files",
                }
            )
    with pytest.raises(VerdictRejected, match="nonexistent_evidence"):
        schema.parse_verdict(obj, ws, grader_id="a", grader_version="1")
    ok = schema.parse_verdict(
        obj,
        ws,
        grader_id="a",
        grader_version="1",
        check_logs={cid: ["$ x\nchecked files: pkg/core.py\nOK"]},
    )
    assert ok.judgement(cid).scores["solution_fit"] == 0.2


def test_self_consistency_votes_report_agreement():
    ws = group()
    v = AgenticGrader(ScriptedGraderPolicy(), votes=3).grade(ws)
    assert v.votes == 3 and v.agreement == 1.0
    schema.validate(v, ws)


def test_malformed_responses_and_tool_calls_do_not_crash():
    class BrokenPolicy:
        """Emits malformed responses and tool calls of every kind, never a verdict."""

        def __init__(self):
            self.k = 0

        def chat_completions(self, messages, **kw):
            self.k += 1
            bad = [
                {},
                {"choices": []},
                {"choices": [{"message": "text"}]},
                {"choices": [{"message": {"content": None, "tool_calls": "nope"}}]},
                {"choices": [{"message": {"tool_calls": [{"function": {"name": "rm -rf"}}]}}]},
                {
                    "choices": [
                        {
                            "message": {
                                "tool_calls": [
                                    {
                                        "id": "x",
                                        "function": {"name": "read_file", "arguments": "{bad json"},
                                    },
                                    {
                                        "id": "y",
                                        "function": {
                                            "name": "read_file",
                                            "arguments": '{"path": "/etc/passwd"}',
                                        },
                                    },
                                    {
                                        "id": "z",
                                        "function": {
                                            "name": "show_diff",
                                            "arguments": '{"candidate": 7}',
                                        },
                                    },
                                    {
                                        "id": "w",
                                        "function": {
                                            "name": "read_trajectory",
                                            "arguments": '{"candidate": "C1", "start": "a"}',
                                        },
                                    },
                                ]
                            }
                        }
                    ]
                },
                {"choices": [{"message": {"content": '{"verdicts": [{"candidate": "C9"}]}'}}]},
            ]
            return bad[(self.k - 1) % len(bad)]

    ws = group()
    grader = AgenticGrader(BrokenPolicy(), max_steps=7)
    with pytest.raises(VerdictRejected) as err:
        grader.grade(ws)
    assert err.value.reason == RejectReason.MALFORMED
    assert grader.metrics["bad_tool_calls"] >= 4


def test_agentic_grader_in_pool():
    groups = [group(f"g{i}") for i in range(3)]
    with GradingPool(
        AgenticGrader(ScriptedGraderPolicy()), max_concurrency=2, deadline_s=30
    ) as pool:
        for ws in groups:
            pool.submit(ws)
        res = pool.results([ws.group_id for ws in groups], timeout=30)
    assert all(r.verdict is not None for r in res)
    with GradingPool(AgenticGrader(ScriptedGraderPolicy(), votes=3), deadline_s=30) as pool:
        pool.submit(groups[0])
        pool.results([groups[0].group_id], timeout=30)
        m = pool.metrics()
        assert m["voted_groups"] == 1 and m["vote_agreement_mean"] == 1.0
    with GradingPool(AgenticGrader(ScriptedGraderPolicy(), max_steps=1), deadline_s=30) as pool:
        pool.submit(groups[0])
        (r,) = pool.results([groups[0].group_id], timeout=30)
        assert r.fallback_reason == FallbackReason.BUDGET_EXHAUSTED
        assert pool.metrics()["fallback/budget_exhausted"] == 1


def test_prompts_are_versioned_package_files():
    assert "submit_verdict" in load_prompt("system", "v1")
    assert "$verdict_example" in load_prompt("task", "v1")
    with pytest.raises(FileNotFoundError, match="v999"):
        load_prompt("system", "v999")
    assert set(TOOL_NAMES) == {
        "read_summaries",
        "read_trajectory",
        "read_file",
        "show_diff",
        "read_test_log",
        "run_check",
        "submit_verdict",
    }


def _vote(ws, tiers_ranks, cheat_for=None):
    fix_line = ws.candidate("alpha-minimal").parsed_patch.files[0].added()[0][0]
    js = []
    for cid, (tier, rank) in tiers_ranks.items():
        ev = (schema.Evidence("minimality", "patch", cid, file="pkg/core.py", line=fix_line),)
        scores = {d: 1.0 for d in schema.DIMENSIONS} | ({"minimality": 0.3} if tier > 1 else {})
        cheat = cid == cheat_for
        if cheat:
            ev += (schema.Evidence("cheat", "execution", cid, quote="1 passed"),)
        js.append(schema.Judgement(cid, tier, rank, scores, cheat, "leak" if cheat else "", ev))
    return schema.validate(schema.Verdict(ws.group_id, tuple(js), "agentic", "v1"), ws)


def test_merge_votes_majority_ties_and_agreement():
    from gagar_jax.grading.agentic import merge_votes

    ws = group()
    a, b, c = "alpha-minimal", "bravo-debug", "charlie-sprawl"
    votes = [
        _vote(ws, {a: (1, 1), b: (2, 2), c: (3, 3)}, cheat_for=c),
        _vote(ws, {a: (1, 1), b: (1, 1), c: (3, 2)}, cheat_for=c),
        _vote(ws, {a: (1, 1), b: (2, 2), c: (2, 2)}),
    ]
    v = merge_votes(votes, ws, latency_s=1.0)
    j = {x.candidate_id: x for x in v.judgements}
    assert (j[a].tier, j[b].tier, j[c].tier) == (1, 2, 3)  # majorities
    assert j[c].cheat and "leak" in j[c].cheat_reason  # 2 of 3 votes
    assert j[a].rank < j[b].rank < j[c].rank
    assert v.votes == 3 and v.agreement == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    # A 1-1 split goes to the worse tier.
    two = merge_votes(votes[1:], ws, latency_s=0.0)
    assert {x.candidate_id: x.tier for x in two.judgements}[b] == 2


class FlakyPolicy(ScriptedGraderPolicy):
    """The scripted policy, but answering prose whenever sampled with temperature > 0."""

    def chat_completions(self, messages, **kw):
        if kw.get("temperature", 0.0) > 0:
            return {"choices": [{"message": {"role": "assistant", "content": "looks fine to me"}}]}
        return super().chat_completions(messages, **kw)


def test_too_few_accepted_votes_reject_the_group():
    ws = group()
    with pytest.raises(VerdictRejected) as err:
        AgenticGrader(FlakyPolicy(), votes=3, max_steps=6, vote_temperature=0.7).grade(ws)
    assert err.value.reason == RejectReason.MALFORMED and "1/3 votes" in err.value.detail
    v = AgenticGrader(FlakyPolicy(), votes=3, min_votes=1, max_steps=6, vote_temperature=0.7).grade(
        ws
    )
    assert v.votes == 1 and v.agreement == 1.0


def test_real_ids_are_not_accepted_from_an_anonymised_grader():
    from gagar_jax.grading.agentic import AnonymisedView

    ws = group()
    view = AnonymisedView(ws, seed=0)
    good = HeuristicGrader().grade(ws)
    obj = schema.verdict_to_dict(good)  # real ids: what a model could only guess
    with pytest.raises(VerdictRejected) as err:
        schema.parse_verdict(obj, ws, grader_id="a", grader_version="1", id_map=view.real_of)
    assert err.value.reason == RejectReason.EXTRA_CANDIDATE
    for item in obj["verdicts"]:  # the same verdict in aliases is accepted and mapped back
        item["candidate"] = view.alias_of[item["candidate"]]
        for ev in item["evidence"]:
            ev["candidate"] = view.alias_of[ev["candidate"]]
    v = schema.parse_verdict(obj, ws, grader_id="a", grader_version="1", id_map=view.real_of)
    assert {j.candidate_id for j in v.judgements} == {j.candidate_id for j in good.judgements}


def test_a_permuted_group_gives_the_model_the_same_prompt():
    """The anonymising shuffle starts from a content order: whatever the slot order, every
    vote's prompt is the same text, so position bias cannot flip a verdict."""
    from gagar_jax.grading import labelled
    from gagar_jax.grading.agentic import AnonymisedView

    class Recorder:
        def __init__(self):
            self.prompts = []

        def chat_completions(self, messages, **kw):
            self.prompts.append(messages[1]["content"])
            return {"choices": [{"message": {"role": "assistant", "content": "no verdict"}}]}

    ws = labelled.load_set("toy").groups[0].workspace
    permuted = dataclasses.replace(ws, candidates=tuple(reversed(ws.candidates)))
    rec = Recorder()
    grader = AgenticGrader(rec, votes=2, min_votes=1, max_steps=1)
    for w in (ws, permuted):
        with pytest.raises(VerdictRejected):
            grader.grade(w)
    assert len(rec.prompts) == 4 and rec.prompts[:2] == rec.prompts[2:]
    assert rec.prompts[0] != rec.prompts[1]  # votes still see different shuffles
    # Another grader instance has another secret: the untrusted-content markers differ.
    other = Recorder()
    with pytest.raises(VerdictRejected):
        AgenticGrader(other, votes=1, max_steps=1).grade(ws)
    assert other.prompts[0] != rec.prompts[0]
    a, b = AnonymisedView(ws, 3), AnonymisedView(permuted, 3)
    assert a.alias_of == b.alias_of
