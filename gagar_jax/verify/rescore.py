"""Re-scoring a run's stored rollouts with today's verifier.

Verifiers co-evolve with the policy: a hack the verifier of the day paid for may be recognised
by a later one. A run stores every training rollout (``rollouts.jsonl``: see
``gagar_jax.rl.rollout_log``); this module verifies each again with the current verifier and
monitor and reports, per step, the reward that changes and the confirmed flags that appear::

    python -m gagar_jax.verify.rescore RUN_DIR [--json out.json] [--steps 10:20] [--workers 2]

The table lists per step: rollouts re-scored, the reward paid then and now (sums), the rewards
withdrawn (paid then, not now: a forged reward found afterwards), the rewards granted (not paid
then, now paid: usually a verifier bug fixed or a flaky test), and the new confirmed flags by
rule. The JSON (``--json``) holds the same per step and one record per changed rollout (step,
group, slot, task, old and new reward, the flags that appeared, with their evidence).

The run's ``config.json`` says which task family the rollouts came from; its tasks are rebuilt
from the configured pool and each rollout is verified again from its stored patch (and its
trajectory, which the monitor's trajectory rules read): Python repository tasks with
``verify.repo.verify_repo_patch`` in the sandbox, toy tasks with ``envs.toy.verify``. A rollout
whose task cannot be found (the pool changed) or whose family has no re-verifier is counted as
``skipped``; an ``infra_error`` now is counted as such and changes no reward.

:func:`rescore_rows` takes the re-verifier as a function, so the same report can be made for any
family (the CLI imports the RL experiment's config and families lazily: the verifier package
itself does not depend on them).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["Rescored", "main", "rescore_rows", "step_table"]


@dataclasses.dataclass(frozen=True)
class Rescored:
    """One stored rollout verified again.

    Attributes:
      row: the stored row (``rl.rollout_log.rollout_rows``).
      status: ``"rescored"``, ``"skipped"`` (no task or re-verifier) or ``"infra_error"``.
      reward: the reward today's verifier pays (the stored one when not rescored).
      new_flags: confirmed flags ``(rule, evidence)`` today's monitor raises whose rule was not
        among the stored confirmed ones.
      note: why it was skipped, or the verifier's status.
    """

    row: Mapping[str, Any]
    status: str
    reward: float
    new_flags: tuple[tuple[str, str], ...] = ()
    note: str = ""

    @property
    def old_reward(self) -> float:
        return float(self.row.get("reward", 0.0))

    @property
    def withdrawn(self) -> bool:
        return self.status == "rescored" and self.old_reward > 0 and self.reward == 0

    @property
    def granted(self) -> bool:
        return self.status == "rescored" and self.old_reward == 0 and self.reward > 0


# A re-verifier: (stored row) -> (passed, cheat, flags) | None (cannot re-verify: skipped) |
# "infra_error"; flags are objects with ``rule``, ``evidence``, ``confirmed``.
Reverifier = Callable[[Mapping[str, Any]], Any]


def _one(row: Mapping[str, Any], reverify: Reverifier) -> Rescored:
    if row.get("infra_error"):
        return Rescored(row, "skipped", float(row.get("reward", 0.0)), note="infra_error then")
    try:
        out = reverify(row)
    except Exception as e:  # noqa: BLE001 - one rollout's problem: reported, not fatal
        return Rescored(row, "infra_error", float(row.get("reward", 0.0)), note=repr(e)[:300])
    if out is None:
        return Rescored(row, "skipped", float(row.get("reward", 0.0)), note="no re-verifier")
    if isinstance(out, str):
        return Rescored(row, "infra_error", float(row.get("reward", 0.0)), note=out[:300])
    passed, cheat, flags = out
    old_rules = {f[0] for f in row.get("flags", ()) if len(f) > 1 and f[1]}
    new = tuple(
        dict.fromkeys(
            (f.rule, str(f.evidence)[:400])
            for f in flags
            if f.confirmed and f.rule not in old_rules
        )
    )
    return Rescored(row, "rescored", float(bool(passed) and not bool(cheat)), new)


def rescore_rows(
    rows: Sequence[Mapping[str, Any]],
    reverify: Reverifier,
    *,
    workers: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[Rescored]:
    """Every row verified again by ``reverify`` (``workers`` at a time), in row order."""
    out: list[Rescored | None] = [None] * len(rows)
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        futures = {pool.submit(_one, row, reverify): i for i, row in enumerate(rows)}
        for done, fut in enumerate(concurrent.futures.as_completed(futures), start=1):
            out[futures[fut]] = fut.result()
            if progress is not None:
                progress(done, len(rows))
    return [r for r in out if r is not None]


def step_table(results: Iterable[Rescored]) -> list[dict[str, Any]]:
    """Per step: rollouts, rescored, skipped, infra errors, reward then and now, withdrawn,
    granted, and the new confirmed flags by rule."""
    steps: dict[int, dict[str, Any]] = {}
    for r in results:
        s = steps.setdefault(
            int(r.row.get("step", -1)),
            {
                "rollouts": 0,
                "rescored": 0,
                "skipped": 0,
                "infra_error": 0,
                "reward_then": 0.0,
                "reward_now": 0.0,
                "withdrawn": 0,
                "granted": 0,
                "new_flags": collections.Counter(),
            },
        )
        s["rollouts"] += 1
        s[r.status] += 1
        if r.status == "rescored":
            s["reward_then"] += r.old_reward
            s["reward_now"] += r.reward
        s["withdrawn"] += r.withdrawn
        s["granted"] += r.granted
        s["new_flags"].update({rule for rule, _ in r.new_flags})
    return [
        {"step": step, **{k: (dict(v) if k == "new_flags" else v) for k, v in s.items()}}
        for step, s in sorted(steps.items())
    ]


def format_table(table: Sequence[Mapping[str, Any]]) -> str:
    head = (
        f"{'step':>5} {'rollouts':>8} {'rescored':>8} {'skipped':>7} {'infra':>5} "
        f"{'reward then':>11} {'reward now':>10} {'withdrawn':>9} {'granted':>7}  new flags"
    )
    lines = [head]
    for t in table:
        flags = ", ".join(f"{k} x{v}" for k, v in sorted(t["new_flags"].items())) or "-"
        lines.append(
            f"{t['step']:>5} {t['rollouts']:>8} {t['rescored']:>8} {t['skipped']:>7} "
            f"{t['infra_error']:>5} {t['reward_then']:>11.0f} {t['reward_now']:>10.0f} "
            f"{t['withdrawn']:>9} {t['granted']:>7}  {flags}"
        )
    return "\n".join(lines)


def report(results: Sequence[Rescored]) -> dict[str, Any]:
    """The JSON report: the per-step table, totals and one record per changed rollout."""
    table = step_table(results)
    changed = [
        {
            "step": r.row.get("step"),
            "group_id": r.row.get("group_id"),
            "slot": r.row.get("slot"),
            "task_id": r.row.get("task_id"),
            "old_reward": r.old_reward,
            "new_reward": r.reward,
            "new_flags": [list(f) for f in r.new_flags],
        }
        for r in results
        if r.withdrawn or r.granted or r.new_flags
    ]
    totals = {
        k: sum(t[k] for t in table)
        for k in ("rollouts", "rescored", "skipped", "infra_error", "withdrawn", "granted")
    }
    totals["reward_then"] = sum(t["reward_then"] for t in table)
    totals["reward_now"] = sum(t["reward_now"] for t in table)
    return {"steps": table, "totals": totals, "changed": changed}


# ------------------------------------------------------------------------------------------------
# The re-verifier of a run directory (the RL experiment's config and families, imported lazily)
# ------------------------------------------------------------------------------------------------


def run_reverifier(run_dir: str, **verify_kwargs: Any) -> Reverifier:
    """The re-verifier of the run in ``run_dir``: its family's tasks rebuilt from
    ``config.json``; repository tasks verified in the sandbox, toy tasks in-process."""
    from gagar_jax.envs.repo import RepoTask
    from gagar_jax.envs.toy import ToyTask
    from gagar_jax.envs.toy import verify as toy_verify
    from gagar_jax.rl.collect import build_family
    from gagar_jax.rl.config import RunConfig
    from gagar_jax.verify.repo import verify_repo_patch

    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    with open(path, encoding="utf-8") as f:
        cfg = RunConfig.from_config_dict(json.load(f))
    family = build_family(cfg)
    by_id: dict[str, Any] = {}

    def task_of(row: Mapping[str, Any]) -> Any:
        i, tid = int(row.get("task_index", -1)), str(row.get("task_id", ""))
        if 0 <= i < family.num_train:
            task = family.train_task(i)
            if not tid or str(getattr(task, "task_id", "")) == tid:
                return task
        if tid and not by_id:
            by_id.update(
                {
                    str(getattr(t, "task_id", "")): t
                    for t in map(family.train_task, range(family.num_train))
                }
            )
        return by_id.get(tid)

    kwargs = {**dict(getattr(family, "_verify_kwargs", {}) or {}), **verify_kwargs}

    def reverify(row: Mapping[str, Any]):
        task = task_of(row)
        if isinstance(task, RepoTask):
            v = verify_repo_patch(
                task, row.get("patch", ""), events=row.get("events", ()), **kwargs
            )
            if v.infra_error:
                return f"infra_error: {v.test_log[:200]}"
            return v.passed, v.cheat, v.flags
        if isinstance(task, ToyTask):
            v = toy_verify(task, row.get("patch", ""))
            if v.infra_error:
                return f"infra_error: {v.test_log[:200]}"
            return v.passed, v.cheat, v.cheat_flags
        return None

    return reverify


def _steps(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo or 0), int(hi) if hi else sys.maxsize


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="python -m gagar_jax.verify.rescore",
        description="Re-verify a run's stored rollouts with today's verifier.",
    )
    p.add_argument("run_dir", help="the run directory (config.json, rollouts.jsonl)")
    p.add_argument("--json", default="", help="write the JSON report here")
    p.add_argument("--steps", default="", help="only steps LO:HI (HI excluded)")
    p.add_argument("--limit", type=int, default=0, help="at most this many rollouts")
    p.add_argument("--workers", type=int, default=1, help="verifications at once")
    args = p.parse_args(argv)
    from gagar_jax.rl.rollout_log import read_rollouts

    rows = read_rollouts(args.run_dir)
    if args.steps:
        lo, hi = _steps(args.steps)
        rows = [r for r in rows if lo <= int(r.get("step", -1)) < hi]
    if args.limit > 0:
        rows = rows[: args.limit]
    reverify = run_reverifier(args.run_dir)
    results = rescore_rows(rows, reverify, workers=args.workers)
    out = report(results)
    print(format_table(out["steps"]))
    t = out["totals"]
    print(
        f"total: {t['rollouts']} rollouts, {t['rescored']} re-scored, reward {t['reward_then']:.0f}"
        f" then, {t['reward_now']:.0f} now ({t['withdrawn']} withdrawn, {t['granted']} granted)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1, sort_keys=True)
    return out


if __name__ == "__main__":
    main()
