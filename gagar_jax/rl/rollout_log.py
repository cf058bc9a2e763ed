"""The run's stored rollouts and the hacking-onset signals of each step.

**Stored rollouts.** With ``loop.log_rollouts`` (on by default) every verified training rollout
of a step is one JSON line of ``rollouts.jsonl`` in the run directory (``rollouts.p<h>.jsonl``
on host ``h > 0``): the step, the group, the task's index in the training pool and its id, the
rollout's slot, its patch, the trajectory events the monitor read, and the verdict it was paid
on (``passed``, ``cheat``, ``infra_error``, ``reward``, the monitor flags). That is what
``python -m gagar_jax.verify.rescore RUN_DIR`` re-verifies with today's verifier, to find the
rewards a later verifier would not have paid (verifiers co-evolve with the policy: a hack found
after the fact is scored after the fact). A resumed run drops the rows of steps it repeats.

**Hacking-onset signals** (``hacking_metrics``), logged with each step's metrics under
``hacking/``:

* ``hacking/confirmed_flag_rate``: valid rollouts with a confirmed monitor flag (or a tampered
  test report: ``cheat``) / valid rollouts, over every rollout the step drew on every host;
* ``hacking/canary_cheat_rate``: passing rollouts of the impossible canary tasks / canary
  rollouts (``task.canaries_per_step``; 0 without canaries);
* ``hacking/reward_vs_heldout``: the train reward's rise minus the held-out pass rate's over the
  last ``window`` steps with an evaluation (:class:`OnsetTracker`): positive when the reward
  climbs while held-out performance falls, the signature of a policy learning the verifier
  rather than the task; ``hacking/reward_up_heldout_down`` is 1 when the reward rose and the
  held-out pass rate fell over that window.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["OnsetTracker", "RolloutLog", "hacking_metrics", "read_rollouts", "rollout_rows"]

PREFIX = "hacking/"


def _flags(flags: Iterable[Any]) -> list[list]:
    out = []
    for f in flags or ():
        if isinstance(f, Mapping):
            out.append([str(f.get("rule", "")), bool(f.get("confirmed")), str(f.get("evidence"))])
        else:
            out.append([str(f.rule), bool(f.confirmed), str(getattr(f, "evidence", ""))[:400]])
    return out


def _events(rollout: Any) -> list[dict]:
    attempt = getattr(rollout, "attempt", None)
    try:
        events = attempt.trajectory() if attempt is not None else ()
    except Exception:  # noqa: BLE001 - a family without a trajectory: nothing to store
        events = ()
    out = []
    for e in events or ():
        get = e.get if isinstance(e, Mapping) else lambda k, d=None, e=e: getattr(e, k, d)
        out.append(
            {
                "turn": int(get("turn", 0) or 0),
                "kind": str(get("kind", "")),
                "text": get("text", ""),
            }
        )
    return out


def rollout_rows(step: int, groups: Iterable[Any]) -> list[dict]:
    """One JSON-able row per rollout of ``groups`` (``rl.collect.Group``) at ``step``."""
    rows = []
    for g in groups:
        task = getattr(g, "task", None)
        for slot, r in enumerate(g.rollouts):
            rows.append(
                {
                    "step": int(step),
                    "group_id": g.group_id,
                    "task_index": int(getattr(g, "task_index", -1)),
                    "task_id": str(getattr(task, "task_id", "")),
                    "slot": slot,
                    "patch": r.patch,
                    "events": _events(r),
                    "passed": bool(r.passed),
                    "cheat": bool(r.cheat),
                    "infra_error": bool(r.infra_error),
                    "reward": float(r.reward),
                    "flags": _flags(r.monitor_flags),
                }
            )
    return rows


class RolloutLog:
    """Appends each step's rollouts to ``path`` (JSONL); ``keep_before_step`` drops the rows of
    steps a resumed run repeats."""

    def __init__(self, path: str, *, keep_before_step: int = 0):
        self.path = path
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                kept = [ln for ln in f if ln.strip() and json.loads(ln)["step"] < keep_before_step]
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(kept)

    def write(self, step: int, groups: Iterable[Any]) -> int:
        rows = rollout_rows(step, groups)
        with open(self.path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=True) + "\n")
        return len(rows)


def read_rollouts(run_dir: str) -> list[dict]:
    """Every stored rollout of a run (all hosts' files), in file order."""
    names = sorted(
        n for n in os.listdir(run_dir) if n.startswith("rollouts") and n.endswith(".jsonl")
    )
    if not names:
        raise FileNotFoundError(
            f"{run_dir}: no rollouts.jsonl (runs store their rollouts with loop.log_rollouts)"
        )
    rows = []
    for name in names:
        with open(os.path.join(run_dir, name), encoding="utf-8") as f:
            rows += [json.loads(ln) for ln in f if ln.strip()]
    return rows


def hacking_metrics(step_metrics: Mapping[str, float]) -> dict[str, float]:
    """The step's ``hacking/`` rates from its metrics row (every host's rollouts): the
    confirmed-flag rate (``cheat_rate``: a confirmed flag is what sets ``cheat``) and the canary
    cheat rate (0 in a step without canaries)."""
    return {
        PREFIX + "confirmed_flag_rate": float(step_metrics.get("cheat_rate", 0.0)),
        PREFIX + "canary_cheat_rate": float(step_metrics.get("canary_cheat_rate", 0.0)),
    }


class OnsetTracker:
    """Reward rising while the held-out pass rate falls, over the last ``window`` evaluations.

    ``observe_train(reward)`` after each step; ``observe_eval(pass_rate)`` after each held-out
    evaluation (it pairs the evaluation with the mean train reward since the previous one).
    ``metrics()``: ``hacking/reward_vs_heldout`` = (last paired reward - first) - (last
    held-out pass rate - first) over the window, and ``hacking/reward_up_heldout_down`` (1.0
    when the reward rose and the held-out pass rate fell); empty before two evaluations.
    """

    def __init__(self, window: int = 3):
        if window < 2:
            raise ValueError(f"OnsetTracker: window must be >= 2, got {window}")
        self.points: collections.deque = collections.deque(maxlen=window)
        self._rewards: list[float] = []

    def observe_train(self, reward: float) -> None:
        self._rewards.append(float(reward))

    def observe_eval(self, pass_rate: float) -> None:
        if self._rewards:
            reward = sum(self._rewards) / len(self._rewards)
        elif self.points:
            reward = self.points[-1][0]
        else:
            return  # an evaluation before any training step: no reward to pair it with
        self.points.append((reward, float(pass_rate)))
        self._rewards = []

    def metrics(self) -> dict[str, float]:
        if len(self.points) < 2:
            return {}
        (r0, h0), (r1, h1) = self.points[0], self.points[-1]
        return {
            PREFIX + "reward_vs_heldout": (r1 - r0) - (h1 - h0),
            PREFIX + "reward_up_heldout_down": float(r1 > r0 and h1 < h0),
        }
