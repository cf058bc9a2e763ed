"""LoRA adapters on the decoder's projections: the adapter modules, merging, the base's identity,
and export as PEFT-compatible safetensors.

``TransformerConfig(lora_rank=r, lora_alpha=a, lora_targets=(...))`` gives every targeted
projection ``W`` (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``) an adapter ``(A [in, r], B [r, out])`` (flattened ``in``/``out``: ``q_proj``'s
``out`` is ``heads * head_dim`` in the Hugging Face order), and the projection computes::

    y = x @ W + (a / r) * (x @ A) @ B        # PEFT's LoRA: scaling lora_alpha / r

``A`` starts He-uniform and ``B`` at zero, so a fresh adapter leaves the model's outputs
unchanged. The adapters are :class:`flax.nnx.LoRA` modules (parameters of type
``nnx.LoRAParam``, a ``Param``) stored beside the weight as ``<name>_lora`` (pure-dict path
``layers.{i}.self_attn.q_proj_lora.lora_a``); ``scan_layers`` models stack them ``[L, ...]``
like every other layer parameter. They are kept in float32 whatever ``param_dtype`` (they are
small, and the optimizer's updates to them are too) and run in the compute dtype.

Why not ``qwix`` (Google's LoRA/quantisation library that Tunix uses): qwix applies LoRA by
intercepting ``dot_general``/``einsum`` calls whose right operand *is* a module parameter. This
model's projections do not call them on the parameter: ``q``/``k``/``v`` run as one dot over the
three weights concatenated per KV group, and every projection goes through ``_linear``, a
``jax.custom_vjp`` whose backward is written out for XLA:CPU's fast GEMM path. Measured with
qwix 0.1.8 on a 2-layer model (``qwix.apply_lora_to_model(model, LoraProvider([LoraRule(
module_path='.*', rank=4, alpha=8)], disable_jit=True), tokens, positions)``): it created
adapters for ``gate/up/down_proj`` and ``lm_head`` only (none for ``q/k/v/o_proj``), and the
gradient with respect to them failed with ``UnexpectedTracerError`` (its adapter parameters are
created and read inside our ``custom_vjp``, whose backward does not know them). Using qwix would
mean giving up the fused QKV dot and the hand-written backward; so the adapter parameters are
``flax.nnx.LoRA`` modules and their two small products are added here, outside ``_linear``, where
autodiff differentiates them (the base weight's gradient is never formed: the update
differentiates the adapters only, ``gagar_jax.update``).

Export (:func:`save_peft_adapter`): ``adapter_model.safetensors`` with PEFT's names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight [r, in]``, ``lora_B.weight
[out, r]``) and ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``), which ``peft.PeftModel.from_pretrained`` and SGLang's LoRA loader read.
:func:`merged_params` folds the adapters into the weights (``W + (a / r) A B``) for a plain
Hugging Face export (:func:`gagar_jax.models.save_hf_safetensors`).

The base's identity (:func:`base_hash`): a SHA-256 over the non-adapter parameters (paths,
dtypes, shapes and bytes); a LoRA checkpoint stores it, and restoring onto another base is an
error (``gagar_jax.update.checkpoint``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTN_TARGETS + MLP_TARGETS
SUFFIX = "_lora"  # an adapter's attribute: "<projection>_lora"
LORA_AXIS = "lora_rank"  # logical axis of the rank dimension (never sharded)


def scale(config) -> float:
    """PEFT's LoRA scaling ``lora_alpha / lora_rank``."""
    return float(config.lora_alpha) / float(config.lora_rank)


def targets(config, group: tuple[str, ...]) -> tuple[str, ...]:
    """The projections of ``group`` that carry an adapter under ``config`` (none at rank 0)."""
    if not config.lora_rank:
        return ()
    return tuple(t for t in group if t in config.lora_targets)


def make_adapter(
    rngs: nnx.Rngs,
    in_features: int,
    out_features: int,
    in_axis: str,
    out_axis: str,
    rank: int,
    stack: int | None = None,
) -> nnx.LoRA:
    """A :class:`flax.nnx.LoRA` holder of ``A [in, r]`` (He-uniform) and ``B [r, out]`` (zero),
    float32, with logical axes for the mesh; ``stack``: ``[L, ...]`` for ``scan_layers``."""
    a_init = nnx.initializers.he_uniform()
    b_init = nnx.initializers.zeros
    a_axes, b_axes = (in_axis, LORA_AXIS), (LORA_AXIS, out_axis)
    if stack is not None:
        a_axes, b_axes = ("layers", *a_axes), ("layers", *b_axes)

        def stacked(init):
            def fn(key, shape, dtype):
                keys = jax.random.split(key, stack)
                return jax.vmap(lambda k: init(k, shape, dtype))(keys)

            return fn

        a_init, b_init = stacked(a_init), stacked(b_init)
    return nnx.LoRA(
        in_features,
        rank,
        out_features,
        param_dtype=jnp.float32,
        a_initializer=a_init,
        b_initializer=b_init,
        a_metadata={"logical_axes": a_axes},
        b_metadata={"logical_axes": b_axes},
        rngs=rngs,
    )


def delta(adapter: nnx.LoRA, x: jax.Array, in_dims: int, out_shape: tuple[int, ...], s: float):
    """``s * (x @ A) @ B`` for ``x [..., *I]`` (the last ``in_dims`` dims flattened) ->
    ``[..., *out_shape]`` in ``x``'s dtype."""
    dt = x.dtype
    lead = x.shape[: x.ndim - in_dims]
    x2 = x.reshape(*lead, -1)
    h = x2 @ adapter.lora_a[...].astype(dt)
    y = (h @ adapter.lora_b[...].astype(dt)) * jnp.asarray(s, dt)
    return y.reshape(*lead, *out_shape)


# -- pure-dict helpers ------------------------------------------------------------------------


def is_adapter_key(key: Any) -> bool:
    return isinstance(key, str) and key.endswith(SUFFIX)


def _split(tree: Any, inside: bool) -> tuple[Any, Any]:
    """(adapter part, rest) of a nested dict; empty sub-dicts dropped."""
    if not isinstance(tree, dict):
        return (tree, None) if inside else (None, tree)
    ad, rest = {}, {}
    for k, v in tree.items():
        a, r = _split(v, inside or is_adapter_key(k))
        if a is not None and not (isinstance(a, dict) and not a):
            ad[k] = a
        if r is not None and not (isinstance(r, dict) and not r):
            rest[k] = r
    return ad, rest


def split_adapters(params: dict) -> tuple[dict, dict]:
    """``(adapters, base)``: the adapter leaves and the others of a pure parameter dict, each a
    nested dict of the same layout (either may be ``{}``)."""
    ad, rest = _split(params, False)
    return ad or {}, rest or {}


def combine(base: dict, adapters: dict) -> dict:
    """The inverse of :func:`split_adapters`: one nested dict with both parts' leaves."""
    if not adapters:
        return base
    if not base:
        return adapters
    out = dict(base)
    for k, v in adapters.items():
        out[k] = combine(base[k], v) if k in base and isinstance(v, dict) else v
    return out


def has_adapters(params: dict) -> bool:
    return bool(split_adapters(params)[0])


def trainable(params: dict, config) -> tuple[dict, dict]:
    """``(trainable, frozen)`` parts of the update's parameters: with ``config.lora_rank`` the
    adapters and the base; otherwise every parameter and ``{}``."""
    if not config.lora_rank:
        return params, {}
    ad, base = split_adapters(params)
    return ad, base


def _merge_one(w, adapter: dict, s: float):
    a = jnp.asarray(adapter["lora_a"], jnp.float32)
    b = jnp.asarray(adapter["lora_b"], jnp.float32)
    dw = jnp.matmul(a, b) * s  # [in, out] (stacked: [L, in, out])
    return (jnp.asarray(w, jnp.float32) + dw.reshape(w.shape)).astype(w.dtype)


def merged_params(params: dict, config) -> dict:
    """The base parameters with every adapter folded in (``W + (a / r) A B``, computed in
    float32 and stored in ``W``'s dtype), adapters dropped: a plain model's parameters."""
    ad, base = split_adapters(params)
    if not ad:
        return base
    s = scale(config)

    def walk(b, a):
        out = dict(b)
        for k, v in a.items():
            if is_adapter_key(k):
                name = k[: -len(SUFFIX)]
                out[name] = _merge_one(b[name], v, s)
            else:
                out[k] = walk(b[k], v)
        return out

    return walk(base, ad)


def merge_and_reset(params: dict, config) -> dict:
    """:func:`merged_params` with the adapters kept, ``B`` zeroed (``A`` unchanged): the same
    model, with the current weights as the LoRA base (e.g. after a full SFT warm start)."""
    ad, _ = split_adapters(params)
    if not ad:
        return params
    zeroed = jax.tree.map(lambda x: x, ad)

    def zero_b(tree):
        return {
            k: ({**v, "lora_b": jnp.zeros_like(v["lora_b"])} if is_adapter_key(k) else zero_b(v))
            for k, v in tree.items()
        }

    return combine(merged_params(params, config), zero_b(zeroed))


def base_hash(params: dict) -> str:
    """SHA-256 (hex, 16 chars) of the base parameters: every non-adapter leaf's path, dtype,
    shape and bytes, in path order. Sharded leaves are gathered one at a time."""
    from gagar_jax.models.hf import gather_to_host

    _, base = split_adapters(params)
    h = hashlib.sha256()
    for path, leaf in sorted(
        jax.tree_util.tree_leaves_with_path(base), key=lambda kv: jax.tree_util.keystr(kv[0])
    ):
        x = np.ascontiguousarray(gather_to_host(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(x.tobytes())
    return h.hexdigest()[:16]


# -- PEFT export --------------------------------------------------------------------------------

_GROUPS = {t: "self_attn" for t in ATTN_TARGETS} | {t: "mlp" for t in MLP_TARGETS}


def peft_tensors(params: dict, config, *, fetch=None) -> dict[str, np.ndarray]:
    """The adapters of ``params`` under PEFT's names: ``base_model.model.model.layers.{i}.
    {self_attn|mlp}.{proj}.lora_A.weight [r, in]`` and ``lora_B.weight [out, r]`` (float32)."""
    from gagar_jax.models.hf import gather_to_host
    from gagar_jax.models.transformer import unstack_layer_params

    get = fetch or gather_to_host
    params = unstack_layer_params(params)
    out = {}
    for i in range(config.num_layers):
        layer = params["layers"][i]
        for t in config.lora_targets:
            group = layer[_GROUPS[t]]
            if t + SUFFIX not in group:
                continue
            a = np.asarray(get(group[t + SUFFIX]["lora_a"]), np.float32)
            b = np.asarray(get(group[t + SUFFIX]["lora_b"]), np.float32)
            pre = f"base_model.model.model.layers.{i}.{_GROUPS[t]}.{t}"
            out[pre + ".lora_A.weight"] = np.ascontiguousarray(a.T)
            out[pre + ".lora_B.weight"] = np.ascontiguousarray(b.T)
    return out


def adapter_config(config, base_model_name_or_path: str = "") -> dict:
    """PEFT's ``adapter_config.json`` for ``config``'s adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": int(config.lora_rank),
        "lora_alpha": float(config.lora_alpha),
        "lora_dropout": 0.0,
        "target_modules": sorted(config.lora_targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapter(
    params: dict,
    config,
    directory: str,
    *,
    base_model_name_or_path: str = "",
    writer: bool | None = None,
    extra_metadata: dict | None = None,
) -> str:
    """Writes ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT's layout) of the
    adapters in ``params`` to ``directory``; returns it. Every process calls it (sharded leaves
    are gathered); ``writer`` (default process 0) writes. ``extra_metadata``: strings stored in
    the safetensors header (e.g. the base's hash and the adapter's version)."""
    from safetensors.numpy import save_file

    if not config.lora_rank:
        raise ValueError("save_peft_adapter: model.lora_rank is 0 (no adapters)")
    tensors = peft_tensors(params, config)
    if not tensors:
        raise ValueError("save_peft_adapter: params hold no adapters")
    writer = jax.process_index() == 0 if writer is None else writer
    if writer:
        os.makedirs(directory, exist_ok=True)
        meta = {"format": "pt", **{k: str(v) for k, v in (extra_metadata or {}).items()}}
        save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata=meta)
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            json.dump(adapter_config(config, base_model_name_or_path), f, indent=2)
    return directory


def load_peft_adapter(directory: str, config) -> dict:
    """A PEFT adapter directory -> our adapter pure dict (per-layer layout, float32); raises a
    ``ValueError`` naming what does not fit ``config`` (rank, alpha, targets, shapes)."""
    from safetensors.numpy import load_file

    with open(os.path.join(directory, "adapter_config.json")) as f:
        cfg = json.load(f)
    if int(cfg["r"]) != config.lora_rank or float(cfg["lora_alpha"]) != config.lora_alpha:
        raise ValueError(
            f"adapter {directory}: r={cfg['r']} lora_alpha={cfg['lora_alpha']}, the model has "
            f"lora_rank={config.lora_rank} lora_alpha={config.lora_alpha}"
        )
    tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))
    layers: dict = {}
    for i in range(config.num_layers):
        for t in config.lora_targets:
            pre = f"base_model.model.model.layers.{i}.{_GROUPS[t]}.{t}"
            try:
                a, b = tensors[pre + ".lora_A.weight"], tensors[pre + ".lora_B.weight"]
            except KeyError as e:
                raise ValueError(f"adapter {directory} lacks {e.args[0]}") from e
            group = layers.setdefault(i, {}).setdefault(_GROUPS[t], {})
            group[t + SUFFIX] = {
                "lora_a": np.ascontiguousarray(a.T.astype(np.float32)),
                "lora_b": np.ascontiguousarray(b.T.astype(np.float32)),
            }
    return {"layers": layers}


def adapter_only_state(params: dict) -> dict:
    """The adapters of a pure parameter dict (what a LoRA sync sends and a LoRA checkpoint
    keeps)."""
    return split_adapters(params)[0]
