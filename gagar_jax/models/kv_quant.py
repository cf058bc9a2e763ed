"""An int8 KV cache: keys and values quantised as they are written, dequantised as they are read.

A quantised cache buffer (:class:`QuantizedKV`) holds int8 values of the buffer's own shape and
one float32 scale per token and KV head: the scale array has the buffer's shape with 1 on the
head-dimension axis (keys ``[..., KV, D, S]`` -> scales ``[..., KV, 1, S]``; values
``[..., KV, S, D]`` -> ``[..., KV, S, 1]``). Each token's head vector is quantised on its own
when it is written (symmetric, ``scale = absmax * float32(1 / 127)``, round to nearest even,
clipped to ``[-127, 127]``), so writing a token never rescales the tokens before it, and the
round-trip error of an element is at most half its scale (``absmax / 254``). A head vector
that is all zeros (or so small that its scale would be a subnormal float32) gets scale 1 and
values 0: every scale is finite and positive, every dequantised value finite, on every
platform (whether it flushes subnormals or not).

Both arrays keep the batch axis at the buffer's ``-4`` and the slot axis where the buffer has
it (``-1`` for keys, ``-2`` for values), so the cache's slot-wise edits
(:class:`gagar_jax.models.transformer.Cache`: take rows, slice, pad, compact, shard) apply to
them leaf by leaf as they apply to a float buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

INT8_MAX = 127.0
TINY = float(jnp.finfo(jnp.float32).tiny)


@struct.dataclass
class QuantizedKV:
    """A KV-cache buffer stored as int8 ``values`` times a float32 ``scale`` per token and head
    (``scale`` has 1 on the head-dimension axis ``axis``)."""

    values: jax.Array
    scale: jax.Array
    axis: int = struct.field(pytree_node=False, default=-2)

    @property
    def shape(self):
        """The buffer's shape."""
        return self.values.shape

    @property
    def dtype(self):
        """The stored values' dtype (int8)."""
        return self.values.dtype


def quantize_kv(x: jax.Array, axis: int) -> QuantizedKV:
    """``x`` on the int8 grid, one scale per vector along ``axis`` (the head dimension)."""
    x = jnp.asarray(x).astype(jnp.float32)
    # times the float32 reciprocal (what XLA makes of a division by the constant anyway)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) * jnp.float32(1.0 / INT8_MAX)
    # a scale below the smallest normal float32 (an all-zero head; or one a platform that
    # flushes subnormals would turn into 0): 1, whose values are then 0
    scale = jnp.where(scale >= TINY, scale, 1.0)
    q = jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedKV(values=q, scale=scale, axis=axis)


def dequantize_kv(q: QuantizedKV, dtype) -> jax.Array:
    """``values * scale`` in ``dtype`` (computed in float32)."""
    return (q.values.astype(jnp.float32) * q.scale).astype(dtype)


def empty_kv(shape: tuple[int, ...], axis: int) -> QuantizedKV:
    """A zero buffer of ``shape`` (values 0, scales 1: dequantises to 0)."""
    scale_shape = list(shape)
    scale_shape[axis] = 1
    return QuantizedKV(
        values=jnp.zeros(shape, jnp.int8), scale=jnp.ones(scale_shape, jnp.float32), axis=axis
    )


def read_kv(buf, dtype) -> jax.Array:
    """A cache buffer as a ``dtype`` array: dequantised when quantised, else cast."""
    if isinstance(buf, QuantizedKV):
        return dequantize_kv(buf, dtype)
    return buf.astype(dtype)
