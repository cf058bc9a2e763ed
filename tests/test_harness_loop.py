"""The collect phase with harness episodes (``rollout.harness``): each rollout of a group an
episode of a harness in the real sandbox, through a real in-process gateway on the embedded
sampler (the tiny policy); rows packed into the update's batch, scored by the update's own
program at the sampling weights."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from configs import toy_gagar
from gagar_jax.data import trajectories
from gagar_jax.envs.hf_tokenizer import HFTokenizer
from gagar_jax.rl import collect, harness_rollouts
from gagar_jax.rl.config import ConfigError, RunConfig
from gagar_jax.rollout.sampler import Sampler
from gagar_jax.update import UpdateConfig
from gagar_jax.update.alignment import behaviour_logprobs
from gagar_jax.update.step import _split, episode_token_advantages
from tests.gateway_fixtures import tiny_policy
from tests.hf_fixtures import make_tiny_tokenizer
from tests.test_harness import HTTP_HARNESS, TASK, _script


class RepoFamily:
    """The family's side the collect phase reads for harness episodes (the prompt, the task's
    id, the tokenizer); verification is the harness's own (``verify_harness_episode``)."""

    multi_turn = True
    stop_token_ids = ()

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_tokens(self, task):
        return self.tokenizer.encode(task.issue)

    def task_id(self, task):
        return task.task_id


def _cfg(**rollout):
    base = RunConfig.from_config_dict(toy_gagar.get_config("smoke"))
    r = dataclasses.replace(
        base.rollout,
        **{
            "num_prompts": 1,
            "num_rollouts": 2,
            "max_prompt_len": 256,
            "max_new_tokens": 256,
            "max_turn_tokens": 16,
            "temperature": 1.0,
            **rollout,
        },
    )
    learner = dataclasses.replace(base.learner, score_window=0, shared_prefix=False)
    return dataclasses.replace(base, rollout=r, learner=learner)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"harness": "openhands"}, "rollout.harness must be native|mini_swe_agent|command"),
        ({"harness": "command"}, "rollout.harness_command must be a non-empty command"),
        ({"harness_command": "true"}, "rollout.harness_command must be empty unless"),
        ({"harness_max_calls": 0}, "rollout.harness_max_calls must be >= 1"),
        (
            {"harness": "command", "harness_command": "true", "partial_rollout": True},
            "rollout.harness must be 'native' with partial rollouts",
        ),
    ],
)
def test_harness_fields_are_validated_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**fields)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return HFTokenizer(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_harness_groups_pack_into_rows_the_update_scores_exactly(tokenizer, tmp_path):
    model = tiny_policy(tokenizer)
    sampler = Sampler(
        model,
        pad_id=tokenizer.pad_id,
        batch_buckets=(1, 2),
        prompt_buckets=(256,),
        new_token_buckets=(16,),
    )
    cfg = _cfg(harness="command", harness_command=_script(HTTP_HARNESS), harness_max_wall_s=60)
    # the training loop's gateway records every episode under the run (RUN_DIR/episodes)
    run_dir = tmp_path / "run"
    harness_rollouts.harness_runner(sampler, tokenizer, cfg, record_dir=str(run_dir / "episodes"))
    counters = collect.StepCounters()
    (group,) = collect.generate_groups(
        sampler,
        RepoFamily(tokenizer),
        [TASK],
        cfg=cfg,
        step=0,
        round_id=0,
        num_rollouts=2,
        temperature=1.0,
        id_prefix="s0",
        counters=counters,
        prompt_seeds=[7],
    )
    assert len(group.rollouts) == 2
    for r in group.rollouts:
        # the harness's edit passes the hidden tests through the standard verifier
        assert r.passed and not r.infra_error, r.test_log[-2000:]
        assert r.harness_stats == {
            "segments": 1,
            "calls": 2,
            "tokens": len(r.prompt_tokens) + len(r.response_tokens),
            "untrained_segments": 0,
        }
        assert r.num_turns == 2 and sum(r.response_mask) == len([v for v in r.versions() if v >= 0])
        # the monitor and the graders read the gateway's record: the command's output
        events = r.attempt.trajectory()
        assert [e["kind"] for e in events] == ["action", "observation"] * 2
        assert events[1]["text"] == "a.py\ntests\n"
        assert "+x = 2" in r.patch
    # two episodes of one prompt, seeded apart
    assert group.rollouts[0].response_tokens != group.rollouts[1].response_tokens
    m = counters.metrics()
    assert (m["episode/segments"], m["episode/calls"]) == (1.0, 2.0)
    assert m["episode/tokens"] == np.mean(
        [len(r.prompt_tokens) + len(r.response_tokens) for r in group.rollouts]
    )
    batch = collect.pack_groups(
        [group],
        num_groups=1,
        num_rollouts=2,
        max_prompt_len=256,
        max_new_tokens=256,
        pad_id=tokenizer.pad_id,
    )
    graphdef, params = nnx.split(model)
    lp = np.asarray(
        behaviour_logprobs(
            params, batch, graphdef=graphdef, config=UpdateConfig(shared_prefix=False)
        )
    )
    mask = np.asarray(batch.response_mask)
    old = np.asarray(batch.old_logprobs)
    # every recorded call's completion, at its own position of the row
    assert mask.sum() == sum(sum(r.response_mask) for r in group.rollouts) > 0
    diff = (lp - old)[mask]
    log_ratio = old[mask] - lp[mask]
    k3 = float(np.mean(np.exp(-log_ratio) - 1 + log_ratio))
    assert np.max(np.abs(diff)) < 1e-5 and abs(k3) < 1e-9, (np.max(np.abs(diff)), k3)
    _check_export(run_dir, group, tokenizer, sampler, cfg)


def _check_export(run_dir, group, tokenizer, sampler, cfg):
    """The run's episode records export as ATIF and read back to the calls each rollout was
    trained on; a gateway started again on the directory keeps them, and the same episode
    drawn again gets a new id."""
    files = trajectories.export(str(run_dir), fmt="atif")
    assert len(files) == len(group.rollouts) == 2
    by_id = {}
    for path in files:
        traj = trajectories.read_atif(path)
        by_id[traj["session_id"]] = traj
    for r in group.rollouts:
        ep = r.attempt.harness
        traj = by_id[ep.episode_id]
        calls = trajectories.atif_calls(traj)
        assert calls == [
            {k: c[k] for k in ("index", "prompt_ids", "completion_ids", "logprobs",
                               "policy_version", "linked_call")}
            for c in ep.record["calls"]
        ]  # fmt: skip
        # the row the update trained: the first call's prompt, then every completion with its
        # recorded log-probs (tool results between them, mask 0)
        assert r.prompt_tokens == calls[0]["prompt_ids"]
        trained = [t for t, m in zip(r.response_tokens, r.response_mask) if m]
        assert trained == [t for c in calls for t in c["completion_ids"]]
        lps = [x for x, m in zip(r.logprobs, r.response_mask) if m]
        assert lps == [x for c in calls for x in c["logprobs"]]
        # this harness sends its command's output back as a user message
        assert [st["source"] for st in traj["steps"]] == ["user", "agent", "user", "agent"]
        assert traj["steps"][2]["message"] == "a.py\ntests\n"
        assert traj["final_metrics"]["extra"]["status"] == "finished"
    # a gateway started again on the records (a resumed run): the episodes are kept
    from gagar_jax.rollout.gateway.sessions import SessionStore

    store = SessionStore(str(run_dir / "episodes"))
    eid = group.rollouts[0].attempt.harness.episode_id
    assert store.known(eid) and store.finished(eid)["calls"]
    runner = harness_rollouts.harness_runner(sampler, tokenizer, cfg)
    assert harness_rollouts._fresh_id(runner, eid) == eid + "-r1"
    with pytest.raises(ValueError, match="this engine's gateway records to"):
        harness_rollouts.harness_runner(sampler, tokenizer, cfg, record_dir=str(run_dir / "x"))


# A harness that compacts its history: its second call starts from a summary, not from the
# first call's messages (a new segment of the same episode).
COMPACTING_HARNESS = HTTP_HARNESS.replace(
    'm += [answer, {"role": "user", "content": out}]',
    'm = [{"role": "user", "content": "summary of the work so far: " + out}]',
)


def test_edited_history_trains_every_segment_as_a_row_of_its_episode(tokenizer):
    model = tiny_policy(tokenizer)
    sampler = Sampler(
        model,
        pad_id=tokenizer.pad_id,
        batch_buckets=(1, 2),
        prompt_buckets=(256,),
        new_token_buckets=(16,),
    )
    cfg = _cfg(
        harness="command",
        harness_command=_script(COMPACTING_HARNESS),
        harness_max_wall_s=60,
        harness_max_segments=2,
    )
    counters = collect.StepCounters()
    (group,) = collect.generate_groups(
        sampler,
        RepoFamily(tokenizer),
        [TASK],
        cfg=cfg,
        step=0,
        round_id=0,
        num_rollouts=2,
        temperature=1.0,
        id_prefix="s0",
        counters=counters,
        prompt_seeds=[3],
    )
    for r in group.rollouts:
        assert r.harness_stats["segments"] == 2 and r.harness_stats["untrained_segments"] == 0
        assert len(r.extra_segments) == 1 and sum(r.extra_segments[0]["response_mask"]) > 0
    m = counters.metrics()
    assert (m["episode/segments"], m["episode/calls"]) == (2.0, 2.0)
    assert m["episode/untrained_segments"] == 0.0
    with pytest.raises(ValueError, match="more than max_segments=1"):
        collect.pack_groups(
            [group],
            num_groups=1,
            num_rollouts=2,
            max_prompt_len=256,
            max_new_tokens=256,
            pad_id=tokenizer.pad_id,
        )
    batch = collect.pack_groups(
        [group],
        num_groups=1,
        num_rollouts=2,
        max_prompt_len=256,
        max_new_tokens=256,
        pad_id=tokenizer.pad_id,
        max_segments=2,
    )
    assert batch.tokens.shape[0] == 4 and list(batch.row_episode) == [0, 1, 0, 1]
    graphdef, params = nnx.split(model)
    lp = np.asarray(
        behaviour_logprobs(
            params, batch, graphdef=graphdef, config=UpdateConfig(shared_prefix=False)
        )
    )
    mask = np.asarray(batch.response_mask)
    old = np.asarray(batch.old_logprobs)
    # both calls of each episode, each in its own row, scored as sampled
    assert mask[2:].sum() > 0 and mask.sum() == sum(
        sum(r.response_mask) + sum(r.extra_segments[0]["response_mask"]) for r in group.rollouts
    )
    assert np.max(np.abs(lp - old)[mask]) < 1e-5
    # token-level credit as the update runs it: each episode's credit is conserved over its
    # two rows (not row by row: the statistics span the episode)
    adv = np.array([0.75, -0.5], np.float32)
    ids = np.asarray(batch.row_episode)
    tok, err = episode_token_advantages(
        params,
        {
            f: _split(np.asarray(getattr(batch, f)), 1, 1, None)
            for f in ("tokens", "positions", "attention_mask", "response_mask")
        },
        adv,
        ids,
        graphdef=graphdef,
        config=UpdateConfig(shared_prefix=False, token_credit="entropy", token_gamma=1.0),
    )
    tok = np.asarray(tok)
    assert float(err) < 1e-6
    for e in range(2):
        np.testing.assert_allclose(tok[ids == e].sum(), adv[e] * mask[ids == e].sum(), rtol=1e-5)
    # the same episodes with one segment per row budget: the second is counted, not trained
    cfg1 = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, harness_max_segments=1)
    )
    counters = collect.StepCounters()
    (group1,) = collect.generate_groups(
        sampler,
        RepoFamily(tokenizer),
        [TASK],
        cfg=cfg1,
        step=0,
        round_id=0,
        num_rollouts=2,
        temperature=1.0,
        id_prefix="s0",
        counters=counters,
        prompt_seeds=[3],
    )
    assert counters.metrics()["episode/untrained_segments"] == 2.0
    assert all(not r.extra_segments for r in group1.rollouts)


def test_a_dead_engine_makes_masked_counted_infra_errors(tokenizer, tmp_path):
    import socket

    from gagar_jax.rollout import SGLangClient
    from gagar_jax.rollout.sglang_engine import SGLangEngine

    with socket.socket() as s:  # a port nothing listens on: the SGLang server is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    client = SGLangClient(url, request_timeout_s=2.0, max_retry_time_s=1.0)
    engine = SGLangEngine(client, export_fn=None, sync_dir=str(tmp_path))
    cfg = _cfg(
        engine="sglang",
        sglang_url=url,
        harness="command",
        harness_command=_script(HTTP_HARNESS),
        harness_max_wall_s=60,
    )
    counters = collect.StepCounters()
    (group,) = collect.generate_groups(
        engine,
        RepoFamily(tokenizer),
        [TASK],
        cfg=cfg,
        step=0,
        round_id=0,
        num_rollouts=2,
        temperature=1.0,
        id_prefix="dead",
        counters=counters,
        prompt_seeds=[1],
    )
    assert [r.infra_error for r in group.rollouts] == [True, True]
    assert group.outcome == "empty" and group.valid_mask() == [False, False]
    assert "engine:" in group.rollouts[0].test_log
    assert counters.metrics()["infra_errors"] == 2.0
