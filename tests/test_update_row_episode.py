"""Several rows per rollout (``UpdateBatch.row_episode``, a harness episode's linked segments):
every row takes its rollout's advantage and validity, so an episode split into segment rows
trains exactly as the same tokens in one row (token-mean loss)."""

import dataclasses

import jax
import numpy as np
import pytest

from gagar_jax.update import check_batch, make_mesh
from tests.update_fixtures import CONFIG, MODEL, make_batch, run_updates

ONE = dataclasses.replace(CONFIG, eps=1e-3, num_minibatches=1, num_microbatches=1)


def _split_rows(batch, seed=0):
    """Each row's response cut in two: the row keeps its first part, an extra row (the same
    tokens, its rollout's index) its second part."""
    rng = np.random.default_rng(seed)
    n = batch.tokens.shape[0]
    first = np.array(batch.response_mask)
    second = np.zeros_like(first)
    for i in range(n):
        idx = np.flatnonzero(first[i])
        cut = idx[int(rng.integers(1, len(idx)))]
        second[i, cut:] = first[i, cut:]
        first[i, cut:] = False

    def both(x, a=None, b=None):
        x = np.asarray(x)
        return np.concatenate([x if a is None else a, x if b is None else b])

    old = np.asarray(batch.old_logprobs)
    return batch._replace(
        tokens=both(batch.tokens),
        positions=both(batch.positions),
        attention_mask=both(batch.attention_mask),
        response_mask=both(batch.response_mask, first, second),
        old_logprobs=both(old, np.where(first, old, 0.0), np.where(second, old, 0.0)),
        row_episode=np.concatenate([np.arange(n), np.arange(n)]).astype(np.int32),
    )


def test_segment_rows_train_as_the_episode_in_one_row():
    batch = make_batch(seed=1)
    split = _split_rows(batch)
    p1, m1 = run_updates(MODEL, ONE, [batch])
    p2, m2 = run_updates(MODEL, ONE, [split])
    for k in ("loss", "pg_loss", "grad_norm", "tokens"):
        np.testing.assert_allclose(m1[0][k], m2[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # a wrong episode index (every extra row the first rollout's) trains something else
    wrong = split._replace(
        row_episode=np.concatenate([np.arange(16), np.zeros(16)]).astype(np.int32)
    )
    _, m3 = run_updates(MODEL, ONE, [wrong])
    assert abs(m3[0]["pg_loss"] - m1[0]["pg_loss"]) > 1e-6


def test_row_episode_is_checked_by_name():
    split = _split_rows(make_batch())
    mesh = make_mesh((1, 1, 1), devices=jax.devices()[:1])
    check_batch(split, ONE, mesh)
    bad = split._replace(row_episode=np.full((32,), 16, np.int32))
    with pytest.raises(
        ValueError, match=r"batch.row_episode must be \[N=32\] ints in \[0, G \* K = 16\)"
    ):
        check_batch(bad, ONE, mesh)
    with pytest.raises(ValueError, match="need N = G \\* K"):
        check_batch(split._replace(row_episode=None), ONE, mesh)
