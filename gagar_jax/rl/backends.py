"""Builds the loop's collaborators from the config: policy (+update, checkpoints), engine, grader.

This is the only module of the loop that knows the other packages' constructors; the loop itself
talks to three small surfaces:

* :class:`Policy`: ``run_sft``, ``update(batch, step) -> metrics``, ``params_for_sync``,
  ``checkpoint_steps / save / restore / close``.
* the rollout engine (``gagar_jax.rollout`` ``RolloutEngine``): ``generate``, ``sync_weights``.
* the grading pool (``gagar_jax.grading.GradingPool``): ``submit``, ``results``, ``close``; its
  verdict cache persists in the workdir (the grader cache of a resumed run).
"""

from __future__ import annotations

import os

import jax
import numpy as np

from gagar_jax.rl.collect import PackedBatch
from gagar_jax.rl.config import RunConfig


def transformer_config(cfg: RunConfig, vocab_size: int):
    from gagar_jax.models import TransformerConfig

    m = cfg.model
    return TransformerConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
        num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        intermediate_size=m.intermediate_size, rope_theta=m.rope_theta,
        rms_norm_eps=m.rms_norm_eps, qkv_bias=m.qkv_bias, tie_embeddings=m.tie_embeddings,
        dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat)


def mesh_shape(shape: tuple[int, int, int], num_devices: int) -> tuple[int, int, int]:
    """Resolves a -1 axis; raises naming ``mesh.shape`` when the devices do not factor."""
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh.shape={shape}: {num_devices} devices not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if int(np.prod(shape)) != num_devices:
        raise ValueError(f"mesh.shape={shape} needs {int(np.prod(shape))} devices, "
                         f"{num_devices} available")
    return shape


def make_mesh(cfg: RunConfig):
    devices = jax.devices()
    shape = mesh_shape(tuple(cfg.mesh.shape), len(devices))
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), ("data", "fsdp", "tensor"))


class Policy:
    """The policy model, its RL train state and checkpoints (``gagar_jax.models``/``train``)."""

    def __init__(self, cfg: RunConfig, *, vocab_size: int, workdir: str):
        from flax import nnx

        from gagar_jax.models import Transformer

        self.cfg = cfg
        self.workdir = workdir
        if cfg.model.hf_checkpoint:
            from gagar_jax.models import load_hf_safetensors

            self.model_config, self.model = load_hf_safetensors(cfg.model.hf_checkpoint)
            if self.model_config.vocab_size < vocab_size:
                raise ValueError(f"model.hf_checkpoint vocab {self.model_config.vocab_size} < "
                                 f"tokenizer vocab {vocab_size}")
        else:
            self.model_config = transformer_config(cfg, vocab_size)
            self.model = Transformer(self.model_config, rngs=nnx.Rngs(cfg.seed))
        self.mesh = make_mesh(cfg)
        self._rl = None  # created after the SFT warm start (see _rl_state)
        self._ckpt_dir = os.path.join(workdir, "checkpoints")

    # -- SFT --------------------------------------------------------------------------------
    def run_sft(self, demos, *, pad_id: int, log_fn=None):
        from gagar_jax.update import sft

        if self._rl is not None:
            raise RuntimeError("run_sft after the RL state exists")
        return sft.run_sft(
            self.model, demos, steps=self.cfg.sft.steps, batch_size=self.cfg.sft.batch_size,
            lr=self.cfg.sft.lr, warmup_steps=self.cfg.sft.warmup_steps,
            seq_len=self.cfg.rollout.seq_len, pad_id=pad_id, seed=self.cfg.seed,
            log_fn=log_fn)

    # -- RL ---------------------------------------------------------------------------------
    def _rl_state(self):
        if self._rl is None:
            from gagar_jax.rl import rl_adapter

            self._rl = rl_adapter.RLState.create(self.cfg, self.model, self.mesh,
                                                 self._ckpt_dir)
        return self._rl

    def update(self, batch: PackedBatch, *, step: int) -> dict[str, float]:
        return self._rl_state().update(batch, step=step)

    def update_traces(self) -> int | None:
        """How many times the update compiled in this process (None before the RL state)."""
        return None if self._rl is None else self._rl.trace_count

    def params_for_sync(self):
        """What the engine's ``sync_weights`` takes: for the embedded sampler the model's nnx
        state (a full copy on this host's device, made device to device); for SGLang the
        sharded parameters themselves (pure dict), exported tensor by tensor."""
        if self.cfg.rollout.engine == "sglang":
            return self._rl_state().state.params
        return self._rl_state().params_for_sync()

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint_steps(self) -> list[int]:
        from gagar_jax.rl import rl_adapter

        return rl_adapter.finished_checkpoint_steps(self._ckpt_dir)

    def save(self, step: int) -> None:
        self._rl_state().save(step)

    def restore(self, step: int) -> None:
        self._rl_state().restore(step)

    def close(self) -> None:
        if self._rl is not None:
            self._rl.close()


def build_policy(cfg: RunConfig, *, vocab_size: int, workdir: str) -> Policy:
    return Policy(cfg, vocab_size=vocab_size, workdir=workdir)


def build_engine(cfg: RunConfig, policy: Policy, *, workdir: str, pad_id: int = 0,
                 hosts=None):
    """The embedded sampler over the policy model (``pad_id``: the tokenizer's), or an SGLang
    engine (health-checked; ``hosts``: see :func:`build_sglang_engine`)."""
    if cfg.rollout.engine == "embedded":
        from gagar_jax.rollout.sampler import Sampler

        return Sampler(policy.model, pad_id=pad_id, seed=cfg.seed)
    return build_sglang_engine(cfg, policy, workdir=workdir, hosts=hosts)


def build_sglang_engine(cfg: RunConfig, policy: Policy, *, workdir: str, hosts=None):
    """``gagar_jax.rollout.SGLangEngine`` on ``rollout.sglang_url`` (health-checked): weights
    exported as HF safetensors to ``workdir/sync/v<version>`` and loaded with the engine's sync
    protocol (pause, drain, atomic export, update, version check, flush, resume, rollback on
    failure).

    Several hosts (``hosts``, the loop's :class:`~gagar_jax.train.multihost.Hosts`): process
    ``rollout.weight_writer`` writes the export and drives ``/update_weights_from_disk``; every
    host takes part in the streamed export's gathers; the others wait (``hosts.allgather``)
    for the writer's outcome and then for the servers to report the new version before they
    sample again; a failure anywhere is the same ``WeightSyncError`` on every host.

    A dead server is a clear error here (naming the URL) or, mid-run, the client's error after
    its retries (the loop names the step); never a hang: every request has
    ``rollout.request_timeout_s``.
    """
    from flax import nnx

    from gagar_jax.models import save_hf_safetensors_streaming
    from gagar_jax.rollout import SGLangClient
    from gagar_jax.rollout.sglang_engine import SGLangEngine

    count, index = (1, 0) if hosts is None else (hosts.count, hosts.index)
    if not 0 <= cfg.rollout.weight_writer < count:
        raise ValueError(f"rollout.weight_writer={cfg.rollout.weight_writer} is not a process "
                         f"index of this run ({count} process(es))")
    writer = index == cfg.rollout.weight_writer
    url = cfg.rollout.sglang_url
    client = SGLangClient(url, request_timeout_s=cfg.rollout.request_timeout_s,
                          max_retry_time_s=cfg.rollout.request_timeout_s)
    if not client.health():
        raise RuntimeError(f"SGLang rollout server at {url} (rollout.sglang_url) does "
                           "not answer GET /health: start it (scripts/launch_sglang.sh) or "
                           "use rollout.engine='embedded'")

    def export(params, directory):
        # ``params``: the sharded train-state parameters (Policy.params_for_sync). Streamed
        # tensor by tensor: every host takes part in each gather, the weight writer writes; no
        # host ever holds the whole model.
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        if isinstance(params, nnx.State):
            params = nnx.to_pure_dict(params)
        save_hf_safetensors_streaming(params, policy.model_config, directory, writer=writer)

    return SGLangEngine(client, export_fn=export, sync_dir=os.path.join(workdir, "sync"),
                        writer=writer, exchange=None if count == 1 else hosts.allgather,
                        version_timeout_s=cfg.mesh.host_timeout_s)


def build_grading_pool(cfg: RunConfig, *, cache_path: str | None = None, grader=None,
                       check_runner=None):
    """The grading pool with the configured grader (or ``grader`` when given).

    ``check_runner``: the task family's targeted-check runner for the agentic grader.

    ``cache_path``: the pool's persisted verdict cache (JSON lines, reloaded at start), so a
    resumed run does not re-grade groups it already graded.
    """
    from gagar_jax.grading.heuristic import HeuristicGrader
    from gagar_jax.grading.pool import GradingPool

    if grader is not None:
        pass
    elif cfg.grading.grader == "heuristic":
        grader = HeuristicGrader()
    else:
        from gagar_jax.grading import AgenticGrader
        from gagar_jax.rollout import SGLangClient

        # An unreachable grader server is not fatal: each group falls back (grader_error or
        # deadline, counted) and training continues on the original advantages.
        grader = AgenticGrader(SGLangClient(cfg.grading.sglang_url), check_runner=check_runner)
    return GradingPool(grader, max_concurrency=cfg.grading.max_concurrency,
                       deadline_s=cfg.grading.deadline_s, cache=cache_path)
