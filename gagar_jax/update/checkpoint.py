"""Orbax checkpoints of the train state with everything needed to resume.

A checkpoint at step ``s`` holds two items:

- ``state``: the whole :class:`~gagar_jax.update.TrainState` (params, optimizer state, update
  count, RNG key), saved asynchronously by orbax from the sharded arrays and restored directly
  into a sharded abstract state (any mesh: orbax reshards on read);
- ``meta``: JSON with the data position (whatever the loop needs to continue its input stream,
  e.g. a task-pool cursor and sampler seed), the config fingerprint, and free-form extras.

Restoring a checkpoint written under a different model/update config raises a ``ValueError``
naming both fingerprints (``allow_config_change=True`` overrides, e.g. to change the learning
rate deliberately).

Integrity: ``meta`` also holds a SHA-256 of every array of the state (dtype, shape and bytes of
the global value), computed from the state being saved, in the same save. A restore recomputes
them from what it read: a mismatch, or data orbax cannot read, makes that checkpoint corrupt.
``restore()`` of the latest then falls back to the previous complete checkpoint, logging which
step was skipped and why; ``restore(step=s)`` and a directory with no intact checkpoint raise
``CheckpointCorruptError`` naming the step(s). Checkpoints without checksums (older ones) are
restored unchecked. Arrays not fully addressable by this process (multi-host) are not summed.

LoRA (``model.lora_rank > 0``): a step holds the adapters and their optimizer state only, and
``meta`` the base's identity (``lora_base_hash``, :func:`gagar_jax.models.lora.base_hash`). The
base itself is written once per checkpoint directory (``lora_base/``: Hugging Face safetensors
and the hash), so a run warmed by SFT resumes without it; ``restore(base_params=...)`` takes the
base from the caller instead. A base whose hash differs from the checkpoint's is refused
(:class:`ConfigMismatchError` naming both hashes): adapters trained on one base are not applied
to another.

Preemption (SIGTERM) is the training loop's business, not this class's: the RL loop
(``gagar_jax.rl.train``) sets a flag on SIGTERM and saves at the next step boundary, where the
state is whole and every host can take part in the (collective) save. A save from inside a
signal handler could meet donated buffers, a half-finished collective or a grading thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from gagar_jax.models import TransformerConfig
from gagar_jax.models import lora as lora_lib
from gagar_jax.update.state import TrainState, UpdateConfig, config_fingerprint, state_shardings

log = logging.getLogger(__name__)


class ConfigMismatchError(ValueError):
    """The checkpoint was written under another config (its fingerprint differs)."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint whose data does not match its checksums or cannot be read."""


def array_checksums(state: Any) -> dict[str, str]:
    """``{key path: sha256 hex}`` of every fully addressable array leaf of ``state``."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            continue
        a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


@dataclasses.dataclass(frozen=True)
class ResumeInfo:
    step: int  # checkpoint step (the loop's step counter when saved)
    data_position: Any  # JSON value saved with the checkpoint
    fingerprint: str
    extra: dict


def abstract_train_state(model_config: TransformerConfig, config: UpdateConfig, mesh):
    """``TrainState`` of ``jax.ShapeDtypeStruct`` carrying the target shardings on ``mesh``."""
    abstract, shardings = state_shardings(model_config, config, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` (async saves, keep-N) with resume metadata.

    Args:
      directory: checkpoint root (created).
      model_config, update_config: fingerprinted into every checkpoint.
      fingerprint: the fingerprint to store and compare instead (an experiment's own, e.g.
        ``RunConfig.fingerprint()``, which covers these configs and more).
      keep: number of most recent checkpoints kept.
      async_save: orbax asynchronous checkpointing (the save returns once arrays are copied
        to host; writing continues in the background).
    """

    def __init__(
        self,
        directory: str,
        *,
        model_config: TransformerConfig,
        update_config: UpdateConfig,
        keep: int = 3,
        async_save: bool = True,
        fingerprint: str | None = None,
    ):
        if keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self.model_config = model_config
        self.update_config = update_config
        self.fingerprint = fingerprint or config_fingerprint(model_config, update_config)
        self._base_hash: str | None = None  # LoRA: the base's hash, computed once
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=async_save
            ),
        )

    # -- saving ----------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: TrainState,
        *,
        data_position: Any = None,
        extra: dict | None = None,
        wait: bool = False,
    ) -> None:
        """Saves ``state`` and resume metadata as checkpoint ``step`` (async unless ``wait``)."""
        meta = {
            "data_position": data_position,
            "fingerprint": self.fingerprint,
            "extra": extra or {},
        }
        if self.model_config.lora_rank:
            adapters, base = lora_lib.split_adapters(state.params)
            meta["lora_base_hash"] = self._save_base(base)
            state = state._replace(params=adapters)
        meta["checksums"] = array_checksums(state)
        self.manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        if wait:
            self.manager.wait_until_finished()

    @property
    def base_dir(self) -> str:
        """Where a LoRA run's base is written once (Hugging Face safetensors + ``hash``)."""
        return os.path.join(self.directory, "lora_base")

    def _save_base(self, base: dict) -> str:
        """The base's hash; the base written to :attr:`base_dir` unless it is there already
        under this hash (every process takes part in the gathers, process 0 writes)."""
        from gagar_jax.models import save_hf_safetensors_streaming

        if self._base_hash is None:
            self._base_hash = lora_lib.base_hash(base)
        path = os.path.join(self.base_dir, "hash")
        if os.path.exists(path):
            with open(path) as f:
                if f.read().strip() == self._base_hash:
                    return self._base_hash
        save_hf_safetensors_streaming(base, self.model_config, self.base_dir)
        if jax.process_index() == 0:
            with open(path + ".tmp", "w") as f:
                f.write(self._base_hash)
            os.replace(path + ".tmp", path)
        return self._base_hash

    def _load_base(self) -> dict:
        from gagar_jax.models import load_hf_safetensors

        if not os.path.exists(os.path.join(self.base_dir, "hash")):
            raise FileNotFoundError(
                f"LoRA checkpoint {self.directory} has no base in {self.base_dir}: pass "
                "base_params to restore"
            )
        fields = ("dtype", "param_dtype", "scan_layers", "remat", "remat_policy")
        _, model = load_hf_safetensors(
            self.base_dir, **{k: getattr(self.model_config, k) for k in fields}
        )
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def _with_base(self, adapters, full_abstract, meta, base_params, step) -> dict:
        """The restored ``adapters`` on the base (``base_params`` or :attr:`base_dir`'s), placed
        on ``full_abstract``'s shardings; the base's hash must be the checkpoint's."""
        base = base_params if base_params is not None else self._load_base()
        base = lora_lib.split_adapters(base)[1]
        got = lora_lib.base_hash(base)
        if got != meta["lora_base_hash"]:
            raise ConfigMismatchError(
                f"checkpoint {self.directory} step {step} holds LoRA adapters trained on the "
                f"base with hash {meta['lora_base_hash']}, but the base given has hash {got}; "
                "refusing to apply them to another base"
            )
        self._base_hash = got
        base_abstract = lora_lib.split_adapters(full_abstract.params)[1]
        base = jax.device_put(base, jax.tree.map(lambda a: a.sharding, base_abstract))
        return lora_lib.combine(base, adapters)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    # -- restoring ---------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(
        self,
        abstract_state: TrainState,
        step: int | None = None,
        *,
        allow_config_change: bool = False,
        base_params: dict | None = None,
    ) -> tuple[TrainState, ResumeInfo]:
        """Restores ``step`` (default: the latest) into ``abstract_state``'s shardings.

        Args:
          abstract_state: from :func:`abstract_train_state` (shapes, dtypes, shardings).
          step: which checkpoint; ``None`` for the latest.
          allow_config_change: restore despite a different config fingerprint.
          base_params: LoRA only: the base the adapters go on (a pure dict; adapters in it are
            ignored), checked against the checkpoint's base hash; None: the base this
            directory holds (:attr:`base_dir`).
        Raises:
          FileNotFoundError when there is no checkpoint; ValueError on a fingerprint mismatch;
          CheckpointCorruptError when ``step`` (or, for the latest, every checkpoint) is corrupt.
        """
        self.manager.wait_until_finished()
        if step is not None:
            return self._restore_step(abstract_state, int(step), allow_config_change, base_params)
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        problems = []
        for s in steps:
            try:
                return self._restore_step(abstract_state, s, allow_config_change, base_params)
            except CheckpointCorruptError as e:
                problems.append(str(e))
                log.error(
                    "checkpoint %s step %d is corrupt (%s); falling back to the previous "
                    "complete checkpoint",
                    self.directory,
                    s,
                    e,
                )
        raise CheckpointCorruptError(
            f"no intact checkpoint in {self.directory}: " + "; ".join(problems)
        )

    def _restore_step(
        self, abstract_state: TrainState, step: int, allow_config_change: bool, base_params=None
    ) -> tuple[TrainState, ResumeInfo]:
        if step not in self.all_steps():
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory}")
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
            if not isinstance(meta, dict) or "fingerprint" not in meta:
                raise ValueError(f"metadata is {type(meta).__name__} without a fingerprint")
        except Exception as e:  # noqa: BLE001 - unreadable metadata: this checkpoint is corrupt
            raise CheckpointCorruptError(
                f"step {step}: metadata unreadable: {type(e).__name__}: {e}"[:500]
            ) from e
        if meta["fingerprint"] != self.fingerprint and not allow_config_change:
            raise ConfigMismatchError(
                f"checkpoint {self.directory} step {step} was written with config fingerprint "
                f"{meta['fingerprint']}, but the current model/update config has "
                f"{self.fingerprint}; refusing to restore a mismatched state (pass "
                "allow_config_change=True to override)"
            )
        lora = bool(self.model_config.lora_rank) and "lora_base_hash" in meta
        full_abstract = abstract_state
        if lora:
            abstract_state = abstract_state._replace(
                params=lora_lib.split_adapters(abstract_state.params)[0]
            )
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )["state"]
        except Exception as e:  # noqa: BLE001 - data orbax cannot decode: corrupt
            raise CheckpointCorruptError(
                f"step {step}: state unreadable: {type(e).__name__}: {e}"[:500]
            ) from e
        kind = type(abstract_state)  # TrainState, or another NamedTuple state (feedback)
        state = restored if isinstance(restored, kind) else kind(*restored)
        saved = meta.get("checksums")
        if saved:
            got = array_checksums(state)
            bad = sorted(k for k in saved if got.get(k) != saved[k])
            if bad:
                raise CheckpointCorruptError(
                    f"step {step}: checksum mismatch in {len(bad)} array(s): {', '.join(bad[:3])}"
                )
        if lora:
            state = state._replace(
                params=self._with_base(state.params, full_abstract, meta, base_params, step)
            )
        return state, ResumeInfo(
            step=step,
            data_position=meta["data_position"],
            fingerprint=meta["fingerprint"],
            extra=meta.get("extra", {}),
        )
