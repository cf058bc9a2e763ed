"""Grading overlap benchmark: a step's wall time with the grading pool vs. grading after generation.

Run: ``.venv/bin/python benchmarks/grading.py`` (about a minute; ``--quick`` for a shorter run).

Generation is simulated by the caller sleeping ``gen_s`` per batch, finishing its G groups one by
one (each group is submitted the moment it is "verified"); grading uses ``SleepGrader``, which
takes a known ``grade_s`` per group and then runs the real heuristic grader. Two loops run the
same steps:

* serial: generate batch t, then grade it (pool, same concurrency), then update;
* overlapped: generate batch t while the pool grades batch t-1 (submitted as its groups finished),
  then collect batch t-1's verdicts and update on it (one step of lag, as in the paper, where
  600 s of grading hide behind generation).

Per steady-state step (first step's fill and last step's drain excluded), the ideal overlapped
time is max(gen, grade) and the serial one gen + grade, grade = ceil(G / C) * grade_s. Overlap
efficiency = (serial_measured - overlapped_measured) / (serial_ideal - overlapped_ideal): 1 when
grading is fully hidden, 0 when the two are simply added. It can exceed 1 when grading is the
longer part: groups submitted as they finish start grading during their own batch's generation,
so the overlapped step beats the one-step-lag bound max(gen, grade). A last row mixes in real
faulty graders (crash, hang, garbage) behind a deadline: steps stay bounded, fallbacks counted.
"""

from __future__ import annotations

import argparse
import difflib
import math
import statistics
import sys
import time
import zlib

from gagar_jax.grading import schema
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.pool import GradingPool
from gagar_jax.grading.testing import CrashingGrader, GarbageGrader, HangingGrader, SleepGrader

REPO = {
    "lib/core.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    "lib/util.py": "def ident(x):\n    return x\n",
}


def _diff(path: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    )


def make_group(step: int, g: int, k: int = 8) -> schema.GroupWorkspace:
    """A group of k candidates: passing fixes of varying quality and failed attempts."""
    core = REPO["lib/core.py"]
    cands = []
    for i in range(k):
        fixed = core.replace("a - b", "a + b")
        if i % 3 == 1:
            fixed = fixed.replace("    return a + b", "    print(a)\n    return a + b")
        patch = _diff("lib/core.py", core, fixed if i % 4 != 3 else core.replace("a - b", "b - a"))
        if i % 3 == 2:
            patch += _diff("lib/util.py", REPO["lib/util.py"], "def ident(x):\n    return (x)\n")
        passed = i % 4 != 3
        traj = [
            schema.TrajectoryEvent(t, "action", f"step {t}", 50 + 10 * i) for t in range(1 + i % 3)
        ]
        cands.append(
            schema.Candidate(f"r{i}", patch, passed, "1 passed" if passed else "1 failed", traj)
        )
    return schema.GroupWorkspace(f"s{step}-g{g}", "make add() add (lib/core.py)", REPO, cands)


class MixedFaultyGrader:
    """Routes each group (by a hash of its id) to a sleeping, crashing, hanging or garbage one."""

    grader_id = "mixed-faulty"
    version = "1"

    def __init__(self, grade_s: float):
        self.sleep = SleepGrader(grade_s)
        self.crash = CrashingGrader()
        self.hang = HangingGrader()
        self.garbage = GarbageGrader("random", seed=0)

    def grade(self, workspace, cancel=None):
        r = zlib.crc32(workspace.group_id.encode()) % 8
        if r == 0:
            return self.crash.grade(workspace)
        if r == 1:
            return self.hang.grade(workspace)
        if r == 2:
            return self.garbage.grade(workspace)
        return self.sleep.grade(workspace, cancel=cancel)


def _generate(step: int, G: int, gen_s: float, pool: GradingPool | None) -> list[str]:
    ids = []
    for g in range(G):
        time.sleep(gen_s / G)  # the group's rollouts finish and are verified
        ws = make_group(step, g)
        ids.append(ws.group_id)
        if pool is not None:
            pool.submit(ws)
    return ids


def run_loop(grader, *, gen_s, G, C, steps, deadline_s, overlapped, update_s=0.01):
    """Returns (per-step wall times, results of all steps)."""
    pool = GradingPool(grader, max_concurrency=C, deadline_s=deadline_s)
    step_times, all_results = [], []
    prev: list[str] | None = None
    try:
        for step in range(steps + (1 if overlapped else 0)):
            t0 = time.perf_counter()
            if overlapped:
                ids = _generate(step, G, gen_s, pool) if step < steps else None
                if prev is not None:
                    all_results += pool.results(prev, timeout=deadline_s * math.ceil(G / C) + 5)
                    time.sleep(update_s)
                prev = ids
            else:
                ids = _generate(step, G, gen_s, None)
                for g in range(G):
                    pool.submit(make_group(step, g))
                all_results += pool.results(ids, timeout=deadline_s * math.ceil(G / C) + 5)
                time.sleep(update_s)
            step_times.append(time.perf_counter() - t0)
        metrics = pool.metrics()
    finally:
        pool.close()
    return step_times, all_results, metrics


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 5)
    configs = [  # gen_s per batch, grade_s per group, G groups, C concurrency
        (1.0, 0.25, 8, 2),
        (1.0, 0.50, 8, 4),
        (0.6, 0.30, 8, 2),
        (1.0, 0.10, 8, 8),
        (0.5, 0.50, 8, 4),
    ]
    if args.quick:
        configs = configs[:3]
    print(f"# grading overlap ({steps} steps per row; times are per steady-state step, seconds)")
    header = (
        f"{'gen':>5} {'grade/g':>7} {'G':>3} {'C':>3} | {'grade':>6} {'sum':>6} {'max':>6} | "
        f"{'serial':>7} {'overlap':>7} {'ovl/max':>7} | {'efficiency':>10}"
    )
    print(header)
    print("-" * len(header))
    for gen_s, grade_s, G, C in configs:
        grade = math.ceil(G / C) * grade_s
        serial_t, _, _ = run_loop(
            SleepGrader(grade_s),
            gen_s=gen_s,
            G=G,
            C=C,
            steps=steps,
            deadline_s=30,
            overlapped=False,
        )
        over_t, res, _ = run_loop(
            SleepGrader(grade_s), gen_s=gen_s, G=G, C=C, steps=steps, deadline_s=30, overlapped=True
        )
        assert all(r.verdict is not None for r in res), "a sleeping grader must be accepted"
        s = statistics.mean(serial_t[1:])
        o = statistics.mean(over_t[1:-1])
        ideal_gain = (gen_s + grade) - max(gen_s, grade)
        eff = (s - o) / ideal_gain
        print(
            f"{gen_s:5.2f} {grade_s:7.2f} {G:3d} {C:3d} | {grade:6.2f} {gen_s + grade:6.2f} "
            f"{max(gen_s, grade):6.2f} | {s:7.3f} {o:7.3f} {o / max(gen_s, grade):7.2f} | "
            f"{eff:10.2f}"
        )
        sys.stdout.flush()

    gen_s, grade_s, G, C, deadline = 1.0, 0.2, 8, 4, 0.5
    faulty = MixedFaultyGrader(grade_s)
    try:
        over_t, res, m = run_loop(
            faulty, gen_s=gen_s, G=G, C=C, steps=steps, deadline_s=deadline, overlapped=True
        )
    finally:
        faulty.hang.release()
    fallbacks = {
        k.split("/", 1)[1]: int(v) for k, v in m.items() if k.startswith("fallback/") and v
    }
    print(
        f"\n# faulty graders (crash/hang/garbage on ~3/8 of groups), gen {gen_s}s, "
        f"grade {grade_s}s/group, G={G}, C={C}, deadline {deadline}s"
    )
    print(
        f"steady step {statistics.mean(over_t[1:-1]):.3f}s (max step {max(over_t):.3f}s); "
        f"{len(res)} groups: {sum(r.verdict is not None for r in res)} accepted, "
        f"fallbacks {fallbacks}; abandoned threads {int(m['abandoned'])}"
    )

    grader = HeuristicGrader()
    groups = [make_group(0, g, k=16) for g in range(200)]
    t0 = time.perf_counter()
    for ws in groups:
        grader.grade(ws)
    dt = (time.perf_counter() - t0) / len(groups)
    print(f"\n# heuristic grader: {dt * 1e3:.2f} ms per group of 16 candidates (single thread)")


if __name__ == "__main__":
    main()
