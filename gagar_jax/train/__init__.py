"""Training: update config, train state, mesh, the jitted sharded update, checkpoints."""

from gagar_jax.train.checkpoint import Checkpointer, ResumeInfo, abstract_train_state
from gagar_jax.train.state import (
    MESH_AXES,
    TrainState,
    UpdateConfig,
    config_fingerprint,
    create_train_state,
    learning_rate_schedule,
    make_mesh,
    make_optimizer,
    state_shardings,
)
from gagar_jax.train.update import (
    UpdateBatch,
    batch_shardings,
    check_batch,
    jit_update,
    shard_batch,
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
