"""How the gateway reaches a rollout engine: one prompt's ids in, one ``Sample`` out.

* :class:`BatchingBackend` (the embedded sampler): calls that arrive within ``window_s`` of each
  other and share their sampling parameters go to the engine as one batched ``agenerate`` call
  (one compiled program for up to ``max_batch`` rows), one batch at a time, so 64 concurrent
  sessions cost a few batched calls rather than 64 single-row ones.
* :class:`DirectBackend` (an SGLang server or router): each call is its own request; the server
  batches (continuous batching) and the client bounds concurrency and retries.

Both pass one seed per prompt (``prompt_seeds``), so a call's sample does not depend on the other
calls it was batched with. An engine that fails for a reason other than the request itself (a
server down after the client's retries, a crashed device) is :class:`EngineUnavailable`: the
gateway answers 503 and marks the episode ``infra_error``.
"""

from __future__ import annotations

import asyncio
import dataclasses

from gagar_jax.rollout.sglang_client import SGLangRequestError, SGLangUnavailableError
from gagar_jax.rollout.types import Sample, SamplingParams


class EngineUnavailable(RuntimeError):
    """The engine could not answer (infrastructure, not the request)."""


def _classify(e: BaseException) -> BaseException:
    if isinstance(e, (SGLangRequestError, ValueError, TypeError)) and not isinstance(
        e, SGLangUnavailableError
    ):
        return e  # the request's fault: a 400
    return EngineUnavailable(f"{type(e).__name__}: {e}")


class DirectBackend:
    """One engine call per model call."""

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int) -> Sample:
        try:
            out = await self.engine.agenerate([prompt_ids], params, prompt_seeds=[seed])
        except Exception as e:  # noqa: BLE001 -- classified: request error or infrastructure
            raise _classify(e) from e
        return out[0][0]

    async def aclose(self) -> None:
        return None


@dataclasses.dataclass
class _Pending:
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    future: asyncio.Future


class BatchingBackend:
    """Batches concurrent calls with equal sampling parameters into one engine call.

    Args:
      engine: a ``RolloutEngine`` with ``agenerate(prompts, params, prompt_seeds=...)``.
      max_batch: rows per engine call at most.
      window_s: how long the first call of a batch waits for others to join it.
    """

    def __init__(self, engine, *, max_batch: int = 64, window_s: float = 0.002):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.max_batch = int(max_batch)
        self.window_s = float(window_s)
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None
        self.batches = 0  # engine calls made
        self.rows = 0  # model calls served

    def _ensure_worker(self):
        if self._worker is None or self._worker.done():
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._run())

    async def generate(self, prompt_ids: list[int], params: SamplingParams, seed: int) -> Sample:
        self._ensure_worker()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(prompt_ids, params, seed, fut))
        return await fut

    async def _run(self):
        q = self._queue
        while True:
            first = await q.get()
            batch = [first]
            deadline = asyncio.get_running_loop().time() + self.window_s
            while len(batch) < self.max_batch:
                timeout = deadline - asyncio.get_running_loop().time()
                try:
                    batch.append(
                        q.get_nowait() if timeout <= 0 else await asyncio.wait_for(q.get(), timeout)
                    )
                except (asyncio.QueueEmpty, TimeoutError):
                    break
            groups: dict[SamplingParams, list[_Pending]] = {}
            for p in batch:
                groups.setdefault(p.params, []).append(p)
            for params, items in groups.items():
                await self._call(params, items)

    async def _call(self, params: SamplingParams, items: list[_Pending]):
        self.batches += 1
        self.rows += len(items)
        try:
            out = await self.engine.agenerate(
                [p.prompt_ids for p in items], params, prompt_seeds=[p.seed for p in items]
            )
        except Exception as e:  # noqa: BLE001 -- handed to every waiting call, classified
            err = _classify(e)
            for p in items:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        for p, samples in zip(items, out):
            if not p.future.done():
                p.future.set_result(samples[0])

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 -- shutting down
                pass
            self._worker = None
