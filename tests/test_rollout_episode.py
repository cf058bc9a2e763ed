"""Multi-turn episodes on a scripted code-agent environment: masks, spans, logprobs, summaries."""

import json

import pytest

from gagar_jax.rollout import (
    CodeAgentEnv,
    Sample,
    SamplingParams,
    ToolCall,
    advance_episodes,
    episode,
    finish_episodes,
    parse_action,
    restore_episodes,
    run_episode,
    run_episodes,
    start_episodes,
)


class CharTokenizer:
    """Byte-level tokenizer: every character is its code point (vocab 0x110000)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


TOK = CharTokenizer()


class ScriptedEngine:
    """A model stand-in that answers each episode with its next scripted turn.

    It is the *policy* that is scripted here (the environment is real); each sample's logprobs
    are a recognisable function of (episode, turn, position) so the test can find them again.
    """

    def __init__(self, prompts, scripts, finish="stop"):
        self.prompts = [list(p) for p in prompts]
        self.scripts = scripts
        self.turn = [0] * len(prompts)
        self.calls = []
        self.finish = finish

    def which(self, context):
        for e, p in enumerate(self.prompts):
            if context[: len(p)] == p:
                return e
        raise AssertionError("unknown context")

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.max_tokens))
        out = []
        for ctx in prompts:
            e = self.which(list(ctx))
            t = self.turn[e]
            self.turn[e] += 1
            text = self.scripts[e][t] if t < len(self.scripts[e]) else "noop"
            ids = TOK.encode(text)[: params.max_tokens]
            lps = [-(e + 1) * 0.01 - t * 0.1 - k * 1e-4 for k in range(len(ids))]
            fin = "length" if len(ids) < len(TOK.encode(text)) else self.finish
            out.append([Sample(ids, lps, fin, policy_version=3 + t)])
        return out

    async def agenerate(self, prompts, params):
        return self.generate(prompts, params)

    def sync_weights(self, params_or_path, version):
        return version


def run_tests(files):
    ok = "return a + b" in files["calc.py"]
    return ok, "1 passed" if ok else "FAILED test_add: 1 - 2 != 3"


REPO = {"calc.py": "def add(a, b):\n    return a - b\n", "README": "calc\n"}
FIX = {"name": "edit", "arguments": {"path": "calc.py", "old": "a - b", "new": "a + b"}}
SCRIPT = [
    "read_file calc.py",
    "run_tests",
    f"<tool_call>{json.dumps(FIX)}</tool_call>",
    "run_tests",
    "submit",
]
OBS = "\n<observation>\n{}\n</observation>\n"


def test_parse_action_forms():
    assert parse_action("read_file a.py") == ToolCall("read_file", {"path": "a.py"})
    assert parse_action("  run_tests \n") == ToolCall("run_tests", {})
    assert parse_action("edit a.py\nx = 1\n") == ToolCall(
        "edit", {"path": "a.py", "content": "x = 1\n"}
    )
    call = parse_action('think... <tool_call>{"name": "submit", "arguments": "{}"}</tool_call>')
    assert call == ToolCall("submit", {})
    assert parse_action("<tool_call>{not json}</tool_call>") is None
    assert parse_action("hello world") is None
    assert parse_action("") is None


def test_episode_masks_spans_logprobs_and_summaries():
    prompt = TOK.encode("Fix add() in calc.py.\n")
    env = CodeAgentEnv(REPO, run_tests)
    engine = ScriptedEngine([prompt], [SCRIPT])
    ep = run_episode(
        engine,
        TOK,
        env,
        prompt,
        SamplingParams(max_tokens=200),
        max_turns=10,
        max_total_tokens=4000,
    )

    assert ep.finish_reason == "submitted"
    assert len(ep.turns) == len(SCRIPT)
    assert len(ep.tokens) == len(ep.response_mask) == len(ep.logprobs)
    assert ep.tokens[: len(prompt)] == prompt and ep.prompt_len == len(prompt)

    # Rebuild the expected sequence by hand: prompt, then (model turn, observation) pairs.
    observations = [
        REPO["calc.py"],
        "tests failed\nFAILED test_add: 1 - 2 != 3",
        "edited calc.py",
        "tests passed\n1 passed",
        None,
    ]  # submit ends the episode: no observation
    expected, mask = list(prompt), [0] * len(prompt)
    for text, obs in zip(SCRIPT, observations):
        expected += TOK.encode(text)
        mask += [1] * len(text)
        if obs is not None:
            o = TOK.encode(OBS.format(obs))
            expected += o
            mask += [0] * len(o)
    assert ep.tokens == expected
    assert ep.response_mask == mask
    assert ep.num_model_tokens == sum(len(t) for t in SCRIPT)

    for t, turn in enumerate(ep.turns):
        a, b = turn.model_span
        assert TOK.decode(ep.tokens[a:b]) == SCRIPT[t]
        assert all(m == 1 for m in ep.response_mask[a:b])
        assert ep.logprobs[a:b] == pytest.approx([-0.01 - t * 0.1 - k * 1e-4 for k in range(b - a)])
        oa, ob = turn.observation_span
        assert oa == b
        assert all(m == 0 for m in ep.response_mask[oa:ob])
        assert all(lp == 0.0 for lp in ep.logprobs[oa:ob])
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.response_mask) if m == 0)

    assert ep.summaries() == [
        "turn 0: read_file calc.py (2 lines)",
        "turn 1: run_tests: failed",
        "turn 2: edit calc.py",
        "turn 3: run_tests: passed",
        "turn 4: submit: tests passed",
    ]
    assert ep.policy_versions == [3, 4, 5, 6, 7]
    assert ep.info["passed"] is True
    assert "-    return a - b" in ep.info["patch"] and "+    return a + b" in ep.info["patch"]
    assert [e["summary"] for e in ep.trajectory()] == ep.summaries()
    assert env.counts == {"invalid_actions": 0, "test_runs": 3, "edits": 1}


def test_batched_episodes_end_independently():
    # Observations are cut to 20 tokens so every episode's length is easy to count by hand.
    prompts = [TOK.encode("task A\n"), TOK.encode("task B\n"), TOK.encode("task C\n" + "#" * 83)]
    scripts = [
        ["read_file calc.py", "submit"],  # submits (failing) after 2 turns
        ["hello?", "cat calc.py", "run_tests"],  # two invalid actions, never submits -> max_turns
        ["read_file README", "read_file calc.py", "submit"],  # runs out of tokens in turn 1
    ]
    envs = [CodeAgentEnv(REPO, run_tests) for _ in prompts]
    engine = ScriptedEngine(prompts, scripts)
    eps = run_episodes(
        engine,
        TOK,
        envs,
        prompts,
        SamplingParams(max_tokens=20),
        max_turns=3,
        max_total_tokens=150,
        max_observation_tokens=20,
    )
    assert [e.finish_reason for e in eps] == ["submitted", "max_turns", "max_tokens"]
    assert (
        eps[0].info["passed"] is False
        and eps[0].turns[-1].summary == "turn 1: submit: tests failed"
    )
    assert envs[1].counts["invalid_actions"] == 2
    assert eps[1].turns[0].observation.startswith("error: no valid tool call")
    # A: 7 + (17 + 20) + 6; B: 7 + (6 + 20) + (11 + 20) + (9 + 20);
    # C: 90 + (16 + 20) + 17, then its second observation is cut to the 7 tokens left of 150.
    assert [len(e.tokens) for e in eps] == [50, 93, 150]
    assert [e.num_model_tokens for e in eps] == [23, 26, 33]
    # One engine call per turn for all live episodes (3, then 3, then the one left).
    assert engine.calls == [(3, 20), (3, 20), (1, 20)]
    for ep in eps:
        assert len(ep.tokens) == len(ep.response_mask) == len(ep.logprobs)
        for turn in ep.turns:
            a, b = turn.model_span
            assert set(ep.response_mask[a:b]) <= {1}
            assert set(ep.response_mask[b : turn.observation_span[1]]) <= {0}


def test_turn_budget_shrinks_near_the_token_budget():
    prompt = TOK.encode("p\n")
    engine = ScriptedEngine([prompt], [["read_file calc.py", "x" * 500]])
    ep = run_episode(
        engine,
        TOK,
        CodeAgentEnv(REPO, run_tests),
        prompt,
        SamplingParams(max_tokens=400),
        max_turns=4,
        max_total_tokens=200,
    )
    assert engine.calls[0][1] == 198 and engine.calls[1][1] < 198
    assert len(ep.tokens) == 200 and ep.finish_reason == "max_tokens"
    assert ep.turns[-1].finish_reason == "length"


def test_episode_argument_errors():
    env = CodeAgentEnv(REPO, run_tests)
    eng = ScriptedEngine([[1]], [["submit"]])
    with pytest.raises(ValueError, match="n == 1"):
        run_episodes(eng, TOK, [env], [[1]], SamplingParams(n=2))
    with pytest.raises(ValueError, match="same length"):
        run_episodes(eng, TOK, [env, env], [[1]], SamplingParams())
    with pytest.raises(ValueError, match="max_total_tokens"):
        run_episodes(eng, TOK, [env], [[1] * 10], SamplingParams(), max_total_tokens=10)


class ChunkEngine:
    """A stateless model stand-in for chunked turns: each call's seed names the chunk (episode,
    turn, position in the turn, from the seeds the test expects), and the answer is the next
    ``max_tokens`` characters of that turn's scripted text after that position (``stop`` at its
    end). It checks that the context ends with the turn's tokens so far."""

    def __init__(self, scripts, episode_seeds):
        self.scripts = scripts
        self.by_seed = {
            episode._chunk_seed(s, t, pos): (e, t, pos)
            for e, s in enumerate(episode_seeds)
            for t in range(len(scripts[e]))
            for pos in range(len(scripts[e][t]) + 1)
        }
        self.version = 0
        self.calls = []

    def generate(self, prompts, params, prompt_seeds):
        self.calls.append(len(prompts))
        out = []
        for ctx, seed in zip(prompts, prompt_seeds):
            e, t, pos = self.by_seed[seed]
            text = TOK.encode(self.scripts[e][t])
            if pos:  # the turn so far follows the episode's history
                assert list(ctx[len(ctx) - pos :]) == text[:pos]
            ids = text[pos : pos + params.max_tokens]
            lps = [-(e + 1) * 0.01 - t * 0.1 - (pos + k) * 1e-4 for k in range(len(ids))]
            fin = "stop" if pos + len(ids) == len(text) else "length"
            out.append([Sample(ids, lps, fin, policy_version=self.version)])
        return out


def test_chunked_turns_stop_mid_turn_and_resume_exactly():
    prompts = [TOK.encode("task A\n"), TOK.encode("task B\n")]
    scripts = [
        ["read_file calc.py", f"<tool_call>{json.dumps(FIX)}</tool_call>", "submit"],
        ["hello?", "run_tests", "read_file README"],
    ]
    seeds = [11, 12]
    params = SamplingParams(max_tokens=200)
    kw = dict(max_observation_tokens=20, chunk_tokens=4)

    def fresh():
        envs = [CodeAgentEnv(REPO, run_tests) for _ in prompts]
        return envs, start_episodes(prompts, max_total_tokens=400, episode_seeds=seeds)

    engine = ChunkEngine(scripts, seeds)
    envs, batch = fresh()
    advance_episodes(engine, TOK, envs, batch, params, until_turn=3, **kw)
    whole = finish_episodes(batch)
    # each turn is its whole scripted text, as the environment saw it; one engine call per
    # chunk of 4 over the episodes still in the turn
    for ep, script in zip(whole, scripts):
        assert [TOK.decode(ep.tokens[slice(*t.model_span)]) for t in ep.turns] == script
        assert set(ep.token_versions) <= {-1, 0}
    chunks = [[-(-len(s) // 4) for s in turn] for turn in zip(*scripts)]
    assert engine.calls == [sum(c > j for c in turn) for turn in chunks for j in range(max(turn))]

    # stopped after two chunks of the second turn, saved, replayed, resumed at version 9
    engine = ChunkEngine(scripts, seeds)
    envs, batch = fresh()
    advance_episodes(engine, TOK, envs, batch, params, until_turn=1, until_chunk=2, **kw)
    assert (batch.next_turn, batch.next_chunk) == (1, 2)
    assert [len(e.part_tokens) for e in batch.live] == [8, 8]
    with pytest.raises(ValueError, match="middle of a turn"):
        finish_episodes(batch)
    with pytest.raises(ValueError, match="chunk_tokens"):
        advance_episodes(engine, TOK, envs, batch, params, until_turn=3)
    state = json.loads(json.dumps(batch.state_dict()))
    envs = [CodeAgentEnv(REPO, run_tests) for _ in prompts]
    back = restore_episodes(state, envs, TOK, max_observation_tokens=20)
    engine.version = 9
    advance_episodes(engine, TOK, envs, back, params, until_turn=3, **kw)
    resumed = finish_episodes(back)
    for ep, w in zip(resumed, whole):
        assert (ep.tokens, ep.logprobs, ep.response_mask) == (w.tokens, w.logprobs, w.response_mask)
        a, b = ep.turns[1].model_span
        assert ep.token_versions[a:b] == [0] * 8 + [9] * (b - a - 8)  # mid-turn across the sync
        assert ep.policy_versions[:2] == [0, 0] and set(ep.policy_versions[2:]) <= {9}
    assert envs[0].counts["edits"] == 1  # the resumed turn reached the environment whole


def test_chunked_turns_need_episode_seeds():
    batch = start_episodes([[1, 2]], max_total_tokens=50)
    with pytest.raises(ValueError, match="episode_seeds"):
        advance_episodes(
            ChunkEngine([["x"]], [0]),
            TOK,
            [CodeAgentEnv(REPO, run_tests)],
            batch,
            SamplingParams(),
            until_turn=1,
            chunk_tokens=4,
        )
