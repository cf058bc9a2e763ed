"""ATIF export of gateway episodes: the command line writes one trajectory per finished episode,
and reading it back gives the recorded calls (ids, log-probs, versions) and segments."""

import json
import os
import subprocess
import sys

import openai
import pytest

from gagar_jax.data.trajectories import AtifError, atif_calls, export, read_atif
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.rollout.gateway import DirectBackend, Gateway, GatewayConfig, GatewayServer
from gagar_jax.rollout.segments import build_segments
from tests.gateway_fixtures import ForcedEngine, tiny_policy, tool_text
from tests.hf_fixtures import make_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tok = HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    script = [tool_text("ls", prefix="Looking.\n"), "Done.", "Again from a summary."]
    engine = ForcedEngine(tiny_policy(tok), tok, script, version=5)
    run = tmp_path_factory.mktemp("run")
    gw = Gateway(
        DirectBackend(engine),
        tok,
        GatewayConfig(context_limit=512, default_max_tokens=32, max_tokens_cap=32),
        record_dir=str(run / "gateway"),
    )
    with GatewayServer(gw) as server:
        s = gw.open_session("ep/one")
        client = openai.OpenAI(base_url=server.session_url(s), api_key="x")
        msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
        r = client.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
        msg = r.choices[0].message
        msgs += [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "a.py"},
        ]
        client.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
        client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "summary: listed a.py"}], tools=TOOLS
        )
        gw.finish_session(s.token)
    return run


def test_export_command_line_and_read_back(run_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gagar_jax.data.trajectories",
            "export",
            str(run_dir),
            "--format",
            "atif",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (path,) = out.stdout.split()
    assert path == str(run_dir / "atif" / "ep_one.atif.json")
    traj = read_atif(path)
    (record,) = [json.load(open(run_dir / "gateway" / f)) for f in os.listdir(run_dir / "gateway")]
    calls = atif_calls(traj)
    for got, want in zip(calls, record["calls"], strict=True):
        for key in ("prompt_ids", "completion_ids", "logprobs", "policy_version", "linked_call"):
            assert got[key] == want[key], key
    assert [s.calls for s in build_segments(calls)] == [[0, 1], [2]]
    sources = [st["source"] for st in traj["steps"]]
    assert sources == ["system", "user", "agent", "agent", "user", "agent"]
    first = traj["steps"][2]
    assert first["message"] == "Looking." and first["tool_calls"][0]["function_name"] == "bash"
    assert first["observation"]["results"][0]["content"] == "a.py"
    assert traj["steps"][4]["extra"] == {"history_rewritten": True}
    assert traj["final_metrics"]["extra"]["segments"] == 2
    assert traj["steps"][5]["extra"]["policy_version"] == 5


def test_read_atif_names_what_is_wrong(tmp_path, run_dir):
    (path,) = export(str(run_dir), out_dir=str(tmp_path / "atif"))
    traj = json.loads(open(path).read())
    traj["steps"][2]["metrics"]["logprobs"].pop()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(traj))
    with pytest.raises(AtifError, match=r"steps\[2\].metrics: completion_token_ids and logprobs"):
        read_atif(str(bad))
    with pytest.raises(ValueError, match="format must be one of"):
        export(str(run_dir), fmt="jsonl")
