"""SFT warm start: next-token cross-entropy on demonstration responses.

The paper starts RL from an SFT checkpoint. Here the demonstrations are the task family's
(``TaskFamily.demonstrations``: the toy family's passing, non-cheating patch kinds; the agent
families' tool-call trajectories built from reference patches), packed to the same static
``[B, T]`` layout as rollouts (prompt, response, right padding) so one compiled step serves the
whole phase. The loss covers the demonstration's model tokens only (``loss_mask``): in a
multi-turn trajectory the observations between tool calls are context, not targets.

``sft_step(params, opt_state, batch) -> (params, opt_state, metrics)`` is a pure function of the
model's parameter state (flax NNX ``State``), jitted once with the optimizer bound.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class SFTBatch(NamedTuple):
    tokens: np.ndarray  # [B, T] int32
    positions: np.ndarray  # [B, T] int32
    attention_mask: np.ndarray  # [B, T] bool
    loss_mask: np.ndarray  # [B, T] bool, True on response tokens (predicted from t-1)


def _tokens_and_mask(demo) -> tuple[list[int], list[bool]]:
    """(tokens, loss mask) of a ``(prompt ids, response ids)`` pair or an object with
    ``tokens`` and ``loss_mask`` (``gagar_jax.envs.family.Demonstration``)."""
    if hasattr(demo, "loss_mask"):
        return list(demo.tokens), [bool(m) for m in demo.loss_mask]
    prompt, response = demo
    return list(prompt) + list(response), [False] * len(prompt) + [True] * len(response)


def pack_demonstrations(demos: Sequence, *, seq_len: int, pad_id: int) -> SFTBatch:
    """Packs demonstrations (``(prompt ids, response ids)`` pairs or ``Demonstration``s with a
    loss mask) into a :class:`SFTBatch` of length ``seq_len``."""
    B = len(demos)
    tokens = np.full((B, seq_len), pad_id, np.int32)
    positions = np.zeros((B, seq_len), np.int32)
    attn = np.zeros((B, seq_len), bool)
    loss = np.zeros((B, seq_len), bool)
    for i, demo in enumerate(demos):
        ids, mask = _tokens_and_mask(demo)
        n = len(ids)
        if n > seq_len:
            raise ValueError(f"demonstration {i} has {n} tokens > seq_len={seq_len}")
        tokens[i, :n] = ids
        positions[i, :n] = np.arange(n)
        attn[i, :n] = True
        loss[i, :n] = mask
    return SFTBatch(tokens, positions, attn, loss)


def make_optimizer(
    lr: float, warmup_steps: int, total_steps: int, grad_clip: float = 1.0
) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=max(warmup_steps, 1),
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=lr * 0.1,
    )
    return optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(schedule))


def sft_loss(model, batch: SFTBatch):
    """Token-mean cross-entropy of response tokens; returns (loss, token accuracy)."""
    logits = model(batch.tokens, batch.positions, attention_mask=batch.attention_mask)
    logits = logits[:, :-1].astype(jnp.float32)  # position t predicts token t+1
    targets = batch.tokens[:, 1:]
    mask = batch.loss_mask[:, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    ll = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    denom = jnp.maximum(mask.sum(), 1.0)  # an all-padding batch gives 0, not NaN
    acc = ((jnp.argmax(logits, -1) == targets) * mask).sum() / denom
    return -(ll * mask).sum() / denom, acc


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"), donate_argnums=(1, 2))
def sft_step(graphdef, params, opt_state, rest, batch: SFTBatch, *, tx):
    """One optimizer step on a demonstration batch."""
    from flax import nnx

    def loss_fn(p):
        model = nnx.merge(graphdef, p, rest)
        return sft_loss(model, batch)

    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (
        params,
        opt_state,
        {"sft_loss": loss, "sft_token_accuracy": acc, "sft_grad_norm": optax.tree.norm(grads)},
    )


def run_sft(
    model,
    demos: Sequence,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup_steps: int,
    seq_len: int,
    pad_id: int,
    seed: int,
    log_fn=None,
    log_every: int = 10,
):
    """Trains ``model`` (flax NNX, updated in place) on ``demos`` for ``steps`` steps.

    Batches are drawn without replacement per epoch with a seeded permutation. Returns the list
    of per-step metrics (host floats). Raises if a loss is not finite (naming the step).
    """
    from flax import nnx

    if not demos:
        raise ValueError("SFT warm start has no demonstrations (sft.steps > 0 needs some)")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(lr, warmup_steps, steps)
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    history = []
    for step in range(steps):
        idx = []
        while len(idx) < batch_size:
            if not order:
                order = list(rng.permutation(len(demos)))
            idx.append(order.pop())
        batch = pack_demonstrations([demos[i] for i in idx], seq_len=seq_len, pad_id=pad_id)
        params, opt_state, m = sft_step(graphdef, params, opt_state, rest, batch, tx=tx)
        if step % log_every == 0 or step == steps - 1:
            m = {k: float(v) for k, v in m.items()}
            if not np.isfinite(m["sft_loss"]):
                raise FloatingPointError(f"SFT loss is {m['sft_loss']} at step {step}")
            history.append((step, m))
            if log_fn is not None:
                log_fn(step, m)
    nnx.update(model, params)
    return history
