"""The typed run configuration: the ``ConfigDict`` of ``configs/*.py``, converted once.

``configs/*.py`` return a sectioned ``ConfigDict`` (editable from the command line with
``--config.learner.learning_rate=1e-6``); :func:`RunConfig.from_config_dict` turns it into
frozen dataclasses whose ``__post_init__`` validates every field and names the one that is wrong.

One config layer: the policy and its update are configured by the library's own types, not by
restatements of them. ``model`` *is* a :class:`~gagar_jax.models.TransformerConfig` (its
``vocab_size`` is the task family's tokenizer's, filled in by :meth:`RunConfig.model_config`;
``model.hf_checkpoint`` in the ``ConfigDict`` loads architecture and weights from a Hugging Face
checkpoint instead, :attr:`RunConfig.hf_checkpoint`), and ``learner`` *is* the
:class:`~gagar_jax.update.UpdateConfig` the jitted update receives, ``learner.advantages`` its
:class:`~gagar_jax.advantages.GagarConfig`. (The section is called ``learner``, not ``update``,
because ``ConfigDict.update`` is a method: ``c.update`` would never reach the section.) The
loop-only sections (``task``, ``rollout``, ``sampling``, ``grading``, ``sft``, ``loop``,
``mesh``) are dataclasses of this module.

Nine ``learner`` fields follow from other choices and are filled in by
:meth:`RunConfig.from_config_dict` when the ``ConfigDict`` leaves them out (and checked when it
sets them): ``temperature`` = ``rollout.temperature`` (the behaviour policy's), ``decay_steps``
= the run's optimizer steps, ``advantages.mode`` = the training mode's redistribution,
``token_credit`` (``"evidence"`` in mode ``gagar_token``, else ``"broadcast"``),
``score_window`` = ``rollout.max_new_tokens`` (the LM head runs on the response positions
only; 0 runs it on every position, with the same loss), and ``shared_prefix`` = whether there
is a window and no partial rollouts (each group's prompt runs through the model once, not once
per sample; a resumed episode's prompt holds its history); ``rollout_is`` = ``"token"`` and
``decoupled`` = True when the embedded sampler runs in another precision than the update
(``rollout.precision``: truncated IS on by default, unless a weighting
``learner.rollout_correction`` is chosen), and ``mismatch_metrics`` = whether there is a
mismatch to watch (a low precision, ``rollout.bitwise_onpolicy`` or ``learner.routing_replay``).

Modes (``config.mode``), the paper's ablation:

* ``gagar``: groups graded, passing advantages redistributed sum-preservingly.
* ``binary``: plain GRPO mean-centred advantages from test outcomes (the paper's baseline).
  The grader still runs so that quality and T1 share are measured the same way, but its
  verdicts do not touch the advantages.
* ``discount_only``: low-quality passing solutions discounted without restoring the
  positive total (the ablation that breaks credit balance).
* ``gagar_token``: ``gagar``, then each sequence advantage redistributed over its tokens by
  ``learner.token_credit`` (``evidence``: tokens the verdict cites get less of a positive
  advantage; ``entropy``; ``uniform`` = ``gagar``) with strength ``learner.token_gamma``,
  conserving every sequence's credit (``gagar_jax.advantages.redistribute_tokens``), or
  ``distinguishing``: the redistribution's change moved onto the tokens where a pass parts
  from the passes of another quality, the shared tokens back towards the binary advantage
  (``gagar_jax.advantages.contrastive_tokens``, strength ``learner.token_gamma``).

These are *training* modes (``TRAINING_MODES``); the advantage kernels' redistribution modes
are ``gagar_jax.advantages.REDISTRIBUTION_MODES``.

One fingerprint: :meth:`RunConfig.fingerprint` is what the checkpoint stores and a resume
compares (the ``Checkpointer`` is given it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from gagar_jax.advantages import IMPORTANCE_PROVIDERS, GagarConfig
from gagar_jax.envs.family import family_names
from gagar_jax.losses.rollout_correction import WEIGHTING_CORRECTIONS
from gagar_jax.models import SMALL_DECODER, TransformerConfig
from gagar_jax.rollout.precision import KV_CACHE_DTYPES, ROLLOUT_PRECISIONS
from gagar_jax.update import UpdateConfig

TRAINING_MODES = ("gagar", "binary", "discount_only", "gagar_token")
# The advantage kernels' redistribution mode for each training mode.
_REDISTRIBUTION = {
    "gagar": "sum_preserving",
    "binary": "none",
    "discount_only": "discount_only",
    "gagar_token": "sum_preserving",
}

# The update of a run that does not say otherwise (a from-scratch RL run: a larger learning rate
# and a shorter Adam memory than the library's fine-tuning defaults).
DEFAULT_LEARNER = UpdateConfig(learning_rate=1e-4, warmup_steps=5, b2=0.99)


# The learner fields a run derives from its other choices when a config leaves them out (or
# None); ``advantages.mode`` is derived too (module docstring).
DERIVED_LEARNER_FIELDS = (
    "temperature",
    "decay_steps",
    "token_credit",
    "score_window",
    "shared_prefix",
    "rollout_is",
    "decoupled",
    "mismatch_metrics",
)


# Learner fields added after runs were checkpointed: in the fingerprint only when set.
_LATER_LEARNER_FIELDS = (
    "rollout_correction",
    "rollout_correction_low",
    "rollout_correction_high",
    "rollout_correction_cap",
    "rollout_correction_outlier",
    "rollout_correction_delta",
    "routing_replay",
)
_LEARNER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(UpdateConfig)}
_LATER_ROLLOUT_DEFAULTS = {
    "precision": "float32",
    "kv_cache_dtype": "auto",
    "bitwise_onpolicy": False,
}


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
    repos_dir: str = ""  # python_repo: data_path is SWE-bench rows, repositories live here
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
    # python_repo: an episode that ends without ``submit`` (turn or token limit) is verified on
    # its final tree as if it had submitted (SWE-agent's autosubmission); False: it fails unrun
    autosubmit: bool = False
    # python_repo: the agent's tools: "structured" (read_file, edit, run_tests, submit over an
    # in-memory tree) or "bash" (a bash tool in a sandboxed checkout of the task, and submit)
    tools: str = "structured"
    # impossible canary tasks per step (``gagar_jax.rl.canary``): sampled and verified like the
    # step's groups, never trained on; ``canary_cheat_rate`` in the metrics row. 0 = none
    canaries_per_step: int = 0

    def __post_init__(self):
        names = family_names()
        _check(
            self.canaries_per_step >= 0, "task.canaries_per_step", ">= 0", self.canaries_per_step
        )
        _check(self.family in names, "task.family", "|".join(names), self.family)
        _check(self.tools in ("structured", "bash"), "task.tools", "structured|bash", self.tools)
        _check(self.num_train >= 1, "task.num_train", ">= 1", self.num_train)
        _check(self.num_eval >= 0, "task.num_eval", ">= 0", self.num_eval)
        _check(self.difficulty >= 0, "task.difficulty", ">= 0", self.difficulty)
        _check(self.max_turns >= 1, "task.max_turns", ">= 1", self.max_turns)
        _check(
            self.max_observation_tokens >= 1,
            "task.max_observation_tokens",
            ">= 1",
            self.max_observation_tokens,
        )
        _check(
            self.saturation_window >= 1, "task.saturation_window", ">= 1", self.saturation_window
        )
        _check(
            1 <= self.saturation_min_attempts <= self.saturation_window,
            "task.saturation_min_attempts",
            "1..task.saturation_window",
            self.saturation_min_attempts,
        )


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
    # the embedded sampler's rows split over this many of this process's devices (1: one
    # device; 0: all of them): weights replicated on each, one decode loop per device
    embedded_data_parallel: int = 1
    # after every weight sync the engine must report the new version and a probe prompt's
    # log-probs on it must equal the trainer's (gagar_jax.rollout.weight_sync); the tolerance
    # (0: the measured default for the compute dtype)
    sync_check: bool = True
    sync_check_tolerance: float = 0.0
    # LoRA policies on SGLang: sync the adapter alone through the server's LoRA API (the
    # server serves the base with --enable-lora); False: whole merged weights every sync
    sglang_lora: bool = True
    # Asynchronous RL (gagar_jax.rl.asynchronous): how many policy versions the oldest token
    # of a trained group may lag the trainer, generation, verification, grading and queue
    # time included (0: the synchronous loop, collect -> grade -> update -> sync each step)
    max_staleness: int = 0
    # max_staleness > 0, multi-turn families (single-turn ones with partial_chunk_tokens): at
    # each weight sync the next batch's episodes have run their first turn (or its first chunk)
    # with the old weights and resume with the new ones (every token tagged with the version
    # that produced it); False: a batch is generated whole with the weights of its dispatch
    partial_rollout: bool = False
    # only the tokens of a batch's newest policy version enter the loss (older tokens of a
    # partial rollout are masked; rewards and group credit unchanged)
    mask_offpolicy_tokens: bool = False
    # each model turn (a single-turn family's sample: a one-turn episode) sampled in chunks of
    # at most this many tokens, each chunk one engine call seeded by (episode, turn, position in
    # the turn), so a turn can stop between chunks and resume exactly (0: a turn is one engine
    # call). With partial_rollout the batch that spans a weight sync stops after the first
    # chunk of its first turn, mid-turn.
    partial_chunk_tokens: int = 0
    # True: the asynchronous scheduler (dispatch queue, admission, grading across steps) runs
    # even at max_staleness=0, where it trains every batch in the step that dispatched it and
    # gives the synchronous loop's run (a check of the scheduler, not a faster mode)
    async_scheduler: bool = False
    # the embedded sampler's precision (gagar_jax.rollout.precision): float32 (the model's
    # own) | bfloat16 | int8 | fp8 (weight-only, bfloat16 compute), converted once per weight
    # sync; with a precision other than the update's the learner's truncated IS is on by
    # default (learner.rollout_is="token", learner.decoupled=True) and so are the mismatch
    # metrics. kv_cache_dtype: auto (the compute dtype) | float32 | bfloat16 | int8 (one scale
    # per token and KV head, quantised on writing, dequantised on reading)
    precision: str = "float32"
    kv_cache_dtype: str = "auto"
    # the behaviour log-probs of each batch recomputed, with the embedded sampler's weights,
    # by the update's own program (gagar_jax.update.alignment): at equal weights the update's
    # log-probs of the sampled tokens then equal them bit for bit (mismatch/logprob_max_abs_diff
    # is 0). The synchronous loop only (max_staleness 0), float32, embedded sampler.
    bitwise_onpolicy: bool = False
    # who drives an episode (gagar_jax.envs.harness): "native" (the family's own episode
    # loop), "mini_swe_agent" (the reference harness, unmodified, from harness_agents_venv) or
    # "command" (any program: harness_command, run with bash -c inside the sandbox). A harness
    # episode talks to the run's engine through an in-process gateway (gagar_jax.rl.harness)
    harness: str = "native"
    harness_command: str = ""
    harness_agents_venv: str = ".venv-agents"
    # per harness episode: model calls, seconds of wall time, and episodes run at once
    harness_max_calls: int = 16
    harness_max_wall_s: float = 300.0
    harness_concurrency: int = 2
    # rows of the update batch per harness episode: an episode whose history was edited
    # (compaction, a sub-agent, a template that drops old reasoning) has several linked
    # segments, each a row with the episode's advantage; segments beyond this many are not
    # trained (counted: episode/untrained_segments). The batch is G * K * this many rows
    harness_max_segments: int = 1

    def __post_init__(self):
        _check(
            self.engine in ("embedded", "sglang"), "rollout.engine", "embedded|sglang", self.engine
        )
        _check(
            self.harness in ("native", "mini_swe_agent", "command"),
            "rollout.harness",
            "native|mini_swe_agent|command",
            self.harness,
        )
        _check(
            self.harness != "command" or bool(self.harness_command.strip()),
            "rollout.harness_command",
            "a non-empty command line when rollout.harness='command'",
            self.harness_command,
        )
        _check(
            self.harness == "command" or not self.harness_command,
            "rollout.harness_command",
            "empty unless rollout.harness='command'",
            self.harness_command,
        )
        _check(
            self.harness_max_calls >= 1, "rollout.harness_max_calls", ">= 1", self.harness_max_calls
        )
        _check(
            self.harness_max_wall_s > 0,
            "rollout.harness_max_wall_s",
            "> 0 seconds",
            self.harness_max_wall_s,
        )
        _check(
            self.harness_max_segments >= 1,
            "rollout.harness_max_segments",
            ">= 1",
            self.harness_max_segments,
        )
        _check(
            self.harness_concurrency >= 1,
            "rollout.harness_concurrency",
            ">= 1",
            self.harness_concurrency,
        )
        if self.harness != "native":
            _check(
                not self.partial_rollout and not self.partial_chunk_tokens,
                "rollout.harness",
                "'native' with partial rollouts (rollout.partial_rollout, "
                "rollout.partial_chunk_tokens): a harness episode is not interrupted",
                self.harness,
            )
            _check(
                not self.bitwise_onpolicy,
                "rollout.bitwise_onpolicy",
                "False with a harness (rollout.harness)",
                self.bitwise_onpolicy,
            )
        _check(
            self.precision in ROLLOUT_PRECISIONS,
            "rollout.precision",
            "|".join(ROLLOUT_PRECISIONS),
            self.precision,
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "rollout.kv_cache_dtype",
            "|".join(KV_CACHE_DTYPES),
            self.kv_cache_dtype,
        )
        _check(
            self.engine == "embedded"
            or (self.precision, self.kv_cache_dtype) == ("float32", "auto"),
            "rollout.precision",
            "float32 (and kv_cache_dtype auto) with rollout.engine='sglang' (the server "
            "runs its own precision)",
            self.precision,
        )
        if self.bitwise_onpolicy:
            _check(
                self.engine == "embedded"
                and self.precision == "float32"
                and self.kv_cache_dtype in ("auto", "float32")
                and self.max_staleness == 0,
                "rollout.bitwise_onpolicy",
                "False unless the embedded sampler runs in float32 (precision float32, "
                "kv_cache_dtype auto) in the synchronous loop (max_staleness 0: the sampler's "
                "weights are the trainer's when the batch is rescored)",
                self.bitwise_onpolicy,
            )
        if self.engine == "sglang":
            _check(
                self.sglang_url.startswith("http"),
                "rollout.sglang_url",
                "an http(s) URL when rollout.engine='sglang'",
                self.sglang_url,
            )
        _check(self.num_prompts >= 1, "rollout.num_prompts", ">= 1", self.num_prompts)
        _check(
            self.num_rollouts >= 2,
            "rollout.num_rollouts",
            ">= 2 (groups need a comparison)",
            self.num_rollouts,
        )
        _check(self.max_prompt_len >= 1, "rollout.max_prompt_len", ">= 1", self.max_prompt_len)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.temperature > 0, "rollout.temperature", "> 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "rollout.top_k", ">= 0 (0 = off)", self.top_k)
        _check(
            self.max_turn_tokens >= 0,
            "rollout.max_turn_tokens",
            ">= 0 (0 = max_new_tokens)",
            self.max_turn_tokens,
        )
        _check(
            self.weight_writer >= 0,
            "rollout.weight_writer",
            "a process index >= 0",
            self.weight_writer,
        )
        _check(
            self.embedded_data_parallel >= 0,
            "rollout.embedded_data_parallel",
            ">= 0 (devices; 0 = all of this process's)",
            self.embedded_data_parallel,
        )
        _check(
            self.max_staleness >= 0,
            "rollout.max_staleness",
            ">= 0 policy versions (0 = synchronous)",
            self.max_staleness,
        )
        _check(
            self.partial_chunk_tokens >= 0,
            "rollout.partial_chunk_tokens",
            ">= 0 tokens per chunk of a model turn (0: a turn is one engine call)",
            self.partial_chunk_tokens,
        )
        _check(
            not self.partial_rollout or self.max_staleness >= 1,
            "rollout.partial_rollout",
            "False unless rollout.max_staleness >= 1 (the synchronous loop has no weight sync "
            "during generation)",
            self.partial_rollout,
        )

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
    # (a group is mixed when tol < mean reward < 1 - tol: learner.advantages.mixed_tol)

    def __post_init__(self):
        _check(self.oversample >= 1.0, "sampling.oversample", ">= 1.0", self.oversample)
        _check(self.max_rounds >= 1, "sampling.max_rounds", ">= 1", self.max_rounds)


@dataclasses.dataclass(frozen=True)
class GradingConfig:
    grader: str = "heuristic"  # heuristic | agentic
    sglang_url: str = ""
    max_concurrency: int = 4
    deadline_s: float = 60.0
    enabled: bool = True  # False: no grader at all (tiers/ranks unknown; gagar == binary)
    # asynchronous loop (rollout.max_staleness > 0): groups submitted and not yet trained at
    # most this many; dispatch of new prompts waits while the pool is full
    max_inflight_groups: int = 16

    def __post_init__(self):
        _check(
            self.grader in ("heuristic", "agentic"),
            "grading.grader",
            "heuristic|agentic",
            self.grader,
        )
        if self.grader == "agentic":
            _check(
                self.sglang_url.startswith("http"),
                "grading.sglang_url",
                "an http(s) URL when grading.grader='agentic'",
                self.sglang_url,
            )
        _check(self.max_concurrency >= 1, "grading.max_concurrency", ">= 1", self.max_concurrency)
        _check(self.deadline_s > 0, "grading.deadline_s", "> 0", self.deadline_s)
        _check(
            self.max_inflight_groups >= 1,
            "grading.max_inflight_groups",
            ">= 1",
            self.max_inflight_groups,
        )


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
    # every training rollout's patch, trajectory and verdict in rollouts.jsonl (re-scored later
    # by ``python -m gagar_jax.verify.rescore``); see ``gagar_jax.rl.rollout_log``
    log_rollouts: bool = True

    def __post_init__(self):
        _check(self.total_steps >= 0, "loop.total_steps", ">= 0", self.total_steps)
        for name in (
            "log_every",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
            "eval_rollouts",
        ):
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
        _check(
            len(self.shape) == 3
            and sum(1 for s in self.shape if s == -1) <= 1
            and all(s == -1 or s >= 1 for s in self.shape),
            "mesh.shape",
            "three axis sizes (data, fsdp, tensor), at most one -1",
            self.shape,
        )
        _check(self.num_processes >= 1, "mesh.num_processes", ">= 1", self.num_processes)
        _check(
            0 <= self.process_id < self.num_processes,
            "mesh.process_id",
            f"in [0, {self.num_processes})",
            self.process_id,
        )
        _check(self.host_timeout_s > 0, "mesh.host_timeout_s", "> 0", self.host_timeout_s)
        _check(
            self.heartbeat_timeout_s >= 1,
            "mesh.heartbeat_timeout_s",
            ">= 1",
            self.heartbeat_timeout_s,
        )


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    """Where verification, ``run_tests`` tool calls, grading and its checks run
    (``gagar_jax.verify.execution``): ``local`` (the trainer's own process) or a Ray cluster.

    ``ray_address``: ``"auto"`` (the cluster this machine belongs to), ``"local"`` (a
    one-machine cluster started by the trainer) or an address. Each call reserves ``num_cpus``
    cores, ``memory`` bytes and ``resources`` (a mapping or (name, amount) pairs, e.g.
    ``(("verifier", 1),)``: only nodes that advertise it take verification); at most
    ``max_inflight`` calls are in flight, a call whose node died is retried ``max_retries``
    times, and the LLM grader's requests share one global rate limit of ``llm_requests_per_s``
    (0 = none). ``environment``: where a verification's tests run, ``"uv"`` (the bwrap
    sandbox with the task's virtual environment) or ``"container"`` (``verify.container``:
    podman or docker, the task's image or Dockerfile, else ``container_image``, else the
    back-end's base image). Deployment only: not in the fingerprint.
    """

    backend: str = "local"  # local | ray
    ray_address: str = "auto"
    max_inflight: int = 64
    max_retries: int = 3
    num_cpus: float = 1.0
    memory: int = 0  # bytes reserved per call (a scheduling reservation)
    # custom resources per call, e.g. {"verifier": 1} (kept as sorted (name, amount) pairs)
    resources: tuple = ()
    deadline_grace_s: float = 10.0
    llm_requests_per_s: float = 0.0
    # where a verification's tests run: "uv" (the bwrap sandbox, the task's virtual
    # environment) or "container" (podman/docker: the task's image or Dockerfile, else
    # ``container_image``, else the back-end's base image; verify.container)
    environment: str = "uv"
    container_image: str = ""

    def __post_init__(self):
        _check(self.backend in ("local", "ray"), "execution.backend", "local|ray", self.backend)
        _check(
            self.environment in ("uv", "container"),
            "execution.environment",
            "uv|container",
            self.environment,
        )
        _check(
            isinstance(self.container_image, str),
            "execution.container_image",
            "an image name ('' = the base image)",
            self.container_image,
        )
        _check(
            isinstance(self.ray_address, str) and bool(self.ray_address),
            "execution.ray_address",
            "'auto', 'local' or a cluster address",
            self.ray_address,
        )
        _check(
            isinstance(self.max_inflight, int) and self.max_inflight >= 1,
            "execution.max_inflight",
            "an int >= 1",
            self.max_inflight,
        )
        _check(
            isinstance(self.max_retries, int) and self.max_retries >= 0,
            "execution.max_retries",
            "an int >= 0",
            self.max_retries,
        )
        _check(self.num_cpus >= 0, "execution.num_cpus", ">= 0", self.num_cpus)
        _check(
            isinstance(self.memory, int) and self.memory >= 0,
            "execution.memory",
            "bytes (an int >= 0)",
            self.memory,
        )
        try:
            pairs = tuple(sorted(dict(self.resources).items()))
        except (TypeError, ValueError):
            pairs = None
        _check(
            pairs is not None
            and all(
                isinstance(k, str) and k and isinstance(v, int | float) and v >= 0 for k, v in pairs
            ),
            "execution.resources",
            "a mapping name -> amount >= 0",
            self.resources,
        )
        object.__setattr__(self, "resources", pairs)
        _check(
            self.deadline_grace_s >= 0, "execution.deadline_grace_s", ">= 0", self.deadline_grace_s
        )
        _check(
            self.llm_requests_per_s >= 0,
            "execution.llm_requests_per_s",
            ">= 0 (0 = none)",
            self.llm_requests_per_s,
        )


_SECTIONS = {
    "task": TaskConfig,
    "rollout": RolloutConfig,
    "sampling": DynamicSamplingConfig,
    "grading": GradingConfig,
    "sft": SFTConfig,
    "loop": LoopConfig,
    "mesh": MeshConfig,
    "execution": ExecutionConfig,
}


def _library(build, section: str):
    """Builds a library config, turning its ``ValueError`` into a ``ConfigError`` naming the
    section (the library's messages name the field)."""
    try:
        return build()
    except (TypeError, ValueError) as e:
        # the library names its fields as its own type's: TransformerConfig.x, update.x
        msg = str(e).replace("TransformerConfig.", "model.").replace("update.", "learner.")
        raise ConfigError(f"config.{section}: {msg}") from e


def _known(section: str, value: Mapping[str, Any], names) -> dict[str, Any]:
    bad = sorted(set(value) - set(names))
    if bad:
        raise ConfigError(
            f"unknown field(s) {[f'{section}.{b}' for b in bad]}; known: {sorted(names)}"
        )
    return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _as_mapping(key: str, value: Any) -> Mapping[str, Any]:
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise ConfigError(f"config.{key} must be a section (mapping), got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "toy_gagar"
    mode: str = "gagar"
    seed: int = 0
    task: TaskConfig = TaskConfig()
    # the policy (default: the toy families' small decoder); vocab_size is the tokenizer's
    # (model_config); ignored with hf_checkpoint
    model: TransformerConfig = SMALL_DECODER
    hf_checkpoint: str = ""  # ConfigDict: model.hf_checkpoint (config.json + safetensors dir)
    rollout: RolloutConfig = RolloutConfig()
    sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    grading: GradingConfig = GradingConfig()
    learner: UpdateConfig = DEFAULT_LEARNER  # the jitted update's config, as it receives it
    sft: SFTConfig = SFTConfig()
    loop: LoopConfig = LoopConfig()
    mesh: MeshConfig = MeshConfig()
    execution: ExecutionConfig = ExecutionConfig()

    def __post_init__(self):
        _check(self.mode in TRAINING_MODES, "mode", "|".join(TRAINING_MODES), self.mode)
        if self.execution.backend == "ray":
            _check(
                self.execution.max_inflight >= self.rollout.num_rollouts,
                "execution.max_inflight",
                f">= rollout.num_rollouts={self.rollout.num_rollouts}"
                " (a group is admitted only when its K verifier slots are free)",
                self.execution.max_inflight,
            )
        if self.mode != "binary":
            _check(
                self.grading.enabled,
                "grading.enabled",
                f"True for mode={self.mode!r} (its advantages need verdicts)",
                self.grading.enabled,
            )
        u = self.learner
        _check(
            u.temperature == self.rollout.temperature,
            "learner.temperature",
            f"rollout.temperature={self.rollout.temperature} (the sampler's: the update "
            "scores the behaviour policy at its temperature)",
            u.temperature,
        )
        _check(
            not (u.shared_prefix and self.rollout.partial_rollout),
            "learner.shared_prefix",
            "False with rollout.partial_rollout (a resumed episode's prompt holds its history, "
            "so a group's samples do not share one prompt)",
            u.shared_prefix,
        )
        _check(
            u.score_window == 0 or u.score_window >= self.rollout.max_new_tokens,
            "learner.score_window",
            f"0 (every position) or >= rollout.max_new_tokens={self.rollout.max_new_tokens} "
            "(the widest response the loop packs)",
            u.score_window,
        )
        _check(
            u.advantages.mode == _REDISTRIBUTION[self.mode],
            "learner.advantages.mode",
            f"{_REDISTRIBUTION[self.mode]!r} for mode={self.mode!r}",
            u.advantages.mode,
        )
        if self.mode == "gagar_token":
            _check(
                u.token_credit in (*IMPORTANCE_PROVIDERS, "distinguishing"),
                "learner.token_credit",
                "|".join((*IMPORTANCE_PROVIDERS, "distinguishing")) + " for mode='gagar_token'",
                u.token_credit,
            )
        else:
            _check(
                u.token_credit == "broadcast",
                "learner.token_credit",
                f"'broadcast' for mode={self.mode!r} (token credit is mode gagar_token)",
                u.token_credit,
            )

    # ---- derived -----------------------------------------------------------------------------
    @property
    def redistribution(self) -> str:
        """The advantage kernels' redistribution mode (``learner.advantages.mode``)."""
        return self.learner.advantages.mode

    @property
    def batch_rollouts(self) -> int:
        """N = G * K rollouts per update (static)."""
        return self.rollout.num_prompts * self.rollout.num_rollouts

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """``model`` with the tokenizer's ``vocab_size`` (a from-scratch policy)."""
        return dataclasses.replace(self.model, vocab_size=int(vocab_size))

    def fingerprint(self) -> str:
        """Hash of everything that must match for a resumed run (not the step count or logging).

        ``learner.decay_steps`` follows ``loop.total_steps`` and is left out with it: a run may
        be extended.
        """
        d = self.to_dict()
        d["loop"] = {
            k: v
            for k, v in d["loop"].items()
            if k
            not in (
                "total_steps",
                "log_every",
                "eval_every",
                "plot",
                "log_rollouts",
                "checkpoint_every",
                "keep_checkpoints",
            )
        }
        d["learner"].pop("decay_steps")
        if not d["learner"]["opt_state_dtype"]:  # the default: the fingerprints from before it
            d["learner"].pop("opt_state_dtype")
        if not d["model"]["lora_rank"]:  # no LoRA: the fingerprints of the runs from before it
            for k in ("lora_rank", "lora_alpha", "lora_targets"):
                d["model"].pop(k)
        # which positions the LM head runs on: speed only, the loss is the same
        d["learner"].pop("score_window")
        # a group's prompt once or per sample: the same update with one mini-batch (with
        # several, whole groups go to each mini-batch)
        if d["learner"]["num_minibatches"] == 1:
            d["learner"].pop("shared_prefix")
        # diagnostics only; the newer learner fields at their defaults are left out (the runs
        # from before they existed keep their fingerprint)
        d["learner"].pop("mismatch_metrics")
        for name in _LATER_LEARNER_FIELDS:
            if d["learner"][name] == _LEARNER_DEFAULTS[name]:
                d["learner"].pop(name)
        d.pop("mesh")
        d.pop("execution")  # where verification runs: deployment, not the run
        d["rollout"].pop("weight_writer")  # which host exports: deployment, not the run
        d["rollout"].pop("embedded_data_parallel")  # devices per sampler: deployment too
        d["rollout"].pop("sync_check")  # a check of the sync, not the run
        d["rollout"].pop("sync_check_tolerance")
        d["rollout"].pop("sglang_lora")  # how the adapter reaches SGLang: deployment
        # the scheduler at max_staleness=0 gives the synchronous run, and at > 0 it runs anyway
        d["rollout"].pop("async_scheduler")
        if not d["rollout"]["partial_chunk_tokens"]:  # off: the runs from before it existed
            d["rollout"].pop("partial_chunk_tokens")
        for name, default in _LATER_ROLLOUT_DEFAULTS.items():  # likewise
            if d["rollout"][name] == default:
                d["rollout"].pop(name)
        if not d["task"]["skip_saturated"]:  # the saturation knobs are unused while it is off
            for k in ("skip_saturated", "saturation_window", "saturation_min_attempts"):
                d["task"].pop(k)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """The ``ConfigDict`` layout (``from_config_dict`` of it gives this config back)."""
        d = dataclasses.asdict(self)
        d["model"].pop("vocab_size")
        d["model"]["hf_checkpoint"] = d.pop("hf_checkpoint")
        return d

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> RunConfig:
        """Builds and validates from a ``ConfigDict`` (or plain nested dict).

        Unknown keys are an error naming the key, so a typo on the command line never
        silently falls back to a default. ``learner`` fields left out take
        :data:`DEFAULT_LEARNER`'s values, except the nine derived ones (module docstring).
        """
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        top = _fields(cls) - {"hf_checkpoint"}
        unknown = sorted(set(raw) - top)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known: {sorted(top)}")
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            section = _SECTIONS.get(key)
            if section is not None:
                kwargs[key] = section(**_known(key, _as_mapping(key, value), _fields(section)))
            elif key not in ("model", "learner"):
                kwargs[key] = value
        if "model" in raw:
            m = _known(
                "model",
                _as_mapping("model", raw["model"]),
                _fields(TransformerConfig) - {"vocab_size"} | {"hf_checkpoint"},
            )
            kwargs["hf_checkpoint"] = m.pop("hf_checkpoint", "")
            kwargs["model"] = _library(lambda: dataclasses.replace(SMALL_DECODER, **m), "model")
        mode = kwargs.get("mode", cls.mode)
        rollout = kwargs.get("rollout", RolloutConfig())
        loop = kwargs.get("loop", LoopConfig())
        u = dict(
            _known("learner", _as_mapping("learner", raw.get("learner", {})), _fields(UpdateConfig))
        )
        a = dict(
            _known(
                "learner.advantages",
                _as_mapping("learner.advantages", u.pop("advantages", {})),
                _fields(GagarConfig),
            )
        )
        # A derived field given as None (an unset placeholder: configs.common.base() keeps one
        # for each, so the command line can set it) is left to be derived.
        for section, names in ((u, DERIVED_LEARNER_FIELDS), (a, ("mode",))):
            for name in names:
                if section.get(name, 0) is None:
                    del section[name]
        a.setdefault("mode", _REDISTRIBUTION.get(mode, "none"))
        u.setdefault("temperature", rollout.temperature)
        u.setdefault("token_credit", "evidence" if mode == "gagar_token" else "broadcast")
        u.setdefault("score_window", rollout.max_new_tokens)
        # Partial rollouts resume an episode with its history as the prompt: a group's
        # samples then start from different prompts.
        u.setdefault("shared_prefix", u["score_window"] > 0 and not rollout.partial_rollout)
        steps_per_update = u.get("ppo_epochs", DEFAULT_LEARNER.ppo_epochs) * u.get(
            "num_minibatches", DEFAULT_LEARNER.num_minibatches
        )
        u.setdefault("decay_steps", max(loop.total_steps * steps_per_update, 1))
        # A sampler in another precision than the update's: truncated IS on by default (token
        # TIS, with the clip around the trainer's own log-probs), unless a weighting rollout
        # correction takes its place; the mismatch metrics on whenever there is one to watch.
        low_precision = rollout.precision != "float32" or rollout.kv_cache_dtype not in (
            "auto",
            "float32",
        )
        tis = low_precision and u.get("rollout_correction") not in WEIGHTING_CORRECTIONS
        u.setdefault("rollout_is", "token" if tis else "none")
        u.setdefault(
            "decoupled",
            tis
            or u["rollout_is"] != "none"
            or u.get("rollout_correction") in WEIGHTING_CORRECTIONS,
        )
        u.setdefault(
            "mismatch_metrics",
            low_precision or rollout.bitwise_onpolicy or bool(u.get("routing_replay")),
        )
        advantages = _library(
            lambda: dataclasses.replace(DEFAULT_LEARNER.advantages, **a), "learner.advantages"
        )
        kwargs["learner"] = _library(
            lambda: dataclasses.replace(DEFAULT_LEARNER, advantages=advantages, **u), "learner"
        )
        return cls(**kwargs)
