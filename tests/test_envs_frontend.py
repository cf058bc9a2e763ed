"""The ``frontend`` family and the browser grader, with a real Chromium (one per module)."""

import json
import os

import playwright  # noqa: F401
import pytest

from gagar_jax.envs.family import Attempt, FamilySettings, GroupMember, make_family
from gagar_jax.envs.frontend import TEMPLATES, FrontendTask, generated_tasks, make_task
from gagar_jax.grading.browser import BrowserGrader, tier_of
from gagar_jax.grading.pool import GradingPool
from gagar_jax.grading.schema import FallbackReason
from gagar_jax.verify import browser as B

if not os.path.exists(B.DEFAULT_EXECUTABLE):
    pytest.skip("chromium is not installed (make system-deps)", allow_module_level=True)

pytestmark = pytest.mark.browser

JUDGE = {
    "load_timeout_s": 3,
    "call_timeout_s": 2.5,
    "expect_timeout_ms": 300,
    "action_timeout_ms": 1000,
}


@pytest.fixture(scope="module")
def family():
    fam = make_family(
        "frontend", FamilySettings(num_train=6, num_eval=3, extra={"judge_kwargs": JUDGE})
    )
    yield fam
    pids = fam.runner.judge.browser_pids
    fam.close()
    assert B.alive(pids) == ()


def _call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_generated_tasks_are_seeded_and_valid():
    a, b = generated_tasks(6, seed=3), generated_tasks(6, seed=3)
    assert a == b and {t.task_id.split("-")[1] for t in a} == set(TEMPLATES)
    assert generated_tasks(3, seed=4) != generated_tasks(3, seed=3)
    t = a[0]
    assert FrontendTask.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(ValueError, match="template"):
        make_task("carousel", 0)


@pytest.mark.parametrize("template", TEMPLATES)
def test_start_page_fails_and_solution_passes(family, template):
    task = make_task(template, 0)
    start = family.verify_files(task, task.files)
    solved = family.verify_files(task, task.solution)
    assert not start.passed and not start.infra_error, start.test_log
    assert start.quality["checklist_pass_rate"] < 0.5
    assert solved.passed and solved.quality["checklist_pass_rate"] == 1.0, solved.test_log
    assert "PASS" in solved.test_log and "FAIL" in start.test_log


def test_episode_edits_html_through_the_code_agent_tools(family):
    task = family.train_task(1)  # a to-do task
    env = family.make_env(task)
    assert "FAIL" in env.step(_call("run_tests")).observation
    env.step(_call("edit", path="index.html", content=task.solution["index.html"]))
    assert env.step(_call("run_tests")).observation.startswith("tests passed")
    assert env.step(_call("submit")).done
    out = family.verify(task, Attempt(env=env))
    assert out.passed and out.patch.startswith("--- a/index.html")
    unsubmitted = family.make_env(task)
    assert not family.verify(task, Attempt(env=unsubmitted)).passed


def test_browser_grader_tiers_through_the_pool(family):
    task = make_task("todo", 0)
    html = task.solution["index.html"]
    no_enter = html.replace("if (e.key === 'Enter') add();", "")
    assert no_enter != html
    members = []
    for cid, page in (("r0", html), ("r1", {"index.html": no_enter}), ("r2", task.files)):
        files = page if isinstance(page, dict) else {"index.html": page}
        members.append(GroupMember(cid, Attempt(), family.verify_files(task, files)))
    assert [m.outcome.passed for m in members] == [True, True, False]
    ws = family.workspace("g0", task, members)
    grader = family.grader()
    with GradingPool(grader, max_concurrency=1, deadline_s=120) as pool:
        pool.submit(ws)
        (res,) = pool.results(["g0"])
    assert res.verdict is not None, res.detail
    tiers = {j.candidate_id: (j.tier, j.rank) for j in res.verdict.judgements}
    assert tiers == {"r0": (1, 1), "r1": (3, 2)}  # 1/2 items (< 0.75) -> T3
    ev = res.verdict.judgement("r1").evidence[0]
    assert ev.kind == "execution" and ev.quote.startswith("FAIL adds_by_enter")
    assert grader.metrics["judged"] == 2


def test_browser_grader_infra_error_is_a_counted_pool_fallback(family, tmp_path):
    task = make_task("counter", 0)
    members = [GroupMember("r0", Attempt(), family.verify_files(task, task.solution))]
    ws = family.workspace("g1", task, members)
    dead = B.BrowserJudge(executable_path=str(tmp_path / "no-chromium"), **JUDGE)
    grader = BrowserGrader(dead, lambda w: task.rubric)
    with GradingPool(grader, max_concurrency=1, deadline_s=60) as pool:
        pool.submit(ws)
        (res,) = pool.results(["g1"])
        metrics = pool.metrics()
    assert res.verdict is None and res.fallback_reason == FallbackReason.GRADER_ERROR
    assert grader.metrics["infra_error"] == 1 and metrics["fallback/grader_error"] == 1


def test_tier_of():
    assert [tier_of(r) for r in (1.0, 0.99, 0.75, 0.5, 0.0)] == [1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="tier_thresholds"):
        BrowserGrader(None, lambda w: None, tier_thresholds=(0.5, 0.9))


def test_prompt_through_the_chat_template(family, tmp_path):
    from hf_fixtures import make_tiny_tokenizer

    fam = make_family(
        "frontend",
        FamilySettings(
            num_train=3,
            num_eval=0,
            max_prompt_len=4096,
            tokenizer_path=make_tiny_tokenizer(tmp_path / "tok"),
        ),
    )
    task = fam.train_task(0)
    text = fam.tokenizer.decode(fam.prompt_tokens(task), skip_special_tokens=False)
    assert task.instruction in text and '"name": "edit"' in text
    with pytest.raises(ValueError, match="tokenizer"):
        _ = make_family("frontend", FamilySettings(num_train=1, num_eval=0)).tokenizer
