"""Graders with known behaviour, for tests and benchmarks of the pool.

These are real graders, not mocks: ``SleepGrader`` really takes its time (and honours
cancellation), ``CrashingGrader`` really raises from inside ``grade``, ``HangingGrader`` really
blocks its thread (ignoring cancellation, like a grader stuck in a C call or a dead socket)
until ``release()``, and ``GarbageGrader`` really returns unusable output of many kinds.
"""

from __future__ import annotations

import random
import threading
import time

from gagar_jax.grading import schema
from gagar_jax.grading.heuristic import HeuristicGrader


class SleepGrader:
    """Takes ``seconds`` per group (interruptible by ``cancel``), then grades with ``inner``."""

    version = "1"

    def __init__(self, seconds: float, inner=None):
        self.seconds = float(seconds)
        self.inner = inner or HeuristicGrader()
        self.grader_id = f"sleep{self.seconds:g}+{self.inner.grader_id}"
        self.calls = 0
        self._lock = threading.Lock()

    def grade(self, workspace, cancel: threading.Event | None = None):
        with self._lock:
            self.calls += 1
        if cancel is not None:
            if cancel.wait(self.seconds):
                raise TimeoutError("cancelled")
        else:
            time.sleep(self.seconds)
        return self.inner.grade(workspace)


class CrashingGrader:
    """Raises ``exc`` (default: a real ZeroDivisionError from arithmetic) on every group."""

    grader_id = "crashing"
    version = "1"

    def __init__(self, exc: BaseException | None = None):
        self.exc = exc

    def grade(self, workspace):
        if self.exc is not None:
            raise self.exc
        return len(workspace.candidates) / 0


class HangingGrader:
    """Blocks forever (ignoring any cancellation) until ``release()``; then raises."""

    grader_id = "hanging"
    version = "1"

    def __init__(self):
        self._gate = threading.Event()
        self.entered = 0

    def grade(self, workspace):
        self.entered += 1
        self._gate.wait()
        raise RuntimeError("released")

    def release(self) -> None:
        self._gate.set()


class GarbageGrader:
    """Returns unusable output; ``kind`` picks one, ``"random"`` cycles through all (seeded)."""

    grader_id = "garbage"
    version = "1"
    KINDS = (
        "none",
        "bytes",
        "prose",
        "truncated_json",
        "wrong_schema",
        "wrong_group",
        "nan_scores",
        "empty",
        "huge",
        "missing_candidate",
    )

    def __init__(self, kind: str = "random", seed: int = 0):
        if kind != "random" and kind not in self.KINDS:
            raise ValueError(
                f"GarbageGrader.kind must be 'random' or one of {self.KINDS}, got {kind!r}"
            )
        self.kind = kind
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def grade(self, workspace):
        with self._lock:
            kind = self._rng.choice(self.KINDS) if self.kind == "random" else self.kind
        good = schema.verdict_to_dict(HeuristicGrader().grade(workspace))
        if kind == "none":
            return None
        if kind == "bytes":
            return bytes(range(256))
        if kind == "prose":
            return "I think candidate 2 is the best because it is elegant."
        if kind == "truncated_json":
            import json

            text = json.dumps(good)
            return text[: len(text) // 2]
        if kind == "wrong_schema":
            return {"ranking": ["c0", "c1"], "best": "c0"}
        if kind == "wrong_group":
            return dict(good, group_id=workspace.group_id + "-x")
        if kind == "nan_scores":
            for v in good["verdicts"]:
                v["scores"]["minimality"] = float("nan")
            good.setdefault("verdicts", []).append({"candidate": "?", "tier": 1})
            return good
        if kind == "empty":
            return ""
        if kind == "huge":
            return "{" * (schema.MAX_OUTPUT_CHARS + 1)
        good["verdicts"] = good["verdicts"][1:]
        good["verdicts"].append({"candidate": "nobody", "tier": 1})
        return good
