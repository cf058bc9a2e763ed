"""learner.token_credit='distinguishing' inside the update: strength 0 is the broadcast, a
strength moves the parameters while every sequence's credit stays conserved, and a batch whose
rows are not one per rollout is refused."""

import dataclasses

import jax
import numpy as np
import pytest

from gagar_jax.update import check_batch, create_train_state, jit_update, make_mesh, shard_batch
from gagar_jax.update.state import state_shardings
from tests.update_fixtures import CONFIG, MODEL, make_batch

BASE = dataclasses.replace(CONFIG, eps=1e-3)


def _shared_prefix_batch(seed=3, shared=3, prompt=4):
    """make_batch with each group's rows sharing row 0's prompt and first response tokens."""
    b = make_batch(seed=seed, prompt=prompt)
    g, k = b.rewards.shape
    tokens, att, pos, resp = (
        np.array(x) for x in (b.tokens, b.attention_mask, b.positions, b.response_mask)
    )
    for gi in range(g):
        r0 = gi * k
        for r in range(r0 + 1, r0 + k):
            tokens[r, : prompt + shared] = tokens[r0, : prompt + shared]
            att[r, : prompt + shared] = att[r0, : prompt + shared]
            resp[r, :prompt] = False
            resp[r, prompt : prompt + shared] = True
    pos = np.maximum(np.cumsum(att, axis=1) - 1, 0).astype(np.int32)
    tier = np.array(b.tier)
    tier[:, 0], tier[:, 2] = 1, 3  # a T1 and a T3 slot in every group
    passed = np.array(b.passed)
    passed[:, 2] = True
    return b._replace(
        tokens=tokens,
        attention_mask=att,
        positions=pos,
        response_mask=resp,
        tier=tier,
        passed=passed,
        rewards=passed.astype(np.float32),
    )


def _update(host, config, batch):
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    _, sh = state_shardings(MODEL, config, mesh)
    check_batch(batch, config)
    fn = jit_update(MODEL, config, mesh)
    state, m = fn(jax.device_put(host, sh), shard_batch(batch, mesh))
    return jax.device_get(state.params), {k: float(v) for k, v in m.items()}


@pytest.fixture(scope="module")
def runs():
    one = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    host = jax.device_get(create_train_state(MODEL, BASE, one, seed=0))
    batch = _shared_prefix_batch()
    out = {"broadcast": _update(host, BASE, batch)}
    for s in (0.0, 1.0):
        cfg = dataclasses.replace(BASE, token_credit="distinguishing", token_gamma=s)
        out[s] = _update(host, cfg, batch)
    return out


def _leaves(p):
    return [np.asarray(x) for x in jax.tree.leaves(p)]


def test_strength_zero_is_the_broadcast(runs):
    for a, b in zip(_leaves(runs["broadcast"][0]), _leaves(runs[0.0][0])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_strength_moves_parameters_and_conserves_credit(runs):
    params, m = runs[1.0]
    diff = max(
        float(np.max(np.abs(a - b))) for a, b in zip(_leaves(runs["broadcast"][0]), _leaves(params))
    )
    assert diff > 1e-6
    assert m["token_credit/conservation_error"] < 1e-6
    # every row shares its first response tokens with the group's other rows
    assert 0.0 < m["token_credit/distinguishing_share"] < 1.0
    assert np.isfinite(m["loss"])


def test_rows_not_one_per_rollout_are_refused():
    b = make_batch(seed=0)
    n = b.tokens.shape[0]
    cfg = dataclasses.replace(BASE, token_credit="distinguishing")
    with pytest.raises(ValueError, match="distinguishing"):
        check_batch(b._replace(row_episode=np.arange(n, dtype=np.int32)), cfg)
