"""Harness episodes: a program inside the sandbox, the gateway its only endpoint, the episode's
checkout its working directory (real bwrap sandbox, real gateway, the tiny policy)."""

import os

import pytest

from gagar_jax.envs.harness import HarnessConfig, HarnessRunner, verify_harness_episode
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.envs.repo import RepoTask
from gagar_jax.rollout.gateway import (
    BatchingBackend,
    DirectBackend,
    Gateway,
    GatewayConfig,
    GatewayServer,
)
from gagar_jax.rollout.sampler import Sampler, score_tokens
from tests.gateway_fixtures import ForcedEngine, tiny_policy, tool_text
from tests.hf_fixtures import make_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENTS_VENV = os.environ.get("GAGAR_AGENTS_VENV", os.path.join(ROOT, ".venv-agents"))
TASK = RepoTask(
    task_id="x",
    issue="x should be 2",
    files={
        "a.py": "x = 1\n",
        "tests/test_a.py": "from a import x\n\ndef test():\n    assert x == 2\n",
    },
    fail_to_pass=("tests/test_a.py::test",),
)
CONFIG = GatewayConfig(context_limit=4096, default_max_tokens=16, max_tokens_cap=16)

# A harness speaking the OpenAI wire format with the standard library (the sandbox exposes the
# test runner's packages, not the trainer's): two calls, a command in between, an edit.
HTTP_HARNESS = r"""
import json, os, subprocess, urllib.request
def chat(messages, max_tokens=8):
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": os.environ["GAGAR_MODEL"], "messages": messages,
                         "max_tokens": max_tokens}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                 "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["message"]
m = [{"role": "user", "content": open(os.environ["GAGAR_TASK_FILE"]).read()}]
answer = chat(m)
out = subprocess.run("ls", shell=True, capture_output=True, text=True).stdout
m += [answer, {"role": "user", "content": out}]
chat(m)
open("a.py", "w").write("x = 2\n")
"""


def _script(body: str) -> str:
    return f"cat > /tmp/h.py <<'GAGAR_EOF'\n{body}\nGAGAR_EOF\npython /tmp/h.py"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_policy(tokenizer)


@pytest.fixture(scope="module")
def served(tokenizer, model, tmp_path_factory):
    sampler = Sampler(
        model,
        pad_id=tokenizer.pad_id,
        batch_buckets=(1, 2),
        prompt_buckets=(256,),
        new_token_buckets=(16,),
    )
    gw = Gateway(BatchingBackend(sampler), tokenizer, CONFIG)
    uds = str(tmp_path_factory.mktemp("gw") / "gateway.sock")
    with GatewayServer(gw, uds=uds) as server:
        yield gw, server


def test_a_command_harness_runs_in_the_sandbox_through_the_gateway(served, model):
    # (the official SDK inside the sandbox: mini-swe-agent's litellm, in the e2e test below)
    gw, server = served
    runner = HarnessRunner(gw, server, HarnessConfig(command=_script(HTTP_HARNESS), max_wall_s=60))
    ep = runner.run(TASK, episode_id="http-harness")
    assert ep.status == "finished" and ep.finish_reason == "exited", ep.stderr[-2000:]
    assert ep.diff.ok and "+x = 2" in ep.patch
    calls = ep.record["calls"]
    assert [c["linked_call"] for c in calls] == [None, 0]
    (seg,) = ep.segments
    assert seg.calls == [0, 1]
    for c in calls:
        ref = score_tokens(model, c["prompt_ids"] + c["completion_ids"], len(c["prompt_ids"]))
        assert max(abs(a - b) for a, b in zip(c["logprobs"], ref)) < 1e-4
    assert ep.trajectory()[0]["observation"] == "a.py\ntests\n"


def test_limits_crashes_and_hangs_end_the_episode_with_the_reason(served):
    gw, server = served
    looping = HTTP_HARNESS.split("answer = chat(m)")[0] + "while True:\n    chat(m, 2)"
    ep = HarnessRunner(
        gw, server, HarnessConfig(command=_script(looping), max_calls=3, max_wall_s=60)
    ).run(TASK, episode_id="loops")
    assert ep.finish_reason == "limit: max_calls=3 model calls per episode"
    assert len(ep.record["calls"]) == 3 and ep.status == "finished"
    crash = HarnessRunner(gw, server, HarnessConfig(command="echo partial > a.py; exit 7"))
    ep = crash.run(TASK, episode_id="crashes")
    assert ep.finish_reason == "crashed (exit 7)" and "+partial" in ep.patch
    hang = HarnessRunner(gw, server, HarnessConfig(command="sleep 600", max_wall_s=2))
    ep = hang.run(TASK, episode_id="hangs")
    assert ep.finish_reason.startswith("timeout") and ep.patch == ""
    assert ep.status == "finished"  # a harness's fault, not infrastructure
    out = verify_harness_episode(TASK, ep)
    assert not out.passed and not out.infra_error
    assert (
        out.test_log == "episode ended without a diff (timeout: the harness ran past max_wall_s=2)"
    )


def test_an_engine_failure_is_infra_error(tokenizer, tmp_path):
    class Down:
        async def agenerate(self, prompts, params, prompt_seeds=None):
            raise ConnectionError("engine process gone")  # a crashed engine, as it raises

    gw = Gateway(DirectBackend(Down()), tokenizer, CONFIG)
    with GatewayServer(gw, uds=str(tmp_path / "gw.sock")) as server:
        ep = HarnessRunner(
            gw, server, HarnessConfig(command=_script(HTTP_HARNESS), max_wall_s=60)
        ).run(TASK, episode_id="engine-down")
    assert ep.status == "infra_error" and "engine process gone" in ep.finish_reason
    assert verify_harness_episode(TASK, ep).infra_error


@pytest.mark.e2e
def test_mini_swe_agent_unmodified_drives_the_episode(tokenizer, model, tmp_path):
    if not os.path.exists(os.path.join(AGENTS_VENV, "bin", "mini")):
        pytest.fail(f"{AGENTS_VENV} has no mini-swe-agent: run scripts/setup_agents.sh")
    script = [
        tool_text("sed -i 's/x = 1/x = 2/' a.py && cat a.py", prefix="Fixing a.py.\n"),
        tool_text("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
    ]
    engine = ForcedEngine(model, tokenizer, script)
    gw = Gateway(DirectBackend(engine), tokenizer, CONFIG)
    with GatewayServer(gw, uds=str(tmp_path / "gw.sock")) as server:
        runner = HarnessRunner(
            gw,
            server,
            HarnessConfig(
                harness="mini_swe_agent", agents_venv=AGENTS_VENV, max_calls=4, max_wall_s=180
            ),
        )
        ep = runner.run(TASK, episode_id="mini")
    assert ep.status == "finished" and ep.finish_reason == "exited", ep.stdout[-3000:]
    assert ep.patch.count("+x = 2") == 1 and ep.diff.ok
    calls = ep.record["calls"]
    assert len(calls) == 2 and calls[1]["linked_call"] == 0  # its history: our exact ids
    assert ep.trajectory()[0]["commands"] == ["sed -i 's/x = 1/x = 2/' a.py && cat a.py"]
    assert "x = 2" in ep.trajectory()[0]["observation"]
    assert len(ep.segments) == 1 and ep.segments[0].model_tokens == sum(
        len(c["completion_ids"]) for c in calls
    )
    events = ep.events()
    assert [e["kind"] for e in events] == ["tool_call", "observation"] * 2
    assert "sed -i" in events[0]["text"] and "x = 2" in events[1]["text"]
    outcome = verify_harness_episode(TASK, ep)  # the hidden-test verifier, the monitor
    assert outcome.passed and not outcome.cheat, outcome.test_log
