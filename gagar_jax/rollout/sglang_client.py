"""A client for a real SGLang server (or an SGLang router in front of several) over HTTP.

Native API, the one that keeps token ids exact:
  `POST /generate` {"input_ids": [...], "sampling_params": {...}, "return_logprob": true,
                    "rid": ...}
  -> {"output_ids": [...], "meta_info": {"output_token_logprobs": [[logprob, id, text], ...],
      "finish_reason": {"type": "stop" | "length" | "abort", ...}, "weight_version": "...", ...}}
  with `record_routes` (a mixture of experts) also `"return_routed_experts": true` ->
  `meta_info["routed_experts"]` (`gagar_jax.rollout.sglang_routes`).
  `POST /update_weights_from_disk` {"model_path": dir, "weight_version": "7"} -> {"success": ...}
  `GET /health`; `POST /v1/chat/completions` (OpenAI-compatible, tools allowed) for the agentic
  grader.

Fault handling (all counted in `client.metrics`):
  * connection errors, timeouts, HTTP 5xx and 429 are retried with exponential backoff and jitter
    (delay_k = min(backoff_max_s, backoff_base_s * 2**k) * uniform(0.5, 1)), up to `max_retries`
    retries per request; then `SGLangUnavailableError` names the URL, the attempts and the last
    error;
  * other 4xx are the caller's bug: `SGLangRequestError` at once, with the server's message;
  * every sample of a batch owns one slot (prompt index, sample index) and one request id; a retry
    re-sends the same request for the same slot (with an attempt suffix on the server-side id, so a
    server that still runs the first attempt never rejects the second as a duplicate). A slot is
    filled exactly once, so a batch that survives a server restart comes back with every sample
    exactly once.
  * a generation that the server aborted (finish_reason "abort", e.g. it was shutting down) is
    retried like a connection error; `on_failure="abort"` turns spent retries into samples with
    finish_reason "abort" and no tokens (counted) instead of an exception, for callers that would
    rather drop a rollout from a group than stop a run.

Concurrency is bounded by an asyncio semaphore (`max_concurrency` requests in flight per call).
The sync methods run the async ones in a private event loop (in a worker thread when the caller
already runs one), so they are safe to call from notebooks and async code alike.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

from gagar_jax.rollout.sglang_routes import RoutesFormatError, routes_from_meta
from gagar_jax.rollout.types import Sample, SamplingParams, validate_prompts

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# Pauses before asking a router's `/workers` again when it lists none or does not answer.
_WORKERS_RETRY_PAUSES_S = (0.5, 2.0)


class SGLangError(RuntimeError):
    """Base class of the client's errors."""


class SGLangUnavailableError(SGLangError):
    """Retries spent on connection errors / 5xx: the message names the URL and the last error."""


class SGLangRequestError(SGLangError):
    """The server rejected a request (4xx) or answered something not of the documented shape."""


class _Retryable(Exception):
    """Internal: a failed attempt worth repeating."""


class _NotFound(Exception):
    """Internal: the endpoint does not exist there (e.g. a router)."""


_NOT_FOUND = object()


def _run_sync(coro):
    """Runs `coro` to completion from sync code, also when the calling thread already has a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="sglang-client-sync")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class SGLangClient:
    """Talks to one SGLang server or router. Implements the `RolloutEngine` protocol.

    Args:
      base_url: e.g. "http://127.0.0.1:30000" (a server) or a router's URL.
      max_concurrency: requests in flight at once per `generate` call.
      max_retries: retries per request after the first attempt (so max_retries + 1 attempts).
      max_retry_time_s: also stop retrying a request once this much time has passed since its
        first attempt (None: no time limit). Size it to cover a server restart.
      backoff_base_s, backoff_max_s: exponential backoff parameters (see module docstring).
      request_timeout_s: per-request timeout (connect, read and write).
      on_failure: "raise" (default) or "abort" (a failed sample comes back empty, finish "abort").
      ignore_eos: passed to the server: keep generating past the model's EOS token.
      policy_version: the version the served weights are believed to be at start.
      seed: seeds the backoff jitter (tests); sampling seeds go in SamplingParams.seed.
      vocab_size: if given, prompt token ids are checked against it before sending (SGLang 0.5.23
        does not check them: an out-of-vocabulary id crashes the server's scheduler).
      record_routes: a mixture-of-experts model's ``(layers, experts_per_token,
        num_experts)``: every request asks for the routed experts (``return_routed_experts``;
        the server must run with ``--enable-return-routed-experts``) and each sample carries
        them as the embedded sampler's do (``Sample.routes``, ``Sample.prompt_routes``;
        ``gagar_jax.rollout.sglang_routes``), for the update's routing replay. None: no routes.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_concurrency: int = 16,
        max_retries: int = 6,
        max_retry_time_s: float | None = None,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 10.0,
        request_timeout_s: float = 300.0,
        on_failure: str = "raise",
        ignore_eos: bool = False,
        policy_version: int = 0,
        seed: int | None = None,
        vocab_size: int | None = None,
        record_routes: tuple[int, int, int] | None = None,
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"SGLangClient.base_url must be an http(s) URL, got {base_url!r}")
        if max_concurrency < 1:
            raise ValueError(f"SGLangClient.max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"SGLangClient.max_retries must be >= 0, got {max_retries}")
        if on_failure not in ("raise", "abort"):
            raise ValueError(
                f"SGLangClient.on_failure must be 'raise' or 'abort', got {on_failure!r}"
            )
        if record_routes is not None and (
            len(tuple(record_routes)) != 3
            or not all(isinstance(x, int) and x > 0 for x in record_routes)
        ):
            raise ValueError(
                "SGLangClient.record_routes must be None or (layers, experts_per_token, "
                f"num_experts), positive ints, got {record_routes!r}"
            )
        self.record_routes = None if record_routes is None else tuple(record_routes)
        self.base_url = base_url.rstrip("/")
        self.max_concurrency = int(max_concurrency)
        self.max_retries = int(max_retries)
        self.max_retry_time_s = max_retry_time_s
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.request_timeout_s = float(request_timeout_s)
        self.on_failure = on_failure
        self.ignore_eos = bool(ignore_eos)
        self.policy_version = int(policy_version)
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._batch_counter = itertools.count()
        self._client_id = uuid.uuid4().hex[:8]
        self.metrics: collections.Counter[str] = collections.Counter()
        # a LoRA adapter loaded on the server (gagar_jax.rollout.weight_sync.SGLangLoraSync)
        # that every /generate request names; None: the served weights themselves
        self.lora_name: str | None = None

    # ------------------------------------------------------------------ plumbing

    def _backoff(self, attempt: int) -> float:
        cap = min(self.backoff_max_s, self.backoff_base_s * (2.0**attempt))
        return cap * (0.5 + 0.5 * self._rng.random())

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(self.request_timeout_s),
            limits=httpx.Limits(
                max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
            ),
            trust_env=False,  # never route loopback traffic through a proxy from the environment
        )

    async def _request(
        self,
        http: httpx.AsyncClient,
        method: str,
        path: str,
        payload: Any = None,
        *,
        check=None,
        what: str | None = None,
        not_found_ok: bool = False,
    ) -> Any:
        """One logical request with retries.

        `payload` may be a callable, called once per attempt (a fresh server-side request id each
        time); `check(json)` may raise _Retryable for soft failures (e.g. an aborted generation).
        """
        what = what or f"{method} {path}"
        last = "no attempt made"
        t0 = time.monotonic()
        attempts = 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = self._backoff(attempt - 1)
                if (
                    self.max_retry_time_s is not None
                    and time.monotonic() + delay - t0 > self.max_retry_time_s
                ):
                    break
                self.metrics["retries"] += 1
                await asyncio.sleep(delay)
            attempts += 1
            self.metrics["requests"] += 1
            try:
                body_json = payload() if callable(payload) else payload
                resp = await http.request(method, path, json=body_json)
            except httpx.TransportError as e:  # connect/read/write errors and timeouts
                self.metrics["connection_errors"] += 1
                last = f"{type(e).__name__}: {e}"
                continue
            if resp.status_code in _RETRY_STATUS:
                self.metrics["http_5xx"] += 1
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                continue
            if resp.status_code == 404 and not_found_ok:
                return _NOT_FOUND
            if resp.status_code >= 400:
                self.metrics["http_4xx"] += 1
                raise SGLangRequestError(
                    f"{what} at {self.base_url} was rejected: HTTP {resp.status_code}: "
                    f"{resp.text[:500]}"
                )
            try:
                body = resp.json()
            except ValueError as e:
                raise SGLangRequestError(
                    f"{what} at {self.base_url} answered non-JSON: {resp.text[:300]!r}"
                ) from e
            if check is not None:
                try:
                    check(body)
                except _Retryable as e:
                    self.metrics["soft_failures"] += 1
                    last = str(e)
                    continue
            return body
        self.metrics["failures"] += 1
        raise SGLangUnavailableError(
            f"SGLang server at {self.base_url} failed {what} after {attempts} attempts "
            f"over {time.monotonic() - t0:.1f} s; last error: {last}"
        )

    # ------------------------------------------------------------------ health / info

    async def ahealth(self, timeout_s: float = 5.0) -> bool:
        """True when `GET /health` answers 200 within `timeout_s` (no retries)."""
        try:
            async with httpx.AsyncClient(
                base_url=self.base_url, timeout=timeout_s, trust_env=False
            ) as http:
                resp = await http.get("/health")
            return resp.status_code == 200
        except httpx.TransportError:
            return False

    def health(self, timeout_s: float = 5.0) -> bool:
        return _run_sync(self.ahealth(timeout_s))

    def wait_healthy(self, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
        """Blocks until `/health` answers 200; else SGLangUnavailableError naming the URL."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health(timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                return
            time.sleep(poll_s)
        raise SGLangUnavailableError(
            f"SGLang server at {self.base_url} not healthy after {timeout_s:.0f} s (GET /health)"
        )

    def model_info(self) -> dict:
        async def go():
            async with self._new_http() as http:
                return await self._request(http, "GET", "/model_info")

        return _run_sync(go())

    # ------------------------------------------------------------------ generation

    def _sampling_payload(self, params: SamplingParams, sample_seed: int | None) -> dict:
        sp = {
            "max_new_tokens": int(params.max_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k > 0 else -1,
            "ignore_eos": self.ignore_eos,
        }
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if sample_seed is not None:
            sp["sampling_seed"] = int(sample_seed)
        return sp

    @staticmethod
    def _check_generate(body: Any) -> None:
        if not isinstance(body, dict) or "meta_info" not in body:
            raise SGLangRequestError(f"/generate answered an unexpected body: {str(body)[:300]}")
        fr = body["meta_info"].get("finish_reason") or {}
        if fr.get("type") == "abort":
            raise _Retryable(f"generation aborted by the server: {fr}")

    def _to_sample(
        self,
        body: dict,
        rid: str,
        stop_token_ids: tuple[int, ...] = (),
        prompt_len: int | None = None,
    ) -> Sample:
        meta = body["meta_info"]
        lp = meta.get("output_token_logprobs")
        if lp is None:
            raise SGLangRequestError("/generate answered without output_token_logprobs")
        tokens = [int(x[1]) for x in lp]
        out_ids = body.get("output_ids")
        if out_ids is not None and list(out_ids) != tokens:
            raise SGLangRequestError(
                f"/generate output_ids disagree with output_token_logprobs ids for request {rid}"
            )
        routes = {}
        if self.record_routes is not None and prompt_len is not None:
            layers, k, experts = self.record_routes
            try:
                prompt_routes, gen_routes = routes_from_meta(
                    meta, prompt_len, len(tokens), layers, k, experts
                )
            except RoutesFormatError as e:
                raise SGLangRequestError(f"/generate request {rid}: {e}") from e
            routes = dict(routes=gen_routes, prompt_routes=prompt_routes)
        fr = (meta.get("finish_reason") or {}).get("type", "length")
        matched = (meta.get("finish_reason") or {}).get("matched")
        logprobs = [float(x[0]) for x in lp]
        if self.ignore_eos and stop_token_ids:
            # SGLang's ignore_eos also disables stop_token_ids: enforce them here, exactly as a
            # server-side stop would (the stop token is kept, finish_reason "stop").
            cut = next((i for i, t in enumerate(tokens) if t in stop_token_ids), None)
            if cut is not None:
                tokens, logprobs = tokens[: cut + 1], logprobs[: cut + 1]
                fr, matched = "stop", tokens[cut]
                if routes:  # the stop token was fed back: its row is known
                    routes["routes"] = routes["routes"][: cut + 1]
        version = meta.get("weight_version")
        try:
            version = int(version)
        except (TypeError, ValueError):  # "default": a server that never got a weight update
            version = None
        # A server that reports another version than the last one this client pushed (e.g. one
        # restarted from its original checkpoint after a crash) is counted; the sample keeps the
        # version the server reports ("default" = the launch weights = version 0).
        if version is None:
            version = 0
        if version != self.policy_version:
            self.metrics["version_mismatch_samples"] += 1
        return Sample(
            tokens=tokens,
            logprobs=logprobs,
            finish_reason=fr if fr in ("stop", "length") else "length",
            policy_version=version,
            meta={
                "rid": rid,
                "e2e_latency": meta.get("e2e_latency"),
                "matched_stop": matched,
                # as the worker reported it ("default": its launch weights, never pushed)
                "weight_version": str(meta.get("weight_version") or "default"),
            },
            **routes,
        )

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        """`params.n` samples for each prompt via `/generate`, one request per sample.

        `prompt_seeds[i]` (optional, one per prompt) seeds prompt i's samples by themselves
        (sample j gets `prompt_seeds[i] + j`), whatever the other prompts of the call.
        """
        prompts = validate_prompts(prompts, self.vocab_size)
        if prompt_seeds is not None and len(prompt_seeds) != len(prompts):
            raise ValueError(
                f"prompt_seeds must have one seed per prompt: {len(prompt_seeds)} for "
                f"{len(prompts)} prompts"
            )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        batch = f"{self._client_id}-{next(self._batch_counter)}"
        results: list[list[Sample | None]] = [[None] * params.n for _ in prompts]
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(http, i: int, j: int):
            rid = f"{batch}-{i}-{j}"
            if prompt_seeds is not None:
                seed = (int(prompt_seeds[i]) + j) % 2**31
            else:
                seed = None if params.seed is None else params.seed + 1_000_003 * i + j
            attempt_box = itertools.count()

            def payload():
                body = {
                    "input_ids": prompts[i],
                    "sampling_params": self._sampling_payload(params, seed),
                    "return_logprob": True,
                    "logprob_start_len": -1,
                    "rid": f"{rid}.a{next(attempt_box)}",
                }
                if self.lora_name:
                    body["lora_path"] = self.lora_name
                if self.record_routes is not None:
                    body["return_routed_experts"] = True
                return body

            async with sem:
                try:
                    body = await self._request(
                        http,
                        "POST",
                        "/generate",
                        payload,
                        check=self._check_generate,
                        what=f"/generate request {rid}",
                    )
                except SGLangUnavailableError:
                    if self.on_failure == "raise":
                        raise
                    body = None
            if body is None:  # on_failure="abort": an empty sample, counted, never a silent loss
                self.metrics["aborted_samples"] += 1
                sample = Sample([], [], "abort", self.policy_version, {"rid": rid})
            else:
                sample = self._to_sample(body, rid, params.stop_token_ids, len(prompts[i]))
            if results[i][j] is not None:  # cannot happen by construction; guard the invariant
                raise AssertionError(f"sample slot {rid} filled twice")
            results[i][j] = sample
            self.metrics["samples"] += 1

        async with self._new_http() as http:
            await asyncio.gather(
                *(one(http, i, j) for i in range(len(prompts)) for j in range(params.n))
            )
        return [[s for s in row] for row in results]  # every slot is filled (gather re-raises)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        prompt_seeds: Sequence[int] | None = None,
    ) -> list[list[Sample]]:
        return _run_sync(self.agenerate(prompts, params, prompt_seeds=prompt_seeds))

    # ------------------------------------------------------------------ weights

    async def aupdate_weights_from_disk(self, path: str, version: int) -> int:
        """Loads the safetensors checkpoint in `path` (HF layout, readable by the server) and tags
        it `version`; returns the version the server reports afterwards (also recorded as
        `policy_version`, which later samples are checked against).

        Behind an SGLang router (which does not forward this call: it answers 404), the update
        goes to every worker the router lists at `GET /workers`; all must report `version`.
        """
        payload = {"model_path": str(path), "weight_version": str(int(version))}
        async with self._new_http() as http:
            try:
                reported = [await self._update_one(http, self.base_url, payload)]
            except _NotFound:
                # A busy router can time out on `/workers` or list none for a moment; asked
                # again after a pause (each retry counted) before the update is given up.
                workers = await self._worker_urls(http)
                for pause in _WORKERS_RETRY_PAUSES_S:
                    if workers:
                        break
                    self.metrics["router_workers_retries"] += 1
                    await asyncio.sleep(pause)
                    workers = await self._worker_urls(http)
                if not workers:
                    listing = "lists no workers at" if workers == [] else "does not answer"
                    raise SGLangRequestError(
                        f"{self.base_url} has no /update_weights_from_disk and {listing} "
                        f"/workers (asked {len(_WORKERS_RETRY_PAUSES_S) + 1} times)"
                    ) from None
                reported = [await self._update_one(http, w, payload) for w in workers]
                self.metrics["router_weight_fanouts"] += 1
        got = {int(version) if r is None else r for r in reported}
        if got != {int(version)}:
            raise SGLangRequestError(
                f"after /update_weights_from_disk to version {version}, {self.base_url} reports "
                f"versions {sorted(got)}"
            )
        self.policy_version = int(version)
        self.metrics["weight_updates"] += 1
        return self.policy_version

    async def _update_one(self, http, url: str, payload: dict) -> int | None:
        try:
            body = await self._request(
                http,
                "POST",
                f"{url}/update_weights_from_disk",
                payload,
                what="/update_weights_from_disk",
                not_found_ok=True,
            )
        except SGLangRequestError as e:
            raise SGLangRequestError(f"{e} (model_path={payload['model_path']})") from None
        if body is _NOT_FOUND:
            raise _NotFound(url)
        if isinstance(body, dict) and body.get("success") is False:
            raise SGLangRequestError(
                f"/update_weights_from_disk at {url} failed for {payload['model_path']}: "
                f"{body.get('message')}"
            )
        return await self._reported_version(http, url)

    async def _worker_urls(self, http) -> list[str] | None:
        """Worker URLs a router lists at `GET /workers` (any JSON holding url/worker_url keys);
        None when it does not answer with JSON (a transport error, a timeout, another status)."""
        try:
            resp = await http.get("/workers")
            if resp.status_code != 200:
                return None
            body = resp.json()
        except (httpx.TransportError, ValueError):
            return None
        urls: list[str] = []

        def walk(x):
            if isinstance(x, dict):
                for k, v in x.items():
                    if k in ("url", "worker_url") and isinstance(v, str) and v.startswith("http"):
                        urls.append(v.rstrip("/"))
                    else:
                        walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        walk(body)
        return sorted(set(urls))

    async def _reported_version(self, http, url: str | None = None) -> int | None:
        """The server's `weight_version` from `GET /model_info` (or the older `/get_model_info`);
        None if absent or not an integer."""
        url = url or self.base_url
        for path in ("/model_info", "/get_model_info"):
            try:
                resp = await http.get(f"{url}{path}")
                body = resp.json() if resp.status_code == 200 else None
            except (httpx.TransportError, ValueError):
                body = None
            if isinstance(body, dict) and "weight_version" in body:
                try:
                    return int(body["weight_version"])
                except (TypeError, ValueError):
                    return None
        return None

    def update_weights_from_disk(self, path: str, version: int) -> int:
        return _run_sync(self.aupdate_weights_from_disk(path, version))

    async def areported_versions(self) -> list[int | None]:
        """The weight version each worker reports now (`GET /model_info`): the server's own, or
        behind a router every worker it lists at `GET /workers`; None where a worker reports
        none (its launch weights: "default") or does not answer."""
        async with self._new_http() as http:
            urls = await self._worker_urls(http) or [self.base_url]
            return [await self._reported_version(http, u) for u in urls]

    def reported_versions(self) -> list[int | None]:
        return _run_sync(self.areported_versions())

    def sync_weights(self, params_or_path: Any, version: int) -> int:
        """RolloutEngine API: a path to an HF safetensors directory readable by the server."""
        if not isinstance(params_or_path, (str, bytes)) and not hasattr(
            params_or_path, "__fspath__"
        ):
            raise TypeError(
                "SGLangClient.sync_weights needs a directory path holding HF safetensors "
                "(export the "
                "policy with gagar_jax.models.save_hf_safetensors first), got "
                f"{type(params_or_path).__name__}"
            )
        return self.update_weights_from_disk(str(params_or_path), version)

    # ------------------------------------------------------------------ OpenAI-compatible chat

    async def achat_completions(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        **extra: Any,
    ) -> dict:
        """`POST /v1/chat/completions`; returns the OpenAI-compatible response dict."""
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise ValueError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
            )
        payload = {
            "model": extra.pop("model", "default"),
            "messages": messages,
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            **extra,
        }
        if tools:
            payload["tools"] = tools
        async with self._new_http() as http:
            body = await self._request(
                http, "POST", "/v1/chat/completions", payload, what="/v1/chat/completions"
            )
        if not isinstance(body, dict) or "choices" not in body:
            raise SGLangRequestError(
                f"/v1/chat/completions at {self.base_url} answered without choices: "
                f"{str(body)[:300]}"
            )
        self.metrics["chat_requests"] += 1
        return body

    def chat_completions(self, messages: list[dict], **kwargs: Any) -> dict:
        return _run_sync(self.achat_completions(messages, **kwargs))
