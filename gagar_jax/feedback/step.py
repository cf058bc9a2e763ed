"""The feedback-training state and its jitted, sharded step (SFT, RW-SFT, Span-KTO, baselines).

Modes (``FeedbackObjective.mode``), all on the same state, optimiser, mesh and checkpoints:

=========================  =====================================================================
``sft``                    plain token-mean cross-entropy on every response token
``rw_sft``                 :func:`~gagar_jax.losses.rw_sft_loss` with ``w_pos / w_neu / w_neg``
``span_kto``               :func:`~gagar_jax.losses.span_kto_loss` against the frozen reference
``sft_drop_negative``      cross-entropy with the tokens of negative spans removed (mask and
                           denominator), the paper's "drop the negative data" baseline
``sft_penalize_negative``  cross-entropy with weight ``-penalty`` on negative tokens, the paper's
                           "harshly penalise" baseline
=========================  =====================================================================

State (:class:`FeedbackTrainState`, one pytree checkpointed whole by the policy package's
``Checkpointer``): the update count, the policy parameters, the optax state, the RNG key, the
**frozen reference parameters** (a copy of the starting parameters, never updated), the Span-KTO
reference point ``z_ref`` and the batch count of the ``cumulative`` reference point. A resumed run
therefore continues with exactly the ``z_ref`` and reference policy it stopped with.

Reference log-probs, two ways (``ref_logprobs``): ``inside`` runs the frozen reference's forward
inside the same compiled step (no extra dispatch, no host round trip, but its activations live
beside the policy's); ``precomputed`` takes ``ref_logprobs [N, T]`` in the batch from
:func:`jit_ref_logprobs`, one separate compiled forward per batch (or once per dataset: the
reference never changes). ``benchmarks/feedback_ref.py`` measures both.

Token alignment as in the RL update: arrays describe token ``t``; the logits at ``t - 1`` predict
it, so every ``[N, T]`` array is used from column 1 and ``response_mask[:, 0]`` must be False.

Imports from the update library (``gagar_jax.update``): ``UpdateConfig``, ``make_optimizer``,
``learning_rate_schedule``, ``state_shardings``, ``abstract_model``, ``BATCH_AXES``. Nothing else
of the RL experiment is used here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gagar_jax.losses import (
    REFERENCE_POINTS,
    REWARD_NORMS,
    kto_kl_reference_point,
    rw_sft_loss,
    span_kto_loss,
    token_logprobs_and_entropy,
)
from gagar_jax.models import BATCH_AXES, TransformerConfig
from gagar_jax.update.state import (
    UpdateConfig,
    abstract_model,
    learning_rate_schedule,
    make_optimizer,
    state_shardings,
)

MODES = ("sft", "rw_sft", "span_kto", "sft_drop_negative", "sft_penalize_negative")
REF_LOGPROBS = ("inside", "precomputed")


@dataclasses.dataclass(frozen=True)
class FeedbackObjective:
    """Which objective and its knobs (frozen, validated, hashable: a static jit argument)."""

    mode: str = "span_kto"
    # RW-SFT weights (the paper gives none; ours amplify positive, weaken negative tokens).
    w_pos: float = 1.5
    w_neu: float = 1.0
    w_neg: float = 0.1
    penalty: float = 1.0  # sft_penalize_negative: negative tokens get weight -penalty
    # Span-KTO.
    beta: float = 0.1
    lambda_w: float = 1.0
    lambda_l: float = 1.0
    alpha: float = 0.9
    neutral_coef: float = 1.0
    reference_point: str = "ema"
    reward_norm: str = "sum"
    ref_logprobs: str = "inside"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"objective.mode must be one of {MODES}, got {self.mode!r}")
        if self.reference_point not in REFERENCE_POINTS:
            raise ValueError(
                f"objective.reference_point must be one of {REFERENCE_POINTS}, "
                f"got {self.reference_point!r}"
            )
        if self.reward_norm not in REWARD_NORMS:
            raise ValueError(
                f"objective.reward_norm must be one of {REWARD_NORMS}, got {self.reward_norm!r}"
            )
        if self.ref_logprobs not in REF_LOGPROBS:
            raise ValueError(
                f"objective.ref_logprobs must be one of {REF_LOGPROBS}, got {self.ref_logprobs!r}"
            )
        if self.beta <= 0:
            raise ValueError(f"objective.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"objective.alpha must be in [0, 1], got {self.alpha}")
        for name in ("lambda_w", "lambda_l", "neutral_coef", "penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"objective.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def needs_reference(self) -> bool:
        return self.mode == "span_kto"

    @property
    def needs_kl_pairs(self) -> bool:
        return self.mode == "span_kto" and self.reference_point == "batch_kl"


class FeedbackTrainState(NamedTuple):
    """The whole feedback-training state (a pytree, checkpointed whole)."""

    step: jax.Array  # [] int32, optimizer steps done
    params: dict  # policy parameters (pure nested dict)
    opt_state: Any  # optax state
    ref_params: dict  # frozen reference policy: the starting parameters, never updated
    z_ref: jax.Array  # [] float32 Span-KTO reference point
    ref_count: jax.Array  # [] float32 batches in the cumulative reference point


class FeedbackTrainBatch(NamedTuple):
    """One step's packed feedback examples (``gagar_jax.data.feedback.FeedbackBatch`` + extras)."""

    tokens: jax.Array  # [N, T] int32
    positions: jax.Array  # [N, T] int32
    attention_mask: jax.Array  # [N, T] bool
    response_mask: jax.Array  # [N, T] bool
    span_ids: jax.Array  # [N, T] int32 (-1 = no span)
    span_polarity: jax.Array  # [N, S] int32
    token_polarity: jax.Array  # [N, T] int32
    ref_logprobs: jax.Array | None = None  # [N, T] f32 (ref_logprobs="precomputed")
    # Mismatched (prompt i, completion of another row) pairs for reference_point="batch_kl".
    kl_tokens: jax.Array | None = None  # [N, T] int32
    kl_positions: jax.Array | None = None  # [N, T] int32
    kl_attention_mask: jax.Array | None = None  # [N, T] bool
    kl_response_mask: jax.Array | None = None  # [N, T] bool


_ROW_FIELDS = tuple(FeedbackTrainBatch._fields)


def to_train_batch(batch, *, ref_logprobs=None, with_kl: bool = False) -> FeedbackTrainBatch:
    """A ``FeedbackBatch`` (host numpy) -> :class:`FeedbackTrainBatch`, with mismatched pairs
    (row i's prompt followed by row ``i + 1 mod N``'s response) when ``with_kl``."""
    fields = {f: np.asarray(getattr(batch, f)) for f in batch._fields}
    out = dict(fields, ref_logprobs=None if ref_logprobs is None else np.asarray(ref_logprobs))
    if with_kl:
        out.update(
            zip(
                ("kl_tokens", "kl_positions", "kl_attention_mask", "kl_response_mask"),
                mismatched_pairs(
                    fields["tokens"], fields["attention_mask"], fields["response_mask"]
                ),
            )
        )
    return FeedbackTrainBatch(**out)


def mismatched_pairs(tokens, attention_mask, response_mask, *, pad_id: int = 0):
    """TRL KTO's KL completions: row i = prompt of row i + response of row ``(i + 1) % N``.

    Rows whose combination does not fit ``T`` are truncated at ``T`` (the reference point is an
    estimate). Returns ``(tokens, positions, attention_mask, response_mask)`` [N, T].
    """
    n, t = tokens.shape
    out_t = np.full((n, t), pad_id, np.int32)
    out_a = np.zeros((n, t), bool)
    out_r = np.zeros((n, t), bool)
    for i in range(n):
        j = (i + 1) % n
        prompt = tokens[i][attention_mask[i] & ~response_mask[i]]
        resp = tokens[j][response_mask[j]]
        seq = np.concatenate([prompt, resp])[:t]
        out_t[i, : len(seq)] = seq
        out_a[i, : len(seq)] = True
        out_r[i, len(prompt) : len(seq)] = True
    pos = np.where(out_a, np.cumsum(out_a, axis=1) - 1, 0).astype(np.int32)
    return out_t, pos, out_a, out_r


# ------------------------------------------------------------------------------------------
# State
# ------------------------------------------------------------------------------------------
def feedback_shardings(model_config: TransformerConfig, update_config: UpdateConfig, mesh: Mesh):
    """``(abstract FeedbackTrainState, FeedbackTrainState of NamedShardings)``."""
    abstract, sh = state_shardings(model_config, update_config, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    abstract_fb = FeedbackTrainState(
        step=abstract.step,
        params=abstract.params,
        opt_state=abstract.opt_state,
        ref_params=abstract.params,
        z_ref=scalar,
        ref_count=scalar,
    )
    shard_fb = FeedbackTrainState(
        step=sh.step,
        params=sh.params,
        opt_state=sh.opt_state,
        ref_params=sh.params,
        z_ref=rep,
        ref_count=rep,
    )
    return abstract_fb, shard_fb


def abstract_feedback_state(model_config, update_config, mesh) -> FeedbackTrainState:
    """Shapes, dtypes and target shardings (for ``Checkpointer.restore``)."""
    abstract, sh = feedback_shardings(model_config, update_config, mesh)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh
    )


def create_feedback_state(
    model_config: TransformerConfig,
    update_config: UpdateConfig,
    mesh: Mesh,
    params: dict,
    *,
    z_ref: float = 0.0,
) -> FeedbackTrainState:
    """The starting state: ``params`` for the policy *and*, copied, for the frozen reference."""
    tx = make_optimizer(update_config)
    _, sh = feedback_shardings(model_config, update_config, mesh)
    params = jax.device_put(params, sh.params)

    def init(p):
        return FeedbackTrainState(
            step=jnp.zeros((), jnp.int32),
            params=p,
            opt_state=tx.init(p),
            ref_params=jax.tree.map(jnp.copy, p),
            z_ref=jnp.asarray(z_ref, jnp.float32),
            ref_count=jnp.zeros((), jnp.float32),
        )

    return jax.jit(init, out_shardings=sh)(params)


# ------------------------------------------------------------------------------------------
# Loss and step
# ------------------------------------------------------------------------------------------
def _logprobs(graphdef, params, tokens, positions, attention_mask):
    """[N, T-1] log-prob of token t+1 from the logits at t (the update's alignment)."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens, positions, attention_mask=attention_mask)
    logp, _ = token_logprobs_and_entropy(logits, jnp.roll(tokens, -1, axis=1))
    return logp[:, :-1]


def feedback_loss(
    params,
    ref_params,
    batch: FeedbackTrainBatch,
    z_ref,
    ref_count,
    *,
    graphdef,
    objective: FeedbackObjective,
):
    """``(loss, (new_z_ref, new_ref_count, metrics))`` of one batch under ``objective.mode``."""
    o = objective
    logp = _logprobs(graphdef, params, batch.tokens, batch.positions, batch.attention_mask)
    resp = batch.response_mask[:, 1:]
    pol = batch.token_polarity[:, 1:]
    ids = batch.span_ids[:, 1:]
    sg = jax.lax.stop_gradient
    # Per-polarity diagnostics for every mode (how each kind of token's probability moves).
    _, diag = rw_sft_loss(sg(logp), pol, resp, w_pos=1.0, w_neu=1.0, w_neg=1.0)
    metrics = {
        k: diag[k]
        for k in (
            "ce",
            "logp_pos",
            "logp_neu",
            "logp_neg",
            "tokens_pos",
            "tokens_neu",
            "tokens_neg",
        )
    }
    new_z, new_count = z_ref, ref_count
    if o.mode == "sft":
        loss, _ = rw_sft_loss(logp, pol, resp, w_pos=1.0, w_neu=1.0, w_neg=1.0)
    elif o.mode == "rw_sft":
        loss, _ = rw_sft_loss(logp, pol, resp, w_pos=o.w_pos, w_neu=o.w_neu, w_neg=o.w_neg)
    elif o.mode == "sft_drop_negative":
        loss, _ = rw_sft_loss(logp, pol, resp & (pol >= 0), w_pos=1.0, w_neu=1.0, w_neg=1.0)
    elif o.mode == "sft_penalize_negative":
        loss, _ = rw_sft_loss(logp, pol, resp, w_pos=1.0, w_neu=1.0, w_neg=-o.penalty)
    else:
        if batch.ref_logprobs is not None:
            ref = batch.ref_logprobs[:, 1:]
        else:
            ref = _logprobs(
                graphdef, ref_params, batch.tokens, batch.positions, batch.attention_mask
            )
        ref = sg(ref)
        z = z_ref
        if o.reference_point == "batch_kl":
            kl_args = (batch.kl_tokens, batch.kl_positions, batch.kl_attention_mask)
            kl_pol = sg(_logprobs(graphdef, params, *kl_args))
            kl_ref = sg(_logprobs(graphdef, ref_params, *kl_args))
            z = kto_kl_reference_point(
                kl_pol, kl_ref, batch.kl_response_mask[:, 1:], reward_norm=o.reward_norm
            )
        loss, new_z, m = span_kto_loss(
            logp,
            ref,
            ids,
            batch.span_polarity,
            z,
            beta=o.beta,
            lambda_w=o.lambda_w,
            lambda_l=o.lambda_l,
            alpha=o.alpha,
            neutral_coef=o.neutral_coef,
            reference_point=o.reference_point,
            reward_norm=o.reward_norm,
            ref_count=ref_count,
        )
        new_count = m["ref_count"]
        metrics.update({f"kto/{k}": v for k, v in m.items()})
        resp_f = resp.astype(jnp.float32)
        metrics["kl_to_ref"] = jnp.sum(jnp.where(resp, sg(logp) - ref, 0.0)) / jnp.maximum(
            jnp.sum(resp_f), 1.0
        )
    return loss, (new_z, new_count, metrics)


def feedback_step(
    state: FeedbackTrainState,
    batch: FeedbackTrainBatch,
    *,
    graphdef,
    objective: FeedbackObjective,
    update_config: UpdateConfig,
):
    """One optimizer step. Returns ``(state, metrics)``; the reference parameters pass through."""
    tx = make_optimizer(update_config)
    schedule = learning_rate_schedule(update_config)
    grad_fn = jax.value_and_grad(feedback_loss, has_aux=True)
    (loss, (new_z, new_count, metrics)), grads = grad_fn(
        state.params,
        state.ref_params,
        batch,
        state.z_ref,
        state.ref_count,
        graphdef=graphdef,
        objective=objective,
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(
        metrics,
        loss=loss,
        grad_norm=optax.tree.norm(grads),
        learning_rate=schedule(state.step),
        z_ref=new_z,
    )
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    new_state = FeedbackTrainState(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        ref_params=state.ref_params,
        z_ref=jnp.asarray(new_z, jnp.float32),
        ref_count=jnp.asarray(new_count, jnp.float32),
    )
    return new_state, metrics


def batch_shardings(mesh: Mesh, batch: FeedbackTrainBatch) -> FeedbackTrainBatch:
    """Rows over ``('data', 'fsdp')``; absent optional fields stay None."""
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    return FeedbackTrainBatch(*[None if x is None else rows for x in batch])


def shard_train_batch(batch: FeedbackTrainBatch, mesh: Mesh) -> FeedbackTrainBatch:
    """Host numpy (global) batch -> global sharded arrays (multi-process safe)."""

    def put(x, s):
        if x is None:
            return None
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return FeedbackTrainBatch(*[put(x, s) for x, s in zip(batch, batch_shardings(mesh, batch))])


def jit_feedback_step(
    model_config: TransformerConfig,
    objective: FeedbackObjective,
    update_config: UpdateConfig,
    mesh: Mesh,
    example: FeedbackTrainBatch,
    *,
    wrap=None,
):
    """``step(state, batch) -> (state, metrics)`` jitted with explicit shardings, state donated.

    ``example`` fixes which optional batch fields are present (their shardings).
    """
    graphdef = nnx.graphdef(abstract_model(model_config))
    _, st_sh = feedback_shardings(model_config, update_config, mesh)
    rep = NamedSharding(mesh, PartitionSpec())

    def fn(state, batch):
        return feedback_step(
            state, batch, graphdef=graphdef, objective=objective, update_config=update_config
        )

    if wrap is not None:
        fn = wrap(fn)
    return jax.jit(
        fn,
        in_shardings=(st_sh, batch_shardings(mesh, example)),
        out_shardings=(st_sh, rep),
        donate_argnums=(0,),
    )


def jit_ref_logprobs(model_config: TransformerConfig, update_config: UpdateConfig, mesh: Mesh):
    """``ref_logprobs(ref_params, tokens, positions, attention_mask) -> [N, T]`` (column t is
    token t's log-prob; column 0 is 0): the precomputed alternative to ``inside``."""
    graphdef = nnx.graphdef(abstract_model(model_config))
    _, st_sh = feedback_shardings(model_config, update_config, mesh)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))

    def fn(ref_params, tokens, positions, attention_mask):
        lp = _logprobs(graphdef, ref_params, tokens, positions, attention_mask)
        return jnp.pad(lp, ((0, 0), (1, 0)))

    return jax.jit(fn, in_shardings=(st_sh.ref_params, rows, rows, rows), out_shardings=rows)
