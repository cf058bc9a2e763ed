"""The typed run configuration: the ``ConfigDict`` of ``configs/*.py``, converted once.

``configs/*.py`` return a sectioned ``ConfigDict`` (editable from the command line with
``--config.optim.lr=1e-6``); :func:`RunConfig.from_config_dict` turns it into frozen
dataclasses whose ``__post_init__`` validates every field and names the one that is wrong.
Derived values (batch sizes, the redistribution mode of a training mode, whether a grader is
needed) are properties, never written back into the config.

Modes (``config.mode``), the paper's ablation:

* ``gagar``: groups graded, passing advantages redistributed sum-preservingly.
* ``binary``: plain GRPO mean-centred advantages from test outcomes (the paper's baseline).
  The grader still runs so that quality and T1 share are measured the same way, but its
  verdicts do not touch the advantages.
* ``discount_only``: low-quality passing solutions discounted without restoring the
  positive total (the ablation that breaks credit balance).
* ``gagar_token``: ``gagar``, then each sequence advantage redistributed over its tokens by
  ``advantages.token_importance`` (``evidence``: tokens the verdict cites get less of a positive
  advantage; ``entropy``; ``uniform`` = ``gagar``) with strength ``advantages.token_gamma``,
  conserving every sequence's credit (``gagar_jax.advantages.redistribute_tokens``).

These are *training* modes (``TRAINING_MODES``); the advantage kernels' redistribution modes
are ``gagar_jax.advantages.REDISTRIBUTION_MODES``. ``MODES`` is kept as an alias.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from gagar_jax.envs.family import family_names

TRAINING_MODES = ("gagar", "binary", "discount_only", "gagar_token")
MODES = TRAINING_MODES  # backward-compatible alias
# The advantage kernels' redistribution mode for each training mode.
_REDISTRIBUTION = {"gagar": "sum_preserving", "binary": "none", "discount_only": "discount_only",
                   "gagar_token": "sum_preserving"}
TOKEN_IMPORTANCE = ("evidence", "entropy", "uniform")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _check(cond: bool, field: str, expected: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"config.{field} must be {expected}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The task family (``gagar_jax.envs``: ``toy``, ``toy_agent``, ``python_repo``, ...)."""

    family: str = "toy"
    seed: int = 0
    difficulty: int = 1
    num_train: int = 256  # tasks generated for training; the pool cycles through them per epoch
    num_eval: int = 32  # held-out tasks, generated from a different seed
    data_path: str = ""  # repository families: task dirs / a .jsonl file (see the family)
    eval_data_path: str = ""  # their held-out pool ("" = the family's default)
    tokenizer_path: str = ""  # HF tokenizer dir ("" = model.hf_checkpoint, else built-in)
    max_turns: int = 6  # multi-turn families: model turns per episode
    max_observation_tokens: int = 256  # multi-turn families: observation cut
    # dynamic sampling: pass over tasks whose last ``saturation_window`` attempts (at least
    # ``saturation_min_attempts`` of them) all passed or all failed (PassRateTracker)
    skip_saturated: bool = False
    saturation_window: int = 8
    saturation_min_attempts: int = 4
    # SFT demonstration kinds (comma-separated; families with patch kinds: toy, toy_agent):
    # "" = the family's default (every passing, non-cheating kind)
    demo_kinds: str = ""

    def __post_init__(self):
        names = family_names()
        _check(self.family in names, "task.family", "|".join(names), self.family)
        _check(self.num_train >= 1, "task.num_train", ">= 1", self.num_train)
        _check(self.num_eval >= 0, "task.num_eval", ">= 0", self.num_eval)
        _check(self.difficulty >= 0, "task.difficulty", ">= 0", self.difficulty)
        _check(self.max_turns >= 1, "task.max_turns", ">= 1", self.max_turns)
        _check(self.max_observation_tokens >= 1, "task.max_observation_tokens", ">= 1",
               self.max_observation_tokens)
        _check(self.saturation_window >= 1, "task.saturation_window", ">= 1",
               self.saturation_window)
        _check(1 <= self.saturation_min_attempts <= self.saturation_window,
               "task.saturation_min_attempts", "1..task.saturation_window",
               self.saturation_min_attempts)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy; ``hf_checkpoint`` (config.json + safetensors dir) overrides the sizes."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: bool = False
    hf_checkpoint: str = ""

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            _check(getattr(self, name) >= 1, f"model.{name}", ">= 1", getattr(self, name))
        _check(self.num_heads % self.num_kv_heads == 0, "model.num_kv_heads",
               f"a divisor of model.num_heads={self.num_heads}", self.num_kv_heads)
        _check(self.dtype in ("float32", "bfloat16"), "model.dtype", "float32|bfloat16", self.dtype)
        _check(self.param_dtype in ("float32", "bfloat16"), "model.param_dtype",
               "float32|bfloat16", self.param_dtype)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Generation: G prompts x K rollouts per step, by the embedded sampler or SGLang."""

    engine: str = "embedded"  # embedded | sglang
    sglang_url: str = ""
    num_prompts: int = 8  # G: mixed groups per update
    num_rollouts: int = 8  # K: rollouts per prompt
    max_prompt_len: int = 128
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    request_timeout_s: float = 120.0
    # multi-turn families: new tokens per model turn (0 = max_new_tokens); max_new_tokens is
    # the budget of the whole episode after the prompt (turns and observations)
    max_turn_tokens: int = 0
    # several hosts sharing SGLang servers: the process that writes the weight export and
    # drives /update_weights_from_disk; the others wait for the version it reports
    weight_writer: int = 0

    def __post_init__(self):
        _check(self.engine in ("embedded", "sglang"), "rollout.engine", "embedded|sglang",
               self.engine)
        if self.engine == "sglang":
            _check(self.sglang_url.startswith("http"), "rollout.sglang_url",
                   "an http(s) URL when rollout.engine='sglang'", self.sglang_url)
        _check(self.num_prompts >= 1, "rollout.num_prompts", ">= 1", self.num_prompts)
        _check(self.num_rollouts >= 2, "rollout.num_rollouts", ">= 2 (groups need a comparison)",
               self.num_rollouts)
        _check(self.max_prompt_len >= 1, "rollout.max_prompt_len", ">= 1", self.max_prompt_len)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.temperature > 0, "rollout.temperature", "> 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)
        _check(self.max_turn_tokens >= 0, "rollout.max_turn_tokens", ">= 0 (0 = max_new_tokens)",
               self.max_turn_tokens)
        _check(self.weight_writer >= 0, "rollout.weight_writer", "a process index >= 0",
               self.weight_writer)

    @property
    def seq_len(self) -> int:
        """Static token length of a packed rollout (prompt + response)."""
        return self.max_prompt_len + self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO-style dynamic sampling: keep drawing until ``num_prompts`` mixed groups are found."""

    enabled: bool = True
    oversample: float = 1.5  # prompts drawn per round = ceil(oversample * missing groups)
    max_rounds: int = 8  # cap: after this many rounds the step fails with a clear error
    allow_partial: bool = False  # True: pad the batch with masked-out groups instead of failing
    tol: float = 1e-6

    def __post_init__(self):
        _check(self.oversample >= 1.0, "sampling.oversample", ">= 1.0", self.oversample)
        _check(self.max_rounds >= 1, "sampling.max_rounds", ">= 1", self.max_rounds)
        _check(self.tol >= 0, "sampling.tol", ">= 0", self.tol)


@dataclasses.dataclass(frozen=True)
class GradingConfig:
    grader: str = "heuristic"  # heuristic | agentic
    sglang_url: str = ""
    max_concurrency: int = 4
    deadline_s: float = 60.0
    enabled: bool = True  # False: no grader at all (tiers/ranks unknown; gagar == binary)

    def __post_init__(self):
        _check(self.grader in ("heuristic", "agentic"), "grading.grader", "heuristic|agentic",
               self.grader)
        if self.grader == "agentic":
            _check(self.sglang_url.startswith("http"), "grading.sglang_url",
                   "an http(s) URL when grading.grader='agentic'", self.sglang_url)
        _check(self.max_concurrency >= 1, "grading.max_concurrency", ">= 1", self.max_concurrency)
        _check(self.deadline_s > 0, "grading.deadline_s", "> 0", self.deadline_s)


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    estimator: str = "mean_centered"  # the paper's (Dr. GRPO style); grpo | rloo
    tier_factors: tuple[float, float, float] = (1.0, 0.6, 0.3)
    rank_decay: float = 0.5
    cheat_reward: float = 0.0  # reward of a confirmed cheat (the paper: 0)
    token_importance: str = "evidence"  # mode gagar_token: evidence | entropy | uniform
    token_gamma: float = 0.5  # mode gagar_token: weights within [1 - gamma, 1 + gamma]

    def __post_init__(self):
        _check(self.estimator in ("mean_centered", "grpo", "rloo"),
               "advantages.estimator", "mean_centered|grpo|rloo", self.estimator)
        _check(len(self.tier_factors) == 3 and all(0 < f <= 1 for f in self.tier_factors),
               "advantages.tier_factors", "three factors in (0, 1]", self.tier_factors)
        _check(0 <= self.rank_decay < 1, "advantages.rank_decay", "in [0, 1)", self.rank_decay)
        _check(0 <= self.cheat_reward <= 1, "advantages.cheat_reward", "in [0, 1]",
               self.cheat_reward)
        _check(self.token_importance in TOKEN_IMPORTANCE, "advantages.token_importance",
               "|".join(TOKEN_IMPORTANCE), self.token_importance)
        _check(0 <= self.token_gamma <= 1, "advantages.token_gamma", "in [0, 1]",
               self.token_gamma)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.99
    clip_low: float = 0.2
    clip_high: float = 0.28
    ppo_epochs: int = 1
    num_minibatches: int = 1
    num_microbatches: int = 1
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"  # the paper's; seq-mean-token-mean | seq-mean-token-sum
    schedule: str = "constant"  # after warm-up: constant | linear | cosine (to end_lr_ratio)
    end_lr_ratio: float = 0.1
    dual_clip: float = 0.0  # 0 = off, else > 1

    def __post_init__(self):
        _check(self.lr > 0, "optim.lr", "> 0", self.lr)
        _check(self.warmup_steps >= 0, "optim.warmup_steps", ">= 0", self.warmup_steps)
        _check(self.grad_clip > 0, "optim.grad_clip", "> 0", self.grad_clip)
        _check(self.clip_low > 0 and self.clip_high > 0, "optim.clip_low/clip_high", "> 0",
               (self.clip_low, self.clip_high))
        for name in ("ppo_epochs", "num_minibatches", "num_microbatches"):
            _check(getattr(self, name) >= 1, f"optim.{name}", ">= 1", getattr(self, name))
        _check(self.loss_agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
               "optim.loss_agg", "token-mean|seq-mean-token-mean|seq-mean-token-sum",
               self.loss_agg)
        _check(self.schedule in ("constant", "linear", "cosine"), "optim.schedule",
               "constant|linear|cosine", self.schedule)
        _check(0 <= self.end_lr_ratio <= 1, "optim.end_lr_ratio", "in [0, 1]", self.end_lr_ratio)
        _check(self.dual_clip == 0 or self.dual_clip > 1, "optim.dual_clip", "0 (off) or > 1",
               self.dual_clip)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Warm start from demonstrations (the toy env's reference patches and alternates)."""

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 32
    warmup_steps: int = 10

    def __post_init__(self):
        _check(self.steps >= 0, "sft.steps", ">= 0", self.steps)
        _check(self.lr > 0, "sft.lr", "> 0", self.lr)
        _check(self.batch_size >= 1, "sft.batch_size", ">= 1", self.batch_size)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    total_steps: int = 30
    log_every: int = 1
    eval_every: int = 10
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    eval_rollouts: int = 1  # samples per held-out task (greedy-ish pass@1 at eval temperature)
    eval_temperature: float = 0.7
    plot: bool = True

    def __post_init__(self):
        _check(self.total_steps >= 0, "loop.total_steps", ">= 0", self.total_steps)
        for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "eval_rollouts"):
            _check(getattr(self, name) >= 1, f"loop.{name}", ">= 1", getattr(self, name))
        _check(self.eval_temperature > 0, "loop.eval_temperature", "> 0", self.eval_temperature)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axes ('data', 'fsdp', 'tensor'); -1 on one axis takes the remaining devices."""

    shape: tuple[int, int, int] = (1, -1, 1)
    coordinator_address: str = ""  # multi-host: host:port of process 0 (or JAX_COORDINATOR_ADDRESS)
    num_processes: int = 1
    process_id: int = 0
    # multi-host: how long a host waits for the others at an exchange point before it ends the
    # run naming the missing process (longer than any phase one host can lag: a generation
    # round, grading.deadline_s, a checkpoint save)
    host_timeout_s: float = 900.0
    # jax.distributed's heartbeat timeout: a process silent this long is declared dead by JAX
    # itself, which ends every other process (the backstop inside orbax's save barriers)
    heartbeat_timeout_s: int = 100

    def __post_init__(self):
        _check(len(self.shape) == 3 and sum(1 for s in self.shape if s == -1) <= 1
               and all(s == -1 or s >= 1 for s in self.shape), "mesh.shape",
               "three axis sizes (data, fsdp, tensor), at most one -1", self.shape)
        _check(self.num_processes >= 1, "mesh.num_processes", ">= 1", self.num_processes)
        _check(0 <= self.process_id < self.num_processes, "mesh.process_id",
               f"in [0, {self.num_processes})", self.process_id)
        _check(self.host_timeout_s > 0, "mesh.host_timeout_s", "> 0", self.host_timeout_s)
        _check(self.heartbeat_timeout_s >= 1, "mesh.heartbeat_timeout_s", ">= 1",
               self.heartbeat_timeout_s)


_SECTIONS = {
    "task": TaskConfig, "model": ModelConfig, "rollout": RolloutConfig,
    "sampling": DynamicSamplingConfig, "grading": GradingConfig,
    "advantages": AdvantageConfig, "optim": OptimConfig, "sft": SFTConfig,
    "loop": LoopConfig, "mesh": MeshConfig,
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "toy_gagar"
    mode: str = "gagar"
    seed: int = 0
    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    grading: GradingConfig = GradingConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    optim: OptimConfig = OptimConfig()
    sft: SFTConfig = SFTConfig()
    loop: LoopConfig = LoopConfig()
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        _check(self.mode in TRAINING_MODES, "mode", "|".join(TRAINING_MODES), self.mode)
        if self.mode != "binary":
            _check(self.grading.enabled, "grading.enabled",
                   f"True for mode={self.mode!r} (its advantages need verdicts)",
                   self.grading.enabled)

    # ---- derived -----------------------------------------------------------------------------
    @property
    def redistribution(self) -> str:
        """The advantage kernels' redistribution mode for ``self.mode``."""
        return _REDISTRIBUTION[self.mode]

    def gagar_config(self):
        """The advantage kernels' ``GagarConfig`` for this run (mode from ``self.mode``)."""
        from gagar_jax.advantages import GagarConfig

        a = self.advantages
        return GagarConfig(estimator=a.estimator, mode=self.redistribution,
                           tier_factors=tuple(a.tier_factors), rank_decay=a.rank_decay,
                           mixed_tol=self.sampling.tol, cheat_reward=a.cheat_reward)

    @property
    def token_credit(self) -> str:
        """The update's ``token_credit``: the importance provider in mode ``gagar_token``."""
        return self.advantages.token_importance if self.mode == "gagar_token" else "broadcast"

    @property
    def batch_rollouts(self) -> int:
        """N = G * K rollouts per update (static)."""
        return self.rollout.num_prompts * self.rollout.num_rollouts

    def fingerprint(self) -> str:
        """Hash of everything that must match for a resumed run (not the step count or logging)."""
        d = self.to_dict()
        d["loop"] = {k: v for k, v in d["loop"].items()
                     if k not in ("total_steps", "log_every", "eval_every", "plot",
                                  "checkpoint_every", "keep_checkpoints")}
        d.pop("mesh")
        d["rollout"].pop("weight_writer")  # which host exports: deployment, not the run
        if not d["task"]["skip_saturated"]:  # off: the fingerprint of runs from before the flag
            for k in ("skip_saturated", "saturation_window", "saturation_min_attempts"):
                d["task"].pop(k)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> RunConfig:
        """Builds and validates from a ``ConfigDict`` (or plain nested dict).

        Unknown keys are an error naming the key, so a typo on the command line never
        silently falls back to a default.
        """
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - top)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {sorted(top)}")
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            section = _SECTIONS.get(key)
            if section is None:
                kwargs[key] = value
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"config.{key} must be a section (mapping), got {value!r}")
            names = {f.name: f for f in dataclasses.fields(section)}
            bad = sorted(set(value) - set(names))
            if bad:
                raise ConfigError(f"unknown field(s) {[f'{key}.{b}' for b in bad]}; "
                                  f"known: {sorted(names)}")
            fields = {}
            for k, v in value.items():
                if isinstance(v, list):  # ConfigDict tuples may come back as lists
                    v = tuple(v)
                fields[k] = v
            kwargs[key] = section(**fields)
        return cls(**kwargs)
