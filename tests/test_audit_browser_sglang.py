"""The task auditor and the browser judge's LLM planner against a REAL SGLang server.

The session's tiny random model cannot follow either protocol: both must fail safe. The auditor's
votes fall back (no verdict on the task, counted), the planner's plan is re-asked and falls back
(the description-only item is left out of the score, the rule-checked item still counts: never a
score of 0 for the page).
"""

from __future__ import annotations

import os

import pytest

from gagar_jax.data import audit as A
from gagar_jax.rollout import sglang_server

pytestmark = [
    pytest.mark.xdist_group("sglang"),
    pytest.mark.sglang,
    pytest.mark.skipif(not sglang_server.sglang_python().exists(), reason="no SGLang venv"),
]

CAL = os.path.join(os.path.dirname(__file__), "fixtures", "browser_calibration")


def test_auditor_and_planner_fail_safe_on_a_real_server(sglang_client):
    from gagar_jax.envs.repo import RepoTask

    task = RepoTask(
        "t",
        "add(2, 3) must be 5",
        {
            "calc.py": "def add(a, b):\n    return a - b\n",
            "test_calc.py": "from calc import add\n\n\ndef test_add():\n"
            "    assert add(2, 3) == 5\n",
        },
        ("test_calc.py::test_add",),
        reference_patch="",
    )
    auditor = A.TaskAuditor(sglang_client, votes=2, max_steps=2, max_tokens=16, temperature=1.0)
    audit = auditor.audit(task)
    print("\nauditor metrics:", dict(auditor.metrics), "client:", dict(sglang_client.metrics))
    assert audit.vote is None and audit.fallbacks == 2 and len(audit.reasons) == 2
    assert sglang_client.metrics["chat_requests"] >= 2
    kept, _ = A.filter_tasks([A.PoolEntry(task, audit=audit)], {"max_test_validity": 0})
    assert len(kept) == 1  # a fallback audit is no verdict on the task

    from gagar_jax.verify import browser as B
    from gagar_jax.verify.browser_llm import BrowserLLMPlanner

    if not os.path.exists(B.DEFAULT_EXECUTABLE):
        pytest.skip("chromium is not installed")
    planner = BrowserLLMPlanner(sglang_client, max_attempts=2, max_tokens=32, temperature=1.0)
    rubric = {
        "items": [
            {
                "id": "renders",
                "expect": [{"count": {"role": "button", "name": "Add item"}, "equals": 1}],
            },
            {"id": "adds", "description": 'typing "milk" and adding it lists it'},
        ]
    }
    with B.BrowserJudge(planner=planner, load_timeout_s=5) as judge:
        v = judge.judge(os.path.join(CAL, "todo_ok"), rubric)
    print("planner metrics:", dict(planner.metrics), "rejections:", v.plan.rejections)
    assert v.status == "ok" and v.score == 1.0
    assert v.plan.source["adds"] == "unplanned" and v.items[1].passed is None
    assert planner.metrics["fallback"] == 1 and planner.metrics["calls"] >= 1
