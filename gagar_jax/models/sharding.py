"""Logical axis names of parameters and the small table that maps them to mesh axes.

Every parameter of :class:`~gagar_jax.models.Transformer` carries ``logical_axes`` metadata
(``("embed", "heads", "head_dim")`` ...). :data:`LOGICAL_RULES` maps each logical name to a mesh
axis of the ``('data', 'fsdp', 'tensor')`` mesh (four rules, lm1b-style): the embedding dimension
is split over ``fsdp`` (ZeRO-3 style parameter sharding), heads / MLP / vocabulary over ``tensor``.
Mixture-of-experts kernels ``[expert, embed, mlp]`` put the expert dimension on ``tensor``
(expert parallelism on the tensor-parallel devices; the expert's own ``mlp`` dimension is then
replicated since a mesh axis is used once per leaf) and ``embed`` on ``fsdp``. The stacked layer
dimension of ``scan_layers`` models (logical ``"layers"``) is never sharded.
A mesh axis that does not divide a dimension is dropped for that leaf (replicated), so tiny test
configs run on any mesh; :func:`param_specs` reports exactly what each leaf gets.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

LOGICAL_RULES: Mapping[str, str | None] = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "expert": "tensor",
    "layers": None,
    "lora_rank": None,  # a LoRA adapter's rank dimension (gagar_jax.models.lora)
}

# Activations: the batch dimension is split over every data-parallel axis.
BATCH_AXES = ("data", "fsdp")


def logical_to_spec(
    axes, shape, mesh: jax.sharding.Mesh, rules: Mapping[str, str | None] = LOGICAL_RULES
) -> PartitionSpec:
    """PartitionSpec for one leaf with logical ``axes`` and ``shape`` on ``mesh``."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    spec, used = [], set()
    for name, dim in zip(axes, shape):
        if name not in rules:
            raise ValueError(f"no sharding rule for logical axis {name!r}; known: {sorted(rules)}")
        mesh_axis = rules[name]
        if (
            mesh_axis is None
            or mesh_axis in used
            or mesh_axis not in mesh.shape
            or dim % mesh.shape[mesh_axis]
        ):
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return PartitionSpec(*spec)


def param_specs(abstract_state: nnx.State, mesh, rules=LOGICAL_RULES):
    """Pure-dict tree of PartitionSpecs for an (abstract) ``nnx.State`` of Params."""

    def one(v):
        return logical_to_spec(v.get_metadata()["logical_axes"], v.shape, mesh, rules)

    specs = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs) if isinstance(specs, nnx.State) else specs


def param_shardings(abstract_state: nnx.State, mesh, rules=LOGICAL_RULES):
    """Pure-dict tree of NamedShardings for an (abstract) ``nnx.State`` of Params."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s),
        param_specs(abstract_state, mesh, rules),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
