"""Decoder-only transformer policy in Flax NNX, compatible with the Qwen2 / Llama family.

Architecture (pre-norm, as in Hugging Face ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``)::

    h = embed(tokens)
    for each layer:
        h = h + o_proj(attention(rope(q_proj(rms(h))), rope(k_proj(rms(h))), v_proj(rms(h))))
        h = h + down_proj(silu(gate_proj(rms(h))) * up_proj(rms(h)))
    logits = lm_head(rms(h))            # or embed^T when embeddings are tied

- RMSNorm and the attention softmax are computed in float32 whatever the compute dtype; logits
  are float32 (matmul with ``preferred_element_type=float32``).
- Rotary embeddings use the "rotate half" convention of Hugging Face, driven by explicit
  ``positions`` so left padding and packed sequences work.
- Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` key/value heads.
- Kernels are stored head-split (``q: [embed, heads, head_dim]``) so heads can be sharded on the
  ``tensor`` mesh axis; every parameter carries ``logical_axes`` metadata (see ``sharding.py``).

Causal masking is by slot index (query slot ``t`` sees key slots ``s <= t``) combined with an
``attention_mask`` over keys; RoPE uses ``positions``. A fully masked query row (a padding token)
attends uniformly instead of producing NaN: masked scores are a large finite negative number.

Decoding: ``init_cache(batch, max_len)`` returns a :class:`Cache`; ``decode`` writes ``T`` new
tokens at ``cache.index`` (prefill when ``T > 1``, one step when ``T == 1``) and returns the
logits of those tokens, equal to the full forward's logits at the same slots.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

_MASK_VALUE = -1e30  # finite: a fully masked row softmaxes to uniform, not NaN.


def _dtype(name: Any) -> jnp.dtype:
    return jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the decoder (hashable: usable as a static jit argument).

    ``dtype`` is the compute dtype (``"float32"`` or ``"bfloat16"``), ``param_dtype`` the storage
    dtype of parameters. ``head_dim`` defaults to ``hidden_size // num_heads``.
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

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"TransformerConfig.hidden_size ({self.hidden_size}) must be divisible by "
                    f"num_heads ({self.num_heads}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        for name in ("dtype", "param_dtype"):
            value = str(jnp.dtype(getattr(self, name)))
            if value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"TransformerConfig.{name} must be float32/bfloat16/float16, "
                                 f"got {value}")
            object.__setattr__(self, name, value)

    @property
    def num_params(self) -> int:
        """Number of parameters (embeddings counted once when tied)."""
        h, d, f = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h

    # -- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> TransformerConfig:
        """Builds a config from a Hugging Face ``config.json`` dict (Qwen2 or Llama)."""
        model_type = hf.get("model_type", "qwen2")
        if model_type not in ("qwen2", "llama"):
            raise ValueError(
                f"config.json model_type must be 'qwen2' or 'llama', got {model_type!r}")
        rope_scaling = hf.get("rope_scaling")
        rope_params = hf.get("rope_parameters") or {}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise NotImplementedError(f"config.json rope_scaling={rope_scaling} is not supported")
        if rope_params.get("rope_type", "default") != "default":
            raise NotImplementedError(f"config.json rope_parameters={rope_params} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(
                f"config.json hidden_act must be 'silu', got {hf['hidden_act']}")
        if hf.get("use_sliding_window", False):
            raise NotImplementedError("config.json use_sliding_window=true is not supported")
        if model_type == "qwen2":
            qkv_bias = True
        else:
            if hf.get("attention_bias", False):
                raise NotImplementedError(
                    "Llama attention_bias=true (biased o_proj) is not supported")
            if hf.get("mlp_bias", False):
                raise NotImplementedError("Llama mlp_bias=true is not supported")
            qkv_bias = False
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
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self, *, max_position_embeddings: int = 32768) -> dict:
        """The Hugging Face ``config.json`` dict (Qwen2 when ``qkv_bias``, else Llama)."""
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=max_position_embeddings,
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            initializer_range=self.initializer_range,
            torch_dtype=self.param_dtype,
            use_cache=True,
        )
        if self.qkv_bias:
            if self.head_dim != self.hidden_size // self.num_heads:
                raise ValueError("Qwen2 requires head_dim == hidden_size // num_heads; "
                                 f"got head_dim={self.head_dim}")
            return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                        use_sliding_window=False, sliding_window=None, max_window_layers=0,
                        attention_dropout=0.0, **common)
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                    mlp_bias=False, attention_dropout=0.0, pretraining_tp=1, **common)


class Cache(NamedTuple):
    """Key/value cache for incremental decoding (a pytree; pass it through ``jit``)."""

    k: jax.Array      # [L, B, S, KV, D] compute dtype, keys after RoPE
    v: jax.Array      # [L, B, S, KV, D] compute dtype
    mask: jax.Array   # [B, S] bool, True where a slot holds a real (non-padding) token
    index: jax.Array  # [] int32, next slot to write


def _param(rngs: nnx.Rngs, shape, axes, config: TransformerConfig, init: str = "normal"):
    dtype = _dtype(config.param_dtype)
    if init == "normal":
        value = config.initializer_range * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:  # "ones"
        value = jnp.ones(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.eps = config.rms_norm_eps
        self.weight = _param(rngs, (config.hidden_size,), ("norm",), config, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(jnp.float32) * x32.astype(dtype).astype(jnp.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, Hugging Face "rotate half" layout.

    Args:
      x: [B, T, H, D] queries or keys.
      positions: [B, T] int positions.
      theta: RoPE base.
    Returns:
      [B, T, H, D], same dtype as ``x`` (rotation computed in float32).
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        h, n, kv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = _param(rngs, (h, n, d), ("embed", "heads", "head_dim"), c)
        self.k_proj = _param(rngs, (h, kv, d), ("embed", "kv_heads", "head_dim"), c)
        self.v_proj = _param(rngs, (h, kv, d), ("embed", "kv_heads", "head_dim"), c)
        self.o_proj = _param(rngs, (n, d, h), ("heads", "head_dim", "embed"), c)
        if c.qkv_bias:
            self.q_bias = _param(rngs, (n, d), ("heads", "head_dim"), c, "zeros")
            self.k_bias = _param(rngs, (kv, d), ("kv_heads", "head_dim"), c, "zeros")
            self.v_bias = _param(rngs, (kv, d), ("kv_heads", "head_dim"), c, "zeros")

    def __call__(self, x, positions, key_mask, cache_kv=None, index=None):
        """x: [B, T, E]; key_mask: [B, S] bool over key slots; returns ([B, T, E], (k, v))."""
        c = self.config
        dt = x.dtype
        q = jnp.einsum("bte,end->btnd", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("bte,ekd->btkd", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("bte,ekd->btkd", x, self.v_proj[...].astype(dt))
        if c.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        q = rope(q, positions, c.rope_theta)
        k = rope(k, positions, c.rope_theta)
        b, t = x.shape[:2]
        if cache_kv is None:
            keys, values = k, v
            offset = 0
        else:
            ck, cv = cache_kv
            keys = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, index, 0, 0))
            values = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, index, 0, 0))
            offset = index
        s = keys.shape[1]
        q_slot = offset + jnp.arange(t)[:, None]  # [T, 1]
        causal = jnp.arange(s)[None, :] <= q_slot  # [T, S]
        mask = causal[None] & key_mask[:, None, :]  # [B, T, S]
        g = c.num_heads // c.num_kv_heads
        q = q.reshape(b, t, c.num_kv_heads, g, c.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, keys.astype(dt),
                            preferred_element_type=jnp.float32)
        scores = scores * (c.head_dim ** -0.5)
        scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(dt)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, values.astype(dt))
        out = out.reshape(b, t, c.num_heads, c.head_dim)
        y = jnp.einsum("btnd,nde->bte", out, self.o_proj[...].astype(dt))
        return y, (keys, values)


class MLP(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _param(rngs, (h, f), ("embed", "mlp"), config)
        self.up_proj = _param(rngs, (h, f), ("embed", "mlp"), config)
        self.down_proj = _param(rngs, (f, h), ("mlp", "embed"), config)

    def __call__(self, x):
        dt = x.dtype
        gate = x @ self.gate_proj[...].astype(dt)
        up = x @ self.up_proj[...].astype(dt)
        return (jax.nn.silu(gate) * up) @ self.down_proj[...].astype(dt)


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config, rngs=rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, positions, key_mask, cache_kv=None, index=None):
        dt = x.dtype
        y, kv = self.self_attn(self.input_layernorm(x).astype(dt), positions, key_mask,
                               cache_kv, index)
        x = x + y
        x = x + self.mlp(self.post_attention_layernorm(x).astype(dt))
        return x, kv


def _block_apply(block, x, positions, key_mask, cache_kv, index):
    return block(x, positions, key_mask, cache_kv, index)


class Transformer(nnx.Module):
    """Qwen2/Llama-compatible decoder. See the module docstring."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = _param(rngs, (config.vocab_size, config.hidden_size),
                                   ("vocab", "embed"), config)
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config, rngs=rngs)
        if not config.tie_embeddings:
            self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size),
                                  ("embed", "vocab"), config)

    def _check(self, tokens, positions, attention_mask):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T] int, got shape {tokens.shape}")
        if positions.shape != tokens.shape:
            raise ValueError(f"positions must match tokens {tokens.shape}, got {positions.shape}")
        if attention_mask is not None and attention_mask.shape != tokens.shape:
            raise ValueError(f"attention_mask must match tokens {tokens.shape}, "
                             f"got {attention_mask.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens must be integer, got {tokens.dtype}")

    def _run(self, tokens, positions, key_mask, cache=None):
        c = self.config
        dt = _dtype(c.dtype)
        x = self.embed_tokens[...].astype(dt)[tokens]
        new_k, new_v = [], []
        apply = nnx.remat(_block_apply) if c.remat else _block_apply
        for i, block in enumerate(self.layers):
            if cache is None:
                x, _ = apply(block, x, positions, key_mask, None, None)
            else:
                x, (k, v) = apply(block, x, positions, key_mask, (cache.k[i], cache.v[i]),
                                  cache.index)
                new_k.append(k)
                new_v.append(v)
        h = self.norm(x).astype(dt)
        if c.tie_embeddings:
            logits = jnp.einsum("bte,ve->btv", h, self.embed_tokens[...].astype(dt),
                                preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("bte,ev->btv", h, self.lm_head[...].astype(dt),
                                preferred_element_type=jnp.float32)
        return logits, new_k, new_v

    def __call__(self, tokens, positions, *, attention_mask=None):
        """Full forward.

        Args:
          tokens: [B, T] int32 token ids.
          positions: [B, T] int32 RoPE positions.
          attention_mask: [B, T] bool, False on padding keys (None: all valid).
        Returns:
          logits [B, T, V] float32.
        """
        self._check(tokens, positions, attention_mask)
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        logits, _, _ = self._run(tokens, positions, attention_mask.astype(bool))
        return logits

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """An empty cache for ``batch`` sequences of at most ``max_len`` slots."""
        c = self.config
        shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)
        zeros = jnp.zeros(shape, _dtype(c.dtype))
        return Cache(k=zeros, v=zeros, mask=jnp.zeros((batch, max_len), bool),
                     index=jnp.zeros((), jnp.int32))

    def decode(self, tokens, positions, cache: Cache, *, attention_mask=None):
        """Runs ``T`` new tokens against the cache (prefill when T > 1, one step when T == 1).

        Args:
          tokens: [B, T] int32, written at slots ``cache.index .. cache.index + T - 1``.
          positions: [B, T] int32 RoPE positions.
          cache: from :meth:`init_cache` or a previous ``decode``.
          attention_mask: [B, T] bool, False for padding tokens (None: all valid).
        Returns:
          (logits [B, T, V] float32, updated Cache). Writing past ``max_len`` is clamped by
          ``dynamic_update_slice``: callers must keep ``index + T <= max_len``.
        """
        self._check(tokens, positions, attention_mask)
        if cache.mask.shape[0] != tokens.shape[0]:
            raise ValueError(f"cache batch {cache.mask.shape[0]} != tokens batch {tokens.shape[0]}")
        if attention_mask is None:
            attention_mask = jnp.ones(tokens.shape, bool)
        key_mask = jax.lax.dynamic_update_slice(cache.mask, attention_mask.astype(bool),
                                                (0, cache.index))
        logits, ks, vs = self._run(tokens, positions, key_mask, cache)
        new_cache = Cache(k=jnp.stack(ks), v=jnp.stack(vs), mask=key_mask,
                          index=cache.index + tokens.shape[1])
        return logits, new_cache


def create_model(config: TransformerConfig, seed: int = 0) -> Transformer:
    """Builds a :class:`Transformer` with its initialisation compiled as one XLA program.

    Eager NNX construction runs (and compiles) every initialiser op separately, which costs
    tens of seconds on CPU; this is the fast path for tests, benchmarks and samplers. Sharded
    creation for training lives in ``gagar_jax.train.state``.
    """
    return nnx.jit(lambda key: Transformer(config, rngs=nnx.Rngs(params=key)))(
        jax.random.key(seed))
