"""The int8 KV cache (``kv_cache_dtype="int8"``, ``gagar_jax.models.kv_quant``): each token's
head vectors quantised as they are written (one scale per token and KV head), dequantised as
they are read. Checked against a NumPy reference of the quantise / dequantise, with the
round-trip bound, finite scales on all-zero heads, and a decode step that reads exactly the
dequantised cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gagar_jax.models import create_model
from gagar_jax.models.kv_quant import QuantizedKV, dequantize_kv, quantize_kv
from gagar_jax.rollout import SamplingParams
from gagar_jax.rollout.sampler import Sampler
from tests.update_fixtures import tiny_config

MODEL = tiny_config(vocab_size=61, num_layers=2, initializer_range=0.3)


def quantize_reference(x, axis):
    """NumPy: symmetric int8, one scale per vector along ``axis`` (absmax times
    float32(1 / 127); 1 where that is below the smallest normal float32), round half to even,
    clipped to [-127, 127]."""
    x = np.asarray(x, np.float32)
    scale = np.max(np.abs(x), axis=axis, keepdims=True) * np.float32(1.0 / 127.0)
    scale = np.where(scale >= np.finfo(np.float32).tiny, scale, np.float32(1.0)).astype(np.float32)
    return np.clip(np.round(x / scale), -127, 127).astype(np.int8), scale


def dequantize_reference(values, scale):
    return values.astype(np.float32) * scale


magnitudes = st.sampled_from([0.0, 1e-40, 1e-30, 1e-3, 1.0, 30.0, 1e30])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), magnitude=magnitudes, axis=st.sampled_from([-1, -2]))
def test_quantize_matches_numpy_and_round_trips_within_half_a_step(seed, magnitude, axis):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 3, 8, 5)) * magnitude).astype(np.float32)
    if axis == -2:
        x[0, 1, :, 2] = 0.0  # an all-zero head vector of one token
    else:
        x[1, 0, 3, :] = 0.0
    q = quantize_kv(jnp.asarray(x), axis)
    ref_values, ref_scale = quantize_reference(x, axis)
    assert q.values.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q.values), ref_values)
    np.testing.assert_array_equal(np.asarray(q.scale), ref_scale)
    scale = np.asarray(q.scale)
    assert np.all(np.isfinite(scale)) and np.all(scale > 0)
    back = np.asarray(dequantize_kv(q, jnp.float32))
    np.testing.assert_array_equal(back, dequantize_reference(ref_values, ref_scale))
    assert np.all(np.isfinite(back))
    # half a grid step, plus float rounding of the product
    bound = scale / 2 * (1 + 2**-20) + np.finfo(np.float32).tiny
    assert np.all(np.abs(back - x) <= bound)
    assert np.all(np.abs(q.values) <= 127)


def test_all_zero_heads_get_scale_one_and_dequantise_to_zero():
    q = quantize_kv(jnp.zeros((1, 2, 4, 3)), -2)
    np.testing.assert_array_equal(np.asarray(q.scale), 1.0)
    np.testing.assert_array_equal(np.asarray(dequantize_kv(q, jnp.bfloat16)), 0.0)


@pytest.fixture(scope="module")
def model():
    return create_model(MODEL, seed=1)


@pytest.mark.parametrize("layer", [None, 1])
def test_writes_quantise_each_new_token_and_reads_dequantise_the_buffer(layer):
    """``_write_slots`` into an int8 buffer (one layer's, or layer 1 of a stacked one): the
    written slots hold the NumPy quantisation of the new keys / values, the others are
    untouched, and what attention reads is the NumPy dequantisation of the whole buffer."""
    from gagar_jax.models.kv_quant import empty_kv, read_kv
    from gagar_jax.models.transformer import _write_slots

    rng = np.random.default_rng(1)
    b, kv, d, s, t, index = 2, 3, 8, 10, 4, 5
    lead = () if layer is None else (2,)
    k_buf, v_buf = empty_kv((*lead, b, kv, d, s), -2), empty_kv((*lead, b, kv, s, d), -1)
    old_k = rng.standard_normal((*lead, b, kv, d, s)).astype(np.float32)
    old_v = rng.standard_normal((*lead, b, kv, s, d)).astype(np.float32)
    k_buf, v_buf = quantize_kv(jnp.asarray(old_k), -2), quantize_kv(jnp.asarray(old_v), -1)
    k = rng.standard_normal((b, t, kv, d)).astype(np.float32) * 3
    v = rng.standard_normal((b, t, kv, d)).astype(np.float32)
    k[0, 1, 2] = 0.0  # an all-zero head of one token
    k_buf, v_buf, keys, values = _write_slots(
        k_buf, v_buf, jnp.asarray(k), jnp.asarray(v), layer, index
    )

    def here(x):  # this layer's part of an array or a quantised buffer
        return x if layer is None else jax.tree.map(lambda y: y[layer], x)

    want_k, want_ks = quantize_reference(k.transpose(0, 2, 3, 1), -2)  # [B, KV, D, T]
    want_v, want_vs = quantize_reference(v.transpose(0, 2, 1, 3), -1)  # [B, KV, T, D]
    got_k, got_v = np.asarray(here(k_buf.values)), np.asarray(here(v_buf.values))
    np.testing.assert_array_equal(got_k[..., index : index + t], want_k)
    np.testing.assert_array_equal(np.asarray(here(k_buf.scale))[..., index : index + t], want_ks)
    np.testing.assert_array_equal(got_v[..., index : index + t, :], want_v)
    np.testing.assert_array_equal(np.asarray(here(v_buf.scale))[..., index : index + t, :], want_vs)
    old_kq, _ = quantize_reference(here(old_k), -2)
    np.testing.assert_array_equal(got_k[..., :index], old_kq[..., :index])
    np.testing.assert_array_equal(got_k[..., index + t :], old_kq[..., index + t :])
    for read, buf in ((keys, here(k_buf)), (values, here(v_buf))):
        out = np.asarray(read_kv(read, jnp.float32))
        ref = dequantize_reference(np.asarray(buf.values), np.asarray(buf.scale))
        np.testing.assert_array_equal(out, ref)
        assert np.all(np.isfinite(out))


def test_a_decode_step_writes_its_key_quantised(model):
    """Through the model: after a prefill and one decode step into an int8 cache, the step's
    layer-0 key (which depends on the token alone) is the NumPy quantisation of the float32
    cache's, and the step's logits are finite and near the float32 cache's."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, MODEL.vocab_size, (2, 7)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    step, step_pos = tokens[:, :1], jnp.full((2, 1), 7, jnp.int32)
    caches, logits = {}, {}
    for dt in ("int8", "float32"):
        cache = model.init_cache(2, 9, dtype=dt)
        _, cache = model.decode(tokens, pos, cache, fresh=True)
        logits[dt], caches[dt] = model.decode(step, step_pos, cache)
    c8 = caches["int8"]
    assert isinstance(c8.k[0], QuantizedKV) and c8.k[0].values.dtype == jnp.int8
    assert c8.k[0].scale.shape == (2, MODEL.num_kv_heads, 1, 9)
    assert c8.v[0].scale.shape == (2, MODEL.num_kv_heads, 9, 1)
    want, want_scale = quantize_reference(np.asarray(caches["float32"].k[0])[..., 7:8], -2)
    np.testing.assert_array_equal(np.asarray(c8.k[0].values)[..., 7:8], want)
    np.testing.assert_allclose(np.asarray(c8.k[0].scale)[..., 7:8], want_scale, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(logits["int8"])))
    assert 0 < np.max(np.abs(np.asarray(logits["int8"]) - np.asarray(logits["float32"]))) < 0.1


@pytest.mark.parametrize("scan_layers", [False, True])
def test_int8_cache_sampler_is_close_and_finite_on_every_path(scan_layers):
    """Per-row and shared-prefix decodes, per-layer and stacked caches, and a later turn
    that reuses a kept (compacted) int8 cache: log-probs finite, within the int8 cache's
    reach of the float32 cache's, and the kept cache really int8."""
    m = create_model(
        tiny_config(vocab_size=61, num_layers=2, initializer_range=0.3, scan_layers=scan_layers),
        seed=1,
    )
    buckets = dict(batch_buckets=(8,), prompt_buckets=(8, 32), new_token_buckets=(16,))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12)
    ref = Sampler(m, **buckets).generate(prompts, params)
    s8 = Sampler(m, kv_cache_dtype="int8", prefix_cache=1, **buckets)
    out = s8.generate(prompts, params)
    kept = s8._kept[0]["cache"]
    leaf = kept.k if scan_layers else kept.k[0]
    assert isinstance(leaf, QuantizedKV) and leaf.values.dtype == jnp.int8
    for r_row, q_row in zip(ref, out):
        for r, q in zip(r_row, q_row):
            lp = np.asarray(q.logprobs)
            assert np.all(np.isfinite(lp))
            # greedy: the same tokens while the logits agree; compare the common prefix
            same = next((i for i, (a, b) in enumerate(zip(r.tokens, q.tokens)) if a != b), 12)
            assert same > 0
            assert np.max(np.abs(lp[:same] - np.asarray(r.logprobs[:same]))) < 0.3
    turn = [prompts[0] + out[0][0].tokens + [9, 9]]
    again = s8.generate(turn, SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=4))
    assert s8.stats["calls_reusing_cache"] == 1
    assert np.all(np.isfinite(again[0][0].logprobs))


def test_int8_cache_data_parallel_sampler_matches_one_device(model):
    """The rows split over a 2-device mesh (the cache's quantised buffers sharded by rows
    like float ones): the same greedy samples as on one device."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    buckets = dict(batch_buckets=(8,), prompt_buckets=(8,), new_token_buckets=(16,))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 3, 3]]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=10)
    one = Sampler(model, kv_cache_dtype="int8", **buckets).generate(prompts, params)
    two = Sampler(model, kv_cache_dtype="int8", mesh=mesh, **buckets).generate(prompts, params)
    for a_row, b_row in zip(one, two):
        for a, b in zip(a_row, b_row):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
