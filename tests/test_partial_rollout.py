"""Per-token policy versions, partial rollouts and ``rollout.mask_offpolicy_tokens``.

The multi-turn toy-agent family with the real embedded sampler over the ``smoke`` policy:
episodes interrupted after their first turn and resumed (in the same process, or rebuilt from
their checkpoint form with environments replayed) equal uninterrupted ones exactly where the
weights did not change; across a weight sync every token keeps the version that produced it.
The off-policy token mask is checked on the clipped policy loss against a NumPy reference."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gagar_jax import rollout
from gagar_jax.losses import policy as losses
from gagar_jax.rl import asynchronous, collect, engines, policy, train
from gagar_jax.rl.config import ConfigError, RunConfig
from gagar_jax.rl.multihost import prompt_seed
from tests.test_loop_pieces import load_config_module

K = 2


def _cfg(**rollout) -> RunConfig:
    d = load_config_module("toy_agent").get_config("smoke").to_dict()
    d["rollout"].update(num_rollouts=K, **rollout)
    return RunConfig.from_config_dict(d)


@pytest.fixture(scope="module")
def setup():
    cfg = _cfg()
    family = train.build_family(cfg)
    _, model = policy.build_model(cfg, family.tokenizer.vocab_size)
    engine = engines.build_engine(cfg, model, workdir="", pad_id=family.tokenizer.pad_id)
    return cfg, family, model, engine


def _args(cfg, family, index=(0, 1)):
    tasks = [family.train_task(i) for i in index]
    seeds = [prompt_seed([1, 2], 1, p) for p in range(len(tasks))]
    return tasks, dict(
        cfg=cfg,
        step=0,
        round_id=1,
        num_rollouts=K,
        temperature=1.0,
        prompt_seeds=seeds,
    )


def _fields(groups):
    return [
        (
            r.response_tokens,
            r.logprobs,
            r.response_mask,
            r.versions(),
            r.finish_reason,
            r.passed,
            r.patch,
            r.num_turns,
        )
        for g in groups
        for r in g.rollouts
    ]


def test_resumed_episodes_equal_uninterrupted_ones_exactly(setup):
    cfg, family, _, engine = setup
    tasks, kw = _args(cfg, family)
    whole = collect.generate_groups(engine, family, tasks, id_prefix="a", **kw)
    turns = [r.num_turns for g in whole for r in g.rollouts]
    assert max(turns) > 1  # some episodes run past the interruption
    started = collect.start_groups(engine, family, tasks, until_turn=1, **kw)
    assert started.batch.next_turn == 1 and not started.batch.done
    resumed = collect.generate_groups(engine, family, tasks, id_prefix="a", started=started, **kw)
    assert _fields(resumed) == _fields(whole)  # tokens and log-probs bit for bit
    # the checkpoint form: JSON, fresh environments replayed to their state, then resumed
    started = collect.start_groups(engine, family, tasks, until_turn=2, **kw)
    sb = asynchronous.StartedBatch(
        index=3,
        version=0,
        position=0,
        n=[2],
        idx=[0, 1],
        pos=[0, 1],
        skipped=0,
        episodes=started,
    )
    item = json.loads(json.dumps(asynchronous.started_state(sb)))
    back = asynchronous.restore_started(item, family, cfg)
    assert (back.index, back.n, back.idx) == (3, [2], [0, 1])
    again = collect.generate_groups(
        engine, family, tasks, id_prefix="a", started=back.episodes, **kw
    )
    assert _fields(again) == _fields(whole)


def test_across_a_weight_sync_every_token_keeps_its_version(setup):
    cfg, family, model, _ = setup
    engine = engines.build_engine(cfg, model, workdir="", pad_id=family.tokenizer.pad_id)
    tasks, kw = _args(cfg, family)
    whole = collect.generate_groups(engine, family, tasks, id_prefix="a", **kw)
    started = collect.start_groups(engine, family, tasks, until_turn=1, **kw)
    params = jax.tree.map(lambda x: x * 1.5, engine.state)  # other weights, version 1
    engine.sync_weights(params, 1)
    resumed = collect.generate_groups(engine, family, tasks, id_prefix="a", started=started, **kw)
    spanning = 0
    for g0, g1 in zip(whole, resumed):
        for r0, r1 in zip(g0.rollouts, g1.rollouts):
            ep0, ep1 = r0.attempt.episode, r1.attempt.episode
            a, b = ep0.turns[0].model_span
            # the first turn ran before the sync: identical tokens and log-probs, version 0
            assert ep1.tokens[a:b] == ep0.tokens[a:b] and ep1.logprobs[a:b] == ep0.logprobs[a:b]
            assert set(ep1.token_versions[a:b]) == {0}
            model_v = {v for v, m in zip(r1.versions(), r1.response_mask) if m}
            obs_v = {v for v, m in zip(r1.versions(), r1.response_mask) if not m}
            assert obs_v <= {-1}
            assert ep1.policy_versions == [0] + [1] * (len(ep1.turns) - 1)
            assert r1.oldest_version == r1.policy_version == 0
            if len(ep1.turns) > 1:
                assert model_v == {0, 1}
                spanning += 1
    assert spanning > 0


CHUNK = 8  # tokens per chunk of a model turn (the smoke config's turns take up to 16)


def test_turns_stopped_mid_chunk_resume_exactly(setup):
    """Turns sampled in chunks, stopped after the first chunk of a turn (mid-turn) and resumed,
    in the same process or from the checkpoint form: the uninterrupted episodes exactly."""
    _, family, _, engine = setup
    cfg = _cfg(partial_chunk_tokens=CHUNK)
    tasks, kw = _args(cfg, family)
    whole = collect.generate_groups(engine, family, tasks, id_prefix="a", **kw)
    spans = [
        b - a
        for g in whole
        for r in g.rollouts
        for a, b in (t.model_span for t in r.attempt.episode.turns)
    ]
    assert max(spans) > CHUNK  # some turns span several chunks
    assert max(r.num_turns for g in whole for r in g.rollouts) > 1
    for until_turn in (0, 1):  # mid-way through the first turn, through the second
        started = collect.start_groups(
            engine, family, tasks, until_turn=until_turn, until_chunk=1, **kw
        )
        batch = started.batch
        assert (batch.next_turn, batch.next_chunk) == (until_turn, 1)
        if until_turn == 0:
            assert any(e.part_tokens for e in batch.live)  # stopped inside a turn
            with pytest.raises(ValueError, match="middle of a turn"):
                rollout.finish_episodes(batch)
        sb = asynchronous.StartedBatch(
            index=3,
            version=0,
            position=0,
            n=[2],
            idx=[0, 1],
            pos=[0, 1],
            skipped=0,
            episodes=started,
        )
        item = json.loads(json.dumps(asynchronous.started_state(sb)))
        back = asynchronous.restore_started(item, family, cfg)
        resumed = collect.generate_groups(
            engine, family, tasks, id_prefix="a", started=started, **kw
        )
        assert _fields(resumed) == _fields(whole)  # tokens and log-probs bit for bit
        again = collect.generate_groups(
            engine, family, tasks, id_prefix="a", started=back.episodes, **kw
        )
        assert _fields(again) == _fields(whole)


def test_a_turn_interrupted_mid_way_across_a_weight_sync(setup):
    """Stopped after the first chunk of the first turn, resumed after a weight sync: the first
    chunk is the uninterrupted one at version 0, the rest of the turn and the later turns are
    version 1, token by token."""
    _, family, model, _ = setup
    cfg = _cfg(partial_chunk_tokens=CHUNK)
    engine = engines.build_engine(cfg, model, workdir="", pad_id=family.tokenizer.pad_id)
    tasks, kw = _args(cfg, family)
    whole = collect.generate_groups(engine, family, tasks, id_prefix="a", **kw)
    started = collect.start_groups(engine, family, tasks, until_turn=0, until_chunk=1, **kw)
    engine.sync_weights(jax.tree.map(lambda x: x * 1.5, engine.state), 1)
    resumed = collect.generate_groups(engine, family, tasks, id_prefix="a", started=started, **kw)
    mid_turn = 0
    for g0, g1 in zip(whole, resumed):
        for r0, r1 in zip(g0.rollouts, g1.rollouts):
            ep0, ep1 = r0.attempt.episode, r1.attempt.episode
            a, b = ep1.turns[0].model_span
            k = min(CHUNK, b - a)  # the first chunk, sampled before the sync
            assert ep1.tokens[a : a + k] == ep0.tokens[a : a + k]
            assert ep1.logprobs[a : a + k] == ep0.logprobs[a : a + k]
            assert ep1.token_versions[a:b] == [0] * k + [1] * (b - a - k)
            assert ep1.policy_versions == [0] + [1] * (len(ep1.turns) - 1)
            for t in ep1.turns[1:]:
                assert set(ep1.token_versions[slice(*t.model_span)]) <= {1}
            assert r1.oldest_version == 0
            mid_turn += b - a > k
    assert mid_turn > 0  # some first turns went on past the sync
    # the off-policy mask keeps exactly the version-1 tokens of those turns
    masked_groups, masked, _ = asynchronous.offpolicy_token_mask(resumed, 1)
    for gm, g in zip(masked_groups, resumed):
        for rm, r in zip(gm.rollouts, g.rollouts):
            assert rm.response_mask == [
                int(m and v >= 1) for m, v in zip(r.response_mask, r.versions())
            ]
    assert masked == sum(
        v == 0
        for g in resumed
        for r in g.rollouts
        for v, m in zip(r.versions(), r.response_mask)
        if m
    )


@pytest.fixture(scope="module")
def single_turn():
    """The single-turn toy family (``toy_gagar:smoke``, responses of up to 16 tokens), its
    samples generated in chunks of ``CHUNK``."""
    d = load_config_module("toy_gagar").get_config("smoke").to_dict()
    d["rollout"].update(num_rollouts=K, partial_chunk_tokens=CHUNK)
    cfg = RunConfig.from_config_dict(d)
    family = train.build_family(cfg)
    _, model = policy.build_model(cfg, family.tokenizer.vocab_size)
    return cfg, family, model


def _sample_fields(groups):
    return [
        (r.response_tokens, r.logprobs, r.versions(), r.finish_reason, r.passed, r.reward)
        for g in groups
        for r in g.rollouts
    ]


def test_single_turn_samples_interrupted_mid_sample(single_turn):
    """A single-turn sample stopped after its first chunk: resumed under the same weights it
    is the uninterrupted sample bit for bit (in the same process and from the checkpoint form);
    resumed after a weight sync, its first chunk is version 0 and the rest version 1."""
    cfg, family, model = single_turn
    engine = engines.build_engine(cfg, model, workdir="", pad_id=family.tokenizer.pad_id)
    tasks, kw = _args(cfg, family, index=(0, 1, 2, 3))
    whole = collect.generate_groups(engine, family, tasks, id_prefix="s", **kw)
    lengths = [len(r.response_tokens) for g in whole for r in g.rollouts]
    assert max(lengths) > CHUNK  # some samples run past the interruption
    started = collect.start_groups(engine, family, tasks, until_turn=0, until_chunk=1, **kw)
    assert any(e.part_tokens for e in started.batch.live)
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
    assert _sample_fields(resumed) == _sample_fields(whole)
    again = collect.generate_groups(
        engine, family, tasks, id_prefix="s", started=back.episodes, **kw
    )
    assert _sample_fields(again) == _sample_fields(whole)

    started = collect.start_groups(engine, family, tasks, until_turn=0, until_chunk=1, **kw)
    engine.sync_weights(jax.tree.map(lambda x: x * 1.5, engine.state), 1)
    resumed = collect.generate_groups(engine, family, tasks, id_prefix="s", started=started, **kw)
    spanning = 0
    for g0, g1 in zip(whole, resumed):
        for r0, r1 in zip(g0.rollouts, g1.rollouts):
            n, k = len(r1.response_tokens), min(CHUNK, len(r1.response_tokens))
            assert r1.response_tokens[:k] == r0.response_tokens[:k]
            assert r1.logprobs[:k] == r0.logprobs[:k]
            assert r1.versions() == [0] * k + [1] * (n - k)
            assert r1.policy_version == r1.oldest_version == 0
            spanning += n > k
    assert spanning > 0


def test_partial_rollout_config_errors():
    with pytest.raises(ConfigError, match="rollout.partial_rollout"):
        _cfg(partial_rollout=True)
    cfg = _cfg(partial_rollout=True, max_staleness=1)
    assert cfg.rollout.partial_rollout
    with pytest.raises(ConfigError, match="rollout.partial_rollout"):
        _cfg(partial_rollout=True, max_staleness=0, mask_offpolicy_tokens=True)
    with pytest.raises(ConfigError, match="rollout.partial_chunk_tokens"):
        _cfg(partial_chunk_tokens=-1)
    assert _cfg(partial_chunk_tokens=8).fingerprint() != _cfg().fingerprint()  # another run
    # the scheduler at max_staleness=0 gives the synchronous run: the same fingerprint
    assert _cfg(async_scheduler=True).fingerprint() == _cfg().fingerprint()


def test_admission_with_partial_rollouts():
    aq = asynchronous.AsyncQueue(1, 16, 2, partial_rollout=True)
    assert aq.may_dispatch()  # empty: one whole batch
    aq.queue.append(object())
    assert not aq.may_dispatch()  # the slot of S = 1 is kept for the partial batch
    aq.queue.popleft()  # trained this step
    assert aq.may_start(steps_left=5) and not aq.may_start(steps_left=1)  # no later step
    aq.started = object()
    assert not aq.may_start(steps_left=5) and aq.inflight_groups() == 2
    aq = asynchronous.AsyncQueue(2, 16, 2, partial_rollout=True)
    aq.queue.append(object())
    assert aq.may_dispatch()  # one ahead + the kept slot <= 2
    aq.queue.append(object())
    assert not aq.may_dispatch()
    aq = asynchronous.AsyncQueue(2, 4, 2, partial_rollout=True)
    aq.queue.append(object())
    assert not aq.may_dispatch()  # 2 + 2 queued and kept + 2 new > 4 groups


# ------------------------------------------------------------------------------ the mask
def np_clipped_loss(lp, old, adv, mask, clip_low, clip_high):
    """Token-mean PPO clip-higher loss by a loop over the tokens that count."""
    total, count = 0.0, 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            r = np.exp(lp[b, t] - old[b, t])
            a = adv[b]
            total += max(-a * r, -a * min(max(r, 1 - clip_low), 1 + clip_high))
            count += 1
    return total / max(count, 1)


def _group(versions_per_rollout, newest):
    rollouts = []
    for vs in versions_per_rollout:
        R = len(vs)
        rollouts.append(
            collect.Rollout(
                prompt_tokens=[1, 2],
                response_tokens=list(range(3, 3 + R)),
                logprobs=[-0.5] * R,
                response_mask=[0 if v < 0 else 1 for v in vs],
                token_versions=list(vs),
                policy_version=min(v for v in vs if v >= 0),
                passed=bool(len(rollouts) % 2),
            )
        )
    return collect.Group(group_id="g", task=None, rollouts=rollouts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_offpolicy_token_mask_on_the_loss_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    # 4 rollouts: turns at versions 2 and 3 with observations (-1) between, one all old
    versions = [
        [2, 2, -1, -1, 3, 3, 3],
        [2, 2, 2, -1, 3],
        [2, 2, 2, 2],
        [3, 3, -1, 3],
    ]
    groups = [_group(versions, 3)]
    masked_groups, masked, model = asynchronous.offpolicy_token_mask(groups, 3)
    assert model == sum(v >= 0 for vs in versions for v in vs)
    assert masked == sum(v == 2 for vs in versions for v in vs)
    assert groups[0].rollouts[0].response_mask == [1, 1, 0, 0, 1, 1, 1]  # left intact
    P, R = 2, 8
    b_all = collect.pack_groups(
        groups, num_groups=1, num_rollouts=4, max_prompt_len=P, max_new_tokens=R, pad_id=0
    )
    b_new = collect.pack_groups(
        masked_groups, num_groups=1, num_rollouts=4, max_prompt_len=P, max_new_tokens=R, pad_id=0
    )
    N, T = b_new.response_mask.shape
    lp = rng.normal(-1.0, 0.3, (N, T)).astype(np.float32)
    old = (lp + rng.normal(0, 0.2, (N, T))).astype(np.float32)
    adv = rng.normal(0, 1, (N,)).astype(np.float32)
    # reference: only the newest version's model tokens count
    newest_only = np.zeros((N, T), bool)
    for n, vs in enumerate(versions):
        for i, v in enumerate(vs):
            newest_only[n, P + i] = v == 3
    assert (b_new.response_mask == newest_only).all()
    for batch, ref_mask in ((b_new, newest_only), (b_all, b_all.response_mask)):
        got = losses.policy_loss(
            jnp.asarray(lp),
            jnp.asarray(old),
            jnp.asarray(adv),
            jnp.asarray(batch.response_mask),
            clip_low=0.2,
            clip_high=0.28,
        ).pg_loss
        want = np_clipped_loss(lp, old, adv, ref_mask, 0.2, 0.28)
        assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-6)
    # rewards and the group fields are those of the unmasked batch
    for f in ("rewards", "passed", "valid", "tokens", "old_logprobs"):
        assert (getattr(b_new, f) == getattr(b_all, f)).all()


def test_queued_multi_turn_batch_round_trips_through_its_checkpoint_form(setup):
    """A finished multi-turn batch saved as JSON comes back with the same episodes, verdicts of
    the verifier and grading workspaces (so the verdict cache answers it)."""
    from gagar_jax.grading.pool import VerdictCache

    cfg, family, _, engine = setup
    tasks, kw = _args(cfg, family)
    groups = collect.generate_groups(engine, family, tasks, id_prefix="q", **kw)
    for i, g in enumerate(groups):
        g.task_index = i
    counters = collect.StepCounters()
    for g in groups:
        counters.add(g)
    sres = collect.SamplingResult(groups, 1, len(groups), {"mixed": 2}, 0, 2 * K)
    collected = train.Collected(
        sampling=sres,
        counters=counters,
        submitted=tuple(g.group_id for g in groups),
        attempts=(),
        wait_start=0.0,
    )
    b = asynchronous.InflightBatch(5, 1, 10, collected=collected, completed_version=1)
    item = json.loads(json.dumps(asynchronous.batch_state(b)))

    class Submitted(list):  # records what the restored batch resubmits for grading
        submit = list.append

    pool = Submitted()
    back = asynchronous.restore_batch(item, family, pool, cfg)
    assert (back.index, back.version, back.position, back.completed_version) == (5, 1, 10, 1)
    assert _fields(back.collected.sampling.groups) == _fields(groups)
    for g, og in zip(back.collected.sampling.groups, groups):
        for r, o in zip(g.rollouts, og.rollouts):
            assert r.attempt.episode.trajectory() == o.attempt.episode.trajectory()
    want = [VerdictCache.key(train.group_workspace(family, g), None) for g in groups]
    assert [VerdictCache.key(w, None) for w in pool] == want
