"""Grading pool: concurrency bound, deadlines, cancellation, cache, metrics, and real faulty graders
(crash, hang, garbage, SystemExit) that must never stall or kill the caller."""

import threading
import time

import numpy as np
import pytest
from grading_strategies import BASE_REPO, EXTRA_EDITS, FIX, apply_edits

from gagar_jax.grading import schema
from gagar_jax.grading.heuristic import HeuristicGrader
from gagar_jax.grading.pool import GradingPool, VerdictCache
from gagar_jax.grading.schema import FallbackReason, RejectReason
from gagar_jax.grading.testing import CrashingGrader, GarbageGrader, HangingGrader, SleepGrader


def make_group(i: int, n: int = 4) -> schema.GroupWorkspace:
    cands = []
    for k in range(n):
        edits = [FIX] + [EXTRA_EDITS[(i + k) % len(EXTRA_EDITS)]] * (k % 2)
        cands.append(
            schema.Candidate(
                f"r{k}",
                apply_edits(BASE_REPO, edits),
                k != n - 1,
                "1 passed" if k != n - 1 else "1 failed",
            )
        )
    return schema.GroupWorkspace(f"group-{i}", f"fix add (variant {i})", BASE_REPO, cands)


class CountingGrader:
    """A real grader that records how many of its calls overlap (to check the concurrency bound)."""

    grader_id = "counting"
    version = "1"

    def __init__(self, seconds: float = 0.05):
        self.seconds = seconds
        self.active = 0
        self.max_active = 0
        self.calls = 0
        self._lock = threading.Lock()

    def grade(self, workspace):
        with self._lock:
            self.active += 1
            self.calls += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(self.seconds)
        with self._lock:
            self.active -= 1
        return HeuristicGrader().grade(workspace)


def test_heuristic_pool_grades_everything_and_reports_metrics():
    groups = [make_group(i) for i in range(6)]
    with GradingPool(HeuristicGrader(), max_concurrency=2, deadline_s=30) as pool:
        for ws in groups:
            pool.submit(ws)
        res = pool.results([ws.group_id for ws in groups], timeout=30)
        m = pool.metrics()
    assert all(r.verdict is not None and r.fallback_reason is None for r in res)
    assert [r.group_id for r in res] == [ws.group_id for ws in groups]
    judged = sum(len(r.verdict.judgements) for r in res)
    assert m["tier/1"] + m["tier/2"] + m["tier/3"] == judged == 6 * 3
    assert m["t1_share"] == pytest.approx(m["tier/1"] / judged)
    assert m["accepted"] == 6 and m["fallback_rate"] == 0.0 and m["queue_depth"] == 0
    tier, rank, graded, cheat = schema.to_arrays(res, K=4)
    assert graded.all() and tier.shape == (6, 4)


def test_concurrency_is_bounded_and_used():
    grader = CountingGrader(0.1)
    groups = [make_group(i) for i in range(8)]
    with GradingPool(grader, max_concurrency=3, deadline_s=30) as pool:
        for ws in groups:
            pool.submit(ws)
        assert pool.metrics()["max_queue_depth"] >= 5
        res = pool.results([ws.group_id for ws in groups], timeout=30)
    assert all(r.verdict is not None for r in res)
    assert grader.max_active == 3 and grader.calls == 8


@pytest.mark.parametrize("exc", [None, SystemExit(3), KeyboardInterrupt(), MemoryError("x")])
def test_crashing_grader_falls_back(exc):
    groups = [make_group(i) for i in range(4)]
    with GradingPool(CrashingGrader(exc), max_concurrency=2, deadline_s=5) as pool:
        for ws in groups:
            pool.submit(ws)
        res = pool.results([ws.group_id for ws in groups], timeout=10)
        m = pool.metrics()
    assert all(r.fallback_reason == FallbackReason.GRADER_ERROR for r in res)
    assert m["fallback/grader_error"] == 4 and m["fallback_rate"] == 1.0
    assert not schema.to_arrays(res, K=4)[2].any()


def test_hanging_grader_never_stalls_the_caller():
    grader = HangingGrader()
    groups = [make_group(i) for i in range(3)]
    try:
        t0 = time.monotonic()
        with GradingPool(grader, max_concurrency=1, deadline_s=0.2) as pool:
            for ws in groups:
                pool.submit(ws)
            res = pool.results([ws.group_id for ws in groups], timeout=10)
            m = pool.metrics()
        elapsed = time.monotonic() - t0
        # One slot, three hanging groups: each is abandoned at its deadline and the next starts.
        assert grader.entered == 3
        assert all(r.fallback_reason == FallbackReason.DEADLINE for r in res)
        assert m["fallback/deadline"] == 3 and m["abandoned"] == 3
        assert elapsed < 5, elapsed  # bounded by the deadlines, not by the hang
    finally:
        grader.release()


def test_caller_timeout_and_cancellation():
    grader = SleepGrader(5.0)
    a, b, c = make_group(0), make_group(1), make_group(2)
    with GradingPool(grader, max_concurrency=1, deadline_s=60) as pool:
        for ws in (a, b, c):
            pool.submit(ws)
        assert pool.cancel(b.group_id)  # queued -> cancelled without running
        t0 = time.monotonic()
        (ra,) = pool.results([a.group_id], timeout=0.2)
        assert time.monotonic() - t0 < 2
        assert ra.fallback_reason == FallbackReason.DEADLINE
        (rb, rx) = pool.results([b.group_id, "never-submitted"], timeout=1)
        assert rb.fallback_reason == FallbackReason.CANCELLED
        assert rx.fallback_reason == FallbackReason.NOT_SUBMITTED and rx.candidate_ids == ()
        time.sleep(0.2)  # c started after a's slot was released; cancel it while running
        assert pool.cancel(c.group_id) and not pool.cancel(c.group_id)
        (rc,) = pool.results([c.group_id], timeout=1)
        assert rc.fallback_reason == FallbackReason.CANCELLED
        time.sleep(0.2)
        # SleepGrader honours its cancel event: no thread is left behind.
        assert pool.metrics()["abandoned"] == 0
    assert grader.calls == 2


def test_garbage_grader_outputs_all_rejected_by_name():
    groups = [make_group(i) for i in range(40)]
    with GradingPool(GarbageGrader("random", seed=1), max_concurrency=4, deadline_s=10) as pool:
        for ws in groups:
            pool.submit(ws)
        res = pool.results([ws.group_id for ws in groups], timeout=30)
        m = pool.metrics()
    reasons = {r.fallback_reason for r in res}
    assert None not in reasons
    assert reasons <= {FallbackReason(r.value) for r in RejectReason}
    assert {FallbackReason.MALFORMED, FallbackReason.WRONG_GROUP} <= reasons
    assert sum(m[f"fallback/{r.value}"] for r in FallbackReason) == 40
    tier, rank, graded, cheat = schema.to_arrays(res, K=4)
    assert not graded.any() and (tier == 1).all() and (rank == 1).all()


def test_cache_persists_and_resumed_run_does_not_regrade(tmp_path):
    path = tmp_path / "verdicts.jsonl"
    groups = [make_group(i) for i in range(3)]
    first = CountingGrader(0.0)
    with GradingPool(first, max_concurrency=2, deadline_s=10, cache=path) as pool:
        for ws in groups:
            pool.submit(ws)
        r1 = pool.results([ws.group_id for ws in groups], timeout=10)
    assert first.calls == 3
    with open(path, "a") as f:
        f.write('{"key": "torn')  # an interrupted write must not break the resume
    resumed = CountingGrader(0.0)
    changed = schema.GroupWorkspace(
        groups[0].group_id, groups[0].task_text + "!", BASE_REPO, groups[0].candidates
    )
    with GradingPool(resumed, max_concurrency=2, deadline_s=10, cache=str(path)) as pool:
        for ws in groups[1:] + [changed]:
            pool.submit(ws)
        r2 = pool.results([changed.group_id] + [ws.group_id for ws in groups[1:]], timeout=10)
        m = pool.metrics()
    assert resumed.calls == 1  # only the group whose content changed
    assert m["cache_hits"] == 2
    assert [r.cached for r in r2] == [False, True, True]
    assert [r.verdict for r in r2[1:]] == [r.verdict for r in r1[1:]]
    assert len(VerdictCache(path)) == 4


def test_resubmission_of_same_content_is_deduplicated():
    grader = CountingGrader(0.1)
    ws = make_group(0)
    with GradingPool(grader, max_concurrency=2, deadline_s=10) as pool:
        pool.submit(ws)
        pool.submit(ws)
        (r,) = pool.results([ws.group_id], timeout=10)
    assert r.verdict is not None and grader.calls == 1


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="max_concurrency"):
        GradingPool(HeuristicGrader(), max_concurrency=0)
    with pytest.raises(ValueError, match="deadline_s"):
        GradingPool(HeuristicGrader(), deadline_s=0)
    with GradingPool(HeuristicGrader()) as pool, pytest.raises(TypeError, match="GroupWorkspace"):
        pool.submit({"group_id": "x"})


def test_fallback_arrays_feed_finite_advantages():
    from gagar_jax import advantages

    groups = [make_group(i) for i in range(6)]
    with GradingPool(GarbageGrader("random", seed=3), max_concurrency=2, deadline_s=5) as pool:
        for ws in groups[:3]:
            pool.submit(ws)
        bad = pool.results([ws.group_id for ws in groups[:3]], timeout=10)
    good = [schema.GradeResult.accepted(ws, HeuristicGrader().grade(ws)) for ws in groups[3:]]
    res = bad + good
    tier, rank, graded, cheat = schema.to_arrays(res, K=4)
    passed = np.array([[c.passed for c in ws.candidates] for ws in groups])
    rewards = passed.astype(np.float32)
    valid = np.ones_like(passed)
    out = advantages.gagar_advantages(rewards, passed, cheat, tier, rank, graded, valid)
    adv = np.asarray(out.advantages)
    assert np.isfinite(adv).all()
    # Fallback groups keep their original advantages exactly.
    np.testing.assert_allclose(adv[:3], np.asarray(out.original)[:3], rtol=0, atol=1e-6)


def test_async_results_keep_the_event_loop_free():
    import asyncio

    async def main(pool, ws):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # the ticker is running before the group is even submitted
        pool.submit(ws)
        (r,) = await pool.aresults([ws.group_id], timeout=10)
        t.cancel()
        return r, ticks

    ws = make_group(0)
    # The grader sleeps 0.5 s; if aresults blocked the loop, the ticker could not tick at all.
    with GradingPool(SleepGrader(0.5), deadline_s=10) as pool:
        r, ticks = asyncio.run(main(pool, ws))
    assert r.verdict is not None and ticks >= 3


def test_cache_key_depends_on_grader_settings():
    from gagar_jax.grading.heuristic import HeuristicConfig

    ws = make_group(0)
    a = VerdictCache.key(ws, HeuristicGrader())
    assert a == VerdictCache.key(ws, HeuristicGrader())
    assert a != VerdictCache.key(ws, HeuristicGrader(HeuristicConfig(t1_at_least=0.9)))


def test_corrupt_cache_records_are_ignored_counted_and_regraded(tmp_path):
    # issue 11: a cached verdict that is a string, a latency "fast" or 10**400, an unknown
    # reason, a record that is not an object: each is skipped and its group graded again.
    import json

    path = tmp_path / "verdicts.jsonl"
    groups = [make_group(i) for i in range(6)]
    with GradingPool(CountingGrader(0.0), max_concurrency=2, deadline_s=10, cache=path) as pool:
        for ws in groups:
            pool.submit(ws)
        good = pool.results([ws.group_id for ws in groups], timeout=10)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    by_key = {r["key"]: r for r in recs}
    keys = [VerdictCache.key(ws, CountingGrader()) for ws in groups]
    corruptions = [
        lambda r: r.update(verdict="not a verdict"),
        lambda r: r["verdict"].update(latency_s="fast"),
        lambda r: r["verdict"].update(latency_s=10**400),
        lambda r: r.update(verdict=None, reason="no-such-reason"),
        lambda r: r["verdict"]["verdicts"][0]["scores"].update(solution_fit=10**400),
    ]
    for key, corrupt in zip(keys, corruptions, strict=False):
        corrupt(by_key[key])
    lines = [json.dumps(by_key[k]) for k in keys[:5]] + [json.dumps(by_key[keys[5]])]
    path.write_text("\n".join(lines) + '\n[1, 2]\n"text"\n')
    again = CountingGrader(0.0)
    with GradingPool(again, max_concurrency=2, deadline_s=10, cache=path) as pool:
        for ws in groups:
            pool.submit(ws)  # must not raise
        res = pool.results([ws.group_id for ws in groups], timeout=10)
        m = pool.metrics()
    assert again.calls == 5 and m["cache_corrupt"] == 5 and m["cache_hits"] == 1
    assert [r.verdict.judgements for r in res] == [r.verdict.judgements for r in good]
    assert [r.cached for r in res] == [False] * 5 + [True]
