"""The task factory's LLM-written issue against a REAL SGLang server (the tiny random model).

The random model writes garbage; whatever it returns is either accepted after the leak check
(and then is the row's issue, ``llm@...``) or refused, and the template writes the issue
(``template@...``, counted). Uses the shared session server of ``tests/sglang_fixtures.py``.
"""

from __future__ import annotations

import json

from sglang_fixtures import SGLANG

from gagar_jax.data import swe, synth

pytestmark = SGLANG


def test_llm_issue_on_a_real_server_is_checked_or_falls_back(sglang_server):
    from test_data_synth import LLM_F2P, LLM_LOG, _llm_task

    task, template = _llm_task()
    writer = synth.IssueWriter(sglang_server.url, max_tokens=48, temperature=1.0)
    text, source = writer.write(
        "pkg",
        LLM_F2P,
        LLM_LOG,
        template=template,
        accept=lambda t: not synth.issue_leaks(task, t),
    )
    print("\nissue writer metrics:", dict(writer.metrics), "source:", source)
    assert writer.client.metrics["chat_requests"] == 1  # the server answered
    assert writer.metrics["calls"] == 1
    assert writer.metrics["accepted"] + writer.metrics["fallbacks"] == 1
    if source == writer.source:
        assert text.strip() and len(text) <= synth.MAX_LLM_ISSUE_CHARS + 1
        assert not synth.issue_leaks(task, text)
    else:
        assert source == synth.template_source() and text == template
        assert writer.metrics["fallbacks"] == 1
        assert sum(n for k, n in writer.metrics.items() if k.startswith("fallback_")) == 1
    # the row the factory would write is well-formed whichever wrote the issue
    row = swe.SweInstance(
        "pypi__pkg.0001", "pypi/pkg", "0" * 40, task.reference_patch, "", text, LLM_F2P, ()
    ).to_row() | {"synth": {"issue_source": source}}
    back = swe.parse_instance(json.loads(json.dumps(row)), "the row")
    assert back.problem_statement == text and back.FAIL_TO_PASS == LLM_F2P
