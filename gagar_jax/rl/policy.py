"""The policy side of an RL run: building the model, the update as one RL step calls it, weight
sync to the rollout engine, and checkpoints of the train state with the loop state.

Small functions over the update library's own objects (``TrainState``, ``jit_update``,
``Checkpointer``); the loop holds those objects itself (no wrapper class forwarding to them):

* :func:`build_model`: the policy model from ``cfg.model`` (vocab from the tokenizer) or from a
  Hugging Face checkpoint (``cfg.hf_checkpoint``);
* :func:`initial_state`: the sharded ``TrainState`` from the (SFT-warmed) model's parameters;
* :func:`rl_update`: the packed group-major ``[N, T]`` ``UpdateBatch`` (rows ``n = g * K + k``),
  validated on the host and sharded, through the jitted update; a non-finite loss is an error
  naming the step;
* :func:`sync_engine`: the new parameters to the rollout engine. The embedded sampler gets a
  full copy on its own device made device to device (:func:`local_params`; the sampler then
  ``device_put``\\ s it onto its own sharding, a no-op copy), never through the host and never
  by mutating a model object shared with the sampler; SGLang gets the sharded parameters,
  exported tensor by tensor by its engine's sync protocol;
  With LoRA (``model.lora_rank``) the embedded sampler gets its first sync whole and the
  adapters alone after it, SGLang the adapter through its LoRA API (``engines``). After every
  sync (``rollout.sync_check``) the engine must report the new version and a probe prompt's
  log-probs on it must equal the trainer's (:mod:`gagar_jax.rollout.weight_sync`);
* :func:`checkpointer`, :func:`save`, :func:`restore`: one orbax step holds the ``TrainState``
  and the loop's :class:`~gagar_jax.rl.resume.LoopState` (the ``meta`` item, key
  ``loop_state``), with the run config's fingerprint; restores go onto the mesh's shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gagar_jax.models import Transformer, TransformerConfig, load_hf_safetensors, lora
from gagar_jax.rl.config import RunConfig
from gagar_jax.rl.resume import LOOP_STATE_KEY, LoopState
from gagar_jax.rollout import weight_sync
from gagar_jax.update import (
    Checkpointer,
    TrainState,
    UpdateBatch,
    abstract_train_state,
    check_batch,
    create_train_state,
    shard_host_batch,
)
from gagar_jax.update.step import check_batch_rows

# How the policy runs, not what it is: taken from ``cfg.model`` for a Hugging Face checkpoint too
# (whose config.json decides the architecture).
EXECUTION_FIELDS = (
    "dtype",
    "param_dtype",
    "remat",
    "remat_policy",
    "scan_layers",
    "causal_block_size",
)

# How the policy is trained on top of the architecture: LoRA adapters (gagar_jax.models.lora).
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")


def build_model(cfg: RunConfig, vocab_size: int) -> tuple[TransformerConfig, Transformer]:
    """The policy: ``cfg.model`` with the tokenizer's vocab (seeded by ``cfg.seed``), or the
    architecture and weights of ``cfg.hf_checkpoint`` run with ``cfg.model``'s
    :data:`EXECUTION_FIELDS` (dtype, rematerialisation, scanned layers, causal blocks)."""
    if cfg.hf_checkpoint:
        overrides = {k: getattr(cfg.model, k) for k in EXECUTION_FIELDS + LORA_FIELDS}
        model_config, model = load_hf_safetensors(cfg.hf_checkpoint, **overrides)
        if model_config.vocab_size < vocab_size:
            raise ValueError(
                f"model.hf_checkpoint vocab {model_config.vocab_size} < "
                f"tokenizer vocab {vocab_size}"
            )
        return model_config, model
    model_config = cfg.model_config(vocab_size)
    return model_config, Transformer(model_config, rngs=nnx.Rngs(cfg.seed))


def initial_state(cfg: RunConfig, model: Transformer, mesh) -> TrainState:
    """The sharded train state holding ``model``'s (SFT-warmed) parameters. With LoRA the
    adapters are folded into the weights and ``B`` reset (the same model): the warmed weights
    are the base the adapters train on."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if model.config.lora_rank:
        params = jax.device_get(lora.merge_and_reset(params, model.config))
    return create_train_state(model.config, cfg.learner, mesh, seed=cfg.seed, params=params)


def rl_update(
    update_fn,
    state: TrainState,
    batch: UpdateBatch,
    *,
    cfg: RunConfig,
    mesh,
    step: int,
    behaviour=None,
) -> tuple[TrainState, dict[str, float]]:
    """One update on ``batch`` (NumPy, from ``rl.collect.pack_groups``): this host's
    ``[G / P * K, T]`` rows, the global ``[G, K]`` group fields (``P`` processes; one process:
    the whole batch). ``update_fn``: ``jit_update(...)``. ``behaviour``: None, or
    ``fn(sharded batch) -> old_logprobs`` that replaces the recorded behaviour log-probs
    (``rollout.bitwise_onpolicy``).

    Raises:
      FloatingPointError: a non-finite loss (naming the RL step).
    """
    ub = batch if cfg.grading.enabled else batch._replace(evidence=None)
    if jax.process_count() > 1:  # the global arrays are not readable here: check this host's
        check_batch_rows(ub, cfg.learner, cfg.rollout.num_rollouts)
    ub = shard_host_batch(ub, mesh)
    check_batch(ub, cfg.learner, mesh)
    if behaviour is not None:
        ub = ub._replace(old_logprobs=behaviour(ub))
    state, metrics = update_fn(state, ub)
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not np.isfinite(m["loss"]):
        raise FloatingPointError(f"non-finite loss {m['loss']} at RL step {step}")
    return state, m


def model_device(model: Transformer):
    """The device the (unsharded) policy model, hence the embedded sampler, lives on."""
    leaf = jax.tree.leaves(nnx.state(model))[0]
    return next(iter(leaf.devices())) if hasattr(leaf, "devices") else jax.local_devices()[0]


@functools.lru_cache(maxsize=8)
def _replicator(sharding: NamedSharding):
    """A jitted identity onto ``sharding`` (one per mesh; jit caches per parameter tree)."""
    return jax.jit(lambda p: p, out_shardings=sharding)


def local_params(params, mesh, device):
    """A full copy of the sharded ``params`` on ``device`` (one of this process's devices).

    Device to device: one jitted identity re-lays the tree out replicated over ``mesh`` (the
    all-gather runs on the devices, across hosts over their interconnect), then each leaf's
    shard on ``device`` is taken as is. Nothing is fetched to the host, so this works for
    parameters spanning non-addressable devices, where ``jax.device_get`` raises. Peak memory:
    one extra full copy per device for the duration of the call.

    Raises:
      ValueError: ``device`` is not one of this process's devices.
    """
    if device.process_index != jax.process_index():
        raise ValueError(
            f"local_params: {device} belongs to process {device.process_index}, "
            f"this is process {jax.process_index()}"
        )
    full = _replicator(NamedSharding(mesh, PartitionSpec()))(params)

    def pick(x):
        if x.sharding.device_set == {device}:  # a one-device mesh: the copy is on `device`
            return x.addressable_data(0)
        for shard in x.addressable_shards:
            if shard.device == device:
                return shard.data
        # the sampler's device is outside the mesh: copy the local replica over (device to
        # device within this process)
        return jax.device_put(x.addressable_shards[0].data, device)

    return jax.tree.map(pick, full)


def sync_engine(
    engine, cfg: RunConfig, params, *, mesh, device, version: int, metrics: dict | None = None
) -> int:
    """Sends ``params`` (the train state's, sharded) to the rollout engine as ``version``;
    returns the version the engine reports (``device``: the embedded sampler's).

    LoRA: an embedded sampler gets the adapters alone once it has the base (its first sync
    from here is whole); SGLang's LoRA engine exports the adapter. With ``rollout.sync_check``
    the sync is verified (:func:`gagar_jax.rollout.weight_sync.check_sync`, its metrics into
    ``metrics``).

    Raises:
      SyncCheckError: the engine does not serve what was synced (naming it).
    """
    lora_on = bool(cfg.model.lora_rank) and lora.has_adapters(params)
    if cfg.rollout.engine == "sglang":
        got = engine.sync_weights(params, version)
    elif lora_on and getattr(engine, "lora_base_hash", None) is not None:
        adapters = lora.split_adapters(params)[0]
        got = weight_sync.sync_sampler_adapters(
            engine, local_params(adapters, mesh, device), version
        )
    else:
        got = engine.sync_weights(local_params(params, mesh, device), version)
        if lora_on:  # the base is on the sampler now: later syncs send the adapters alone
            engine.lora_base_hash = True
    if cfg.rollout.sync_check:
        out = weight_sync.check_sync(
            engine,
            params,
            engine_model_config(engine, cfg),
            version,
            tolerance=cfg.rollout.sync_check_tolerance or None,
        )
        if metrics is not None:
            metrics.update(out)
    return got


def engine_model_config(engine, cfg: RunConfig):
    """The policy's model config as the engine runs it (the sampler's ``config``, an SGLang
    engine's ``model_config``; ``cfg.model`` for an engine that names none)."""
    for name in ("model_config", "config"):
        config = getattr(engine, name, None)
        if config is not None:
            return config
    return cfg.model


def checkpointer(cfg: RunConfig, workdir: str, model_config: TransformerConfig) -> Checkpointer:
    """The run's orbax checkpoints in ``workdir/checkpoints`` (run-config fingerprint)."""
    return Checkpointer(
        os.path.join(workdir, "checkpoints"),
        model_config=model_config,
        update_config=cfg.learner,
        fingerprint=cfg.fingerprint(),
        keep=cfg.loop.keep_checkpoints + 1,
    )


def save(ckpt: Checkpointer, step: int, state: TrainState, loop_state: LoopState) -> None:
    """Checkpoint ``step``: the train state and ``loop_state``, one orbax step (waited on)."""
    ckpt.save(
        step,
        state,
        data_position=loop_state.data_position,
        extra={LOOP_STATE_KEY: dataclasses.asdict(loop_state)},
        wait=True,
    )


def restore(
    ckpt: Checkpointer,
    cfg: RunConfig,
    model_config: TransformerConfig,
    mesh,
    step: int | None = None,
) -> tuple[TrainState, int, LoopState]:
    """Checkpoint ``step`` (None: the newest intact one) onto ``mesh``: state, step, loop state.

    Raises:
      ConfigMismatchError: the checkpoint belongs to another run config.
    """
    state, info = ckpt.restore(abstract_train_state(model_config, cfg.learner, mesh), step)
    return state, info.step, LoopState.from_dict(info.extra[LOOP_STATE_KEY])
