"""Tests of the NNX transformer: shapes, masking/padding, cached decode == full forward, remat."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gagar_jax.models import TransformerConfig, create_model
from gagar_jax.models.transformer import (
    _blocked_causal_attention,
    _cached_attention,
    _causal_blocks,
    _linear,
    _materialized,
    _shared_prefix_attention,
    _swiglu,
    rope,
)
from gagar_jax.update.state import abstract_model
from tests.update_fixtures import tiny_config

TINY = tiny_config()


def _perturb(state, seed):
    """Every parameter plus N(0, 0.05^2) noise, drawn on the host (a jitted draw per leaf is
    seconds of compiling for every new parameter tree)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: x + jnp.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state
    )


def _model(config=TINY, seed=0):
    model = create_model(config, seed)
    # Non-zero biases and norm weights so the test exercises them.
    nnx.update(model, _perturb(nnx.state(model, nnx.Param), seed + 1))
    return model


@nnx.jit
def _fwd(model, tokens, positions, mask=None):
    return model(tokens, positions, attention_mask=mask)


@nnx.jit(static_argnames=("last_only", "fresh"))
def _decode(model, tokens, positions, cache, mask=None, last_only=False, fresh=False):
    """``model.decode`` as the sampler runs it: one compiled program per shape (run eagerly,
    every operation of the model would be dispatched and compiled on its own)."""
    return model.decode(
        tokens, positions, cache, attention_mask=mask, last_only=last_only, fresh=fresh
    )


def _left_padded(batch=3, length=10, pads=(0, 2, 5), seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, TINY.vocab_size, (batch, length)).astype(np.int32)
    mask = np.ones((batch, length), bool)
    positions = np.zeros((batch, length), np.int32)
    for b, p in enumerate(pads):
        mask[b, :p] = False
        tokens[b, :p] = 0
        positions[b, p:] = np.arange(length - p)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="num_heads"):
        dataclasses.replace(TINY, num_kv_heads=3)
    with pytest.raises(ValueError, match="vocab_size"):
        dataclasses.replace(TINY, vocab_size=0)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(TINY, dtype="int8")


def test_forward_shapes_and_param_count():
    model = _model()
    tokens, positions, mask = _left_padded()
    logits = _fwd(model, tokens, positions, mask)
    assert logits.shape == (3, 10, TINY.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == TINY.num_params
    with pytest.raises(ValueError, match="positions"):
        _fwd(model, tokens, positions[:, :4])


def test_left_padding_equals_unpadded():
    """A left-padded row gives the same logits on its real tokens as the row alone."""
    model = _model()
    tokens, positions, mask = _left_padded()
    logits = _fwd(model, tokens, positions, mask)
    for b, p in enumerate((0, 2, 5)):
        alone = _fwd(model, tokens[b : b + 1, p:], positions[b : b + 1, p:])
        np.testing.assert_allclose(logits[b, p:], alone[0], atol=1e-5, rtol=1e-5)


def test_causality():
    """Changing a later token never changes earlier logits."""
    model = _model()
    tokens, positions, _ = _left_padded(pads=(0, 0, 0))
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % TINY.vocab_size)
    a = _fwd(model, tokens, positions)
    b = _fwd(model, changed, positions)
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-4


@pytest.mark.parametrize("tie", [False, True])
def test_cached_decode_equals_full_forward(tie):
    """Prefill 4 slots then decode one token at a time: logits == the full forward's."""
    config = dataclasses.replace(TINY, tie_embeddings=tie)
    model = _model(config)
    tokens, positions, mask = _left_padded(length=10, pads=(0, 2, 3))
    full = _fwd(model, tokens, positions, mask)

    cache = model.init_cache(batch=3, max_len=12)
    prefill = 4
    logits, cache = _decode(
        model, tokens[:, :prefill], positions[:, :prefill], cache, mask[:, :prefill]
    )
    # Padding slots have arbitrary (but finite) logits; compare real tokens only.
    m = np.asarray(mask)
    np.testing.assert_allclose(
        np.asarray(logits)[m[:, :prefill]], np.asarray(full[:, :prefill])[m[:, :prefill]], atol=1e-5
    )
    for t in range(prefill, 10):
        logits, cache = _decode(model, tokens[:, t : t + 1], positions[:, t : t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert int(cache.index) == 10
    np.testing.assert_array_equal(np.asarray(cache.mask[:, :10]), m)


@pytest.mark.parametrize("scan", [False, True])
def test_fresh_prefill_equals_the_cached_prefill_and_ignores_old_slots(scan):
    """``decode(fresh=True)`` (causal attention in query blocks) on a cache that already holds
    other tokens == the plain prefill of an empty cache: the same logits, the same keys and
    values in the new slots, those slots alone valid, the index after them; the decode steps
    that follow agree too. With 3 query blocks, left padding, and a stale cache whose old
    slots would change every logit if they were attended to; per-layer and scanned layers.
    A prompt longer than the cache is refused."""
    config = dataclasses.replace(TINY, causal_block_size=4, scan_layers=scan)
    model = _model(config)
    tokens, positions, mask = _left_padded(length=10, pads=(0, 2, 5))
    m = np.asarray(mask)
    empty = model.init_cache(batch=3, max_len=16)
    plain_logits, plain = _decode(model, tokens, positions, empty, mask)
    # A stale cache: 13 other tokens already written (index 13, their slots valid).
    other, other_pos, _ = _left_padded(length=13, pads=(0, 0, 0), seed=7)
    _, stale = _decode(model, other, other_pos, empty)
    assert int(stale.index) == 13
    fresh_logits, fresh = _decode(model, tokens, positions, stale, mask, fresh=True)

    np.testing.assert_allclose(
        np.asarray(fresh_logits)[m], np.asarray(plain_logits)[m], atol=1e-5, rtol=1e-5
    )
    assert int(fresh.index) == 10
    np.testing.assert_array_equal(np.asarray(fresh.mask[:, :10]), m)
    assert not np.asarray(fresh.mask[:, 10:]).any()  # the stale slots are no longer valid
    # Keys [B, KV, D, S] and values [B, KV, S, D] of the valid slots (a padding slot's are
    # masked out, and its query row, which has no valid key, is undefined).
    for a, b in zip(fresh.k, plain.k):
        a, b = np.moveaxis(np.asarray(a), -1, 1), np.moveaxis(np.asarray(b), -1, 1)
        np.testing.assert_allclose(a[:, :10][m], b[:, :10][m], atol=1e-5, rtol=1e-5)
    for a, b in zip(fresh.v, plain.v):
        a, b = np.moveaxis(np.asarray(a), -2, 1), np.moveaxis(np.asarray(b), -2, 1)
        np.testing.assert_allclose(a[:, :10][m], b[:, :10][m], atol=1e-5, rtol=1e-5)
    # Had the stale slots been attended to, the logits would differ far beyond that.
    stale_logits, _ = _decode(model, tokens, positions + 13, stale, mask)
    assert np.abs(np.asarray(stale_logits)[m] - np.asarray(plain_logits)[m]).max() > 1e-2

    nxt, nxt_pos, _ = _left_padded(length=3, pads=(0, 0, 0), seed=3)
    for t in range(3):
        step = (nxt[:, t : t + 1], nxt_pos[:, t : t + 1] + 10)
        a, fresh = _decode(model, *step, fresh)
        b, plain = _decode(model, *step, plain)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="fresh prefill of 10 tokens needs a cache of at least"):
        model.decode(tokens, positions, model.init_cache(3, 8), attention_mask=mask, fresh=True)


def test_fresh_prefill_gradients_equal_the_cached_prefill():
    """The update's shared-prefix forward differentiates through a fresh prefill: the
    parameters' gradients of the prompt's hidden states equal those of the plain prefill."""
    config = dataclasses.replace(TINY, causal_block_size=4)
    model = _model(config)
    tokens, positions, mask = _left_padded(length=10, pads=(0, 2, 5))
    graphdef, state = nnx.split(model)
    weights = jnp.asarray(np.random.default_rng(0).standard_normal((3, 10, config.hidden_size)))
    w = weights * jnp.asarray(mask)[..., None]

    def loss(state, fresh):
        mdl = nnx.merge(graphdef, state)
        h, _ = mdl.decode_hidden(
            tokens, positions, mdl.init_cache(3, 14), attention_mask=mask, fresh=fresh
        )
        return jnp.sum(h * w)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    for a, b in zip(jax.tree.leaves(grad(state, True)), jax.tree.leaves(grad(state, False))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_fresh_prefill_keeps_less_of_the_scores():
    """A fresh prefill of 1,024 tokens needs well under the temporary memory of the plain
    one, which holds the whole ``[T, S]`` scores (and their exponentials) at once."""
    graphdef, state = nnx.split(_model())
    t = 1024

    def prefill(state, tokens, fresh):
        mdl = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
        return mdl.decode(tokens, pos, mdl.init_cache(2, t + 8), last_only=True, fresh=fresh)

    tokens = jnp.ones((2, t), jnp.int32)
    temp = {
        fresh: jax.jit(prefill, static_argnums=2)
        .lower(state, tokens, fresh)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for fresh in (False, True)
    }
    scores = 2 * TINY.num_heads * t * (t + 8) * 4  # one layer's float32 [T, S] scores
    assert temp[False] > scores  # the plain prefill does hold them whole
    assert temp[True] < 0.6 * temp[False], temp


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) ", line)
        if head:
            cur = comps.setdefault(head.group(1), [])
        elif cur is not None:
            cur.append(line)
    return comps


def test_decode_loop_reads_the_cache_in_place():
    """A decode step inside a while loop moves one token's worth of cache, never the cache.

    Every instruction of the compiled loop body whose result is a layer's cache buffer must be
    the in-place write of the new slot (a dynamic-update-slice) or a tuple access: a cache-sized
    copy or transpose there (the re-layout that made decode throughput stop growing with the
    batch) fails this test.
    """
    model = _model()
    batch, slots = 8, 48
    graphdef, state = nnx.split(model)

    def run(state, tok):
        mdl = nnx.merge(graphdef, state)

        def body(i, carry):
            cache, tok = carry
            logits, cache = mdl.decode(tok, jnp.full((batch, 1), i), cache)
            return cache, jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)

        return jax.lax.fori_loop(0, slots, body, (mdl.init_cache(batch, slots), tok))[1]

    text = jax.jit(run).lower(state, jnp.ones((batch, 1), jnp.int32)).compile().as_text()
    body = _computations(text)[re.search(r"body=%([\w.\-]+)", text).group(1)]
    size = batch * TINY.num_kv_heads * TINY.head_dim * slots
    cache_sized = []
    for line in body:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]+)\]\S* (\S+)", line)
        if m and int(np.prod([int(d) for d in m.group(2).split(",")])) == size:
            cache_sized.append((m.group(1), m.group(3)))
    assert len(cache_sized) >= 2 * TINY.num_layers, cache_sized  # the writes, at least
    for name, op in cache_sized:
        assert op.startswith("get-tuple-element") or "dynamic-update-slice" in name, (name, op)


def test_shared_prefix_decode_loop_copies_no_prefix():
    """A shared-prefix decode step (groups of 4 rows on one prefix row) inside a while loop
    holds no per-row copy of the prefix: no instruction of the compiled loop body has the size
    of a layer's prefix keys or values repeated for every row, and the rows' own buffers are
    only written in place."""
    model = _model()
    groups, size, prompt, slots = 2, 4, 40, 16
    batch = groups * size
    graphdef, state = nnx.split(model)
    kv, d = TINY.num_kv_heads, TINY.head_dim

    def run(state, prompt_tokens, tok):
        mdl = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(prompt), (groups, prompt))
        _, prefix = mdl.decode_hidden(
            prompt_tokens, positions, mdl.init_cache(groups, prompt), fresh=True
        )

        def body(i, carry):
            cache, tok = carry
            pos = jnp.full((batch, 1), prompt + i)
            logits, cache = mdl.decode_shared_prefix(tok, pos, prefix, cache, size)
            return cache, jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)

        own = mdl.init_cache(batch, slots)
        return jax.lax.fori_loop(0, slots, body, (own, tok))[1]

    args = (state, jnp.ones((groups, prompt), jnp.int32), jnp.ones((batch, 1), jnp.int32))
    text = jax.jit(run).lower(*args).compile().as_text()
    body = _computations(text)[re.search(r"body=%([\w.\-]+)", text).group(1)]
    copied = batch * kv * d * prompt  # every row's copy of a layer's prefix keys
    own = batch * kv * d * slots
    sizes = []
    for line in body:
        m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]+)\]\S* (\S+)", line)
        if m:
            sizes.append(
                (m.group(1), m.group(3), int(np.prod([int(x) for x in m.group(2).split(",")])))
            )
    assert not [x for x in sizes if x[2] >= copied], [x for x in sizes if x[2] >= copied]
    writes = [x for x in sizes if x[2] == own]
    assert len(writes) >= 2 * TINY.num_layers, writes
    for name, op, _ in writes:  # a bitcast is a view
        assert op.startswith(("get-tuple-element", "bitcast(")) or "dynamic-update-slice" in name, (
            name,
            op,
        )


@pytest.mark.parametrize("tie", [False, True])
def test_decode_last_only_is_the_last_position(tie):
    """``decode(last_only=True)`` (the sampler's prefill) == the last column, same cache."""
    model = _model(dataclasses.replace(TINY, tie_embeddings=tie))
    tokens, positions, mask = _left_padded(length=10, pads=(0, 2, 3))
    cache = model.init_cache(batch=3, max_len=12)
    full, c_full = _decode(model, tokens, positions, cache, mask)
    last, c_last = _decode(model, tokens, positions, cache, mask, last_only=True)
    assert last.shape == (3, 1, TINY.vocab_size)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, -1]), atol=1e-6)
    for a, b in zip(jax.tree.leaves(c_full), jax.tree.leaves(c_last)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_compute_logits_f32_close_to_f32():
    model = _model()
    tokens, positions, mask = _left_padded()
    ref = _fwd(model, tokens, positions, mask)
    model_bf16 = _model(dataclasses.replace(TINY, dtype="bfloat16"))
    out = _fwd(model_bf16, tokens, positions, mask)
    assert out.dtype == jnp.float32
    m = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(ref)[m], atol=5e-2)


def test_remat_same_value_and_grad():
    tokens, positions, mask = _left_padded()
    outs = []
    for remat in (False, True):
        model = _model(dataclasses.replace(TINY, remat=remat))

        def loss(mdl):
            return jnp.mean(mdl(tokens, positions, attention_mask=mask) ** 2)

        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        outs.append((value, jax.tree.leaves(grads)))
    np.testing.assert_allclose(outs[0][0], outs[1][0], rtol=1e-6)
    for a, b in zip(outs[0][1], outs[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_hf_config_round_trip():
    hf = TINY.to_hf()
    assert hf["model_type"] == "qwen2"
    assert TransformerConfig.from_hf(hf) == TINY
    llama = dataclasses.replace(TINY, qkv_bias=False, tie_embeddings=True)
    assert TransformerConfig.from_hf(llama.to_hf()) == llama
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        TransformerConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 300))
def test_causal_blocks_cover_the_sequence(t, block):
    """Query blocks are contiguous, cover 0..t in order, and number at most 16."""
    blocks = _causal_blocks(t, block)
    assert blocks[0][0] == 0 and blocks[-1][1] == t
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert all(lo < hi for lo, hi in blocks)
    assert len(blocks) <= 16
    if block == 0 or t <= block:
        assert blocks == [(0, t)]


@settings(max_examples=10, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(0, 2**16),
    st.sampled_from(["float32", "bfloat16"]),
)
@example(1, 1, 3, 0, "float32")  # I=3 > O=2: the backward transposes dy
@example(1, 2, 3, 0, "float32")  # I=3 <= O=10: the residual is x^T
def test_linear_equals_the_matmul_in_value_and_gradient(in_dims, out_dims, t, seed, dtype):
    """``_linear`` (the projections' hand-written backward) == the einsum it replaces, value and
    both gradients, for 1-2 contracted and 1-3 output dims, in float32 and bfloat16. Both
    residual layouts are exercised: ``I <= O`` keeps ``x^T`` (e.g. I=3, O=10), ``I > O``
    keeps ``x`` and transposes ``dy`` (e.g. I=3, O=2)."""
    rng = np.random.default_rng(seed)
    in_shape, out_shape = (3, 4)[:in_dims], (2, 5, 3)[:out_dims]
    x = jnp.asarray(rng.standard_normal((2, t, *in_shape)), dtype)
    w = jnp.asarray(rng.standard_normal((*in_shape, *out_shape)), dtype)
    cot = jnp.asarray(rng.standard_normal((2, t, *out_shape)), jnp.float32)
    letters_in, letters_out = "ij"[:in_dims], "opq"[:out_dims]
    spec = f"bt{letters_in},{letters_in}{letters_out}->bt{letters_out}"

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) * cot)

    @jax.jit  # both in one program: one compile per example
    def both(x, w):
        return (
            jax.value_and_grad(loss(lambda x, w: _linear(x, w, in_dims)), (0, 1))(x, w),
            jax.value_and_grad(loss(lambda x, w: jnp.einsum(spec, x, w)), (0, 1))(x, w),
        )

    got, want = both(x, w)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert got[1][0].dtype == x.dtype and got[1][1].dtype == w.dtype
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol
        )


def _np_attention(qh, kh, vh, mask):
    """NumPy reference: masked softmax attention, float64. qh [B, KV, T, G, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (qh, kh, vh))
    s = np.einsum("bktgd,bksd->bktgs", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.asarray(mask)[:, None, :, None, :], s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bktgs,bksd->bktgd", p, v)


def _autodiff_attention(qh, kh, vh, mask):
    """The same attention in plain jnp, differentiated by autodiff (the gradient reference)."""
    s = jnp.einsum("bktgd,bksd->bktgs", qh, kh) / np.sqrt(qh.shape[-1])
    s = jnp.where(mask[:, None, :, None, :], s, -1e30)
    return jnp.einsum("bktgs,bksd->bktgd", jax.nn.softmax(s, axis=-1), vh)


def _assert_attention_matches(fn, qh, kh, vh, mask, weight):
    """``fn(q, k, v)`` (attention in the reference's layouts) equals the float64 NumPy
    forward on query rows with a valid key (finite everywhere), and its gradients equal the
    autodiff gradient of plain softmax attention."""

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v) * weight)

    @jax.jit  # the forward and both gradients in one program: one compile per example
    def run(qh, kh, vh):
        return (
            fn(qh, kh, vh),
            jax.grad(loss(fn), argnums=(0, 1, 2))(qh, kh, vh),
            jax.grad(loss(lambda q, k, v: _autodiff_attention(q, k, v, mask)), argnums=(0, 1, 2))(
                qh, kh, vh
            ),
        )

    out, got, want = run(qh, kh, vh)
    out = np.asarray(out)
    live = np.broadcast_to(np.asarray(mask).any(-1)[:, None, :, None, None], out.shape)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(
        out[live], _np_attention(qh, kh, vh, mask)[live], atol=2e-5, rtol=2e-5
    )
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), atol=5e-5, rtol=5e-5, err_msg=f"d{name}"
        )


def _attention_inputs(seed, b, kv, g, d, t, pads, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    qh = jax.random.normal(keys[0], (b, kv, t, g, d), dtype)
    kh = jax.random.normal(keys[1], (b, kv, t, d), dtype)
    vh = jax.random.normal(keys[2], (b, kv, t, d), dtype)
    valid = np.arange(t)[None, :] >= np.asarray(pads)[:, None]
    mask = jnp.asarray(np.tril(np.ones((t, t), bool))[None] & valid[:, None, :])
    # Cotangent direction; zero on query rows with no valid key (left padding), whose output
    # the mask leaves undefined (blocked: uniform over the block's keys; plain: over all).
    live = np.asarray(mask).any(-1)[:, None, :, None, None]
    weight = jax.random.normal(keys[3], (b, kv, t, g, d), jnp.float32) * live
    return qh, kh, vh, mask, weight


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 24),
    st.integers(0, 9),
    st.integers(1, 2),
    st.integers(0, 2**16),
    st.lists(st.integers(0, 24), min_size=1, max_size=3),
)
def test_blocked_attention_matches_numpy_and_autodiff(t, block, g, seed, pads):
    """The blocked attention and its FlashAttention-style backward (recomputed probabilities,
    ``ds = p (dp - rowsum(dout out))``) equal a float64 NumPy forward and the autodiff gradient
    of plain softmax attention, for any block size, with left padding (rows without any valid
    key are finite and get no gradient from outside)."""
    pads = [min(p, t) for p in pads]
    qh, kh, vh, mask, weight = _attention_inputs(seed, len(pads), 2, g, 8, t, pads)
    blocks = tuple(_causal_blocks(t, block))
    _assert_attention_matches(
        lambda q, k, v: _blocked_causal_attention(q, k, v, mask, blocks), qh, kh, vh, mask, weight
    )


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(0, 12),
    st.integers(1, 3),
    st.integers(0, 2**16),
    st.lists(st.integers(0, 24), min_size=1, max_size=3),
)
def test_cached_attention_matches_numpy_and_autodiff(t, prefix, g, seed, pads):
    """The cached attention (``T`` new queries against ``prefix + T`` cache slots, keys stored
    slot-minor) and its FlashAttention-style backward equal a float64 NumPy forward and the
    autodiff gradient of plain softmax attention, with left padding in the cache; a query row
    without any valid key stays finite and gets no gradient from outside."""
    s = prefix + t
    pads = [min(p, s) for p in pads]
    qh, kh, vh, mask, weight = _attention_inputs(seed, len(pads), 2, g, 8, s, pads)
    qh, mask, weight = qh[:, :, prefix:], mask[:, prefix:], weight[:, :, prefix:]
    b, kv, _, _, d = qh.shape

    def to_cached(q):  # [B, KV, T, G, D] -> [B, KV, G * T, D]
        return q.transpose(0, 1, 3, 2, 4).reshape(b, kv, g * t, d)

    def from_cached(o):
        return o.reshape(b, kv, g, t, d).transpose(0, 1, 3, 2, 4)

    def cached(q, k, v):
        return from_cached(_cached_attention(to_cached(q), k.transpose(0, 1, 3, 2), v, mask, g))

    _assert_attention_matches(cached, qh, kh, vh, mask, weight)


@pytest.mark.parametrize("kind", ["blocked", "one-block", "cached", "shared-prefix"])
def test_attention_bfloat16_tracks_float32(kind):
    """bf16 inputs: value and gradients stay within bf16 rounding of the float32 computation,
    and come back in bf16 (the blocked attention of a whole sequence, in three blocks and in
    one, the cached one of 8 new queries against a 24-slot cache, and the shared-prefix one of
    two rows' 8 tokens against their 16-slot prefix). With one block, XLA once folded the key
    and value gradients' final transposes into their products, as bfloat16 dots XLA:CPU's
    runtime cannot run."""
    qh, kh, vh, mask, weight = _attention_inputs(3, 2, 2, 2, 16, 24, (0, 5))
    if kind in ("blocked", "one-block"):
        blocks = tuple(_causal_blocks(24, 8 if kind == "blocked" else 0))

        def attend(q, k, v):
            return _blocked_causal_attention(q, k, v, mask, blocks)

    elif kind == "cached":
        qh, weight = qh[:, :, 16:], weight[:, :, 16:]
        b, kv, t, g, d = qh.shape

        def attend(q, k, v):
            qm = q.transpose(0, 1, 3, 2, 4).reshape(b, kv, g * t, d)
            out = _cached_attention(qm, k.transpose(0, 1, 3, 2), v, mask[:, 16:], g)
            return out.reshape(b, kv, g, t, d).transpose(0, 1, 3, 2, 4)

    else:  # the two rows as one group: row 0's first 16 slots are the prefix, unmasked
        qh, weight = qh[:, :, 16:], weight[:, :, 16:]
        b, kv, t, g, d = qh.shape
        pmask = np.ones((1, 16), bool)
        wmask = np.broadcast_to(np.tril(np.ones((8, 8), bool)), (2, 8, 8))

        def attend(q, k, v):
            qm = q.transpose(0, 1, 3, 2, 4).reshape(b, kv, g * t, d)
            out = _shared_prefix_attention(
                qm,
                k[:1, :, :16].transpose(0, 1, 3, 2),
                v[:1, :, :16],
                k[:, :, 16:].transpose(0, 1, 3, 2),
                v[:, :, 16:],
                pmask,
                wmask,
                g,
                2,
            )
            return out.reshape(b, kv, g, t, d).transpose(0, 1, 3, 2, 4)

    bf = [x.astype(jnp.bfloat16) for x in (qh, kh, vh)]

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * weight)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # compiled as the model runs it
    got = grad(*bf)
    want = grad(*[x.astype(jnp.float32) for x in bf])
    for a, ref in zip(got, want):
        assert a.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(ref)))
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - ref))) < 0.05 * scale


def _dot_lhs_contractions(hlo: str) -> list[tuple[str, int, int]]:
    """(dot line, the left operand's contracted axis, its minor-most axis) for every dot of an
    optimized HLO module's text with one contracted axis."""
    shapes = {}  # instruction name -> minor-to-major layout of its result
    for m in re.finditer(r"%([\w.\-]+) = \w+\[[\d,]*\]\{([\d,]*)\}", hlo):
        shapes[m.group(1)] = [int(x) for x in m.group(2).split(",") if x]
    out = []
    for line in hlo.splitlines():
        m = re.search(r"dot\(%([\w.\-]+), %[\w.\-]+\).*lhs_contracting_dims=\{(\d+)\}", line)
        if m and shapes.get(m.group(1)):
            out.append((line.strip()[:120], int(m.group(2)), shapes[m.group(1)][0]))
    return out


@pytest.mark.parametrize("block", [16, 0])
def test_blocked_attention_gradient_dots_contract_the_minor_axis(block):
    """Every dot of the blocked attention's compiled gradient contracts its left operand's
    minor-most axis: no product runs over the probabilities' leading (query) axis, the form
    XLA:CPU runs as a strided dot (``dk = ds^T q`` and ``dv = p^T dout`` are computed as
    ``dk^T = q^T ds`` and ``dv^T = dout^T p``). Written the other way, eight dots of the
    four-block gradient fail it; with one block, XLA folded the final transposes back into
    two such dots until an optimization barrier kept them apart."""
    qh, kh, vh, mask, weight = _attention_inputs(0, 2, 2, 2, 16, 64, (0, 3))
    blocks = tuple(_causal_blocks(64, block))

    def loss(q, k, v):
        return jnp.sum(_blocked_causal_attention(q, k, v, mask, blocks) * weight)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qh, kh, vh).compile().as_text()
    dots = _dot_lhs_contractions(hlo)
    assert len(dots) >= 5 * len(blocks)  # scores, pv, dp, dk, dv, dq per block (scores once)
    strided = [line for line, axis, minor in dots if axis != minor]
    assert not strided, strided


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(1, 6),
    st.integers(0, 4),
    st.integers(1, 2),
    st.integers(0, 2**16),
    st.data(),
)
def test_shared_prefix_attention_matches_numpy_and_autodiff(n, r, p, t, old, g, seed, data):
    """The shared-prefix attention (a group's ``r`` rows, each ``t`` new queries against the
    group's one ``p``-slot prefix and its own ``old + t`` slots, the new ones causally) equals
    a float64 NumPy forward and the autodiff gradient of plain softmax attention over each
    row's own copy of the prefix followed by its slots; the prefix's gradients are the sums
    over the group's rows. With left padding in the prefix and padding among a row's slots, a
    row without any valid key (fully padded prefix and row) stays finite and gets no
    gradient."""
    b, s = n * r, old + t
    pads = data.draw(st.lists(st.integers(0, p), min_size=n, max_size=n))
    own_len = data.draw(st.lists(st.integers(0, s), min_size=b, max_size=b))
    qh, kh, vh, _, _ = _attention_inputs(seed, b, 2, g, 8, p + s, [0] * b)
    qh = qh[:, :, p + old :]
    group_of = np.arange(b) // r
    pk, pv = kh[::r, :, :p], vh[::r, :, :p]  # [N, KV, P, D]: the group's first row's
    wk, wv = kh[:, :, p:], vh[:, :, p:]  # [B, KV, S, D]: each row's own slots
    pmask = np.arange(p)[None, :] >= np.asarray(pads)[:, None]  # [N, P]
    valid = np.arange(s)[None, :] < np.asarray(own_len)[:, None]  # [B, S]
    causal = np.arange(s)[None, :] <= old + np.arange(t)[:, None]  # [T, S]
    wmask = causal[None] & valid[:, None, :]  # [B, T, S]
    mask = jnp.asarray(
        np.concatenate([np.broadcast_to(pmask[group_of, None, :], (b, t, p)), wmask], axis=-1)
    )
    live = np.asarray(mask).any(-1)[:, None, :, None, None]
    weight = jax.random.normal(jax.random.key(seed + 1), qh.shape, jnp.float32) * live
    kv, d = qh.shape[1], qh.shape[-1]

    def shared(q, pk, pv, wk, wv):
        qm = q.transpose(0, 1, 3, 2, 4).reshape(b, kv, g * t, d)
        out = _shared_prefix_attention(
            qm,
            pk.transpose(0, 1, 3, 2),
            pv,
            wk.transpose(0, 1, 3, 2),
            wv,
            jnp.asarray(pmask),
            jnp.asarray(wmask),
            g,
            r,
        )
        return out.reshape(b, kv, g, t, d).transpose(0, 1, 3, 2, 4)

    def copies(q, pk, pv, wk, wv):  # every row with its own copy of its group's prefix
        k = jnp.concatenate([pk[group_of], wk], axis=2)
        v = jnp.concatenate([pv[group_of], wv], axis=2)
        return _autodiff_attention(q, k, v, mask)

    def loss(f):
        return lambda *xs: jnp.sum(f(*xs) * weight)

    out, got, want = jax.jit(
        lambda *xs: (
            shared(*xs),
            jax.grad(loss(shared), argnums=tuple(range(5)))(*xs),
            jax.grad(loss(copies), argnums=tuple(range(5)))(*xs),
        )
    )(qh, pk, pv, wk, wv)
    out = np.asarray(out)
    full_k = np.concatenate([np.asarray(pk)[group_of], np.asarray(wk)], axis=2)
    full_v = np.concatenate([np.asarray(pv)[group_of], np.asarray(wv)], axis=2)
    live = np.broadcast_to(live, out.shape)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(
        out[live], _np_attention(qh, full_k, full_v, mask)[live], atol=2e-5, rtol=2e-5
    )
    for name, a, w in zip(("q", "prefix k", "prefix v", "own k", "own v"), got, want):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(w), atol=5e-5, rtol=5e-5, err_msg=f"d {name}"
        )


def test_shared_prefix_attention_gradient_dots_contract_the_minor_axis():
    """The shared-prefix attention's compiled gradient has no strided dot either: its key and
    value gradients come from ``q^T`` and ``dout^T`` laid out behind a barrier (without it,
    XLA folded the transposes of ``q`` back into two products over its token axis)."""
    n, r, kv, g, t, p, d = 2, 4, 2, 2, 16, 40, 16
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (n * r, kv, g * t, d))
    pk = jax.random.normal(keys[1], (n, kv, d, p))
    pv = jax.random.normal(keys[2], (n, kv, p, d))
    wk = jax.random.normal(keys[3], (n * r, kv, d, t))
    wv = jax.random.normal(keys[4], (n * r, kv, t, d))
    weight = jax.random.normal(keys[5], q.shape)
    pmask = jnp.ones((n, p), bool)
    wmask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (n * r, t, t))

    def loss(*xs):
        return jnp.sum(_shared_prefix_attention(*xs, pmask, wmask, g, r) * weight)

    args = (q, pk, pv, wk, wv)
    hlo = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).lower(*args).compile().as_text()
    dots = _dot_lhs_contractions(hlo)
    assert len(dots) >= 12  # 2 scores, 2 outputs, 2 dp, 2 dq, 4 key / value gradients
    strided = [line for line, axis, minor in dots if axis != minor]
    assert not strided, strided


@pytest.mark.parametrize("scan", [False, True])
def test_shared_prefix_hidden_equals_per_row_copies(scan):
    """``shared_prefix_hidden``: rows in groups of 3 continuing their group's prefilled
    prompt give the hidden states and parameter gradients of ``decode_hidden`` with each row
    holding its own copy of the prompt's cache (``take_rows``), per-layer and scanned, with a
    left-padded prompt, a padded row and a row with no valid token."""
    config = dataclasses.replace(TINY, scan_layers=scan, causal_block_size=4)
    model = _model(config)
    graphdef, state = nnx.split(model)
    n, r, t = 3, 3, 5
    prompt, ppos, pmask = _left_padded(batch=n, length=9, pads=(0, 2, 4), seed=1)
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(1, config.vocab_size, (n * r, t)), jnp.int32)
    start = np.asarray(ppos)[:, -1] + 1
    positions = jnp.asarray(np.repeat(start, r)[:, None] + np.arange(t)[None], jnp.int32)
    own = np.ones((n * r, t), bool)
    own[4, 3:] = False
    own[7] = False
    own = jnp.asarray(own)
    weight = jnp.asarray(rng.standard_normal((n * r, t, config.hidden_size)), jnp.float32)
    weight = weight * own[..., None]

    def hidden(state, shared):
        mdl = nnx.merge(graphdef, state)
        _, cache = mdl.decode_hidden(
            prompt, ppos, mdl.init_cache(n, 9), attention_mask=pmask, fresh=True
        )
        if shared:
            return mdl.shared_prefix_hidden(tokens, positions, cache, r, attention_mask=own)
        rows = cache.take_rows(jnp.arange(n * r) // r).pad_slots(t)
        return mdl.decode_hidden(tokens, positions, rows, attention_mask=own)[0]

    def loss(state, shared):
        return jnp.sum(hidden(state, shared) * weight)

    run = jax.jit(
        lambda state, shared: (hidden(state, shared), jax.grad(loss)(state, shared)),
        static_argnums=1,
    )
    (h_shared, g_shared), (h_copies, g_copies) = run(state, True), run(state, False)
    m = np.asarray(own)
    np.testing.assert_allclose(
        np.asarray(h_shared)[m], np.asarray(h_copies)[m], atol=2e-5, rtol=2e-5
    )
    assert np.isfinite(np.asarray(h_shared)).all()
    for a, b in zip(jax.tree.leaves(g_shared), jax.tree.leaves(g_copies)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"prefix rows \(3\) x size \(2\)"):
        mdl = nnx.merge(graphdef, state)
        mdl.shared_prefix_hidden(tokens, positions, mdl.init_cache(n, 9), 2, attention_mask=own)


@pytest.mark.parametrize("block", [4, 7])
def test_causal_blocks_equal_unblocked_attention(block):
    """Blocked causal attention (keys up to each query block's end) == one block, in value and
    gradient, with left padding and a length the block does not divide."""
    config = dataclasses.replace(TINY, causal_block_size=0)
    model = _model(config)
    blocked = nnx.merge(
        nnx.graphdef(abstract_model(dataclasses.replace(config, causal_block_size=block))),
        nnx.state(model),
    )
    tokens, positions, mask = _left_padded(length=30, pads=(0, 3, 11))
    m = np.asarray(mask)

    def loss(mdl):
        return jnp.sum(jnp.where(mask[..., None], _fwd(mdl, tokens, positions, mask), 0.0) ** 2)

    np.testing.assert_allclose(
        np.asarray(_fwd(blocked, tokens, positions, mask))[m],
        np.asarray(_fwd(model, tokens, positions, mask))[m],
        atol=1e-5,
        rtol=1e-5,
    )
    g_ref = nnx.state(nnx.jit(nnx.grad(loss))(model))
    g_blk = nnx.state(nnx.jit(nnx.grad(loss))(blocked))
    for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_blk)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(["float32", "bfloat16"]))
def test_swiglu_equals_autodiff_in_value_and_gradient(seed, dtype):
    """``_swiglu`` (the written-out backward) == ``silu(gate) * up`` under autodiff: the same
    value bit for bit (the forward is that expression), both gradients to rounding.

    In float32 the two gradients agree to 1e-5. In bfloat16 both are checked against the exact
    gradient (float64, from the same rounded inputs) with a bound of eight bfloat16 roundings
    of each term's magnitude: near ``gate * (1 - s) = -1`` the gate gradient cancels, and there
    autodiff's own bfloat16 rounding differs from the written-out one by more than any fixed
    relative tolerance, while both stay within the rounding bound of the exact value.
    """
    rng = np.random.default_rng(seed)
    gate, up = (jnp.asarray(4 * rng.standard_normal((3, 5, 7)), dtype) for _ in range(2))
    cot = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.float32)

    def loss(fn):
        return lambda g, u: jnp.sum(fn(g, u).astype(jnp.float32) * cot)

    got = jax.jit(jax.value_and_grad(loss(_swiglu), (0, 1)))(gate, up)
    want = jax.jit(jax.value_and_grad(loss(lambda g, u: jax.nn.silu(g) * u), (0, 1)))(gate, up)
    np.testing.assert_array_equal(np.asarray(_swiglu(gate, up)), np.asarray(jax.nn.silu(gate) * up))
    (_, got_grads), (_, want_grads) = got, want
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(got_grads, want_grads):
        assert a.dtype == b.dtype == jnp.dtype(dtype)
    if dtype == "float32":
        for a, b in zip(got_grads, want_grads):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
        return
    # The exact gradient of the rounded inputs; the cotangent reaches the backward in bfloat16.
    x, u = (np.asarray(v, np.float64) for v in (gate, up))
    g = np.asarray(cot.astype(jnp.bfloat16), np.float64)
    s = 1 / (1 + np.exp(-x))
    exact_gate, exact_up = g * u * s * (1 + x * (1 - s)), g * x * s
    scale_gate = np.abs(g * u * s) * (1 + np.abs(x * (1 - s)))
    scale_up = np.abs(g * x * s)
    eps = 2.0**-8  # bfloat16's spacing at 1
    for grads in (got_grads, want_grads):
        for a, exact, scale in zip(grads, (exact_gate, exact_up), (scale_gate, scale_up)):
            err = np.abs(np.asarray(a, np.float64) - exact)
            assert np.all(err <= 8 * eps * scale + 1e-30), float(np.max(err / (scale + 1e-30)))


def test_materialized_is_the_identity():
    """The dot with the identity returns its operand's values exactly (huge ones and the
    smallest normal ones too; subnormals, which the CPU dot flushes to zero, cannot occur in
    the cos/sin tables it carries), in float32 and bfloat16."""
    x = np.random.default_rng(0).standard_normal((4, 3, 1, 32)).astype(np.float32)
    x[0, 0, 0, :4] = [3e38, -3e38, 1.2e-38, 0.0]
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(_materialized)(jnp.asarray(x, dtype))
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(x, dtype)))


def test_rope_matches_numpy_rotate_half():
    """``rope`` == the rotate-half formula in NumPy (float64), at large positions too."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [100, 2000, 30000, 7, 9]], np.int32)
    inv = 1.0 / (10000.0 ** (np.arange(0, 8, 2) / 8))
    ang = pos[..., None, None] * np.concatenate([inv, inv])  # [B, T, 1, D]
    rot = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    want = x * np.cos(ang) + rot * np.sin(ang)
    got = jax.jit(lambda x, p: rope(x, p, 10000.0))(x, pos)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_training_step_evaluates_rope_cos_sin_once():
    """The compiled forward + backward of a training loss evaluates ``cos`` and ``sin`` once
    each: XLA:CPU fused them into every query, key and attention-block fusion (72 in the small
    benchmark config's update) before the tables were materialised."""
    model = _model(dataclasses.replace(TINY, causal_block_size=4))
    graphdef, state = nnx.split(model)
    tokens, positions, mask = _left_padded(length=16, pads=(0, 2, 5))

    def loss(state):
        logits = nnx.merge(graphdef, state)(tokens, positions, attention_mask=mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    text = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
    assert len(re.findall(r" cosine\(", text)) == 1, re.findall(r".* cosine\(.*", text)
    assert len(re.findall(r" sine\(", text)) == 1
