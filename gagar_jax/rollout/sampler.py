"""The embedded rollout engine: a jitted JAX sampler over `gagar_jax.models.Transformer`.

One compiled program per shape bucket does the whole generation:

    prefill:  logits, cache = model.decode(prompts [Bp, P], positions, cache, attention_mask)
              (once per distinct prompt; the n samples of a prompt copy its cache rows: [B, ...])
    loop:     lax.while_loop while step < max_new and not all(done):
                token, logprob = sample(logits_t)           # temperature / top-k / top-p
                logits, cache = model.decode(token [B, 1], position, cache)

The decode step is one token's attention and MLP: the cache is written in place (one slot per
layer), the key mask gains one slot, nothing leaves the device until the loop ends. The loop is
split into a few segments (``decode_segments``) whose caches hold only the slots filled by the
segment's end, so early steps do not read the empty tail of the budget.

Multi-turn (``prefix_cache > 0``): the final cache of a call is kept (compacted: each row's
valid slots right-aligned), and a later prompt that extends a kept row's sequence (prompt +
sample, e.g. an episode's history) starts from that row's cache and prefills only the new
tokens (the observation), instead of the whole history each turn.

Shapes are static and bucketed: prompts are left-padded to the next prompt bucket `P` (the padding
is masked out of attention; RoPE positions start at 0 on each row's first real token), the batch is
padded to the next batch bucket `B` with rows that start finished, and the new-token budget is
rounded up to the next bucket `N` while the actual `max_tokens` is a traced scalar. The distinct
prompts (prefilled once each) are padded to their own bucket `Bp` (`prefill_buckets`: the batch
buckets and the powers of two from 8 up), so 16 prompts x 8 samples in a 128-row bucket prefill
16 rows, not 128. Sampling knobs (temperature, top-p, top-k, stop tokens, seed) are traced values
too, so every batch that falls in the same (B, Bp, P, N) bucket reuses one executable (shared by
every Sampler over the same architecture): `Sampler.trace_count` counts the traces its calls
caused.

Log-probabilities: each generated token's `log_softmax(logits / temperature)` (temperature 1 when
greedy), taken from the full distribution *before* top-k/top-p truncation. This is exactly what the
training forward recomputes on the same tokens (`log_softmax(model(tokens) / temperature)`), so the
PPO ratio is 1 at the behaviour policy. (Truncation changes the sampling distribution, not the
scored one; the usual choice of vLLM/SGLang-based RL trainers.)

Precision (``precision``, ``gagar_jax.rollout.precision``): the sampler may hold and run its
weights in bfloat16, or as weight-only int8 / fp8 (dequantized once per call), converted from
the trainer's at each weight sync. Routes (``record_routes``, a mixture of experts): each
token's experts per MoE layer come back with the samples, for the update's routing replay.

Data parallel (``mesh``): the rows of a call are split over the mesh's data axis; the prefill
is partitioned by XLA, the decode loop runs under ``shard_map``, one loop per device.

Randomness: the key of row `r` (prompt i, sample j -> r = i * n + j) at step `t` is
`fold_in(fold_in(key(seed), r), t)`, so a fixed seed gives the same samples whatever the batch
bucket; without `SamplingParams.seed` the sampler draws a fresh seed from its own counter. A
sampled token takes one uniform number from that key and inverts the (truncated) softmax's
cumulative distribution (`inverse_cdf_draw`): one random number per row and step, where
Gumbel-max would draw one per vocabulary entry.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gagar_jax.models import (
    Transformer,
    load_hf_safetensors,
    stack_layer_params,
    unstack_layer_params,
)
from gagar_jax.models.transformer import Cache
from gagar_jax.rollout.precision import (
    check_precision,
    convert_params,
    dequantize_tree,
    rollout_model_config,
)
from gagar_jax.rollout.types import Sample, SamplingParams, validate_prompts

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_NEW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
MAX_STOP_TOKENS = 8  # stop ids are a padded [MAX_STOP_TOKENS] array: any count up to it, no retrace
# The shared prefill of the distinct prompts has its own buckets: the batch buckets and the
# powers of two from this size up to the largest batch bucket, so a batch bucket sized for the
# sample rows (prompts x n) never pads the prefill to the row count. Each bucket is a program
# of its own (compiled on first use), so fewer prompts than this share one; at 8 prompts of
# 448 tokens x 8 samples on a 2-core CPU, a 16-row prefill made the call 1.36-1.37 s against
# 1.12-1.18 s with 8 rows.
MIN_PREFILL_BUCKET = 8


def prefill_buckets(batch_buckets: Sequence[int], multiple: int = 1) -> tuple[int, ...]:
    """The buckets of the distinct-prompt (prefill) batch: ``batch_buckets`` plus the powers of
    two from ``MIN_PREFILL_BUCKET`` to the largest batch bucket, each rounded up to a multiple
    of ``multiple`` (the data axis size of a data-parallel sampler)."""
    top = max(batch_buckets)
    extra, b = set(), MIN_PREFILL_BUCKET
    while b < top:
        extra.add(-(-b // multiple) * multiple)
        b *= 2
    return tuple(sorted(set(batch_buckets) | {x for x in extra if x <= top}))


def _bucket(n: int, buckets: Sequence[int], what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def _first_max_index(x, top):
    """The first index of ``top`` (``max(x, -1)``, keepdims) in each row of ``x``: argmax as a
    plain reduction.

    XLA:CPU runs ``jnp.argmax`` as one variadic (value, index) reduce that does not vectorise:
    over a [128, 4096] row block it cost 4x a max followed by a min over the matching indices.
    """
    vocab = x.shape[-1]
    idx = jnp.min(jnp.where(x == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(idx, vocab - 1)  # NaN rows (nothing equals the max): the last id


def _argmax(x):
    """``jnp.argmax(x, -1)`` (first index of the maximum) as two plain reductions."""
    return _first_max_index(x, jnp.max(x, axis=-1, keepdims=True))


INVERSE_CDF_BLOCK = 64  # tokens per block of the two-level inverse-CDF draw


def inverse_cdf_draw(x, top, u):
    """One draw per row from ``softmax(x)`` by inverting its cumulative distribution with one
    uniform number per row.

    Args:
      x: [B, V] float32 logits; ``-inf`` where a token is excluded (top-k / top-p).
      top: [B, 1] ``max(x, -1)`` (finite: the most likely token is never excluded).
      u: [B] float32 uniform numbers in [0, 1) (the sampler's: ``jax.random.uniform`` of each
        row's key at this step).
    Returns:
      tokens [B] int32: the first token whose cumulative weight exceeds ``u`` times the total.

    The weights ``exp(x - top)`` are the softmax's numerators (1 at the maximum, 0 where
    excluded, so an excluded token's interval is empty and is never drawn). The search has two
    levels, so no cumulative sum runs over the whole vocabulary: over the sums of blocks of
    ``INVERSE_CDF_BLOCK`` tokens, then inside the chosen block. Gumbel-max
    (``jax.random.categorical``) would need ``V`` random numbers per row; this needs one.
    """
    b, vocab = x.shape
    blk = INVERSE_CDF_BLOCK
    nb = -(-vocab // blk)
    weights = jnp.pad(jnp.exp(x - top), ((0, 0), (0, nb * blk - vocab))).reshape(b, nb, blk)
    block_sum = jnp.sum(weights, axis=-1)  # [B, nb]
    block_cum = jnp.cumsum(block_sum, axis=-1)
    target = u * block_cum[:, -1]

    def first_above(cum, level, positive):
        # The first index whose cumulative weight exceeds ``level``; ``u * total`` can round
        # up to the total, and then the draw is the last index of positive weight.
        ids = jnp.arange(cum.shape[-1], dtype=jnp.int32)
        count = jnp.sum((cum <= level[:, None]).astype(jnp.int32), axis=-1)
        return jnp.minimum(count, jnp.max(jnp.where(positive, ids, 0), axis=-1))

    block = first_above(block_cum, target, block_sum > 0)
    before = jnp.take_along_axis(block_cum - block_sum, block[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0, :]  # [B, blk]
    # Rounding can put the level a hair below the block's start: clamp at 0, so the draw is
    # the block's first token of positive weight.
    level = jnp.maximum(target - before, 0.0)
    within = first_above(jnp.cumsum(inner, axis=-1), level, inner > 0)
    return (block * blk + within).astype(jnp.int32)


def sample_token(logits, key, temperature, top_p, top_k):
    """Draws one token per row and returns its (untruncated) log-probability.

    Args:
      logits: [B, V] float32.
      key: [B] PRNG keys (one per row).
      temperature: [] float32; 0 means greedy.
      top_p: [] float32 in (0, 1]; 1 disables.
      top_k: [] int32; <= 0 disables.
    Returns:
      (tokens [B] int32, logprobs [B] float32): logprobs of log_softmax(logits / T) (T=1 greedy).
    """
    greedy = temperature <= 0.0
    t = jnp.where(greedy, 1.0, temperature)
    scaled = logits.astype(jnp.float32) / t
    vocab = logits.shape[-1]
    # log_softmax(scaled)[token] = (scaled[token] - max) - log(sum(exp(scaled - max))), the
    # same operations as jax.nn.log_softmax, for the chosen token only: no [B, V] log-prob
    # array is written, and greedy rows share the max with their argmax.
    top = jnp.max(scaled, axis=-1, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1))

    def truncate(x):
        # Sort once; a token is kept if its rank < k and the mass strictly before it < top_p
        # (so the most likely token is always kept). Ties at the threshold are kept.
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = sorted_x[:, k - 1][:, None]
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < top_p
        # Smallest kept logit under top-p: the threshold in logit space.
        p_thresh = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
        thresh = jnp.maximum(kth, p_thresh)
        return jnp.where(x >= thresh, x, -jnp.inf)

    def draw(logits, top):
        x = logits.astype(jnp.float32) / t
        need = (top_k > 0) | (top_p < 1.0)
        masked = jax.lax.cond(need, truncate, lambda y: y, x)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)
        return inverse_cdf_draw(masked, top, u)

    # Greedy rows skip the [B, V] Gumbel noise and the truncation entirely (a traced branch:
    # one program serves greedy and sampled calls). The branches take the logits, not
    # ``scaled``: a branch operand is a buffer of its own, and each branch's division by the
    # temperature fuses into its first pass instead.
    tokens = jax.lax.cond(
        greedy,
        lambda logits, top: _first_max_index(logits.astype(jnp.float32) / t, top).astype(jnp.int32),
        draw,
        logits,
        top,
    )
    lp = (jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - top[:, 0]) - log_total
    return tokens, lp


def _check_mesh(mesh, data_axis: str, batch_buckets):
    """(mesh, batch buckets) for a data-parallel Sampler; a clear error for what cannot work.

    The default buckets are rounded up to multiples of the data axis size (a call of fewer rows
    than devices still fits, in a bucket of one row per device); given buckets must all be
    multiples of it."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"Sampler.mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}"
        )
    if data_axis not in mesh.axis_names:
        raise ValueError(
            f"Sampler.data_axis={data_axis!r} is not an axis of Sampler.mesh "
            f"(axes {mesh.axis_names})"
        )
    others = [a for a in mesh.axis_names if a != data_axis and mesh.shape[a] != 1]
    if others:
        raise ValueError(
            f"Sampler.mesh: only the data axis {data_axis!r} may have more than one device "
            f"(the sampler replicates the weights), got sizes {dict(mesh.shape)}"
        )
    here = jax.process_index()
    if any(d.process_index != here for d in mesh.devices.flat):
        raise ValueError(
            "Sampler.mesh must hold only this process's devices (the embedded sampler runs "
            "per host: build it from jax.local_devices())"
        )
    # The program's sharding is XLA's to propagate (Auto axes), whatever the caller's mesh says
    # (`jax.make_mesh` makes Explicit ones).
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    size = mesh.shape[data_axis]
    if tuple(batch_buckets) == DEFAULT_BATCH_BUCKETS:  # each rounded up to a multiple
        batch_buckets = tuple(sorted({-(-b // size) * size for b in batch_buckets}))
    bad = [b for b in batch_buckets if b % size]
    if bad:
        raise ValueError(
            f"Sampler.batch_buckets must be multiples of the data axis size {size} "
            f"(Sampler.mesh.shape[{data_axis!r}]), got {tuple(batch_buckets)}"
        )
    return mesh, batch_buckets


def _segment_ends(n: int, segments: int) -> list[int]:
    """Static ends (in new tokens, increasing, the last one ``n``) of the decode loop's
    segments: at most ``segments`` parts of at least 16 tokens, each a multiple of 8 but the
    last (a shorter segment would save less reading than its copy of the step costs to
    compile)."""
    step = max(16, -(-n // segments // 8) * 8)
    return list(range(step, n, step)) + [n]


_TRACES = [0]  # programs traced so far (all samplers): the recompile counter


def _compact(cache):
    """Moves every row's valid slots to the right end, in order (same shapes).

    Keys carry their RoPE positions, so slot order (not slot index) is all attention needs; a
    right-aligned history lets the next turn's tokens follow it at one common slot index.
    """
    order = jnp.argsort(cache.mask.astype(jnp.int32), axis=1, stable=True)  # invalid first

    def gather(x, axis):  # x [..., B, ...] with the slot axis at `axis`: order [B, S] there
        shape = [1] * x.ndim
        batch = x.ndim + cache.BATCH_AXIS
        shape[batch], shape[axis] = order.shape
        return jnp.take_along_axis(x, order.reshape(shape), axis=axis)

    return cache.map_slots(gather, gather, lambda m: jnp.take_along_axis(m, order, axis=1))


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "pad_id",
        "max_new_bucket",
        "hist_slots",
        "keep_cache",
        "decode_segments",
        "group",
        "mesh",
        "data_axis",
        "kv_cache_dtype",
        "record_routes",
    ),
)
def _generate_program(
    state,
    history,
    hist_src,
    hist_len,
    prompts,
    prompt_mask,
    row_src,
    row_ids,
    live,
    row_seeds,
    temperature,
    top_p,
    top_k,
    stop_ids,
    max_new,
    prefix_src=None,
    *,
    graphdef,
    pad_id: int,
    max_new_bucket: int,
    hist_slots: int,
    keep_cache: bool,
    decode_segments: int,
    group: int = 0,
    mesh=None,
    data_axis: str = "data",
    kv_cache_dtype: str | None = None,
    record_routes: bool = False,
):
    """One generation call.

    prompts/prompt_mask [Bp, P]: the distinct prompts (left-padded; only the part after the
    history when ``history`` is given), prefilled once each; row_src [B] maps each sample row to
    its prompt row, whose KV cache it copies after the prefill. history: None, or a stored
    compacted `Cache` (``Bh`` rows of ``S_h`` slots) of which prompt row i continues row
    ``hist_src[i]`` (its last ``hist_slots`` slots, ``hist_len[i]`` valid tokens). row_ids [B] i32
    and row_seeds [B] u32 (PRNG rows: row ``r`` draws from
    ``fold_in(key(row_seeds[r]), row_ids[r])``, then ``fold_in(., t)`` per step: one seed with
    ``row_ids = arange(B)``, or one seed per prompt with ``row_ids`` the sample index within its
    prompt), live [B] bool. Returns (tokens, logprobs, lengths, stopped, compacted cache or
    None).

    ``group`` > 0: the rows are the prompt rows' samples in order, ``group`` per prompt row
    (``row_src = arange(B) // group``, ``B = Bp * group``). The decode then reads each
    prompt's cache once per step for all its samples (``Transformer.decode_shared_prefix``):
    the samples keep only their own new tokens' keys and values, not a copy of the prompt's.
    ``prefix_src`` [B / group] (a call that repeats a prompt): group i's prompt is prefill
    row ``prefix_src[i]``, whose cache row is copied once per call (None: group i is row i).
    0: each row decodes against its own copy of its prompt's cache.

    With ``mesh``, the rows are split over its ``data_axis``: the prefill runs partitioned by
    XLA (the sample rows' copy of their prompt's cache may cross shards), then the decode loop
    runs under ``shard_map``, each shard its own loop over its own rows, stopping when they are
    all done (no collective per step). With ``group``, each shard holds its rows' prompt rows.

    ``state`` may hold quantized weights (``rollout.precision``): they are dequantized once,
    here, before the prefill. ``kv_cache_dtype``: the caches' dtype (None: the compute dtype).
    ``record_routes`` (a mixture of experts): the experts every prompt token (prefill) and
    every generated token (the decode step that feeds it back) went to, returned as a sixth
    value ``(prompt routes [Bp, P, L, K], generated routes [B, N, L, K])`` (else None).

    One program per (graphdef, pad_id, mesh, Bp, B, P, N, history shape, keep_cache, group):
    samplers over models of the same architecture share compiled programs.
    """
    _TRACES[0] += 1  # runs at trace time only
    state = dequantize_tree(state)
    model = nnx.merge(graphdef, state)
    bp, p = prompts.shape
    n = max_new_bucket
    h = 0 if history is None else hist_slots
    positions = hist_len[:, None] + jnp.maximum(
        jnp.cumsum(prompt_mask.astype(jnp.int32), axis=1) - 1, 0
    )
    prompt_len = hist_len + jnp.sum(prompt_mask.astype(jnp.int32), axis=1)  # [Bp]
    ends = _segment_ends(n, decode_segments)
    cache = model.init_cache(bp, h + p + (0 if group else ends[0]), dtype=kv_cache_dtype)
    if history is not None:
        hist = history.take_rows(hist_src).slice_slots(history.mask.shape[1] - h)
        cache = cache.write_slots(hist, 0)._replace(index=jnp.asarray(h, jnp.int32))
    # Left padding: the last slot is every row's last prompt token, the only logits needed
    # (last_only: no LM head over the other prompt positions). Then the n samples of a
    # prompt copy its prefilled cache (one prefill per distinct prompt, not per sample).
    out = model.decode(
        prompts,
        positions,
        cache,
        attention_mask=prompt_mask,
        last_only=True,
        fresh=history is None,  # an empty cache: causal attention in query blocks
        return_routes=record_routes,
    )
    logits, cache = out[:2]
    prompt_routes = out[2] if record_routes else None
    logits = logits[row_src, -1, :]
    prompt_len = prompt_len[row_src]
    if group:  # the prompts' cache stays one row per prompt; each sample's own slots
        prefix = cache if prefix_src is None else cache.take_rows(prefix_src)
        cache = model.init_cache(row_src.shape[0], ends[0], dtype=kv_cache_dtype)
    else:
        prefix, cache = None, cache.take_rows(row_src)

    def decode_loop(
        state,
        prefix,
        logits,
        cache,
        live,
        prompt_len,
        row_seeds,
        row_ids,
        temperature,
        top_p,
        top_k,
        stop_ids,
        max_new,
    ):
        model = nnx.merge(graphdef, state)
        row_keys = jax.vmap(lambda s, r: jax.random.fold_in(jax.random.key(s), r))(
            row_seeds, row_ids
        )
        b = logits.shape[0]
        # RoPE tables of every step's positions ([B, N, 1, D] each), computed once: sliced per
        # step, they keep cos / sin out of the loop body (XLA would evaluate them per layer).
        rope = model.rope_tables(prompt_len[:, None] + jnp.arange(n, dtype=jnp.int32)[None])

        def cond(end, carry):
            step, _, _, done, *_ = carry
            return (step < jnp.minimum(max_new, end)) & ~jnp.all(done)

        def body(carry):
            step, logits, cache, done, toks, lps, lengths, stopped, routes = carry
            keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(row_keys)
            tok, lp = sample_token(logits, keys, temperature, top_p, top_k)
            tok = jnp.where(done, pad_id, tok)
            lp = jnp.where(done, 0.0, lp)
            toks = jax.lax.dynamic_update_index_in_dim(toks, tok, step, axis=1)
            lps = jax.lax.dynamic_update_index_in_dim(lps, lp, step, axis=1)
            lengths = jnp.where(done, lengths, step + 1)
            hit = (~done) & jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            stopped = stopped | hit
            pos = (prompt_len + step)[:, None]
            # A finished row's pad token is written masked: the cache then holds exactly the
            # prompt and the sample (what a later turn's prefill reuses).
            step_rope = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, step, 1, 1), rope)
            kw = dict(
                attention_mask=~done[:, None], rope_cos_sin=step_rope, return_routes=record_routes
            )
            if prefix is None:
                out = model.decode(tok[:, None], pos, cache, **kw)
            else:
                out = model.decode_shared_prefix(tok[:, None], pos, prefix, cache, group, **kw)
            logits, cache = out[:2]
            if record_routes:  # the experts the token just sampled went to, fed back
                routes = jax.lax.dynamic_update_index_in_dim(routes, out[2][:, 0], step, axis=1)
            done = done | hit | (step + 1 >= max_new)
            return step + 1, logits[:, 0, :], cache, done, toks, lps, lengths, stopped, routes

        carry = (
            jnp.zeros((), jnp.int32),
            logits,
            cache,
            ~live,
            jnp.full((b, n), pad_id, jnp.int32),
            jnp.zeros((b, n), jnp.float32),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), bool),
            None,
        )
        if record_routes:
            c = model.config
            carry = carry[:-1] + (
                jnp.zeros((b, n, c.num_layers, c.num_experts_per_tok), jnp.int32),
            )
        for i, end in enumerate(ends):
            if i:  # the next segment attends over more slots: grow the cache (one copy)
                carry = (*carry[:2], carry[2].pad_slots(end - ends[i - 1]), *carry[3:])
            carry = jax.lax.while_loop(functools.partial(cond, end), body, carry)
        _, _, cache, _, toks, lps, lengths, stopped, routes = carry
        kept = None
        if keep_cache:
            if prefix is not None:  # each row's prompt then its own slots, as without groups
                rows = jnp.arange(cache.mask.shape[0]) // group
                cache = _concat_slots(prefix.take_rows(rows), cache)
            kept = _compact(cache)._replace(index=cache.index[None])
        return toks, lps, lengths, stopped, kept, routes

    args = (
        state,
        prefix,
        logits,
        cache,
        live,
        prompt_len,
        row_seeds,
        row_ids,
        temperature,
        top_p,
        top_k,
        stop_ids,
        max_new,
    )
    if mesh is None:
        toks, lps, lengths, stopped, kept, routes = decode_loop(*args)
    else:
        rows, whole = P(data_axis), P()
        cache_spec = _cache_spec(cache, data_axis)
        in_specs = (
            jax.tree.map(lambda _: whole, state),
            None if prefix is None else _cache_spec(prefix, data_axis),
            rows,
            cache_spec,
            rows,
            rows,
            rows,
            rows,
            whole,
            whole,
            whole,
            whole,
            whole,
        )
        kept_spec = cache_spec._replace(index=rows) if keep_cache else None
        toks, lps, lengths, stopped, kept, routes = jax.shard_map(
            decode_loop,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(rows, rows, rows, rows, kept_spec, rows if record_routes else None),
            check_vma=False,
        )(*args)
    if kept is not None:  # the slot index reached by the last shard to finish (one loop: its own)
        kept = kept._replace(index=jnp.max(kept.index))
    return toks, lps, lengths, stopped, kept, (None if routes is None else (prompt_routes, routes))


def _concat_slots(first, second):
    """One cache of the same rows: ``first``'s slots, then ``second``'s (index: the sum)."""

    def cat(a, b, axis):
        return jnp.concatenate([a, b], axis=a.ndim + axis)

    return Cache(
        k=jax.tree.map(lambda a, b: cat(a, b, Cache.K_SLOT_AXIS), first.k, second.k),
        v=jax.tree.map(lambda a, b: cat(a, b, Cache.V_SLOT_AXIS), first.v, second.v),
        mask=jnp.concatenate([first.mask, second.mask], axis=1),
        index=first.mask.shape[1] + second.index,
    )


def _cache_spec(cache, data_axis: str):
    """`PartitionSpec`s of a `Cache` with its rows split over ``data_axis``."""

    def rows(x):
        return P(*([None] * (x.ndim + Cache.BATCH_AXIS)), data_axis)

    return Cache(
        k=jax.tree.map(rows, cache.k),
        v=jax.tree.map(rows, cache.v),
        mask=P(data_axis),
        index=P(),
    )


class Sampler:
    """Embedded `RolloutEngine` over a `gagar_jax.models.Transformer` (flax NNX).

    Args:
      model: the policy (its parameters are copied out; `sync_weights` replaces them).
      pad_id: token id used for padding (never attended to, never reported).
      batch_buckets, prompt_buckets, new_token_buckets: the static shape buckets.
      seed: base seed for calls whose SamplingParams.seed is None.
      policy_version: version of the initial weights.
      decode_segments: the decode loop runs as up to this many loops in sequence (at least 16
        new tokens each), each over a KV cache of the slots filled by its end (grown by one
        copy between them), so a step reads only up to its segment's end instead of the whole
        budget: at 64 new tokens after a 32-token prompt, 72 slots on average instead of 96.
        Each segment is another copy of the decode step in the compiled program (compile time
        grows with it); 1 turns it off. Results are the same either way (up to float rounding
        of the softmax sums).
      shared_prefix: a call's samples of one prompt decode against that prompt's one KV cache
        (True, the default) instead of each against its own copy of it: every decode step
        reads a prompt's keys and values once for all its samples, and the samples' cache holds
        only their new tokens. It applies to calls with ``n > 1``: the decode runs
        ``ceil(bucket / n)`` groups of ``n`` rows (rounded up to a multiple of the data axis),
        and the prefill of distinct prompts takes that many rows; a call that repeats a prompt
        prefills it once and gives each repeat a copy of its cache row (once per call, not per
        sample). The compiled program is keyed by ``n`` as well as by the buckets. Results
        are the same either way up to float rounding of the softmax sums.
      prefix_cache: how many previous calls' KV caches to keep (0: none). A prompt that extends
        a kept sequence (a previous prompt + its sample, e.g. the next turn of an episode:
        history + observation) prefills only the new tokens; the rest of its cache is copied
        from the kept one. A call uses it when every distinct prompt of the call extends a row
        of one kept call; otherwise it prefills in full. Kept caches cost device memory (a key
        and a value buffer per layer, the call's rows x slots) and are dropped by `sync_weights`.
      mesh, data_axis: None (one device), or a `jax.sharding.Mesh` of this process's devices
        whose ``data_axis`` (the only axis of size > 1) splits every call's rows: the weights
        are replicated on each device and each device runs its own decode loop over its rows
        (stopping when they are done; no collective per step). Batch buckets must be multiples
        of the axis size (the default ones are rounded up). Samples equal the one-device
        sampler's up to float rounding.
      precision: the sampler's weights and compute (``gagar_jax.rollout.precision``):
        ``"float32"`` (the model's own), ``"bfloat16"``, ``"int8"`` or ``"fp8"`` (weight-only,
        bfloat16 compute). The model's parameters are converted here and at every
        ``sync_weights`` (once per sync); ``config`` is then the sampler's (bfloat16) model
        config, ``model_config`` the trainer's.
      kv_cache_dtype: ``"auto"`` (the compute dtype), ``"float32"``, ``"bfloat16"`` or
        ``"int8"`` (quantised on writing, one scale per token and KV head; dequantised on
        reading: ``gagar_jax.models.kv_quant``).
      record_routes: a mixture-of-experts model records each token's experts per MoE layer
        (``Sample.routes`` and ``Sample.prompt_routes``: routing replay); ignored for a dense
        model. Its programs are compiled apart from the ones that do not record.
    """

    def __init__(
        self,
        model,
        *,
        pad_id: int = 0,
        batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
        new_token_buckets: Sequence[int] = DEFAULT_NEW_BUCKETS,
        seed: int = 0,
        policy_version: int = 0,
        prefix_cache: int = 0,
        decode_segments: int = 4,
        shared_prefix: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        precision: str = "float32",
        kv_cache_dtype: str = "auto",
        record_routes: bool = False,
    ):
        check_precision(precision, kv_cache_dtype)
        self.record_routes = bool(record_routes) and model.config.num_experts > 0
        self.precision = precision
        self.kv_cache_dtype = None if kv_cache_dtype == "auto" else kv_cache_dtype
        self.model_config = model.config
        if precision != "float32":
            model = _converted_model(model, precision)
        if not isinstance(shared_prefix, bool):
            raise ValueError(f"Sampler.shared_prefix must be a bool, got {shared_prefix!r}")
        self.shared_prefix = shared_prefix
        if mesh is not None:
            mesh, batch_buckets = _check_mesh(mesh, data_axis, batch_buckets)
        for name, b in (
            ("batch_buckets", batch_buckets),
            ("prompt_buckets", prompt_buckets),
            ("new_token_buckets", new_token_buckets),
        ):
            if not b or list(b) != sorted(set(b)) or b[0] < 1:
                raise ValueError(
                    f"Sampler.{name} must be strictly increasing positive ints, got {b}"
                )
        self.config = model.config
        self.graphdef, self.state = nnx.split(model)
        self.pad_id = int(pad_id)
        self.batch_buckets = tuple(batch_buckets)
        self.prefill_buckets = prefill_buckets(
            self.batch_buckets, 1 if mesh is None else mesh.shape[data_axis]
        )
        self.prompt_buckets = tuple(prompt_buckets)
        self.new_token_buckets = tuple(new_token_buckets)
        self.policy_version = int(policy_version)
        self._seed_counter = int(seed) * 1_000_003
        self._lock = threading.Lock()
        self.trace_count = 0  # programs this sampler's calls traced (compiled)
        if int(prefix_cache) < 0:
            raise ValueError(f"Sampler.prefix_cache must be >= 0, got {prefix_cache}")
        self.prefix_cache = int(prefix_cache)
        if (
            not isinstance(decode_segments, int)
            or isinstance(decode_segments, bool)
            or (decode_segments < 1)
        ):
            raise ValueError(
                f"Sampler.decode_segments must be an int >= 1, got {decode_segments!r}"
            )
        self.decode_segments = int(decode_segments)
        self.mesh, self.data_axis = mesh, data_axis
        if mesh is not None:  # the weights whole on every device of the mesh
            self.state = jax.device_put(self.state, NamedSharding(mesh, P()))
        else:
            # Committed to the model's device, like the leaves `sync_weights` places: a program
            # compiled for uncommitted weights would otherwise compile again after the first sync.
            leaf = jax.tree.leaves(self.state)[0]
            device = next(iter(leaf.devices())) if hasattr(leaf, "devices") else None
            self.state = jax.device_put(self.state, device or jax.local_devices()[0])
        pure = nnx.to_pure_dict(self.state)
        self._param_paths = _pure_paths(pure)
        # What `sync_weights` needs to swap a pure dict's leaves in directly: the state's tree and
        # leaf shardings, and whether the pure dict lists the same leaves in the same order.
        state_leaves, self._state_def = jax.tree.flatten(self.state)
        pure_leaves, self._pure_def = jax.tree.flatten(pure)
        self._leaf_shardings = [x.sharding for x in state_leaves]
        self._leaf_types = [(x.shape, x.dtype) for x in state_leaves]
        self._pure_in_state_order = len(pure_leaves) == len(state_leaves) and all(
            a is b for a, b in zip(pure_leaves, state_leaves)
        )
        self._kept: list[dict] = []  # most recent first: {"cache", "rows", "lengths"}
        # prompt tokens prefilled / taken from a kept cache, over the sampler's life
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "calls_reusing_cache": 0}

    # ------------------------------------------------------------------ host side

    def _place(self, arrays, *, split_rows: bool):
        """The program's inputs on the sampler's devices: with a mesh, per-row arrays ([Bp] or
        [B] leading) split over its data axis, call-wide ones (knobs, stop ids) whole on each."""
        if self.mesh is None:
            return [jnp.asarray(x) for x in arrays]
        spec = P(self.data_axis) if split_rows else P()
        return jax.device_put(list(arrays), NamedSharding(self.mesh, spec))

    def _next_seed(self) -> int:
        with self._lock:
            self._seed_counter += 1
            return self._seed_counter

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        """`params.n` samples per prompt (outer list: prompts, inner: samples).

        `prompt_seeds[i]` (optional, one per prompt, in [0, 2**32)) seeds prompt i's samples on
        their own: they are then the same whatever else is in the batch and wherever prompt i
        sits in it (what a multi-host loop needs: the rollouts of a prompt do not depend on how
        prompts are split over hosts). Otherwise `params.seed` seeds the whole call.
        """
        prompts = validate_prompts(prompts, self.config.vocab_size)
        if prompt_seeds is not None:
            prompt_seeds = [int(x) for x in prompt_seeds]
            if len(prompt_seeds) != len(prompts) or not all(0 <= x < 2**32 for x in prompt_seeds):
                raise ValueError(
                    f"prompt_seeds must be {len(prompts)} ints in [0, 2**32) (one per prompt), "
                    f"got {prompt_seeds!r:.200}"
                )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if len(params.stop_token_ids) > MAX_STOP_TOKENS:
            raise ValueError(
                f"SamplingParams.stop_token_ids: at most {MAX_STOP_TOKENS} ids, "
                f"got {len(params.stop_token_ids)}"
            )
        bad = [t for t in params.stop_token_ids if t >= self.config.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids outside the vocabulary: {bad}")
        uniq: dict[tuple, int] = {}
        for ids in prompts:
            uniq.setdefault(tuple(ids), len(uniq))
        distinct = [list(k) for k in uniq]
        n_rows = len(prompts) * params.n
        b = _bucket(n_rows, self.batch_buckets, "prompts x n")
        bp = _bucket(len(distinct), self.prefill_buckets, "distinct prompts")
        n = _bucket(params.max_tokens, self.new_token_buckets, "max_tokens")
        # A prompt's samples on one prefix row: rows r = i * n + j of prompt i (filler rows on
        # filler prompt rows), so the decode reads each prompt's cache once for its samples.
        # The prompt rows are the bucket's rows in whole groups (a multiple of the data axis):
        # with n not dividing the bucket, the decode runs a few more filler rows than it holds.
        # A call that repeats a prompt prefills it once and gives each repeat its own copy of
        # that cache row, once per call (prefix_src).
        group, rows, prefix_src = 0, b, None
        if self.shared_prefix and params.n > 1:
            axis = 1 if self.mesh is None else self.mesh.shape[self.data_axis]
            groups = -(-b // params.n)  # ceil
            groups = -(-groups // axis) * axis
            group, rows = params.n, groups * params.n
            if len(distinct) == len(prompts):
                bp = groups
            else:
                prefix_src = np.zeros((groups,), np.int32)
                prefix_src[: len(prompts)] = [uniq[tuple(ids)] for ids in prompts]
        match = self._match(distinct)
        if match is not None:
            entry, hist_rows, counts = match
            suffixes = [ids[c:] for ids, c in zip(distinct, counts)]
            h = min(
                _bucket(max(counts), self.prompt_buckets, "history"), entry["cache"].mask.shape[1]
            )
        else:
            suffixes, counts, hist_rows, h = distinct, [0] * len(distinct), [0] * len(distinct), 0
        p = _bucket(max(len(r) for r in suffixes), self.prompt_buckets, "prompt length")

        tokens = np.full((bp, p), self.pad_id, np.int32)
        mask = np.zeros((bp, p), bool)
        for r, ids in enumerate(suffixes):
            tokens[r, p - len(ids) :] = ids
            mask[r, p - len(ids) :] = True
        mask[len(suffixes) :, -1] = True  # filler rows: one visible pad token
        hist_src = np.zeros((bp,), np.int32)
        hist_src[: len(hist_rows)] = hist_rows
        hist_len = np.zeros((bp,), np.int32)
        hist_len[: len(counts)] = counts
        if group:  # row r is a sample of group r // n, whose prompt is its prefill row
            occurrence = np.arange(rows // group) if prefix_src is None else prefix_src
            row_src = occurrence[np.arange(rows) // group].astype(np.int32)
        else:
            row_src = np.zeros((rows,), np.int32)
            row_src[:n_rows] = np.repeat([uniq[tuple(ids)] for ids in prompts], params.n)
        live = np.zeros((rows,), bool)
        live[:n_rows] = True  # filler rows start done
        stop = np.full((MAX_STOP_TOKENS,), -1, np.int32)
        stop[: len(params.stop_token_ids)] = params.stop_token_ids
        seed = params.seed if params.seed is not None else self._next_seed()
        if prompt_seeds is None:
            row_seeds = np.full((rows,), seed, np.uint32)
            row_ids = np.arange(rows, dtype=np.int32)
        else:  # row r = i * n + j: prompt i's seed, sample index j; filler rows keep their index
            row_seeds = np.zeros((rows,), np.uint32)
            row_seeds[:n_rows] = np.repeat(np.asarray(prompt_seeds, np.uint32), params.n)
            row_ids = np.arange(rows, dtype=np.int32)
            row_ids[:n_rows] = np.tile(np.arange(params.n, dtype=np.int32), len(prompts))

        with self._lock:  # serialises dispatch so the trace count is attributed to this call
            before = _TRACES[0]
            per_row = self._place(
                (hist_src, hist_len, tokens, mask, row_src, row_ids, live, row_seeds),
                split_rows=True,
            )
            knobs = self._place(
                (
                    np.float32(params.temperature),
                    np.float32(params.top_p),
                    np.int32(params.top_k),
                    stop,
                    np.int32(params.max_tokens),
                ),
                split_rows=False,
            )
            if prefix_src is not None:
                (prefix_src,) = self._place((prefix_src,), split_rows=True)
            toks, lps, lengths, stopped, kept, routes = _generate_program(
                self.state,
                None if match is None else entry["cache"],
                *per_row,
                *knobs,
                prefix_src,
                graphdef=self.graphdef,
                pad_id=self.pad_id,
                max_new_bucket=n,
                hist_slots=h,
                keep_cache=self.prefix_cache > 0,
                decode_segments=self.decode_segments,
                group=group,
                mesh=self.mesh,
                data_axis=self.data_axis,
                kv_cache_dtype=self.kv_cache_dtype,
                record_routes=self.record_routes,
            )
            self.trace_count += _TRACES[0] - before
            self.stats["prefill_tokens"] += sum(len(x) for x in suffixes)
            self.stats["reused_tokens"] += sum(counts)
            self.stats["calls_reusing_cache"] += match is not None
        toks, lps, lengths, stopped, routes = jax.device_get((toks, lps, lengths, stopped, routes))
        if self.prefix_cache:
            rows = {}
            for r in range(n_rows):
                seq = tuple(prompts[r // params.n]) + tuple(int(t) for t in toks[r, : lengths[r]])
                rows.setdefault(seq, r)
            self._kept.insert(
                0,
                {
                    "cache": kept,
                    "rows": rows,
                    "lengths": sorted({len(k) for k in rows}, reverse=True),
                },
            )
            del self._kept[self.prefix_cache :]

        out: list[list[Sample]] = []
        for i in range(len(prompts)):
            row_samples = []
            for j in range(params.n):
                r = i * params.n + j
                k = int(lengths[r])
                if routes is not None:
                    pr = uniq[tuple(prompts[i])]
                    extra = dict(
                        routes=routes[1][r, :k].astype(np.int16),
                        prompt_routes=routes[0][pr, p - len(suffixes[pr]) :].astype(np.int16),
                    )
                else:
                    extra = {}
                row_samples.append(
                    Sample(
                        tokens=[int(t) for t in toks[r, :k]],
                        logprobs=[float(x) for x in lps[r, :k]],
                        finish_reason="stop" if stopped[r] else "length",
                        policy_version=self.policy_version,
                        meta={
                            "bucket": (b, p, n),
                            "prefill_rows": bp,
                            "seed": int(seed if prompt_seeds is None else prompt_seeds[i]),
                            "cached_prefix": int(counts[uniq[tuple(prompts[i])]]),
                        },
                        **extra,
                    )
                )
            out.append(row_samples)
        return out

    def _match(self, distinct: list[list[int]]):
        """(kept entry, its row per prompt, reused length per prompt) or None.

        A prompt matches the longest kept sequence that is a strict prefix of it (at least one
        new token is left to prefill: its logits start the sample)."""
        for entry in self._kept:
            rows, counts = [], []
            for ids in distinct:
                hit = next(
                    (
                        (entry["rows"][key], n)
                        for n in entry["lengths"]
                        if n < len(ids) and (key := tuple(ids[:n])) in entry["rows"]
                    ),
                    None,
                )
                if hit is None:
                    break
                rows.append(hit[0])
                counts.append(hit[1])
            else:
                if max(counts) <= self.prompt_buckets[-1]:
                    return entry, rows, counts
        return None

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        """`generate` in a worker thread: the event loop stays free while the device works."""
        return await asyncio.to_thread(
            functools.partial(self.generate, prompt_seeds=prompt_seeds), prompts, params
        )

    def _to_precision(self, new: Any) -> Mapping:
        """Weights in any form ``sync_weights`` takes (the trainer's precision) -> a pure dict
        in the sampler's layer layout and precision."""
        if isinstance(new, (str, os.PathLike)):
            _, new = load_hf_safetensors(os.fspath(new))
        if isinstance(new, nnx.Module):
            new = nnx.state(new, nnx.Param)
        if isinstance(new, nnx.State):
            new = nnx.to_pure_dict(new)
        if not isinstance(new, Mapping):
            raise TypeError(
                "sync_weights takes a params dict, nnx.State, Transformer or safetensors "
                f"directory, got {type(new).__name__}"
            )
        try:
            new = self._own_layout(new)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"sync_weights: params do not fit the sampler's model: {e}") from e
        return convert_params(new, self.precision)

    def _state_from_params(self, params: Mapping) -> nnx.State:
        """The sampler's state with ``params`` (a pure dict, either layer layout) as its leaves:
        no model is built and nothing is initialised (the tree is the sampler's own)."""

        try:
            params = self._own_layout(params)
            paths = _pure_paths(params)
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"sync_weights: params do not fit the sampler's model: {e}") from e
        if paths != self._param_paths:
            missing = sorted(self._param_paths - paths)[:3]
            extra = sorted(paths - self._param_paths)[:3]
            raise ValueError(
                "sync_weights: params do not fit the sampler's model: "
                f"missing {missing}, unexpected {extra}"
            )
        state = jax.tree.map(lambda x: x, self.state)  # a new tree: the old one stays intact
        nnx.replace_by_pure_dict(state, params)
        return state

    def _own_layout(self, params: Mapping) -> Mapping:
        """A pure parameter dict in the sampler's layer layout (stacked or per layer)."""
        if self.config.scan_layers:
            return stack_layer_params(params)
        return unstack_layer_params(params)

    def _leaves_in_state_order(self, params: Mapping) -> list | None:
        """The leaves of the pure dict ``params`` (after the sampler's layer layout is applied)
        in the order of the state's leaves, or None when its tree is not the sampler's own
        pure-dict tree (the general path then matches it by path, with its errors)."""
        if not self._pure_in_state_order:
            return None
        try:
            params = self._own_layout(params)
        except (KeyError, ValueError, TypeError, AttributeError):
            return None
        leaves, treedef = jax.tree.flatten(params)
        return leaves if treedef == self._pure_def else None

    def _check_leaves(self, leaves: list) -> None:
        for (shape, dtype), b_ in zip(self._leaf_types, leaves):
            if shape != b_.shape or dtype != b_.dtype:
                raise ValueError(
                    f"sync_weights: leaf shape/dtype {b_.shape}/{b_.dtype} does not "
                    f"match {shape}/{dtype}"
                )

    def sync_weights(self, params_or_path: Any, version: int) -> int:
        """Replaces the weights; returns `version` (stamped on every later Sample).

        Accepts a pure parameter dict (`TrainState.params`), an `nnx.State`, a Transformer, or a
        directory of HF safetensors (`gagar_jax.models.load_hf_safetensors`). Shapes and dtypes
        must match; leaves are placed like the current ones, so compiled programs are reused.
        A low-precision sampler converts the (trainer's) weights first, once per sync.
        """

        new = params_or_path
        if self.precision != "float32":
            new = self._to_precision(new)
        if isinstance(new, Mapping) and not isinstance(new, nnx.State):
            leaves = self._leaves_in_state_order(new)
            if leaves is not None:  # the same tree: its leaves replace the state's in place
                self._check_leaves(leaves)
                moved = [
                    i
                    for i, (x, sh) in enumerate(zip(leaves, self._leaf_shardings))
                    if getattr(x, "sharding", None) != sh
                ]
                if moved:  # one transfer call for the leaves not yet in place
                    put = jax.device_put(
                        [leaves[i] for i in moved], [self._leaf_shardings[i] for i in moved]
                    )
                    for i, x in zip(moved, put):
                        leaves[i] = x
                self.state = jax.tree.unflatten(self._state_def, leaves)
                self._kept.clear()
                self.policy_version = int(version)
                return self.policy_version
        if isinstance(new, (str, os.PathLike)):
            _, new = load_hf_safetensors(os.fspath(new))
        if isinstance(new, nnx.Module):
            new = nnx.split(new)[1]
        elif not isinstance(new, nnx.State):
            if not isinstance(new, Mapping):
                raise TypeError(
                    "sync_weights takes a params dict, nnx.State, Transformer or safetensors "
                    f"directory, got {type(new).__name__}"
                )
            new = self._state_from_params(new)
        old_struct = jax.tree.structure(self.state)
        new_struct = jax.tree.structure(new)
        if old_struct != new_struct:
            raise ValueError(
                f"sync_weights: parameter tree differs from the sampler's model: "
                f"{new_struct} vs {old_struct}"
            )
        self._check_leaves(jax.tree.leaves(new))
        # One transfer call for the whole tree (a no-op for leaves already in place).
        self.state = jax.device_put(new, jax.tree.map(lambda old: old.sharding, self.state))
        self._kept.clear()  # caches of the old weights
        self.policy_version = int(version)
        return self.policy_version


def _converted_model(model, precision: str):
    """``model`` rebuilt in ``precision`` (its config's bfloat16 form, the parameters
    converted by ``gagar_jax.rollout.precision.convert_params``)."""
    config = rollout_model_config(model.config, precision)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(
        state, convert_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)), precision)
    )
    return nnx.merge(graphdef, state)


def _pure_paths(tree) -> frozenset:
    return frozenset(jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward_logprobs(graphdef, state, tokens, positions, mask, temperature):
    model = nnx.merge(graphdef, state)
    logits = model(tokens, positions, attention_mask=mask)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]


def score_tokens(model, tokens: Sequence[int], prompt_len: int, temperature: float = 1.0):
    """Training-forward log-probabilities of `tokens[prompt_len:]` given their prefix (one row).

    The reference the sampler's behaviour log-probabilities must equal. The row is right-padded
    to a multiple of 64 (masked; causal attention makes the padding invisible to earlier slots),
    so scoring sequences of similar length reuses one compiled forward.
    """
    if not 1 <= prompt_len <= len(tokens):
        raise ValueError(f"prompt_len must be in [1, {len(tokens)}], got {prompt_len}")
    graphdef, state = nnx.split(model)
    length = -(-len(tokens) // 64) * 64
    ids = np.zeros((1, length), np.int32)
    ids[0, : len(tokens)] = tokens
    mask = np.arange(length)[None] < len(tokens)
    pos = np.arange(length, dtype=np.int32)[None]
    t = 1.0 if temperature <= 0 else float(temperature)
    lp = _forward_logprobs(graphdef, state, ids, pos, mask, t)
    return np.asarray(lp[0, prompt_len - 1 : len(tokens) - 1])
