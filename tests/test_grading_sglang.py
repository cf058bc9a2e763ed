"""The agentic grader against a REAL SGLang server serving a tiny random model.

The model cannot follow the grading protocol, so the grader must fail safe: every group ends in a
rejected verdict (counted by reason in the pool's metrics), the caller gets neutral kernel inputs
and finite advantages, and nothing hangs. Also checks a dead endpoint (connection refused, real
socket) becomes a counted ``grader_error``.

Needs the SGLang venv (``scripts/setup_sglang.sh``; ``$GAGAR_SGLANG_VENV`` or ``.venv-sglang``):
skipped with the reason otherwise. The server is started here with a context of 8192 tokens,
because the grader's system prompt and tool schemas alone take ~3.5k tokens of the tiny model's
1024-token BPE (the rollout tests' shared server uses 2048; the model config is raised to match).
Start-up ~40 s; the five chat calls of ~3.7k-token prompts ~15 s on 2 shared cores.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from grading_strategies import BASE_REPO, EXTRA_EDITS, FIX, apply_edits, run_kernels

from gagar_jax.grading import schema
from gagar_jax.grading.agentic import AgenticGrader
from gagar_jax.grading.pool import GradingPool
from gagar_jax.grading.schema import FallbackReason, RejectReason, VerdictRejected
from gagar_jax.rollout import sglang_client, sglang_server

HAVE_SGLANG = sglang_server.sglang_python().exists()
NEEDS_SGLANG = pytest.mark.skipif(
    not HAVE_SGLANG,
    reason=f"no SGLang venv at {sglang_server.sglang_python().parent.parent}: "
    "build it with scripts/setup_sglang.sh",
)
# The `sglang` marker puts this module in `make test`'s single-process server pass.
pytestmark = [pytest.mark.xdist_group("sglang"), pytest.mark.sglang]


@pytest.fixture(scope="module")
def grading_server(request, tmp_path_factory):
    model = tmp_path_factory.mktemp("grading") / "tiny"
    try:  # reuse the session's tiny model (tests/sglang_fixtures.py) when it is there
        shutil.copytree(request.getfixturevalue("tiny_sglang_model"), model)
    except pytest.FixtureLookupError:
        sglang_server.make_tiny_model(model, seed=0)
    # RoPE has no length limit; the tiny model's config only declares 2048 positions.
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 8192
    cfg_path.write_text(json.dumps(cfg))
    server = sglang_server.SGLangServer(
        model, context_length=8192, max_total_tokens=32768, max_running_requests=8
    )
    server.start(timeout_s=300)
    try:
        yield server
    finally:
        server.stop()


def _group(i: int) -> schema.GroupWorkspace:
    c = [
        schema.Candidate("a", apply_edits(BASE_REPO, [FIX]), True, "1 passed"),
        schema.Candidate("b", apply_edits(BASE_REPO, [FIX, EXTRA_EDITS[1]]), True, "1 passed"),
        schema.Candidate("c", apply_edits(BASE_REPO, [EXTRA_EDITS[1]]), False, "1 failed"),
    ]
    return schema.GroupWorkspace(f"real-{i}", "Fix add() in pkg/core.py", BASE_REPO, c)


@NEEDS_SGLANG
def test_tiny_random_model_fails_safe(grading_server):
    client = sglang_client.SGLangClient(grading_server.url, max_retries=1, request_timeout_s=60)
    grader = AgenticGrader(client, max_steps=2, max_tokens=16, temperature=1.0, time_budget_s=60)
    groups = [_group(i) for i in range(2)]
    with GradingPool(grader, max_concurrency=2, deadline_s=120) as pool:
        for ws in groups:
            pool.submit(ws)
        res = pool.results([ws.group_id for ws in groups], timeout=180)
        m = pool.metrics()
    # The model really answered (every step is a real chat completion) but never a valid verdict.
    assert client.metrics["chat_requests"] == 2 * 2 == grader.metrics["steps"]
    assert all(r.verdict is None for r in res)
    rejected = {FallbackReason.MALFORMED, FallbackReason.BUDGET_EXHAUSTED}
    assert {r.fallback_reason for r in res} <= rejected, [r.detail for r in res]
    assert sum(m[f"fallback/{r.value}"] for r in rejected) == 2 and m["fallback_rate"] == 1.0
    # The caller continues: neutral inputs, finite advantages equal to the original ones.
    adv, orig = run_kernels(res, groups)
    assert np.isfinite(adv).all() and (adv == orig).all()

    # Without tool schemas (plain-text protocol) the same: a named rejection, never a verdict.
    # (One test function, so that pytest-xdist never starts this module's server twice.)
    client = sglang_client.SGLangClient(grading_server.url, max_retries=1, request_timeout_s=60)
    grader = AgenticGrader(client, max_steps=1, max_tokens=16, use_tools=False, time_budget_s=60)
    with pytest.raises(VerdictRejected) as err:
        grader.grade(_group(9))
    assert err.value.reason in (RejectReason.MALFORMED, RejectReason.BUDGET_EXHAUSTED)
    assert client.metrics["chat_requests"] == 1


def test_dead_endpoint_is_a_counted_grader_error():
    port = sglang_server.free_port()  # nothing listens there
    client = sglang_client.SGLangClient(
        f"http://127.0.0.1:{port}", max_retries=1, backoff_base_s=0.01, request_timeout_s=5
    )
    ws = _group(0)
    with GradingPool(AgenticGrader(client, max_steps=2), deadline_s=30) as pool:
        pool.submit(ws)
        (r,) = pool.results([ws.group_id], timeout=30)
        assert r.fallback_reason == FallbackReason.GRADER_ERROR
        assert "127.0.0.1" in r.detail
        assert pool.metrics()["fallback/grader_error"] == 1
