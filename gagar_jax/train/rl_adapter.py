"""The RL train state behind :class:`~gagar_jax.train.backends.Policy`: update and checkpoints.

INTERIM: this is the loop's own single-program update, used while the sharded update of the
policy-update issue (``gagar_jax.train`` update, train state and checkpoint manager) has not
landed. It is a real update, not a placeholder:

* the advantage kernels run inside the jitted step: ``gagar_advantages`` on the raw ``[G, K]``
  results (rewards, passed, cheat, tier, rank, graded, valid) with the run's ``GagarConfig``
  (mode ``sum_preserving`` / ``none`` / ``discount_only``), then ``broadcast_to_tokens``;
* PPO-clip with separate low/high clip ranges (clip-higher), token-mean aggregation over the
  batch (the paper's), log-probs recomputed by the same forward as the SFT loss;
* ``optax`` AdamW with global-norm clipping and linear warm-up;
* metrics: pg-loss mean, entropy, clip fractions, approximate KL, gradient norm, the kernels'
  credit-balance figures (``credit/ratio`` ...) and tier shares;
* orbax ``CheckpointManager`` saves of ``{params, opt_state, step}``, waited on before the loop
  writes its bookkeeping, so a listed step is always complete.

What it does not do (the full update does): explicit shardings over the ('data', 'fsdp',
'tensor') mesh, several mini-batches / PPO epochs, gradient accumulation, KL to a reference.
Configs asking for those are refused with a clear error rather than silently ignored.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gagar_jax.train.run_config import RunConfig
from gagar_jax.train.sampling import PackedBatch


def finished_checkpoint_steps(directory: str) -> list[int]:
    """Steps with a complete checkpoint (orbax renames ``<step>.orbax-checkpoint-tmp-*`` to
    ``<step>`` only when the write is finished)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory)
                  if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def make_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    o = cfg.optim
    schedule = optax.linear_schedule(0.0, o.lr, max(o.warmup_steps, 1))
    return optax.chain(optax.clip_by_global_norm(o.grad_clip),
                       optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def token_logprobs_and_entropy(model, tokens, positions, attention_mask):
    """Per-token log-prob of ``tokens[:, t]`` and the entropy of its predictive distribution.

    Returns ``(logp [B, T], entropy [B, T])`` aligned with ``tokens``; position 0 (no
    prediction) is 0.
    """
    logits = model(tokens, positions, attention_mask=attention_mask)[:, :-1]
    logp_all = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens[:, 1:, None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, entropy], 1)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "gagar", "clip_low",
                                             "clip_high", "entropy_coef"),
                   donate_argnums=(1, 2))
def rl_step(graphdef, params, opt_state, rest, batch: dict[str, jax.Array], *, tx, gagar,
            clip_low: float, clip_high: float, entropy_coef: float):
    """One PPO-clip step with Gagar advantages computed in the same program.

    Args:
      batch: the fields of :class:`PackedBatch` as arrays (``[G, K, T]`` tokens, ``[G, K]``
        results, ``[G]`` graded).
    Returns:
      ``(params, opt_state, metrics)``; metrics a flat dict of float32 scalars.
    """
    from flax import nnx

    from gagar_jax.advantages import broadcast_to_tokens, gagar_advantages

    G, K, T = batch["tokens"].shape
    out = gagar_advantages(batch["rewards"], batch["passed"], batch["cheat"], batch["tier"],
                           batch["rank"], batch["graded"], batch["valid"], config=gagar)
    mask = batch["response_mask"] & batch["valid"][..., None]
    adv_tok = broadcast_to_tokens(out.advantages, mask)  # [G, K, T]
    flat = lambda x: x.reshape((G * K,) + x.shape[2:])
    tokens, positions = flat(batch["tokens"]), flat(batch["positions"])
    attn, m = flat(batch["attention_mask"]), flat(mask).astype(jnp.float32)
    old_lp, adv = flat(batch["old_logprobs"]), flat(adv_tok)
    n_tok = jnp.maximum(m.sum(), 1.0)  # an all-padding batch gives zero loss, not NaN

    def loss_fn(p):
        model = nnx.merge(graphdef, p, rest)
        logp, ent = token_logprobs_and_entropy(model, tokens, positions, attn)
        log_ratio = jnp.where(m > 0, logp - old_lp, 0.0)
        ratio = jnp.exp(log_ratio)
        clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
        pg = -jnp.minimum(ratio * adv, clipped * adv)
        pg_mean = jnp.sum(pg * m) / n_tok
        ent_mean = jnp.sum(ent * m) / n_tok
        loss = pg_mean - entropy_coef * ent_mean
        aux = {
            "pg_loss_mean": pg_mean,
            "entropy": ent_mean,
            "approx_kl": jnp.sum((ratio - 1.0 - log_ratio) * m) / n_tok,  # k3 estimator
            "clip_frac_low": jnp.sum(((ratio < 1.0 - clip_low) & (adv < 0)) * m) / n_tok,
            "clip_frac_high": jnp.sum(((ratio > 1.0 + clip_high) & (adv > 0)) * m) / n_tok,
            "ratio_mean": jnp.sum(ratio * m) / n_tok,
        }
        return loss, aux

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(out.metrics)
    metrics.update(aux)
    metrics.update(loss=loss, grad_norm=optax.tree.norm(grads), loss_tokens=m.sum(),
                   finite=jnp.isfinite(loss).astype(jnp.float32))
    return params, opt_state, metrics


class RLState:
    """Params, optimizer state, the jitted step and the checkpoint manager of one run."""

    def __init__(self, cfg: RunConfig, model, mesh, ckpt_dir: str):
        import orbax.checkpoint as ocp
        from flax import nnx

        o = cfg.optim
        unsupported = {k: v for k, v in (("optim.ppo_epochs", o.ppo_epochs),
                                         ("optim.num_minibatches", o.num_minibatches),
                                         ("optim.num_microbatches", o.num_microbatches))
                       if v != 1}
        if o.kl_coef:
            unsupported["optim.kl_coef"] = o.kl_coef
        if o.loss_agg != "token_mean":
            unsupported["optim.loss_agg"] = o.loss_agg
        if unsupported:
            raise ValueError(f"{unsupported}: the interim loop update supports one token-mean "
                             "PPO step per batch without KL; these need the sharded update")
        self.cfg = cfg
        self.model = model
        self.mesh = mesh
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.tx = make_optimizer(cfg)
        self.opt_state = self.tx.init(self.params)
        self.gagar = cfg.gagar_config()
        self.step = 0
        self.manager = ocp.CheckpointManager(
            os.path.abspath(ckpt_dir),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.loop.keep_checkpoints + 1,
                                                 create=True))

    @classmethod
    def create(cls, cfg: RunConfig, model, mesh, ckpt_dir: str) -> RLState:
        return cls(cfg, model, mesh, ckpt_dir)

    def update(self, batch: PackedBatch, *, step: int) -> dict[str, float]:
        arrays = {k: jnp.asarray(v) for k, v in batch._asdict().items()}
        self.params, self.opt_state, m = rl_step(
            self.graphdef, self.params, self.opt_state, self.rest, arrays, tx=self.tx,
            gagar=self.gagar, clip_low=self.cfg.optim.clip_low,
            clip_high=self.cfg.optim.clip_high, entropy_coef=self.cfg.optim.entropy_coef)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        if not np.isfinite(m["loss"]):
            raise FloatingPointError(f"non-finite loss {m['loss']} at RL step {step}")
        self.step = step + 1
        return m

    @property
    def trace_count(self) -> int:
        """Compiled variants of the step (1 for a whole run: the batch shape is static)."""
        return rl_step._cache_size()

    def params_for_sync(self):
        """The model's full nnx state with the current params (the sampler's ``sync_weights``)."""
        from flax import nnx

        nnx.update(self.model, self.params)
        return nnx.state(self.model)

    def _tree(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state,
                "step": jnp.asarray(self.step, jnp.int32)}

    def save(self, step: int) -> None:
        import orbax.checkpoint as ocp

        self.manager.save(step, args=ocp.args.StandardSave(self._tree()), force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int) -> None:
        import orbax.checkpoint as ocp
        from flax import nnx

        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._tree())
        tree = self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
        self.params, self.opt_state = tree["params"], tree["opt_state"]
        self.step = int(tree["step"])
        nnx.update(self.model, self.params)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
