"""Mixture-of-experts routes from an SGLang server, in the layout routing replay consumes.

An SGLang server started with ``--enable-return-routed-experts`` answers a ``/generate``
request that sets ``"return_routed_experts": true`` with ``meta_info["routed_experts"]``: the
base64 of a little-endian int32 array ``[rows, layers, K]`` (each fed token's experts in every
layer, as its router's top-k chose them). The rows are the tokens the server ran through the
model, in order, from the request's ``routed_experts_start_len`` (0 unless set): the prompt,
then every generated token but the last (which is sampled and never fed back), so
``rows = prompt + generated - 1``.

:func:`routes_from_meta` turns them into what the embedded sampler records
(:class:`gagar_jax.rollout.types.Sample`): ``prompt_routes`` ``[P, layers, K]`` and ``routes``
``[L, layers, K]`` int16, the last generated token's row ``-1`` (not recorded: the update routes
it freely, and an episode's next call fills it from its prefill's routes; it predicts nothing
the update trains on).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

ROUTES_FIELD = "routed_experts"


class RoutesFormatError(ValueError):
    """The server's routes do not have the documented shape (the message says how)."""


def decode_routed_experts(value, rows: int, layers: int, k: int) -> np.ndarray:
    """``meta_info["routed_experts"]`` (base64 of int32, or a nested list) as ``[rows, layers,
    k]`` int32; a :class:`RoutesFormatError` naming the field when it is missing or of
    another size."""
    if value is None:
        raise RoutesFormatError(
            f"meta_info.{ROUTES_FIELD} is missing: start the server with "
            "--enable-return-routed-experts"
        )
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise RoutesFormatError(f"meta_info.{ROUTES_FIELD} is not base64: {e}") from e
        if len(raw) % 4:
            raise RoutesFormatError(
                f"meta_info.{ROUTES_FIELD}: {len(raw)} bytes is not a whole number of int32"
            )
        flat = np.frombuffer(raw, dtype="<i4")
    else:
        flat = np.asarray(value, np.int64).reshape(-1)
    if flat.size != rows * layers * k:
        raise RoutesFormatError(
            f"meta_info.{ROUTES_FIELD}: {flat.size} expert ids, expected rows x layers x k = "
            f"{rows} x {layers} x {k} = {rows * layers * k}"
        )
    return flat.reshape(rows, layers, k).astype(np.int32)


def routes_from_meta(
    meta: dict, prompt_len: int, generated: int, layers: int, k: int, num_experts: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_routes [prompt_len, layers, k], routes [generated, layers, k])`` int16 from a
    ``/generate`` answer's ``meta_info`` (module docstring); the last generated token's row is
    ``-1``. Ids outside ``[0, num_experts)`` are a :class:`RoutesFormatError`."""
    rows = max(prompt_len + generated - 1, 0)
    arr = decode_routed_experts(meta.get(ROUTES_FIELD), rows, layers, k)
    bad = (arr < 0) | (arr >= num_experts)
    if bad.any():
        raise RoutesFormatError(
            f"meta_info.{ROUTES_FIELD}: expert ids outside [0, {num_experts}): "
            f"{np.unique(arr[bad])[:5].tolist()}"
        )
    arr = arr.astype(np.int16)
    prompt = np.full((prompt_len, layers, k), -1, np.int16)
    prompt[: min(prompt_len, rows)] = arr[:prompt_len]
    routes = np.full((generated, layers, k), -1, np.int16)
    routes[: max(generated - 1, 0)] = arr[prompt_len:]
    return prompt, routes
