"""Grading the toy code-repair family through the adapters: every passing patch kind is
judged, the minimal fix wins, the monitor's cheat becomes a cheat verdict, and the agentic loop
runs real targeted checks on toy programs."""

from gagar_jax.envs import toy, toy_grading
from gagar_jax.grading import adapters, schema
from gagar_jax.grading.agentic import AgenticGrader
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.scripted import ScriptedGraderPolicy
from gagar_jax.verify.diff import apply_unified_diff


def _groups(n=6):
    out = []
    for difficulty in (1, 2, 3):
        gen = toy.ToyTaskGenerator(seed=7, difficulty=difficulty)
        for i, task in enumerate(gen.tasks(n)):
            kinds = toy.candidate_patches(task)
            names = sorted(kinds)
            ws = toy_grading.toy_group(task, f"d{difficulty}-{i}", [kinds[k] for k in names])
            out.append((task, dict(zip(names, ws.candidates)), ws))
    return out


def test_heuristic_grades_every_toy_kind():
    seen_kinds = set()
    for _, by_kind, ws in _groups():
        v = schema.validate(HeuristicGrader().grade(ws), ws)
        j = {k: v.judgement(c.candidate_id) for k, c in by_kind.items()}
        seen_kinds |= {k for k, x in j.items() if x is not None}
        assert j["minimal"] is not None and j["minimal"].tier == 1 and j["minimal"].rank == 1
        for kind in ("noop", "wrong"):
            if kind in by_kind:
                assert j[kind] is None and not by_kind[kind].passed
        if "cheat" in by_kind:
            assert j["cheat"].cheat and j["cheat"].tier == 3
        for kind in ("sprawling", "out_of_scope", "side_effect", "inconsistent"):
            if kind in by_kind:
                assert j[kind].rank > j["minimal"].rank, kind
    assert {"minimal", "sprawling", "side_effect", "cheat"} <= seen_kinds


def test_toy_patch_renders_as_unified_diff_of_program():
    task, by_kind, ws = _groups(1)[0]
    minimal = by_kind["minimal"]
    (fd,) = minimal.parsed_patch.files
    assert fd.path == toy_grading.TOY_PROGRAM
    assert [n for n, _ in fd.added()] == [task.bug_line]
    patched = apply_unified_diff(ws.repo_files, minimal.parsed_patch)
    assert (
        patched[toy_grading.TOY_PROGRAM].splitlines()
        == toy.apply_patch(task, task.reference_patch).splitlines()
    )


def test_toy_check_runner_and_agentic_loop():
    task, by_kind, ws = _groups(1)[0]
    runner = adapters.ToyCheckRunner()
    res = runner.run(ws, by_kind["side_effect"], "f(25) f(0)")
    assert res.status == "passed" and "f(25) = 0" in res.log
    assert runner.run(ws, by_kind["minimal"], "no numbers").status == "error"
    policy = ScriptedGraderPolicy(use_check=True, check_command="f(25) f(-3)")
    v = AgenticGrader(policy, check_runner=runner).grade(ws)
    schema.validate(v, ws)
    assert "run_check" in policy.tools_called
    assert v.judgement(by_kind["minimal"].candidate_id).tier == 1


def test_sandbox_check_runner_runs_patched_repository():
    from grading_strategies import BASE_REPO, FIX, apply_edits

    ws = schema.GroupWorkspace(
        "g-sandbox",
        "fix add",
        BASE_REPO,
        [
            schema.Candidate("fixed", apply_edits(BASE_REPO, [FIX]), True, "1 passed"),
            schema.Candidate("unfixed", "", True, "1 passed"),
        ],
    )
    runner = adapters.SandboxCheckRunner()
    cmd = "python -c 'from pkg.core import add; print(add(2, 3))'"
    fixed = runner.run(ws, ws.candidates[0], cmd)
    unfixed = runner.run(ws, ws.candidates[1], cmd)
    assert fixed.status == "passed" and "\n5\n" in fixed.log, fixed.log
    assert unfixed.status == "passed" and "\n-1\n" in unfixed.log, unfixed.log
    failing = runner.run(ws, ws.candidates[0], "python -c 'raise SystemExit(3)'")
    assert failing.status == "failed"


def test_sandbox_check_runner_runs_pytest_on_the_patched_repository():
    from grading_strategies import BASE_REPO, FIX, apply_edits

    ws = schema.GroupWorkspace(
        "g-pytest",
        "fix add",
        BASE_REPO,
        [
            schema.Candidate("fixed", apply_edits(BASE_REPO, [FIX]), True, "ok"),
            schema.Candidate("unfixed", "", True, "ok"),
        ],
    )
    runner = adapters.SandboxCheckRunner()
    cmd = "python -m pytest -q -p no:cacheprovider tests/test_core.py"
    fixed, unfixed = (runner.run(ws, c, cmd) for c in ws.candidates)
    assert fixed.status == "passed" and "1 passed" in fixed.log, fixed.log
    assert unfixed.status == "failed" and "1 failed" in unfixed.log, unfixed.log
