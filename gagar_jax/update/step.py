"""The jitted, sharded policy update: advantage kernels -> PPO-clip loss -> AdamW steps.

``update(state, batch) -> (state, metrics)`` is one compiled program:

1. ``gagar_advantages`` turns the raw graded rollout results ``[G, K]`` into one advantage per
   sequence ``[N = G * K]`` (group-major: sequence ``n = g * K + k``);
2. sequences are split into ``ppo_epochs * num_minibatches`` optimizer steps (``lax.scan``),
   each accumulating gradients over ``num_microbatches`` micro-batches (an inner ``lax.scan``);
   the split is *strided* (mini-batch ``m`` holds sequences ``m, m + M, ...``) so every device
   keeps a share of every mini-batch when the sequence axis is sharded;
3. per micro-batch: forward, per-token log-probs/entropy of ``softmax(logits / temperature)``
   (the sampling temperature is part of the policy: ``UpdateConfig.temperature``, set from
   ``rollout.temperature``), and the clipped loss, with the
   sequence advantage ``[b]`` broadcast over tokens inside the fused loss expression (no
   ``[N, T]`` advantage array); normalisers are the mini-batch's token and sequence counts, so
   the accumulated loss is the mini-batch token mean (see ``gagar_jax.losses``). With
   ``config.token_credit`` set to an importance provider, the broadcast is replaced by
   ``redistribute_tokens`` on the micro-batch (``[b, T]``, still inside the loss), which
   conserves every sequence's credit, and ``token_credit/*`` metrics report the conservation
   error before and after the clip, the token-credit Gini and the positive credit on evidence
   tokens. With several rows per rollout (``UpdateBatch.row_episode``: a harness episode's
   linked segments, which the strided split may put in different micro-batches) the token
   advantages are computed once for the whole batch before the first optimizer step by
   ``redistribute_segment_tokens`` (statistics over each episode's tokens in all its rows, the
   entropy importance from a forward at the pre-update parameters), so an episode's credit is
   conserved over its rows and each token gets the weight it would get were the episode one
   row; ``token_credit/conservation_error`` is then per episode;
4. optax AdamW (global-norm clipped) once per mini-batch.

Train/rollout mismatch (``docs/concepts/mismatch.md``): ``learner.rollout_correction`` masks
and weights tokens on the trainer/behaviour ratio (``gagar_jax.losses.rollout_correction``),
``learner.mismatch_metrics`` reports ``mismatch/*`` from the proximal pass
(``update/mismatch.py``), and ``learner.routing_replay`` routes a mixture of experts' tokens to
the experts the rollout engine recorded (``UpdateBatch.routes``).

Token alignment: ``response_mask[n, t]`` marks token ``t`` as a model-generated token to train
on, and ``old_logprobs[n, t]`` is its behaviour log-probability; it is predicted by the logits
at ``t - 1``, so the first column of ``response_mask`` must be False.

Sharding: sequence axes over ``('data', 'fsdp')``, group arrays ``[G, K]`` replicated (they
are tiny), parameters and Adam moments by their logical axes. The mini-batch split needs
``N / (num_minibatches * num_microbatches)`` divisible by ``data * fsdp``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gagar_jax.advantages import (
    ImportanceInputs,
    gagar_advantages,
    importance_provider,
    token_credit,
)
from gagar_jax.advantages.contrast import (
    contrastive_tokens_unchecked,
    distinguishing_tokens_unchecked,
)
from gagar_jax.advantages.segments import redistribute_segment_tokens
from gagar_jax.advantages.tokens import redistribute_tokens_unchecked
from gagar_jax.losses import (
    PolicyLossTerms,
    delivered_credit,
    policy_loss,
)
from gagar_jax.models import BATCH_AXES, TransformerConfig
from gagar_jax.models import lora as lora_lib
from gagar_jax.update.mismatch import proximal_mismatch_metrics, route_mismatch_metrics
from gagar_jax.update.state import (
    TrainState,
    UpdateConfig,
    abstract_model,
    learning_rate_schedule,
    make_optimizer,
    state_shardings,
)

log = logging.getLogger(__name__)


class UpdateBatch(NamedTuple):
    """One update's worth of graded rollouts (``N = G * K`` sequences of ``T`` tokens)."""

    tokens: jax.Array  # [N, T] int32 prompt + response tokens
    positions: jax.Array  # [N, T] int32 RoPE positions
    attention_mask: jax.Array  # [N, T] bool, False on padding
    response_mask: jax.Array  # [N, T] bool, True on model tokens to train on
    old_logprobs: jax.Array  # [N, T] float32 behaviour log-probs of each token
    rewards: jax.Array  # [G, K] float32
    passed: jax.Array  # [G, K] bool
    cheat: jax.Array  # [G, K] bool
    tier: jax.Array  # [G, K] int32
    rank: jax.Array  # [G, K] int32
    valid: jax.Array  # [G, K] bool
    graded: jax.Array  # [G] bool
    ref_logprobs: jax.Array | None = None  # [N, T] float32 reference log-probs (KL term)
    evidence: jax.Array | None = None  # [N, T] bool, tokens a verdict cites (token credit)
    # [N, T, L, K] int, the experts the rollout engine routed each token to in each MoE layer
    # (routing replay, learner.routing_replay; the route-mismatch metrics)
    routes: jax.Array | None = None
    # [N] int32: the rollout (``g * K + k``) each row belongs to, when an episode spans several
    # rows (a harness episode's linked segments, ``gagar_jax.rl.harness_rollouts``): every row
    # of a rollout takes its advantage and validity; N is then any multiple of the chunks, and
    # the shared-prefix forward is off. None: row n is rollout n (N = G * K).
    row_episode: jax.Array | None = None


_TOKEN_FIELDS = (
    "tokens",
    "positions",
    "attention_mask",
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "evidence",
    "routes",
)


def batch_shardings(
    mesh: Mesh,
    with_ref: bool = False,
    with_evidence: bool = False,
    with_routes: bool = False,
    with_row_episode: bool = False,
) -> UpdateBatch:
    """The shardings of an :class:`UpdateBatch` on ``mesh``, field by field.

    Token fields (``[N, T]``: tokens, positions, masks, log-probs, evidence; ``[N, T, L, K]``
    routes) split their rows over the batch axes; the group fields (``[G, K]``) are
    replicated. ``ref_logprobs``, ``evidence`` and ``routes`` are ``None`` unless
    ``with_ref`` / ``with_evidence`` / ``with_routes`` ask for them.
    """
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    rep = NamedSharding(mesh, PartitionSpec())
    fields = {f: (rows if f in _TOKEN_FIELDS else rep) for f in UpdateBatch._fields}
    if not with_ref:
        fields["ref_logprobs"] = None
    if not with_evidence:
        fields["evidence"] = None
    if not with_routes:
        fields["routes"] = None
    if not with_row_episode:
        fields["row_episode"] = None
    return UpdateBatch(**fields)


def check_batch(batch: UpdateBatch, config: UpdateConfig, mesh: Mesh | None = None) -> None:
    """Host-side validation with messages naming the field and the expected shape."""
    n, t = np.shape(batch.tokens)
    g, k = np.shape(batch.rewards)
    if batch.row_episode is not None:
        ids = np.asarray(batch.row_episode)
        if ids.shape != (n,) or (ids.size and (ids.min() < 0 or ids.max() >= g * k)):
            raise ValueError(
                f"batch.row_episode must be [N={n}] ints in [0, G * K = {g * k}), got shape "
                f"{ids.shape}"
            )
    elif n != g * k:
        raise ValueError(
            f"batch.tokens has {n} rows but rewards is [G={g}, K={k}]: "
            f"need N = G * K = {g * k} (group-major rows)"
        )
    for f in _TOKEN_FIELDS:
        x = getattr(batch, f)
        if f == "routes":
            if x is not None and (np.ndim(x) != 4 or np.shape(x)[:2] != (n, t)):
                raise ValueError(f"batch.routes must be [N={n}, T={t}, L, K], got {np.shape(x)}")
        elif x is not None and np.shape(x) != (n, t):
            raise ValueError(f"batch.{f} must be [N={n}, T={t}], got {np.shape(x)}")
    for f in ("passed", "cheat", "tier", "rank", "valid"):
        if np.shape(getattr(batch, f)) != (g, k):
            raise ValueError(f"batch.{f} must be [G={g}, K={k}], got {np.shape(getattr(batch, f))}")
    if np.shape(batch.graded) != (g,):
        raise ValueError(f"batch.graded must be [G={g}], got {np.shape(batch.graded)}")
    if config.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("batch.ref_logprobs [N, T] is required when update.kl_coef > 0")
    if config.token_credit == "evidence" and batch.evidence is None:
        raise ValueError("batch.evidence [N, T] is required when update.token_credit='evidence'")
    if config.token_credit == "distinguishing" and batch.row_episode is not None:
        raise ValueError(
            "update.token_credit='distinguishing' compares the rollouts of a group row by row: "
            "it needs one row per rollout (batch.row_episode None)"
        )
    chunks = config.num_minibatches * config.num_microbatches
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if all(_on_host(getattr(batch, f)) for f in _ROW_FIELDS):
        # (Arrays spread over several processes: each checks its own rows before it builds
        # them, ``check_batch_rows``.)
        check_batch_rows(batch, config if batch.row_episode is None else _unshared(config), k)
    if n % (chunks * shards):
        raise ValueError(
            f"batch of N={n} sequences must divide into num_minibatches * num_microbatches = "
            f"{chunks} chunks times data*fsdp = {shards} shards"
        )


def _unshared(config: UpdateConfig) -> UpdateConfig:
    return dataclasses.replace(config, shared_prefix=False)


def _shares_prefix(config: UpdateConfig, seq_len: int, groups: int, mesh: Mesh | None) -> bool:
    """Whether the update runs the shared-prefix forward (static): ``config.shared_prefix``
    with a score window, and the ``groups`` dividing into the mini- and micro-batches times the
    batch shards (a group's samples stay in one micro-batch on one device); otherwise the
    per-sample forward, with the same result."""
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    chunks = config.num_minibatches * config.num_microbatches
    return config.shared_prefix and _windowed(config, seq_len) and groups % (chunks * shards) == 0


_ROW_FIELDS = ("tokens", "positions", "attention_mask", "response_mask")


def _on_host(x) -> bool:
    """Whether this process can read all of ``x`` (NumPy, or a fully addressable array)."""
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def check_batch_rows(batch: UpdateBatch, config: UpdateConfig, group_size: int) -> None:
    """The checks of a batch's token rows (whole groups of ``group_size`` rows, group-major;
    one process's rows of a multi-process batch): every response fits ``score_window``, and
    with ``shared_prefix`` (and a window) every sample of a group has its group's prompt. The
    prompts are checked even where the update falls back to the per-sample forward, so a
    batch is refused or accepted alike on every mesh and in every process."""
    n, t = np.shape(batch.tokens)
    if _windowed(config, t):
        scored = np.asarray(batch.response_mask, bool)[:, 1:]
        rows = np.flatnonzero(scored.any(axis=1))
        if rows.size:
            first = scored[rows].argmax(axis=1)
            last = scored.shape[1] - 1 - scored[rows, ::-1].argmax(axis=1)
            span = last - first + 1
            worst = int(np.argmax(span))
            if span[worst] > config.score_window:
                raise ValueError(
                    f"batch.response_mask row {int(rows[worst])} has response tokens over "
                    f"{int(span[worst])} positions ({int(first[worst]) + 1}.."
                    f"{int(last[worst]) + 1}), more than update.score_window="
                    f"{config.score_window}: raise score_window to at least "
                    f"{int(span.max())} (the widest response), or set it to 0 to score "
                    "every position"
                )
    if config.shared_prefix and _windowed(config, t):
        _check_shared_prompts(batch, config.score_window, n // group_size, group_size)


def _check_shared_prompts(batch: UpdateBatch, window: int, g: int, k: int) -> None:
    """Every row of a group that has response tokens has the same prompt (tokens, positions and
    key mask before its window, :func:`score_window_index`'s start) as the group's first such
    row: what the shared-prefix forward computes once per group."""
    scored = np.asarray(batch.response_mask, bool)[:, 1:]
    has = scored.any(axis=1)
    start = np.minimum(scored.argmax(axis=1), scored.shape[1] - window) + 1
    ref = np.repeat(has.reshape(g, k).argmax(axis=1) + np.arange(g) * k, k)  # per row
    prompt = np.arange(scored.shape[1] + 1)[None, :] < start[ref][:, None]  # [N, T]
    differs = start != start[ref]
    for f in ("tokens", "positions", "attention_mask"):
        x = np.asarray(getattr(batch, f))
        differs |= np.any((x != x[ref]) & prompt, axis=1)
    bad = np.flatnonzero(has & differs)
    if bad.size:
        r = int(bad[0])
        raise ValueError(
            f"update.shared_prefix: batch row {r} (group {r // k}) does not share its "
            f"group's prompt (row {int(ref[r])}, {int(start[ref[r]])} tokens): every sample "
            "of a group needs the same tokens, positions and attention_mask before its first "
            "response token; set shared_prefix False for this data"
        )


def _split(x, minibatches: int, microbatches: int, mesh: Mesh | None):
    """[N, ...] -> [M, A, N / (M A), ...] with the strided assignment of the module docstring."""
    n = x.shape[0]
    per = n // (minibatches * microbatches)
    y = x.reshape((per, minibatches, microbatches) + x.shape[1:])
    y = jnp.moveaxis(y, 0, 2)
    if mesh is not None:
        spec = PartitionSpec(None, None, BATCH_AXES, *([None] * (x.ndim - 1)))
        y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))
    return y


def _rows_sharded(x, mesh: Mesh):
    """``x [b, ...]`` constrained to rows split over the batch axes."""
    spec = PartitionSpec(BATCH_AXES, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _split_groups(x, minibatches: int, microbatches: int, k: int, mesh: Mesh | None):
    """[N = G K, ...] -> [M, A, N / (M A), ...] keeping each group's K rows together (groups
    strided over the chunks as :func:`_split` strides rows): the shared-prefix forward needs
    a group's samples in one micro-batch."""
    g = x.shape[0] // k
    y = _split(x.reshape((g, k) + x.shape[1:]), minibatches, microbatches, mesh)
    return y.reshape(y.shape[:2] + (y.shape[2] * k,) + x.shape[1:])


def _shared_prefix_hidden(model, mb, window: int, k: int):
    """The shared-prefix forward of one micro-batch of whole groups (K rows each, group-major):
    ``(hidden [b, W, E] predicting each row's window tokens, window index [b, W])``.

    Each group's prompt (the tokens before its rows' first response token, taken from a row
    that has a response) runs through the model once, into a cache of ``T - W`` slots; each
    row's window (its ``W`` tokens from the first response token on) then runs against that
    cache (``Transformer.shared_prefix_hidden``: a group's queries in one product against its
    prompt, no copy per row). The window's first token is predicted by the prompt's last
    hidden state, the others by the window's own. Same values as the whole-sequence forward:
    a prompt token attends to the prompt only, a window token to the prompt and the window up
    to itself, with the rows' own positions and key masks."""
    tokens, positions, attn, resp = (
        mb["tokens"],
        mb["positions"],
        mb["attention_mask"].astype(bool),
        mb["response_mask"],
    )
    b, t = tokens.shape
    pm, g = t - window, b // k
    idx = score_window_index(resp, window)  # [b, W]; idx[:, 0] + 1 = first response token
    has = jnp.any(resp[:, 1:], axis=1)
    starts = jnp.where(has, idx[:, 0] + 1, 0).reshape(g, k)
    prompt_len = jnp.max(starts, axis=1)  # [g]; 0 for a group without responses
    src = jnp.argmax(starts, axis=1) + jnp.arange(g) * k  # a row holding the group's prompt
    slots = jnp.arange(pm)[None, :]
    cache = model.init_cache(g, pm)
    h_prompt, cache = model.decode_hidden(
        tokens[src, :pm],
        positions[src, :pm],
        cache,
        attention_mask=attn[src, :pm] & (slots < prompt_len[:, None]),
        fresh=True,
    )
    group = jnp.arange(b) // k

    def take(x):
        return jnp.take_along_axis(x, idx + 1, axis=1)

    h_window = model.shared_prefix_hidden(
        take(tokens), take(positions), cache, k, attention_mask=take(attn)
    )
    last = h_prompt[jnp.arange(g), jnp.maximum(prompt_len - 1, 0)]  # [g, E]
    hidden = jnp.concatenate([last[group][:, None], h_window[:, :-1]], axis=1)
    return hidden, idx


ROUTER_METRICS = (
    "router_aux_loss",
    "router_load_max",
    "router_load_min",
    "router_load_max_pooled",
    "router_entropy",
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_logprobs_entropy(h, w, targets, temperature: float):
    """``token_logprobs_and_entropy(h @ w^T / temperature, targets)``: the LM head and the
    scores of its tokens, h [N, E], w [V, E] (compute dtype), targets [N] -> ([N], [N]) f32.

    The values are those operations' (the sampler's behaviour log-probabilities are the same
    expression). The backward is written out: with ``z`` the scaled logits, ``p = softmax(z)``
    and ``E = sum p z``, ``d z = g_lp (onehot(target) - p) - g_ent p (z - E)``, one elementwise
    pass over ``[N, V]`` (the target's one-hot an index comparison, not a scatter), where
    autodiff left XLA:CPU a stored ``exp``, a product, a scatter-add and a transposed copy of
    the ``[N, V]`` cotangent for the weight gradient. Here the weight gradient is
    ``(h^T dz)^T``: ``h^T`` ``[E, N]`` (kept from the forward) times ``dz``, then a ``[E, V]``
    transpose, so no ``[N, V]`` array is transposed.
    """
    return _head_logprobs_entropy_fwd(h, w, targets, temperature)[0]


def _head_scores(h, w, targets, temperature):
    """(scaled logits z [N, V], log-probabilities, entropies): ``token_logprobs_and_entropy``'s
    expressions, the two sums each over their own ``exp(z - max)``. Sharing one ``exp``,
    XLA:CPU wrote ``z - max`` and its ``exp`` out as ``[N, V]`` arrays and read them back:
    here each sum is one pass over ``z``."""
    logits = jnp.einsum("ne,ve->nv", h, w, preferred_element_type=jnp.float32)
    z = logits / temperature
    m = jnp.max(z, axis=-1, keepdims=True)
    sum_exp = jnp.sum(jnp.exp(z - m), axis=-1)
    lse = jnp.log(sum_exp)
    lp = jnp.take_along_axis(z, targets[:, None].astype(jnp.int32), axis=-1)[:, 0] - m[:, 0] - lse
    m2 = jax.lax.optimization_barrier(m)  # another value: its exp is not the first sum's
    mean_logit = jnp.sum(jnp.exp(z - m2) * (z - m2), axis=-1) / sum_exp
    return z, lp, lse - mean_logit


def _head_grad_via_transpose(h) -> bool:
    """Whether the head's weight gradient is computed as ``(h^T dlogits)^T`` (tokens at least
    twice the width) rather than as ``dlogits^T h``.

    One weight-gradient product, CPU time: at 2048 tokens x 256 x 4096 the transposed form
    took 52 ms against 125 ms (XLA:CPU runs ``dlogits^T h`` reading ``dlogits`` along its slow
    axis); at 1024 tokens x 768 x 32000 it took 811 ms against 644-719 ms (the ``[E, V]``
    transpose is then a large share)."""
    n, e = h.shape
    return n >= 2 * e


def _head_logprobs_entropy_fwd(h, w, targets, temperature):
    z, lp, ent = _head_scores(h, w, targets, temperature)
    h_res = jax.lax.optimization_barrier(h.T) if _head_grad_via_transpose(h) else h
    return (lp, ent), (h_res, w, targets, z, lp, ent)


def _head_logprobs_entropy_bwd(temperature, residuals, g):
    h_res, w, targets, z, lp, ent = residuals
    g_lp, g_ent = g
    # log p_v = z_v - lse = (z_v - z_target) + lp; E = lse - ent.
    z_t = jnp.take_along_axis(z, targets[:, None].astype(jnp.int32), axis=-1)
    log_norm = z_t - lp[:, None]  # lse of z
    mean = log_norm - ent[:, None]
    p = jnp.exp(z - log_norm)
    onehot = jnp.arange(z.shape[-1], dtype=jnp.int32)[None, :] == targets[:, None]
    dz = g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (z - mean)
    dlogits = (dz / temperature).astype(w.dtype)
    dh = jnp.einsum("nv,ve->ne", dlogits, w, preferred_element_type=jnp.float32)
    if _head_grad_via_transpose(dh):  # h_res is h^T
        # (h^T dlogits)^T: the [E, V] product made a buffer of its own, then transposed.
        # Without the barrier XLA:CPU folds the transpose back into the dot.
        dw = jax.lax.optimization_barrier(
            jnp.matmul(h_res, dlogits, preferred_element_type=jnp.float32)
        ).T
    else:
        dw = jnp.einsum("nv,ne->ve", dlogits, h_res, preferred_element_type=jnp.float32)
    return dh.astype(h_res.dtype), dw.astype(w.dtype), None


_head_logprobs_entropy.defvjp(_head_logprobs_entropy_fwd, _head_logprobs_entropy_bwd)


def chunked_token_logprobs_and_entropy(
    model, hidden, targets, temperature: float = 1.0, chunk: int = 0
):
    """``token_logprobs_and_entropy(model.logits_from_hidden(hidden) / temperature, targets)``.

    With ``chunk > 0`` the LM head and the log-softmax run over ``chunk`` tokens of the
    sequence at a time (``lax.map``; each chunk rematerialised in the backward pass), so the
    float32 ``[B, T, V]`` logits and their cotangent never exist whole: the largest buffer is
    ``[B, chunk, V]``. The sequence is padded to a multiple of ``chunk`` (padding is dropped).

    Args:
      model: a :class:`~gagar_jax.models.Transformer` (its LM head / tied embedding is used).
      hidden: [B, T, E] final-norm hidden states (``model.hidden_states``).
      targets: [B, T] int token ids scored at each position.
    Returns:
      (logprobs [B, T] float32, entropy [B, T] float32).
    """
    b, t = targets.shape
    dt = jnp.dtype(model.config.dtype)
    weight = model.head_weight()  # [V, E]
    temperature = float(temperature)

    def one(w, hc, yc):  # hc [b, c, E], yc [b, c] -> ([b, c], [b, c])
        e = hc.shape[-1]
        lp, ent = _head_logprobs_entropy(
            hc.reshape(-1, e).astype(dt), w.astype(dt), yc.reshape(-1), temperature
        )
        return lp.reshape(yc.shape), ent.reshape(yc.shape)

    if chunk <= 0 or chunk >= t:
        return one(weight, hidden, targets)
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1)
    y = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk)
    one = jax.checkpoint(one)

    lp, ent = jax.lax.map(
        lambda xs: one(weight, *xs), (jnp.moveaxis(h, 1, 0), jnp.moveaxis(y, 1, 0))
    )
    lp = jnp.moveaxis(lp, 0, 1).reshape(b, n * chunk)[:, :t]
    ent = jnp.moveaxis(ent, 0, 1).reshape(b, n * chunk)[:, :t]
    return lp, ent


def _windowed(config: UpdateConfig, seq_len: int) -> bool:
    """Whether the loss scores a window of ``config.score_window`` positions per sequence (a
    window as wide as the ``seq_len - 1`` predictions, or wider, is the whole sequence)."""
    return 0 < config.score_window < seq_len - 1


def score_window_index(response_mask: jax.Array, window: int) -> jax.Array:
    """The ``[N, window]`` prediction positions each sequence's loss reads under
    ``UpdateConfig.score_window``: ``window`` consecutive positions from the one that predicts
    the sequence's first response token (position ``j`` predicts token ``j + 1``), moved back
    to end at the last prediction where they would run past it. ``response_mask`` is
    ``[N, T]`` with ``T - 1 >= window``; a sequence without response tokens reads the first
    ``window`` positions (all masked)."""
    scored = response_mask[:, 1:].astype(jnp.int32)
    first = jnp.argmax(scored, axis=1).astype(jnp.int32)
    start = jnp.minimum(first, scored.shape[1] - window)
    return start[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]


def update_step(
    state: TrainState,
    batch: UpdateBatch,
    *,
    graphdef,
    config: UpdateConfig,
    mesh: Mesh | None = None,
):
    """The pure update (jit it with :func:`jit_update`). Returns ``(state, metrics)``."""
    tx = make_optimizer(config)
    schedule = learning_rate_schedule(config)
    adv_out = gagar_advantages(
        batch.rewards,
        batch.passed,
        batch.cheat,
        batch.tier,
        batch.rank,
        batch.graded,
        batch.valid,
        config=config.advantages,
    )
    seq_adv = adv_out.advantages.reshape(-1)  # [N]
    seq_valid = batch.valid.reshape(-1)
    if batch.row_episode is not None:  # several rows per rollout: each takes its rollout's
        seq_adv, seq_valid = seq_adv[batch.row_episode], seq_valid[batch.row_episode]
        config = _unshared(config)

    resp = batch.response_mask & seq_valid[:, None]
    fields = dict(
        tokens=batch.tokens,
        positions=batch.positions,
        attention_mask=batch.attention_mask,
        response_mask=resp,
        old_logprobs=batch.old_logprobs,
        advantages=seq_adv,
    )
    if batch.ref_logprobs is not None:
        fields["ref_logprobs"] = batch.ref_logprobs
    if batch.evidence is not None:
        fields["evidence"] = batch.evidence
    if config.token_credit == "distinguishing":
        # The group's context, taken before the rows are split: which tokens of each pass no
        # pass of another factor shares, and the base advantage the shared ones go back to.
        g_, k_ = batch.rewards.shape
        fields["distinguishing"] = distinguishing_tokens_unchecked(
            batch.tokens.reshape(g_, k_, -1),
            resp.reshape(g_, k_, -1),
            adv_out.factors,
            adv_out.passed,
            batch.valid,
        ).reshape(resp.shape)
        fields["base_advantages"] = adv_out.original.reshape(-1)
    if batch.routes is not None:
        fields["routes"] = batch.routes
    m, a = config.num_minibatches, config.num_microbatches
    group_size = batch.rewards.shape[1]
    model_config = nnx.merge(graphdef, state.params).config
    moe = model_config.num_experts > 0
    # LoRA: the adapters are differentiated and stepped, the base is a constant of the step
    # (its gradient is never formed); without LoRA every parameter is trainable.
    trainable0, frozen = lora_lib.trainable(state.params, model_config)
    # Dense models only: a router's statistics would count a group's prompt once, not once
    # per sample.
    shared = not moe and _shares_prefix(config, batch.tokens.shape[1], batch.rewards.shape[0], mesh)
    if config.shared_prefix:  # at trace time: once per compiled update
        log.info(
            "update: %s",
            "each group's prompt runs through the model once (shared_prefix)"
            if shared
            else "shared_prefix is set but the update runs per sample (a mixture-of-experts "
            "model, no score_window, or groups that do not divide into the mini-batches, "
            "micro-batches and batch shards)",
        )
    if shared:
        data = {key: _split_groups(v, m, a, group_size, mesh) for key, v in fields.items()}
    else:
        data = {key: _split(v, m, a, mesh) for key, v in fields.items()}
    token_keys = _token_metric_keys(config, batch.evidence is not None)
    episode_credit = None
    if batch.row_episode is not None and config.token_credit != "broadcast":
        tok_adv, episode_credit = episode_token_advantages(
            state.params,
            data,
            adv_out.advantages.reshape(-1),
            batch.row_episode,
            graphdef=graphdef,
            config=config,
            mesh=mesh,
        )
        data["token_advantages"] = _split(tok_adv, m, a, mesh)

    route_m = {}
    if config.needs_proximal:
        if moe and "routes" in data and config.mismatch_metrics:
            # the routes the update's own router picks (no replay) against the recorded ones,
            # and the log-probs it gives without replay (``mismatch/*``)
            free_lp, free_routes = _proximal_logprobs(
                state.params, data, graphdef, config, replay=False, return_routes=True
            )
            if config.routing_replay:
                prox, used = _proximal_logprobs(
                    state.params, data, graphdef, config, return_routes=True
                )
                route_m = route_mismatch_metrics(data, free_lp, free_routes, prox, used)
            else:
                prox = free_lp
                route_m = route_mismatch_metrics(data, free_lp, free_routes)
        else:
            prox = _proximal_logprobs(state.params, data, graphdef, config)
        data["proximal_logprobs"] = prox

    def loss_fn(params, mb, num_tokens, num_seqs):
        model = nnx.merge(graphdef, params)
        # The behaviour policy sampled from softmax(logits / T): score the same distribution.
        # ``per_token(x)`` aligns a [b, T] token field with the scored predictions (position j
        # predicts token j + 1; ``shift=0`` for fields already indexed by the prediction).
        # Scored positions: a window per row (``idx``), or every prediction (``idx`` None).
        if shared:
            hidden, idx = _shared_prefix_hidden(model, mb, config.score_window, group_size)
            router = {}
        else:
            hidden, router = model.hidden_states(
                mb["tokens"],
                mb["positions"],
                attention_mask=mb["attention_mask"],
                return_aux=True,
                routes=mb["routes"] if (config.routing_replay and "routes" in mb) else None,
            )
            idx = None
            if mesh is not None:
                # Rows stay split over the batch axes into the LM head: left to itself, GSPMD
                # contracted the FSDP-split embedding dimension in place, so every device
                # computed partial logits of the whole micro-batch (all devices' rows) and
                # all-reduced them, [tokens x devices, vocab] float32 on each (docs/
                # benchmarks_scale.md: 9.8 of 10 GiB per device at the Qwen3-0.6B shape).
                hidden = _rows_sharded(hidden, mesh)
            if _windowed(config, mb["tokens"].shape[1]):
                idx = score_window_index(mb["response_mask"], config.score_window)  # [b, W]
                hidden = jnp.take_along_axis(hidden, idx[..., None], axis=1)
        if idx is not None:

            def per_token(x, shift=1):
                return jnp.take_along_axis(x, idx + shift, axis=1)

            logprobs, entropy = chunked_token_logprobs_and_entropy(
                model, hidden, per_token(mb["tokens"]), config.temperature, config.logits_chunk_size
            )
        else:

            def per_token(x, shift=1):
                return x[:, 1:] if shift else x[:, :-1]

            # Targets shifted left by one; the logits are consumed whole (no sliced
            # [b, T-1, V] copy) and only the [b, T] results drop their last column.
            next_tokens = jnp.roll(mb["tokens"], -1, axis=1)
            logprobs, entropy = chunked_token_logprobs_and_entropy(
                model, hidden, next_tokens, config.temperature, config.logits_chunk_size
            )
            logprobs, entropy = logprobs[:, :-1], entropy[:, :-1]
        ref = mb.get("ref_logprobs")
        mask = per_token(mb["response_mask"])
        old_logprobs = per_token(mb["old_logprobs"])
        evidence = per_token(mb["evidence"]) if "evidence" in mb else None
        advantages = mb["advantages"]  # [b]: broadcast inside the fused loss
        if "token_advantages" in mb:  # an episode's rows share its statistics (see above)
            advantages = per_token(mb["token_advantages"])  # [b, T - 1] or [b, W]
        elif config.token_credit == "distinguishing":
            advantages = contrastive_tokens_unchecked(
                mb["advantages"],
                mb["base_advantages"],
                per_token(mb["distinguishing"]),
                mask,
                strength=config.token_gamma,
            )  # [b, T - 1]
        elif config.token_credit != "broadcast":
            importance = importance_provider(config.token_credit)(
                ImportanceInputs(mask=mask, entropy=entropy, evidence=evidence)
            )
            advantages = redistribute_tokens_unchecked(
                mb["advantages"], importance, mask, gamma=config.token_gamma
            )  # [b, T - 1]
        terms = policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            entropy,
            None if ref is None else per_token(ref),
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            dual_clip=config.dual_clip,
            aggregation=config.aggregation,
            kl_coef=config.kl_coef,
            kl_estimator=config.kl_estimator,
            entropy_coef=config.entropy_coef,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            **_off_policy_args(mb, config, per_token),
        )
        extra = {}
        if token_keys:
            extra = _token_metrics(
                advantages,
                mb["advantages"],
                mask,
                evidence,
                logprobs,
                old_logprobs,
                config,
                num_tokens,
                num_seqs,
            )
        # MoE router metrics, averaged over micro-batches (the accumulation sums them).
        extra.update({k: v / a for k, v in router.items()})
        loss = terms.loss
        if moe and config.router_aux_loss_coef > 0:
            # Per micro-batch, scaled so the accumulated sum is the micro-batches' mean.
            loss = loss + config.router_aux_loss_coef * router["router_aux_loss"] / a
        # training-inference mismatch: |trainer log-prob - engine log-prob| on the engine's own
        # tokens (meaningful at the first optimizer step, before the parameters move)
        diff = jnp.abs(logprobs - old_logprobs)
        max_diff = jnp.max(jnp.where(mask, diff, 0.0), initial=0.0)
        return loss, (terms, extra, jax.lax.stop_gradient(max_diff))

    grad_fn = jax.value_and_grad(
        lambda tr, *a: loss_fn(lora_lib.combine(frozen, tr), *a), has_aux=True
    )

    def minibatch(carry, i):
        params, opt_state, opt_step = carry  # params: the trainable ones (LoRA: the adapters)
        mb_all = jax.tree.map(lambda x: x[i % m], data)  # [A, b, ...]
        mask = mb_all["response_mask"][..., 1:]
        num_tokens = jnp.sum(mask.astype(jnp.float32))
        num_seqs = jnp.sum(jnp.any(mask, axis=-1).astype(jnp.float32))

        def micro(acc, mb):
            (_, (terms, extra, max_diff)), grads = grad_fn(params, mb, num_tokens, num_seqs)
            acc_gt, acc_diff = acc
            return (
                jax.tree.map(jnp.add, acc_gt, (grads, terms, extra)),
                jnp.maximum(acc_diff, max_diff),
            ), None

        zero = jnp.zeros((), jnp.float32)
        zeros = (
            (
                jax.tree.map(jnp.zeros_like, params),
                PolicyLossTerms(*([zero] * len(PolicyLossTerms._fields))),
                {k: zero for k in token_keys + (ROUTER_METRICS if moe else ())},
            ),
            zero,
        )
        ((grads, terms, extra), max_diff), _ = jax.lax.scan(micro, zeros, mb_all)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        out = dict(
            terms._asdict(),
            **extra,
            grad_norm=grad_norm,
            learning_rate=schedule(opt_step),
            tokens=num_tokens,
            logprob_max_abs_diff=max_diff,
        )
        return (params, opt_state, opt_step + 1), out

    steps_per_update = config.optimizer_steps_per_update
    opt_step0 = state.step * steps_per_update
    (trained, opt_state, _), per_step = jax.lax.scan(
        minibatch, (trainable0, state.opt_state, opt_step0), jnp.arange(steps_per_update)
    )
    params = lora_lib.combine(frozen, trained)

    metrics = {k: jnp.mean(v) for k, v in per_step.items() if k != "learning_rate"}
    if token_keys:
        metrics.update(_token_metric_ratios(per_step))
    if episode_credit is not None:  # per episode: its rows' sums are not conserved one by one
        metrics["token_credit/conservation_error"] = episode_credit
    metrics["pg_loss_first"] = per_step["pg_loss"][0]  # on-policy value of the first step
    # first optimizer step: on-policy, so ratio 1 and k3 KL 0 unless the update scores another
    # distribution than the sampler's (the temperature check)
    metrics["ratio_mean_first"] = per_step["ratio_mean"][0]
    metrics["approx_kl_first"] = per_step["approx_kl"][0]
    metrics["logprob_max_abs_diff_first"] = per_step["logprob_max_abs_diff"][0]
    metrics.update(_off_policy_metrics(per_step))
    for k in ("token", "seq"):  # the rollout correction's masked shares
        frac = metrics.pop(f"correction_{k}_frac")
        if config.rollout_correction != "none":
            metrics[f"mismatch/masked_{k}_frac"] = frac
    if config.needs_proximal:
        metrics.update(proximal_mismatch_metrics(data))
        metrics.update(route_m)
    for k in ("credit_delivered", "credit_positive", "is_weight_sq_mean"):  # summed into those
        metrics.pop(k)
    metrics["grad_norm_max"] = jnp.max(per_step["grad_norm"])
    metrics["learning_rate"] = per_step["learning_rate"][-1]
    metrics["tokens"] = jnp.sum(resp[:, 1:].astype(jnp.float32))
    if _windowed(config, resp.shape[1]):
        idx = score_window_index(resp, config.score_window)
        kept = jnp.sum(jnp.take_along_axis(resp, idx + 1, axis=1).astype(jnp.float32))
        metrics["score_window/dropped_tokens"] = metrics["tokens"] - kept
    n_resp_seqs = jnp.sum(jnp.any(resp[:, 1:], axis=-1).astype(jnp.float32))
    metrics["response_length"] = metrics["tokens"] / jnp.maximum(n_resp_seqs, 1.0)
    metrics.update(adv_out.metrics)
    if "distinguishing" in fields:
        # the share of the passes' response tokens that no pass of another factor shares
        on_pass = resp[:, 1:] & adv_out.passed.reshape(-1)[:, None]
        metrics["token_credit/distinguishing_share"] = jnp.sum(
            fields["distinguishing"][:, 1:] & on_pass
        ) / jnp.maximum(jnp.sum(on_pass), 1)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
    return new_state, metrics


def _unsplit(y):
    """[M, A, b, ...] -> [N, ...]: the inverse of :func:`_split`."""
    n = y.shape[0] * y.shape[1] * y.shape[2]
    return jnp.moveaxis(y, 2, 0).reshape((n,) + y.shape[3:])


def episode_token_advantages(
    params,
    data,
    episode_advantages,
    row_episode,
    *,
    graphdef,
    config: UpdateConfig,
    mesh: Mesh | None = None,
):
    """The token advantages of a batch whose rollouts span several rows (``row_episode``),
    before the first optimizer step: ``redistribute_segment_tokens`` over the whole batch.

    ``data`` is the split batch (``[M, A, b, T]``, the fields of :func:`update_step`; its
    ``response_mask`` already masked by validity), ``episode_advantages`` ``[G * K]`` and
    ``row_episode`` ``[N]``. The importance provider reads the rows' response mask, cited
    tokens and (``entropy``) the policy entropy of every prediction at ``params`` (one forward
    of the batch, no gradient), all over the whole batch, so each episode's statistics span all
    its rows wherever the split puts them.

    Returns ``(token_advantages [N, T] float32, conservation_error)``: the advantages indexed
    by token (column ``t`` the advantage of token ``t``, predicted at ``t - 1``; column 0 is
    0), and ``sum_e |sum_{t in M_e} A_t - A_e |M_e|| / sum_e |M_e|`` over the batch's episodes
    (0 up to rounding).
    """
    mask = _unsplit(data["response_mask"])[:, 1:]  # [N, T - 1], by prediction
    evidence = _unsplit(data["evidence"])[:, 1:] if "evidence" in data else None
    entropy = None
    if config.token_credit == "entropy":
        _, ent = _proximal_logprobs(params, data, graphdef, config, with_entropy=True)
        entropy = _unsplit(ent)[:, :-1]
    importance = importance_provider(config.token_credit)(
        ImportanceInputs(mask=mask, entropy=entropy, evidence=evidence)
    )
    tok = redistribute_segment_tokens(
        episode_advantages, importance, mask, row_episode, gamma=config.token_gamma
    )
    e = episode_advantages.shape[0]
    maskf = mask.astype(jnp.float32)
    got = jax.ops.segment_sum(jnp.sum(tok * maskf, axis=-1), row_episode, num_segments=e)
    count = jax.ops.segment_sum(jnp.sum(maskf, axis=-1), row_episode, num_segments=e)
    error = jnp.sum(jnp.abs(got - episode_advantages * count)) / jnp.maximum(jnp.sum(count), 1.0)
    tok = jnp.pad(tok, ((0, 0), (1, 0)))
    if mesh is not None:
        tok = _rows_sharded(tok, mesh)
    return jax.lax.stop_gradient(tok), error


def _proximal_logprobs(
    params,
    data,
    graphdef,
    config: UpdateConfig,
    *,
    replay=None,
    return_routes=False,
    with_entropy=False,
):
    """The trainer's own log-probs of every token before the update (``[M, A, b, T]`` like the
    split ``data``; no gradient): the proximal policy of the off-policy correction.

    ``replay`` (default ``config.routing_replay``): a mixture of experts routes each token to
    its recorded experts (``data["routes"]``); ``return_routes``: also the experts each token
    went to (``[M, A, b, T, L, K]``); ``with_entropy``: ``(log-probs, entropies)`` instead."""
    replay = config.routing_replay if replay is None else replay
    replay = replay and "routes" in data

    def one(mb):
        model = nnx.merge(graphdef, params)
        out = model.hidden_states(
            mb["tokens"],
            mb["positions"],
            attention_mask=mb["attention_mask"],
            routes=mb["routes"] if replay else None,
            return_routes=return_routes,
        )
        hidden, routes = out if return_routes else (out, None)
        lp, ent = chunked_token_logprobs_and_entropy(
            model,
            hidden,
            jnp.roll(mb["tokens"], -1, axis=1),
            config.temperature,
            config.logits_chunk_size,
        )
        lp = jax.lax.stop_gradient(lp)
        if with_entropy:
            return lp, jax.lax.stop_gradient(ent)
        return (lp, routes) if return_routes else lp

    keys = ("tokens", "positions", "attention_mask") + (("routes",) if replay else ())
    inputs = {k: data[k] for k in keys}
    return jax.lax.map(lambda mbs: jax.lax.map(one, mbs), inputs)


def _off_policy_args(mb, config: UpdateConfig, per_token) -> dict:
    """``policy_loss``'s correction arguments (none when no correction is configured)."""
    args = {}
    if config.rollout_correction != "none":
        args = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if f.name.startswith("rollout_correction")
        }
    if not config.off_policy:
        return args
    return dict(
        args,
        proximal_logprobs=per_token(mb["proximal_logprobs"], 0),
        rollout_is=config.rollout_is,
        rollout_is_threshold=config.rollout_is_threshold,
        rollout_rs=config.rollout_rs,
        rollout_rs_threshold=config.rollout_rs_threshold,
        rollout_rs_threshold_lower=config.rollout_rs_threshold_lower,
        decoupled=config.decoupled,
    )


def _off_policy_metrics(per_step: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``is_ess`` (normalised effective sample size of the IS weights, 1 when all are equal)
    and ``credit/delivered_ratio`` (positive credit delivered after weights and clipping over
    the positive credit S+), from the accumulated token means."""
    ess = per_step["is_weight_mean"] ** 2 / jnp.maximum(per_step["is_weight_sq_mean"], 1e-30)
    pos = jnp.sum(per_step["credit_positive"])
    return {
        "is_ess": jnp.mean(jnp.where(per_step["is_weight_sq_mean"] > 0, ess, 1.0)),
        "credit/delivered_ratio": jnp.where(
            pos > 0, jnp.sum(per_step["credit_delivered"]) / jnp.where(pos > 0, pos, 1.0), 1.0
        ),
    }


def _token_metric_keys(config: UpdateConfig, has_evidence: bool) -> tuple[str, ...]:
    """Static names of the token-credit sums the loss accumulates (none for the broadcast)."""
    if config.token_credit == "broadcast" and not has_evidence:
        return ()
    keys = (
        "token_credit/conservation_error",
        "token_credit/conservation_error_clipped",
        "token_credit/delivered_abs",
        "token_credit/gini",
        "token_credit/positive",
    )
    return keys + (("token_credit/positive_on_evidence",) if has_evidence else ())


def _token_metrics(
    tok_adv,
    seq_adv,
    mask,
    evidence,
    logprobs,
    old_logprobs,
    config: UpdateConfig,
    num_tokens,
    num_seqs,
) -> dict[str, jax.Array]:
    """Token-credit sums of one micro-batch, normalised like the loss (they add up exactly).

    ``conservation_error``: ``sum_seq |sum_t A_t - n A|`` (the kernel's; 0 up to rounding);
    ``conservation_error_clipped``: ``sum_seq |sum_t (A_t - A) r_t [active_t]|``, the credit the
    clipped surrogate delivers with token credit minus what it delivers with the broadcast (the
    clip set is the same for both: it depends on the ratio and the sign only); both over
    ``num_tokens``, with ``delivered_abs`` = ``sum_t |A_t r_t [active_t]|`` as their scale.
    ``gini``: mean over sequences of the Gini of ``|A_t|``. ``positive`` /
    ``positive_on_evidence``: positive token credit in all / on cited tokens. With several rows
    per episode (``UpdateBatch.row_episode``) these are per row: ``conservation_error`` is then
    replaced by the episode figure (:func:`episode_token_advantages`), and
    ``conservation_error_clipped`` also counts the credit moved between an episode's rows.
    """
    sg = jax.lax.stop_gradient
    tok_adv = jnp.broadcast_to(tok_adv if tok_adv.ndim == 2 else tok_adv[:, None], mask.shape)
    tok_adv = sg(tok_adv.astype(jnp.float32))
    seq_adv = sg(seq_adv.astype(jnp.float32))
    ratio = jnp.exp(jnp.clip(sg(logprobs - old_logprobs), -20.0, 20.0))
    clip = dict(clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip)
    maskf = mask.astype(jnp.float32)
    delivered = delivered_credit(tok_adv, ratio, **clip) * maskf
    broadcast = delivered_credit(jnp.broadcast_to(seq_adv[:, None], mask.shape), ratio, **clip)
    tc = token_credit(tok_adv, seq_adv, mask, evidence)
    per_tok = lambda x: jnp.sum(x) / jnp.maximum(num_tokens, 1.0)
    out = {
        "token_credit/conservation_error": per_tok(tc.error_sum),
        "token_credit/conservation_error_clipped": per_tok(
            jnp.abs(jnp.sum(delivered - broadcast * maskf, axis=-1))
        ),
        "token_credit/delivered_abs": per_tok(jnp.abs(delivered)),
        "token_credit/gini": jnp.sum(tc.gini) / jnp.maximum(num_seqs, 1.0),
        "token_credit/positive": per_tok(tc.positive),
    }
    if evidence is not None:
        out["token_credit/positive_on_evidence"] = per_tok(tc.positive_on_evidence)
    return out


def _token_metric_ratios(per_step: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Shares from the accumulated sums (ratios of sums, not means of ratios)."""
    out = {}
    delivered = jnp.maximum(jnp.sum(per_step["token_credit/delivered_abs"]), 1e-30)
    out["token_credit/conservation_error_clipped_rel"] = (
        jnp.sum(per_step["token_credit/conservation_error_clipped"]) / delivered
    )
    if "token_credit/positive_on_evidence" in per_step:
        pos = jnp.sum(per_step["token_credit/positive"])
        out["token_credit/evidence_share"] = jnp.where(
            pos > 0,
            jnp.sum(per_step["token_credit/positive_on_evidence"]) / jnp.where(pos > 0, pos, 1.0),
            0.0,
        )
    return out


def jit_update(
    model_config: TransformerConfig,
    config: UpdateConfig,
    mesh: Mesh,
    *,
    with_ref: bool = False,
    with_evidence: bool = False,
    with_routes: bool = False,
    with_row_episode: bool = False,
    wrap=None,
):
    """``update(state, batch) -> (state, metrics)`` jitted with explicit shardings
    (``with_*``: the optional batch fields it receives).

    The state is donated. Returns the jitted function; it compiles once per batch shape.
    ``wrap`` (e.g. ``chex.assert_max_traces(n=1)``) decorates the traced function.
    """
    graphdef = nnx.graphdef(abstract_model(model_config))
    _, st_sh = state_shardings(model_config, config, mesh)
    rep = NamedSharding(mesh, PartitionSpec())

    def fn(state, batch):
        return update_step(state, batch, graphdef=graphdef, config=config, mesh=mesh)

    if wrap is not None:
        fn = wrap(fn)
    return jax.jit(
        fn,
        in_shardings=(
            st_sh,
            batch_shardings(mesh, with_ref, with_evidence, with_routes, with_row_episode),
        ),
        out_shardings=(st_sh, rep),
        donate_argnums=(0,),
    )


def shard_batch(batch: UpdateBatch, mesh: Mesh) -> UpdateBatch:
    """Host numpy batch (the *global* batch, on every process) -> global sharded jax arrays.

    Works in single- and multi-process runs: each process materialises only its own shards.
    """
    shardings = batch_shardings(
        mesh,
        batch.ref_logprobs is not None,
        batch.evidence is not None,
        batch.routes is not None,
        batch.row_episode is not None,
    )

    def put(x, sharding):
        if x is None:
            return None
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return UpdateBatch(*[put(x, s) for x, s in zip(batch, shardings)])


def shard_host_batch(batch: UpdateBatch, mesh: Mesh) -> UpdateBatch:
    """This process's rows + the global group arrays -> global sharded jax arrays.

    The multi-host form of :func:`shard_batch`: the ``[N_local, T]`` token fields hold only the
    rows this process's devices own (process ``p``: rows ``[p * N_local, (p + 1) * N_local)``,
    see ``gagar_jax.rl.multihost.check_process_rows``), assembled with
    ``jax.make_array_from_process_local_data``, so no host holds another host's rollouts; the
    small ``[G, K]`` group fields are global (identical on every process) and replicated. With
    one process the local rows are all rows and this equals :func:`shard_batch`.
    """
    shardings = batch_shardings(
        mesh,
        batch.ref_logprobs is not None,
        batch.evidence is not None,
        batch.routes is not None,
        batch.row_episode is not None,
    )
    g, k = np.shape(batch.rewards)
    n = g * k if batch.row_episode is None else len(batch.row_episode)

    def put(name, x, sharding):
        if x is None:
            return None
        x = np.asarray(x)
        shape = (n,) + x.shape[1:] if name in _TOKEN_FIELDS else x.shape
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return UpdateBatch(*[put(f, x, s) for f, x, s in zip(UpdateBatch._fields, batch, shardings)])
