"""Resume bookkeeping: what, besides the train state, a killed run needs to continue exactly.

* :class:`TaskStream`: the training prompts as a deterministic function of a position (epoch-wise
  permutations of the pool), so the data position is one integer and a resumed run neither
  repeats nor skips a prompt.
* :class:`LoopState`: the next step, data position, base RNG key, policy version, whether the
  SFT warm start is done and the grader cache. It is saved as an item of the same orbax
  checkpoint step as the train state (the ``meta`` JSON item of
  :class:`~gagar_jax.update.Checkpointer`, key ``loop_state``): one atomic step with one
  fingerprint, written once however many hosts save the state, so a killed run resumes from a
  consistent pair without any scanning of its own (orbax lists only finished steps).

Per-step randomness is ``fold_in(base_key, step)``: nothing random is carried from step to step,
so a resumed step draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np
import orbax.checkpoint as ocp


class TaskStream:
    """Position -> task index over a pool of ``num_tasks``, reshuffled every epoch.

    ``index(p)`` is the ``p % n``-th element of the permutation for epoch ``p // n``
    (seeded by ``(seed, epoch)``), so any position can be computed without replaying the stream.
    """

    def __init__(self, num_tasks: int, seed: int):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        self.num_tasks = num_tasks
        self.seed = seed
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.num_tasks)
            self._perm_cache = {epoch: perm}  # keep one epoch: positions only move forward
        return perm

    def index(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        epoch, offset = divmod(position, self.num_tasks)
        return int(self._perm(epoch)[offset])

    def take(self, position: int, n: int) -> tuple[list[int], int]:
        """The next ``n`` task indices from ``position`` and the new position."""
        return [self.index(position + i) for i in range(n)], position + n


@dataclasses.dataclass
class LoopState:
    """Host-side state of the training loop, saved next to each checkpoint."""

    step: int = 0  # the next RL step to run
    data_position: int = 0  # tasks consumed from the TaskStream
    rng_key: list[int] = dataclasses.field(default_factory=list)  # base key data (uint32 words)
    policy_version: int = 0  # weight syncs done (the sampler's version)
    sft_done: bool = False
    grader_cache: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LoopState:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"loop state has unknown fields {unknown}")
        return cls(**data)


LOOP_STATE_KEY = "loop_state"  # the LoopState's key in the checkpoint's ``meta`` item


def read_loop_state(checkpoint_dir: str, step: int) -> LoopState:
    """The :class:`LoopState` saved with checkpoint ``step`` in ``checkpoint_dir`` (reads only
    the step's JSON item, never the arrays; for tools and tests)."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(os.path.abspath(checkpoint_dir), options=options) as manager:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return LoopState.from_dict(meta["extra"][LOOP_STATE_KEY])
