"""The asynchronous loop's admission control, FIFO order, staleness bound and bias monitor.

A real ``GradingPool`` with the real ``SleepGrader`` (a sleeping stand-in for a slow remote
grader) grades the groups; the collect phase is a scripted stand-in that submits groups at once
and the update / weight sync are stand-ins that count versions (the jitted update and the
engine are exercised by the training-script tests)."""

import dataclasses
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.grading import GradingPool
from gagar_jax.grading.testing import SleepGrader
from gagar_jax.rl import asynchronous, collect, resume, train
from gagar_jax.rl.config import RunConfig
from tests.test_grading_pool import make_group as make_workspace
from tests.test_loop_pieces import load_config_module, make_group


def np_ks(a, b):
    """sup |F_a - F_b| by a loop over every sample point."""
    best = 0.0
    for x in list(a) + list(b):
        fa = sum(v <= x for v in a) / len(a)
        fb = sum(v <= x for v in b) / len(b)
        best = max(best, abs(fa - fb))
    return best


@settings(max_examples=30, deadline=None)
@given(
    a=st.lists(st.integers(0, 20), min_size=1, max_size=30),
    b=st.lists(st.integers(0, 20), min_size=1, max_size=30),
)
def test_ks_distance_matches_numpy_loop(a, b):
    assert asynchronous.ks_distance(a, b) == pytest.approx(np_ks(a, b))
    assert asynchronous.ks_distance(a, a) == 0.0


def test_ks_distance_disjoint_and_empty():
    assert asynchronous.ks_distance([1, 2], [5, 6]) == 1.0
    assert np.isnan(asynchronous.ks_distance([], [1]))


def test_admission_rule():
    aq = asynchronous.AsyncQueue(max_staleness=1, max_inflight_groups=4, groups_per_batch=2)
    batch = lambda: asynchronous.InflightBatch(
        0, 0, 0, collected=types.SimpleNamespace(submitted=("a", "b"))
    )
    assert aq.may_dispatch()  # empty: always one batch
    aq.queue.append(batch())
    assert aq.may_dispatch()  # one ahead <= S = 1 and 2 + 2 <= 4 groups
    aq.queue.append(batch())
    assert not aq.may_dispatch()  # a third would be trained 2 versions late
    aq = asynchronous.AsyncQueue(max_staleness=3, max_inflight_groups=3, groups_per_batch=2)
    aq.queue.append(batch())
    assert not aq.may_dispatch()  # the pool's bound: 2 + 2 > 3
    with pytest.raises(ValueError, match="max_staleness"):
        asynchronous.AsyncQueue(-1, 4, 2)
    aq = asynchronous.AsyncQueue(max_staleness=0, max_inflight_groups=4, groups_per_batch=2)
    assert aq.may_dispatch()  # S = 0: one batch, trained in the step that dispatched it
    aq.queue.append(batch())
    assert not aq.may_dispatch()


G, K = 2, 4


def _cfg(max_staleness, max_inflight, deadline):
    cd = load_config_module("toy_gagar").get_config("smoke").to_dict()
    cd["rollout"].update(
        num_prompts=G,
        num_rollouts=K,
        max_prompt_len=8,
        max_new_tokens=8,
        max_staleness=max_staleness,
    )
    cd["grading"].update(enabled=True, deadline_s=deadline, max_inflight_groups=max_inflight)
    return RunConfig.from_config_dict(cd)


def _run(monkeypatch, cfg, seconds, steps):
    """Runs ``steps`` async steps; returns (metrics per step, dispatched ids, queue)."""
    dispatched = []

    def scripted_collect(
        engine, family, pool, stream, ls, cfg, *, step, hosts, tracker=None, rollout_log=None
    ):
        groups, ids = [], []
        for g in range(G):
            gid = f"d{step}-{g}"
            group = make_group(gid, passes=1 + (g % 3), K=K, resp_len=1 + step % 4)
            for r in group.rollouts:  # the engine tags each sample with its weights' version
                r.policy_version = ls.policy_version
            groups.append(group)
            ws = make_workspace(100 * step + g)
            pool.submit(dataclasses.replace(ws, group_id=gid))
            ids.append(gid)
        ls.data_position += G
        dispatched.append(step)
        sres = collect.SamplingResult(
            groups=groups,
            rounds=1,
            drawn=G,
            counts={"mixed": G},
            discarded_mixed=0,
            rollouts_drawn=G * K,
        )
        return train.Collected(
            sampling=sres,
            counters=train.StepCounters(),
            submitted=tuple(ids),
            attempts=(),
            wait_start=0.0,
        )

    def stand_in_update(ctx, state, batch, *, step):  # the jitted update's stand-in
        return train.Updated(state=state, metrics={"loss": 0.0})

    def stand_in_sync(
        ctx, state, ls, *, step, metrics=None
    ):  # the engine's stand-in: reports the version
        ls.policy_version += 1
        return ls.policy_version

    monkeypatch.setattr(train, "collect_phase", scripted_collect)
    monkeypatch.setattr(train, "update_phase", stand_in_update)
    monkeypatch.setattr(train, "sync_phase", stand_in_sync)
    monkeypatch.setattr(
        train, "step_metrics", lambda sres, counters, grading_m, *a: dict(grading_m)
    )
    pool = GradingPool(SleepGrader(seconds), max_concurrency=2, deadline_s=cfg.grading.deadline_s)
    family = types.SimpleNamespace(tokenizer=types.SimpleNamespace(pad_id=0), token_spans=None)
    ctx = types.SimpleNamespace(
        cfg=cfg,
        hosts=train.Hosts(60.0),
        family=family,
        grading_pool=pool,
        engine=None,
        stream=None,
        tracker=None,
        rollout_log=None,
    )
    aq = asynchronous.AsyncQueue(cfg.rollout.max_staleness, cfg.grading.max_inflight_groups, G)
    ls = resume.LoopState(rng_key=[0, 1])
    out = []
    try:
        for step in range(steps):
            _, m = asynchronous.async_step(step, None, ls, ctx, aq)
            out.append(m)
    finally:
        pool.close()
    return out, dispatched, aq, ls


def test_oldest_first_nothing_dropped_staleness_bounded(monkeypatch):
    cfg = _cfg(max_staleness=2, max_inflight=16, deadline=30.0)
    ms, dispatched, aq, ls = _run(monkeypatch, cfg, seconds=0.05, steps=5)
    trained = [int(m["async/dispatch_index"]) for m in ms]
    assert trained == list(range(5))  # oldest first
    # nothing dropped or requeued: every dispatch is trained or still queued, once
    assert sorted(trained + [b.index for b in aq.queue]) == dispatched
    assert len(aq.queue) == 2  # S batches ahead of the next update
    assert all(m["async/staleness"] <= 2 for m in ms)
    assert [m["async/staleness"] for m in ms] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all(m["grading_fallbacks"] == 0 for m in ms)
    assert aq.state_dict()["dispatched"] == len(dispatched)


def test_slow_grader_pauses_dispatch_and_past_the_bound_falls_back(monkeypatch):
    # the pool holds one batch: while its grading sleeps, no new batch is dispatched
    cfg = _cfg(max_staleness=1, max_inflight=G, deadline=30.0)
    ms, dispatched, aq, _ = _run(monkeypatch, cfg, seconds=0.3, steps=3)
    assert dispatched == [0, 1, 2] and len(aq.queue) == 0
    assert all(m["async/queued_batches"] == 0 for m in ms)
    assert all(m["async/dispatch_paused_s"] > 0.2 for m in ms)  # waited for the verdicts
    assert all(m["grading_fallbacks"] == 0 for m in ms)
    # a grader far past the deadline: the bound forces the update; the group falls back
    cfg = _cfg(max_staleness=1, max_inflight=16, deadline=0.2)
    ms, dispatched, aq, _ = _run(monkeypatch, cfg, seconds=5.0, steps=2)
    assert [int(m["async/dispatch_index"]) for m in ms] == [0, 1]
    assert all(m["grading_fallbacks"] == G for m in ms)  # trained on original advantages
    assert all(m["async/staleness_fallbacks"] == G for m in ms)
    assert all(m["async/staleness"] <= 1 for m in ms)


def test_queued_batches_saved_with_trajectories_and_restored(monkeypatch, tmp_path):
    cfg = _cfg(max_staleness=2, max_inflight=16, deadline=30.0)
    _, _, aq, ls = _run(monkeypatch, cfg, seconds=0.01, steps=3)
    # what the loop saves at a checkpoint (one host)
    ls.extra[asynchronous.ASYNC_KEY] = {"per_host": [aq.state_dict()]}
    saved = resume.LoopState.from_json(ls.to_json()).extra[asynchronous.ASYNC_KEY]["per_host"][0]
    # batches 3 and 4 wait (dispatched at versions 1 and 2, data positions 6 and 8)
    assert [(q["index"], q["version"], q["position"]) for q in saved["queued"]] == [
        (3, 1, 6),
        (4, 2, 8),
    ]
    assert saved["dispatched"] == 5
    family = train.build_family(cfg)
    for q in saved["queued"]:
        for g in q["groups"]:
            g["task_index"] = 0  # the scripted groups carry no task: any of the pool
    pool = GradingPool(
        SleepGrader(0.0), max_concurrency=1, deadline_s=30.0, cache=str(tmp_path / "cache.jsonl")
    )
    try:
        back = asynchronous.AsyncQueue(2, 16, G)
        back.load(saved, family=family, pool=pool, cfg=cfg)
        assert [b.index for b in back.queue] == [3, 4] and not back.resume_positions
        for b, old in zip(back.queue, aq.queue):
            for g, og in zip(b.collected.sampling.groups, old.collected.sampling.groups):
                assert g.group_id == og.group_id
                for r, o in zip(g.rollouts, og.rollouts):
                    assert (r.response_tokens, r.logprobs, r.policy_version) == (
                        o.response_tokens,
                        o.logprobs,
                        o.policy_version,
                    )
        ids = [gid for b in back.queue for gid in b.collected.submitted]
        assert len(pool.results(ids, timeout=30.0)) == 4 and pool.metrics()["submitted"] == 4
    finally:
        pool.close()
    # the same trajectories again (a second resume): every verdict from the cache
    pool = GradingPool(
        SleepGrader(0.0), max_concurrency=1, deadline_s=30.0, cache=str(tmp_path / "cache.jsonl")
    )
    try:
        again = asynchronous.AsyncQueue(2, 16, G)
        again.load(saved, family=family, pool=pool, cfg=cfg)
        assert pool.metrics()["cache_hits"] == 4 and pool.grader.calls == 0
    finally:
        pool.close()


def test_batches_saved_as_positions_only_are_dispatched_again_first():
    """Checkpoints that hold a batch as its data position (no trajectories)."""
    back = asynchronous.AsyncQueue(1, 16, G)
    back.load({"dispatched": 7, "queued": [{"position": 40, "version": 3, "groups": None}]})
    assert back.resume_positions == [(40, 3)] and back.dispatched == 7
    assert back.state_dict()["queued"] == [{"position": 40, "version": 3}]
