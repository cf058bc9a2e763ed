"""Group layouts shared by every kernel: dense `[G, K]` or flat `[N]` with segment ids.

Every kernel in `gagar_jax.advantages` is written once against the two operations of
`Groups` -- reduce a per-rollout array to per-group values, and broadcast a per-group value
back to every rollout -- so the dense and the flat forms give the same numbers by
construction:

* dense: rollouts are `[G, K]` (G groups, K rollout slots, `valid` marks filled slots);
  reductions run along the last axis and never cross groups, so a batch sharded along G
  keeps every reduction local to its shard.
* flat: rollouts are `[N]` with `group_ids: int [N]` in `[0, num_groups)` and a static
  `num_groups`; reductions are `jax.ops.segment_sum`/`segment_max`/`segment_min`, and
  broadcasts are gathers `stat[group_ids]`. This serves packed batches whose groups have
  different sizes.

Input checking lives here too. Shapes are static under `jax.jit`, so shape errors are always
raised eagerly with the field name and the expected shape. Value errors (a tier of 7, a group
id out of range) can only be raised when the values are concrete; under `jit` the kernels
report them through validity masks instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def is_concrete(*xs: Any) -> bool:
    """True when no argument is a tracer, i.e. values can be inspected on the host."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_shape(name: str, x: Any, shape: Sequence[int], meaning: str) -> None:
    """Raises a ValueError naming `name` unless `x.shape == shape`."""
    got = tuple(np.shape(x))
    if got != tuple(shape):
        raise ValueError(
            f"{name}: expected shape {meaning}={_shape_str(shape)}, got {_shape_str(got)}"
        )


def check_float(name: str, x: Any) -> Array:
    x = jnp.asarray(x)
    if not (
        jnp.issubdtype(x.dtype, jnp.floating)
        or jnp.issubdtype(x.dtype, jnp.integer)
        or x.dtype == jnp.bool_
    ):
        raise TypeError(f"{name}: expected a real-valued array, got dtype {x.dtype}")
    # Accumulate in float32 whatever the input dtype (bf16 rewards, int rewards, ...).
    return x.astype(jnp.float32)


def check_bool(name: str, x: Any) -> Array:
    x = jnp.asarray(x)
    if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"{name}: expected a bool (or 0/1 integer) array, got dtype {x.dtype}")
    if x.dtype != jnp.bool_ and is_concrete(x):
        bad = np.asarray(x)
        if bad.size and not np.isin(bad, (0, 1)).all():
            raise ValueError(f"{name}: expected 0/1 values, got {np.unique(bad)[:8].tolist()}")
    return x.astype(jnp.bool_)


def check_int(name: str, x: Any) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer array, got dtype {x.dtype}")
    return x.astype(jnp.int32)


class Groups:
    """Per-group reductions and broadcasts for one layout.

    Build with `Groups.make(reference, group_ids, num_groups)` where `reference` is any
    per-rollout array (its shape fixes the layout).
    """

    def __init__(self, shape: tuple[int, ...], group_ids: Array | None, num_groups: int):
        self.shape = shape  # per-rollout shape: (G, K) dense or (N,) flat
        self.group_ids = group_ids  # None for dense, int32 [N] for flat
        self.num_groups = num_groups  # G

    @property
    def flat(self) -> bool:
        return self.group_ids is not None

    @property
    def rollout_meaning(self) -> str:
        return "[N]" if self.flat else "[G, K]"

    @classmethod
    def make(
        cls, name: str, reference: Any, group_ids: Any = None, num_groups: int | None = None
    ) -> Groups:
        shape = tuple(np.shape(reference))
        if group_ids is None:
            if num_groups is not None:
                raise ValueError("num_groups: only used with group_ids (the flat [N] layout)")
            if len(shape) != 2:
                raise ValueError(
                    f"{name}: expected shape [G, K] (groups x rollout slots), got "
                    f"{_shape_str(shape)}; for a flat [N] batch pass group_ids and num_groups"
                )
            return cls(shape, None, shape[0])
        if num_groups is None or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(
                f"num_groups: expected a static Python int >= 1 with group_ids, got {num_groups!r}"
            )
        if len(shape) != 1:
            raise ValueError(f"{name}: expected shape [N] with group_ids, got {_shape_str(shape)}")
        group_ids = check_int("group_ids", group_ids)
        check_shape("group_ids", group_ids, shape, "[N]")
        if is_concrete(group_ids):
            ids = np.asarray(group_ids)
            if ids.size and (ids.min() < 0 or ids.max() >= num_groups):
                raise ValueError(
                    f"group_ids: expected values in [0, num_groups={num_groups}), got range "
                    f"[{ids.min()}, {ids.max()}]"
                )
        return cls(shape, group_ids, int(num_groups))

    def check(self, name: str, x: Any) -> None:
        check_shape(name, x, self.shape, self.rollout_meaning)

    def check_group(self, name: str, x: Any) -> None:
        check_shape(name, x, (self.num_groups,), "[G]")

    # Reductions: per-rollout -> per-group [G].
    def sum(self, x: Array) -> Array:
        if self.flat:
            return jax.ops.segment_sum(x, self.group_ids, num_segments=self.num_groups)
        return jnp.sum(x, axis=-1)

    def max(self, x: Array, where: Array, initial: float) -> Array:
        """`max(initial, max of x over the `where` slots)` per group (so `initial` if none)."""
        x = jnp.where(where, x, initial)
        if self.flat:
            out = jax.ops.segment_max(x, self.group_ids, num_segments=self.num_groups)
            # segment_max yields -inf for groups without members; map them to `initial`.
            return jnp.maximum(out, initial)
        return jnp.max(x, axis=-1, initial=initial)

    def min(self, x: Array, where: Array, initial: float) -> Array:
        """`min(initial, min of x over the `where` slots)` per group."""
        return -self.max(-x, where, -initial)

    # Broadcast: per-group [G] -> per-rollout.
    def expand(self, stat: Array) -> Array:
        if self.flat:
            return stat[self.group_ids]
        return stat[..., None]
