"""Recorded routes travel with the tokens through the RL loop: single-turn samples, multi-turn
episodes (observation tokens from the next turn's prefill), partial rollouts interrupted
mid-turn or mid-sample and resumed (in the process and from their checkpoint form), queued
batches saved and restored, and the packed update batch. The smoke configs with a
mixture-of-experts policy and ``learner.routing_replay``."""

import json

import numpy as np
import pytest

from gagar_jax.rl import asynchronous, collect, engines, policy, train
from gagar_jax.rl.config import RunConfig
from gagar_jax.rl.multihost import prompt_seed
from tests.test_loop_pieces import load_config_module

K = 2
CHUNK = 8
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def moe_config(name: str, **rollout) -> RunConfig:
    d = load_config_module(name).get_config("smoke").to_dict()
    d["model"].update(MOE)
    d["rollout"].update(num_rollouts=K, **rollout)
    d["learner"]["routing_replay"] = True
    return RunConfig.from_config_dict(d)


def build(cfg):
    family = train.build_family(cfg)
    _, model = policy.build_model(cfg, family.tokenizer.vocab_size)
    engine = engines.build_engine(cfg, model, workdir="", pad_id=family.tokenizer.pad_id)
    return family, model, engine


def args(cfg, family, index):
    tasks = [family.train_task(i) for i in index]
    seeds = [prompt_seed([1, 2], 1, p) for p in range(len(tasks))]
    return tasks, dict(
        cfg=cfg, step=0, round_id=1, num_rollouts=K, temperature=1.0, prompt_seeds=seeds
    )


def routes_of(groups):
    return [r.routes.tolist() for g in groups for r in g.rollouts]


def check_routes(groups, model, *, last_observation_unknown=False):
    """Each rollout's routes cover its prompt and response; every model token has its
    experts (those the model's own forward picks, in float32: no rounding flips here)."""
    import jax.numpy as jnp

    for g in groups:
        for r in g.rollouts:
            toks = list(r.prompt_tokens) + list(r.response_tokens)
            assert r.routes.shape == (len(toks), model.config.num_layers, 2)
            known = (r.routes >= 0).all(axis=(1, 2))
            mask = r.response_mask or [1] * len(r.response_tokens)
            model_pos = [len(r.prompt_tokens) + i for i, m in enumerate(mask) if m]
            assert known[: len(r.prompt_tokens)].all() and known[model_pos].all()
            if not last_observation_unknown:
                assert known.all()
            _, own = model.hidden_states(
                jnp.asarray([toks]), jnp.arange(len(toks))[None], return_routes=True
            )
            own = np.sort(np.asarray(own[0]), -1)
            np.testing.assert_array_equal(np.sort(r.routes, -1)[known], own[known])


@pytest.fixture(scope="module")
def multi_turn():
    cfg = moe_config("toy_agent")
    return (cfg, *build(cfg))


def test_multi_turn_episodes_carry_routes_and_resume_them_exactly(multi_turn):
    cfg, family, model, engine = multi_turn
    assert engine.record_routes
    tasks, kw = args(cfg, family, (0, 1))
    whole = collect.generate_groups(engine, family, tasks, id_prefix="a", **kw)
    assert max(r.num_turns for g in whole for r in g.rollouts) > 1
    check_routes(whole, model, last_observation_unknown=True)
    started = collect.start_groups(engine, family, tasks, until_turn=1, **kw)
    resumed = collect.generate_groups(engine, family, tasks, id_prefix="a", started=started, **kw)
    assert routes_of(resumed) == routes_of(whole)
    started = collect.start_groups(engine, family, tasks, until_turn=2, **kw)
    sb = asynchronous.StartedBatch(
        index=3, version=0, position=0, n=[2], idx=[0, 1], pos=[0, 1], skipped=0, episodes=started
    )
    back = asynchronous.restore_started(
        json.loads(json.dumps(asynchronous.started_state(sb))), family, cfg
    )
    again = collect.generate_groups(
        engine, family, tasks, id_prefix="a", started=back.episodes, **kw
    )
    assert routes_of(again) == routes_of(whole)


def test_queued_batch_keeps_its_routes_through_its_checkpoint_form(multi_turn):
    cfg, family, _, engine = multi_turn
    tasks, kw = args(cfg, family, (0, 1))
    groups = collect.generate_groups(engine, family, tasks, id_prefix="q", **kw)
    for i, g in enumerate(groups):
        g.task_index = i
    counters = collect.StepCounters()
    for g in groups:
        counters.add(g)
    sres = collect.SamplingResult(groups, 1, len(groups), {"mixed": 2}, 0, 2 * K)
    collected = train.Collected(
        sampling=sres, counters=counters, submitted=(), attempts=(), wait_start=0.0
    )
    b = asynchronous.InflightBatch(5, 1, 10, collected=collected, completed_version=1)
    back = asynchronous.restore_batch(
        json.loads(json.dumps(asynchronous.batch_state(b))), family, [], cfg
    )
    assert routes_of(back.collected.sampling.groups) == routes_of(groups)


def test_packed_batch_holds_each_rollouts_routes(multi_turn):
    cfg, family, _, engine = multi_turn
    tasks, kw = args(cfg, family, (0, 1))
    groups = collect.generate_groups(engine, family, tasks, id_prefix="p", **kw)
    shape = train.route_shape(engine)
    assert shape == (engine.config.num_layers, 2)
    batch = collect.pack_groups(
        groups,
        num_groups=3,  # a padding group
        num_rollouts=K,
        max_prompt_len=cfg.rollout.max_prompt_len,
        max_new_tokens=cfg.rollout.max_new_tokens,
        pad_id=family.tokenizer.pad_id,
        route_shape=shape,
    )
    assert batch.routes.shape == batch.tokens.shape + shape
    for gi, g in enumerate(groups):
        for ki, r in enumerate(g.rollouts):
            n = len(r.prompt_tokens) + len(r.response_tokens)
            np.testing.assert_array_equal(batch.routes[gi * K + ki, :n], r.routes)
            assert (batch.routes[gi * K + ki, n:] == -1).all()
    assert (batch.routes[2 * K :] == -1).all()
    with pytest.raises(ValueError, match="routes of shape"):
        collect.pack_groups(
            groups,
            num_groups=2,
            num_rollouts=K,
            max_prompt_len=cfg.rollout.max_prompt_len,
            max_new_tokens=cfg.rollout.max_new_tokens,
            pad_id=family.tokenizer.pad_id,
            route_shape=(shape[0] + 1, 2),
        )


def test_single_turn_samples_interrupted_mid_sample_keep_their_routes():
    cfg = moe_config("toy_gagar", partial_chunk_tokens=CHUNK)
    family, model, engine = build(cfg)
    tasks, kw = args(cfg, family, (0, 1, 2, 3))
    whole = collect.generate_groups(engine, family, tasks, id_prefix="s", **kw)
    assert max(len(r.response_tokens) for g in whole for r in g.rollouts) > CHUNK
    check_routes(whole, model)
    started = collect.start_groups(engine, family, tasks, until_turn=0, until_chunk=1, **kw)
    sb = asynchronous.StartedBatch(
        index=1,
        version=0,
        position=0,
        n=[4],
        idx=[0, 1, 2, 3],
        pos=[0, 1, 2, 3],
        skipped=0,
        episodes=started,
    )
    back = asynchronous.restore_started(
        json.loads(json.dumps(asynchronous.started_state(sb))), family, cfg
    )
    resumed = collect.generate_groups(engine, family, tasks, id_prefix="s", started=started, **kw)
    assert routes_of(resumed) == routes_of(whole)
    again = collect.generate_groups(
        engine, family, tasks, id_prefix="s", started=back.episodes, **kw
    )
    assert routes_of(again) == routes_of(whole)
    # one engine call per sample (no chunks; other draws): its prompt and response routes
    plain = moe_config("toy_gagar")
    one_call = collect.generate_groups(
        engines.build_engine(plain, model, workdir="", pad_id=family.tokenizer.pad_id),
        family,
        tasks,
        id_prefix="s",
        **dict(kw, cfg=plain),
    )
    check_routes(one_call, model)


def test_routing_replay_with_sglang_asks_the_server_for_routes():
    """With ``rollout.engine='sglang'`` the client records the server's routes for replay
    (``tests/test_routing_replay_sglang.py`` runs it against a real server); the mismatch
    metrics alone do not ask a server for them."""
    from gagar_jax.rl.engines import sglang_record_routes
    from tests.update_fixtures import tiny_config

    moe = tiny_config(**MOE)
    sglang = {"engine": "sglang", "sglang_url": "http://x"}
    replay = RunConfig.from_config_dict({"rollout": sglang, "learner": {"routing_replay": True}})
    assert sglang_record_routes(replay, moe) == (moe.num_layers, 2, 4)
    assert sglang_record_routes(replay, tiny_config()) is None  # a dense model has none
    metrics = RunConfig.from_config_dict({"rollout": sglang, "learner": {"mismatch_metrics": True}})
    assert sglang_record_routes(metrics, moe) is None
