"""The update library: update config, train state, optimizer, mesh, the jitted sharded update,
checkpoints and the SFT step.

It imports only ``models``, ``losses`` and ``advantages`` (never ``envs``, ``grading`` or
``rollout``); the RL experiment that drives it lives in :mod:`gagar_jax.rl`.

Modules: ``state`` (``UpdateConfig``, ``TrainState``, optimizer, mesh, shardings, fingerprint),
``step`` (``UpdateBatch``, ``update_step``, ``jit_update``, ``shard_batch``), ``checkpoint``
(``Checkpointer``, orbax), ``sft`` (the supervised warm start), ``alignment`` (behaviour
log-probs by the update's own program: ``rollout.bitwise_onpolicy``), ``mismatch`` (the
train/rollout mismatch metrics).
"""

from gagar_jax.update.alignment import behaviour_logprobs, jit_behaviour_logprobs
from gagar_jax.update.checkpoint import Checkpointer, ResumeInfo, abstract_train_state
from gagar_jax.update.state import (
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
from gagar_jax.update.step import (
    UpdateBatch,
    batch_shardings,
    check_batch,
    jit_update,
    shard_batch,
    shard_host_batch,
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
    "behaviour_logprobs",
    "jit_behaviour_logprobs",
    "check_batch",
    "config_fingerprint",
    "create_train_state",
    "jit_update",
    "learning_rate_schedule",
    "make_mesh",
    "make_optimizer",
    "shard_batch",
    "shard_host_batch",
    "state_shardings",
    "update_step",
]
