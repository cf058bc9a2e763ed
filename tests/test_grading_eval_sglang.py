"""The grader-quality harness against the agentic grader on a REAL SGLang server (tiny random
model, CPU). A random model's agreement numbers mean nothing; what is checked is that the harness
runs the voting agentic grader end to end through the CLI, counts its fallbacks and the tokens
the server reports, and prints every column. Six chat calls of a ~3.7k-token prompt and 16 new
tokens each after the server's start-up: 4.5 to 6 minutes in all on 2 cores shared at loads of
12 to 24, far less on an idle machine."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout

import pytest

from gagar_jax.grading import eval as ev
from gagar_jax.rollout import sglang_server

pytestmark = [
    pytest.mark.skipif(
        not sglang_server.sglang_python().exists(),
        reason="no SGLang venv: build it with scripts/setup_sglang.sh",
    ),
    pytest.mark.xdist_group("sglang"),
    pytest.mark.sglang,
]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    model = tmp_path_factory.mktemp("eval") / "tiny"
    try:  # reuse the session's tiny model (tests/sglang_fixtures.py) when it is there
        shutil.copytree(request.getfixturevalue("tiny_sglang_model"), model)
    except pytest.FixtureLookupError:
        sglang_server.make_tiny_model(model, seed=0)
    cfg_path = model / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 8192  # the grader's prompt alone is ~3.5k tokens
    cfg_path.write_text(json.dumps(cfg))
    srv = sglang_server.SGLangServer(
        model, context_length=8192, max_total_tokens=32768, max_running_requests=8
    )
    srv.start(timeout_s=300)
    try:
        yield srv
    finally:
        srv.stop()


def test_harness_runs_the_voting_agentic_grader_on_a_real_server(server):
    buf = io.StringIO()
    with redirect_stdout(buf):
        ev.main(
            ["--grader", "agentic", "--set", "toy", "--json", "--sglang-url", server.url,
             "--votes", "3", "--max-steps", "1", "--max-tokens", "16", "--limit", "1",
             "--probes", "permute", "--bootstrap", "0"]
        )  # fmt: skip  # argv pairs
    (row,) = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert set(ev.METRIC_KEYS) <= set(row)
    assert row["grader"].startswith("agentic@") and row["set"] == "toy@v1"
    # A random model cannot produce a valid verdict: the group falls back, counted; no verdict,
    # so no agreement figure is claimed (null), and the probe did not run.
    assert row["fallback_rate"] == 1.0 and row["kappa"] is None and row["flip_rate"] is None
    assert row["tokens_per_group"] > 3 * 3000  # three votes of a >3k-token prompt were sent
    assert row["s_per_group"] > 0
