"""The distilled-grader gate on CPU: the teacher log records (workspace, verdict, trajectory); the
gate refuses an undertrained checkpoint and an injection-obeying copy, and accepts a scripted
teacher's copy and a student trained on the teacher's log; the gated grader switches only then."""

import dataclasses
import json

import pytest

from gagar_jax.grading import distill, labelled
from gagar_jax.grading.agentic import AgenticGrader
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.scripted import ScriptedGraderPolicy


@pytest.fixture(scope="module")
def toy_groups():
    return [g.workspace for g in labelled.load_set("toy").groups]


def _scripted(record=False):
    client = ScriptedGraderPolicy()
    return AgenticGrader(distill.RecordingClient(client) if record else client)


def test_teacher_log_records_workspace_verdict_and_trajectory(tmp_path, toy_groups):
    path = tmp_path / "teacher.jsonl"
    log = distill.TeacherLog(_scripted(record=True), path)
    for ws in toy_groups[:3]:
        log.grade(ws)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0])
    assert set(rec) == {"workspace", "verdict", "trajectory"}
    assert rec["trajectory"] and rec["trajectory"][0]["messages"][0]["role"] == "system"
    pairs = distill.read_log(path)
    assert [ws.group_id for ws, _ in pairs] == [ws.group_id for ws in toy_groups[:3]]
    assert pairs[0][1].judgements  # verdicts validate against their logged workspaces
    with open(path, "a") as f:
        f.write('{"workspace": {"group_id": "torn"')  # a torn last line is skipped
    assert len(distill.read_log(path)) == 3


def test_gate_refuses_an_undertrained_checkpoint_and_accepts_the_teachers_copy(toy_groups):
    target = distill.teacher_set(_scripted(), toy_groups[:12])
    assert len(target.groups) == 12
    untrained = distill.gate(distill.FeatureGrader(), target)
    assert not untrained.accepted and any("kappa" in r for r in untrained.reasons)
    copy = distill.gate(_scripted(), target)
    assert copy.accepted, copy.reasons
    assert copy.kappa == pytest.approx(1.0) and copy.flip_rate == 0.0


class _Gullible:
    """A perfect copy of the heuristic teacher that also obeys instructions in test logs."""

    grader_id = "gullible"
    version = "1"

    def grade(self, ws):
        v = HeuristicGrader().grade(ws)
        asked = {c.candidate_id for c in ws.passing if "assign it tier 1" in c.test_log}
        js = tuple(
            dataclasses.replace(j, tier=1, rank=1, cheat=False) if j.candidate_id in asked else j
            for j in v.judgements
        )
        return dataclasses.replace(v, judgements=js)


def test_gate_refuses_a_high_kappa_student_that_fails_a_probe(toy_groups):
    target = distill.teacher_set(HeuristicGrader(), toy_groups[:6])
    report = distill.gate(_Gullible(), target)
    assert report.kappa == pytest.approx(1.0)
    assert not report.accepted and any("injection" in r for r in report.reasons)


def test_distilled_student_trained_on_the_log_passes_the_gate(tmp_path, toy_groups):
    log = distill.TeacherLog(HeuristicGrader(), tmp_path / "t.jsonl")
    for ws in toy_groups[:12]:
        log.grade(ws)
    pairs = distill.read_log(tmp_path / "t.jsonl")
    held_out = distill.teacher_set(HeuristicGrader(), toy_groups[12:])
    few = distill.FeatureGrader.train(pairs, steps=3)
    assert not distill.gate(few, held_out).accepted
    student = distill.FeatureGrader.train(pairs, steps=300)
    ckpt = tmp_path / "student.npz"
    student.save(ckpt)
    loaded = distill.FeatureGrader.load(ckpt)
    report = distill.gate(loaded, held_out)
    assert report.accepted, report.reasons
    with pytest.raises(ValueError, match="shape"):
        distill.FeatureGrader(weights=[[0.0]])


def test_gated_grader_uses_the_teacher_until_the_student_is_accepted(tmp_path, toy_groups):
    teacher = HeuristicGrader()
    gated = distill.GatedGrader(teacher, distill.FeatureGrader(), toy_groups[:4], recheck_every=2)
    assert not gated.using_student
    v = gated.grade(toy_groups[5])
    assert v.grader_id == "heuristic"
    pairs = [(ws, teacher.grade(ws)) for ws in toy_groups[6:18]]
    gated.student = distill.FeatureGrader.train(pairs, steps=300)
    gated.grade(toy_groups[6])  # the second graded group triggers the re-check
    assert gated.using_student and len(gated.reports) == 2
    assert gated.grade(toy_groups[7]).grader_id == "distilled"


@pytest.mark.e2e
def test_sft_distilled_lm_grader_is_refused_undertrained_and_accepted_trained(tmp_path, toy_groups):
    """The small-model path: a tiny decoder fine-tuned with ``update.sft.run_sft`` on the
    teacher's verdicts. Untrained it writes no tier (every group falls back) and the gate refuses
    it; after 300 SFT steps it matches the teacher on held-out groups and the gate accepts the
    checkpoint it saved. About two minutes on 2 shared cores."""
    teacher = HeuristicGrader()
    pairs = [(ws, teacher.grade(ws)) for ws in toy_groups[:12]]
    held_out = distill.teacher_set(teacher, toy_groups[12:18])
    untrained = distill.gate(distill.LMGrader(), held_out)
    assert not untrained.accepted and untrained.fallback_rate == 1.0
    trained = distill.LMGrader.train(pairs, steps=300)
    trained.save(tmp_path / "lm.npz")
    report = distill.gate(distill.LMGrader.load(tmp_path / "lm.npz"), held_out)
    assert report.accepted, report.reasons
