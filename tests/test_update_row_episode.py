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


def _with_evidence(batch, seed=2):
    """Random cited tokens on the responses (the ``evidence`` importance reads them)."""
    rng = np.random.default_rng(seed)
    resp = np.asarray(batch.response_mask)
    return batch._replace(evidence=resp & (rng.uniform(size=resp.shape) < 0.3))


def _split_rows_across_microbatches(batch, seed=0):
    """:func:`_split_rows` with the extra rows rotated by one, so an episode's two rows sit in
    different micro-batches of the strided split (rows ``i`` and ``N + i - 1``)."""
    split = _split_rows(batch, seed)
    n = batch.tokens.shape[0]
    order = np.concatenate([np.arange(n), n + np.roll(np.arange(n), 1)])
    fields = {
        f: np.asarray(getattr(split, f))[order]
        for f in ("tokens", "positions", "attention_mask", "response_mask", "old_logprobs")
    }
    if batch.evidence is not None:  # each row's cited tokens (only its masked ones count)
        fields["evidence"] = np.concatenate([batch.evidence, batch.evidence])[order]
    return split._replace(row_episode=np.asarray(split.row_episode)[order], **fields)


@pytest.mark.parametrize("credit, microbatches", [("entropy", 2), ("evidence", 1)])
def test_token_credit_over_segment_rows_trains_as_the_episode_in_one_row(credit, microbatches):
    # Token-level credit takes its statistics over each episode's tokens in all its rows: the
    # split batch gives every token the advantage it has in the one-row batch, so the update
    # is the same (per-row redistribution centres each half on its own and trains otherwise).
    config = dataclasses.replace(
        ONE, token_credit=credit, token_gamma=0.8, num_microbatches=microbatches
    )
    batch = _with_evidence(make_batch(seed=1))
    split = _split_rows_across_microbatches(batch)
    p1, m1 = run_updates(MODEL, config, [batch])
    p2, m2 = run_updates(MODEL, config, [split])
    for k in ("loss", "pg_loss", "grad_norm", "tokens", "token_credit/positive"):
        np.testing.assert_allclose(m1[0][k], m2[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # conserved per episode (the split metric sums over episodes, not rows)
    assert m2[0]["token_credit/conservation_error"] < 1e-6
    # rows given to the wrong episodes train otherwise
    wrong = split._replace(row_episode=np.asarray(split.row_episode)[::-1].copy())
    _, m3 = run_updates(MODEL, config, [wrong])
    assert abs(m3[0]["pg_loss"] - m1[0]["pg_loss"]) > 1e-6


def test_episode_token_advantages_equal_the_one_row_ones_and_conserve_credit():
    # The function the update runs, called on the split batch: each token's advantage is its
    # advantage in the one-row batch; the per-row kernel differs (its statistics per row).
    from flax import nnx

    from gagar_jax.advantages import gagar_advantages, redistribute_tokens
    from gagar_jax.advantages.tokens import ImportanceInputs, importance_provider
    from gagar_jax.models import Transformer
    from gagar_jax.update.step import _split, episode_token_advantages

    config = dataclasses.replace(ONE, token_credit="evidence", token_gamma=1.0)
    batch = _with_evidence(make_batch(seed=3))
    split = _split_rows_across_microbatches(batch, seed=4)
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    adv = gagar_advantages(
        batch.rewards,
        batch.passed,
        batch.cheat,
        batch.tier,
        batch.rank,
        batch.graded,
        batch.valid,
        config=config.advantages,
    ).advantages.reshape(-1)
    valid = np.asarray(batch.valid).reshape(-1)

    def data_of(b, ids):
        resp = np.asarray(b.response_mask) & valid[ids][:, None]
        return {
            "tokens": _split(np.asarray(b.tokens), 1, 2, None),
            "positions": _split(np.asarray(b.positions), 1, 2, None),
            "attention_mask": _split(np.asarray(b.attention_mask), 1, 2, None),
            "response_mask": _split(resp, 1, 2, None),
            "evidence": _split(np.asarray(b.evidence), 1, 2, None),
        }

    ids = np.asarray(split.row_episode)
    tok, err = episode_token_advantages(
        params, data_of(split, ids), adv, ids, graphdef=graphdef, config=config
    )
    tok = np.asarray(tok)
    assert float(err) < 1e-6 and np.all(tok[:, 0] == 0)
    # one-row reference: the kernel on the unsplit rows
    resp = np.asarray(batch.response_mask) & valid[:, None]
    imp = importance_provider("evidence")(
        ImportanceInputs(mask=resp[:, 1:], evidence=np.asarray(batch.evidence)[:, 1:])
    )
    ref = np.asarray(redistribute_tokens(adv, imp, resp[:, 1:], gamma=1.0))
    n = batch.tokens.shape[0]
    # the episode's token advantages, gathered from its rows (each token in exactly one row)
    got = np.zeros((n, ref.shape[1]), np.float32)
    np.add.at(got, ids, tok[:, 1:])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # total credit with segments = total credit of the episode as one sample
    for e in range(n):
        np.testing.assert_allclose(
            tok[ids == e].sum(), float(adv[e]) * resp[e, 1:].sum() * valid[e], atol=1e-4
        )
    # the per-row kernel on the split rows gives other token advantages
    split_resp = np.asarray(split.response_mask) & valid[ids][:, None]
    imp_rows = importance_provider("evidence")(
        ImportanceInputs(mask=split_resp[:, 1:], evidence=np.asarray(split.evidence)[:, 1:])
    )
    per_row = np.asarray(redistribute_tokens(adv[ids], imp_rows, split_resp[:, 1:], gamma=1.0))
    other = np.zeros_like(got)
    np.add.at(other, ids, per_row)
    assert np.max(np.abs(other - ref)) > 1e-3
