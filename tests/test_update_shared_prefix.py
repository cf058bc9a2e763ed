"""``UpdateConfig.shared_prefix``: each group's prompt through the model once, its samples'
response windows against the prompt's cache, gives the update of the per-sample forward
(parameters and metrics; loss options, mini/micro-batches, scanned layers, one device and
sharded); data it cannot share is refused, and batches it cannot split by groups fall back
(said in the log)."""

import dataclasses
import logging

import jax
import numpy as np
import pytest

from gagar_jax.update import (
    UpdateBatch,
    UpdateConfig,
    check_batch,
)
from tests.update_fixtures import CONFIG, LOSS_VARIANTS, MODEL, run_updates

# One mini-batch: with several, the shared-prefix update assigns whole groups to each (the
# per-sample update strides rows over them), so the optimizer steps see other sequences.
BASE = dataclasses.replace(CONFIG, eps=1e-3, num_minibatches=1)
PROMPT, WINDOW = 8, 8  # longest prompt, widest response: T = 16


def group_batch(seed: int, groups: int = 4, k: int = 4) -> UpdateBatch:
    """G groups of K samples packed like ``rl.collect.pack_groups``: each group's prompt (its
    own length, 2..PROMPT, one group left-padded inside it) then each sample's response
    (1..WINDOW tokens), right-padded; the last sample is a lost rollout with no response."""
    rng = np.random.default_rng(seed)
    n, t = groups * k, PROMPT + WINDOW
    tokens = np.zeros((n, t), np.int32)
    positions = np.zeros((n, t), np.int32)
    attention = np.zeros((n, t), bool)
    response = np.zeros((n, t), bool)
    for g in range(groups):
        p = int(rng.integers(2, PROMPT + 1))
        prompt = rng.integers(1, MODEL.vocab_size, p)
        pad = 1 if g == 1 else 0  # a padding token inside the prompt, masked
        for j in range(k):
            i = g * k + j
            r = 0 if i == n - 1 else int(rng.integers(1, WINDOW + 1))
            tokens[i, :p] = prompt
            tokens[i, p : p + r] = rng.integers(1, MODEL.vocab_size, r)
            attention[i, pad : p + r] = True
            positions[i, pad : p + r] = np.arange(p + r - pad)
            response[i, p : p + r] = True
    old = np.where(response, np.log(rng.uniform(0.01, 0.5, (n, t))), 0.0).astype(np.float32)
    passed = rng.uniform(size=(groups, k)) < 0.5
    passed[:, 0], passed[:, 1] = True, False
    valid = np.ones((groups, k), bool)
    valid[-1, -1] = False
    ref = np.where(response, old - 0.3, 0.0).astype(np.float32)
    return UpdateBatch(
        tokens=tokens,
        positions=positions,
        attention_mask=attention,
        response_mask=response,
        old_logprobs=old,
        rewards=passed.astype(np.float32),
        passed=passed,
        cheat=np.zeros((groups, k), bool),
        tier=rng.integers(1, 4, (groups, k)).astype(np.int32),
        rank=rng.integers(1, 3, (groups, k)).astype(np.int32),
        valid=valid,
        graded=np.ones((groups,), bool),
        ref_logprobs=ref,
    )


def _update(config, model=MODEL, mesh_shape=(1, 1, 1), steps=2, with_ref=False, **shape):
    batches = [group_batch(i, **shape) for i in range(steps)]
    return run_updates(model, config, batches, mesh_shape=mesh_shape, with_ref=with_ref)


SPEED_KEYS = {"score_window/dropped_tokens"}
SHARED = "each group's prompt runs through the model once"
PER_SAMPLE = "shared_prefix is set but the update runs per sample"


def _assert_same(want, got):
    (pa, ma), (pb, mb) = want, got
    for x, y in zip(ma, mb):
        assert set(x) - SPEED_KEYS == set(y) - SPEED_KEYS
        for k in set(x) - SPEED_KEYS:
            # A conservation error is float rounding itself (~1e-5 here): another order of
            # the same sums moves it by its own size.
            atol = 1e-5 if "conservation_error" in k else 1e-6
            np.testing.assert_allclose(x[k], y[k], rtol=1e-4, atol=atol, err_msg=k)
    # Float32 attention in another order (the prompt's cache): the entropy-based token credit
    # turns its ~1e-7 differences into ~5e-7 in the parameters after two steps at lr 1e-2.
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)


VARIANTS = {
    **LOSS_VARIANTS,
    "micro-batches-chunked-logits": dict(num_microbatches=2, logits_chunk_size=3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_shared_prefix_gives_the_per_sample_update(variant, caplog):
    """Two updates (the second from moved parameters): the shared-prefix forward against the
    whole-sequence forward of every position (no window)."""
    with_ref = VARIANTS[variant].get("kl_coef", 0) > 0
    full = dataclasses.replace(BASE, **VARIANTS[variant])
    want = _update(full, with_ref=with_ref)
    with caplog.at_level(logging.INFO, logger="gagar_jax.update.step"):
        got = _update(
            dataclasses.replace(full, score_window=WINDOW, shared_prefix=True), with_ref=with_ref
        )
    assert SHARED in caplog.text
    _assert_same(want, got)


def test_shared_prefix_with_scanned_layers(caplog):
    model = dataclasses.replace(MODEL, scan_layers=True, num_layers=2)
    want = _update(BASE, model=model)
    with caplog.at_level(logging.INFO, logger="gagar_jax.update.step"):
        got = _update(
            dataclasses.replace(BASE, score_window=WINDOW, shared_prefix=True), model=model
        )
    assert SHARED in caplog.text
    _assert_same(want, got)


def test_sharded_shared_prefix_equals_one_device(caplog):
    """8 groups of 2 on (2, 2, 2) and (4, 1, 2) meshes (4 batch shards; 2 micro-batches on
    the first): every micro-batch holds whole groups on one device, and the result is the
    one-device per-sample update."""
    want = _update(BASE, groups=8, k=2)
    shared = dataclasses.replace(BASE, score_window=WINDOW, shared_prefix=True)
    for mesh_shape, micro in (((2, 2, 2), 2), ((4, 1, 2), 1)):
        config = dataclasses.replace(shared, num_microbatches=micro)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gagar_jax.update.step"):
            got = _update(config, mesh_shape=mesh_shape, groups=8, k=2)
        assert SHARED in caplog.text
        _assert_same(want, got)


def test_groups_that_do_not_divide_fall_back_to_the_per_sample_forward(caplog):
    """4 groups cannot fill 8 micro-batches: the update runs per sample, says so in the log,
    and gives the same result."""
    config = dataclasses.replace(BASE, num_microbatches=8)
    want = _update(config, steps=1)
    shared = dataclasses.replace(config, score_window=WINDOW, shared_prefix=True)
    with caplog.at_level(logging.INFO, logger="gagar_jax.update.step"):
        got = _update(shared, steps=1)
    assert PER_SAMPLE in caplog.text and SHARED not in caplog.text
    _assert_same(want, got)


def test_a_group_that_does_not_share_its_prompt_is_refused():
    config = dataclasses.replace(BASE, score_window=WINDOW, shared_prefix=True)
    batch = group_batch(0)
    check_batch(batch, config)
    other = batch.tokens.copy()
    other[6, 0] = (other[6, 0] + 1) % MODEL.vocab_size  # group 1, row 6: one prompt token
    with pytest.raises(ValueError, match=r"row 6 \(group 1\) does not share its group's prompt"):
        check_batch(batch._replace(tokens=other), config)
    check_batch(batch._replace(tokens=other), dataclasses.replace(config, shared_prefix=False))
    # A row whose response starts one token later (a longer prompt) is refused too.
    resp = batch.response_mask.copy()
    row = 9
    first = int(np.argmax(resp[row]))
    resp[row, first] = False
    with pytest.raises(ValueError, match=f"row {row} \\(group 2\\)"):
        check_batch(batch._replace(response_mask=resp), config)
    # The lost rollout (no response) is not compared.
    assert not batch.response_mask[-1].any()


def test_shared_prefix_needs_a_window():
    with pytest.raises(ValueError, match="shared_prefix needs update.score_window > 0"):
        UpdateConfig(shared_prefix=True)
