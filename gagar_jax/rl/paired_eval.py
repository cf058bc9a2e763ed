"""Paired evaluation of a run's checkpoints: the same tasks, the same sample seeds.

A pass-rate change between two checkpoints (the SFT start at step 0 and the end of RL) is
measured on one task set, each task sampled with the same per-task seeds at both steps, so
the change is not blurred by which tasks or which random draws each evaluation happened to get.
:func:`checkpoint_pass_counts` returns each task's pass count per checkpoint;
:func:`paired_mean_se` is the mean and standard error of per-seed differences.
``scripts/heldout_gain.py`` runs both over the seeds and modes of a sweep.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

SPLITS = ("heldout", "train")


def checkpoint_pass_counts(
    workdir: str,
    steps: Sequence[int],
    *,
    split: str = "heldout",
    num_tasks: int = 512,
    samples: int = 4,
    temperature: float = 0.7,
    sample_step: int = 0,
) -> dict[int, list[dict[str, Any]]]:
    """Per checkpoint step (-1: the newest complete one), one record per task: ``task_id``,
    ``kind`` (the task's ``bug_kind`` where it has one, else ""), ``n`` (valid samples),
    ``passed``, ``cheats``.

    ``split``: ``heldout`` (the family's held-out tasks, the first ``num_tasks``) or ``train``
    (its training pool's first ``num_tasks``: for choosing a setting without the held-out set).
    Every checkpoint samples task ``i`` with the seed of ``(run seed, sample_step, i)``.
    """
    from gagar_jax.rl import engines, policy
    from gagar_jax.rl.collect import build_family
    from gagar_jax.rl.config import RunConfig
    from gagar_jax.rl.train import eval_groups
    from gagar_jax.update import make_mesh

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if num_tasks < 1 or samples < 1:
        raise ValueError(f"num_tasks and samples must be >= 1, got {num_tasks}, {samples}")
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir} a run directory?")
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    run_cfg = RunConfig.from_config_dict(d)  # the checkpoints' own (fingerprint)
    d["loop"].update(eval_rollouts=samples, eval_temperature=temperature)
    d["task"]["num_eval"] = num_tasks
    cfg = RunConfig.from_config_dict(d)
    family = build_family(cfg)
    if split == "heldout":
        tasks = family.eval_tasks()
    else:
        if num_tasks > family.num_train:
            raise ValueError(
                f"num_tasks={num_tasks} exceeds the run's training pool "
                f"(task.num_train={family.num_train})"
            )
        tasks = [family.train_task(i) for i in range(num_tasks)]
    model_config, model = policy.build_model(cfg, family.tokenizer.vocab_size)
    mesh = make_mesh(cfg.mesh.shape)
    ckpt = policy.checkpointer(run_cfg, workdir, model_config)
    engine = None
    out: dict[int, list[dict[str, Any]]] = {}
    try:
        have = sorted(ckpt.all_steps())
        steps = [have[-1] if s < 0 and have else s for s in steps]
        missing = [s for s in steps if s not in have]
        if missing:
            raise ValueError(
                f"checkpoints {missing} not in {workdir} (complete ones: {have}); step 0, the SFT "
                "start, is kept only when loop.keep_checkpoints covers the whole run"
            )
        for step in steps:
            state, _, ls = policy.restore(ckpt, run_cfg, model_config, mesh, step)
            if engine is None:
                engine = engines.build_engine(
                    cfg, model, workdir=workdir, pad_id=family.tokenizer.pad_id
                )
            policy.sync_engine(
                engine,
                cfg,
                state.params,
                mesh=mesh,
                device=policy.model_device(model),
                version=ls.policy_version,
            )
            groups = eval_groups(engine, family, cfg, tasks, step=step, sample_step=sample_step)
            out[step] = [
                {
                    "task_id": family.task_id(g.task),
                    "kind": str(getattr(g.task, "bug_kind", "")),
                    "n": g.num_valid,
                    "passed": g.num_passed,
                    "cheats": sum(1 for r in g.rollouts if r.cheat and not r.infra_error),
                }
                for g in groups
            ]
    finally:
        ckpt.close()
    return out


def pass_rate(records: Sequence[dict[str, Any]]) -> float:
    """Passed samples over valid samples of a checkpoint's records (0 when none is valid)."""
    n = sum(r["n"] for r in records)
    return sum(r["passed"] for r in records) / n if n else 0.0


def paired_mean_se(diffs: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n)) of paired differences;
    the error is NaN for fewer than two."""
    n = len(diffs)
    if n == 0:
        raise ValueError("paired_mean_se needs at least one difference")
    mean = sum(diffs) / n
    if n < 2:
        return mean, math.nan
    var = sum((x - mean) ** 2 for x in diffs) / (n - 1)
    return mean, math.sqrt(var / n)
