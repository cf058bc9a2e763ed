"""The task families behind ``gagar_jax.envs.family``: toy (unchanged), toy_agent (multi-turn
tools, in-process tests) and python_repo (chat template, Hermes tool calls, real sandbox)."""

import json

import pytest
from hf_fixtures import fixture_pool, make_tiny_tokenizer

from gagar_jax.envs import TOKENIZER, candidate_patches, verify
from gagar_jax.envs.family import (
    Attempt,
    Demonstration,
    FamilySettings,
    GroupMember,
    Outcome,
    TaskFamily,
    family_names,
    make_family,
)
from gagar_jax.grading.schema import GroupWorkspace
from gagar_jax.rollout import Sample, SamplingParams, parse_action, run_episodes


class ReplayEngine:
    """A scripted policy (not a mock of a fault): turn ``t`` of episode ``e`` returns the
    given token ids with log-prob -0.5 each, so token alignment can be checked exactly."""

    def __init__(self, turns_per_episode):
        self.turns = turns_per_episode
        self.calls = []
        self.turn = [0] * len(turns_per_episode)
        self.contexts = {}

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params))
        out = []
        for ctx in prompts:
            e = self._episode(ctx)
            toks = self.turns[e][self.turn[e]]
            self.turn[e] += 1
            out.append([Sample(list(toks), [-0.5] * len(toks), "stop", 3)])
        return out

    def _episode(self, ctx):
        for e, prefix in self.contexts.items():
            if list(ctx[: len(prefix)]) == prefix:
                return e
        raise AssertionError("unknown context")

    def sync_weights(self, params, version):
        return version


def test_registry_names_the_three_families_and_rejects_others():
    assert {"toy", "toy_agent", "python_repo"} <= set(family_names())
    with pytest.raises(ValueError, match="task.family must be one of"):
        make_family("toys")


# ------------------------------------------------------------------------------------ toy
@pytest.fixture(scope="module")
def toy():
    return make_family("toy", FamilySettings(num_train=8, num_eval=3, max_prompt_len=128))


def test_toy_is_the_single_turn_family_unchanged(toy):
    assert isinstance(toy, TaskFamily) and not toy.multi_turn
    assert toy.tokenizer is TOKENIZER and toy.stop_token_ids == (TOKENIZER.eos_id,)
    task = toy.train_task(5)
    assert task.task_id == "toy-d1-s0-5"  # ToyTaskGenerator(seed=0, difficulty=1).task(5)
    assert toy.prompt_tokens(task) == TOKENIZER.encode(task.prompt)
    assert [t.task_id for t in toy.eval_tasks()] == [f"toy-d1-s1000003-{i}" for i in range(3)]
    with pytest.raises(IndexError):
        toy.train_task(8)
    short = make_family("toy", FamilySettings(max_prompt_len=5))
    with pytest.raises(ValueError, match="rollout.max_prompt_len=5"):
        short.prompt_tokens(task)


def test_toy_verify_matches_the_toy_verifier(toy):
    task = toy.train_task(0)
    for kind, patch in candidate_patches(task).items():
        v = verify(task, patch)
        out = toy.verify(task, Attempt(text=patch))
        assert (out.passed, out.cheat, out.infra_error) == (v.passed, v.cheat, v.infra_error), kind
        assert out.test_log == v.test_log and out.patch == patch and out.detail == v
        assert bool(out.quality) == v.passed


def test_toy_demonstrations_are_prompt_patch_eos(toy):
    demos = toy.demonstrations(2)
    tasks = {tuple(toy.prompt_tokens(t)): t for t in toy._sft.tasks(2)}
    assert demos and all(isinstance(d, Demonstration) for d in demos)
    assert not set(tasks.values()) & {toy.train_task(i) for i in range(8)}  # own seed
    for d in demos:
        task = tasks[d.tokens[: d.prompt_len]]
        assert d.tokens[-1] == TOKENIZER.eos_id
        assert not any(d.loss_mask[: d.prompt_len]) and all(d.loss_mask[d.prompt_len :])
        v = verify(task, TOKENIZER.decode(d.tokens[d.prompt_len :]))
        assert v.passed and not v.cheat


def test_toy_workspace_holds_every_candidate(toy):
    task = toy.train_task(1)
    patches = candidate_patches(task)
    members = [
        GroupMember(f"g/{i}", Attempt(text=p), toy.verify(task, Attempt(text=p)))
        for i, p in enumerate([patches["minimal"], patches["noop"]])
    ]
    ws = toy.workspace("g", task, members)
    assert isinstance(ws, GroupWorkspace)
    assert [c.candidate_id for c in ws.candidates] == ["g/0", "g/1"]
    assert [c.passed for c in ws.candidates] == [True, False]
    assert "program.toy" in ws.repo_files


# ------------------------------------------------------------------------------ toy_agent
@pytest.fixture(scope="module")
def agent():
    return make_family("toy_agent", FamilySettings(num_train=8, num_eval=2, max_prompt_len=128))


def test_agent_tokenizer_keeps_every_toy_id(agent):
    tok = agent.tokenizer
    assert tok.vocab[: TOKENIZER.vocab_size] == TOKENIZER.vocab
    assert tok.vocab_size > TOKENIZER.vocab_size
    for word in ("read_file", "edit", "run_tests", "submit"):
        assert tok.encode(word) != [tok.unk_id]
    task = agent.train_task(0)
    assert "tools read_file edit run_tests submit" in tok.decode(agent.prompt_tokens(task))


def test_agent_tools_over_the_program(agent):
    task = agent.train_task(2)
    env = agent.make_env(task)
    r = env.step("read_file")
    assert r.observation.splitlines()[0].startswith("1 : ") and not r.done
    assert env.step("frobnicate").observation.startswith("error")
    assert env.step("edit\n99 : return x").observation.startswith("error")  # outside the program
    assert env.patch == ""
    fails = env.step("run_tests").observation
    assert fails.startswith("tests failed") and " got " in fails  # the bug fails a test
    assert env.step(f"edit\n{task.reference_patch}").observation == "edited"
    assert env.step("run_tests").observation == "tests passed"
    assert not env.submitted
    r = env.step("submit")
    assert r.done and env.submitted and env.patch == task.reference_patch
    out = agent.verify(task, Attempt(env=env))
    assert out.passed and not out.cheat and out.patch == task.reference_patch


def test_agent_unsubmitted_episode_fails_and_a_cheat_is_flagged(agent):
    task = agent.train_task(3)
    env = agent.make_env(task)
    env.step(f"edit\n{task.reference_patch}")
    out = agent.verify(task, Attempt(env=env))
    assert not out.passed and not out.infra_error and "without submit" in out.test_log
    env = agent.make_env(task)
    env.step("edit\n" + candidate_patches(task)["cheat"])
    env.step("submit")
    out = agent.verify(task, Attempt(env=env))
    assert out.passed and out.cheat and out.flags


def test_agent_demonstrations_replayed_through_run_episodes_align(agent):
    """The demonstration's model-token spans, replayed as a policy through ``run_episodes``,
    give exactly the demonstration's tokens and mask: observations are what the environment
    returns and model tokens are appended as generated."""
    tok = agent.tokenizer
    demos = agent.demonstrations(1)
    demo = demos[0]
    turns, cur = [], []
    for t, m in zip(demo.tokens[demo.prompt_len :], demo.loss_mask[demo.prompt_len :]):
        if m:
            cur.append(t)
            if t == tok.eos_id:
                turns.append(cur)
                cur = []
    assert len(turns) == 4  # read_file, edit, run_tests, submit
    task = agent._sft.tasks(1)[0]
    prompt = agent.prompt_tokens(task)
    engine = ReplayEngine([turns])
    engine.contexts = {0: list(prompt)}
    (ep,) = run_episodes(
        engine,
        tok,
        [agent.make_env(task)],
        [prompt],
        SamplingParams(max_tokens=32, stop_token_ids=(tok.eos_id,)),
        max_turns=6,
        max_total_tokens=len(prompt) + 200,
        observation_tokens=agent.observation_tokens,
    )
    assert ep.finish_reason == "submitted" and len(ep.turns) == 4
    assert tuple(ep.tokens) == demo.tokens
    assert tuple(bool(m) for m in ep.response_mask) == demo.loss_mask
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(ep.logprobs, ep.response_mask))
    a = Attempt(response_tokens=ep.tokens[len(prompt) :], episode=ep, env=None)
    kinds = [e["kind"] for e in a.trajectory()]
    assert kinds == ["tool_call", "observation"] * 4


# ---------------------------------------------------------------------------- python_repo
@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("repo_family")
    tok_dir = make_tiny_tokenizer(d / "tok")
    pool = fixture_pool(d / "pool.jsonl")
    return make_family(
        "python_repo",
        FamilySettings(data_path=pool, tokenizer_path=tok_dir, num_eval=0, max_prompt_len=1024),
    )


def test_repo_family_needs_a_tokenizer_and_a_pool(tmp_path):
    with pytest.raises(ValueError, match="tokenizer_path or model.hf_checkpoint"):
        make_family("python_repo", FamilySettings(data_path=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        make_family("python_repo", FamilySettings(tokenizer_path=str(tmp_path)))


def test_repo_prompt_through_the_chat_template(repo):
    tok = repo.tokenizer
    assert tok.eos_id == tok.token_id("<|im_end|>") and tok.pad_id == tok.token_id("<|endoftext|>")
    task = repo.train_task(0)
    text = tok.decode(repo.prompt_tokens(task), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou may call these tools:")
    assert '"name": "read_file"' in text and '"name": "submit"' in text
    assert task.issue in text and text.endswith("<|im_start|>assistant\n")
    obs = tok.decode(repo.observation_tokens("hello"), skip_special_tokens=False)
    assert obs == "\n<|im_start|>tool\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_repo_tool_calls_parse_from_model_tokens(repo):
    from gagar_jax.envs.hf_tokenizer import tool_call_text

    tok = repo.tokenizer
    ids = tok.encode(tool_call_text("edit", {"path": "a.py", "old": "x", "new": "y"}))
    call = parse_action(tok.decode(ids + [tok.eos_id]))
    assert call.name == "edit" and call.arguments == {"path": "a.py", "old": "x", "new": "y"}


def test_repo_episode_verified_with_hidden_tests_in_the_sandbox(repo):
    """slugger's fail-to-pass test exists only in the hidden test patch: run_tests cannot see
    it, the final verification runs it."""
    from gagar_jax.envs.hf_tokenizer import tool_call_text

    task = next(
        t
        for t in (repo.train_task(i) for i in range(repo.num_train))
        if t.task_id.startswith("slugger")
    )
    env = repo.make_env(task)
    for name, args in repo.demonstration_calls(task)[:-2]:
        env.step(tool_call_text(name, args))
    r = env.step(tool_call_text("run_tests", {}))
    assert "not in the visible tests" in r.observation
    assert not env.submitted
    unsubmitted = repo.verify(task, Attempt(env=env))
    assert not unsubmitted.passed and "without submit" in unsubmitted.test_log
    assert env.step(tool_call_text("submit", {})).done
    out = repo.verify(task, Attempt(env=env))
    assert out.passed and not out.cheat and not out.infra_error, out.test_log
    assert "test_collapses_runs" in out.test_log  # the hidden test ran
    assert out.patch.startswith("--- a/slugger/slug.py")


def test_repo_agent_that_edits_the_tests_is_not_rewarded(repo):
    """An agent that rewrites the test file: the verifier resets it, the monitor flags it."""
    from gagar_jax.envs.hf_tokenizer import tool_call_text

    task = next(
        t
        for t in (repo.train_task(i) for i in range(repo.num_train))
        if t.task_id.startswith("statkit")
    )
    env = repo.make_env(task)
    env.step(
        tool_call_text(
            "edit",
            {"path": "tests/test_stats.py", "content": "def test_median_even():\n    pass\n"},
        )
    )
    env.step(tool_call_text("submit", {}))
    out = repo.verify(task, Attempt(env=env))
    assert not (out.passed and not out.cheat)
    assert out.cheat or "reset to pristine" in out.test_log


def test_repo_demonstrations_and_workspace(repo):
    demos = repo.demonstrations(2)
    assert len(demos) == 2
    tok = repo.tokenizer
    for d in demos:
        model_text = tok.decode(
            [t for t, m in zip(d.tokens, d.loss_mask) if m], skip_special_tokens=False
        )
        assert model_text.count("<tool_call>") == model_text.count("<|im_end|>") >= 4
        obs_text = tok.decode(
            [t for t, m in zip(d.tokens[d.prompt_len :], d.loss_mask[d.prompt_len :]) if not m],
            skip_special_tokens=False,
        )
        assert "<|im_start|>tool" in obs_text and "<tool_call>" not in obs_text
        calls = [
            json.loads(b.split("</tool_call>")[0])["name"]
            for b in model_text.split("<tool_call>")[1:]
        ]
        assert calls[0] == "read_file" and calls[-2:] == ["run_tests", "submit"]
    task = repo.train_task(0)
    ok = Outcome(passed=True, test_log="PASSED x", patch="")
    bad = Outcome(passed=False, test_log="FAILED x", patch="")
    ws = repo.workspace(
        "g", task, [GroupMember("g/0", Attempt(), ok), GroupMember("g/1", Attempt(), bad)]
    )
    assert ws.repo_files == dict(task.files) and ws.task_text == task.issue
    assert [c.passed for c in ws.candidates] == [True, False]


# ---------------------------------------------------------------------------- toy on HF ids
def test_toy_on_a_hugging_face_tokenizer_speaks_its_ids(tmp_path):
    """The toy family on an HF checkpoint's tokenizer (an SGLang-served policy): prompts
    through its chat template, responses decoded with it and verified as toy patches, so the
    ids the served model samples are the ids the family reads; toy_agent refuses one."""
    tok_dir = make_tiny_tokenizer(tmp_path / "tok")
    fam = make_family(
        "toy", FamilySettings(tokenizer_path=tok_dir, num_train=4, num_eval=2, max_prompt_len=256)
    )
    assert fam.tokenizer.vocab_size == 1024 and fam.tokenizer is not TOKENIZER
    task = fam.train_task(0)
    ids = fam.prompt_tokens(task)
    text = fam.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\n") and task.prompt in text
    assert text.endswith("<|im_start|>assistant\n")
    patch = candidate_patches(task)["minimal"]
    response = fam.tokenizer.encode(patch) + [fam.tokenizer.eos_id]
    out = fam.verify(task, Attempt(response_tokens=response, text=fam.tokenizer.decode(response)))
    assert out.passed and out.patch == patch
    assert not fam.verify(task, Attempt(response_tokens=[5, 6], text="del 1")).passed
    assert fam.token_spans(task, Attempt(response_tokens=response)) is None
    demo = fam.demonstrations(2)[0]
    assert demo.tokens[-1] == fam.tokenizer.eos_id and max(demo.tokens) < 1024
    with pytest.raises(ValueError, match="toy_agent.*own vocabulary"):
        make_family("toy_agent", FamilySettings(tokenizer_path=tok_dir))
