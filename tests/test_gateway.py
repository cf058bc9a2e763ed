"""The gateway with the official OpenAI and Anthropic SDKs as clients, on the embedded sampler.

A tiny random Qwen2-style model with the tests' BPE tokenizer and ChatML template serves the
plain and streaming calls and the compaction; its recorded log-probs are checked against the
training forward's scores of the same ids (`score_tokens`). The tool-call tests use
`tests.gateway_fixtures.ForcedEngine` (scripted text, the same model's real log-probs).
"""

import json

import anthropic
import httpx
import numpy as np
import openai
import pytest

from gagar_jax import advantages as adv
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.rollout import SGLangClient
from gagar_jax.rollout.gateway import (
    BatchingBackend,
    DirectBackend,
    Gateway,
    GatewayConfig,
    GatewayServer,
    SessionLimits,
)
from gagar_jax.rollout.sampler import Sampler, score_tokens
from gagar_jax.rollout.segments import build_segments
from tests.gateway_fixtures import ForcedEngine, tiny_policy
from tests.hf_fixtures import make_tiny_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_policy(tokenizer)


CONFIG = GatewayConfig(context_limit=256, default_max_tokens=16, max_tokens_cap=16)


@pytest.fixture(scope="module")
def served(model, tokenizer, tmp_path_factory):
    sampler = Sampler(
        model,
        pad_id=tokenizer.pad_id,
        batch_buckets=(1, 2, 4),
        prompt_buckets=(256,),
        new_token_buckets=(16,),
    )
    gw = Gateway(
        BatchingBackend(sampler), tokenizer, CONFIG, record_dir=str(tmp_path_factory.mktemp("rec"))
    )
    with GatewayServer(gw, admin_key="admin-secret") as server:
        yield gw, server


def _forced(model, tokenizer, texts):
    gw = Gateway(ForcedEngineBackend(ForcedEngine(model, tokenizer, texts)), tokenizer, CONFIG)
    return gw


def ForcedEngineBackend(engine):  # noqa: N802 -- reads as the backend it is
    return DirectBackend(engine)


def _check_logprobs(model, call):
    ref = score_tokens(model, call["prompt_ids"] + call["completion_ids"], len(call["prompt_ids"]))
    np.testing.assert_allclose(call["logprobs"], ref, rtol=0, atol=1e-4)


def test_openai_plain_call_is_recorded_token_exact(served, model, tokenizer):
    gw, server = served
    s = gw.open_session("plain")
    client = openai.OpenAI(base_url=server.session_url(s), api_key="unused")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, seed=5)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.model == "policy" and [m.id for m in client.models.list().data] == ["policy"]
    rec = gw.finish_session(s.token)
    (call,) = rec["calls"]
    assert call["prompt_ids"] == tokenizer.render_prompt(msgs)
    assert r.usage.prompt_tokens == len(call["prompt_ids"])
    assert r.usage.completion_tokens == len(call["completion_ids"]) <= 12
    text = tokenizer.decode([t for t in call["completion_ids"] if t != tokenizer.eos_id])
    assert r.choices[0].message.content == text
    _check_logprobs(model, call)
    # The same messages with the same seed sample the same tokens (seeded per call).
    s2 = gw.open_session("plain-again")
    client2 = openai.OpenAI(base_url=server.session_url(s2), api_key="unused")
    r2 = client2.chat.completions.create(model="policy", messages=msgs, max_tokens=12, seed=5)
    assert r2.choices[0].message.content == r.choices[0].message.content
    gw.finish_session(s2.token)


def test_openai_streaming_and_the_api_key_route(served, model):
    gw, server = served
    s = gw.open_session("stream")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=s.token)  # the token as API key
    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "count"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = [c.usage for c in chunks if c.usage]
    (call,) = gw.finish_session(s.token)["calls"]
    assert finish in (["stop"], ["length"]) and usage[0].completion_tokens == len(
        call["completion_ids"]
    )
    assert text == call["response"]["content"]
    _check_logprobs(model, call)


def test_openai_tool_calls_link_the_next_call_to_the_recorded_ids(model, tokenizer):
    script = [
        "Let me look.\n<tool_call>\n"
        '{"name": "bash", "arguments": {"command": "ls -a"}}\n</tool_call>',
        "Done: two files.",
    ]
    gw = _forced(model, tokenizer, script)
    with GatewayServer(gw) as server:
        s = gw.open_session("tools")
        client = openai.OpenAI(base_url=server.session_url(s), api_key="x")
        msgs = [{"role": "user", "content": "list the files"}]
        r = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        (tc,) = choice.message.tool_calls
        assert tc.function.name == "bash" and json.loads(tc.function.arguments) == {
            "command": "ls -a"
        }
        msgs += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": tc.id, "content": "a.py\nb.py"},
        ]
        r2 = client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in r2 if c.choices) == script[1]
        c0, c1 = gw.finish_session(s.token)["calls"]
    assert c1["linked_call"] == 0
    head = c0["prompt_ids"] + c0["completion_ids"]
    assert c1["prompt_ids"][: len(head)] == head  # the model's ids, not a re-encoding of its text
    tail = tokenizer.decode(c1["prompt_ids"][len(head) :], skip_special_tokens=False)
    assert tail == "\n<|im_start|>tool\na.py\nb.py<|im_end|>\n<|im_start|>assistant\n"
    (seg,) = build_segments([c0, c1])
    assert seg.model_tokens == len(c0["completion_ids"]) + len(c1["completion_ids"])
    _check_logprobs(model, c1)


def test_anthropic_plain_streaming_and_tool_use(model, tokenizer):
    script = [
        'Checking.<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}</tool_call>',
        "It is /work.",
        "Plain answer.",
    ]
    gw = _forced(model, tokenizer, script)
    tools = [{"name": "bash", "description": "run", "input_schema": {"type": "object"}}]
    with GatewayServer(gw) as server:
        s = gw.open_session("anthropic")
        client = anthropic.Anthropic(base_url=server.session_url(s)[: -len("/v1")], api_key="x")
        msgs = [{"role": "user", "content": "where am I?"}]
        m = client.messages.create(
            model="policy", max_tokens=64, messages=msgs, tools=tools, system="terse"
        )
        assert m.stop_reason == "tool_use"
        text, use = m.content
        assert text.text == "Checking." and use.name == "bash" and use.input == {"command": "pwd"}
        msgs += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "/work"}],
            },
        ]
        with client.messages.stream(
            model="policy", max_tokens=64, messages=msgs, tools=tools, system="terse"
        ) as stream:
            final = stream.get_final_message()
        assert final.content[0].text == "It is /work." and final.stop_reason == "end_turn"
        plain = client.messages.create(
            model="policy", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        )
        assert [m.id for m in client.models.list()] == ["policy"]
        assert plain.content[0].text == "Plain answer."
        calls = gw.finish_session(s.token)["calls"]
    assert [c["linked_call"] for c in calls] == [None, 0, None]
    assert [len(s.calls) for s in build_segments(calls)] == [2, 1]


def test_a_compacting_client_gives_two_linked_segments_whose_credit_sums_exactly(served, model):
    gw, server = served
    s = gw.open_session("compaction")
    client = openai.OpenAI(base_url=server.session_url(s), api_key="x")
    history = [{"role": "user", "content": "task: fix the bug"}]
    for turn in range(2):
        r = client.chat.completions.create(model="policy", messages=history, max_tokens=8)
        history += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"observation {turn}"},
        ]
    # The harness compacts: its history becomes a summary, then it goes on appending.
    history = [{"role": "user", "content": "task: fix the bug. summary: two steps taken"}]
    for turn in range(2):
        r = client.chat.completions.create(model="policy", messages=history, max_tokens=8)
        history += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": f"next {turn}"},
        ]
    calls = gw.finish_session(s.token)["calls"]
    assert [c["linked_call"] for c in calls] == [None, 0, None, 2]
    segments = build_segments(calls)
    assert [seg.calls for seg in segments] == [[0, 1], [2, 3]]
    for seg in segments:  # each row scores like it was sampled: recorded == training forward
        ref = np.concatenate([[0.0], score_tokens(model, seg.tokens, 1)])  # token k's log-prob
        lp, mask = np.array(seg.logprobs), np.array(seg.response_mask, bool)
        assert mask.sum() > 0 and not mask[: seg.prompt_len].any()
        np.testing.assert_allclose(lp[mask], ref[mask], rtol=0, atol=1e-4)
    # The episode's advantage over its two rows: exactly A times its model tokens.
    a = 0.5
    n_model = sum(seg.model_tokens for seg in segments)
    rows = max(len(seg.tokens) for seg in segments)
    mask = np.zeros((2, rows), bool)
    for i, seg in enumerate(segments):
        mask[i, : len(seg.tokens)] = seg.response_mask
    tok = np.asarray(adv.broadcast_to_tokens(adv.segment_advantages(np.array([a]), [0, 0]), mask))
    assert tok.sum() == a * n_model


def test_errors_name_the_field_and_the_limit(served):
    gw, server = served
    s = gw.open_session("errors", limits=SessionLimits(max_calls=2))
    url = server.session_url(s)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="n: only n = 1"):
        client.chat.completions.create(model="p", messages=msgs, n=2)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model="p", messages=msgs, frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\].type"):
        client.chat.completions.create(
            model="p",
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        )
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "word " * 400}]
        )
    raw = httpx.post(f"{url}/chat/completions", content=b"{not json", timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "body"
    raw = httpx.post(f"{url}/chat/completions", json={"messages": msgs, "best_of": 3}, timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "best_of"
    raw = httpx.post(f"{url}/messages", json={"messages": msgs}, timeout=10)
    assert raw.status_code == 400 and raw.json()["error"]["message"] == "max_tokens: required"
    client.chat.completions.create(model="p", messages=msgs)
    client.chat.completions.create(model="p", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="max_calls=2"):
        client.chat.completions.create(model="p", messages=msgs)
    assert len(gw.finish_session(s.token)["calls"]) == 2
    with pytest.raises(openai.NotFoundError):  # finished
        client.chat.completions.create(model="p", messages=msgs)
    forged = openai.OpenAI(base_url=f"{server.url}/sessions/gs-{'A' * 43}/v1", api_key="x")
    with pytest.raises(openai.NotFoundError):  # unknown
        forged.chat.completions.create(model="p", messages=msgs)


def test_engine_down_is_503_and_the_episode_infra_error(tokenizer):
    # A real SGLang client pointed at a port nothing listens on: connection refused.
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = SGLangClient(f"http://127.0.0.1:{port}", max_retries=0, request_timeout_s=5)
    gw = Gateway(DirectBackend(engine), tokenizer, CONFIG)
    with GatewayServer(gw) as server:
        s = gw.open_session("down")
        client = openai.OpenAI(base_url=server.session_url(s), api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 503
        rec = gw.finish_session(s.token)
    assert rec["status"] == "infra_error" and "SGLangUnavailableError" in rec["reason"]


def test_admin_routes_and_a_restart_keep_finished_episodes(served, tokenizer):
    gw, server = served
    admin = {"Authorization": "Bearer admin-secret"}
    assert httpx.post(f"{server.url}/admin/sessions", json={}, timeout=10).status_code == 404
    opened = httpx.post(
        f"{server.url}/admin/sessions", json={"episode_id": "via-http"}, headers=admin, timeout=10
    ).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key="x")
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    done = httpx.post(
        f"{server.url}/admin/sessions/{opened['token']}/finish", headers=admin, timeout=10
    ).json()
    assert done["episode_id"] == "via-http" and len(done["calls"]) == 1
    # A new gateway on the same record directory serves the finished episode again.
    again = Gateway(None, tokenizer, CONFIG, record_dir=gw.store.record_dir)
    assert again.store.finished("via-http") == done
    with GatewayServer(again, admin_key="k2") as s2:
        got = httpx.get(
            f"{s2.url}/admin/episodes/via-http", headers={"Authorization": "Bearer k2"}, timeout=10
        )
    assert got.json() == done


def test_a_template_that_drops_old_reasoning_starts_a_new_segment(model, tmp_path):
    # A Qwen3-style template: an assistant turn's <think>...</think> part is rendered only in
    # the last assistant turn; once a later turn follows, the history is rendered without it.
    import shutil

    from gagar_jax.envs.hf_tokenizer import HFTokenizer as Tok

    src = make_tiny_tokenizer(tmp_path / "base")
    shutil.copytree(src, tmp_path / "think")
    cfg_path = tmp_path / "think" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{%- set c = m['content'] or '' %}"
        "{%- if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}"
        "{%- endif %}{{ c }}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    cfg_path.write_text(json.dumps(cfg))
    tok = Tok(tmp_path / "think")
    script = ["<think>plan</think>first", "<think>more</think>second", "third"]
    gw = Gateway(DirectBackend(ForcedEngine(model, tok, script)), tok, CONFIG)
    with GatewayServer(gw) as server:
        s = gw.open_session("reasoning")
        client = openai.OpenAI(base_url=server.session_url(s), api_key="x")
        history = [{"role": "user", "content": "q1"}]
        r = client.chat.completions.create(model="p", messages=history)
        assert r.choices[0].message.content == "<think>plan</think>first"
        history += [r.choices[0].message.model_dump(exclude_none=True)]
        history += [{"role": "user", "content": "q2"}]
        r = client.chat.completions.create(model="p", messages=history)
        calls = gw.finish_session(s.token)["calls"]
    # the second prompt renders the first answer without its reasoning: not an extension
    assert calls[1]["linked_call"] is None
    assert [seg.calls for seg in build_segments(calls)] == [[0], [1]]
    assert "plan" not in tok.decode(calls[1]["prompt_ids"])
