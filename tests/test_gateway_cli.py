"""``python -m gagar_jax.rollout.gateway`` as a process of its own: on the embedded sampler (a
saved tiny model) and on a real CPU SGLang server, driven by the OpenAI SDK through the admin
routes, with the recorded log-probs compared to the training forward of the same weights."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from sglang_fixtures import SGLANG

from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.models import load_hf_safetensors, save_hf_safetensors
from gagar_jax.rollout.sampler import score_tokens
from tests.gateway_fixtures import tiny_policy
from tests.hf_fixtures import make_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADMIN = "cli-admin-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args, tmp_path):
    port = _free_port()
    log = open(tmp_path / "gateway.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gagar_jax.rollout.gateway", *args, "--port", str(port),
         "--admin-key", ADMIN, "--record-dir", str(tmp_path / "records"),
         "--default-max-tokens", "8", "--context-limit", "512"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip  # argv pairs
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError((tmp_path / "gateway.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the gateway did not start: " + (tmp_path / "gateway.log").read_text())


def _episode(url):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    opened = httpx.post(
        f"{url}/admin/sessions", json={"episode_id": "cli", "seed": 1}, headers=admin, timeout=10
    ).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="unused")
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=8)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go"}]
    client.chat.completions.create(model="policy", messages=msgs, max_tokens=8, temperature=0.0)
    return httpx.post(
        f"{url}/admin/sessions/{opened['token']}/finish", headers=admin, timeout=10
    ).json()


def _max_logprob_error(model_dir, record) -> float:
    _, model = load_hf_safetensors(model_dir)
    worst = 0.0
    for c in record["calls"]:
        ids = c["prompt_ids"] + c["completion_ids"]
        ref = score_tokens(model, ids, len(c["prompt_ids"]), c["temperature"])
        worst = max(worst, float(np.max(np.abs(np.array(c["logprobs"]) - ref))))
    return worst


@pytest.mark.e2e
def test_cli_on_the_embedded_sampler(tmp_path):
    model_dir = tmp_path / "model"
    tok = HFTokenizer(make_tiny_tokenizer(model_dir))
    model = tiny_policy(tok)
    save_hf_safetensors(model, model.config, str(model_dir))
    proc, url = _serve(["--engine", "embedded", "--model-dir", str(model_dir)], tmp_path)
    try:
        record = _episode(url)
    finally:
        proc.terminate()
        proc.wait(30)
    assert [c["linked_call"] for c in record["calls"]] == [None, 0]
    assert _max_logprob_error(str(model_dir), record) < 1e-4  # k3 = 0: the sampling weights
    (name,) = os.listdir(tmp_path / "records")
    assert name.startswith("cli-") and name.endswith(".json")
    saved = json.loads((tmp_path / "records" / name).read_text())
    assert saved == record


@SGLANG[0]
@SGLANG[1]
@SGLANG[2]
def test_cli_on_a_real_sglang_server(sglang_server, tiny_sglang_model, tmp_path):
    tok_dir = tmp_path / "tok"
    shutil.copytree(tiny_sglang_model, tok_dir)
    proc, url = _serve(
        ["--engine", "sglang", "--sglang-url", sglang_server.url, "--tokenizer", str(tok_dir)],
        tmp_path,
    )
    try:
        record = _episode(url)
    finally:
        proc.terminate()
        proc.wait(30)
    calls = record["calls"]
    assert [c["linked_call"] for c in calls] == [None, 0]
    head = calls[0]["prompt_ids"] + calls[0]["completion_ids"]
    assert calls[1]["prompt_ids"][: len(head)] == head
    err = _max_logprob_error(str(tiny_sglang_model), record)
    print(f"SGLang behaviour log-probs vs the training forward: max |diff| = {err:.2e}")
    assert err < 1e-3


@pytest.mark.e2e
@SGLANG[0]
@SGLANG[1]
@SGLANG[2]
def test_mini_swe_agent_through_the_gateway_on_sglang(sglang_server, tiny_sglang_model, tmp_path):
    """Unmodified mini-swe-agent in the sandbox, its model the real SGLang server behind the
    gateway: every call recorded with SGLang's log-probs, compared to the training forward."""
    from gagar_jax.envs.harness import HarnessConfig, HarnessRunner
    from gagar_jax.envs.repo import RepoTask
    from gagar_jax.rollout import SGLangClient
    from gagar_jax.rollout.gateway import DirectBackend, Gateway, GatewayConfig, GatewayServer

    venv = os.environ.get("GAGAR_AGENTS_VENV", os.path.join(ROOT, ".venv-agents"))
    if not os.path.exists(os.path.join(venv, "bin", "mini")):
        pytest.fail(f"{venv} has no mini-swe-agent: run scripts/setup_agents.sh")
    tok = HFTokenizer(str(tiny_sglang_model))
    client = SGLangClient(sglang_server.url, vocab_size=tok.vocab_size, max_retries=1)
    gw = Gateway(
        DirectBackend(client),
        tok,
        GatewayConfig(context_limit=2048, default_max_tokens=16, max_tokens_cap=16),
    )
    task = RepoTask(
        task_id="t",
        issue="make x equal 2",
        files={"a.py": "x = 1\n"},
        fail_to_pass=("tests/test_a.py::test",),
    )
    with GatewayServer(gw, uds=str(tmp_path / "gw.sock")) as server:
        runner = HarnessRunner(
            gw,
            server,
            HarnessConfig(harness="mini_swe_agent", agents_venv=venv, max_calls=3, max_wall_s=240),
        )
        ep = runner.run(task, episode_id="mini-sglang")
    assert ep.status == "finished", (ep.finish_reason, ep.stdout[-3000:])
    assert len(ep.record["calls"]) >= 1
    err = _max_logprob_error(str(tiny_sglang_model), ep.record)
    print(f"mini-swe-agent on SGLang: {len(ep.record['calls'])} calls, {len(ep.segments)} "
          f"segment(s), finish {ep.finish_reason!r}; log-probs vs training forward: "
          f"max |diff| = {err:.2e}")  # fmt: skip
    assert err < 1e-3
