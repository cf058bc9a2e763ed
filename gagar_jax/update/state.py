"""Update configuration, train state, optimiser, mesh, and sharded state creation.

The train state is a plain pytree (:class:`TrainState`: step, params as a pure nested dict, the
optax state), so ``jax.jit`` shardings, donation and orbax apply to it directly. The
model's structure (an ``nnx.GraphDef``) is static and rebuilt from the model config.

Sharded creation follows lm1b / big_vision: ``jax.eval_shape`` of the initialiser gives the
abstract state, shardings derive from the parameters' logical axes (``models/sharding.py``), and
``jax.jit(init, out_shardings=...)`` creates every leaf directly on its shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gagar_jax.advantages import IMPORTANCE_PROVIDERS, GagarConfig
from gagar_jax.losses import AGGREGATIONS, KL_ESTIMATORS
from gagar_jax.losses.policy import ROLLOUT_IS, ROLLOUT_RS
from gagar_jax.losses.rollout_correction import WEIGHTING_CORRECTIONS, check_correction_settings
from gagar_jax.models import Transformer, TransformerConfig, param_shardings
from gagar_jax.models import lora as lora_lib

MESH_AXES = ("data", "fsdp", "tensor")
SCHEDULES = ("cosine", "linear", "constant")

# `UpdateConfig.token_credit`: the broadcast, an importance provider, or the contrastive split.
TOKEN_CREDITS = ("broadcast", *IMPORTANCE_PROVIDERS, "distinguishing")


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Knobs of the policy update (frozen, validated, hashable).

    Batch geometry: ``N`` sequences per update are split into ``num_minibatches`` optimizer
    steps, each accumulated over ``num_microbatches`` forward/backward passes, repeated for
    ``ppo_epochs`` epochs (``ppo_epochs * num_minibatches`` optimizer steps per update).
    """

    # Optimiser: AdamW + global-norm clipping, linear warm-up then decay to
    # ``learning_rate * end_lr_ratio`` at ``decay_steps`` optimizer steps.
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int = 1000
    schedule: str = "constant"
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    # The dtype of Adam's moments ("": the parameters'; "float32": float32 moments for
    # bfloat16 parameters, the update computed in float32 and rounded onto the parameters).
    opt_state_dtype: str = ""
    # Loss.
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    # The sampling temperature is part of the behaviour policy: the sampler records
    # log_softmax(logits / T), so the update (loss, ratio, entropy, KL) scores at the same T.
    # Set it from rollout.temperature; at T != 1 a temperature-1 update is off-policy.
    temperature: float = 1.0
    # Mixture-of-experts models: weight of the load-balancing loss (``router_aux_loss`` of
    # ``gagar_jax.models.router_metrics``, Switch-Transformer / HF Qwen3-MoE definition) added
    # to the policy loss; 0 disables (the router metrics are reported either way).
    router_aux_loss_coef: float = 0.0
    # Memory: the LM head + log-softmax run over the sequence in chunks of this many tokens
    # (rematerialised in the backward pass), so the [tokens, vocab] float32 logits never exist
    # whole; 0 = the whole sequence at once.
    logits_chunk_size: int = 0
    # Speed: the LM head and the log-softmax run only on a window of this many positions of
    # each sequence, from the one that predicts its first response token, not on the prompt
    # (the RL loop sets it to ``rollout.max_new_tokens``, the widest a packed response can be).
    # Every response token must lie inside the window: ``check_batch`` refuses a batch where
    # one does not, and the ``score_window/dropped_tokens`` metric counts any the jitted update
    # would leave out. The loss is the same as with every position scored. 0 = every position.
    score_window: int = 0
    # Speed: each group's prompt runs through the model once, not once per sample; the
    # samples' response windows (``score_window`` wide) attend to the prompt's keys and values,
    # and the backward sums their gradients into it. The same loss and gradients as the
    # sample-by-sample forward, for a fraction of the layers' work when prompts are long. Needs
    # ``score_window``, every sample of a group on the same prompt (``check_batch`` checks),
    # a dense model, and the groups to divide into the mini- and micro-batches.
    shared_prefix: bool = False
    # Geometry.
    num_minibatches: int = 1
    num_microbatches: int = 1
    ppo_epochs: int = 1
    # Advantage kernels (run inside the update).
    advantages: GagarConfig = GagarConfig()
    # Token credit: "broadcast" (each sequence advantage on all its tokens, the paper's), an
    # importance provider ("uniform" | "entropy" | "evidence") whose importance
    # `redistribute_tokens` uses, with strength `token_gamma` in [0, 1], inside the loss, or
    # "distinguishing": the redistribution's change on the tokens where a pass parts from the
    # passes of another quality (`contrastive_tokens`, strength `token_gamma`: 1 leaves the
    # shared tokens at the base advantage).
    token_credit: str = "broadcast"
    token_gamma: float = 0.5
    # Off-policy correction (``gagar_jax.losses.policy_loss``): truncated importance sampling
    # on the trainer/behaviour ratio ("none" | "token" | "sequence", truncated at
    # ``rollout_is_threshold``), rejection ("none" | "token_k3" | "geometric" with its bounds)
    # and the decoupled objective (the clip around the policy the update starts from). Any of
    # them makes the update recompute the trainer's own log-probs first (one forward pass).
    rollout_is: str = "none"
    rollout_is_threshold: float = 2.0
    rollout_rs: str = "none"
    rollout_rs_threshold: float = 2.0
    rollout_rs_threshold_lower: float = 0.5
    decoupled: bool = False
    # The rollout-correction toolbox (``gagar_jax.losses.rollout_correction``), on top of the
    # two above: "none" | "icepop" | "seq_mask_tis" | "outlier_token" | "outlier_veto" |
    # "tv_trust_region", with the ratio band [low, high] (icepop; seq_mask_tis's geometric
    # mean), the TIS cap of seq_mask_tis, the outlier ratio of outlier_* and the total-variation
    # radius of tv_trust_region. icepop and seq_mask_tis weight tokens: they need decoupled and
    # rollout_is "none". Metrics: mismatch/masked_token_frac, mismatch/masked_seq_frac.
    rollout_correction: str = "none"
    rollout_correction_low: float = 0.5
    rollout_correction_high: float = 2.0
    rollout_correction_cap: float = 2.0
    rollout_correction_outlier: float = 20.0
    rollout_correction_delta: float = 0.2
    # Mismatch diagnostics: the update runs the proximal pass (the trainer's log-probs before
    # it) even without a correction and reports mismatch/logprob_max_abs_diff and mismatch/k3
    # against the behaviour log-probs (and, for a mixture of experts with recorded routes,
    # mismatch/route_diff_frac and mismatch/k3 with and without routing replay).
    mismatch_metrics: bool = False
    # Routing replay (mixture-of-experts models): each token goes to the experts the rollout
    # engine routed it to (``UpdateBatch.routes``), with gate weights from the current
    # router's probabilities over those experts (the router still learns).
    routing_replay: bool = False

    @property
    def off_policy(self) -> bool:
        """Some correction is on (the update computes the proximal log-probs)."""
        return (
            self.decoupled
            or self.rollout_is != "none"
            or self.rollout_rs != "none"
            or self.rollout_correction not in ("none", "tv_trust_region")
        )

    @property
    def needs_proximal(self) -> bool:
        """The update runs the proximal pass: a correction or the mismatch diagnostics."""
        return self.off_policy or self.mismatch_metrics

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"update.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.opt_state_dtype not in ("", "float32", "bfloat16"):
            raise ValueError(
                "update.opt_state_dtype must be '', 'float32' or 'bfloat16', "
                f"got {self.opt_state_dtype!r}"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(
                f"update.aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"update.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        for name in ("num_minibatches", "num_microbatches", "ppo_epochs", "decay_steps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"update.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "learning_rate",
            "max_grad_norm",
            "clip_low",
            "clip_high",
            "kl_coef",
            "entropy_coef",
            "weight_decay",
            "warmup_steps",
            "router_aux_loss_coef",
            "logits_chunk_size",
            "score_window",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"update.{name} must be >= 0, got {getattr(self, name)}")
        if self.shared_prefix and self.score_window <= 0:
            raise ValueError(
                "update.shared_prefix needs update.score_window > 0 (the response window each "
                f"sample runs against its group's prompt), got {self.score_window}"
            )
        if not self.temperature > 0:  # also rejects NaN
            raise ValueError(f"update.temperature must be > 0, got {self.temperature}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"update.dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.token_credit not in TOKEN_CREDITS:
            raise ValueError(
                f"update.token_credit must be one of {TOKEN_CREDITS}, got {self.token_credit!r}"
            )
        if not 0.0 <= self.token_gamma <= 1.0:
            raise ValueError(f"update.token_gamma must be in [0, 1], got {self.token_gamma}")
        if self.rollout_is not in ROLLOUT_IS:
            raise ValueError(
                f"update.rollout_is must be one of {ROLLOUT_IS}, got {self.rollout_is!r}"
            )
        if self.rollout_rs not in ROLLOUT_RS:
            raise ValueError(
                f"update.rollout_rs must be one of {ROLLOUT_RS}, got {self.rollout_rs!r}"
            )
        if self.rollout_is != "none" and not self.decoupled:
            raise ValueError(
                f"update.rollout_is={self.rollout_is!r} needs update.decoupled="
                "True (with the clip around the behaviour policy the ratio "
                "already carries pi / mu)"
            )
        if not self.rollout_is_threshold >= 1.0:
            raise ValueError(
                f"update.rollout_is_threshold must be >= 1, got {self.rollout_is_threshold}"
            )
        if self.rollout_rs == "token_k3" and not self.rollout_rs_threshold >= 0.0:
            raise ValueError(
                "update.rollout_rs_threshold (a k3 bound for token_k3) must be "
                f">= 0, got {self.rollout_rs_threshold}"
            )
        if self.rollout_rs == "geometric" and not (
            self.rollout_rs_threshold_lower <= 1.0 <= self.rollout_rs_threshold
        ):
            raise ValueError(
                "update.rollout_rs_threshold_lower <= 1 <= "
                "update.rollout_rs_threshold expected, got "
                f"[{self.rollout_rs_threshold_lower}, {self.rollout_rs_threshold}]"
            )
        check_correction_settings(
            self.rollout_correction,
            low=self.rollout_correction_low,
            high=self.rollout_correction_high,
            cap=self.rollout_correction_cap,
            outlier=self.rollout_correction_outlier,
            delta=self.rollout_correction_delta,
            prefix="update.",
        )
        if self.rollout_correction in WEIGHTING_CORRECTIONS and (
            not self.decoupled or self.rollout_is != "none"
        ):
            raise ValueError(
                f"update.rollout_correction={self.rollout_correction!r} weights tokens: it "
                "needs update.decoupled=True and update.rollout_is='none' (the weight would "
                "count the mismatch twice)"
            )
        if not 0.0 <= self.end_lr_ratio <= 1.0:
            raise ValueError(f"update.end_lr_ratio must be in [0, 1], got {self.end_lr_ratio}")

    @classmethod
    def from_mapping(cls, mapping: Any) -> UpdateConfig:
        """From a dict / ``ml_collections.ConfigDict``; ``advantages`` may be a nested mapping.

        Unknown keys raise a ``ValueError`` naming them.
        """
        items = dict(mapping)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(items) - names)
        if unknown:
            raise ValueError(
                f"update config: unknown keys {unknown}; expected some of {sorted(names)}"
            )
        if "advantages" in items and not isinstance(items["advantages"], GagarConfig):
            items["advantages"] = GagarConfig.from_mapping(items["advantages"])
        return cls(**items)

    @property
    def optimizer_steps_per_update(self) -> int:
        return self.ppo_epochs * self.num_minibatches


class TrainState(NamedTuple):
    """The whole training state (a pytree)."""

    step: jax.Array  # [] int32, number of completed updates
    params: dict  # pure nested dict of parameter arrays (see nnx.to_pure_dict)
    opt_state: Any  # optax state


def learning_rate_schedule(config: UpdateConfig) -> optax.Schedule:
    """Linear warm-up to ``learning_rate`` then cosine/linear decay (or constant)."""
    lr = config.learning_rate
    end = lr * config.end_lr_ratio
    decay = max(config.decay_steps - config.warmup_steps, 1)
    if config.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif config.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay, alpha=config.end_lr_ratio)
    else:
        after = optax.linear_schedule(lr, end, decay)
    if config.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, lr, config.warmup_steps)
    return optax.join_schedules([warm, after], [config.warmup_steps])


def make_optimizer(config: UpdateConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm`` then AdamW with the configured schedule (its moments in
    ``opt_state_dtype`` when set)."""
    adamw = optax.adamw(
        learning_rate_schedule(config),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    if config.opt_state_dtype:
        adamw = _in_dtype(adamw, jnp.dtype(config.opt_state_dtype))
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)


def _in_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """``inner`` run on ``dtype`` copies of the gradients and parameters (so its state is in
    ``dtype``); the updates come back in each parameter's own dtype."""

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype), tree)

    def init(params):
        return inner.init(cast(params))

    def update(grads, state, params=None):
        updates, state = inner.update(cast(grads), state, None if params is None else cast(params))
        return jax.tree.map(lambda u, g: u.astype(g.dtype), updates, grads), state

    return optax.GradientTransformation(init, update)


def mesh_shape(shape: tuple[int, int, int], num_devices: int) -> tuple[int, int, int]:
    """Resolves a -1 axis; raises naming ``mesh.shape`` when the devices do not factor."""
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh.shape={shape}: {num_devices} devices not divisible by {known}")
        shape = tuple(num_devices // known if s == -1 else s for s in shape)
    if int(np.prod(shape)) != num_devices:
        raise ValueError(
            f"mesh.shape={shape} needs {int(np.prod(shape))} devices, {num_devices} available"
        )
    return shape


def make_mesh(shape: tuple[int, int, int], devices=None) -> Mesh:
    """A ``('data', 'fsdp', 'tensor')`` mesh with Auto axes (GSPMD inserts collectives).

    Auto rather than ``jax.make_mesh``'s Explicit default: the model and kernels then need no
    per-op ``out_sharding`` annotations and run unchanged on any mesh shape. One axis may be -1
    (the remaining devices, :func:`mesh_shape`).
    """
    devices = jax.devices() if devices is None else devices
    shape = tuple(int(s) for s in shape)
    if len(shape) == 3 and -1 in shape:
        shape = mesh_shape(shape, len(devices))
    if len(shape) != 3 or int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh shape {shape} (data, fsdp, tensor) must multiply to the {len(devices)} devices"
        )
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def abstract_model(model_config: TransformerConfig) -> Transformer:
    return nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))


def _opt_state_shardings(abstract_opt_state, params_shardings, mesh):
    """Optimizer-state leaves mirroring a parameter (Adam moments) take its sharding."""
    by_path = {path: s for path, s in jax.tree_util.tree_flatten_with_path(params_shardings)[0]}
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(path, leaf):
        for start in range(len(path)):
            s = by_path.get(tuple(path[start:]))
            if s is not None and len(s.spec) <= leaf.ndim:
                return s
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def _opt_init(tx, params: dict, model_config: TransformerConfig):
    """The optimizer state of the trainable parameters: every parameter, or with LoRA
    (``model.lora_rank``) the adapters only (``gagar_jax.models.lora.trainable``)."""
    return tx.init(lora_lib.trainable(params, model_config)[0])


def state_shardings(model_config: TransformerConfig, config: UpdateConfig, mesh: Mesh):
    """``(abstract TrainState, TrainState of NamedShardings)`` for this model on ``mesh``."""
    tx = make_optimizer(config)
    p_sh = param_shardings(nnx.state(abstract_model(model_config), nnx.Param), mesh)

    def init(key):
        params = nnx.to_pure_dict(
            nnx.state(Transformer(model_config, rngs=nnx.Rngs(params=key)), nnx.Param)
        )
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=_opt_init(tx, params, model_config),
        )

    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = TrainState(
        step=replicated,
        params=p_sh,
        opt_state=_opt_state_shardings(abstract.opt_state, p_sh, mesh),
    )
    return abstract, shardings


def create_train_state(
    model_config: TransformerConfig,
    config: UpdateConfig,
    mesh: Mesh,
    seed: int = 0,
    params: dict | None = None,
) -> TrainState:
    """A freshly initialised (or ``params``-initialised) state, created already sharded."""
    tx = make_optimizer(config)
    _, shardings = state_shardings(model_config, config, mesh)
    if params is None:

        def init(key):
            init_key = jax.random.split(key)[0]  # the key a seed's parameters always came from
            p = nnx.to_pure_dict(
                nnx.state(Transformer(model_config, rngs=nnx.Rngs(params=init_key)), nnx.Param)
            )
            return TrainState(
                step=jnp.zeros((), jnp.int32), params=p, opt_state=_opt_init(tx, p, model_config)
            )

        return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed))

    params = jax.device_put(params, shardings.params)

    def from_params(p):
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=_opt_init(tx, p, model_config)
        )

    return jax.jit(from_params, out_shardings=shardings)(params)


def config_fingerprint(
    model_config: TransformerConfig, config: UpdateConfig, mesh_shape=None
) -> str:
    """A short stable hash of what a checkpoint's state depends on (model + optimiser shape).

    The mesh shape is left out on purpose: a checkpoint restores onto any mesh.
    """
    del mesh_shape
    update = dataclasses.asdict(config)
    for speed_only in ("score_window", "shared_prefix"):  # the same loss and state either way
        update.pop(speed_only, None)
    if not update.get("opt_state_dtype"):  # the default: the fingerprints from before it
        update.pop("opt_state_dtype", None)
    model = dataclasses.asdict(model_config)
    if not model_config.lora_rank:  # no LoRA: the fingerprints of the runs from before it
        for k in ("lora_rank", "lora_alpha", "lora_targets"):
            model.pop(k)
    payload = json.dumps(
        {"model": model, "update": update},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
