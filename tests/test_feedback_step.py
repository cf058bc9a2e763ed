"""The feedback-training step: modes, frozen reference, z_ref in the checkpointed state, sharding,
and the planted-data comparison of Span-KTO and RW-SFT on negative-span tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gagar_jax.feedback.step import (
    MODES,
    FeedbackObjective,
    abstract_feedback_state,
    create_feedback_state,
    feedback_loss,
    jit_feedback_step,
    jit_ref_logprobs,
    shard_train_batch,
    to_train_batch,
)
from gagar_jax.losses import aggregate
from gagar_jax.models import Transformer, TransformerConfig
from gagar_jax.update.checkpoint import Checkpointer
from gagar_jax.update.state import UpdateConfig, abstract_model, make_mesh

MC = TransformerConfig(
    vocab_size=16,
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=32,
    tie_embeddings=True,
    qkv_bias=False,
)
UC = UpdateConfig(learning_rate=3e-2, max_grad_norm=1.0)
POS, NEG = (4, 5), (6, 7)


def planted_batch(n=8, t=10):
    """Prompt [2, 3 + (row % 2)], then a positive span (4 5), a negative span (6 7), a neutral
    EOS; rows alternate the order of the two spans. Padding after."""
    from gagar_jax.data.feedback import FeedbackBatch

    tokens = np.zeros((n, t), np.int32)
    span_ids = -np.ones((n, t), np.int32)
    span_pol = np.zeros((n, 3), np.int32)
    resp = np.zeros((n, t), bool)
    for i in range(n):
        first, second = (POS, NEG) if i % 2 == 0 else (NEG, POS)
        row = [2, 3 + i % 2, *first, *second, 1]
        tokens[i, : len(row)] = row
        resp[i, 2 : len(row)] = True
        span_ids[i, 2:4], span_ids[i, 4:6], span_ids[i, 6] = 0, 1, 2
        span_pol[i] = (1, -1, 0) if i % 2 == 0 else (-1, 1, 0)
    attn = tokens > 0
    tok_pol = np.where(span_ids >= 0, np.take_along_axis(span_pol, np.clip(span_ids, 0, 2), 1), 0)
    pos = np.where(attn, np.arange(t)[None], 0).astype(np.int32)
    return FeedbackBatch(
        tokens=tokens,
        positions=pos,
        attention_mask=attn,
        response_mask=resp,
        span_ids=span_ids,
        span_polarity=span_pol,
        token_polarity=tok_pol,
    )


@pytest.fixture(scope="module")
def params():
    model = Transformer(MC, rngs=nnx.Rngs(0))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _mesh(n=1):
    return make_mesh((n, 1, 1), jax.devices()[:n])


_STEPS = {}


def _step(objective, n_devices, tb):
    """One compiled step per (objective, mesh size) for the whole module (CI time)."""
    key = (objective, n_devices, tb.ref_logprobs is not None)
    if key not in _STEPS:
        _STEPS[key] = jit_feedback_step(MC, objective, UC, _mesh(n_devices), tb)
    return _STEPS[key]


def _obj(mode, **kw):
    return FeedbackObjective(mode=mode, **dict(dict(beta=0.5), **kw))


def _run(params, objective, steps, *, n_devices=1):
    mesh = _mesh(n_devices)
    tb = to_train_batch(planted_batch(), with_kl=objective.needs_kl_pairs)
    state = create_feedback_state(MC, UC, mesh, params)
    step = _step(objective, n_devices, tb)
    history = []
    for _ in range(steps):
        state, m = step(state, shard_train_batch(tb, mesh))
        history.append(jax.device_get(m))
    return state, history


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_steps_with_finite_loss_and_frozen_reference(params, mode):
    obj = _obj(mode)
    state, hist = _run(params, obj, 2)
    assert _step(obj, 1, to_train_batch(planted_batch()))._cache_size() == 1  # one compile
    assert all(np.isfinite(h["loss"]) for h in hist)
    assert int(state.step) == 2
    # the reference never moves; the policy does
    for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    moved = any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params))
    )
    assert moved
    if mode != "span_kto":
        assert float(state.z_ref) == 0.0


def test_mode_losses_are_the_named_objectives(params):
    fb = planted_batch()
    tb = jax.tree.map(jnp.asarray, to_train_batch(fb))
    graphdef = nnx.graphdef(abstract_model(MC))
    z, c = jnp.float32(0.0), jnp.float32(0.0)

    def loss(mode, **kw):
        return feedback_loss(
            params,
            params,
            tb,
            z,
            c,
            graphdef=graphdef,
            objective=FeedbackObjective(mode=mode, **kw),
        )

    sft, (_, _, m) = loss("sft")
    np.testing.assert_array_equal(sft, m["ce"])  # plain cross-entropy, bit for bit
    # drop_negative == CE over the non-negative tokens only (their own denominator)
    from gagar_jax.feedback.step import _logprobs

    lp = _logprobs(graphdef, params, tb.tokens, tb.positions, tb.attention_mask)
    keep = tb.response_mask[:, 1:] & (tb.token_polarity[:, 1:] >= 0)
    drop, _ = loss("sft_drop_negative")
    np.testing.assert_allclose(drop, aggregate(-lp, keep, "token-mean"), rtol=1e-6)
    # penalize: -(sum_pos,neu logp - penalty * sum_neg logp) / n_resp
    resp = tb.response_mask[:, 1:]
    neg = resp & (tb.token_polarity[:, 1:] < 0)
    pen, _ = loss("sft_penalize_negative", penalty=2.0)
    want = -(jnp.sum(jnp.where(resp & ~neg, lp, 0)) - 2.0 * jnp.sum(jnp.where(neg, lp, 0)))
    np.testing.assert_allclose(pen, want / jnp.sum(resp), rtol=1e-5)
    # span_kto at the reference itself: every reward is 0, so with z = 0 the preference part
    # is -mean(lambda * sigmoid(0)) = -0.5 (lambdas 1), plus the neutral EOS cross-entropy
    kto, (new_z, _, m) = loss("span_kto")
    np.testing.assert_allclose(m["kto/pref_loss"], -0.5, rtol=1e-6)
    np.testing.assert_allclose(kto, -0.5 + m["kto/neutral_loss"], rtol=1e-6)
    np.testing.assert_allclose(new_z, 0.0, atol=1e-7)


def test_reference_inside_equals_precomputed(params):
    mesh = _mesh()
    fb = planted_batch()
    ref_fn = jit_ref_logprobs(MC, UC, mesh)
    state = create_feedback_state(MC, UC, mesh, params)
    ref = np.asarray(ref_fn(state.ref_params, fb.tokens, fb.positions, fb.attention_mask))
    outs = {}
    for how, rl in (("inside", None), ("precomputed", ref)):
        obj = _obj("span_kto", ref_logprobs=how)
        tb = to_train_batch(fb, ref_logprobs=rl)
        st = create_feedback_state(MC, UC, mesh, params)
        step = _step(obj, 1, tb)
        for _ in range(2):
            st, m = step(st, shard_train_batch(tb, mesh))
        outs[how] = (jax.device_get(st), jax.device_get(m))
    np.testing.assert_allclose(outs["inside"][1]["loss"], outs["precomputed"][1]["loss"], rtol=1e-6)
    np.testing.assert_allclose(outs["inside"][0].z_ref, outs["precomputed"][0].z_ref, rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(outs["inside"][0].params), jax.tree.leaves(outs["precomputed"][0].params)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_batch_kl_reference_point_is_clamped_mismatched_mean(params):
    _, hist = _run(params, _obj("span_kto", reference_point="batch_kl"), 3)
    zs = [float(h["kto/z_used"]) for h in hist]
    assert zs[0] == 0.0  # at the reference itself the mismatched log-ratio is 0
    assert all(z >= 0.0 for z in zs)


def test_planted_span_kto_lowers_negative_tokens_faster_than_rw_sft(params):
    """Equal steps and learning rate on planted spans: Span-KTO pushes the negative-span tokens'
    log-probability down; RW-SFT (the paper's weights are all positive) only slows their rise."""
    steps = 12
    drop = {}
    for mode in ("span_kto", "rw_sft"):
        _, hist = _run(params, _obj(mode), steps)
        drop[mode] = hist[0]["logp_neg"] - hist[-1]["logp_neg"]  # > 0: negative tokens fell
        if mode == "span_kto":
            pos_gain = hist[-1]["logp_pos"] - hist[0]["logp_pos"]
    assert drop["span_kto"] > 0.0, drop
    assert drop["span_kto"] > drop["rw_sft"] + 0.1, drop
    assert pos_gain > 0.0  # while the positive spans' tokens rise


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices")
def test_sharded_step_equals_single_device(params):
    obj = _obj("span_kto")
    one, h1 = _run(params, obj, 2, n_devices=1)
    eight, h8 = _run(params, obj, 2, n_devices=8)
    for k in h1[-1]:
        np.testing.assert_allclose(h8[-1][k], h1[-1][k], rtol=2e-5, atol=1e-6, err_msg=k)
    # Adam divides by sqrt(v): float noise of near-zero gradients shows at ~1e-6 after 2 steps
    for a, b in zip(
        jax.tree.leaves(jax.device_get(one.params)), jax.tree.leaves(jax.device_get(eight.params))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(eight.z_ref, one.z_ref, rtol=1e-5, atol=1e-7)


def test_resume_restores_z_ref_and_state_bit_identically(params, tmp_path):
    mesh = _mesh()
    obj = _obj("span_kto")
    tb = to_train_batch(planted_batch())
    step = _step(obj, 1, tb)
    ck = Checkpointer(str(tmp_path / "ckpt"), model_config=MC, update_config=obj, async_save=False)
    state = create_feedback_state(MC, UC, mesh, params)
    for _ in range(3):
        state, _ = step(state, shard_train_batch(tb, mesh))
    ck.save(3, state, data_position=3, wait=True)
    saved = jax.device_get(state)
    assert float(saved.z_ref) != 0.0  # the reference point moved
    for _ in range(2):
        state, _ = step(state, shard_train_batch(tb, mesh))
    uninterrupted = jax.device_get(state)

    restored, info = ck.restore(abstract_feedback_state(MC, UC, mesh))
    assert info.step == 3 and info.data_position == 3
    assert type(restored).__name__ == "FeedbackTrainState"
    assert np.asarray(restored.z_ref).tobytes() == np.asarray(saved.z_ref).tobytes()
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    for _ in range(2):
        restored, _ = step(restored, shard_train_batch(tb, mesh))
    resumed = jax.device_get(restored)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    ck.close()


def test_bad_objective_named():
    with pytest.raises(ValueError, match="objective.mode"):
        FeedbackObjective(mode="dpo")
    with pytest.raises(ValueError, match="objective.reference_point"):
        FeedbackObjective(reference_point="median")
    with pytest.raises(ValueError, match="objective.ref_logprobs"):
        FeedbackObjective(ref_logprobs="cached")
