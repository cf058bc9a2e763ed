"""Backward-compatible alias of :mod:`gagar_jax.update` (the update library's old name).

``gagar_jax.train`` once held both the update library and the RL loop. They are now two
packages: :mod:`gagar_jax.update` (train state, optimizer, mesh, the jitted update, checkpoints,
SFT) and :mod:`gagar_jax.rl` (run config, the loop, collection, resume, metrics writers). This
module re-exports the public names it exported before, so ``from gagar_jax.train import
UpdateConfig, jit_update`` keeps working; it has no submodules (``gagar_jax.train.loop`` is now
``gagar_jax.rl.train``, ``gagar_jax.train.update`` is ``gagar_jax.update.step``). New code
imports :mod:`gagar_jax.update`.
"""

from gagar_jax.update import (
    MESH_AXES,
    Checkpointer,
    ResumeInfo,
    TrainState,
    UpdateBatch,
    UpdateConfig,
    abstract_train_state,
    batch_shardings,
    check_batch,
    config_fingerprint,
    create_train_state,
    jit_update,
    learning_rate_schedule,
    make_mesh,
    make_optimizer,
    shard_batch,
    state_shardings,
    update_step,
)

__all__ = [
    "MESH_AXES",
    "Checkpointer",
    "ResumeInfo",
    "abstract_train_state",
    "TrainState",
    "UpdateBatch",
    "UpdateConfig",
    "batch_shardings",
    "check_batch",
    "config_fingerprint",
    "create_train_state",
    "jit_update",
    "learning_rate_schedule",
    "make_mesh",
    "make_optimizer",
    "shard_batch",
    "state_shardings",
    "update_step",
]
