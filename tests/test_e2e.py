"""`make e2e` as a test: the multi-turn code-agent run with a real SGLang server in the loop.

Runs ``scripts/e2e.py`` against the session's SGLang server (one server for every sglang test:
the tiny random Qwen2 with its locally trained tokenizer, the model ``make e2e`` builds), then
checks the metric rows it wrote: real multi-turn episodes with parsed tool calls, the weight
version one higher after every step, a finite training-inference mismatch, and a run that
survived a SIGKILL after its first checkpoint (no step repeated or skipped). The server's launch
weights are put back afterwards for the tests that follow.
"""

import json
import math
import os
import subprocess
import sys

import httpx
import pytest
from sglang_fixtures import SGLANG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Minutes of CPU (SFT and updates at 2k tokens, SGLang rollouts): not in `make test`'s budget.
pytestmark = [
    *SGLANG,
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("GAGAR_E2E") != "1",
        reason="make e2e as a test takes many minutes on 2 cores: run with GAGAR_E2E=1",
    ),
]


def test_make_e2e_metrics(sglang_server, tiny_sglang_model, tmp_path):
    out = tmp_path / "e2e"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "e2e.py"),
        f"--out={out}",
        f"--sglang_url={sglang_server.url}",
        f"--model_dir={tiny_sglang_model}",
    ]
    try:
        r = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=3000,
            env={**os.environ, "XLA_FLAGS": ""},
        )
    finally:  # the launch weights back, as the other sglang tests expect them
        httpx.post(
            f"{sglang_server.url}/update_weights_from_disk",
            timeout=120,
            json={"model_path": str(tiny_sglang_model), "weight_version": "default"},
            trust_env=False,
        )
    log_path = out / "trainer.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + log[-3000:]
    assert "resumed from checkpoint 1" in log
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if x["phase"] == "train"]
    assert [x["step"] for x in train] == [0, 1, 2]
    assert any(x["phase"] == "sft" for x in rows)
    # SFT'd weights are version 0; each step's sync adds one, as the server reports it
    assert [x["rollout/weight_version"] for x in train] == [1.0, 2.0, 3.0]
    assert [x["policy_version"] for x in train] == [1.0, 2.0, 3.0]
    assert max(x["episode/turns_mean"] for x in train) > 1.0
    assert max(x["episode/tool_calls_mean"] for x in train) > 0.0
    for x in train:
        k3, diff = x["rollout/logprob_mismatch_k3"], x["rollout/logprob_mismatch_max_abs"]
        assert math.isfinite(k3) and math.isfinite(diff) and diff >= 0.0
        assert 0 < x["response_length"] <= 768
    # SGLang's kernels are not the trainer's: small, but not exactly zero
    assert any(x["rollout/logprob_mismatch_max_abs"] > 0.0 for x in train)
    assert all(x["rollout/logprob_mismatch_max_abs"] < 1.0 for x in train)
