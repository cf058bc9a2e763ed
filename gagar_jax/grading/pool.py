"""Asynchronous grading pool: grade groups while the next batch generates, never stall the caller.

Groups are ``submit``-ted as soon as their last rollout is verified; up to ``max_concurrency``
graders run at once on threads (graders mostly wait on I/O: an LLM endpoint or a sandbox; the
heuristic grader takes milliseconds). ``results`` collects one ``GradeResult`` per group for the
policy update, waiting at most ``timeout`` seconds.

Fail-safe rules (each counted in ``metrics()`` under ``fallback/<reason>``):

* a grader that raises (any ``BaseException``, ``SystemExit`` included) -> ``grader_error``;
* output that fails validation -> the ``RejectReason`` (malformed output, missing candidate, ...);
* no verdict ``deadline_s`` after its grading started, or by the caller's ``timeout`` ->
  ``deadline``; ``cancel`` -> ``cancelled``.

Python cannot kill a thread. A grader past its deadline is sent its ``cancel`` event (graders
that take one stop at their next check: the agentic grader between steps, ``SleepGrader`` at
once); one that ignores it keeps its daemon thread until it returns, but its slot is released at
the deadline, its late result is discarded (``late_results``) and ``abandoned`` counts such
threads. So a hanging grader costs one thread, never a slot, a step or the run. A grader that must
be killed hard belongs in a subprocess or behind a server with its own timeout (the agentic
grader's client has one).

The cache is keyed by the workspace's content and the grader's ``cache_id`` (its id, version and
settings; ``grader_id@version`` if absent), so a resumed run (same rollouts, same grader) does not
re-grade; with ``cache=<path>`` it is a JSON-lines file read at start and appended to after each
grading (a torn last line from a crash is skipped). Accepted
verdicts and validation rejections are cached (both are the grader's answer to that content);
transient outcomes (deadline, crash, cancel) are not.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import inspect
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from gagar_jax.grading import schema
from gagar_jax.grading.schema import (
    FallbackReason,
    GradeResult,
    GroupWorkspace,
    Verdict,
    VerdictRejected,
)


class Grader(Protocol):
    """What the pool runs: ``grade`` returns a ``Verdict``, JSON text or a dict (all validated)."""

    grader_id: str
    version: str

    def grade(self, workspace: GroupWorkspace, cancel: threading.Event | None = None) -> Any: ...


def accept_output(output: Any, workspace: GroupWorkspace, grader: Any, latency_s: float) -> Verdict:
    """Validates whatever a grader returned; raises ``VerdictRejected`` for anything unusable."""
    if isinstance(output, Verdict):
        return schema.validate(output, workspace)
    if isinstance(output, str | Mapping):
        return schema.parse_verdict(
            output,
            workspace,
            grader_id=str(getattr(grader, "grader_id", type(grader).__name__)),
            grader_version=str(getattr(grader, "version", "")),
            latency_s=latency_s,
        )
    raise VerdictRejected(
        schema.RejectReason.MALFORMED, f"grader returned {type(output).__name__}, not a verdict"
    )


class VerdictCache:
    """Content-keyed store of grading outcomes, optionally persisted as JSON lines."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = os.fspath(path) if path is not None else None
        self._entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._torn_tail = False
        if self.path and os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
            self._torn_tail = bool(text) and not text.endswith("\n")
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                    self._entries[rec["key"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn line from an interrupted write

    @staticmethod
    def key(workspace: GroupWorkspace, grader: Any) -> str:
        name = getattr(grader, "grader_id", type(grader).__name__)
        # A grader may fingerprint its settings (model, budgets, thresholds) in ``cache_id``.
        gid = getattr(grader, "cache_id", None) or f"{name}@{getattr(grader, 'version', '')}"
        return hashlib.sha256(f"{gid}\n{workspace.content_key()}".encode()).hexdigest()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, result: GradeResult) -> None:
        rec = {
            "key": key,
            "group_id": result.group_id,
            "verdict": schema.verdict_to_dict(result.verdict) if result.verdict else None,
            "reason": result.fallback_reason.value if result.fallback_reason else None,
            "detail": result.detail,
        }
        with self._lock:
            self._entries[key] = rec
            if self.path:
                with open(self.path, "a", encoding="utf-8") as f:
                    # After a torn last line, start on a fresh line so this record stays whole.
                    f.write(("\n" if self._torn_tail else "") + json.dumps(rec) + "\n")
                    self._torn_tail = False
                    f.flush()


@dataclasses.dataclass
class _Job:
    workspace: GroupWorkspace
    key: str
    submitted_at: float
    cancel: threading.Event = dataclasses.field(default_factory=threading.Event)
    started_at: float | None = None
    result: GradeResult | None = None
    thread: threading.Thread | None = None


class GradingPool:
    """Bounded-concurrency grading with per-group deadlines, cancellation, cache and metrics.

    Args:
      grader: any object with ``grade(workspace[, cancel])`` (see ``Grader``).
      max_concurrency: graders running at once.
      deadline_s: seconds a group may spend grading (from its start) before it falls back.
      cache: a ``VerdictCache``, a file path for a persisted one, or None for an in-memory one.
      cache_rejections: also cache validation rejections (see the module docstring).
      backend: an execution back-end (``gagar_jax.verify.execution``) to run each grading on
        (the grader is shipped to a Ray node): a grader past its deadline is then killed with
        its process tree, not abandoned; an infrastructure failure falls back as
        ``grader_error`` (counted in ``infra_errors``). None: graders run on threads here.
    """

    def __init__(
        self,
        grader: Any,
        max_concurrency: int = 4,
        deadline_s: float = 600.0,
        *,
        cache: VerdictCache | str | os.PathLike | None = None,
        cache_rejections: bool = True,
        backend: Any = None,
    ):
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(
                f"GradingPool.max_concurrency must be an int >= 1, got {max_concurrency!r}"
            )
        if not deadline_s > 0:
            raise ValueError(f"GradingPool.deadline_s must be > 0 seconds, got {deadline_s!r}")
        self.grader = grader
        self.max_concurrency = max_concurrency
        self.deadline_s = float(deadline_s)
        self.cache = cache if isinstance(cache, VerdictCache) else VerdictCache(cache)
        self.cache_rejections = cache_rejections
        self.backend = backend
        try:
            self._pass_cancel = "cancel" in inspect.signature(grader.grade).parameters
        except (TypeError, ValueError, AttributeError):
            self._pass_cancel = False
        self._cond = threading.Condition()
        self._jobs: dict[str, _Job] = {}
        self._queue: collections.deque[str] = collections.deque()
        self._running: set[str] = set()
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()
        self._fallbacks: collections.Counter[str] = collections.Counter()
        self._tiers: collections.Counter[int] = collections.Counter()
        self._latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self._waits: collections.deque[float] = collections.deque(maxlen=10_000)
        self._agreements: collections.deque[float] = collections.deque(maxlen=10_000)
        self._max_queue = 0
        self._abandoned: list[threading.Thread] = []  # threads past their deadline, still running
        self._on_finish: list[Callable[[str], Any]] = []
        self._supervisor = threading.Thread(
            target=self._supervise, name="grading-pool", daemon=True
        )
        self._supervisor.start()

    # -- public API --------------------------------------------------------------------------

    def submit(self, workspace: GroupWorkspace) -> None:
        """Queues ``workspace`` for grading (a cache hit completes at once). Never blocks."""
        if not isinstance(workspace, GroupWorkspace):
            raise TypeError(f"GradingPool.submit: expected a GroupWorkspace, got {type(workspace)}")
        key = VerdictCache.key(workspace, self.grader)
        now = time.monotonic()
        with self._cond:
            if self._closed:
                raise RuntimeError("GradingPool.submit after close()")
            old = self._jobs.get(workspace.group_id)
            if old is not None and old.result is None:
                if old.key == key:
                    return  # already being graded
                self._finish(
                    old,
                    GradeResult.fallback(
                        old.workspace, FallbackReason.CANCELLED, "replaced by a resubmission"
                    ),
                )
            job = _Job(workspace, key, now)
            self._jobs[workspace.group_id] = job
            self._counts["submitted"] += 1
            hit = self._from_cache(job)
            if hit is not None:
                self._counts["cache_hits"] += 1
                self._finish(job, hit)
                return
            self._queue.append(workspace.group_id)
            self._max_queue = max(self._max_queue, len(self._queue))
            self._cond.notify_all()

    def results(
        self, group_ids: Iterable[str], timeout: float | None = None, *, keep: bool = False
    ) -> list[GradeResult]:
        """One ``GradeResult`` per id, in order, waiting at most ``timeout`` seconds in all.

        Groups still unfinished at the timeout fall back with ``deadline`` (and are cancelled);
        ids never submitted fall back with ``not_submitted``. Finished groups are forgotten
        unless ``keep`` (the cache still holds their verdicts).
        """
        ids = list(group_ids)
        end = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                pending = [g for g in ids if g in self._jobs and self._jobs[g].result is None]
                if not pending:
                    break
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    for g in pending:
                        self._finish(
                            self._jobs[g],
                            GradeResult.fallback(
                                self._jobs[g].workspace,
                                FallbackReason.DEADLINE,
                                f"no verdict within the caller's timeout of {timeout} s",
                            ),
                        )
                    break
                self._cond.wait(left)
            out = []
            for g in ids:
                job = self._jobs.get(g)
                if job is None:
                    self._fallbacks[FallbackReason.NOT_SUBMITTED.value] += 1
                    out.append(GradeResult(g, None, FallbackReason.NOT_SUBMITTED))
                    continue
                out.append(job.result)
            if not keep:
                for g in ids:
                    self._jobs.pop(g, None)
            return out

    async def aresults(
        self, group_ids: Iterable[str], timeout: float | None = None, *, keep: bool = False
    ) -> list[GradeResult]:
        """``results`` for asyncio callers (waits in a worker thread; the event loop stays free)."""
        return await asyncio.to_thread(self.results, list(group_ids), timeout, keep=keep)

    def cancel(self, group_id: str) -> bool:
        """Cancels a queued or running group (result: ``cancelled``); False if none is pending."""
        with self._cond:
            job = self._jobs.get(group_id)
            if job is None or job.result is not None:
                return False
            self._finish(job, GradeResult.fallback(job.workspace, FallbackReason.CANCELLED))
            return True

    def add_finish_callback(self, fn: Callable[[str], Any]) -> None:
        """Calls ``fn(group_id)`` each time a group gets its result (a verdict, a cached one or
        a fallback), under the pool's lock: ``fn`` must be quick and must not call the pool.
        The loop frees the group's grader slot of the execution back-end with it."""
        with self._cond:
            self._on_finish.append(fn)

    def done(self, group_id: str) -> bool:
        with self._cond:
            job = self._jobs.get(group_id)
            return job is not None and job.result is not None

    def close(self) -> None:
        """Cancels everything pending and stops the supervisor (running graders get ``cancel``)."""
        with self._cond:
            for job in list(self._jobs.values()):
                if job.result is None:
                    self._finish(job, GradeResult.fallback(job.workspace, FallbackReason.CANCELLED))
            self._closed = True
            self._cond.notify_all()
        self._supervisor.join(timeout=5)

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict[str, float]:
        """A flat dict of scalars (see the module docstring for the fallback keys).

        ``latency_*`` is grading time (start to result), ``queue_wait_mean_s`` submission to start,
        ``vote_agreement_mean`` the self-consistency agreement over ``voted_groups`` (0 when none).
        """
        with self._cond:
            lat = np.asarray(self._latencies, np.float64)
            finished = self._counts["accepted"] + sum(self._fallbacks.values())
            judged = sum(self._tiers.values())
            out: dict[str, float] = {
                "submitted": self._counts["submitted"],
                "accepted": self._counts["accepted"],
                "cache_hits": self._counts["cache_hits"],
                "cache_corrupt": self._counts["cache_corrupt"],
                "queue_depth": len(self._queue),
                "max_queue_depth": self._max_queue,
                "running": len(self._running),
                "abandoned": sum(1 for j in self._abandoned if j.is_alive()),
                "late_results": self._counts["late_results"],
                "infra_errors": self._counts["infra_errors"],
                "latency_mean_s": float(lat.mean()) if lat.size else 0.0,
                "latency_p50_s": float(np.percentile(lat, 50)) if lat.size else 0.0,
                "latency_p95_s": float(np.percentile(lat, 95)) if lat.size else 0.0,
                "latency_max_s": float(lat.max()) if lat.size else 0.0,
                "queue_wait_mean_s": float(np.mean(self._waits)) if self._waits else 0.0,
                "voted_groups": len(self._agreements),
                "vote_agreement_mean": float(np.mean(self._agreements))
                if self._agreements
                else 0.0,
                "fallback_rate": sum(self._fallbacks.values()) / max(finished, 1),
                "t1_share": self._tiers[1] / max(judged, 1),
            }
            for t in range(1, schema.NUM_TIERS + 1):
                out[f"tier/{t}"] = self._tiers[t]
            for reason in FallbackReason:
                out[f"fallback/{reason.value}"] = self._fallbacks[reason.value]
            return out

    # -- internals ---------------------------------------------------------------------------

    def _grade_on_backend(self, ws: GroupWorkspace) -> Any:
        r = self.backend.call(
            _grade_call, self.grader, ws, deadline_s=self.deadline_s, kind="grade"
        )
        if r.ok:
            return r.value
        with self._cond:
            self._counts["timeouts" if r.status == "timeout" else "infra_errors"] += 1
        raise _CallFailed(f"{r.status}: {r.error}")

    def _from_cache(self, job: _Job) -> GradeResult | None:
        """The cached result for ``job``, or None. A record that does not read back as a result
        (a verdict that is a string, a latency of ``"fast"`` or ``10**400``, an unknown reason)
        is ignored, counted in ``cache_corrupt``, and the group is graded again."""
        rec = self.cache.get(job.key)
        if rec is None:
            return None
        try:
            return self._read_cached(rec, job.workspace)
        except Exception:  # noqa: BLE001 - a corrupt record must never take submit() down
            self._counts["cache_corrupt"] += 1
            return None

    @staticmethod
    def _read_cached(rec: Any, ws: GroupWorkspace) -> GradeResult:
        if not isinstance(rec, Mapping):
            raise VerdictRejected(schema.RejectReason.MALFORMED, "cache record is not an object")
        if rec.get("verdict") is not None:
            v = schema.verdict_from_dict(rec["verdict"], ws)  # stale or corrupt: raises
            return GradeResult.accepted(ws, v, cached=True)
        reason = FallbackReason(rec.get("reason"))
        detail = rec.get("detail", "")
        if not isinstance(detail, str):
            raise VerdictRejected(schema.RejectReason.MALFORMED, "cache detail is not text")
        return dataclasses.replace(GradeResult.fallback(ws, reason, detail), cached=True)

    def _finish(self, job: _Job, result: GradeResult) -> None:
        """Records ``result`` for ``job`` (lock held). The first result wins."""
        if job.result is not None:
            return
        job.result = result
        gid = job.workspace.group_id
        if gid in self._queue:
            self._queue.remove(gid)
        if gid in self._running:
            self._running.discard(gid)
            if result.fallback_reason in (FallbackReason.DEADLINE, FallbackReason.CANCELLED):
                job.cancel.set()
                if job.thread is not None and job.thread.is_alive():
                    self._abandoned = [t for t in self._abandoned if t.is_alive()]
                    self._abandoned.append(job.thread)
        if not result.cached and job.started_at is not None:
            self._latencies.append(result.latency_s)
        if result.verdict is not None:
            self._counts["accepted"] += 1
            for j in result.verdict.judgements:
                self._tiers[j.tier] += 1
            if result.verdict.agreement is not None:
                self._agreements.append(result.verdict.agreement)
        else:
            self._fallbacks[result.fallback_reason.value] += 1
        for fn in self._on_finish:
            try:
                fn(gid)
            except Exception:  # noqa: BLE001 - a hook must never lose the result
                self._counts["finish_hook_errors"] += 1
        self._cond.notify_all()

    def _supervise(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for gid in list(self._running):
                    job = self._jobs.get(gid)
                    if job is not None and now - job.started_at >= self.deadline_s:
                        self._finish(
                            job,
                            GradeResult.fallback(
                                job.workspace,
                                FallbackReason.DEADLINE,
                                f"no verdict within deadline_s={self.deadline_s}",
                                latency_s=now - job.started_at,
                            ),
                        )
                while self._queue and len(self._running) < self.max_concurrency:
                    gid = self._queue.popleft()
                    job = self._jobs[gid]
                    job.started_at = time.monotonic()
                    self._waits.append(job.started_at - job.submitted_at)
                    self._running.add(gid)
                    job.thread = threading.Thread(
                        target=self._work, args=(job,), name=f"grade-{gid}", daemon=True
                    )
                    job.thread.start()
                starts = [self._jobs[g].started_at for g in self._running if g in self._jobs]
                wait = None if not starts else max(0.0, min(starts) + self.deadline_s - now)
                self._cond.wait(wait if wait is None else wait + 1e-3)

    def _work(self, job: _Job) -> None:
        ws = job.workspace
        t0 = time.monotonic()
        cacheable = False
        try:
            if self.backend is not None:
                out = self._grade_on_backend(ws)
            elif self._pass_cancel:
                out = self.grader.grade(ws, cancel=job.cancel)
            else:
                out = self.grader.grade(ws)
            latency = time.monotonic() - t0
            verdict = accept_output(out, ws, self.grader, latency)
            result = GradeResult.accepted(ws, verdict, latency_s=latency)
            cacheable = True
        except VerdictRejected as e:
            result = GradeResult.fallback(
                ws, FallbackReason(e.reason.value), e.detail, latency_s=time.monotonic() - t0
            )
            cacheable = self.cache_rejections
        except BaseException as e:  # noqa: BLE001 - a grader must never take the caller down
            result = GradeResult.fallback(
                ws,
                FallbackReason.GRADER_ERROR,
                f"{type(e).__name__}: {e}"[:500],
                latency_s=time.monotonic() - t0,
            )
        if cacheable:  # before the result is published, so a finished group is always on disk
            try:
                self.cache.put(job.key, result)
            except OSError:
                with self._cond:
                    self._counts["cache_write_errors"] += 1
        with self._cond:
            if job.result is not None:
                self._counts["late_results"] += 1
                return
            self._finish(job, result)


def _grade_call(grader: Any, workspace: GroupWorkspace) -> Any:
    """One grading, as an execution back-end runs it (on a node)."""
    return grader.grade(workspace)


class _CallFailed(Exception):
    pass


def grade_all(
    grader: Any, workspaces: Sequence[GroupWorkspace], **pool_kwargs: Any
) -> list[GradeResult]:
    """Grades ``workspaces`` through a temporary pool (a convenience for scripts and tests)."""
    with GradingPool(grader, **pool_kwargs) as pool:
        for ws in workspaces:
            pool.submit(ws)
        return pool.results([ws.group_id for ws in workspaces])
