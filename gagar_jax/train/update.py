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
   the accumulated loss is the mini-batch token mean (see ``gagar_jax.losses``);
4. optax AdamW (global-norm clipped) once per mini-batch.

Token alignment: ``response_mask[n, t]`` marks token ``t`` as a model-generated token to train
on, and ``old_logprobs[n, t]`` is its behaviour log-probability; it is predicted by the logits
at ``t - 1``, so the first column of ``response_mask`` must be False.

Sharding: sequence axes over ``('data', 'fsdp')``, group arrays ``[G, K]`` replicated (they
are tiny), parameters and Adam moments by their logical axes. The mini-batch split needs
``N / (num_minibatches * num_microbatches)`` divisible by ``data * fsdp``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gagar_jax.advantages import gagar_advantages
from gagar_jax.losses import PolicyLossTerms, policy_loss, token_logprobs_and_entropy
from gagar_jax.models import BATCH_AXES, TransformerConfig
from gagar_jax.train.state import (
    TrainState,
    UpdateConfig,
    abstract_model,
    learning_rate_schedule,
    make_optimizer,
    state_shardings,
)


class UpdateBatch(NamedTuple):
    """One update's worth of graded rollouts (``N = G * K`` sequences of ``T`` tokens)."""

    tokens: jax.Array          # [N, T] int32 prompt + response tokens
    positions: jax.Array       # [N, T] int32 RoPE positions
    attention_mask: jax.Array  # [N, T] bool, False on padding
    response_mask: jax.Array   # [N, T] bool, True on model tokens to train on
    old_logprobs: jax.Array    # [N, T] float32 behaviour log-probs of each token
    rewards: jax.Array         # [G, K] float32
    passed: jax.Array          # [G, K] bool
    cheat: jax.Array           # [G, K] bool
    tier: jax.Array            # [G, K] int32
    rank: jax.Array            # [G, K] int32
    valid: jax.Array           # [G, K] bool
    graded: jax.Array          # [G] bool
    ref_logprobs: jax.Array | None = None  # [N, T] float32 reference log-probs (KL term)


_TOKEN_FIELDS = ("tokens", "positions", "attention_mask", "response_mask", "old_logprobs",
                 "ref_logprobs")


def batch_shardings(mesh: Mesh, with_ref: bool = False) -> UpdateBatch:
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    rep = NamedSharding(mesh, PartitionSpec())
    fields = {f: (rows if f in _TOKEN_FIELDS else rep) for f in UpdateBatch._fields}
    if not with_ref:
        fields["ref_logprobs"] = None
    return UpdateBatch(**fields)


def check_batch(batch: UpdateBatch, config: UpdateConfig, mesh: Mesh | None = None) -> None:
    """Host-side validation with messages naming the field and the expected shape."""
    n, t = np.shape(batch.tokens)
    g, k = np.shape(batch.rewards)
    if n != g * k:
        raise ValueError(f"batch.tokens has {n} rows but rewards is [G={g}, K={k}]: "
                         f"need N = G * K = {g * k} (group-major rows)")
    for f in _TOKEN_FIELDS:
        x = getattr(batch, f)
        if x is not None and np.shape(x) != (n, t):
            raise ValueError(f"batch.{f} must be [N={n}, T={t}], got {np.shape(x)}")
    for f in ("passed", "cheat", "tier", "rank", "valid"):
        if np.shape(getattr(batch, f)) != (g, k):
            raise ValueError(f"batch.{f} must be [G={g}, K={k}], got {np.shape(getattr(batch, f))}")
    if np.shape(batch.graded) != (g,):
        raise ValueError(f"batch.graded must be [G={g}], got {np.shape(batch.graded)}")
    if config.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError("batch.ref_logprobs [N, T] is required when update.kl_coef > 0")
    chunks = config.num_minibatches * config.num_microbatches
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if n % (chunks * shards):
        raise ValueError(
            f"batch of N={n} sequences must divide into num_minibatches * num_microbatches = "
            f"{chunks} chunks times data*fsdp = {shards} shards")


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


def update_step(state: TrainState, batch: UpdateBatch, *, graphdef, config: UpdateConfig,
                mesh: Mesh | None = None):
    """The pure update (jit it with :func:`jit_update`). Returns ``(state, metrics)``."""
    tx = make_optimizer(config)
    schedule = learning_rate_schedule(config)
    adv_out = gagar_advantages(batch.rewards, batch.passed, batch.cheat, batch.tier, batch.rank,
                               batch.graded, batch.valid, config=config.advantages)
    seq_adv = adv_out.advantages.reshape(-1)  # [N]
    seq_valid = batch.valid.reshape(-1)

    resp = batch.response_mask & seq_valid[:, None]
    fields = dict(tokens=batch.tokens, positions=batch.positions,
                  attention_mask=batch.attention_mask, response_mask=resp,
                  old_logprobs=batch.old_logprobs, advantages=seq_adv)
    if batch.ref_logprobs is not None:
        fields["ref_logprobs"] = batch.ref_logprobs
    m, a = config.num_minibatches, config.num_microbatches
    data = {key: _split(v, m, a, mesh) for key, v in fields.items()}

    def loss_fn(params, mb, num_tokens, num_seqs):
        model = nnx.merge(graphdef, params)
        logits = model(mb["tokens"], mb["positions"], attention_mask=mb["attention_mask"])
        # The behaviour policy sampled from softmax(logits / T): score the same distribution.
        logits = logits.astype(jnp.float32) / config.temperature
        # Targets shifted left by one; the logits are consumed whole (no sliced [b, T-1, V]
        # copy) and only the [b, T] results drop their last column.
        next_tokens = jnp.roll(mb["tokens"], -1, axis=1)
        logprobs, entropy = token_logprobs_and_entropy(logits, next_tokens)
        logprobs, entropy = logprobs[:, :-1], entropy[:, :-1]
        ref = mb.get("ref_logprobs")
        terms = policy_loss(
            logprobs, mb["old_logprobs"][:, 1:], mb["advantages"], mb["response_mask"][:, 1:],
            entropy, None if ref is None else ref[:, 1:],
            clip_low=config.clip_low, clip_high=config.clip_high, dual_clip=config.dual_clip,
            aggregation=config.aggregation, kl_coef=config.kl_coef,
            kl_estimator=config.kl_estimator, entropy_coef=config.entropy_coef,
            num_tokens=num_tokens, num_seqs=num_seqs)
        return terms.loss, terms

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def minibatch(carry, i):
        params, opt_state, opt_step = carry
        mb_all = jax.tree.map(lambda x: x[i % m], data)  # [A, b, ...]
        mask = mb_all["response_mask"][..., 1:]
        num_tokens = jnp.sum(mask.astype(jnp.float32))
        num_seqs = jnp.sum(jnp.any(mask, axis=-1).astype(jnp.float32))

        def micro(acc, mb):
            (_, terms), grads = grad_fn(params, mb, num_tokens, num_seqs)
            return jax.tree.map(jnp.add, acc, (grads, terms)), None

        zero = jnp.zeros((), jnp.float32)
        zeros = (jax.tree.map(jnp.zeros_like, params),
                 PolicyLossTerms(*([zero] * len(PolicyLossTerms._fields))))
        (grads, terms), _ = jax.lax.scan(micro, zeros, mb_all)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        out = dict(terms._asdict(), grad_norm=grad_norm, learning_rate=schedule(opt_step),
                   tokens=num_tokens)
        return (params, opt_state, opt_step + 1), out

    steps_per_update = config.optimizer_steps_per_update
    opt_step0 = state.step * steps_per_update
    (params, opt_state, _), per_step = jax.lax.scan(
        minibatch, (state.params, state.opt_state, opt_step0), jnp.arange(steps_per_update))

    metrics = {k: jnp.mean(v) for k, v in per_step.items() if k != "learning_rate"}
    metrics["pg_loss_first"] = per_step["pg_loss"][0]  # on-policy value of the first step
    # first optimizer step: on-policy, so ratio 1 and k3 KL 0 unless the update scores another
    # distribution than the sampler's (the temperature check)
    metrics["ratio_mean_first"] = per_step["ratio_mean"][0]
    metrics["approx_kl_first"] = per_step["approx_kl"][0]
    metrics["grad_norm_max"] = jnp.max(per_step["grad_norm"])
    metrics["learning_rate"] = per_step["learning_rate"][-1]
    metrics["tokens"] = jnp.sum(resp[:, 1:].astype(jnp.float32))
    n_resp_seqs = jnp.sum(jnp.any(resp[:, 1:], axis=-1).astype(jnp.float32))
    metrics["response_length"] = metrics["tokens"] / jnp.maximum(n_resp_seqs, 1.0)
    metrics.update(adv_out.metrics)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                           rng=state.rng)
    return new_state, metrics


def jit_update(model_config: TransformerConfig, config: UpdateConfig, mesh: Mesh, *,
               with_ref: bool = False, wrap=None):
    """``update(state, batch) -> (state, metrics)`` jitted with explicit shardings.

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
    return jax.jit(fn, in_shardings=(st_sh, batch_shardings(mesh, with_ref)),
                   out_shardings=(st_sh, rep), donate_argnums=(0,))


def shard_batch(batch: UpdateBatch, mesh: Mesh) -> UpdateBatch:
    """Host numpy batch (the *global* batch, on every process) -> global sharded jax arrays.

    Works in single- and multi-process runs: each process materialises only its own shards.
    """
    shardings = batch_shardings(mesh, batch.ref_logprobs is not None)

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
    see ``gagar_jax.train.multihost.check_process_rows``), assembled with
    ``jax.make_array_from_process_local_data``, so no host holds another host's rollouts; the
    small ``[G, K]`` group fields are global (identical on every process) and replicated. With
    one process the local rows are all rows and this equals :func:`shard_batch`.
    """
    shardings = batch_shardings(mesh, batch.ref_logprobs is not None)
    g, k = np.shape(batch.rewards)
    n = g * k

    def put(name, x, sharding):
        if x is None:
            return None
        x = np.asarray(x)
        shape = (n,) + x.shape[1:] if name in _TOKEN_FIELDS else x.shape
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return UpdateBatch(*[put(f, x, s) for f, x, s in zip(UpdateBatch._fields, batch, shardings)])
