"""Feedback training on the toy family: base policy, simulated-user data, the loop, evaluation.

``train_feedback(cfg, workdir)`` runs (or resumes) one mode:

1. **Base** (shared by every mode and seed that names the same ``base.dir``): a policy
   warm-started by SFT on demonstrations of every passing kind (``gagar_jax.update.sft``), its
   samples on the training tasks, and the rule-based simulated user's feedback on each
   (``gagar_jax.envs.simulated_user``), written as ``feedback.jsonl`` (``gagar_jax.data.feedback``
   records) next to ``base_params/`` (an orbax checkpoint of the policy's parameters).
   Built once; later runs load it, so all modes train on
   the same feedback data from the same starting point. ``data.jsonl`` replaces the simulated
   data with a file of real feedback.
2. **Train**: ``loop.steps`` optimizer steps of ``objective.mode``
   (:mod:`gagar_jax.feedback.step`) on batches drawn by a seeded per-epoch permutation of the
   records (the batch of step ``s`` is a pure function of ``(seed, s)``: resuming needs only the
   step); checkpoints of the whole ``FeedbackTrainState`` (with the frozen reference and
   ``z_ref``) through the policy package's ``Checkpointer``; metrics through ``MetricsWriter``.
3. **Evaluate** held-out tasks with the embedded sampler: pass rate, quality of passing patches,
   cheat rate, and ``eval_negative_rate`` (share of patches the simulated user gives any negative
   feedback: the process-level measure the paper's Span-KTO claim is about).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gagar_jax.analysis import writers
from gagar_jax.data.feedback import (
    FeedbackRecord,
    derive_spans,
    pack_examples,
    read_jsonl,
    write_jsonl,
)
from gagar_jax.envs import verify
from gagar_jax.envs.family import FamilySettings
from gagar_jax.envs.llm_user import LLMUser
from gagar_jax.envs.simulated_user import feedback_record, user_feedback
from gagar_jax.envs.toy_family import ToyFamily, quality_score
from gagar_jax.feedback import step as fstep
from gagar_jax.feedback.step import FeedbackObjective
from gagar_jax.models import SMALL_DECODER, Transformer, TransformerConfig, model_from_params
from gagar_jax.rollout import SamplingParams, SGLangClient
from gagar_jax.rollout.sampler import Sampler
from gagar_jax.update import UpdateConfig, make_mesh, sft
from gagar_jax.update.checkpoint import Checkpointer

# The optimiser of a feedback run that does not say otherwise (``decay_steps`` follows
# ``loop.steps`` unless a config sets it).
DEFAULT_LEARNER = UpdateConfig(learning_rate=1e-4, b2=0.99)


class FeedbackConfigError(ValueError):
    pass


def _section(cls, name: str, mapping: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(mapping) - names)
    if unknown:
        raise FeedbackConfigError(
            f"config.{name}: unknown keys {unknown}; expected some of {sorted(names)}"
        )
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in mapping:
            v = mapping[f.name]
            kw[f.name] = tuple(v) if isinstance(v, list | tuple) else v
    return cls(**kw)


@dataclasses.dataclass(frozen=True)
class TaskSection:
    difficulty: int = 1
    seed: int = 0
    num_train: int = 64
    num_eval: int = 32

    def __post_init__(self):
        if self.difficulty not in (1, 2, 3):
            raise FeedbackConfigError(
                f"config.task.difficulty must be 1|2|3, got {self.difficulty!r}"
            )
        if self.num_train < 1 or self.num_eval < 0:
            raise FeedbackConfigError("config.task.num_train must be >= 1 and num_eval >= 0")


@dataclasses.dataclass(frozen=True)
class BaseSection:
    dir: str = ""  # '' -> <workdir>/base
    sft_steps: int = 200
    sft_lr: float = 3e-3
    sft_batch_size: int = 32
    sft_warmup_steps: int = 10
    samples_per_task: int = 4
    temperature: float = 1.0
    max_prompt_len: int = 48
    max_new_tokens: int = 32


@dataclasses.dataclass(frozen=True)
class DataSection:
    jsonl: str = ""  # '' -> the simulated user's feedback on the base policy's samples
    max_spans: int = 16
    uncovered: str = "neutral"


@dataclasses.dataclass(frozen=True)
class FeedbackSection:
    """Who gives the simulated feedback: ``rule`` (default) or ``llm`` (a chat model).

    ``llm``: ``gagar_jax.envs.llm_user.LLMUser`` through ``SGLangClient(sglang_url)``; a rejected
    answer is re-asked (``max_attempts`` in all), then the rule-based user answers; its counters
    (``fallback``, ``rejected_<reason>``) go to the base's ``base.json`` stats.
    """

    user: str = "rule"
    sglang_url: str = ""
    max_attempts: int = 2
    max_tokens: int = 512
    temperature: float = 0.0
    request_timeout_s: float = 120.0
    prompt_version: str = "v1"

    def __post_init__(self):
        if self.user not in ("rule", "llm"):
            raise FeedbackConfigError(f"config.feedback.user must be rule|llm, got {self.user!r}")
        if self.user == "llm" and not str(self.sglang_url).startswith(("http://", "https://")):
            raise FeedbackConfigError(
                "config.feedback.sglang_url must be an http(s) URL when feedback.user = 'llm', "
                f"got {self.sglang_url!r}"
            )
        if self.max_attempts < 1:
            raise FeedbackConfigError(
                f"config.feedback.max_attempts must be >= 1, got {self.max_attempts!r}"
            )

    def make_user(self, client=None):
        """The feedback callable for ``feedback_record(user=...)``: None = the rule-based user."""
        if self.user == "rule":
            return None

        if client is None:
            client = SGLangClient(self.sglang_url, request_timeout_s=self.request_timeout_s)
        return LLMUser(
            client,
            max_attempts=self.max_attempts,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            prompt_version=self.prompt_version,
        )


@dataclasses.dataclass(frozen=True)
class LoopSection:
    steps: int = 60
    batch_size: int = 32
    log_every: int = 5
    eval_every: int = 20
    checkpoint_every: int = 20
    keep_checkpoints: int = 2
    eval_samples: int = 2
    eval_temperature: float = 0.7

    def __post_init__(self):
        for n in (
            "steps",
            "batch_size",
            "log_every",
            "eval_every",
            "checkpoint_every",
            "keep_checkpoints",
            "eval_samples",
        ):
            if getattr(self, n) < 1:
                raise FeedbackConfigError(f"config.loop.{n} must be >= 1, got {getattr(self, n)!r}")


@dataclasses.dataclass(frozen=True)
class FeedbackRunConfig:
    name: str = "feedback_toy"
    seed: int = 0
    mesh_shape: tuple[int, int, int] = (1, -1, 1)
    task: TaskSection = TaskSection()
    # the policy (gagar_jax.models.TransformerConfig; vocab_size from the tokenizer); by default
    # the RL loop's, the toy families' small decoder
    model: TransformerConfig = SMALL_DECODER
    base: BaseSection = BaseSection()
    data: DataSection = DataSection()
    feedback: FeedbackSection = FeedbackSection()
    objective: FeedbackObjective = FeedbackObjective()
    # the optimiser (gagar_jax.update.UpdateConfig)
    learner: UpdateConfig = DEFAULT_LEARNER
    loop: LoopSection = LoopSection()

    @classmethod
    def from_config_dict(cls, c: Mapping[str, Any]) -> FeedbackRunConfig:
        """Builds and validates from a ``ConfigDict`` (or nested dict); unknown keys are an
        error naming them. ``model`` fields left out take ``models.SMALL_DECODER``'s values,
        ``learner`` fields :data:`DEFAULT_LEARNER`'s, with ``learner.decay_steps`` =
        ``loop.steps`` unless given."""
        c = dict(c.to_dict() if hasattr(c, "to_dict") else c)
        sections = {
            "task": TaskSection,
            "base": BaseSection,
            "data": DataSection,
            "feedback": FeedbackSection,
            "objective": FeedbackObjective,
            "loop": LoopSection,
        }
        library = {
            "model": lambda m: dataclasses.replace(SMALL_DECODER, **m),
            "learner": lambda u: dataclasses.replace(DEFAULT_LEARNER, **u),
        }
        library_types = {"model": TransformerConfig, "learner": UpdateConfig}
        top = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(c) - top)
        if unknown:
            raise FeedbackConfigError(f"config: unknown keys {unknown}")
        kw: dict[str, Any] = {}
        for k, v in c.items():
            if k in sections:
                try:
                    kw[k] = _section(sections[k], k, dict(v))
                except ValueError as e:
                    raise FeedbackConfigError(str(e)) from e
            elif k in library:
                fields = {f.name for f in dataclasses.fields(library_types[k])} - {"vocab_size"}
                v = dict(v)
                unknown = sorted(set(v) - fields)
                if unknown:
                    raise FeedbackConfigError(
                        f"config.{k}: unknown keys {unknown}; expected some of {sorted(fields)}"
                    )
                v = {n: tuple(x) if isinstance(x, list) else x for n, x in v.items()}
                if k == "learner":
                    loop = kw.get("loop") or _section(LoopSection, "loop", dict(c.get("loop", {})))
                    v.setdefault("decay_steps", max(loop.steps, 1))
                    if isinstance(v.get("advantages"), Mapping):  # unused here; kept valid
                        a = {
                            n: tuple(x) if isinstance(x, list) else x
                            for n, x in v["advantages"].items()
                        }
                        v["advantages"] = dataclasses.replace(DEFAULT_LEARNER.advantages, **a)
                try:
                    kw[k] = library[k](v)
                except (TypeError, ValueError) as e:
                    raise FeedbackConfigError(f"config.{k}: {e}") from e
            elif k == "mesh_shape":
                kw[k] = tuple(int(x) for x in v)
            else:
                kw[k] = v
        if "learner" not in kw:
            steps = kw.get("loop", LoopSection()).steps
            kw["learner"] = dataclasses.replace(DEFAULT_LEARNER, decay_steps=max(steps, 1))
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The ``ConfigDict`` layout (``from_config_dict`` of it gives this config back)."""
        d = dataclasses.asdict(self)
        d["model"].pop("vocab_size")
        return d

    def base_fingerprint(self) -> str:
        """What the shared base depends on (not the mode, objective, optimiser or loop)."""
        d = {k: dataclasses.asdict(getattr(self, k)) for k in ("task", "model", "base")}
        d["model"].pop("vocab_size")
        d["base"].pop("dir")
        if self.feedback.user != "rule":  # the rule-based user reads none of these fields
            d["feedback"] = {
                k: v
                for k, v in dataclasses.asdict(self.feedback).items()
                if k != "request_timeout_s"
            }
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """``model`` with the tokenizer's ``vocab_size``."""
        return dataclasses.replace(self.model, vocab_size=int(vocab_size))

    def update_config(self) -> UpdateConfig:
        """The update library's config of this run (``learner``)."""
        return self.learner

    @property
    def seq_len(self) -> int:
        return self.base.max_prompt_len + self.base.max_new_tokens


@dataclasses.dataclass(frozen=True)
class _Fingerprinted:
    """What a feedback checkpoint's state depends on (``Checkpointer`` hashes it)."""

    objective: FeedbackObjective
    update: Any
    data: str


# ------------------------------------------------------------------------------------------
# Params I/O, tasks, sampling
# ------------------------------------------------------------------------------------------
def save_params(path: str, params: dict) -> None:
    """Writes the base policy's parameters as an orbax checkpoint at ``path`` (the RL loop's
    checkpoint library; orbax writes to a temporary directory and renames it when complete)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), jax.device_get(params), force=True)


def load_params(path: str, like: dict) -> dict:
    """Reads :func:`save_params`' checkpoint into the structure, shapes and dtypes of ``like``."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), like)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(path), abstract)


def _pool(cfg: FeedbackRunConfig):
    """The ``toy`` task family (``gagar_jax.envs``): tasks, held-out set, prompts, demos."""

    t = cfg.task
    return ToyFamily(
        FamilySettings(
            seed=t.seed,
            difficulty=t.difficulty,
            num_train=t.num_train,
            num_eval=t.num_eval,
            max_prompt_len=cfg.base.max_prompt_len,
        )
    )


def _sample(sampler, pool, tasks, *, n: int, temperature: float, max_tokens: int, seed: int):

    prompts = [pool.prompt_tokens(t) for t in tasks]
    per_call = max(1, 128 // n)  # rows per call stay within one sampler batch bucket
    out = []
    for c in range(0, len(prompts), per_call):
        out += sampler.generate(
            prompts[c : c + per_call],
            SamplingParams(
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                stop_token_ids=(pool.tokenizer.eos_id,),
                seed=seed + c,
            ),
        )
    return prompts, out


def evaluate(sampler, pool, cfg: FeedbackRunConfig, *, seed: int) -> dict[str, float]:
    """Held-out pass rate, quality, cheat rate, negative-feedback rate and response length."""

    tasks = pool.eval_tasks()
    if not tasks:
        return {}
    _, out = _sample(
        sampler,
        pool,
        tasks,
        n=cfg.loop.eval_samples,
        temperature=cfg.loop.eval_temperature,
        max_tokens=cfg.base.max_new_tokens,
        seed=seed,
    )
    n = passed = cheats = negative = length = 0
    quality = []
    for task, samples in zip(tasks, out):
        for s in samples:
            v = verify(task, pool.tokenizer.decode(s.tokens))
            n += 1
            length += len(s.tokens)
            cheats += bool(v.cheat)
            if v.passed and not v.cheat:
                passed += 1
                quality.append(quality_score(v.quality))
            fb = user_feedback(task, s.tokens, tokenizer=pool.tokenizer)
            negative += any(f["polarity"] == "negative" for f in fb)
    return {
        "eval_pass_rate": passed / n,
        "eval_cheat_rate": cheats / n,
        "eval_quality": float(np.mean(quality)) if quality else math.nan,
        "eval_negative_rate": negative / n,
        "eval_response_length": length / n,
    }


# ------------------------------------------------------------------------------------------
# Base: warm-started policy + simulated-user feedback data
# ------------------------------------------------------------------------------------------
def prepare_base(
    cfg: FeedbackRunConfig, base_dir: str, *, log=print, user_client=None
) -> dict[str, Any]:
    """Builds (or loads) the shared base; returns ``{params, jsonl, eval, stats}``.

    ``user_client``: the chat client of an ``llm`` feedback user (default: an ``SGLangClient``
    of ``feedback.sglang_url``; tests pass a scripted one).
    """
    from flax import nnx

    os.makedirs(base_dir, exist_ok=True)
    meta_path = os.path.join(base_dir, "base.json")
    params_path = os.path.join(base_dir, "base_params")
    jsonl = os.path.join(base_dir, "feedback.jsonl")
    pool = _pool(cfg)
    mc = cfg.model_config(pool.tokenizer.vocab_size)
    model = Transformer(mc, rngs=nnx.Rngs(cfg.task.seed))
    like = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        if meta["fingerprint"] != cfg.base_fingerprint():
            raise FeedbackConfigError(
                f"{base_dir} holds a base built with fingerprint {meta['fingerprint']}, this "
                f"config needs {cfg.base_fingerprint()}: use another base.dir"
            )
        return {
            "params": load_params(params_path, like),
            "jsonl": jsonl,
            "eval": meta["eval"],
            "stats": meta["stats"],
            "model_config": mc,
        }

    t0 = time.monotonic()
    demos = [
        d
        for d in pool.demonstrations(cfg.task.num_train)
        if d.response_len <= cfg.base.max_new_tokens
    ]  # never truncated: skipped
    b = cfg.base
    sft.run_sft(
        model,
        demos,
        steps=b.sft_steps,
        batch_size=b.sft_batch_size,
        lr=b.sft_lr,
        warmup_steps=b.sft_warmup_steps,
        seq_len=cfg.seq_len,
        pad_id=pool.tokenizer.pad_id,
        seed=cfg.task.seed,
    )
    log(
        f"base: SFT warm start {b.sft_steps} steps on {len(demos)} demonstrations "
        f"({time.monotonic() - t0:.0f}s)"
    )
    sampler = Sampler(model, pad_id=pool.tokenizer.pad_id, seed=cfg.task.seed)
    tasks = [pool.train_task(i) for i in range(cfg.task.num_train)]
    prompts, out = _sample(
        sampler,
        pool,
        tasks,
        n=b.samples_per_task,
        temperature=b.temperature,
        max_tokens=b.max_new_tokens,
        seed=cfg.task.seed + 17,
    )

    user = cfg.feedback.make_user(user_client)
    records, pol_counts = [], {"positive": 0, "neutral": 0, "negative": 0}
    for task, prompt, samples in zip(tasks, prompts, out):
        for j, s in enumerate(samples):
            rec = feedback_record(
                task,
                prompt,
                s.tokens,
                record_id=f"{task.task_id}/{j}",
                tokenizer=pool.tokenizer,
                user=user,
            )
            for it in rec["feedback"]:
                pol_counts[it["polarity"]] += 1
            records.append(FeedbackRecord.from_dict(rec))
    write_jsonl(jsonl, records)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    save_params(params_path, params)
    ev = evaluate(sampler, pool, cfg, seed=cfg.task.seed + 99)
    stats = {
        "records": len(records),
        "feedback_items": pol_counts,
        "passed_frac": float(np.mean([r.meta["passed"] for r in records])),
        "feedback_user": cfg.feedback.user,
    }
    if user is not None:
        stats["llm_user"] = dict(user.metrics)
    with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"fingerprint": cfg.base_fingerprint(), "eval": ev, "stats": stats}, f, indent=1)
    os.replace(meta_path + ".tmp", meta_path)
    log(
        f"base: {len(records)} feedback records {pol_counts}; held-out {ev} "
        f"({time.monotonic() - t0:.0f}s)"
    )
    return {"params": params, "jsonl": jsonl, "eval": ev, "stats": stats, "model_config": mc}


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------
def batch_indices(step: int, batch_size: int, num_records: int, seed: int) -> np.ndarray:
    """Record indices of step ``step``: consecutive slices of per-epoch seeded permutations."""
    start = step * batch_size
    idx = []
    while len(idx) < batch_size:
        epoch, offset = divmod(start + len(idx), num_records)
        perm = np.random.default_rng([seed, epoch]).permutation(num_records)
        take = min(batch_size - len(idx), num_records - offset)
        idx.extend(perm[offset : offset + take].tolist())
    return np.asarray(idx)


def train_feedback(cfg: FeedbackRunConfig, workdir: str, *, log=print) -> dict[str, Any]:
    """Runs (or resumes) one feedback-training run in ``workdir``; returns its summary."""

    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    base_dir = cfg.base.dir or os.path.join(workdir, "base")
    base = prepare_base(cfg, base_dir, log=log)
    pool = _pool(cfg)
    tok = pool.tokenizer
    jsonl = cfg.data.jsonl or base["jsonl"]
    records: list[FeedbackRecord] = read_jsonl(jsonl)
    examples, skipped = [], 0
    for r in records:
        ex = derive_spans(r, tok, uncovered=cfg.data.uncovered)
        if len(ex.tokens) > cfg.seq_len or len(ex.span_polarity) > cfg.data.max_spans:
            skipped += 1
            continue
        examples.append(ex)
    if not examples:
        raise ValueError(f"no usable feedback records in {jsonl}")
    mc = base["model_config"]
    uc = cfg.update_config()
    obj = cfg.objective
    mesh = make_mesh(cfg.mesh_shape)
    fp = _Fingerprinted(objective=obj, update=uc, data=os.path.abspath(jsonl))
    ck = Checkpointer(
        os.path.join(workdir, "checkpoints"),
        model_config=mc,
        update_config=fp,
        keep=cfg.loop.keep_checkpoints,
    )
    with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f, indent=1, sort_keys=True, default=str)
    start = 0
    if ck.latest_step() is not None:
        state, info = ck.restore(fstep.abstract_feedback_state(mc, uc, mesh))
        start = int(info.step)
        log(f"resumed {workdir} at step {start} (z_ref {float(state.z_ref):.4f})")
    else:
        state = fstep.create_feedback_state(mc, uc, mesh, base["params"])
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    writers.truncate_jsonl(metrics_path, keep_before_step=start)
    writer = writers.MetricsWriter(
        workdir,
        total_steps=cfg.loop.steps,
        start_step=start,
        tensorboard=False,
        primary=jax.process_index() == 0,
    )
    writer.log(
        f"{cfg.name}: mode {obj.mode}, {len(examples)} feedback records "
        f"({skipped} too long skipped), reference point {obj.reference_point}, "
        f"ref log-probs {obj.ref_logprobs}"
    )
    sampler = Sampler(
        model_from_params(mc, jax.device_get(base["params"])), pad_id=tok.pad_id, seed=cfg.seed
    )

    def pack(step):
        idx = batch_indices(step, cfg.loop.batch_size, len(examples), cfg.seed)
        return pack_examples(
            [examples[i] for i in idx],
            seq_len=cfg.seq_len,
            max_spans=cfg.data.max_spans,
            pad_id=tok.pad_id,
        )

    ref_fn = fstep.jit_ref_logprobs(mc, uc, mesh) if obj.ref_logprobs == "precomputed" else None

    def train_batch(fb):
        ref = None
        if ref_fn is not None and obj.needs_reference:
            ref = np.asarray(ref_fn(state.ref_params, fb.tokens, fb.positions, fb.attention_mask))
        return fstep.to_train_batch(fb, ref_logprobs=ref, with_kl=obj.needs_kl_pairs)

    example = train_batch(pack(start))
    step_fn = fstep.jit_feedback_step(mc, obj, uc, mesh, example)

    def run_eval(at):
        sampler.sync_weights(jax.device_get(state.params), at)
        m = evaluate(sampler, pool, cfg, seed=cfg.seed * 7919 + at)
        writer.write(at, m, phase="eval")
        writer.log(f"eval @ {at}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
        return m

    if start == 0:
        run_eval(0)
    writer.start_clock(start)
    t0 = time.monotonic()
    try:
        for s in range(start, cfg.loop.steps):
            state, m = step_fn(state, fstep.shard_train_batch(train_batch(pack(s)), mesh))
            if s % cfg.loop.log_every == 0 or s == cfg.loop.steps - 1:
                m = {k: float(v) for k, v in jax.device_get(m).items()}
                if not np.isfinite(m["loss"]):
                    raise FloatingPointError(f"non-finite loss {m['loss']} at feedback step {s}")
                writer.write(s, m)
                writer.progress(s, {"pg_loss_mean": m["loss"], **m})
            if (s + 1) % cfg.loop.eval_every == 0 or s == cfg.loop.steps - 1:
                run_eval(s + 1)
            if (s + 1) % cfg.loop.checkpoint_every == 0 or s == cfg.loop.steps - 1:
                ck.save(s + 1, state, data_position=s + 1, wait=True)
    finally:
        ck.close()
        writer.close()
    rows = writers.read_jsonl(metrics_path)
    evals = [r for r in rows if r.get("phase") == "eval"]
    summary = {
        "mode": obj.mode,
        "seed": cfg.seed,
        "steps": cfg.loop.steps,
        "train_time_s": time.monotonic() - t0,
        "base_eval": base["eval"],
        "final_eval": evals[-1] if evals else {},
        "records": len(examples),
        "compiles": step_fn._cache_size(),
    }
    with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary
