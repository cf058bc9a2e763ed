"""The RL train state behind :class:`~gagar_jax.rl.backends.Policy`, on the sharded update.

Wires the loop to the policy-update package (``gagar_jax.update.state`` / ``update``):

* the update's ``UpdateConfig`` is the run config's ``learner`` section itself;
* the train state is created already sharded on the run's mesh from the (SFT-warmed) model's
  parameters; ``jit_update`` compiles the update once for the static batch shape;
* a :class:`~gagar_jax.rl.collect.PackedBatch` ``[G, K, T]`` becomes an ``UpdateBatch``
  (group-major rows ``n = g * K + k``), validated on the host (``check_batch``) and sharded;
* checkpoints: the policy package's :class:`~gagar_jax.update.checkpoint.Checkpointer` (orbax,
  keep-N, the run config's fingerprint) saves the whole ``TrainState`` and the loop's
  :class:`~gagar_jax.rl.resume.LoopState` as two items of one checkpoint step (atomic: orbax
  lists a step only once both are written); restores go onto the live state's shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from gagar_jax.rl.collect import PackedBatch
from gagar_jax.rl.config import RunConfig
from gagar_jax.rl.resume import LOOP_STATE_KEY, LoopState


def to_update_batch(batch: PackedBatch):
    """``[G, K, T]`` packed rollouts -> the update's ``[N, T]`` group-major ``UpdateBatch``."""
    from gagar_jax.update.step import UpdateBatch

    G, K, T = batch.tokens.shape
    rows = lambda x: np.ascontiguousarray(x.reshape(G * K, T))
    return UpdateBatch(
        tokens=rows(batch.tokens), positions=rows(batch.positions),
        attention_mask=rows(batch.attention_mask), response_mask=rows(batch.response_mask),
        old_logprobs=rows(batch.old_logprobs), rewards=batch.rewards, passed=batch.passed,
        cheat=batch.cheat, tier=batch.tier, rank=batch.rank, valid=batch.valid,
        graded=batch.graded,
        evidence=None if batch.evidence is None else rows(batch.evidence))


def _model_device(model):
    """The device the (unsharded) policy model and the embedded sampler live on."""
    from flax import nnx

    leaf = jax.tree.leaves(nnx.state(model))[0]
    return next(iter(leaf.devices())) if hasattr(leaf, "devices") else jax.local_devices()[0]


_REPLICATE: dict = {}


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
    from jax.sharding import NamedSharding, PartitionSpec

    if device.process_index != jax.process_index():
        raise ValueError(f"local_params: {device} belongs to process {device.process_index}, "
                         f"this is process {jax.process_index()}")
    rep = NamedSharding(mesh, PartitionSpec())
    key = (rep, jax.tree.structure(params))
    fn = _REPLICATE.get(key)
    if fn is None:
        fn = _REPLICATE[key] = jax.jit(lambda p: p, out_shardings=rep)
    full = fn(params)

    def pick(x):
        for shard in x.addressable_shards:
            if shard.device == device:
                return shard.data
        # the sampler's device is outside the mesh: copy the local replica over (device to
        # device within this process)
        return jax.device_put(x.addressable_shards[0].data, device)

    return jax.tree.map(pick, full)


class RLState:
    """The sharded ``TrainState``, the jitted update and the checkpoint manager of one run."""

    def __init__(self, cfg: RunConfig, model, mesh, checkpointer):
        from flax import nnx

        from gagar_jax.update.state import create_train_state
        from gagar_jax.update.step import jit_update

        self.cfg = cfg
        self.model = model
        self.model_config = model.config
        self.mesh = mesh
        self.config = cfg.learner
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self.state = create_train_state(self.model_config, self.config, mesh, seed=cfg.seed,
                                        params=params)
        # Cited-token masks travel with every graded run, so every mode reports the share of
        # positive credit on evidence tokens (gagar_token's "evidence" importance reads them).
        self.update_fn = jit_update(self.model_config, self.config, mesh,
                                    with_evidence=cfg.grading.enabled)
        self.checkpointer = checkpointer

    @classmethod
    def create(cls, cfg: RunConfig, model, mesh, checkpointer) -> RLState:
        return cls(cfg, model, mesh, checkpointer)

    def update(self, batch: PackedBatch, *, step: int) -> dict[str, float]:
        """One update on ``batch``: this host's ``[G / P, K, T]`` rows, the global ``[G, K]``
        group fields (``P`` processes; one process: the whole batch)."""
        from gagar_jax.update.step import check_batch, shard_host_batch

        ub = to_update_batch(batch)
        if not self.cfg.grading.enabled:
            ub = ub._replace(evidence=None)
        ub = shard_host_batch(ub, self.mesh)
        check_batch(ub, self.config, self.mesh)
        self.state, metrics = self.update_fn(self.state, ub)
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if not np.isfinite(m["loss"]):
            raise FloatingPointError(f"non-finite loss {m['loss']} at RL step {step}")
        return m

    @property
    def trace_count(self) -> int:
        """Compiled variants of the update (1 for a whole run: the batch shape is static)."""
        return self.update_fn._cache_size()

    def params_for_sync(self):
        """The model's full nnx state with the current parameters (``Sampler.sync_weights``).

        The embedded sampler runs unsharded on this process's first local device, whatever the
        update's mesh; its copy comes device to device (:func:`local_params`), never through the
        host, so it works when the parameters span the devices of several processes.
        """
        from flax import nnx

        params = local_params(self.state.params, self.mesh, _model_device(self.model))
        state = nnx.state(self.model)
        nnx.replace_by_pure_dict(state, params)
        nnx.update(self.model, state)
        return state

    def save(self, step: int, loop_state: LoopState) -> None:
        """Checkpoint ``step``: the train state and ``loop_state``, one orbax step (waited on)."""
        self.checkpointer.save(step, self.state, data_position=loop_state.data_position,
                               extra={LOOP_STATE_KEY: dataclasses.asdict(loop_state)},
                               wait=True)

    def restore(self, step: int | None = None) -> tuple[int, LoopState]:
        """Restores checkpoint ``step`` (None: the newest intact one); returns its step and loop
        state. Raises ``ConfigMismatchError`` for a checkpoint of another run config."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        self.state, info = self.checkpointer.restore(abstract, step)
        self.params_for_sync()
        return info.step, LoopState.from_dict(info.extra[LOOP_STATE_KEY])
