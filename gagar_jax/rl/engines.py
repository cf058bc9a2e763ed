"""The rollout engine and the grading pool of a run, built from its config.

* :func:`build_engine`: the embedded JAX sampler over the policy model, or an SGLang server
  (``gagar_jax.rollout.SGLangEngine``: versioned weight sync by its protocol);
* :func:`build_grading_pool`: the configured grader behind ``gagar_jax.grading.GradingPool``
  (async, deadline, fallback; its verdict cache persists in the workdir).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from gagar_jax.grading import AgenticGrader
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.pool import GradingPool
from gagar_jax.models import lora, save_hf_safetensors_streaming
from gagar_jax.rl.config import RunConfig
from gagar_jax.rollout import SGLangClient
from gagar_jax.rollout.sampler import Sampler
from gagar_jax.rollout.sglang_engine import SGLangEngine
from gagar_jax.rollout.weight_sync import SGLangLoraSync


def build_engine(cfg: RunConfig, model, *, workdir: str, pad_id: int, hosts=None):
    """The embedded sampler over ``model`` (its own copy of the weights from then on;
    ``pad_id``: the tokenizer's; its rows split over ``rollout.embedded_data_parallel`` of
    this process's devices, see :func:`sampler_mesh`; in ``rollout.precision``; recording
    mixture-of-experts routes with ``learner.routing_replay`` or ``learner.mismatch_metrics``),
    or an SGLang engine (health-checked; its client recording the server's routes with
    ``learner.routing_replay``: :func:`sglang_record_routes`; ``hosts``: see
    :func:`build_sglang_engine`)."""
    if cfg.rollout.engine == "embedded":
        return Sampler(
            model,
            pad_id=pad_id,
            seed=cfg.seed,
            mesh=sampler_mesh(cfg.rollout.embedded_data_parallel),
            precision=cfg.rollout.precision,
            kv_cache_dtype=cfg.rollout.kv_cache_dtype,
            # a mixture of experts records each token's experts for routing replay and the
            # route-mismatch metrics
            record_routes=cfg.learner.routing_replay or cfg.learner.mismatch_metrics,
        )
    return build_sglang_engine(cfg, model.config, workdir=workdir, hosts=hosts)


def sampler_mesh(devices: int):
    """The embedded sampler's data mesh: this process's first ``devices`` devices (0: all of
    them) on the axis ``"data"``, or None for one device (the sampler's plain path)."""
    local = jax.local_devices()
    n = len(local) if devices == 0 else devices
    if n > len(local):
        raise ValueError(
            f"rollout.embedded_data_parallel={devices}: this process has {len(local)} devices"
        )
    if n == 1:
        return None
    return jax.sharding.Mesh(np.array(local[:n]), ("data",))


def sglang_record_routes(cfg: RunConfig, model_config):
    """What the SGLang client records for routing replay: a mixture of experts' ``(layers,
    experts_per_token, num_experts)`` with ``learner.routing_replay`` (the server must run with
    ``--enable-return-routed-experts``: the client's first request says so otherwise), else
    None (the route-mismatch metrics alone do not ask a server for routes)."""
    if not (cfg.learner.routing_replay and model_config.num_experts > 0):
        return None
    c = model_config
    return (c.num_layers, c.num_experts_per_tok, c.num_experts)


def build_sglang_engine(cfg: RunConfig, model_config, *, workdir: str, hosts=None):
    """``gagar_jax.rollout.SGLangEngine`` on ``rollout.sglang_url`` (health-checked): weights
    exported as HF safetensors to ``workdir/sync/v<version>`` and loaded with the engine's sync
    protocol (pause, drain, atomic export, update, version check, flush, resume, rollback on
    failure).

    Several hosts (``hosts``, the loop's :class:`~gagar_jax.rl.multihost.Hosts`): process
    ``rollout.weight_writer`` writes the export and drives ``/update_weights_from_disk``; every
    host takes part in the streamed export's gathers; the others wait (``hosts.allgather``)
    for the writer's outcome and then for the servers to report the new version before they
    sample again; a failure anywhere is the same ``WeightSyncError`` on every host.

    A dead server is a clear error here (naming the URL) or, mid-run, the client's error after
    its retries (the loop names the step); never a hang: every request has
    ``rollout.request_timeout_s``.
    """
    count, index = (1, 0) if hosts is None else (hosts.count, hosts.index)
    if not 0 <= cfg.rollout.weight_writer < count:
        raise ValueError(
            f"rollout.weight_writer={cfg.rollout.weight_writer} is not a process "
            f"index of this run ({count} process(es))"
        )
    writer = index == cfg.rollout.weight_writer
    url = cfg.rollout.sglang_url
    client = SGLangClient(
        url,
        request_timeout_s=cfg.rollout.request_timeout_s,
        max_retry_time_s=cfg.rollout.request_timeout_s,
        record_routes=sglang_record_routes(cfg, model_config),
    )
    if not client.health():
        raise RuntimeError(
            f"SGLang rollout server at {url} (rollout.sglang_url) does "
            "not answer GET /health: start it (scripts/launch_sglang.sh) or "
            "use rollout.engine='embedded'"
        )

    def export(params, directory):
        # ``params``: the sharded train-state parameters (policy.sync_engine). Streamed
        # tensor by tensor: every host takes part in each gather, the weight writer writes; no
        # host ever holds the whole model.
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        if isinstance(params, nnx.State):
            params = nnx.to_pure_dict(params)
        if model_config.lora_rank:  # a whole-weights export of a LoRA policy: merged
            params = lora.merged_params(params, model_config)
        save_hf_safetensors_streaming(params, model_config, directory, writer=writer)

    if model_config.lora_rank and cfg.rollout.sglang_lora:
        # the server serves the base (e.g. <workdir>/checkpoints/lora_base, which the run's
        # checkpointer writes) with --enable-lora; each sync loads the new adapter
        return SGLangLoraSync(client, model_config, os.path.join(workdir, "sync"), writer=writer)
    engine = SGLangEngine(
        client,
        export_fn=export,
        sync_dir=os.path.join(workdir, "sync"),
        writer=writer,
        exchange=None if count == 1 else hosts.allgather,
        version_timeout_s=cfg.mesh.host_timeout_s,
    )
    engine.model_config = model_config  # the sync check scores with it
    return engine


def build_grading_pool(
    cfg: RunConfig, *, cache_path: str | None = None, grader=None, check_runner=None
):
    """The grading pool with the configured grader (or ``grader`` when given).

    ``check_runner``: the task family's targeted-check runner for the agentic grader.

    ``cache_path``: the pool's persisted verdict cache (JSON lines, reloaded at start), so a
    resumed run does not re-grade groups it already graded.
    """
    if grader is None and cfg.grading.grader == "heuristic":
        grader = HeuristicGrader()
    elif grader is None:
        # An unreachable grader server is not fatal: each group falls back (grader_error or
        # deadline, counted) and training continues on the original advantages.
        grader = AgenticGrader(SGLangClient(cfg.grading.sglang_url), check_runner=check_runner)
    return GradingPool(
        grader,
        max_concurrency=cfg.grading.max_concurrency,
        deadline_s=cfg.grading.deadline_s,
        cache=cache_path,
    )
