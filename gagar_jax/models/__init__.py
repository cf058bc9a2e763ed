"""Policy models: a Qwen2/Llama-compatible decoder in Flax NNX, safetensors I/O, sharding."""

from gagar_jax.models.hf import (
    from_hf_tensors,
    load_hf_safetensors,
    model_from_params,
    save_hf_safetensors,
    save_hf_safetensors_streaming,
    to_hf_tensors,
)
from gagar_jax.models.sharding import (
    BATCH_AXES,
    LOGICAL_RULES,
    logical_to_spec,
    param_shardings,
    param_specs,
)
from gagar_jax.models.transformer import Cache, Transformer, TransformerConfig, create_model, rope

__all__ = [
    "BATCH_AXES",
    "LOGICAL_RULES",
    "Cache",
    "Transformer",
    "TransformerConfig",
    "create_model",
    "from_hf_tensors",
    "load_hf_safetensors",
    "model_from_params",
    "save_hf_safetensors",
    "save_hf_safetensors_streaming",
    "to_hf_tensors",
    "logical_to_spec",
    "param_shardings",
    "param_specs",
    "rope",
]
