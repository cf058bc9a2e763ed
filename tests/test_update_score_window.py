"""``UpdateConfig.score_window``: the LM head on each sequence's response window only gives the
update of every position scored (parameters and metrics, one device and sharded), refuses a
batch whose response does not fit, and counts what a jitted update would leave out."""

import dataclasses

import jax
import numpy as np
import pytest

from gagar_jax.rl.config import ConfigError, RunConfig
from gagar_jax.update import (
    check_batch,
    create_train_state,
    jit_update,
    make_mesh,
    shard_batch,
)
from gagar_jax.update.step import score_window_index
from tests.update_fixtures import CONFIG, LOSS_VARIANTS, MODEL, make_batch, run_updates

BASE = dataclasses.replace(CONFIG, eps=1e-3)
LENGTH, PROMPT, SHIFT = 12, 4, 4  # make_batch's rows, then moved right by up to SHIFT
WIDEST = LENGTH - PROMPT  # the longest response make_batch writes


def shifted_batch(seed: int):
    """make_batch's rows padded to LENGTH + SHIFT columns and moved right by 0..SHIFT, so the
    responses start at different positions (as ``pack_groups`` packs prompts of several
    lengths) and some windows run past the end and must be moved back."""
    b = make_batch(seed=seed, length=LENGTH, prompt=PROMPT)
    n = b.tokens.shape[0]
    shifts = np.arange(n) % (SHIFT + 1)

    def move(x):
        x = np.concatenate([x, np.zeros((n, SHIFT), x.dtype)], axis=1)
        return np.stack([np.roll(row, s) for row, s in zip(x, shifts)])

    fields = ("tokens", "positions", "attention_mask", "response_mask", "old_logprobs")
    out = b._replace(**{f: move(getattr(b, f)) for f in fields})
    if out.ref_logprobs is None:
        ref = np.where(out.response_mask, out.old_logprobs - 0.3, 0.0).astype(np.float32)
        out = out._replace(ref_logprobs=ref)
    return out


def _update(config, mesh_shape=(1, 1, 1), steps=2, with_ref=False):
    batches = [shifted_batch(i) for i in range(steps)]
    return run_updates(MODEL, config, batches, mesh_shape=mesh_shape, with_ref=with_ref)


def _assert_same(a, b):
    (pa, ma), (pb, mb) = a, b
    for x, y in zip(ma, mb):
        assert set(x) - {"score_window/dropped_tokens"} == set(y) - {"score_window/dropped_tokens"}
        for k in x.keys() & y.keys():
            np.testing.assert_allclose(x[k], y[k], rtol=2e-5, atol=1e-7, err_msg=k)
    moved = 0.0
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7)
        moved = max(moved, float(np.abs(u).max()))
    assert moved > 0


VARIANTS = {**LOSS_VARIANTS, "chunked-logits": dict(logits_chunk_size=3)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_window_gives_the_update_of_every_position(variant):
    """Two updates (the second from moved parameters) with windows of the widest response
    (WIDEST) and wider (windows moved back at the end) equal the update of every position."""
    with_ref = VARIANTS[variant].get("kl_coef", 0) > 0
    full = dataclasses.replace(BASE, **VARIANTS[variant])
    want = _update(full, with_ref=with_ref)
    for window in (WIDEST, WIDEST + 2):
        got = _update(dataclasses.replace(full, score_window=window), with_ref=with_ref)
        assert all(m["score_window/dropped_tokens"] == 0 for m in got[1])
        _assert_same(want, got)


def test_sharded_window_equals_one_device():
    full = _update(BASE)
    windowed = dataclasses.replace(BASE, score_window=WIDEST)
    for shape in ((2, 2, 2), (8, 1, 1)):
        _assert_same(full, _update(windowed, mesh_shape=shape))


def test_window_index_against_a_loop():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n, t = 5, int(rng.integers(4, 20))
        window = int(rng.integers(1, t))
        resp = np.zeros((n, t), bool)
        for i in range(n - 1):  # the last row has no response
            start = int(rng.integers(1, t))
            resp[i, start : start + int(rng.integers(1, t - start + 1))] = True
        got = np.asarray(score_window_index(resp, window))
        for i in range(n):
            scored = np.flatnonzero(resp[i, 1:])
            first = scored[0] if scored.size else 0
            start = min(first, t - 1 - window)
            np.testing.assert_array_equal(got[i], np.arange(start, start + window))
            inside = set(range(start, start + window))
            if scored.size and scored[-1] - first < window:
                assert set(scored) <= inside  # a response that fits is read whole


def test_response_wider_than_the_window_is_refused_and_counted():
    config = dataclasses.replace(BASE, score_window=WIDEST - 3)
    batch = shifted_batch(0)._replace(ref_logprobs=None)
    spans = [np.flatnonzero(r[1:]) for r in batch.response_mask]
    widest = max(s[-1] - s[0] + 1 for s in spans if s.size)
    assert widest > config.score_window
    want = f"score_window=5: raise score_window to at least {widest}"
    with pytest.raises(ValueError, match=want):
        check_batch(batch, config)
    check_batch(batch, dataclasses.replace(config, score_window=widest))
    check_batch(batch, dataclasses.replace(config, score_window=0))
    # The jitted update itself cannot raise: it counts the tokens it leaves out.
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    state = create_train_state(MODEL, config, mesh, seed=0)
    _, m = jit_update(MODEL, config, mesh)(state, shard_batch(batch, mesh))
    dropped = sum(max(s.size - config.score_window, 0) for s in spans)
    assert float(m["score_window/dropped_tokens"]) == dropped > 0


def test_run_config_derives_the_window_from_the_response_budget():
    import ml_collections

    from configs import common

    c = common.base()
    c.rollout.max_new_tokens = 24
    assert RunConfig.from_config_dict(c).learner.score_window == 24
    assert RunConfig.from_config_dict(c).learner.shared_prefix
    c.learner.score_window = 0
    assert RunConfig.from_config_dict(c).learner.score_window == 0
    assert not RunConfig.from_config_dict(c).learner.shared_prefix
    c.learner.score_window = 23
    with pytest.raises(ConfigError, match="learner.score_window must be 0 .* >= rollout"):
        RunConfig.from_config_dict(c)
    assert isinstance(c, ml_collections.ConfigDict)
    # Partial rollouts resume episodes with their history as the prompt: no shared prefix.
    p = common.base()
    p.rollout.update(partial_rollout=True, max_staleness=1)
    assert not RunConfig.from_config_dict(p).learner.shared_prefix
    p.learner.shared_prefix = True
    with pytest.raises(ConfigError, match="learner.shared_prefix must be False with rollout"):
        RunConfig.from_config_dict(p)
    # Where the head runs does not change what a checkpoint or a resumed run must match.
    a = RunConfig.from_config_dict(common.base())
    d = common.base()
    d.learner.score_window = 0
    assert a.fingerprint() == RunConfig.from_config_dict(d).fingerprint()
