"""The protocol student through a real SGLang server: it writes verdicts the agentic grader
accepts (end to end: serve, grade; minutes on CPU).

Opt-in: the checkpoint is ``$GAGAR_GRADER_STUDENT`` (a ``model`` directory written by
``scripts/train_agentic_student.py``), and the test is skipped without it. No student trained
with the script's defaults writes accepted verdicts yet (docs/grader_quality.md), so running
this in every test pass would only restate that; it is the check to run on a new student.
Pointing the variable at the script's ``untrained`` directory makes the test fail: the initial
weights never write a verdict.
"""

import os
import time
from pathlib import Path

import pytest
from sglang_fixtures import SGLANG

from gagar_jax.grading import eval as harness
from gagar_jax.grading import labelled
from gagar_jax.grading.agentic import AgenticGrader
from gagar_jax.rollout.sglang_client import SGLangClient
from gagar_jax.rollout.sglang_server import CONSTRAINED_JSON_FLAGS, SGLangServer

pytestmark = [*SGLANG, pytest.mark.e2e]


def _student() -> Path:
    given = os.environ.get("GAGAR_GRADER_STUDENT")
    if not given:
        pytest.skip(
            "set GAGAR_GRADER_STUDENT to a student checkpoint (scripts/train_agentic_student.py)"
        )
    return Path(given)


def test_trained_student_writes_accepted_verdicts_through_the_server(tmp_path):
    model_dir = _student()
    heldout = labelled.load_set("toy", split="heldout")
    groups = labelled.LabelledSet(heldout.name, heldout.version, heldout.groups[:2])
    server = SGLangServer(
        model_dir,
        context_length=8192,
        max_total_tokens=32768,
        model_modules=("qwen2",),
        extra_args=CONSTRAINED_JSON_FLAGS,
    )
    server.start(timeout_s=600)
    try:
        client = SGLangClient(server.url, max_retries=1, request_timeout_s=300.0)
        grader = AgenticGrader(
            client, prompt_version="c1", votes=1, max_steps=1, max_tokens=768, time_budget_s=300
        )
        t0 = time.monotonic()
        row = harness.evaluate(grader, groups, probes=(), n_boot=0)
        print(f"{row['fallback_rate']=} {row['kappa']=} {time.monotonic() - t0:.0f} s")
    finally:
        server.stop()
    # Every call went out with the vote's verdict schema and the server took it (constrained
    # decoding; the compact prompts' default).
    assert grader.metrics["constrain/calls"] >= 1, grader.metrics
    assert grader.metrics["constrain/rejected"] == 0, grader.metrics
    # Parseable, validated verdicts for at least one of the two groups (the initial weights:
    # fallback rate 1.0).
    assert row["fallback_rate"] < 1.0, grader.metrics
