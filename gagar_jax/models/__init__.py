"""Policy models: a Qwen2/Qwen3/Qwen3-MoE/Llama decoder in Flax NNX, safetensors I/O, sharding."""

from gagar_jax.models import lora
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
from gagar_jax.models.transformer import (
    REMAT_POLICIES,
    SMALL_DECODER,
    Cache,
    Transformer,
    TransformerConfig,
    create_model,
    rope,
    rope_inv_freq,
    router_metrics,
    stack_layer_params,
    unstack_layer_params,
)

__all__ = [
    "BATCH_AXES",
    "LOGICAL_RULES",
    "Cache",
    "Transformer",
    "TransformerConfig",
    "create_model",
    "from_hf_tensors",
    "lora",
    "load_hf_safetensors",
    "model_from_params",
    "save_hf_safetensors",
    "save_hf_safetensors_streaming",
    "to_hf_tensors",
    "logical_to_spec",
    "param_shardings",
    "param_specs",
    "rope",
    "rope_inv_freq",
    "router_metrics",
    "stack_layer_params",
    "unstack_layer_params",
    "REMAT_POLICIES",
    "SMALL_DECODER",
]
