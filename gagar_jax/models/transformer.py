"""Decoder-only transformer policy in Flax NNX: Qwen2, Qwen3, Qwen3-MoE and Llama 3.x.

Architecture (pre-norm, as in Hugging Face ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
``Qwen3MoeForCausalLM`` / ``LlamaForCausalLM``)::

    h = embed(tokens)
    for each layer:
        q, k, v = q_proj(rms(h)), k_proj(rms(h)), v_proj(rms(h))      # + bias (Qwen2)
        q, k = q_norm(q), k_norm(k)                                    # per-head RMSNorm (Qwen3)
        h = h + o_proj(attention(rope(q), rope(k), v))                 # llama3 rope scaling
        h = h + mlp(rms(h))          # SwiGLU, or the top-k routed mixture of SwiGLU experts
    logits = lm_head(rms(h))            # or embed^T when embeddings are tied

- RMSNorm and the attention softmax are computed in float32 whatever the compute dtype; logits
  are float32 (matmul with ``preferred_element_type=float32``).
- Rotary embeddings use the "rotate half" convention of Hugging Face, driven by explicit
  ``positions`` so left padding and packed sequences work; ``rope_llama3_scaling`` applies the
  Llama 3.x frequency scaling (``rope_scaling.rope_type == "llama3"``).
- Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` key/value heads.
- Kernels are stored head-split (``q: [embed, heads, head_dim]``) so heads can be sharded on the
  ``tensor`` mesh axis; every parameter carries ``logical_axes`` metadata (see ``sharding.py``).
- Mixture of experts (``num_experts > 0``, Qwen3-MoE): a linear router gives softmax
  probabilities over experts, each token goes to its ``num_experts_per_tok`` most likely
  experts with those probabilities as weights (renormalised over the chosen ones when
  ``norm_topk_prob``). Expert kernels are stacked ``[experts, ...]`` with logical axis
  ``"expert"`` (sharded on the ``tensor`` mesh axis). Every expert runs on every token and the
  combine weights are zero off the top-k (exact, and shardable by GSPMD; the compute is
  ``num_experts / num_experts_per_tok`` times a dispatching kernel's: fine for the small models
  this framework tests, a dispatch kernel is future work). Router statistics and the
  Switch-Transformer load-balancing loss come back with ``return_aux=True``.

Layer layouts. ``scan_layers=False`` (default): ``layers`` is an ``nnx.List`` of blocks, pure-dict
parameters ``layers.{i}.self_attn.q_proj``. ``scan_layers=True``: one block whose parameters are
stacked ``[num_layers, ...]`` (logical axis ``"layers"``, never sharded), run by ``lax.scan`` so
the compiled program (and its compile time) does not grow with depth; pure-dict parameters
``layers.self_attn.q_proj [L, E, N, D]``. ``gagar_jax.models.hf`` reads and writes both, and
:func:`stack_layer_params` / :func:`unstack_layer_params` convert between them. ``remat`` wraps
each layer in ``jax.checkpoint`` with ``remat_policy`` (``"full"``: save nothing; ``"dots"``:
save matmul outputs; ``"dots_no_batch"``: save matmuls without batch dimensions, i.e. weights'
products).

Causal masking is by slot index (query slot ``t`` sees key slots ``s <= t``) combined with an
``attention_mask`` over keys; RoPE uses ``positions``. A fully masked query row (a padding token)
attends uniformly instead of producing NaN: masked scores are a large finite negative number.

Decoding: ``init_cache(batch, max_len)`` returns a :class:`Cache`; ``decode`` writes ``T`` new
tokens at ``cache.index`` (prefill when ``T > 1``, one step when ``T == 1``) and returns the
logits of those tokens, equal to the full forward's logits at the same slots. The new keys and
values are written into the cache buffers in place (``dynamic_update_slice`` at slot ``index``),
never re-stacked, so a decode step inside a ``while_loop`` moves one token's worth of cache, not
the whole cache. The buffers are laid out for the attention dots, so a step reads them as they
are (no per-step transposing copy of the cache): keys slot-minor ``[B, KV, D, S]``, values
``[B, KV, S, D]``, one buffer per layer (a tuple) for per-layer blocks; for ``scan_layers``
models one stacked ``[L, ...]`` buffer each (the scan carries it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gagar_jax.models import lora as _lora
from gagar_jax.models.kv_quant import QuantizedKV, empty_kv, quantize_kv, read_kv

_MASK_VALUE = -1e30  # finite: a fully masked row softmaxes to uniform, not NaN.
REMAT_POLICIES = ("full", "dots", "dots_no_batch")


def _dtype(name: Any) -> jnp.dtype:
    return jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the decoder (hashable: usable as a static jit argument).

    ``dtype`` is the compute dtype (``"float32"`` or ``"bfloat16"``), ``param_dtype`` the storage
    dtype of parameters. ``head_dim`` defaults to ``hidden_size // num_heads``.
    ``rope_llama3_scaling`` is ``(factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)`` of a Llama 3.x ``rope_scaling`` (None: plain RoPE).
    ``num_experts > 0`` makes every MLP a Qwen3-MoE mixture of ``num_experts`` SwiGLU experts of
    width ``moe_intermediate_size`` with top-``num_experts_per_tok`` routing.
    ``causal_block_size`` (execution only, 0: off): the full forward's attention runs its
    queries in blocks of this many slots (at most 16 blocks; longer sequences use ``T / 16``),
    each block against the keys up to its last slot only, skipping the score blocks the causal
    mask zeroes anyway (about half the attention work and memory at long ``T``).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = True
    tie_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    initializer_range: float = 0.02
    qk_norm: bool = False
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    max_position_embeddings: int = 32768
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    scan_layers: bool = False
    remat_policy: str = "full"
    causal_block_size: int = 32
    # LoRA (gagar_jax.models.lora): rank 0 is off; the adapters' scaling is alpha / rank.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = _lora.LORA_TARGETS

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"TransformerConfig.hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_heads ({self.num_heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig.head_dim must be even for RoPE, got {self.head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("dtype", "param_dtype"):
            value = str(jnp.dtype(getattr(self, name)))
            if value not in ("float32", "bfloat16", "float16"):
                raise ValueError(
                    f"TransformerConfig.{name} must be float32/bfloat16/float16, got {value}"
                )
            object.__setattr__(self, name, value)
        if not isinstance(self.causal_block_size, int) or self.causal_block_size < 0:
            raise ValueError(
                "TransformerConfig.causal_block_size must be an int >= 0 (0: one block), "
                f"got {self.causal_block_size!r}"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"TransformerConfig.remat_policy must be one of {REMAT_POLICIES}, "
                f"got {self.remat_policy!r}"
            )
        if self.rope_llama3_scaling is not None:
            s = tuple(self.rope_llama3_scaling)
            if len(s) != 4 or s[0] <= 0 or s[1] <= 0 or s[2] <= s[1] or s[3] <= 0:
                raise ValueError(
                    "TransformerConfig.rope_llama3_scaling must be (factor > 0, "
                    "low_freq_factor > 0, high_freq_factor > low_freq_factor, "
                    f"original_max_position_embeddings > 0), got {self.rope_llama3_scaling}"
                )
            object.__setattr__(
                self, "rope_llama3_scaling", (float(s[0]), float(s[1]), float(s[2]), int(s[3]))
            )
        self._check_lora()
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(
                f"TransformerConfig.num_experts must be an int >= 0, got {self.num_experts!r}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"TransformerConfig.num_experts_per_tok must be in [1, num_experts="
                    f"{self.num_experts}], got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size is None:
                object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
            if self.moe_intermediate_size <= 0:
                raise ValueError(
                    "TransformerConfig.moe_intermediate_size must be positive, "
                    f"got {self.moe_intermediate_size}"
                )

    def _check_lora(self):
        targets = self.lora_targets
        if isinstance(targets, str):  # a command-line override: "q_proj,v_proj"
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        targets = tuple(targets)
        object.__setattr__(self, "lora_targets", targets)
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ValueError(
                f"TransformerConfig.lora_rank must be an int >= 0 (0: no LoRA), "
                f"got {self.lora_rank!r}"
            )
        if not self.lora_alpha > 0:
            raise ValueError(f"TransformerConfig.lora_alpha must be > 0, got {self.lora_alpha}")
        object.__setattr__(self, "lora_alpha", float(self.lora_alpha))
        unknown = sorted(set(targets) - set(_lora.LORA_TARGETS))
        if unknown or (self.lora_rank and not targets):
            raise ValueError(
                f"TransformerConfig.lora_targets must be a non-empty subset of "
                f"{_lora.LORA_TARGETS}, got {targets}"
            )
        if self.lora_rank and self.num_experts and set(targets) & set(_lora.MLP_TARGETS):
            raise ValueError(
                "TransformerConfig.lora_targets: a mixture-of-experts model takes adapters on "
                f"the attention projections {_lora.ATTN_TARGETS} only, got {targets}"
            )

    @property
    def num_lora_params(self) -> int:
        """Number of adapter parameters (0 without LoRA)."""
        if not self.lora_rank:
            return 0
        h, d, f = self.hidden_size, self.head_dim, self.intermediate_size
        n, kv = self.num_heads * d, self.num_kv_heads * d
        sizes = dict(
            q_proj=(h, n), k_proj=(h, kv), v_proj=(h, kv), o_proj=(n, h),
            gate_proj=(h, f), up_proj=(h, f), down_proj=(f, h),
        )  # fmt: skip
        per_layer = sum(self.lora_rank * sum(sizes[t]) for t in self.lora_targets)
        return self.num_layers * per_layer

    @property
    def num_params(self) -> int:
        """Number of parameters (embeddings counted once when tied)."""
        h, d, f = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        if self.num_experts:
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)
        else:
            mlp = 3 * h * f
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h

    @property
    def architecture(self) -> str:
        """``"qwen3_moe"``, ``"qwen3"``, ``"qwen2"`` or ``"llama"`` (the HF ``model_type``)."""
        if self.num_experts:
            return "qwen3_moe"
        if self.qk_norm:
            return "qwen3"
        return "qwen2" if self.qkv_bias else "llama"

    # -- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> TransformerConfig:
        """Builds a config from a Hugging Face ``config.json`` dict.

        Supported ``model_type``: ``qwen2``, ``qwen3``, ``qwen3_moe``, ``llama`` (Llama 2/3.x,
        ``rope_scaling`` of type ``llama3``). Anything this model does not implement raises
        ``NotImplementedError`` naming the config field.
        """
        model_type = hf.get("model_type", "qwen2")
        if model_type not in ("qwen2", "llama", "qwen3", "qwen3_moe"):
            raise ValueError(
                "config.json model_type must be 'qwen2', 'qwen3', 'qwen3_moe' or "
                f"'llama', got {model_type!r}"
            )
        rope_scaling = hf.get("rope_scaling") or None
        rope_params = hf.get("rope_parameters") or {}
        llama3 = None
        for field, spec in (("rope_scaling", rope_scaling), ("rope_parameters", rope_params)):
            if not spec:
                continue
            kind = spec.get("rope_type", spec.get("type", "default"))
            if kind == "default":
                continue
            if kind != "llama3" or model_type != "llama":
                raise NotImplementedError(
                    f"config.json {field}={spec} is not supported (only rope_type 'default', "
                    "and 'llama3' for model_type 'llama')"
                )
            try:
                llama3 = (
                    float(spec["factor"]),
                    float(spec["low_freq_factor"]),
                    float(spec["high_freq_factor"]),
                    int(spec["original_max_position_embeddings"]),
                )
            except KeyError as e:
                raise ValueError(f"config.json {field} of rope_type llama3 lacks {e}") from e
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"config.json hidden_act must be 'silu', got {hf['hidden_act']}"
            )
        if hf.get("use_sliding_window", False):
            raise NotImplementedError("config.json use_sliding_window=true is not supported")
        layer_types = hf.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                "config.json layer_types must all be 'full_attention', got "
                f"{sorted(set(layer_types))}"
            )
        moe = {}
        if model_type == "qwen2":
            qkv_bias, qk_norm = True, False
        elif model_type == "llama":
            if hf.get("attention_bias", False):
                raise NotImplementedError(
                    "Llama attention_bias=true (biased o_proj) is not supported"
                )
            if hf.get("mlp_bias", False):
                raise NotImplementedError("Llama mlp_bias=true is not supported")
            qkv_bias, qk_norm = False, False
        else:
            if hf.get("attention_bias", False):
                raise NotImplementedError(
                    f"{model_type} attention_bias=true (biased q/k/v/o_proj) is not supported"
                )
            qkv_bias, qk_norm = False, True
            if model_type == "qwen3_moe":
                if int(hf.get("decoder_sparse_step", 1)) != 1:
                    raise NotImplementedError(
                        "qwen3_moe decoder_sparse_step != 1 (dense layers between MoE layers) is "
                        f"not supported, got {hf['decoder_sparse_step']}"
                    )
                if hf.get("mlp_only_layers"):
                    raise NotImplementedError(
                        "qwen3_moe mlp_only_layers (dense layers) is not supported, got "
                        f"{hf['mlp_only_layers']}"
                    )
                experts = hf.get("num_experts", hf.get("num_local_experts"))
                if not experts:
                    raise ValueError("qwen3_moe config.json lacks num_experts")
                moe = dict(
                    num_experts=int(experts),
                    num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                )
        num_heads = hf["num_attention_heads"]
        kwargs = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            intermediate_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_params.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_llama3_scaling=llama3,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            **moe,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self, *, max_position_embeddings: int | None = None) -> dict:
        """The Hugging Face ``config.json`` dict of :attr:`architecture`."""
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=max_position_embeddings or self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            initializer_range=self.initializer_range,
            torch_dtype=self.param_dtype,
            use_cache=True,
            attention_dropout=0.0,
        )
        arch = self.architecture
        if arch in ("qwen3", "qwen3_moe"):
            if self.qkv_bias:
                raise ValueError("Qwen3 has no q/k/v bias: set qkv_bias=False with qk_norm=True")
            out = dict(
                attention_bias=False,
                use_sliding_window=False,
                sliding_window=None,
                max_window_layers=self.num_layers,
                **common,
            )
            if arch == "qwen3":
                return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", **out)
            if not self.qk_norm:
                raise ValueError("Qwen3-MoE always has q/k norms: set qk_norm=True")
            return dict(
                architectures=["Qwen3MoeForCausalLM"],
                model_type="qwen3_moe",
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                output_router_logits=False,
                **out,
            )
        if self.rope_llama3_scaling is not None and arch != "llama":
            raise ValueError("rope_llama3_scaling is exported as Llama only (qkv_bias=False)")
        if arch == "qwen2":
            if self.head_dim != self.hidden_size // self.num_heads:
                raise ValueError(
                    "Qwen2 requires head_dim == hidden_size // num_heads; "
                    f"got head_dim={self.head_dim}"
                )
            return dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                use_sliding_window=False,
                sliding_window=None,
                max_window_layers=0,
                **common,
            )
        out = dict(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            attention_bias=False,
            mlp_bias=False,
            pretraining_tp=1,
            **common,
        )
        if self.rope_llama3_scaling is not None:
            f, lo, hi, orig = self.rope_llama3_scaling
            out["rope_scaling"] = dict(
                rope_type="llama3",
                factor=f,
                low_freq_factor=lo,
                high_freq_factor=hi,
                original_max_position_embeddings=orig,
            )
        return out


# A small decoder that trains from scratch on a CPU in minutes: the policy of the toy task
# families' experiments (the RL loop's and the feedback trainer's default model). vocab_size is a
# placeholder: the run's tokenizer decides it (``RunConfig.model_config``).
SMALL_DECODER = TransformerConfig(
    vocab_size=1,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    rope_theta=10000.0,
    qkv_bias=False,
    tie_embeddings=True,
)


class Cache(NamedTuple):
    """Key/value cache for incremental decoding (a pytree; pass it through ``jit``)."""

    # keys after RoPE: per layer [B, KV, D, S] (tuple); scan [L, B, KV, D, S]; values: per
    # layer [B, KV, S, D] (tuple); scan [L, B, KV, S, D]. Arrays of the cache dtype, or int8
    # ``gagar_jax.models.kv_quant.QuantizedKV`` buffers (one scale per token and head).
    k: Any
    v: Any
    mask: jax.Array  # [B, S] bool, True where a slot holds a real (non-padding) token
    index: jax.Array  # [] int32, next slot to write

    # Axes counted from the end, so each holds for a layer's buffer and a stacked one alike.
    BATCH_AXIS = -4
    K_SLOT_AXIS = -1
    V_SLOT_AXIS = -2

    def take_rows(self, rows: jax.Array) -> Cache:
        """The cache of rows ``rows`` ([B'] int): row ``i`` of the result is row ``rows[i]``."""
        take = lambda x: jnp.take(x, rows, axis=Cache.BATCH_AXIS)  # noqa: E731
        return self._replace(
            k=jax.tree.map(take, self.k), v=jax.tree.map(take, self.v), mask=self.mask[rows]
        )

    def slice_slots(self, start: int, stop: int | None = None) -> Cache:
        """Slots ``start:stop`` of every row (static bounds)."""
        cut = lambda x, axis: jax.lax.slice_in_dim(x, start, stop, axis=axis)  # noqa: E731
        return self.map_slots(cut, cut, lambda m: m[:, start:stop])

    def write_slots(self, other: Cache, start: int = 0) -> Cache:
        """This cache with ``other``'s slots (same rows, fewer slots) written from ``start``."""

        def put(bufs, new, axis):
            return jax.tree.map(
                lambda o, n: jax.lax.dynamic_update_slice_in_dim(
                    o, n.astype(o.dtype), start, axis=o.ndim + axis
                ),
                bufs,
                new,
            )

        return self._replace(
            k=put(self.k, other.k, Cache.K_SLOT_AXIS),
            v=put(self.v, other.v, Cache.V_SLOT_AXIS),
            mask=jax.lax.dynamic_update_slice_in_dim(self.mask, other.mask, start, axis=1),
        )

    def pad_slots(self, extra: int) -> Cache:
        """This cache with ``extra`` empty (masked) slots appended to every row (static)."""

        def pad(x, axis):
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, extra)
            return jnp.pad(x, widths)

        return self.map_slots(pad, pad, lambda m: jnp.pad(m, ((0, 0), (0, extra))))

    def map_slots(self, k_fn, v_fn, mask_fn) -> Cache:
        """Applies ``k_fn(buf, slot_axis)`` / ``v_fn`` to every key / value buffer and
        ``mask_fn`` to the mask (slot axis 1): slot-wise edits of the whole cache."""
        return self._replace(
            k=jax.tree.map(lambda x: k_fn(x, x.ndim + Cache.K_SLOT_AXIS), self.k),
            v=jax.tree.map(lambda x: v_fn(x, x.ndim + Cache.V_SLOT_AXIS), self.v),
            mask=mask_fn(self.mask),
        )


def _param(
    rngs: nnx.Rngs,
    shape,
    axes,
    config: TransformerConfig,
    init: str = "normal",
    stack: int | None = None,
):
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    dtype = _dtype(config.param_dtype)
    if init == "normal":
        value = config.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:  # "ones"
        value = jnp.ones(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(
        self,
        config: TransformerConfig,
        *,
        rngs: nnx.Rngs,
        size: int | None = None,
        axis: str = "norm",
        stack: int | None = None,
    ):
        self.eps = config.rms_norm_eps
        self.weight = _param(rngs, (size or config.hidden_size,), (axis,), config, "ones", stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(jnp.float32) * x32.astype(dtype).astype(jnp.float32)


def rope_inv_freq(
    head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None
) -> np.ndarray:
    """RoPE inverse frequencies ``[head_dim / 2]`` (float32), Llama 3.x scaled when given.

    Llama 3 (``rope_type="llama3"``): wavelengths longer than ``original / low_freq_factor`` are
    divided by ``factor``, those shorter than ``original / high_freq_factor`` kept, and the band
    in between interpolated linearly in ``original / wavelength``.
    """
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if llama3 is not None:
        factor, lo, hi, orig = llama3
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > orig / lo, inv / factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _materialized(x: jax.Array) -> jax.Array:
    """``x`` unchanged, as one buffer that XLA computes once.

    XLA:CPU fuses an elementwise producer into each of its consumers and evaluates it again in
    each (``optimization_barrier`` does not stop that there). A dot's result is a buffer of its
    own, and a dot with the identity matrix returns its operand exactly (each output is one
    product by 1 plus zeros; ``HIGHEST`` precision keeps accelerators from rounding the
    operand to a narrower type first). Subnormal values would be flushed to zero: RoPE's
    tables hold none (``|cos|`` and ``|sin|`` of a float32 angle are 0 or above 1e-8).
    """
    eye = jnp.eye(x.shape[-1], dtype=x.dtype)
    return jnp.einsum("...d,de->...e", x, eye, precision=jax.lax.Precision.HIGHEST)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The cosines and sines RoPE rotates by: ``(cos, sin)``, each ``[B, T, 1, D]`` float32.

    Every layer rotates its queries and keys by the same angles, so the model computes these
    once per forward and hands them to every layer, as buffers (:func:`_materialized`):
    otherwise XLA:CPU evaluates ``cos`` and ``sin`` again inside every fusion that applies
    them (each layer's queries and keys, each attention block's key slice, forward and
    backward: 72 fusions in the small config's update, about 4% of its CPU time).

    Args:
      positions: [B, T] int positions.
      inv_freq: [D/2] float32 inverse frequencies (:func:`rope_inv_freq`).
    Returns:
      (cos, sin), each [B, T, 1, D] float32 ("rotate half" layout: the D/2 angles twice).
    """
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    return _materialized(jnp.cos(angles)), _materialized(jnp.sin(angles))


def apply_rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates ``x`` [B, T, H, D] by :func:`rope_tables` ``(cos, sin)``; same dtype as ``x``
    (rotation computed in float32)."""
    cos, sin = tables
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float, *, inv_freq=None) -> jax.Array:
    """Rotary embedding, Hugging Face "rotate half" layout.

    Args:
      x: [B, T, H, D] queries or keys.
      positions: [B, T] int positions.
      theta: RoPE base (ignored when ``inv_freq`` is given).
      inv_freq: [D/2] inverse frequencies (default: plain RoPE of ``theta``).
    Returns:
      [B, T, H, D], same dtype as ``x`` (rotation computed in float32).
    """
    d = x.shape[-1]
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    return apply_rope(x, rope_tables(positions, inv_freq))


def _causal_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """Query blocks ``[lo, hi)`` covering ``0..t``: ``block`` slots each, at most 16 blocks."""
    if block <= 0 or t <= block:
        return [(0, t)]
    block = max(block, -(-t // 16))
    return [(lo, min(lo + block, t)) for lo in range(0, t, block)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _linear(x, w, in_dims: int = 1):
    """``x [..., *I] @ w [*I, *O] -> [..., *O]``, contracting the last ``in_dims`` dims of ``x``
    with the first ``in_dims`` of ``w`` (a projection: ``"bte,end->btnd"``, ``"btnd,nde->bte"``).

    The value and gradient are the plain matmul's. The backward is written out because
    XLA:CPU, left to autodiff, computes the weight gradient ``x^T dy`` by transposing ``dy``
    (with the activation's backward fused into that strided pass, however wide ``dy`` is) and
    then runs a slow strided dot. Here the narrower of ``x`` and ``dy`` is transposed into a
    real row-major ``[width, tokens]`` array (an ``optimization_barrier`` keeps XLA from
    folding it back into the dot), so both backward dots take the fast GEMM path (docs/
    benchmarks.md): ``x^T`` is the forward's residual when ``I <= O``; otherwise the
    forward keeps ``x`` and the backward computes ``(dy^T x)^T``, a weight-sized transpose.
    """
    return _matmul_2d(x, w, in_dims)[0]


def _matmul_2d(x, w, in_dims):
    """(x @ w in x's and w's shapes, x as [tokens, I])."""
    x2 = x.reshape(-1, math.prod(x.shape[x.ndim - in_dims :]))
    y = x2 @ w.reshape(x2.shape[1], -1)
    return y.reshape(x.shape[: x.ndim - in_dims] + w.shape[in_dims:]), x2


def _keeps_x_transposed(w, in_dims) -> bool:
    """I <= O: the residual is x^T (else x, and the backward transposes dy)."""
    return math.prod(w.shape[:in_dims]) <= math.prod(w.shape[in_dims:])


def _linear_fwd(x, w, in_dims):
    y, x2 = _matmul_2d(x, w, in_dims)
    if _keeps_x_transposed(w, in_dims):
        return y, (jax.lax.optimization_barrier(x2.T), w, x.shape)
    return y, (x2, w, x.shape)


def _linear_bwd(in_dims, residuals, dy):
    x_res, w, x_shape = residuals
    w2 = w.reshape(math.prod(w.shape[:in_dims]), -1)
    dy2 = dy.reshape(-1, w2.shape[1])
    dx = jnp.einsum("to,ko->tk", dy2, w2).reshape(x_shape)
    if _keeps_x_transposed(w, in_dims):
        dw = x_res @ dy2  # x^T [I, tokens] @ dy
    else:
        dw = (jax.lax.optimization_barrier(dy2.T) @ x_res).T  # (dy^T x)^T
    return dx, dw.reshape(w.shape)


_linear.defvjp(_linear_fwd, _linear_bwd)


def _block_scores(qh, kh, mask, lo, hi):
    """Masked float32 scores of query block ``[lo, hi)`` against keys ``[0, hi)``
    (``[B, KV, hi - lo, G, hi]``) and the block's mask broadcast to them."""
    b, kv, _, g, d = qh.shape
    qb = qh[:, :, lo:hi].reshape(b, kv, (hi - lo) * g, d)
    scores = jnp.einsum(
        "bkmd,bksd->bkms", qb, kh[:, :, :hi], preferred_element_type=jnp.float32
    ).reshape(b, kv, hi - lo, g, hi)
    block_mask = mask[:, None, lo:hi, None, :hi]
    return jnp.where(block_mask, scores * (d**-0.5), _MASK_VALUE), block_mask


def _blocked_attention_fwd(qh, kh, vh, mask, blocks):
    """Per block: scores, row max ``m``, ``e = exp(s - m)``, ``out = (e @ v) / sum(e)``.
    Returns (out [B, KV, T, G, D], per-block ``(m, log sum e)`` each [B, KV, n, G, 1])."""
    b, kv, _, g, d = qh.shape
    dt = qh.dtype
    outs, stats = [], []
    for lo, hi in blocks:
        scores, _ = _block_scores(qh, kh, mask, lo, hi)
        m = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.exp(scores - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        out = jnp.einsum(
            "bkms,bksd->bkmd",
            e.astype(dt).reshape(b, kv, -1, hi),
            vh[:, :, :hi],
            preferred_element_type=jnp.float32,
        ).reshape(b, kv, hi - lo, g, d)
        outs.append((out / total).astype(dt))
        stats.append((m, jnp.log(total)))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    return out, stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked_causal_attention(qh, kh, vh, mask, blocks):
    """``softmax(q k^T / sqrt(D), masked) v`` with query blocks ``blocks`` (``[lo, hi)``, each
    scored against keys ``[0, hi)`` only: the causally masked rest would softmax to zeros).

    qh [B, KV, T, G, D], kh/vh [B, KV, T, D], mask [B, T, T] bool -> [B, KV, T, G, D].

    The backward pass is FlashAttention's: the forward keeps only its output and each query
    row's max and log-sum-exp, and the backward recomputes the probabilities block by block
    (``p = exp(s - m - log l)`` from the same scores and row statistics) and uses
    ``ds = p * (dp - rowsum(dout * out))``. No ``[.., T, S]`` probability array is stored
    between the passes, and the softmax backward is one elementwise pass instead of autodiff's
    three. A query row without any valid key (left padding) gets a finite output, uniform
    over its block's keys; it is not defined by the mask and callers mask it out.
    """
    return _blocked_attention_fwd(qh, kh, vh, mask, blocks)[0]


def _blocked_causal_attention_fwd(qh, kh, vh, mask, blocks):
    out, stats = _blocked_attention_fwd(qh, kh, vh, mask, blocks)
    return out, (qh, kh, vh, mask, out, stats)


def _blocked_causal_attention_bwd(blocks, residuals, d_out):
    qh, kh, vh, mask, out, stats = residuals
    b, kv, _, g, d = qh.shape
    dt = qh.dtype
    d_out = d_out.astype(jnp.float32)
    # rowsum(dout * out) == sum_s p_s dp_s, the softmax backward's subtracted term.
    row_dot = jnp.sum(d_out * out.astype(jnp.float32), axis=-1, keepdims=True)
    # dk = ds^T q and dv = p^T dout contract the queries, the probabilities' leading axis.
    # Written so, XLA:CPU ran them as strided dots at 14-21 GFLOP/s. They are computed
    # transposed instead, dk^T = q^T ds and dv^T = dout^T p, from q^T and dout^T laid out
    # once (``[B, KV, D, T * G]``, an optimization barrier keeps XLA from folding the
    # transposes back into the dots), and dk, dv are transposed once at the end.
    q_t, do_t = jax.lax.optimization_barrier(
        (
            qh.transpose(0, 1, 4, 2, 3).reshape(b, kv, d, -1),
            d_out.astype(dt).transpose(0, 1, 4, 2, 3).reshape(b, kv, d, -1),
        )
    )
    dq = []
    dk_t = jnp.zeros((b, kv, d, kh.shape[2]), jnp.float32)
    dv_t = jnp.zeros((b, kv, d, vh.shape[2]), jnp.float32)
    for (lo, hi), (m, log_total) in zip(blocks, stats):
        scores, block_mask = _block_scores(qh, kh, mask, lo, hi)
        p = jnp.exp((scores - m) - log_total)  # [B, KV, n, G, hi] float32
        do_b = d_out[:, :, lo:hi].reshape(b, kv, -1, d)
        dp = jnp.einsum(
            "bkmd,bksd->bkms", do_b.astype(dt), vh[:, :, :hi], preferred_element_type=jnp.float32
        ).reshape(p.shape)
        ds = jnp.where(block_mask, p * (dp - row_dot[:, :, lo:hi]), 0.0) * (d**-0.5)
        p = p.astype(dt).reshape(b, kv, -1, hi)
        ds = ds.astype(dt).reshape(b, kv, -1, hi)
        rows = slice(lo * g, hi * g)  # the block's queries in q_t and do_t
        dv_t = dv_t.at[..., :hi].add(
            jnp.einsum("bkdm,bkms->bkds", do_t[..., rows], p, preferred_element_type=jnp.float32)
        )
        dk_t = dk_t.at[..., :hi].add(
            jnp.einsum("bkdm,bkms->bkds", q_t[..., rows], ds, preferred_element_type=jnp.float32)
        )
        dq.append(
            jnp.einsum(
                "bkms,bksd->bkmd", ds, kh[:, :, :hi], preferred_element_type=jnp.float32
            ).reshape(b, kv, hi - lo, g, d)
        )
    dq = dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=2)
    # Behind a barrier: with one block XLA folds the transposes back into the products, as
    # dots over their left operand's leading axis, which XLA:CPU's runtime cannot run in
    # bfloat16 ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    dk_t, dv_t = jax.lax.optimization_barrier((dk_t, dv_t))
    dk, dv = dk_t.transpose(0, 1, 3, 2), dv_t.transpose(0, 1, 3, 2)
    return dq.astype(dt), dk.astype(kh.dtype), dv.astype(vh.dtype), None


_blocked_causal_attention.defvjp(_blocked_causal_attention_fwd, _blocked_causal_attention_bwd)


def _cached_attention_fwd_parts(qm, keys, values, mask, g):
    """The forward of :func:`_cached_attention`: (out, row max, log row sum), the row
    statistics ``[B, KV, G * T, 1]``."""
    b, kv, gt, d = qm.shape
    t = gt // g
    scores = jnp.einsum("bkmd,bkds->bkms", qm, keys, preferred_element_type=jnp.float32).reshape(
        b, kv, g, t, -1
    )
    scores = jnp.where(mask[:, None, None], scores * (d**-0.5), _MASK_VALUE)
    # Softmax as the update's attention computes it: the unnormalised exp(s - max) times the
    # values, divided by its row sum afterwards ([.., D] divisions, not [.., S]).
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - m)
    total = jnp.sum(e, axis=-1, keepdims=True).reshape(b, kv, gt, 1)
    out = jnp.einsum(
        "bkms,bksd->bkmd",
        e.astype(qm.dtype).reshape(b, kv, gt, -1),
        values,
        preferred_element_type=jnp.float32,
    )
    return (out / total).astype(qm.dtype), m.reshape(b, kv, gt, 1), jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cached_attention(qm, keys, values, mask, g):
    """``softmax(q k^T / sqrt(D), masked) v`` of ``T`` new queries against ``S`` cache slots.

    qm [B, KV, G * T, D] (a KV group's G query heads, each over the T tokens), keys
    [B, KV, D, S] (the cache's slot-minor layout), values [B, KV, S, D], mask [B, T, S] bool
    -> [B, KV, G * T, D].

    The backward is FlashAttention's, as in :func:`_blocked_causal_attention`: the forward
    keeps its output and each query row's max and log-sum-exp, and the backward recomputes
    the probabilities from the scores (``ds = p * (dp - rowsum(dout * out))``). Autodiff of
    the forward stored the ``[.., T, S]`` exponentials and ran the max's own backward (a
    comparison and a select over the scores), which cancels in the softmax. The sampler's
    decode runs only the forward, unchanged.
    """
    return _cached_attention_fwd_parts(qm, keys, values, mask, g)[0]


def _cached_attention_fwd(qm, keys, values, mask, g):
    out, m, log_total = _cached_attention_fwd_parts(qm, keys, values, mask, g)
    return out, (qm, keys, values, mask, out, m, log_total)


def _cached_attention_bwd(g, residuals, d_out):
    qm, keys, values, mask, out, m, log_total = residuals
    b, kv, gt, d = qm.shape
    t = gt // g
    dt = qm.dtype
    d_out = d_out.astype(jnp.float32)
    row_dot = jnp.sum(d_out * out.astype(jnp.float32), axis=-1, keepdims=True)
    scores = jnp.einsum("bkmd,bkds->bkms", qm, keys, preferred_element_type=jnp.float32)
    block_mask = jnp.broadcast_to(mask[:, None, None], (b, kv, g, t, mask.shape[-1]))
    block_mask = block_mask.reshape(scores.shape)
    scores = jnp.where(block_mask, scores * (d**-0.5), _MASK_VALUE)
    p = jnp.exp((scores - m) - log_total)  # [B, KV, G * T, S] float32
    dp = jnp.einsum("bkmd,bksd->bkms", d_out.astype(dt), values, preferred_element_type=jnp.float32)
    ds = jnp.where(block_mask, p * (dp - row_dot), 0.0) * (d**-0.5)
    p, ds = p.astype(dt), ds.astype(dt)
    dv = jnp.einsum("bkms,bkmd->bksd", p, d_out.astype(dt), preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkmd,bkms->bkds", qm, ds, preferred_element_type=jnp.float32)
    dq = jnp.einsum("bkms,bkds->bkmd", ds, keys, preferred_element_type=jnp.float32)
    return dq.astype(dt), dk.astype(keys.dtype), dv.astype(values.dtype), None


_cached_attention.defvjp(_cached_attention_fwd, _cached_attention_bwd)


class SharedPrefix(NamedTuple):
    """Marks a grouped pass through the layers' caches (a static argument): every ``size``
    consecutive rows share one row of a prefix cache, their group's prompt, which they read
    and never write; each row's own tokens go to its own cache (:meth:`Transformer.
    shared_prefix_hidden`, :meth:`Transformer.decode_shared_prefix`)."""

    size: int


def _to_groups(x, r):
    """[B, KV, M, ...] (rows group-major, ``r`` per group) -> [B / r, KV, r * M, ...]."""
    b, kv = x.shape[:2]
    y = x.reshape(b // r, r, kv, *x.shape[2:]).swapaxes(1, 2)
    return y.reshape(b // r, kv, r * x.shape[2], *x.shape[3:])


def _to_rows(x, r):
    """The inverse of :func:`_to_groups`: [N, KV, r * M, ...] -> [N * r, KV, M, ...]."""
    n, kv, rm = x.shape[:3]
    y = x.reshape(n, kv, r, rm // r, *x.shape[3:]).swapaxes(1, 2)
    return y.reshape(n * r, kv, rm // r, *x.shape[3:])


def _shared_prefix_scores(qm, pk, wk, pmask, wmask, g, r):
    """The masked, scaled scores of :func:`_shared_prefix_attention`: against the prefix,
    ``[N, KV, R * G * T, P]`` (the group's rows as one axis), and against each row's own
    slots, ``[B, KV, G * T, S]``."""
    b, kv, gt, d = qm.shape
    t = gt // g
    s1 = jnp.einsum("nkmd,nkds->nkms", _to_groups(qm, r), pk, preferred_element_type=jnp.float32)
    s1 = jnp.where(pmask[:, None, None, :], s1 * (d**-0.5), _MASK_VALUE)
    s2 = jnp.einsum("bkmd,bkds->bkms", qm, wk, preferred_element_type=jnp.float32)
    s2 = jnp.where(wmask[:, None, None], s2.reshape(b, kv, g, t, -1) * (d**-0.5), _MASK_VALUE)
    return s1, s2.reshape(b, kv, gt, -1)


def _shared_prefix_fwd_parts(qm, pk, pv, wk, wv, pmask, wmask, g, r):
    """The forward of :func:`_shared_prefix_attention`: (out, row max, log row sum), the row
    statistics ``[B, KV, G * T, 1]``."""
    s1, s2 = _shared_prefix_scores(qm, pk, wk, pmask, wmask, g, r)
    m = jnp.maximum(
        _to_rows(jnp.max(s1, axis=-1, keepdims=True), r), jnp.max(s2, -1, keepdims=True)
    )
    e1 = jnp.exp(s1 - _to_groups(m, r))
    e2 = jnp.exp(s2 - m)
    total = _to_rows(jnp.sum(e1, axis=-1, keepdims=True), r) + jnp.sum(e2, -1, keepdims=True)
    dt = qm.dtype
    out = _to_rows(
        jnp.einsum("nkms,nksd->nkmd", e1.astype(dt), pv, preferred_element_type=jnp.float32), r
    ) + jnp.einsum("bkms,bksd->bkmd", e2.astype(dt), wv, preferred_element_type=jnp.float32)
    return (out / total).astype(dt), m, jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _shared_prefix_attention(qm, pk, pv, wk, wv, pmask, wmask, g, r):
    """Attention of rows that share a prefix in groups of ``r`` (a group's samples of one
    prompt): each query attends to its group's prefix slots and to its own row's slots.

    qm [B, KV, G * T, D] (rows group-major, ``B = N r``; a KV group's G query heads over the T
    new tokens, as :func:`_cached_attention` takes them), the prefix's keys pk [N, KV, D, P]
    and values pv [N, KV, P, D] (a cache's layouts, one row per group), each row's own keys wk
    [B, KV, D, S] and values wv [B, KV, S, D] (its cache, the new tokens written), pmask
    [N, P] bool (the prefix's valid slots), wmask [B, T, S] bool (causal & the row's key mask)
    -> [B, KV, G * T, D].

    The same softmax as one row's attention over its own copy of the prefix followed by its
    slots (:func:`_cached_attention`), up to float rounding: one max and one sum over both
    parts. The prefix is read once per group, with the group's every query in one product
    (``r`` times the rows of a per-row product), and no row holds a copy of it: the update's
    shared-prefix forward and the sampler's decode of a prompt's samples both use it. The
    backward is FlashAttention's (the probabilities recomputed from the scores and the kept
    row statistics); the prefix's key and value gradients sum over the group's rows inside
    their products. Key and value gradients are computed transposed (``dK = q^T ds``,
    ``dV^T = dout^T p``), so that every dot contracts its left operand's minor axis.
    """
    return _shared_prefix_fwd_parts(qm, pk, pv, wk, wv, pmask, wmask, g, r)[0]


def _shared_prefix_fwd(qm, pk, pv, wk, wv, pmask, wmask, g, r):
    out, m, log_total = _shared_prefix_fwd_parts(qm, pk, pv, wk, wv, pmask, wmask, g, r)
    return out, (qm, pk, pv, wk, wv, pmask, wmask, out, m, log_total)


def _shared_prefix_bwd(g, r, residuals, d_out):
    qm, pk, pv, wk, wv, pmask, wmask, out, m, log_total = residuals
    dt = qm.dtype
    b, kv, gt, d = qm.shape
    t = gt // g
    d_out = d_out.astype(jnp.float32)
    row_dot = jnp.sum(d_out * out.astype(jnp.float32), axis=-1, keepdims=True)
    s1, s2 = _shared_prefix_scores(qm, pk, wk, pmask, wmask, g, r)
    p1 = jnp.exp((s1 - _to_groups(m, r)) - _to_groups(log_total, r))
    p2 = jnp.exp((s2 - m) - log_total)
    do = d_out.astype(dt)
    do_g = _to_groups(do, r)
    dp1 = jnp.einsum("nkmd,nksd->nkms", do_g, pv, preferred_element_type=jnp.float32)
    dp2 = jnp.einsum("bkmd,bksd->bkms", do, wv, preferred_element_type=jnp.float32)
    # No score gradient reaches a masked slot (the forward's select), also in a fully masked
    # row, whose probabilities are uniform.
    ds1 = jnp.where(pmask[:, None, None, :], p1 * (dp1 - _to_groups(row_dot, r)), 0.0)
    ds2 = (p2 * (dp2 - row_dot)).reshape(b, kv, g, t, -1)
    ds2 = jnp.where(wmask[:, None, None], ds2, 0.0).reshape(p2.shape)
    ds1, ds2 = (ds1 * (d**-0.5)).astype(dt), (ds2 * (d**-0.5)).astype(dt)
    p1, p2 = p1.astype(dt), p2.astype(dt)
    dq = _to_rows(jnp.einsum("nkms,nkds->nkmd", ds1, pk, preferred_element_type=jnp.float32), r)
    dq = dq + jnp.einsum("bkms,bkds->bkmd", ds2, wk, preferred_element_type=jnp.float32)
    # q^T and dout^T laid out for the key and value gradients: [N, KV, D, R * G * T] for the
    # prefix's (the group's every query contracted at once), [B, KV, D, G * T] for the rows'
    # own. Behind a barrier, or XLA folds the transposes back into the products as strided
    # dots.
    q_g, do_g, q_b, do_b = jax.lax.optimization_barrier(
        (
            _to_groups(qm, r).swapaxes(-1, -2),
            do_g.swapaxes(-1, -2),
            qm.swapaxes(-1, -2),
            do.swapaxes(-1, -2),
        )
    )
    dpk = jnp.einsum("nkdm,nkms->nkds", q_g, ds1, preferred_element_type=jnp.float32)
    dpv = jnp.einsum("nkdm,nkms->nkds", do_g, p1, preferred_element_type=jnp.float32)
    dwk = jnp.einsum("bkdm,bkms->bkds", q_b, ds2, preferred_element_type=jnp.float32)
    dwv = jnp.einsum("bkdm,bkms->bkds", do_b, p2, preferred_element_type=jnp.float32)
    # The barrier keeps the transposes out of the products (as in the blocked attention's).
    dpv, dwv = jax.lax.optimization_barrier((dpv, dwv))
    return (
        dq.astype(dt),
        dpk.astype(pk.dtype),
        dpv.swapaxes(-1, -2).astype(pv.dtype),
        dwk.astype(wk.dtype),
        dwv.swapaxes(-1, -2).astype(wv.dtype),
        None,
        None,
    )


_shared_prefix_attention.defvjp(_shared_prefix_fwd, _shared_prefix_bwd)


def _linear_qkv(x, wq, wk, wv):
    """q, k, v = x @ wq, x @ wk, x @ wv as one dot: x [B, T, E], wq [E, N, D], wk / wv
    [E, KV, D] -> [B, T, N, D], [B, T, KV, D], [B, T, KV, D].

    The weights are stacked per KV group (``[E, KV, G + 2, D]``: a group's G query heads, then
    its key and its value head), so a mesh that splits the KV heads (and with them the query
    heads) over ``tensor`` stacks them without moving data between devices. One dot instead of
    three: the update's backward keeps one transposed ``x`` and runs one weight-gradient dot
    (~100M config, one interleaved run: 4.66 -> 4.03 s a step; the small one within noise).
    The sampler and the update share it, so both round the projections alike. In the decode
    loop the stacked weight is loop-invariant and XLA builds it once per call.
    """
    dt = x.dtype
    e, n, d = wq.shape
    kv = wk.shape[1]
    g = n // kv
    w = jnp.concatenate([wq.reshape(e, kv, g, d), wk[:, :, None], wv[:, :, None]], axis=2).astype(
        dt
    )
    qkv = _linear(x, w)  # [B, T, KV, G + 2, D]
    b, t = x.shape[:2]
    return qkv[..., :g, :].reshape(b, t, n, d), qkv[..., g, :], qkv[..., g + 1, :]


class Attention(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        c = config
        self.config = c
        h, n, kv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _param(rngs, (h, n, d), ("embed", "heads", "head_dim"), c, stack=stack)
        self.k_proj = _param(rngs, (h, kv, d), ("embed", "kv_heads", "head_dim"), c, stack=stack)
        self.v_proj = _param(rngs, (h, kv, d), ("embed", "kv_heads", "head_dim"), c, stack=stack)
        self.o_proj = _param(rngs, (n, d, h), ("heads", "head_dim", "embed"), c, stack=stack)
        if c.qkv_bias:
            self.q_bias = _param(rngs, (n, d), ("heads", "head_dim"), c, "zeros", stack)
            self.k_bias = _param(rngs, (kv, d), ("kv_heads", "head_dim"), c, "zeros", stack)
            self.v_bias = _param(rngs, (kv, d), ("kv_heads", "head_dim"), c, "zeros", stack)
        if c.qk_norm:
            self.q_norm = RMSNorm(c, rngs=rngs, size=d, axis="head_dim", stack=stack)
            self.k_norm = RMSNorm(c, rngs=rngs, size=d, axis="head_dim", stack=stack)
        shapes = dict(
            q_proj=(h, n * d, "embed", "heads"),
            k_proj=(h, kv * d, "embed", "kv_heads"),
            v_proj=(h, kv * d, "embed", "kv_heads"),
            o_proj=(n * d, h, "heads", "embed"),
        )
        for t in _lora.targets(c, _lora.ATTN_TARGETS):
            adapter = _lora.make_adapter(rngs, *shapes[t], c.lora_rank, stack)
            setattr(self, t + _lora.SUFFIX, adapter)

    def _lora(self, name, x, in_dims, out_shape):
        """The adapter's ``s * (x @ A) @ B`` for projection ``name``, or None without one."""
        adapter = getattr(self, name + _lora.SUFFIX, None)
        if adapter is None:
            return None
        return _lora.delta(adapter, x, in_dims, out_shape, _lora.scale(self.config))

    def _attend_causal(self, q, k, v, mask):
        """Attention of a whole causal sequence (no cache), in query blocks.

        q [B, T, KV, G, D], k/v [B, T, KV, D], mask [B, T, T] (causal & key mask) ->
        [B, T, KV, G, D]. Heads are moved in front once (``[B, KV, T, G, D]``), so every
        block's dots take contiguous slices; see :func:`_blocked_causal_attention`.
        """
        blocks = tuple(_causal_blocks(q.shape[1], self.config.causal_block_size))
        qh = q.transpose(0, 2, 1, 3, 4)  # [B, KV, T, G, D]
        kh = k.transpose(0, 2, 1, 3)  # [B, KV, T, D]
        vh = v.transpose(0, 2, 1, 3)
        return _blocked_causal_attention(qh, kh, vh, mask, blocks).transpose(0, 2, 1, 3, 4)

    def __call__(self, x, rope_cos_sin, mask, cache=None):
        """x: [B, T, E]; rope_cos_sin: :func:`rope_tables` of the tokens' positions; mask:
        [B, T, S] bool (causal & key mask).

        ``cache``: None (keys are this call's tokens, S == T) or ``(k_buf, v_buf, layer, index,
        fresh)``: this layer's buffers ``[B, KV, D, S]`` / ``[B, KV, S, D]`` (``layer`` None), or
        the stacked ``[L, ...]`` ones and this layer's index; the new keys and values are written
        in place at slot ``index``. ``fresh`` (static): the cache holds nothing before these
        tokens (``index`` 0), so they attend to each other only, causally, in the full
        forward's query blocks. Returns ``([B, T, E], (k_buf, v_buf) or None)``.
        """
        c = self.config
        dt = x.dtype
        q, k, v = _linear_qkv(x, self.q_proj[...], self.k_proj[...], self.v_proj[...])
        if c.lora_rank:
            n, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
            dq = self._lora("q_proj", x, 1, (n, d))
            dk = self._lora("k_proj", x, 1, (kv, d))
            dv = self._lora("v_proj", x, 1, (kv, d))
            q = q if dq is None else q + dq
            k = k if dk is None else k + dk
            v = v if dv is None else v + dv
        if c.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if c.qk_norm:
            q = self.q_norm(q).astype(dt)
            k = self.k_norm(k).astype(dt)
        q = apply_rope(q, rope_cos_sin)
        k = apply_rope(k, rope_cos_sin)
        b, t = x.shape[:2]
        g = c.num_heads // c.num_kv_heads
        q = q.reshape(b, t, c.num_kv_heads, g, c.head_dim)
        if cache is None:
            new_cache = None
            out = self._attend_causal(q, k, v, mask)
        else:
            out, new_cache = self._attend_cached(q, k, v, mask, cache)
        out = out.reshape(b, t, c.num_heads, c.head_dim)
        y = _linear(out, self.o_proj[...].astype(dt), 2)
        if c.lora_rank:
            dy = self._lora("o_proj", out, 2, (c.hidden_size,))
            y = y if dy is None else y + dy
        return y, new_cache

    def _attend_cached(self, q, k, v, mask, cache):
        """Writes k/v [B, T, KV, D] into the cache at slot ``index`` and attends to all its
        slots: q [B, T, KV, G, D], mask [B, T, S] -> ([B, T, KV, G, D], (k_buf, v_buf)).

        A fresh cache's prefill attends to its own ``T`` tokens only, as the full forward does
        (:meth:`_attend_causal`: query blocks scored against the keys up to their end, and
        FlashAttention's backward). One ``[T, S]`` product would score every masked slot too:
        twice the FLOPs of the causal half, and all of the scores in memory at once (at 8,192
        prompt tokens, 2 GiB per row and layer in float32)."""
        dt = q.dtype
        b, t, kv, g, d = q.shape
        k_buf, v_buf, layer, index, fresh = cache
        shared = isinstance(fresh, SharedPrefix)
        if shared:  # (prefix, own) buffer pairs: the tokens go to their rows' own buffers
            (pk_buf, k_buf), (pv_buf, v_buf) = k_buf, v_buf
        k_buf, v_buf, keys, values = _write_slots(k_buf, v_buf, k, v, layer, index)
        # Batch dims leading on both operands ([B, KV, G*T, D] x [B, KV, D, S]): the layout the
        # CPU dot fusions take without re-laying-out the cache.
        qm = q.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)
        if shared:
            prefix_k, prefix_v = (
                x if layer is None else _layer_of(x, layer) for x in (pk_buf, pv_buf)
            )
            prefix_mask, mask = mask
            out = _shared_prefix_attention(
                qm,
                read_kv(prefix_k, dt),
                read_kv(prefix_v, dt),
                read_kv(keys, dt),
                read_kv(values, dt),
                prefix_mask,
                mask,
                g,
                fresh.size,
            )
            new = ((pk_buf, k_buf), (pv_buf, v_buf))
        elif fresh:  # slots 0..T-1 are these tokens: causal attention among them
            return self._attend_causal(q, k, v, mask[:, :, :t]), (k_buf, v_buf)
        else:
            out = _cached_attention(qm, read_kv(keys, dt), read_kv(values, dt), mask, g)
            new = (k_buf, v_buf)
        return out.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4), new


def _layer_of(buf, layer):
    """Layer ``layer`` (traced) of a stacked ``[L, ...]`` cache buffer (a quantised one too)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False), buf)


def _write_slots(k_buf, v_buf, k, v, layer, index):
    """k / v [B, T, KV, D] written into a layer's cache buffers at slot ``index`` (``layer``
    None: the layer's own ``[B, KV, D, S]`` / ``[B, KV, S, D]``; else its index in the stacked
    ``[L, ...]`` ones): (k_buf, v_buf, this layer's keys, its values). A quantised buffer
    (:class:`gagar_jax.models.kv_quant.QuantizedKV`) takes each new token's int8 values and
    scale; its keys and values come back quantised (read with ``kv_quant.read_kv``)."""
    index = jnp.asarray(index, jnp.int32)
    k_new = k.transpose(0, 2, 3, 1)  # [B, KV, D, T]
    v_new = v.transpose(0, 2, 1, 3)  # [B, KV, T, D]
    if isinstance(k_buf, QuantizedKV):
        k_new, v_new = quantize_kv(k_new, k_buf.axis), quantize_kv(v_new, v_buf.axis)
    else:
        k_new, v_new = k_new.astype(k_buf.dtype), v_new.astype(v_buf.dtype)
    zero = jnp.zeros((), jnp.int32)

    def put(buf, new, start):
        return jax.tree.map(lambda b, n: jax.lax.dynamic_update_slice(b, n, start), buf, new)

    if layer is None:
        k_buf = put(k_buf, k_new, (zero, zero, zero, index))
        v_buf = put(v_buf, v_new, (zero, zero, index, zero))
        return k_buf, v_buf, k_buf, v_buf
    layer = jnp.asarray(layer, jnp.int32)
    add = lambda x: jax.tree.map(lambda y: y[None], x)  # noqa: E731
    k_buf = put(k_buf, add(k_new), (layer, zero, zero, zero, index))
    v_buf = put(v_buf, add(v_new), (layer, zero, zero, index, zero))
    return k_buf, v_buf, _layer_of(k_buf, layer), _layer_of(v_buf, layer)


@jax.custom_vjp
def _swiglu(gate, up):
    """``silu(gate) * up`` (SwiGLU's gating; any shape, both alike).

    The backward is written out as one elementwise expression per input: with
    ``s = sigmoid(gate)``, ``d_up = g * gate * s`` and ``d_gate = g * up * s * (1 + gate *
    (1 - s))``. Autodiff of ``jax.nn.silu(gate) * up`` left XLA:CPU five to six passes over
    the ``[tokens, F]`` arrays per layer (a stored sigmoid, separate products). The forward
    is the expression autodiff saw, so sampled and scored values are unchanged.
    """
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(residuals, g):
    gate, up = residuals
    s = jax.nn.sigmoid(gate)
    return g * up * s * (1 + gate * (1 - s)), g * gate * s


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, (h, f), ("embed", "mlp"), config, stack=stack)
        self.up_proj = _param(rngs, (h, f), ("embed", "mlp"), config, stack=stack)
        self.down_proj = _param(rngs, (f, h), ("mlp", "embed"), config, stack=stack)
        self.config = config
        shapes = dict(
            gate_proj=(h, f, "embed", "mlp"),
            up_proj=(h, f, "embed", "mlp"),
            down_proj=(f, h, "mlp", "embed"),
        )
        for t in _lora.targets(config, _lora.MLP_TARGETS):
            adapter = _lora.make_adapter(rngs, *shapes[t], config.lora_rank, stack)
            setattr(self, t + _lora.SUFFIX, adapter)

    def _proj(self, name, x):
        """``x @ W`` of projection ``name``, plus its adapter's term when it has one."""
        y = _linear(x, getattr(self, name)[...].astype(x.dtype))
        adapter = getattr(self, name + _lora.SUFFIX, None)
        if adapter is None:
            return y
        return y + _lora.delta(adapter, x, 1, y.shape[-1:], _lora.scale(self.config))

    def __call__(self, x, token_mask=None, routes=None):
        """x [B, T, E] -> (``down(silu(x @ gate) * (x @ up))`` [B, T, E], None); ``routes``
        is ignored (a dense MLP has no router)."""
        gate = self._proj("gate_proj", x)
        up = self._proj("up_proj", x)
        return self._proj("down_proj", _swiglu(gate, up)), None


class MoE(nnx.Module):
    """Qwen3-MoE sparse block: softmax router, top-k experts, weighted sum of SwiGLU experts."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        c = config
        self.config = c
        h, f, x = c.hidden_size, c.moe_intermediate_size, c.num_experts
        self.router = _param(rngs, (h, x), ("embed", "expert"), c, stack=stack)
        self.gate_proj = _param(rngs, (x, h, f), ("expert", "embed", "mlp"), c, stack=stack)
        self.up_proj = _param(rngs, (x, h, f), ("expert", "embed", "mlp"), c, stack=stack)
        self.down_proj = _param(rngs, (x, f, h), ("expert", "mlp", "embed"), c, stack=stack)

    def __call__(self, x, token_mask=None, routes=None):
        """x [B, T, E] -> (y [B, T, E], router statistics of this layer, its chosen experts
        ``[B, T, K]`` int32 under ``"routes"``).

        ``routes`` (routing replay): ``[B, T, K]`` expert ids each token goes to instead of
        its own top-k; the gate weights are the current router's probabilities of those
        experts (renormalised over them with ``norm_topk_prob``), so the router's gradient
        flows as it does through its own choice. A token with a negative id (its routes were
        not recorded) takes its own top-k.
        """
        c = self.config
        dt = x.dtype
        logits = jnp.einsum(
            "bte,ex->btx", x, self.router[...].astype(dt), preferred_element_type=jnp.float32
        )
        probs = jax.nn.softmax(logits, axis=-1)  # [B, T, X] float32
        top_p, top_i = jax.lax.top_k(probs, c.num_experts_per_tok)  # [B, T, K]
        if routes is not None:  # a token whose recorded experts are unknown (-1) routes freely
            routes = routes.astype(jnp.int32)
            known = jnp.all(routes >= 0, axis=-1, keepdims=True)
            top_i = jnp.where(known, routes, top_i)
            top_p = jnp.take_along_axis(probs, top_i, axis=-1)
        if c.norm_topk_prob:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        chosen = jax.nn.one_hot(top_i, c.num_experts, dtype=jnp.float32)  # [B, T, K, X]
        combine = jnp.einsum("btk,btkx->btx", top_p, chosen).astype(dt)
        gate = jnp.einsum("bte,xef->btxf", x, self.gate_proj[...].astype(dt))
        up = jnp.einsum("bte,xef->btxf", x, self.up_proj[...].astype(dt))
        hidden = jax.nn.silu(gate) * up * combine[..., None]
        y = jnp.einsum("btxf,xfe->bte", hidden, self.down_proj[...].astype(dt))
        w = (
            jnp.ones(x.shape[:2], jnp.float32)
            if token_mask is None
            else token_mask.astype(jnp.float32)
        )
        counts = jnp.einsum("bt,btx->x", w, jnp.sum(chosen, axis=2))  # assignments per expert
        prob_sum = jnp.einsum("bt,btx->x", w, probs)
        ent = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1)
        stats = dict(
            counts=counts,
            prob_sum=prob_sum,
            tokens=jnp.sum(w),
            entropy_sum=jnp.sum(w * ent),
            routes=top_i.astype(jnp.int32),
        )
        return y, stats


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        self.input_layernorm = RMSNorm(config, rngs=rngs, stack=stack)
        self.self_attn = Attention(config, rngs=rngs, stack=stack)
        self.post_attention_layernorm = RMSNorm(config, rngs=rngs, stack=stack)
        mlp = MoE if config.num_experts else MLP
        self.mlp = mlp(config, rngs=rngs, stack=stack)

    def __call__(self, x, rope_cos_sin, mask, token_mask, cache=None, routes=None):
        dt = x.dtype
        y, kv = self.self_attn(self.input_layernorm(x).astype(dt), rope_cos_sin, mask, cache)
        x = x + y
        y, stats = self.mlp(self.post_attention_layernorm(x).astype(dt), token_mask, routes)
        return x + y, kv, stats


def _remat_policy(name: str):
    return {
        "full": None,
        "dots": jax.checkpoint_policies.dots_saveable,
        "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    }[name]


def router_metrics(stats: dict | None, num_experts: int, top_k: int) -> dict:
    """Router statistics ``[L, X]``-summed over layers -> scalar metrics and the aux loss.

    ``router_aux_loss`` is the Switch-Transformer load-balancing loss exactly as Hugging Face's
    ``load_balancing_loss_func`` computes it (pooled over layers, padding excluded):
    ``X * sum_x f_x P_x`` with ``f_x`` the top-k assignments to expert ``x`` per token and
    ``P_x`` its mean router probability; 1 * top_k at perfect balance. ``router_load_max`` /
    ``router_load_min`` are the busiest / idlest expert's share of assignments times ``X``
    (1 = balanced), ``router_entropy`` the mean entropy of the router distribution.
    """
    if stats is None:
        return {}
    tokens = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)  # summed over layers
    counts = jnp.sum(stats["counts"], axis=0)  # [X]
    prob = jnp.sum(stats["prob_sum"], axis=0)
    f, p = counts / tokens, prob / tokens
    share = counts / jnp.maximum(jnp.sum(counts), 1.0) * num_experts
    per_layer = (
        stats["counts"]
        / jnp.maximum(jnp.sum(stats["counts"], axis=-1, keepdims=True), 1.0)
        * num_experts
    )  # [L, X]
    return dict(
        router_aux_loss=num_experts * jnp.sum(f * p),
        router_load_max=jnp.max(per_layer),
        router_load_min=jnp.min(per_layer),
        router_load_max_pooled=jnp.max(share),
        router_entropy=jnp.sum(stats["entropy_sum"]) / tokens,
    )


class Transformer(nnx.Module):
    """Qwen2/Qwen3/Qwen3-MoE/Llama-compatible decoder. See the module docstring."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = _param(
            rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), config
        )
        if config.scan_layers:
            self.layers = Block(config, rngs=rngs, stack=config.num_layers)
        else:
            self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config, rngs=rngs)
        if not config.tie_embeddings:
            # [V, E] like the embedding and HF's lm_head.weight (see head_weight).
            self.lm_head = _param(
                rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"), config
            )

    def _check(self, tokens, positions, attention_mask):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int, got shape {tokens.shape}")
        if positions.shape != tokens.shape:
            raise ValueError(f"positions must match tokens {tokens.shape}, got {positions.shape}")
        if attention_mask is not None and attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask must match tokens {tokens.shape}, got {attention_mask.shape}"
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integer, got {tokens.dtype}")

    def _layers(self, x, rope_cos_sin, mask, token_mask, cache_kv, index, fresh=False, routes=None):
        """Runs every block; returns (x, (k_all, v_all) or None, stacked router stats or None).
        ``routes``: None, or ``[L, B, T, K]`` experts of each layer (routing replay)."""
        c = self.config

        def apply(block, x, cache_kv, layer, r=None):
            cache = None if cache_kv is None else (*cache_kv, layer, index, fresh)
            return block(x, rope_cos_sin, mask, token_mask, cache, r)

        def apply_own(block, x, cache_kv, layer, r=None):  # per-layer buffers: a tuple of L each
            if cache_kv is None:
                return apply(block, x, None, layer, r)
            ks, vs = cache_kv
            y, (k, v), stats = apply(block, x, (ks[layer], vs[layer]), None, r)
            ks = ks[:layer] + (k,) + ks[layer + 1 :]
            vs = vs[:layer] + (v,) + vs[layer + 1 :]
            return y, (ks, vs), stats

        if c.scan_layers:
            graphdef, stacked = nnx.split(self.layers)

            def body(carry, xs):
                x, kv = carry
                layer, layer_state, r = xs
                x, kv, stats = apply(nnx.merge(graphdef, layer_state), x, kv, layer, r)
                return (x, kv), stats

            if c.remat:
                body = jax.checkpoint(body, policy=_remat_policy(c.remat_policy))
            (x, cache_kv), stats = jax.lax.scan(
                body,
                (x, cache_kv),
                (jnp.arange(c.num_layers, dtype=jnp.int32), stacked, routes),
            )
            return x, cache_kv, stats
        fn = apply_own
        # Not with a KV cache (sampling): nothing is differentiated there, and nnx.remat inside
        # the sampler's decode loop would update the layer's Params from the loop body's trace
        # (flax TraceContextError), so `remat=True` models could not sample.
        if c.remat and cache_kv is None:
            fn = nnx.remat(apply, policy=_remat_policy(c.remat_policy))
        all_stats = []
        for i, block in enumerate(self.layers):
            x, cache_kv, stats = fn(block, x, cache_kv, i, None if routes is None else routes[i])
            all_stats.append(stats)
        if all_stats[0] is None:
            return x, cache_kv, None
        return x, cache_kv, jax.tree.map(lambda *s: jnp.stack(s), *all_stats)

    def rope_tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """:func:`rope_tables` of ``positions`` [B, T] with this model's frequencies."""
        c = self.config
        inv_freq = jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_llama3_scaling))
        return rope_tables(positions, inv_freq)

    def _hidden(
        self,
        tokens,
        positions,
        key_mask,
        token_mask,
        cache=None,
        rope_cos_sin=None,
        fresh=False,
        prefix=None,
        routes=None,
    ):
        """``prefix`` (with ``fresh`` a :class:`SharedPrefix`): the groups' read-only prefix
        cache, attended beside ``cache``, the rows' own one; the returned buffers are the own
        ones. ``routes``: None, or ``[B, T, L, K]`` experts to replay (MoE)."""
        c = self.config
        dt = _dtype(c.dtype)
        x = self.embed_tokens[...].astype(dt)[tokens]
        t, s = tokens.shape[1], key_mask.shape[1]
        offset = 0 if cache is None else cache.index
        causal = jnp.arange(s)[None, :] <= (offset + jnp.arange(t))[:, None]  # [T, S]
        mask = causal[None] & key_mask[:, None, :]  # [B, T, S]
        cache_kv = None if cache is None else (cache.k, cache.v)
        index = None if cache is None else cache.index
        if prefix is not None:  # (prefix, own) pairs: of [L, ...] stacks, or one per layer
            mask = (prefix.mask.astype(bool), mask)
            if c.scan_layers:
                cache_kv = ((prefix.k, cache.k), (prefix.v, cache.v))
            else:
                cache_kv = (tuple(zip(prefix.k, cache.k)), tuple(zip(prefix.v, cache.v)))
        if rope_cos_sin is None:
            rope_cos_sin = self.rope_tables(positions)  # once for all layers
        if routes is not None:
            routes = jnp.moveaxis(jnp.asarray(routes, jnp.int32), 2, 0)  # [L, B, T, K]
        x, cache_kv, stats = self._layers(
            x, rope_cos_sin, mask, token_mask, cache_kv, index, fresh, routes
        )
        if prefix is not None:
            ks, vs = cache_kv
            own = (lambda pair: pair[1]) if c.scan_layers else (lambda ps: tuple(p[1] for p in ps))
            cache_kv = (own(ks), own(vs))
        return self.norm(x).astype(dt), cache_kv, stats

    def head_weight(self) -> jax.Array:
        """The LM head ``[V, E]``: the tied embedding, or the untied ``lm_head`` (stored so).

        Both are contracted in this orientation. With an ``[E, V]`` head XLA:CPU computed the
        training step's hidden-state gradient ``dlogits [T, V] @ W^T`` as a dot contracting both
        operands' minor dimension (the slowest dot of the small config's step in one profile:
        16-21 GFLOP/s against 40-180 for the other dots of that size), and transposing it per
        step cost two ``V x E`` copies (4.6% of the ~100M config's step).
        """
        return self.embed_tokens[...] if self.config.tie_embeddings else self.lm_head[...]

    def logits_from_hidden(self, h: jax.Array) -> jax.Array:
        """Final-norm hidden states [..., E] -> float32 logits [..., V]."""
        dt = _dtype(self.config.dtype)
        return jnp.einsum(
            "...e,ve->...v",
            h.astype(dt),
            self.head_weight().astype(dt),
            preferred_element_type=jnp.float32,
        )

    def hidden_states(
        self,
        tokens,
        positions,
        *,
        attention_mask=None,
        return_aux=False,
        routes=None,
        return_routes=False,
    ):
        """Final-norm hidden states ``[B, T, E]`` (compute dtype), the input of the LM head.

        With ``return_aux`` also the router metrics (:func:`router_metrics`; empty for dense
        models). :meth:`logits_from_hidden` gives the logits, in chunks if the caller wants.
        Mixture-of-experts models: ``routes`` ``[B, T, L, K]`` int (routing replay: each
        token goes to these experts of each layer, with gate weights from the current
        router, see :class:`MoE`), and ``return_routes`` appends the experts each token went
        to, ``[B, T, L, K]`` int32 (None for a dense model), to what is returned.
        """
        self._check(tokens, positions, attention_mask)
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        attention_mask = attention_mask.astype(bool)
        h, _, stats = self._hidden(tokens, positions, attention_mask, attention_mask, routes=routes)
        out = (h,)
        if return_aux:
            c = self.config
            out += (router_metrics(stats, c.num_experts, c.num_experts_per_tok),)
        if return_routes:
            out += (_routes_of(stats),)
        return out[0] if len(out) == 1 else out

    def __call__(self, tokens, positions, *, attention_mask=None, return_aux=False):
        """Full forward.

        Args:
          tokens: [B, T] int32 token ids.
          positions: [B, T] int32 RoPE positions.
          attention_mask: [B, T] bool, False on padding keys (None: all valid).
          return_aux: also return the router metrics dict (MoE; ``{}`` for dense models).
        Returns:
          logits [B, T, V] float32 (and the metrics dict when ``return_aux``).
        """
        out = self.hidden_states(
            tokens, positions, attention_mask=attention_mask, return_aux=return_aux
        )
        if return_aux:
            return self.logits_from_hidden(out[0]), out[1]
        return self.logits_from_hidden(out)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        """An empty cache for ``batch`` sequences of at most ``max_len`` slots, its keys and
        values in ``dtype`` (None: the compute dtype; another float dtype is rounded to on
        writing and widened from on reading; ``"int8"``: :class:`gagar_jax.models.kv_quant.
        QuantizedKV` buffers, each token's head vectors quantised on writing with a scale of
        their own and dequantised to the compute dtype on reading)."""
        c = self.config
        k_shape = (batch, c.num_kv_heads, c.head_dim, max_len)
        v_shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        if dtype is not None and jnp.dtype(dtype) == jnp.int8:

            def zeros(shape, which):
                return empty_kv(shape, -2 if which == "k" else -1)
        else:
            dt = _dtype(c.dtype if dtype is None else dtype)

            def zeros(shape, which):
                return jnp.zeros(shape, dt)

        if c.scan_layers:
            k = zeros((c.num_layers, *k_shape), "k")
            v = zeros((c.num_layers, *v_shape), "v")
        else:
            k = tuple(zeros(k_shape, "k") for _ in range(c.num_layers))
            v = tuple(zeros(v_shape, "v") for _ in range(c.num_layers))
        return Cache(
            k=k, v=v, mask=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32)
        )

    def decode(
        self,
        tokens,
        positions,
        cache: Cache,
        *,
        attention_mask=None,
        last_only=False,
        rope_cos_sin=None,
        fresh=False,
        return_routes=False,
    ):
        """Runs ``T`` new tokens against the cache (prefill when T > 1, one step when T == 1).

        Args:
          tokens: [B, T] int32, written at slots ``cache.index .. cache.index + T - 1``.
          positions: [B, T] int32 RoPE positions.
          cache: from :meth:`init_cache` or a previous ``decode``.
          attention_mask: [B, T] bool, False for padding tokens (None: all valid).
          last_only: the logits of the last position only (``[B, 1, V]``): what a prefill
            needs to start sampling; the LM head over all ``T`` prompt positions would cost
            ``T`` decode steps' worth of head FLOPs for nothing.
          fresh: start new sequences in this cache: the tokens go to slots ``0 .. T - 1``
            whatever ``cache.index`` and its mask held, and attend to each other only,
            causally, in the full forward's query blocks (about half the FLOPs and the score
            memory of one ``T x S`` product). A prefill of an empty cache gives the same
            values either way, up to float rounding.
          return_routes: also return the experts each token went to, ``[B, T, L, K]`` int32
            (None for a dense model): what the sampler records for routing replay.
        Returns:
          (logits [B, T, V] float32, updated Cache[, routes]). Writing past ``max_len`` is
          clamped by ``dynamic_update_slice``: callers must keep ``index + T <= max_len``.
        """
        out = self.decode_hidden(
            tokens,
            positions,
            cache,
            attention_mask=attention_mask,
            rope_cos_sin=rope_cos_sin,
            fresh=fresh,
            return_routes=return_routes,
        )
        h = out[0][:, -1:] if last_only else out[0]
        return (self.logits_from_hidden(h), *out[1:])

    def decode_hidden(
        self,
        tokens,
        positions,
        cache: Cache,
        *,
        attention_mask=None,
        rope_cos_sin=None,
        fresh=False,
        return_routes=False,
    ):
        """:meth:`decode` without the LM head: ``(final-norm hidden states [B, T, E], updated
        Cache[, routes])``. Differentiable (the update's shared-prefix forward runs a group's prompt
        once this way, ``fresh``, and its samples' responses against the prompt's cache)."""
        self._check(tokens, positions, attention_mask)
        if cache.mask.shape[0] != tokens.shape[0]:
            raise ValueError(f"cache batch {cache.mask.shape[0]} != tokens batch {tokens.shape[0]}")
        if fresh:  # new sequences from slot 0: nothing the cache held stays valid
            if tokens.shape[1] > cache.mask.shape[1]:
                raise ValueError(
                    f"a fresh prefill of {tokens.shape[1]} tokens needs a cache of at least that "
                    f"many slots, got {cache.mask.shape[1]}"
                )
            cache = cache._replace(mask=jnp.zeros_like(cache.mask), index=jnp.zeros((), jnp.int32))
        return self._write_and_attend(
            tokens,
            positions,
            cache,
            attention_mask,
            rope_cos_sin,
            fresh,
            return_routes=return_routes,
        )

    def shared_prefix_hidden(
        self, tokens, positions, prefix: Cache, size: int, *, attention_mask=None
    ):
        """Final-norm hidden states ``[B, T, E]`` of rows that continue a shared prefix: every
        ``size`` consecutive rows (a group) continue the same row of ``prefix``.

        Args:
          tokens: [B, T] int32, ``B = N * size``: row ``i`` continues prefix row ``i // size``.
          positions: [B, T] int32 RoPE positions.
          prefix: a :class:`Cache` of N rows (from :meth:`decode_hidden`), read and not
            written: each token attends to its group's valid prefix slots (``prefix.mask``) and,
            causally, to its own row's tokens.
          size: the rows per group.
          attention_mask: [B, T] bool, False for padding tokens (None: all valid).

        The same values as :meth:`decode_hidden` of each row against its own copy of its
        group's prefix cache (``prefix.take_rows(arange(B) // size)``), up to float rounding,
        and differentiable: the prefix's keys and values are read once per group, with a
        group's queries in one product, and no row holds a copy (the update's shared-prefix
        forward runs its samples' windows this way).
        """
        own = self.init_cache(tokens.shape[0], tokens.shape[1])
        h, _ = self.decode_shared_prefix_hidden(
            tokens, positions, prefix, own, size, attention_mask=attention_mask
        )
        return h

    def decode_shared_prefix(
        self, tokens, positions, prefix: Cache, cache: Cache, size: int, **kwargs
    ):
        """:meth:`decode` of rows that share a prefix in groups of ``size``: ``(logits
        [B, T, V] float32, updated cache)``. ``prefix`` (N rows, read only) holds each group's
        prompt, ``cache`` (``B = N * size`` rows) each row's own tokens after it, where the new
        tokens are written; see :meth:`decode_shared_prefix_hidden`. The sampler's decode of a
        prompt's samples runs this way: every step reads the prompt's keys and values once for
        all its samples, and no sample holds a copy of them."""
        out = self.decode_shared_prefix_hidden(tokens, positions, prefix, cache, size, **kwargs)
        return (self.logits_from_hidden(out[0]), *out[1:])

    def decode_shared_prefix_hidden(
        self,
        tokens,
        positions,
        prefix: Cache,
        cache: Cache,
        size: int,
        *,
        attention_mask=None,
        rope_cos_sin=None,
        return_routes=False,
    ):
        """:meth:`decode_shared_prefix` without the LM head: ``(final-norm hidden states
        [B, T, E], updated cache[, routes])`` (``return_routes`` as in :meth:`decode`).

        Args:
          tokens: [B, T] int32, ``B = N * size``: row ``i`` continues prefix row ``i // size``;
            written at slots ``cache.index .. cache.index + T - 1`` of ``cache``.
          positions: [B, T] int32 RoPE positions.
          prefix: :class:`Cache` of N rows; its valid slots (``prefix.mask``) are the group's
            prompt, attended by every row of the group. Not written.
          cache: :class:`Cache` of B rows: each row's own slots, attended causally with its
            mask.
          size: rows per group.
          attention_mask: [B, T] bool, False for padding tokens (None: all valid).
          rope_cos_sin: precomputed :func:`rope_tables` of ``positions`` (None: computed).

        Each token attends to its group's prefix and its row's own slots up to itself, with
        one softmax over both (:func:`_shared_prefix_attention`): the values of
        :meth:`decode_hidden` against the row's prefix copy followed by its own slots, up to
        float rounding. Differentiable.
        """
        self._check(tokens, positions, attention_mask)
        b, t = tokens.shape
        n = prefix.mask.shape[0]
        if size < 1 or b != n * size:
            raise ValueError(
                f"shared prefix: tokens have {b} rows, expected prefix rows ({n}) x size ({size})"
            )
        if cache.mask.shape[0] != b:
            raise ValueError(f"cache batch {cache.mask.shape[0]} != tokens batch {b}")
        return self._write_and_attend(
            tokens,
            positions,
            cache,
            attention_mask,
            rope_cos_sin,
            SharedPrefix(size),
            prefix,
            return_routes=return_routes,
        )

    def _write_and_attend(
        self,
        tokens,
        positions,
        cache,
        attention_mask,
        rope_cos_sin,
        fresh,
        prefix=None,
        return_routes=False,
    ):
        """The tokens' keys and values written into ``cache`` at ``cache.index`` and their
        hidden states through every layer: ``(hidden [B, T, E], updated Cache[, routes
        [B, T, L, K]])``. ``fresh`` and ``prefix`` as in :meth:`_hidden`;
        ``attention_mask`` None means all valid."""
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        attention_mask = attention_mask.astype(bool)
        key_mask = jax.lax.dynamic_update_slice(cache.mask, attention_mask, (0, cache.index))
        h, (k, v), stats = self._hidden(
            tokens,
            positions,
            key_mask,
            attention_mask,
            cache,
            rope_cos_sin=rope_cos_sin,
            fresh=fresh,
            prefix=prefix,
        )
        new = Cache(k=k, v=v, mask=key_mask, index=cache.index + tokens.shape[1])
        if return_routes:
            return h, new, _routes_of(stats)
        return h, new


def _routes_of(stats) -> jax.Array | None:
    """The experts each token went to, ``[B, T, L, K]`` int32, from the stacked per-layer
    router statistics (None for a dense model)."""
    if stats is None or "routes" not in stats:
        return None
    return jnp.moveaxis(stats["routes"], 0, 2)


def _is_stacked_layers(layers) -> bool:
    return not (isinstance(layers, dict) and all(isinstance(k, int) for k in layers))


def stack_layer_params(params: dict) -> dict:
    """Pure-dict params with ``layers.{i}.*`` -> ``layers.*`` stacked ``[L, ...]`` (scan layout)."""
    layers = params["layers"]
    if _is_stacked_layers(layers):
        return params
    blocks = [layers[i] for i in sorted(layers)]
    return {
        **params,
        "layers": jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *blocks),
    }


def unstack_layer_params(params: dict) -> dict:
    """Pure-dict params with stacked ``layers.*`` -> ``layers.{i}.*`` (per-layer layout)."""
    layers = params["layers"]
    if not _is_stacked_layers(layers):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return {**params, "layers": {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)}}


def create_model(config: TransformerConfig, seed: int = 0) -> Transformer:
    """Builds a :class:`Transformer` with its initialisation compiled as one XLA program.

    Eager NNX construction runs (and compiles) every initialiser op separately, which costs
    tens of seconds on CPU; this is the fast path for tests, benchmarks and samplers. Sharded
    creation for training lives in ``gagar_jax.update.state``.
    """
    return _compiled_init(config)(jax.random.key(seed))


@functools.lru_cache(maxsize=16)
def _compiled_init(config: TransformerConfig):
    """The jitted initialiser of one config, kept: a fresh function per call would be traced and
    compiled again (seconds on CPU) for every model built with the same config."""
    return nnx.jit(lambda key: Transformer(config, rngs=nnx.Rngs(params=key)))
