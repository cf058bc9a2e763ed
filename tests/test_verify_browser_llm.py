"""The browser judge's LLM planner and judge: validation, re-ask, fallback (real Chromium).

The model is ``ScriptedBrowserPolicy`` (a deterministic chat policy reading only the prompt);
the page, the browser and the validation against the page are real.
"""

import os

import playwright  # noqa: F401
import pytest

from gagar_jax.verify import browser as B
from gagar_jax.verify.browser_llm import (
    BrowserLLMJudge,
    BrowserLLMPlanner,
    OutputRejected,
    ScriptedBrowserPolicy,
    first_json_object,
)

if not os.path.exists(B.DEFAULT_EXECUTABLE):
    pytest.skip("chromium is not installed (make system-deps)", allow_module_level=True)

pytestmark = pytest.mark.browser

CAL = os.path.join(os.path.dirname(__file__), "fixtures", "browser_calibration")
RUBRIC = {
    "items": [
        {
            "id": "renders_form",
            "expect": [{"count": {"role": "button", "name": "Add item"}, "equals": 1}],
        },
        {"id": "adds_milk", "description": 'typing "milk" and adding it shows it in the list'},
    ]
}


@pytest.fixture(scope="module")
def judge():
    with B.BrowserJudge(
        keep_browser=True,
        load_timeout_s=3,
        call_timeout_s=2.5,
        expect_timeout_ms=300,
        action_timeout_ms=1000,
    ) as j:
        yield j


def _run(judge, page, *, planner=None, llm_judge=None, rubric=RUBRIC):
    judge.planner, judge.llm_judge = planner, llm_judge
    try:
        return judge.judge(os.path.join(CAL, page), rubric)
    finally:
        judge.planner = judge.llm_judge = None


def test_planner_plans_description_items_against_the_real_page(judge):
    planner = BrowserLLMPlanner(ScriptedBrowserPolicy("good"))
    ok = _run(judge, "todo_ok", planner=planner)
    assert ok.status == "ok" and ok.score == 1.0
    assert ok.plan.source == {"renders_form": "rubric", "adds_milk": "llm"}
    assert [s.action.kind for s in ok.plan.steps] == ["fill", "click"]
    assert all(s.in_snapshot for s in ok.plan.steps)
    dead = _run(judge, "todo_dead_button", planner=planner)
    assert dead.score == 0.5 and dead.items[1].passed is False


def test_malformed_plan_is_reasked_then_accepted(judge):
    planner = BrowserLLMPlanner(ScriptedBrowserPolicy("garbage_first"))
    v = _run(judge, "todo_ok", planner=planner)
    assert v.score == 1.0 and len(v.plan.rejections) == 1
    assert "no JSON object" in v.plan.rejections[0]
    assert planner.metrics["rejected"] == 1 and planner.metrics["accepted"] == 1


def test_hallucinated_target_is_rejected_and_falls_back_never_zero(judge):
    planner = BrowserLLMPlanner(ScriptedBrowserPolicy("hallucinate"), max_attempts=2)
    v = _run(judge, "todo_ok", planner=planner)
    assert len(v.plan.rejections) == 2 and "not on the page" in v.plan.rejections[0]
    assert v.plan.source["adds_milk"] == "unplanned"
    assert v.items[1].passed is None  # left out of the score, not failed
    assert v.status == "ok" and v.score == 1.0
    assert planner.metrics["fallback"] == 1 and judge.metrics["planner/fallback"] >= 1


def test_nothing_judgeable_is_infra_error_not_zero(judge):
    rubric = {"items": [RUBRIC["items"][1]]}
    v = _run(
        judge, "todo_ok", planner=BrowserLLMPlanner(ScriptedBrowserPolicy("garbage")), rubric=rubric
    )
    assert v.status == "infra_error" and v.items[0].passed is None


def test_dead_server_falls_back(judge):
    class Down:
        def chat_completions(self, *a, **k):
            raise ConnectionError("connection refused")

    planner = BrowserLLMPlanner(Down())
    v = _run(judge, "todo_ok", planner=planner)
    assert v.status == "ok" and v.score == 1.0 and planner.metrics["client_errors"] == 1


def test_llm_judge_grounded_pass_and_no_lift(judge):
    llm = BrowserLLMJudge(ScriptedBrowserPolicy("good"))
    rubric = {
        "items": [
            RUBRIC["items"][0],
            {
                "id": "adds_item",
                "description": "adds milk",
                "actions": [
                    {"fill": {"role": "textbox", "name": "New item"}, "text": "milk"},
                    {"click": {"role": "button", "name": "Add item"}},
                ],
                "expect": [{"count": {"css": "#list li"}, "equals": 1}],
            },
        ]
    }
    ok = _run(judge, "todo_ok", llm_judge=llm, rubric=rubric)
    assert ok.score == 1.0 and all(i.judged_by == "rules+llm" for i in ok.items)
    assert all(f.aria for f in ok.frames)  # runtime text recorded for the judge
    # the LLM is asked to pass the dead page's failing item: it cannot lift a rule failure
    llm_yes = BrowserLLMJudge(ScriptedBrowserPolicy("good"))
    dead = _run(judge, "todo_static_text", llm_judge=llm_yes, rubric=rubric)
    assert dead.items[1].passed is False


def test_ungrounded_llm_pass_is_rejected_and_rules_stand(judge):
    llm = BrowserLLMJudge(ScriptedBrowserPolicy("ungrounded"))
    v = _run(
        judge,
        "todo_dead_button",
        llm_judge=llm,
        rubric={
            "items": [
                RUBRIC["items"][0],
                {
                    "id": "adds",
                    "actions": [{"click": {"role": "button", "name": "Add item"}}],
                    "expect": [{"count": {"css": "#list li"}, "equals": 1}],
                },
            ]
        },
    )
    assert "llm judge fallback" in v.detail and "not in frame" in v.detail
    assert [i.passed for i in v.items] == [True, False] and v.score == 0.5
    assert llm.metrics["fallback"] == 1


@pytest.mark.parametrize("text", ["", "no json here", "{not json", "[1, 2]", "x" * 200_001])
def test_first_json_object_rejects(text):
    with pytest.raises(OutputRejected):
        first_json_object(text)


def test_first_json_object_reads_fenced_and_bare():
    assert first_json_object('blah ```json\n{"a": 1}\n``` blah') == {"a": 1}
    assert first_json_object('pre {"items": []} post') == {"items": []}
