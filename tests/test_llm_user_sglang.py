"""The LLM simulated user against a REAL SGLang server (the session's tiny random model).

The random model cannot write the feedback schema, so the user must fail safe: its answers are
rejected by name, re-asked once, and the rule-based user answers (counted); whatever comes back
is a valid span. Uses the shared session server of ``tests/sglang_fixtures.py``.
"""

from __future__ import annotations

import pytest

from gagar_jax.rollout import sglang_server

pytestmark = [
    pytest.mark.xdist_group("sglang"),
    pytest.mark.sglang,
    pytest.mark.skipif(not sglang_server.sglang_python().exists(), reason="no SGLang venv"),
]


def test_llm_user_fails_safe_on_a_real_server(sglang_client):
    from test_llm_user import RESPONSE, RULE, TASK, TOK, _check_items

    from gagar_jax.envs.llm_user import LLMUser

    user = LLMUser(sglang_client, max_tokens=32, temperature=1.0)
    items = user(TASK, RESPONSE, tokenizer=TOK)
    print("\nllm user metrics:", dict(user.metrics), "client:", dict(sglang_client.metrics))
    assert sglang_client.metrics["chat_requests"] >= 1
    assert user.metrics["accepted"] + user.metrics["fallback"] == 1
    if user.metrics["fallback"]:
        assert items == RULE and user.metrics["rejected"] >= 1
    _check_items(items)
