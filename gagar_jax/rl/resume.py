"""Resume bookkeeping: what, besides the train state, a killed run needs to continue exactly.

* :class:`TaskStream`: the training prompts as a deterministic function of a position (epoch-wise
  permutations of the pool), so the data position is one integer and a resumed run neither
  repeats nor skips a prompt.
* :class:`LoopState`: the next step, data position, base RNG key, policy version, whether the
  SFT warm start is done, the grader cache and the config fingerprint.
* :class:`ResumeStore`: one JSON file per checkpointed step, written atomically (tmp + rename)
  *after* the train-state checkpoint of that step is finished, so the newest step that has both
  is always a consistent pair, whenever the process is killed.

Per-step randomness is ``fold_in(base_key, step)``: nothing random is carried from step to step,
so a resumed step draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np


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
    fingerprint: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LoopState:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"loop state has unknown fields {unknown}")
        return cls(**data)


class ResumeStore:
    """``dir/loop_state_<step>.json`` files; ``step`` is the checkpoint step they belong to."""

    PREFIX = "loop_state_"

    def __init__(self, directory: str):
        self.directory = directory

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.PREFIX}{step:08d}.json")

    def save(self, step: int, state: LoopState, *, keep: int | None = None) -> str:
        os.makedirs(self.directory, exist_ok=True)
        path = self.path(step)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(state.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if keep is not None:
            for old in self.steps()[:-keep]:
                os.remove(self.path(old))
        return path

    def steps(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            if name.startswith(self.PREFIX) and name.endswith(".json"):
                try:
                    out.append(int(name[len(self.PREFIX):-len(".json")]))
                except ValueError:
                    continue
        return sorted(out)

    def load(self, step: int) -> LoopState:
        with open(self.path(step), encoding="utf-8") as f:
            return LoopState.from_json(f.read())

    def latest_consistent(self, checkpoint_steps: Iterable[int]) -> int | None:
        """Newest step that has both a finished train-state checkpoint and a loop state."""
        both = set(self.steps()) & {int(s) for s in checkpoint_steps}
        return max(both) if both else None
