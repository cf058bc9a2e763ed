"""Weight sync to the rollout engine, verified after every sync; adapter-only sync for LoRA.

A sync that did not take effect is an error naming the engine, never a silent skip (verl's users
met an adapter that was never delivered to the inference engine). After every sync,
:func:`check_sync`:

1. asks the engine which version it serves (the embedded sampler's ``policy_version``; an
   SGLang server's ``weight_version`` from ``/model_info``, or for a LoRA adapter the adapter
   names the server reports loaded) and requires the one just synced;
2. samples a fixed probe prompt on the engine (``PROBE_NEW_TOKENS`` tokens, temperature 1, a
   fixed seed) and scores the same tokens with the trainer's parameters (the training forward,
   on the trainer's mesh): the engine's log-probabilities must equal the trainer's within a
   tolerance (:func:`default_tolerance`, measured: see docs/benchmarks.md, "Weight sync check").

Adapter-only sync (``model.lora_rank > 0``): the embedded sampler gets the adapters alone
(:func:`sync_sampler_adapters`: its own base leaves stay in place, only the adapters move) and
an SGLang server gets them through its LoRA API (:class:`SGLangLoraSync`:
``/load_lora_adapter`` of the PEFT export under a versioned name, requests then name that
adapter, the previous one is unloaded). The probe then catches an adapter that was not
delivered, a stale sampler, or a server whose base is not the trainer's.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from gagar_jax.models import Transformer
from gagar_jax.models import lora as lora_lib

PROBE_LEN = 16
PROBE_NEW_TOKENS = 8
PROBE_SEED = 1234


class SyncCheckError(RuntimeError):
    """A weight sync that did not take effect on the named engine."""


def default_tolerance(model_config) -> float:
    """The largest |engine - trainer| log-probability difference the check accepts.

    Measured on this framework's embedded sampler against the training forward (tests/
    test_weight_sync.py prints them): float32 compute differs by at most ~1e-5 (summation
    order of the decode's cached attention against the full forward's blocked one); bfloat16
    compute by up to ~0.05 on random small models. The bounds here keep a margin over those;
    a stale or undelivered update moves a trained model's probe log-probs by far more.
    """
    return 1e-3 if model_config.dtype == "float32" else 0.25


def probe_prompt(vocab_size: int, length: int = PROBE_LEN) -> list[int]:
    """A fixed prompt of ``length`` token ids spread over the vocabulary (no special meaning)."""
    return [int(1 + (i * 7919) % max(vocab_size - 1, 1)) for i in range(length)]


@functools.lru_cache(maxsize=8)
def _scorer(model_config, mesh):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
    out = None if mesh is None else NamedSharding(mesh, PartitionSpec())

    @functools.partial(jax.jit, out_shardings=out)
    def score(params, tokens):
        model = nnx.merge(graphdef, params)
        t = tokens.shape[1]
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
        logits = model(tokens, pos)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

    return score


def _mesh_of(params):
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def trainer_logprobs(params: dict, model_config, tokens: list[int], prompt_len: int) -> np.ndarray:
    """The trainer's log-probabilities (temperature 1) of ``tokens[prompt_len:]`` given their
    prefix, from ``params`` as they are (sharded on the trainer's mesh or not).

    Several processes (every one calls this, each with its own engine's probe tokens): the rows
    of all processes are gathered and scored as one batch, identical on every process (the
    global program's input), and each process reads its own row.
    """
    # the same width on every process: the prompt (the same everywhere) and the longest sample
    width = max(prompt_len + PROBE_NEW_TOKENS, len(tokens))
    ids = np.zeros((1, width), np.int32)
    ids[0, : len(tokens)] = tokens
    row = 0
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ids = np.asarray(multihost_utils.process_allgather(ids)).reshape(-1, width)
        row = jax.process_index()
    lp = _scorer(model_config, _mesh_of(params))(params, ids)
    return np.asarray(lp)[row, prompt_len - 1 : len(tokens) - 1]


def engine_name(engine) -> str:
    url = getattr(getattr(engine, "client", None), "base_url", None) or getattr(
        engine, "base_url", None
    )
    return f"{type(engine).__name__}({url})" if url else type(engine).__name__


def engine_versions(engine) -> list:
    """The version(s) the engine reports serving now."""
    if isinstance(engine, SGLangLoraSync):
        return [engine.loaded_version()]
    client = getattr(engine, "client", engine)
    if hasattr(client, "reported_versions"):
        return list(client.reported_versions())
    return [getattr(engine, "policy_version", None)]


def check_sync(
    engine,
    params: dict,
    model_config,
    version: int,
    *,
    tolerance: float | None = None,
    prompt: list[int] | None = None,
) -> dict[str, float]:
    """Verifies that ``engine`` serves ``version`` and that its probe log-probs equal the
    trainer's (``params``) within ``tolerance``; returns ``sync/*`` metrics.

    Raises:
      SyncCheckError: naming the engine, when it reports another version or its log-probs
        differ from the trainer's by more than the tolerance.
    """
    from gagar_jax.rollout.types import SamplingParams

    name = engine_name(engine)
    versions = engine_versions(engine)
    if any(v is None or int(v) != int(version) for v in versions):
        raise SyncCheckError(
            f"weight sync to {name} did not take effect: it reports version(s) {versions} after "
            f"syncing version {version}"
        )
    tol = default_tolerance(model_config) if tolerance is None else float(tolerance)
    prompt = prompt or probe_prompt(model_config.vocab_size)
    sp = SamplingParams(n=1, temperature=1.0, max_tokens=PROBE_NEW_TOKENS, seed=PROBE_SEED)
    sample = engine.generate([prompt], sp)[0][0]
    if not sample.tokens:
        raise SyncCheckError(f"weight sync check: {name} returned no probe tokens")
    got = np.asarray(sample.logprobs, np.float64)
    want = trainer_logprobs(params, model_config, list(prompt) + list(sample.tokens), len(prompt))
    diff = float(np.max(np.abs(got - want)))
    if not diff <= tol:
        raise SyncCheckError(
            f"weight sync to {name} (version {version}) did not take effect: its probe "
            f"log-probs differ from the trainer's by {diff:.3g} (tolerance {tol:.3g}; "
            f"engine {np.round(got[:4], 4).tolist()}, trainer {np.round(want[:4], 4).tolist()})"
        )
    return {"sync/probe_max_abs_diff": diff, "sync/probe_tokens": float(len(got))}


# -- adapter-only sync ----------------------------------------------------------------------


def sync_sampler_adapters(sampler, adapters: dict, version: int) -> int:
    """The embedded sampler's weights with ``adapters`` (a pure dict of adapter leaves, on or
    off the sampler's device) in place of its own, its base untouched; returns the version.

    The sampler's own base leaves are reused as they are, so its ``sync_weights`` moves the
    adapters only (a few MB at 1.7B, rank 16) and reuses its compiled programs.
    """
    own = nnx.to_pure_dict(sampler.state)
    _, base = lora_lib.split_adapters(own)
    ad = lora_lib.split_adapters(adapters)[0]
    if not ad:
        raise ValueError("sync_sampler_adapters: no adapter leaves given")
    return sampler.sync_weights(lora_lib.combine(base, ad), version)


class SGLangLoraSync:
    """An SGLang server serving the base with the policy's LoRA adapter, synced adapter-only.

    The server runs the base (launched with ``--enable-lora --max-lora-rank R
    --lora-target-modules ...``); :meth:`sync_weights` writes the PEFT export of the adapters to
    ``sync_dir/lora_v<version>``, loads it with ``POST /load_lora_adapter`` under the name
    ``policy_v<version>``, makes the client's requests name it (``lora_path``), and unloads the
    previous adapter. A load the server refuses raises :class:`SyncCheckError` naming the
    server and its message; the previous adapter keeps serving.
    """

    def __init__(self, client, model_config, sync_dir: str, *, writer: bool = True):
        self.client = client
        self.model_config = model_config
        self.sync_dir = sync_dir
        self.writer = writer
        self.current: str | None = None
        self.loaded: list[str] = []

    @staticmethod
    def adapter_name(version: int) -> str:
        return f"policy_v{int(version):06d}"

    def _post(self, path: str, payload: dict) -> dict:
        import httpx

        url = self.client.base_url + path
        try:
            resp = httpx.post(url, json=payload, timeout=self.client.request_timeout_s)
        except httpx.HTTPError as e:
            raise SyncCheckError(f"LoRA sync to {url}: {type(e).__name__}: {e}") from e
        try:
            body = resp.json()
        except ValueError:
            body = {"success": False, "error_message": resp.text[:300]}
        if resp.status_code != 200 or (isinstance(body, dict) and body.get("success") is False):
            msg = (
                body.get("error_message") or body.get("message") if isinstance(body, dict) else body
            )
            raise SyncCheckError(
                f"LoRA sync to {url} refused (HTTP {resp.status_code}): {str(msg)[:300]}"
            )
        return body if isinstance(body, dict) else {}

    def export(self, params: dict, version: int) -> str:
        path = os.path.join(self.sync_dir, f"lora_v{int(version):06d}")
        shutil.rmtree(path, ignore_errors=True)
        lora_lib.save_peft_adapter(
            params, self.model_config, path, writer=self.writer, extra_metadata={"version": version}
        )
        return path

    def sync_weights(self, params_or_path: Any, version: int) -> int:
        path = (
            os.fspath(params_or_path)
            if isinstance(params_or_path, (str, os.PathLike))
            else self.export(params_or_path, version)
        )
        name = self.adapter_name(version)
        body = self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        loaded = body.get("loaded_adapters")
        if isinstance(loaded, dict) and name not in loaded:
            raise SyncCheckError(
                f"LoRA sync to {self.client.base_url}: the server does not list {name} as loaded "
                f"after loading it ({sorted(loaded)})"
            )
        previous, self.current = self.current, name
        self.client.lora_name = name
        self.client.policy_version = int(version)
        self.loaded = sorted(loaded) if isinstance(loaded, dict) else [*self.loaded, name]
        if previous and previous != name:
            try:
                self._post("/unload_lora_adapter", {"lora_name": previous})
                self.loaded = [x for x in self.loaded if x != previous]
            except SyncCheckError:
                pass  # an old adapter left loaded costs a slot, not correctness
        return int(version)

    def loaded_version(self) -> int | None:
        """The version of the adapter requests are sent to, if the server lists it loaded."""
        if self.current is None or self.current not in self.loaded:
            return None
        return int(self.current.rsplit("_v", 1)[1])

    def generate(self, prompts, params, **kwargs):
        return self.client.generate(prompts, params, **kwargs)
