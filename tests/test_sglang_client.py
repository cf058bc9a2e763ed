"""SGLangClient against a REAL SGLang server (CPU, tiny random Qwen2 built by the fixture)."""

import threading
import time

import pytest
from sglang_fixtures import SGLANG

from gagar_jax.rollout import (
    RolloutEngine,
    SamplingParams,
    SGLangClient,
    SGLangRequestError,
    SGLangUnavailableError,
)
from gagar_jax.rollout.sglang_server import SGLangRouter, free_port, randomize_weights

pytestmark = SGLANG

PROMPTS = [[10, 11, 12, 13, 14], [300, 301], [7] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def tokens(out):
    return [[s.tokens for s in row] for row in out]


def test_generate_with_logprobs(sglang_client):
    assert isinstance(sglang_client, RolloutEngine)
    assert sglang_client.health()
    out = sglang_client.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=10))
    assert [len(row) for row in out] == [3, 3, 3]
    rids = set()
    for row in out:
        for s in row:
            assert len(s.tokens) == len(s.logprobs) == 10 and s.finish_reason == "length"
            assert all(0 <= t < 1024 for t in s.tokens)
            assert all(-30.0 < lp <= 0.0 for lp in s.logprobs)
            assert s.policy_version == 0
            rids.add(s.meta["rid"])
    assert len(rids) == 9
    g1, g2 = sglang_client.generate(PROMPTS, GREEDY), sglang_client.generate(PROMPTS, GREEDY)
    assert tokens(g1) == tokens(g2)  # greedy is deterministic
    flat = [lp for r in g1 for lp in r[0].logprobs]
    assert flat == pytest.approx([lp for r in g2 for lp in r[0].logprobs], abs=1e-5)


def test_stop_token_ids(sglang_client, sglang_server):
    full = sglang_client.generate(PROMPTS[:1], GREEDY)[0][0].tokens
    k = next(i for i in range(2, 12) if full[i] not in full[:i])
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(full[k],))
    # Server-side stop (ignore_eos=False) and client-side stop (ignore_eos=True, where SGLang
    # ignores stop_token_ids too) give the same sample.
    native = SGLangClient(sglang_server.url, ignore_eos=False, vocab_size=1024)
    for client in (native, sglang_client):
        s = client.generate(PROMPTS[:1], params)[0][0]
        assert (s.tokens, s.finish_reason) == (full[: k + 1], "stop"), (full, k)
        assert s.meta["matched_stop"] == full[k]


def test_weight_update_changes_outputs(sglang_client, tiny_sglang_model, sglang_workdir):
    tmp_path = sglang_workdir
    before = sglang_client.generate(PROMPTS, GREEDY)
    new_dir = randomize_weights(tiny_sglang_model, tmp_path / "v5", seed=5)
    t0 = time.monotonic()
    assert sglang_client.update_weights_from_disk(str(new_dir), version=5) == 5
    update_s = time.monotonic() - t0
    after = sglang_client.generate(PROMPTS, GREEDY)
    assert tokens(after) != tokens(before)
    assert all(s.policy_version == 5 for row in after for s in row)
    # Back to the original weights (as a new version): the original outputs come back exactly.
    assert sglang_client.sync_weights(tiny_sglang_model, version=6) == 6
    again = sglang_client.generate(PROMPTS, GREEDY)
    assert tokens(again) == tokens(before)
    assert all(s.policy_version == 6 for row in again for s in row)
    assert sglang_client.metrics["weight_updates"] == 2
    assert sglang_client.metrics["version_mismatch_samples"] == 0
    assert update_s < 30
    with pytest.raises(SGLangRequestError, match="update_weights_from_disk"):
        sglang_client.update_weights_from_disk(str(tmp_path / "missing"), version=7)
    with pytest.raises(TypeError, match="directory path"):
        sglang_client.sync_weights({"w": 1}, version=7)


def test_chat_completions_with_tools(sglang_client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
    ]
    resp = sglang_client.chat_completions(
        [
            {"role": "system", "content": "You grade patches."},
            {"role": "user", "content": "Which candidate is better?"},
        ],
        tools=tools,
        max_tokens=8,
        temperature=0.0,
    )
    msg = resp["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg.get("content"), (str, type(None)))
    assert resp["usage"]["completion_tokens"] <= 8 and resp["usage"]["prompt_tokens"] > 10
    with pytest.raises(ValueError, match="messages"):
        sglang_client.chat_completions([])


def test_bad_requests_fail_fast(sglang_client):
    # SGLang rejects a prompt longer than the context (2048): HTTP 400, never retried.
    with pytest.raises(SGLangRequestError, match=r"rejected: HTTP 400.*context length"):
        sglang_client.generate([[5] * 2100], GREEDY)
    assert sglang_client.metrics["retries"] == 0
    # Out-of-vocabulary ids are caught before sending (they would crash SGLang's scheduler).
    with pytest.raises(ValueError, match=r"prompts\[1\] has token ids outside \[0, 1024\)"):
        sglang_client.generate([[1], [5000, 1]], GREEDY)
    assert sglang_client.health()


def test_dead_url_fails_clearly_after_retries():
    url = f"http://127.0.0.1:{free_port()}"
    client = SGLangClient(url, max_retries=3, backoff_base_s=0.01, backoff_max_s=0.05, seed=0)
    assert not client.health()
    with pytest.raises(SGLangUnavailableError, match=rf"{url}.*4 attempts.*ConnectError"):
        client.generate([[1, 2]], GREEDY)
    assert client.metrics["connection_errors"] == 4 and client.metrics["retries"] == 3
    # on_failure="abort": the rollout comes back empty and counted, never silently dropped.
    soft = SGLangClient(url, max_retries=1, backoff_base_s=0.01, on_failure="abort")
    out = soft.generate([[1, 2], [3]], SamplingParams(n=2, max_tokens=4))
    assert [[s.finish_reason for s in row] for row in out] == [["abort"] * 2] * 2
    assert soft.metrics["aborted_samples"] == 4


def test_through_a_router(sglang_server, sglang_workdir, tiny_sglang_model):
    """The same client code through SGLang's router: generation, chat, and weight sync (which the
    router does not forward: the client fans it out to the workers the router lists)."""
    router = SGLangRouter([sglang_server.url], log_path=sglang_workdir / "router.log")
    with router:
        via = SGLangClient(router.url, ignore_eos=True, vocab_size=1024)
        direct = SGLangClient(sglang_server.url, ignore_eos=True, vocab_size=1024)
        assert via.health()
        assert tokens(via.generate(PROMPTS, GREEDY)) == tokens(direct.generate(PROMPTS, GREEDY))
        new_dir = randomize_weights(tiny_sglang_model, sglang_workdir / "v11", seed=11)
        assert via.update_weights_from_disk(str(new_dir), version=11) == 11
        assert via.metrics["router_weight_fanouts"] == 1
        out = via.generate(PROMPTS, GREEDY)
        assert all(r[0].policy_version == 11 for r in out)
        assert tokens(out) == tokens(direct.generate(PROMPTS, GREEDY))
        resp = via.chat_completions([{"role": "user", "content": "hi"}], max_tokens=4)
        assert resp["choices"][0]["message"]["role"] == "assistant"
        assert via.sync_weights(tiny_sglang_model, version=12) == 12
    assert not router.running()


def test_retry_survives_server_restart_mid_batch(sglang_server):
    """Kill the real server (SIGKILL) while a batch is in flight, start it again: every sample of
    the batch comes back exactly once."""
    client = SGLangClient(
        sglang_server.url,
        max_concurrency=4,
        max_retries=10_000,
        max_retry_time_s=400.0,  # a restart takes 30-40 s on a quiet machine, minutes on a busy one
        backoff_base_s=0.25,
        backoff_max_s=2.0,
        ignore_eos=True,
        seed=0,
    )
    n_prompts, n = 8, 3
    prompts = [[20 + i, 21 + i, 22 + i] for i in range(n_prompts)]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=48)
    events = {}

    def chaos():
        deadline = time.monotonic() + 120
        while client.metrics["samples"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        events["killed_after"] = client.metrics["samples"]
        sglang_server.kill()
        time.sleep(1.0)
        events["restart_s"] = sglang_server.start(timeout_s=300).start_seconds

    t = threading.Thread(target=chaos)
    t.start()
    try:
        out = client.generate(prompts, params)
    finally:
        t.join()
    assert 4 <= events["killed_after"] < n_prompts * n, events
    assert [len(row) for row in out] == [n] * n_prompts
    rids = [s.meta["rid"] for row in out for s in row]
    assert len(set(rids)) == n_prompts * n
    for i, row in enumerate(out):
        for j, s in enumerate(row):
            assert s.meta["rid"].endswith(f"-{i}-{j}")
            assert len(s.tokens) == 48 and s.finish_reason == "length"
    assert client.metrics["samples"] == n_prompts * n
    assert client.metrics["connection_errors"] + client.metrics["http_5xx"] > 0
    assert client.metrics["retries"] > 0 and client.metrics["failures"] == 0
    assert sglang_server.healthy()
