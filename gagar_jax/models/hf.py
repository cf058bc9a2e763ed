"""Safetensors import/export under Hugging Face Qwen2/Qwen3/Qwen3-MoE/Llama names + ``config.json``.

A directory written by :func:`save_hf_safetensors` loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and serves with SGLang; a Hugging Face
checkpoint loads here with :func:`load_hf_safetensors`.

Layout mapping (ours -> Hugging Face ``nn.Linear.weight`` which is ``[out, in]``):

====================================  ==============================================  ============
ours (pure-dict path)                 Hugging Face name                               transform
====================================  ==============================================  ============
embed_tokens [V, E]                   model.embed_tokens.weight [V, E]                identity
layers.i.self_attn.q_proj [E, N, D]   model.layers.i.self_attn.q_proj.weight [N*D, E]  reshape, T
layers.i.self_attn.q_bias [N, D]      model.layers.i.self_attn.q_proj.bias [N*D]       reshape
layers.i.self_attn.o_proj [N, D, E]   model.layers.i.self_attn.o_proj.weight [E, N*D]  reshape, T
layers.i.mlp.gate_proj [E, F]         model.layers.i.mlp.gate_proj.weight [F, E]       T
layers.i.self_attn.q_norm.weight [D]  model.layers.i.self_attn.q_norm.weight [D]       identity
layers.i.mlp.router [E, X]            model.layers.i.mlp.gate.weight [X, E]            T
layers.i.mlp.gate_proj [X, E, F]      model.layers.i.mlp.experts.j.gate_proj.weight    [j], T
lm_head [V, E]                        lm_head.weight [V, E] (absent when tied)         identity
====================================  ==============================================  ============

(``scan_layers`` models hold ``layers.*`` stacked ``[L, ...]``; they are unstacked on export.)
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from gagar_jax.models.transformer import (
    Transformer,
    TransformerConfig,
    stack_layer_params,
    unstack_layer_params,
)


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def to_hf_tensors(params: dict, config: TransformerConfig) -> dict[str, np.ndarray]:
    """Our pure-dict parameters (``nnx.state(model, nnx.Param).to_pure_dict()``) -> HF tensors.

    Accepts both layer layouts (per-layer ``layers.{i}`` and scan-stacked ``layers``). MoE
    experts are written under the Hugging Face hub names (``mlp.experts.{j}.gate_proj.weight``,
    ``mlp.gate.weight``), which ``transformers`` and SGLang load.
    """
    return dict(iter_hf_tensors(params, config))


def iter_hf_tensors(params: dict, config: TransformerConfig, *, fetch=None):
    """``(Hugging Face name, array)`` one tensor at a time, in a fixed order (see
    :func:`to_hf_tensors`).

    ``fetch(x)`` turns one parameter leaf into a host NumPy array (default: ``device_get``);
    it is called for one leaf at a time, just before its tensors are yielded, so a caller that
    drops each tensor after use holds one on the host at a time (an MoE layer's stacked expert
    weights: one stacked leaf), see :func:`save_hf_safetensors_streaming`.
    """
    c = config
    get = fetch or _np
    params = unstack_layer_params(params)

    def one(name, leaf, transform=lambda w: w):
        return name, np.ascontiguousarray(transform(get(leaf)))

    yield one("model.embed_tokens.weight", params["embed_tokens"])
    yield one("model.norm.weight", params["norm"]["weight"])
    if not c.tie_embeddings:
        yield one("lm_head.weight", params["lm_head"])
    for i in range(c.num_layers):
        layer = params["layers"][i]
        pre = f"model.layers.{i}."
        attn, mlp = layer["self_attn"], layer["mlp"]
        yield one(pre + "input_layernorm.weight", layer["input_layernorm"]["weight"])
        yield one(
            pre + "post_attention_layernorm.weight", layer["post_attention_layernorm"]["weight"]
        )
        for name in ("q", "k", "v"):  # [E, heads, D] -> [heads * D, E]
            yield one(
                pre + f"self_attn.{name}_proj.weight",
                attn[f"{name}_proj"],
                lambda w: w.reshape(w.shape[0], -1).T,
            )
            if c.qkv_bias:
                yield one(
                    pre + f"self_attn.{name}_proj.bias",
                    attn[f"{name}_bias"],
                    lambda w: w.reshape(-1),
                )
        if c.qk_norm:
            for name in ("q_norm", "k_norm"):
                yield one(pre + f"self_attn.{name}.weight", attn[name]["weight"])
        yield one(
            pre + "self_attn.o_proj.weight",
            attn["o_proj"],  # [N, D, E] -> [E, N * D]
            lambda w: w.reshape(-1, w.shape[-1]).T,
        )
        if c.num_experts:
            yield one(pre + "mlp.gate.weight", mlp["router"], lambda w: w.T)  # [X, E]
            for name in ("gate_proj", "up_proj", "down_proj"):
                stacked = get(mlp[name])
                for j in range(c.num_experts):
                    yield (
                        pre + f"mlp.experts.{j}.{name}.weight",
                        np.ascontiguousarray(stacked[j].T),
                    )
                del stacked
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                yield one(pre + f"mlp.{name}.weight", mlp[name], lambda w: w.T)


_GATHERS: dict = {}


def gather_to_host(x) -> np.ndarray:
    """One (possibly multi-host sharded) ``jax.Array`` as a NumPy array on every process.

    A jitted identity re-lays it out fully replicated (an all-gather on the devices; every
    process must call this for the same array, in the same order), then this process's
    replica is copied to the host. Only this one tensor is ever gathered.
    """
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return _np(x)
    rep = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    fn = _GATHERS.get(rep)
    if fn is None:
        fn = _GATHERS[rep] = jax.jit(lambda a: a, out_shardings=rep)
    full = fn(x)
    out = np.asarray(full.addressable_shards[0].data)
    del full
    return out


def save_hf_safetensors_streaming(
    params: dict,
    config: TransformerConfig,
    directory: str,
    *,
    dtype: str | None = None,
    writer: bool | None = None,
    max_shard_bytes: int = 1 << 30,
) -> str:
    """:func:`save_hf_safetensors` for sharded (multi-host) parameters, one tensor at a time.

    Every process calls it with the same ``params`` (global ``jax.Array`` leaves, sharded any
    way over the mesh): each tensor is gathered (:func:`gather_to_host`), cast, added to the
    current shard file and dropped; a shard is written when it reaches ``max_shard_bytes``.
    So no host ever holds more than one shard plus one tensor, never the whole model. Only
    the ``writer`` process (default: process 0) writes; the others take part in the gathers.
    The directory is a standard sharded Hugging Face checkpoint
    (``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` + ``config.json``)
    that ``transformers``, SGLang and :func:`load_hf_safetensors` read.

    Returns:
      ``directory``.
    """
    writer = jax.process_index() == 0 if writer is None else writer
    dtype = np.dtype(jax.numpy.dtype(dtype or config.param_dtype))
    shards: list[list[str]] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, np.ndarray] = {}
    size = total = 0
    if writer:
        os.makedirs(directory, exist_ok=True)

    def flush():
        nonlocal pending, size
        if pending:
            if writer:
                save_file(
                    pending,
                    os.path.join(directory, f".shard-{len(shards):05d}"),
                    metadata={"format": "pt"},
                )
            shards.append(list(pending))
            pending, size = {}, 0

    for name, array in iter_hf_tensors(params, config, fetch=gather_to_host):
        array = array.astype(dtype, copy=False)
        if size and size + array.nbytes > max_shard_bytes:
            flush()
        pending[name] = array
        size += array.nbytes
        total += array.nbytes
        del array
    flush()
    if not writer:
        return directory
    n = len(shards)
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(directory, f".shard-{i:05d}"), os.path.join(directory, final))
        weight_map.update({name: final for name in names})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    hf = config.to_hf()
    hf["torch_dtype"] = str(dtype)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return directory


def from_hf_tensors(tensors: dict[str, np.ndarray], config: TransformerConfig) -> dict:
    """HF tensors -> our pure-dict parameters (numpy, cast to ``config.param_dtype``).

    The layer layout follows ``config.scan_layers``. MoE experts are read from the hub names
    (``mlp.experts.{j}.gate_proj.weight``) or from the fused ``transformers`` 5 layout
    (``mlp.experts.gate_up_proj [X, 2F, E]``, ``mlp.experts.down_proj [X, E, F]``).
    Raises a ``ValueError`` naming the tensor when one is missing or has the wrong shape.
    """
    c = config
    dtype = np.dtype(jax.numpy.dtype(c.param_dtype))

    def get(name, shape):
        if name not in tensors:
            raise ValueError(
                f"safetensors checkpoint lacks tensor {name!r} (expected shape {shape})"
            )
        x = np.asarray(tensors[name])
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
        return x.astype(dtype)

    e, n, kv, d, f, v = (
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
    )
    params = {
        "embed_tokens": get("model.embed_tokens.weight", (v, e)),
        "norm": {"weight": get("model.norm.weight", (e,))},
        "layers": {},
    }
    if not c.tie_embeddings:
        params["lm_head"] = get("lm_head.weight", (v, e))
    for i in range(c.num_layers):
        pre = f"model.layers.{i}."
        attn = {}
        for name, heads in (("q", n), ("k", kv), ("v", kv)):
            w = get(pre + f"self_attn.{name}_proj.weight", (heads * d, e))
            attn[f"{name}_proj"] = w.T.reshape(e, heads, d)
            if c.qkv_bias:
                attn[f"{name}_bias"] = get(
                    pre + f"self_attn.{name}_proj.bias", (heads * d,)
                ).reshape(heads, d)
        if c.qk_norm:
            for name in ("q_norm", "k_norm"):
                attn[name] = {"weight": get(pre + f"self_attn.{name}.weight", (d,))}
        attn["o_proj"] = get(pre + "self_attn.o_proj.weight", (e, n * d)).T.reshape(n, d, e)
        if c.num_experts:
            x, fm = c.num_experts, c.moe_intermediate_size
            mlp = {"router": get(pre + "mlp.gate.weight", (x, e)).T}
            fused = pre + "mlp.experts.gate_up_proj"
            if fused in tensors:
                gate_up = get(fused, (x, 2 * fm, e))  # [X, 2F, E]: gate rows then up rows
                mlp["gate_proj"] = np.swapaxes(gate_up[:, :fm], 1, 2)
                mlp["up_proj"] = np.swapaxes(gate_up[:, fm:], 1, 2)
                mlp["down_proj"] = np.swapaxes(get(pre + "mlp.experts.down_proj", (x, e, fm)), 1, 2)
            else:
                ex = pre + "mlp.experts.{}.{}.weight"
                for name, shape in (
                    ("gate_proj", (fm, e)),
                    ("up_proj", (fm, e)),
                    ("down_proj", (e, fm)),
                ):
                    mlp[name] = np.stack([get(ex.format(j, name), shape).T for j in range(x)])
        else:
            mlp = {
                "gate_proj": get(pre + "mlp.gate_proj.weight", (f, e)).T,
                "up_proj": get(pre + "mlp.up_proj.weight", (f, e)).T,
                "down_proj": get(pre + "mlp.down_proj.weight", (e, f)).T,
            }
        params["layers"][i] = {
            "input_layernorm": {"weight": get(pre + "input_layernorm.weight", (e,))},
            "post_attention_layernorm": {
                "weight": get(pre + "post_attention_layernorm.weight", (e,))
            },
            "self_attn": attn,
            "mlp": mlp,
        }
    params = jax.tree.map(np.ascontiguousarray, params)
    return stack_layer_params(params) if c.scan_layers else params


def model_from_params(config: TransformerConfig, params: dict) -> Transformer:
    """A :class:`Transformer` holding ``params`` (pure dict), without running the initialisers.

    ``params`` may be in either layer layout; it is converted to ``config.scan_layers``'.
    """
    params = stack_layer_params(params) if config.scan_layers else unstack_layer_params(params)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, params))
    return nnx.merge(graphdef, state)


def save_hf_safetensors(
    model_or_params, config: TransformerConfig, directory: str, *, dtype: str | None = None
) -> str:
    """Writes ``model.safetensors`` and ``config.json`` to ``directory``; returns the directory.

    Args:
      model_or_params: a :class:`Transformer` or its pure-dict parameters.
      config: the model config (written as a Hugging Face ``config.json``).
      directory: created if missing.
      dtype: storage dtype of the tensors (default ``config.param_dtype``).
    """
    if isinstance(model_or_params, nnx.Module):
        params = nnx.to_pure_dict(nnx.state(model_or_params, nnx.Param))
    else:
        params = model_or_params
    dtype = np.dtype(jax.numpy.dtype(dtype or config.param_dtype))
    tensors = {k: v.astype(dtype) for k, v in to_hf_tensors(params, config).items()}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf()
    hf["torch_dtype"] = str(dtype)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return directory


def load_hf_safetensors(
    directory: str, **config_overrides
) -> tuple[TransformerConfig, Transformer]:
    """Loads ``config.json`` and every ``*.safetensors`` shard in ``directory``.

    ``config_overrides`` replace config fields (e.g. ``dtype="bfloat16"``, ``remat=True``).
    """
    with open(os.path.join(directory, "config.json")) as f:
        config = TransformerConfig.from_hf(json.load(f), **config_overrides)
    files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(directory, name)))
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied copy anyway
    return config, model_from_params(config, from_hf_tensors(tensors, config))
