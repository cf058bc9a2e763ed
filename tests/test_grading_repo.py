"""Grading real Python-repository patches (git diffs of the fixture repositories), verified
in the sandbox: the minimal fix ranks first, sprawl is penalised with cited files, the monitor's
confirmed test edit becomes a cheat; the agentic loop runs pytest in the sandbox as a check."""

import pathlib

import pytest

from gagar_jax.envs import repo as envs_repo
from gagar_jax.grading import adapters, schema
from gagar_jax.grading.agentic import AgenticGrader
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.scripted import ScriptedGraderPolicy

ROOT = pathlib.Path(__file__).parent / "fixtures" / "repos" / "statkit"
KINDS = ("sprawling", "minimal", "edit_tests_with_fix", "edit_tests")


@pytest.fixture(scope="module")
def statkit():
    task = envs_repo.RepoTask.from_dir(ROOT)
    patches = [(ROOT / "patches" / f"{k}.diff").read_text() for k in KINDS]
    ws = envs_repo.repo_group(task, "statkit", patches)
    return ws, dict(zip(KINDS, ws.candidates))


def test_heuristic_on_verified_repository_patches(statkit):
    ws, by_kind = statkit
    assert [by_kind[k].passed for k in KINDS] == [True, True, True, False]
    v = schema.validate(HeuristicGrader().grade(ws), ws)
    j = {k: v.judgement(c.candidate_id) for k, c in by_kind.items()}
    assert j["edit_tests"] is None  # failed: background only
    assert j["minimal"].tier == 1 and j["minimal"].rank == 1
    assert j["minimal"].rank < j["sprawling"].rank < j["edit_tests_with_fix"].rank
    cited = {e.file for e in j["sprawling"].evidence if e.claim == "side_effect_avoidance"}
    assert {"README.md", "statkit/__init__.py"} <= cited
    assert j["edit_tests_with_fix"].cheat and j["edit_tests_with_fix"].tier == 3
    _, _, graded, cheat = schema.to_arrays([schema.GradeResult.accepted(ws, v)], K=4)
    assert graded.all() and cheat.tolist() == [[False, False, True, True]]


def test_agentic_loop_with_sandboxed_pytest_check(statkit):
    ws, _ = statkit
    results = []

    class Recording(adapters.SandboxCheckRunner):
        def run(self, workspace, candidate, command):
            results.append(super().run(workspace, candidate, command))
            return results[-1]

    runner = Recording()
    policy = ScriptedGraderPolicy(
        use_check=True, check_command="python -m pytest -q -p no:cacheprovider"
    )
    v = AgenticGrader(policy, check_runner=runner).grade(ws)
    schema.validate(v, ws)
    assert "run_check" in policy.tools_called
    (res,) = results  # pytest really ran in the sandbox on the candidate's patched repository
    assert res.status in ("passed", "failed") and "passed" in res.log, res.log
