"""The RL train state behind :class:`~gagar_jax.rl.backends.Policy`, on the sharded update.

Wires the loop to the policy-update package (``gagar_jax.update.state`` / ``update``):

* :func:`update_config` maps the run config to its ``UpdateConfig`` (optimiser, PPO-clip,
  geometry, and the ``GagarConfig`` whose ``mode`` the training mode chooses);
* the train state is created already sharded on the run's mesh from the (SFT-warmed) model's
  parameters; ``jit_update`` compiles the update once for the static batch shape;
* a :class:`~gagar_jax.rl.collect.PackedBatch` ``[G, K, T]`` becomes an ``UpdateBatch``
  (group-major rows ``n = g * K + k``), validated on the host (``check_batch``) and sharded;
* checkpoints: the policy package's :class:`~gagar_jax.update.checkpoint.Checkpointer` (orbax,
  keep-N, config fingerprint) saves the whole ``TrainState``, waited on before the loop writes
  its bookkeeping, so a listed step is always complete; restores go onto the live state's
  shardings.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from gagar_jax.rl.collect import PackedBatch
from gagar_jax.rl.config import RunConfig


def finished_checkpoint_steps(directory: str) -> list[int]:
    """Steps with a complete checkpoint (orbax renames ``<step>.orbax-checkpoint-tmp-*`` to
    ``<step>`` only when the write is finished)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def update_config(cfg: RunConfig):
    """The policy update's ``UpdateConfig`` for this run."""
    from gagar_jax.update.state import UpdateConfig

    o = cfg.optim
    return UpdateConfig(
        learning_rate=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(cfg.loop.total_steps * o.ppo_epochs * o.num_minibatches, 1),
        schedule=o.schedule, end_lr_ratio=o.end_lr_ratio, weight_decay=o.weight_decay,
        b1=o.b1, b2=o.b2, max_grad_norm=o.grad_clip, clip_low=o.clip_low,
        clip_high=o.clip_high, dual_clip=o.dual_clip or None, aggregation=o.loss_agg,
        kl_coef=o.kl_coef, entropy_coef=o.entropy_coef, temperature=cfg.rollout.temperature,
        num_minibatches=o.num_minibatches,
        num_microbatches=o.num_microbatches, ppo_epochs=o.ppo_epochs,
        advantages=cfg.gagar_config(), token_credit=cfg.token_credit,
        token_gamma=cfg.advantages.token_gamma)


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

    def __init__(self, cfg: RunConfig, model, mesh, ckpt_dir: str):
        from flax import nnx

        from gagar_jax.update.checkpoint import Checkpointer
        from gagar_jax.update.state import create_train_state
        from gagar_jax.update.step import jit_update

        self.cfg = cfg
        self.model = model
        self.model_config = model.config
        self.mesh = mesh
        self.config = update_config(cfg)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self.state = create_train_state(self.model_config, self.config, mesh, seed=cfg.seed,
                                        params=params)
        # Cited-token masks travel with every graded run, so every mode reports the share of
        # positive credit on evidence tokens (gagar_token's "evidence" importance reads them).
        self.update_fn = jit_update(self.model_config, self.config, mesh,
                                    with_evidence=cfg.grading.enabled)
        self.checkpointer = Checkpointer(ckpt_dir, model_config=self.model_config,
                                         update_config=self.config,
                                         keep=cfg.loop.keep_checkpoints + 1)

    @classmethod
    def create(cls, cfg: RunConfig, model, mesh, ckpt_dir: str) -> RLState:
        return cls(cfg, model, mesh, ckpt_dir)

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

    def save(self, step: int) -> None:
        self.checkpointer.save(step, self.state, wait=True)

    def restore(self, step: int) -> None:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        self.state, _ = self.checkpointer.restore(abstract, step)
        self.params_for_sync()

    def close(self) -> None:
        self.checkpointer.close()
