"""Low-precision rollouts for the embedded sampler: bfloat16, int8 and fp8 weights.

The update trains in the model's own precision (float32 by default); the sampler may generate
in a lower one (``Sampler(precision=...)``, ``rollout.precision`` in a run config):

============ ==================================================================================
precision    the sampler's weights and compute
============ ==================================================================================
``float32``  the model's own parameters and compute dtype (no conversion)
``bfloat16`` every parameter stored in bfloat16, computed in bfloat16 (logits and the
             softmax in float32, as the model always does)
``int8``     weight-only int8: every projection (attention, MLP, experts, router, LM head)
             stored as int8 with one float32 scale per output column (symmetric, absmax / 127),
             the other parameters (embedding, norms, biases) in bfloat16; computed in bfloat16
``fp8``      as ``int8`` with float8 e4m3 values (absmax / 448)
============ ==================================================================================

The conversion runs once per weight sync (:func:`convert_params`, jitted, on the sampler's
device): the sampler holds only the converted weights between syncs. A quantized weight is a
:class:`QuantizedArray` leaf of the sampler's state; the generate program turns it back into a
compute-dtype array once per call (:func:`dequantize_tree`), before the prefill, so the decode
loop's matrix products read bfloat16 weights whose values are exactly the int8 / fp8 grid
(XLA:CPU has no int8 or fp8 matrix product to run them on; an accelerator's fused
dequantizing product would read the narrow values instead).

The KV cache is the compute dtype (bfloat16 under every precision but ``float32``), or
``kv_cache_dtype`` when given (``rollout.kv_cache_dtype``): ``bfloat16`` keys and values are
rounded as they are written and widened as they are read; ``int8`` ones are quantised as they
are written, one float32 scale per token and KV head (symmetric, absmax / 127), and
dequantised to the compute dtype as they are read (:mod:`gagar_jax.models.kv_quant`). The
prompt's own prefill attends to its unrounded keys and values; the decode reads the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

ROLLOUT_PRECISIONS = ("float32", "bfloat16", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
# value grids of the weight-only formats: (storage dtype, largest magnitude)
_QUANT = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}
# parameter names that are never quantized: gathered rows, and the MoE router (whose top-k
# choice a coarse grid would flip for many tokens; kept in bfloat16 as deployments keep it)
_KEEP = ("embed_tokens", "router")
# the input (contracted) axes of each projection, counted from the end (so a stacked [L, ...]
# layout has the same): one scale per output element, absmax over these; default (-2,)
_IN_AXES = {
    "q_proj": (-3,),
    "k_proj": (-3,),
    "v_proj": (-3,),
    "o_proj": (-3, -2),
    "lm_head": (-1,),
}


@struct.dataclass
class QuantizedArray:
    """A weight-only quantized parameter: ``values * scale`` (broadcast) in ``dtype``.

    ``values``: int8 or float8 e4m3 of the parameter's shape; ``scale``: float32 with the
    parameter's shape but 1 on its input (contracted) axes: one scale per output element of
    the projection (per expert and layer where those axes lead).
    """

    values: jax.Array
    scale: jax.Array
    dtype: str = struct.field(pytree_node=False, default="bfloat16")

    @property
    def shape(self):
        """The parameter's shape."""
        return self.values.shape

    def dequantize(self) -> jax.Array:
        """The parameter as a ``dtype`` array: ``values * scale``."""
        return (self.values.astype(jnp.float32) * self.scale).astype(self.dtype)


def quantize(
    w: jax.Array, kind: str, dtype: str = "bfloat16", in_axes: tuple[int, ...] = (-2,)
) -> QuantizedArray:
    """``w`` (``ndim >= 2``) on the ``kind`` grid (``"int8"`` | ``"fp8"``), symmetric, one
    scale per output element (absmax over the input axes ``in_axes``). An all-zero output
    gets scale 1."""
    store, top = _QUANT[kind]
    w = jnp.asarray(w, jnp.float32)
    absmax = jnp.max(jnp.abs(w), axis=in_axes, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / top, 1.0)
    q = w / scale
    if kind == "int8":
        q = jnp.clip(jnp.round(q), -top, top)
    return QuantizedArray(values=q.astype(store), scale=scale, dtype=dtype)


def dequantize_tree(tree):
    """Every :class:`QuantizedArray` of ``tree`` replaced by its dequantized array (other
    leaves unchanged; the identity on a tree without any)."""
    return jax.tree.map(
        lambda x: x.dequantize() if isinstance(x, QuantizedArray) else x,
        tree,
        is_leaf=lambda x: isinstance(x, QuantizedArray),
    )


def check_precision(precision: str, kv_cache_dtype: str = "auto") -> None:
    """A ``ValueError`` naming the argument for an unknown precision or KV-cache dtype."""
    if precision not in ROLLOUT_PRECISIONS:
        raise ValueError(f"precision must be one of {ROLLOUT_PRECISIONS}, got {precision!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def rollout_model_config(config, precision: str):
    """The sampler's ``TransformerConfig`` under ``precision``: the model's own for
    ``float32``; bfloat16 compute and storage otherwise."""
    check_precision(precision)
    if precision == "float32":
        return config
    return dataclasses.replace(config, dtype="bfloat16", param_dtype="bfloat16")


def _path_names(path) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]


def _convert_leaf(path, x, precision: str):
    if precision == "float32":
        return x
    names = _path_names(path)
    if precision in _QUANT and jnp.ndim(x) >= 2 and not any(n in _KEEP for n in names):
        axes = next((_IN_AXES[n] for n in reversed(names) if n in _IN_AXES), (-2,))
        return quantize(x, precision, in_axes=axes)
    return jnp.asarray(x).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("precision",))
def _convert(params, precision: str):
    return jax.tree_util.tree_map_with_path(lambda p, x: _convert_leaf(p, x, precision), params)


def convert_params(params: Mapping[str, Any], precision: str) -> Mapping[str, Any]:
    """A pure parameter dict (the trainer's, any float dtype) in the sampler's ``precision``:
    one jitted conversion (the weight sync's). ``float32`` returns ``params`` unchanged."""
    check_precision(precision)
    if precision == "float32":
        return params
    return _convert(params, precision)


def weight_bytes(tree) -> int:
    """Bytes the arrays of ``tree`` occupy (a quantized weight: its values and scales)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
