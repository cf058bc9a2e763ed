"""SGLang as the training loop's rollout engine, with weight sync as a protocol.

``SGLangEngine`` wraps an :class:`~gagar_jax.rollout.sglang_client.SGLangClient` (one server or
a router) and implements ``RolloutEngine``. ``sync_weights(params, version)`` after every update:

1. **pause**: new ``generate`` calls wait at a gate;
2. **drain**: in-flight calls finish (up to ``drain_timeout_s``); past it the server is asked to
   abort them (``/abort_request``), the client retries every aborted request, and since a retry
   may be served by either weight version, the sample-level version check below resubmits it;
3. **export** the new weights atomically: ``export_fn`` writes the safetensors directory under a
   temporary name, which is renamed to ``sync_dir/v<version>`` only when complete (a reader
   never sees a half-written checkpoint);
4. ``/update_weights_from_disk`` with ``weight_version = version``; the client checks the
   version every worker reports (a router's workers one by one);
5. **flush** the prefix cache (``/flush_cache``: no KV entry of the old weights is reused);
6. **resume** the gate.

Failure: if step 4 fails or only some workers report the new version, every worker is rolled
back to the previous version's directory and the update is retried (``max_sync_attempts``); if
the rollback itself fails the error says so. The previous directory is kept until the next
update succeeds.

Version check: every sample carries the ``weight_version`` its server reported. A sample whose
version differs from the engine's current one (an in-flight request that crossed an update, a
server restarted from its launch weights after a crash, which reports ``default``) is never
returned: if the server is behind, the current weights are pushed to it again, then the slot is
resubmitted with the same seed. Each slot is filled exactly once (none lost, none duplicated).

Several hosts sharing the servers (one engine per JAX process, ``exchange`` given): only the
**weight writer** (``writer=True``; the loop's ``rollout.weight_writer``, default process 0)
writes the export and runs steps 4-5. Every host pauses and drains its own requests and calls
``export_fn`` (the export is a collective: each tensor is gathered with every host's part, and
only the writer's call writes). Then all hosts exchange their outcome (``exchange``, the loop's
deadline-bounded allgather): if any host failed -- the writer's update after its rollbacks and
retries, or a host's export -- every host raises the same :class:`WeightSyncError` naming the
process and its error. Otherwise each other host waits, before it resumes sampling, until every
worker reports the new version (the version handshake, :meth:`SGLangEngine.await_version`), and
takes it as its current version; so no host samples with stale weights, and the sample-level
version check below holds on every host.

Counters in ``engine.metrics``: syncs, sync_failures, rollbacks, drain_aborts, resubmitted,
repushes, followed (syncs this host took from the writer).
"""

from __future__ import annotations

import collections
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from gagar_jax.rollout.sglang_client import SGLangClient, SGLangError
from gagar_jax.rollout.types import Sample, SamplingParams


class WeightSyncError(RuntimeError):
    """The server could not be brought to a consistent weight version."""


class SGLangEngine:
    """``RolloutEngine`` over SGLang with the weight-sync protocol (module docstring).

    Args:
      client: the SGLang client (server or router URL).
      export_fn: ``export_fn(params, directory)`` writes the weights as an HF safetensors
        directory (only called with a fresh, empty ``directory``). None: ``sync_weights`` takes
        a directory path.
      sync_dir: where exported versions live (``v<version>``); readable by the server.
      drain_timeout_s: how long in-flight generations may take before they are aborted.
      max_sync_attempts: update attempts (each failed one rolled back) before giving up.
      max_resubmits: per generate call, how often stale slots are resubmitted before it fails.
      keep_versions: exported directories kept (the current and the previous one at least).
      writer: this engine writes the export and updates the servers (one host of several
        sharing them; always True for a single host). A non-writer's ``export_fn`` must take
        part in the export's collectives and write nothing.
      exchange: ``exchange(tag, value) -> [value of every host]`` (JSON values, same order on
        every host; the loop's ``Hosts.allgather``) when several hosts share the servers; None
        for one host.
      version_timeout_s: how long a non-writer waits for the servers to report the writer's
        version after the writer succeeded.
    """

    def __init__(
        self,
        client: SGLangClient,
        *,
        export_fn: Callable[[Any, str], None] | None,
        sync_dir: str,
        drain_timeout_s: float = 60.0,
        max_sync_attempts: int = 3,
        max_resubmits: int = 4,
        keep_versions: int = 2,
        writer: bool = True,
        exchange: Callable[[str, Any], list[Any]] | None = None,
        version_timeout_s: float = 120.0,
    ):
        if not writer and exchange is None:
            raise ValueError("SGLangEngine(writer=False) needs an exchange with the writer host")
        self.writer = bool(writer)
        self.exchange = exchange
        self.version_timeout_s = float(version_timeout_s)
        self._num_syncs = 0  # identical on every host: names each sync's exchange
        self.client = client
        self.export_fn = export_fn
        self.sync_dir = sync_dir
        self.drain_timeout_s = float(drain_timeout_s)
        self.max_sync_attempts = int(max_sync_attempts)
        self.max_resubmits = int(max_resubmits)
        self.keep_versions = max(int(keep_versions), 2)
        self.version: int | None = None  # the version every sample must carry (None: launch)
        self.path: str | None = None  # the directory of that version
        self.metrics: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._weights = threading.RLock()  # one weight operation at a time (sync, repush)
        self._paused = False
        self._inflight = 0

    # ---- generation ------------------------------------------------------------------------
    def _enter(self) -> None:
        with self._cond:
            while self._paused:
                self._cond.wait()
            self._inflight += 1

    def _leave(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    @staticmethod
    def sample_version(sample: Sample) -> str:
        """The weight version the serving worker reported for ``sample`` ("default" = its
        launch weights)."""
        return str(sample.meta.get("weight_version", sample.policy_version))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        """``prompt_seeds``: one seed per prompt (the client's), so a prompt's samples do not
        depend on the other prompts of the call (multi-host loops split prompts over hosts)."""
        self._enter()
        try:
            out = self.client.generate(prompts, params, prompt_seeds=prompt_seeds)
            for attempt in range(self.max_resubmits + 1):
                stale = [
                    (i, j)
                    for i, row in enumerate(out)
                    for j, s in enumerate(row)
                    if not self._current(s)
                ]
                if not stale:
                    return out
                if attempt == self.max_resubmits:
                    break
                self.metrics["resubmitted"] += len(stale)
                self._repush_if_behind(out[stale[0][0]][stale[0][1]])
                for i, j in stale:
                    # the slot's own seed, as the client derives it for (prompt i, sample j)
                    if prompt_seeds is not None:
                        seed = (int(prompt_seeds[i]) + j) % 2**31
                    else:
                        seed = None if params.seed is None else params.seed + 1_000_003 * i + j
                    one = SamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k,
                        max_tokens=params.max_tokens,
                        stop_token_ids=params.stop_token_ids,
                        seed=seed,
                    )
                    out[i][j] = self.client.generate([prompts[i]], one)[0][0]
            raise WeightSyncError(
                f"{len(stale)} sample(s) still carry another weight version than "
                f"{self.version} after {self.max_resubmits} resubmissions "
                f"({self.client.base_url})"
            )
        finally:
            self._leave()

    async def agenerate(self, prompts, params, *, prompt_seeds=None):
        import asyncio

        return await asyncio.to_thread(self.generate, prompts, params, prompt_seeds=prompt_seeds)

    def _current(self, sample: Sample) -> bool:
        if sample.finish_reason == "abort":
            return True  # an empty abort sample (client on_failure="abort"): no tokens to tag
        want = "default" if self.version is None else str(self.version)
        return self.sample_version(sample) == want

    def _repush_if_behind(self, sample: Sample) -> None:
        """A worker serving other weights than ours (e.g. restarted from its launch
        checkpoint): push the current version again (every worker)."""
        with self._weights:  # after a concurrent sync: push what is current now
            if self.path is None or self.version is None:
                return
            self.metrics["repushes"] += 1
            self.client.update_weights_from_disk(self.path, self.version)
            self._flush()

    # ---- weight sync -----------------------------------------------------------------------
    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        with self._cond:
            while self._inflight and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            if not self._inflight:
                return
        # still running: abort them on the server; the client retries each aborted request
        # and the version check resubmits what crossed the update
        self.metrics["drain_aborts"] += 1
        self._post("/abort_request", {"rid": "", "abort_all": True})

    def _post(self, path: str, payload: dict | None = None) -> bool:
        try:
            r = httpx.post(
                f"{self.client.base_url}{path}", json=payload, timeout=30.0, trust_env=False
            )
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    def _flush(self) -> None:
        if not self._post("/flush_cache"):
            self.metrics["flush_failures"] += 1

    def _export(self, params, version: int) -> str:
        os.makedirs(self.sync_dir, exist_ok=True)
        final = self.version_dir(version)
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        self.export_fn(params, tmp)
        for name in os.listdir(tmp):  # the files are complete on disk before the rename
            fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        shutil.rmtree(final, ignore_errors=True)  # a stale export of this version
        os.replace(tmp, final)
        return final

    def _prune(self) -> None:
        if not os.path.isdir(self.sync_dir):
            return
        keep = {os.path.basename(p) for p in (self.path,) if p}
        names = sorted(
            n for n in os.listdir(self.sync_dir) if n.startswith("v") and n[1:].isdigit()
        )
        for n in names[: max(len(names) - self.keep_versions, 0)]:
            if n not in keep:
                shutil.rmtree(os.path.join(self.sync_dir, n), ignore_errors=True)

    def version_dir(self, version: int) -> str:
        """Where version ``version``'s export lives (the same path on every host)."""
        return os.path.join(self.sync_dir, f"v{int(version):06d}")

    def sync_weights(self, params_or_path: Any, version: int) -> int:
        """The protocol of the module docstring; returns the version every worker reports."""
        version = int(version)
        self._num_syncs += 1
        with self._cond:
            self._paused = True
        try:
            self._drain()
            if self.exchange is None:
                return self._write_and_update(params_or_path, version)
            error, got = None, None
            try:
                if self.writer:
                    got = self._write_and_update(params_or_path, version)
                elif not isinstance(params_or_path, (str, os.PathLike)):
                    if self.export_fn is None:
                        raise TypeError(
                            "SGLangEngine.sync_weights got parameters but has no export_fn"
                        )
                    self.export_fn(params_or_path, self.version_dir(version))  # writes nothing
            except (WeightSyncError, SGLangError, OSError, TypeError, ValueError) as e:
                # told to every host, raised below. Not caught: a broken collective (a peer
                # died during the export's gathers), which the loop names at its own barrier
                error = f"{type(e).__name__}: {e}"
            parts = self.exchange(
                f"weights/{self._num_syncs}/v{version}", {"error": error, "writer": self.writer}
            )
            failed = [(q, p) for q, p in enumerate(parts) if p["error"]]
            if failed:
                raise WeightSyncError(
                    f"weight sync to version {version} failed on "
                    + "; ".join(
                        f"process {q}{' (the weight writer)' if p['writer'] else ''}: {p['error']}"
                        for q, p in failed
                    )
                )
            if self.writer:
                return got
            got = self.await_version(version)
            path = (
                os.fspath(params_or_path)
                if isinstance(params_or_path, (str, os.PathLike))
                else self.version_dir(version)
            )
            with self._weights:
                self.version, self.path = got, path
            self.metrics["followed"] += 1
            return got
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def await_version(self, version: int, *, poll_s: float = 0.1) -> int:
        """Waits until every worker reports ``version`` (the version handshake of a host that
        did not run the update itself); raises :class:`WeightSyncError` after
        ``version_timeout_s`` naming what they report."""
        deadline = time.monotonic() + self.version_timeout_s
        while True:
            reported = self.client.reported_versions()
            if reported and all(v == int(version) for v in reported):
                return int(version)
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{self.client.base_url} reports weight versions {reported}, not {version}, "
                    f"{self.version_timeout_s:g}s after the weight writer's update"
                )
            time.sleep(poll_s)

    def _write_and_update(self, params_or_path: Any, version: int) -> int:
        """Steps 3-5 (the writer's part): export, update with rollback and retries, flush."""
        if isinstance(params_or_path, (str, os.PathLike)):
            path = os.fspath(params_or_path)
        elif self.export_fn is None:
            raise TypeError("SGLangEngine.sync_weights got parameters but has no export_fn")
        else:
            path = self._export(params_or_path, version)
        last: Exception | None = None
        with self._weights:
            for _ in range(self.max_sync_attempts):
                try:
                    got = self.client.update_weights_from_disk(path, version)
                    self._flush()
                    self.version, self.path = got, path
                    self.metrics["syncs"] += 1
                    self._prune()
                    return got
                except SGLangError as e:
                    last = e
                    self.metrics["sync_failures"] += 1
                    self._rollback()
        raise WeightSyncError(
            f"weight sync to version {version} failed {self.max_sync_attempts} times at "
            f"{self.client.base_url}; rolled back to {self.version}: {last}"
        )

    def _rollback(self) -> None:
        """Every worker back to the previous version (a partial update leaves a mix)."""
        if self.path is None or self.version is None:
            return  # nothing pushed yet: the launch weights are the previous version
        self.metrics["rollbacks"] += 1
        try:
            self.client.update_weights_from_disk(self.path, self.version)
            self._flush()
        except SGLangError as e:
            raise WeightSyncError(
                f"rollback to version {self.version} ({self.path}) failed at "
                f"{self.client.base_url}: {e}; the workers may serve mixed versions"
            ) from e
