"""The whole RL step, raced: gagar_jax against TRL's ``GRPOTrainer`` and Tunix's ``GRPOLearner``.

    .venv/bin/python benchmarks/rl_step.py            # the ~5M model, two RL shapes, 5 rounds
    .venv/bin/python benchmarks/rl_step.py --quick    # a tiny model and tiny shapes (minutes)
    .venv/bin/python benchmarks/rl_step.py --check    # only the equal-configuration check

Each framework runs in its own worker process and virtual environment: gagar_jax in this one,
TRL in ``.venv-bench-trl`` and Tunix in ``.venv-bench-tunix``, both built by this script on first
use from the pinned registry versions in ``PINS`` (rebuilt when the pins change). On a CPU
machine gagar_jax races twice: on one device (``gagar_jax``), and with its rows split over two
host devices, one per core (``gagar_2dev``: the sampler's rows and the update's batch, as the
loop's ``rollout.embedded_data_parallel=2`` and ``mesh.shape=(2, 1, 1)`` split them). Nothing is
downloaded from a model hub: one random Qwen2-shaped model is written once as Hugging Face
safetensors with a byte-level BPE tokenizer trained locally (``runs/bench_rl_step/``), and every
framework loads that directory.

One RL step, the same work in all three:

- generate: ``prompts`` distinct prompts (the same text, the same token ids in every framework)
  x ``samples`` samples each, ``new`` new tokens at temperature 1 (no top-k / top-p), stopping
  at the tokenizer's EOS;
- score: one reward function on the decoded completion text (``reward``: 1 when the text has an
  even number of ``e``), so groups are mixed;
- advantages: mean-centred per group (no division by the standard deviation);
- loss: PPO-clip (epsilon 0.2 both sides) with the token mean over the batch, no KL term, no
  entropy bonus, on the sampling distribution (temperature 1);
- optimizer: one Adam step (learning rate 1e-6, no weight decay, global-norm clipping at 1.0,
  constant schedule) on all the step's sequences at once;
- sync: the new weights into the framework's generator (gagar_jax: the embedded sampler's copy;
  Tunix: its rollout model; TRL generates with the trained model itself: nothing to sync).

Timing: the workers wait for the driver between steps; the driver runs one step of every
framework per round (after a warm-up step each, which compiles), ``--rounds`` rounds, so a
change of the machine's load hits all of them alike. Each worker times its own step from its
start to its end and splits it into phases (generate, score, pack, update, sync) at the
framework's own function boundaries; medians over rounds are reported with the machine's load
average before and after. What could not be made equal is listed by ``--notes`` and in the docs
page ``docs/benchmarks_rl_step.md``.

The heap: by default each framework's worker runs as the framework sets up its process.
gagar_jax's worker calls ``gagar_jax.host_cpu.prepare_cpu_host`` as its trainer does, which on a
CPU keeps the memory glibc frees for reuse (``gagar_jax.update.malloc.keep_heap``: one arena, no
``mmap`` for large blocks, no trimming); TRL and Tunix run with glibc's defaults, under which the
large buffers a step frees are returned to the kernel and faulted in afresh the next step.
``--keep-heap`` gives every worker the kept heap (``GLIBC_TUNABLES``), ``--glibc-heap`` every
worker glibc's defaults (gagar_jax's with ``GAGAR_MALLOC_KEEP_HEAP=0``). Each step's page faults,
CPU seconds and context switches are printed below its table (``getrusage`` of the worker).

``--check`` starts every worker on the initial weights and compares, before any step, (1) the
log-probabilities each framework's own training-side scoring gives the first tokens of a fixed
completion of every prompt, (2) the advantages each framework's own code computes for a fixed
reward vector, and (3) the prompt token ids each framework's tokenisation produces; it fails
when they differ beyond float tolerance. The race runs the same check first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "bench_rl_step"

# The registry versions each framework's virtual environment is built from. torch is pinned to
# the CPU build (an unpinned torch pulls the CUDA one).
PINS = {
    "trl": [
        "trl==1.16.0",
        "torch==2.13.0",
        "transformers==5.24.0",
        "accelerate==1.15.0",
        "datasets==5.2.0",
    ],
    "tunix": ["google-tunix==0.1.7"],
}
VENVS = {"trl": ROOT / ".venv-bench-trl", "tunix": ROOT / ".venv-bench-tunix"}
FRAMEWORKS = ("gagar_jax", "gagar_2dev", "trl", "tunix")
# gagar_jax configured for a multi-core CPU: its rows split over host devices, one per core
# (the loop's ``rollout.embedded_data_parallel`` and ``mesh.shape``); CPU only.
HOST_DEVICES = {"gagar_2dev": 2}
PHASES = ("generate", "score", "pack", "update", "sync")

# Model: (vocab of the tokenizer, hidden, layers, heads, kv heads, intermediate); the vocab is
# the trained tokenizer's size.
MODELS = {
    "small": dict(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=4, intermediate=704),
    "tiny": dict(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
}
# RL shapes: prompts x samples, prompt tokens, new tokens.
SHAPES = {
    "rl": dict(prompts=8, samples=8, prompt_len=64, new=64),
    "multiturn": dict(prompts=8, samples=8, prompt_len=448, new=64),
    "quick-rl": dict(prompts=4, samples=4, prompt_len=16, new=16),
    "quick-multiturn": dict(prompts=4, samples=4, prompt_len=96, new=16),
}
LEARNING_RATE = 1e-6
EPSILON = 0.2
MAX_GRAD_NORM = 1.0
CHECK_COMPLETION = 4  # tokens of the fixed completion scored by --check
CHECK_REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.0, 1.0, 0.25, 0.0, 0.0, 0.0, 0.0]
CHECK_GROUP = 4  # CHECK_REWARDS as 4 groups of 4

NOTES = [
    "The allocator: each worker as its framework sets up its process: gagar_jax keeps the "
    "memory glibc frees for reuse (its trainer's prepare_cpu_host, on a CPU), TRL and Tunix "
    "run with glibc's defaults, which return a step's large freed buffers to the kernel (the "
    "per-step page faults are printed under each table). --keep-heap gives every worker the "
    "kept heap, --glibc-heap every worker glibc's defaults. The header line says which.",
    "TRL samples with transformers' generate on the trained model (no separate generator, so "
    "its sync phase is zero); gagar_jax samples with its embedded jitted sampler and syncs a "
    "copy of the weights into it; Tunix samples with its vanilla JAX sampler and syncs its "
    "rollout model.",
    "Random streams differ between frameworks, so the sampled tokens (and hence rewards and "
    "the rows stopped early by EOS) differ; the work per step is equal in expectation (EOS "
    "has probability ~1/vocab per token under the random model).",
    "Tunix is given the same Hugging Face tokenizer through its plain tokenizer protocol "
    "(encode/decode/ids): its learner repeats prompts as NumPy strings, which the "
    "transformers tokenizer it would wrap rejects.",
    "TRL's gradient checkpointing (on by default in GRPOConfig) is turned off: neither "
    "JAX side rematerialises at these sizes.",
    "TRL's phase boundaries: generate = GRPOTrainer._generate (prompt tokenisation, "
    "transformers generate, completion decoding), score = _calculate_rewards, pack = the rest "
    "of _generate_and_score_completions (padding, advantages), update = the rest of the "
    "step (forward/backward of the loss, clipping, AdamW).",
    "Tunix's phase boundaries: generate = the rollout worker's generate, score = the reward "
    "functions, pack = the rest of the learner's example preparation (tokens, masks, "
    "advantages), update = the actor's train step, sync = RLCluster.sync_weights.",
    "Prefill: gagar_jax prefills each distinct prompt once (8 prefill rows at 8 prompts x 8 "
    "samples) and its samples decode against that one KV cache (Sampler(shared_prefix=True), "
    "its default); TRL's generate and Tunix's vanilla sampler prefill every sample row (64) "
    "and decode each against its own cache. At the multiturn shape (a 448-token "
    "history) this is most of their generation FLOPs; it is each framework's own design, "
    "not a configuration choice.",
    "The multiturn shape is one generation call after a long history, the length a late turn "
    "of a multi-turn episode reaches; every framework prefills that history each step "
    "(gagar_jax's prefix_cache, which keeps a previous turn's KV cache, is off: neither "
    "trainer has an equivalent in its RL step).",
    "The update's LM head: gagar_jax (score_window, as its RL loop sets it) and TRL "
    "(logits_to_keep) run it on the completion positions only; Tunix's model returns logits "
    "for every position and its loss keeps the completion's.",
    "The update's forward: gagar_jax runs each prompt through the model once and its 8 "
    "samples' completions against the prompt's keys and values (shared_prefix, as its RL "
    "loop sets it; the same loss and gradients); TRL and Tunix run every sample's prompt and "
    "completion as one sequence. Like the prefill below, each framework's own design.",
    "gagar_2dev is gagar_jax's same step with its rows split over two host devices, one per "
    "core (XLA_FLAGS=--xla_force_host_platform_device_count=2): the sampler's rows over both "
    "(the loop's rollout.embedded_data_parallel=2) and the update's batch over a (2, 1, 1) "
    "mesh (mesh.shape), gradients all-reduced; weights synced into both. TRL's PyTorch and "
    "the one-device JAX workers already run each op on both cores' threads. Left out on an "
    "accelerator.",
    "gagar_jax's phase boundaries: generate = Sampler.generate, score = decoding and the "
    "reward, pack = rl.collect.pack_groups + shard_batch, update = the jitted update "
    "(advantages inside) with its metrics fetched, sync = rl.policy.local_params + "
    "Sampler.sync_weights.",
]


def reward_of_text(text: str) -> float:
    """The benchmark's reward: 1 when the completion text has an even number of ``e``."""
    return 1.0 if text.count("e") % 2 == 0 else 0.0


def mean_centred(rewards, group: int) -> list[float]:
    """The reference advantages: reward minus its group's mean (groups of ``group`` rows)."""
    out = []
    for g in range(0, len(rewards), group):
        chunk = rewards[g : g + group]
        m = sum(chunk) / len(chunk)
        out += [r - m for r in chunk]
    return out


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# --------------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------------


# One interpreter for the TRL and Tunix workers instead of their virtual environments (for a
# machine with no package registry, where those frameworks are installed beside its own torch
# and jax, e.g. on ``PYTHONPATH``): the workers then keep this process's ``PYTHONPATH``.
PYTHON_ENV = "GAGAR_BENCH_PYTHON"


def ensure_venv(name: str, log=print) -> Path | None:
    """The framework's virtual environment, built (or rebuilt) from ``PINS[name]``; nothing when
    ``$GAGAR_BENCH_PYTHON`` names the workers' interpreter."""
    if os.environ.get(PYTHON_ENV):
        return None
    venv = VENVS[name]
    stamp = venv / "bench-pins.json"
    want = json.dumps(PINS[name])
    if stamp.exists() and stamp.read_text() == want and (venv / "bin" / "python").exists():
        return venv
    log(f"building {venv.name} from {' '.join(PINS[name])} (minutes) ...")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + PINS[name], check=True)
    stamp.write_text(want)
    log(f"built {venv.name} in {time.perf_counter() - t0:.0f} s")
    return venv


def is_gagar(framework: str) -> bool:
    return framework == "gagar_jax" or framework in HOST_DEVICES


def python_of(framework: str) -> str:
    if is_gagar(framework):
        return sys.executable
    return os.environ.get(PYTHON_ENV) or str(VENVS[framework] / "bin" / "python")


def make_assets(model: str, root: Path = RUNS) -> Path:
    """The model directory (HF safetensors + tokenizer + prompts), written once per model."""
    out = Path(root) / model
    if (out / "bench-assets.json").exists():
        return out
    sys.path.insert(0, str(ROOT))
    import importlib.util

    import numpy as np

    from gagar_jax.models import TransformerConfig, create_model, save_hf_safetensors

    spec = importlib.util.spec_from_file_location(
        "_make_tiny_model", ROOT / "scripts" / "sglang_cpu" / "make_tiny_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    m = MODELS[model]
    tok = script.train_tokenizer(m["vocab"])
    cfg = TransformerConfig(
        vocab_size=len(tok),
        hidden_size=m["hidden"],
        num_layers=m["layers"],
        num_heads=m["heads"],
        num_kv_heads=m["kv_heads"],
        intermediate_size=m["intermediate"],
        rope_theta=10000.0,
        tie_embeddings=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    save_hf_safetensors(create_model(cfg, seed=0), cfg, str(out))
    tok.save_pretrained(str(out))
    # Prompts: words that are one token each and re-tokenise to themselves, so the prompt text
    # is exactly `prompt_len` tokens in every framework's tokenisation.
    words = []
    for i in range(len(tok)):
        s = tok.decode([i])
        if len(s) > 2 and s[0] == " " and s[1:].isalpha() and tok.encode(s) == [i]:
            words.append(s)
    rng = np.random.default_rng(0)
    prompts = {}
    for name, shape in SHAPES.items():
        texts = []
        for _ in range(shape["prompts"]):
            while True:
                text = "".join(rng.choice(words, shape["prompt_len"])).lstrip()
                if len(tok.encode(text)) == shape["prompt_len"]:
                    break
            texts.append(text)
        prompts[name] = texts
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    # config.json: the ids generate and the trainers read.
    conf = json.loads((out / "config.json").read_text())
    conf.update(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    (out / "config.json").write_text(json.dumps(conf, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None})
    )
    meta = {
        "model": model,
        "vocab_size": len(tok),
        "eos_id": eos,
        "pad_id": pad,
        "num_params": cfg.num_params,
        "prompts": prompts,
    }
    (out / "bench-assets.json").write_text(json.dumps(meta))
    return out


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    """A timestamped line on stderr (seconds since start): where a run cut short by a time
    limit spent its time."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ``--keep-heap``: glibc's allocator keeps what it frees (what ``gagar_jax.update.malloc.keep_heap``
# sets with ``mallopt``), as an environment setting every worker process gets alike.
KEEP_HEAP_TUNABLES = (
    "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
)


def worker_env(framework: str, keep_heap: bool, glibc_heap: bool = False) -> dict:
    """The environment of ``framework``'s worker process: this one's, with the offline
    switches, its host devices and, with ``keep_heap``, :data:`KEEP_HEAP_TUNABLES` (without
    it, any ``GLIBC_TUNABLES`` of this process is dropped). ``glibc_heap``: gagar_jax's worker
    leaves glibc's defaults too (``GAGAR_MALLOC_KEEP_HEAP=0``); without it, it keeps the heap
    as its trainer does."""
    env = dict(os.environ)
    inherited = env.get("PYTHONPATH", "") if env.get(PYTHON_ENV) else ""
    own = [str(ROOT)] if is_gagar(framework) else []
    env["PYTHONPATH"] = os.pathsep.join(own + ([inherited] if inherited else []))
    env.pop("XLA_FLAGS", None)  # one host device (no simulated devices)
    if framework in HOST_DEVICES:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={HOST_DEVICES[framework]}"
    # Several workers share one accelerator: none takes most of its memory up front.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    env.pop("GLIBC_TUNABLES", None)
    if keep_heap:
        env["GLIBC_TUNABLES"] = KEEP_HEAP_TUNABLES
    env.pop("GAGAR_MALLOC_KEEP_HEAP", None)
    if glibc_heap:
        env["GAGAR_MALLOC_KEEP_HEAP"] = "0"
    return env


class WorkerProc:
    """One framework's worker: JSON lines over its stdin/stdout."""

    def __init__(
        self,
        framework: str,
        spec: dict,
        log_path: Path,
        env_extra: dict | None = None,
        prefix: list[str] | None = None,
    ):
        env = worker_env(framework, bool(spec.get("keep_heap")), bool(spec.get("glibc_heap")))
        env.update(env_extra or {})
        self.framework = framework
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            list(prefix or [])
            + [
                python_of(framework),
                str(Path(__file__).resolve()),
                "--worker",
                framework,
                "--spec",
                json.dumps(spec),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=str(ROOT),
        )

    def read(self, timeout: float = 3600.0) -> dict:
        box = {}

        def get():
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    box["eof"] = True
                    return
                if line.startswith("@@"):
                    box["msg"] = json.loads(line[2:])
                    return

        t = threading.Thread(target=get, daemon=True)
        t.start()
        t.join(timeout)
        if "msg" not in box:
            if box.get("eof"):  # the worker closed its output: it is exiting; get its status
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            raise RuntimeError(
                f"{self.framework} worker gave no answer (see {self.log.name}); "
                f"exit code {self.proc.poll()}"
            )
        if "error" in box["msg"]:
            raise RuntimeError(f"{self.framework} worker: {box['msg']['error']}")
        return box["msg"]

    def post(self, cmd: str) -> None:
        """Sends ``cmd`` without waiting for the answer (``read`` collects it)."""
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def send(self, cmd: str) -> dict:
        self.post(cmd)
        return self.read()

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def compare_checks(checks: dict, meta: dict, shape: dict, atol: float = 2e-4) -> list[str]:
    """Problems (empty when the frameworks are configured equally) from each worker's check."""
    import numpy as np

    problems = []
    ref = checks.get("gagar_jax")
    want_adv = np.array(mean_centred(CHECK_REWARDS, CHECK_GROUP))
    for name, c in checks.items():
        adv = np.array(c["advantages"])
        if adv.shape != want_adv.shape or not np.allclose(adv, want_adv, atol=1e-5):
            problems.append(
                f"{name}: advantages {adv.round(4).tolist()} != mean-centred "
                f"{want_adv.round(4).tolist()}"
            )
        if len(c["prompt_ids"]) != shape["prompts"] or any(
            len(p) != shape["prompt_len"] for p in c["prompt_ids"]
        ):
            problems.append(
                f"{name}: prompt token counts {[len(p) for p in c['prompt_ids']]}, "
                f"expected {shape['prompts']} x {shape['prompt_len']}"
            )
        if ref is None or name == "gagar_jax":
            continue
        if c["prompt_ids"] != ref["prompt_ids"]:
            problems.append(f"{name}: prompt token ids differ from gagar_jax's")
        a, b = np.array(c["first_logprobs"]), np.array(ref["first_logprobs"])
        if a.shape != b.shape or not np.allclose(a, b, atol=atol, rtol=0):
            diff = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
            problems.append(
                f"{name}: first-token log-probs differ from gagar_jax's by {diff:.2e} "
                f"(tolerance {atol})"
            )
    return problems


def run_check(frameworks, spec, logdir: Path, out=print) -> dict:
    workers = {}
    try:  # all started at once: the check is not timed
        for fw in frameworks:
            log = logdir / f"{fw}-{spec['shape_name']}-check.log"
            workers[fw] = WorkerProc(fw, dict(spec, mode="check"), log)
        return {fw: w.read() for fw, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()


def race(args) -> int:
    frameworks = [f for f in args.frameworks.split(",") if f]
    for f in frameworks:
        if f not in FRAMEWORKS:
            raise SystemExit(f"--frameworks: unknown {f!r} (choose from {FRAMEWORKS})")
    accelerator = _accelerator()
    if accelerator != "none" and any(f in HOST_DEVICES for f in frameworks):
        print(f"leaving out {[f for f in frameworks if f in HOST_DEVICES]}: CPU host devices")
        frameworks = [f for f in frameworks if f not in HOST_DEVICES]
    for f in frameworks:
        if not is_gagar(f):
            ensure_venv(f)
    model = "tiny" if args.quick else "small"
    shapes = (
        args.shapes.split(",")
        if args.shapes
        else (["quick-rl", "quick-multiturn"] if args.quick else ["rl", "multiturn"])
    )
    rounds = args.rounds if args.rounds else (2 if args.quick else 5)
    assets = make_assets(model)
    meta = json.loads((assets / "bench-assets.json").read_text())
    logdir = RUNS / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    print(
        f"model: {meta['num_params'] / 1e6:.1f}M params, Qwen2-shaped, vocab "
        f"{meta['vocab_size']}, float32 ({assets})"
    )
    print(
        f"cpus: {os.cpu_count()}; accelerator: {accelerator}; heap: "
        + (
            "kept in every worker (--keep-heap)"
            if args.keep_heap
            else "glibc's defaults in every worker (--glibc-heap)"
            if args.glibc_heap
            else "gagar_jax kept (as its trainer sets it on a CPU), TRL and Tunix glibc's defaults"
        )
        + f"; start: {_load()}"
    )
    host_line = host_description()
    print(f"host: {host_line}")
    failed = False
    results = {}
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        spec = dict(
            assets=str(assets),
            shape_name=shape_name,
            **shape,
            lr=LEARNING_RATE,
            epsilon=EPSILON,
            max_grad_norm=MAX_GRAD_NORM,
            keep_heap=bool(args.keep_heap),
            glibc_heap=bool(args.glibc_heap),
        )
        progress(f"[{shape_name}] equal-configuration check")
        checks = run_check(frameworks, spec, logdir)
        progress(f"[{shape_name}] check answered")
        problems = compare_checks(checks, meta, shape)
        label = (
            f"{shape['prompts']} prompts x {shape['samples']} samples, "
            f"{shape['prompt_len']} prompt + {shape['new']} new tokens"
        )
        if problems:
            print(f"[{shape_name}] equal-configuration check FAILED:\n  " + "\n  ".join(problems))
            failed = True
            continue
        worst = (
            max(
                (
                    max(
                        abs(x - y)
                        for x, y in zip(
                            sum(checks[f]["first_logprobs"], []),
                            sum(checks["gagar_jax"]["first_logprobs"], []),
                        )
                    )
                    for f in checks
                    if f != "gagar_jax"
                ),
                default=0.0,
            )
            if "gagar_jax" in checks
            else 0.0
        )
        print(
            f"[{shape_name}] equal-configuration check passed ({label}; first-token "
            f"log-probs within {worst:.1e} of gagar_jax's, advantages mean-centred)"
        )
        if args.check:
            continue
        workers = {}
        try:
            for fw in frameworks:
                workers[fw] = WorkerProc(
                    fw, dict(spec, mode="race"), logdir / f"{fw}-{shape_name}.log"
                )
            setup = {fw: w.read() for fw, w in workers.items()}
            progress(f"[{shape_name}] workers set up")
            if args.warm_together:  # the first steps (compiles) overlap
                for w in workers.values():
                    w.post("step")
                warm = {fw: w.read() for fw, w in workers.items()}
            else:
                warm = {fw: w.send("step") for fw, w in workers.items()}
            progress(f"[{shape_name}] first steps done")
            load_before = os.getloadavg()
            recs = {fw: [] for fw in frameworks}
            for i in range(rounds):
                for fw, w in workers.items():
                    recs[fw].append(w.send("step"))
                progress(f"[{shape_name}] round {i + 1} of {rounds} done")
            load_after = os.getloadavg()
        finally:
            for w in workers.values():
                w.close()
        results[shape_name] = dict(
            recs=recs,
            setup=setup,
            warm=warm,
            load=(load_before, load_after),
            keep_heap=bool(args.keep_heap),
            glibc_heap=bool(args.glibc_heap),
            host=host_line,
        )
        print_table(shape_name, label, recs, setup, warm, load_before, load_after, rounds)
        peak = gemm_peak()
        results[shape_name]["gemm_peak"] = peak
        med = {
            fw: {ph: statistics.median(r[ph] for r in rs) for ph in PHASES}
            for fw, rs in recs.items()
        }
        flops = model_flops(assets, shape)
        results[shape_name]["model_flops"] = flops
        print_roofline(flops, med, peak)
    print(f"end: {_load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.notes:
        print("\nwhat is not equal:\n- " + "\n- ".join(NOTES))
    return 1 if failed else 0


def host_description() -> str:
    """The host facts that explain a swing between machines (``gagar_jax.host_cpu``): CPU and
    instruction set, CPU count, affinity and cgroup quota, transparent huge pages, the C
    library, the kernel's free page reporting, the inherited XLA / JAX / thread / allocator
    variables (the workers drop ``XLA_FLAGS`` and ``GLIBC_TUNABLES`` and set their own)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from gagar_jax.host_cpu import describe

    return describe()


def _accelerator() -> str:
    """The accelerator the workers will see (``none`` on a CPU-only machine)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    return out.stdout.strip().replace("\n", ", ") or "none"


def gemm_peak(n: int = 0, reps: int = 10) -> float:
    """The machine's f32 GEMM peak as JAX reaches it at its default matmul precision: the
    fastest of ``reps`` jitted ``n x n`` matmuls of random values, FLOP/s (``n`` 1024 on a CPU,
    8192 on an accelerator, which a 1024 product does not fill)."""
    import jax

    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), jax.numpy.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def model_flops(assets: Path, shape: dict) -> dict:
    """Model FLOPs of one step's phases.

    ``generate`` and ``update`` are the per-sample step's, the same work in every framework:
    generate = 2 x the layers' matmul params per token (prefill of each sample row + its new
    tokens) + the LM head on the new tokens + causal attention scores/values; update = 6 x the
    same matmuls + 3 x the attention (forward and backward). The LM head counts only where the
    step needs logits: the positions that predict the new tokens.

    ``generate_shared`` and ``update_shared`` count the same arithmetic as gagar_jax's step
    needs it: each distinct prompt once (its sampler's shared prefill, its update's
    ``shared_prefix``), each sample's new tokens against that prompt. Over a phase's time they
    read as its utilisation; the per-sample counts overstate the work gagar_jax does."""
    c = json.loads((Path(assets) / "config.json").read_text())
    h, d = c["hidden_size"], c["head_dim"]
    nh, nkv, f, v, L = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["intermediate_size"],
        c["vocab_size"],
        c["num_hidden_layers"],
    )
    per_layer = h * d * (nh + 2 * nkv) + nh * d * h + 3 * h * f
    rows = shape["prompts"] * shape["samples"]
    p, n = shape["prompt_len"], shape["new"]
    t = p + n
    matmul = L * per_layer * t + v * h * n  # per row
    attn = 4.0 * L * nh * d * t * t / 2  # causal: half the score/value matmuls, per row
    generate = rows * (2.0 * matmul + attn)
    update = rows * (6.0 * matmul + 3 * attn)

    def causal(queries: int, before: int) -> float:  # scores and values of causal queries
        return 4.0 * L * nh * d * queries * (before + queries / 2)

    shared_matmul = shape["prompts"] * L * per_layer * p + rows * (L * per_layer * n + v * h * n)
    shared_attn = shape["prompts"] * causal(p, 0) + rows * causal(n, p)
    return {
        "generate": generate,
        "update": update,
        "generate_shared": 2.0 * shared_matmul + shared_attn,
        "update_shared": 6.0 * shared_matmul + 3 * shared_attn,
    }


def print_roofline(flops: dict, med: dict, peak: float) -> None:
    """Achieved model FLOP/s of the compute phases, as a fraction of the measured GEMM peak:
    every framework's with the per-sample step's FLOPs (the same work in all three), and
    gagar_jax's also with the FLOPs its step needs (each prompt once per group), which read as
    its utilisation."""

    def rate(fl, seconds):
        return f"{fl / seconds / 1e9:.1f} GFLOP/s ({fl / seconds / peak:.0%})"

    parts = []
    for fw, m in med.items():
        phases = [f"{ph} {rate(flops[ph], m[ph])}" for ph in ("generate", "update") if m[ph] > 0]
        if is_gagar(fw):
            own = [
                f"{ph} {rate(flops[ph + '_shared'], m[ph])}"
                for ph in ("generate", "update")
                if m[ph] > 0
            ]
            phases.append("on its own FLOPs: " + ", ".join(own))
        parts.append(f"{fw} " + ", ".join(phases))
    print(
        f"roofline (model FLOPs / phase time / JAX's f32 GEMM peak at its default precision "
        f"{peak / 1e9:.1f} GFLOP/s; per sample: generate {flops['generate'] / 1e9:.1f}, update "
        f"{flops['update'] / 1e9:.1f} GFLOP; each prompt once: generate "
        f"{flops['generate_shared'] / 1e9:.1f}, update {flops['update_shared'] / 1e9:.1f} "
        f"GFLOP): " + "; ".join(parts),
        flush=True,
    )


def print_table(shape_name, label, recs, setup, warm, load_before, load_after, rounds):
    med = {
        fw: {k: statistics.median(r[k] for r in rs) for k in ("total",) + PHASES}
        for fw, rs in recs.items()
    }
    print(
        f"\n[{shape_name}] {label}; median of {rounds} interleaved rounds; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    head = (
        f"{'framework':10} {'step s':>7} "
        + " ".join(f"{p:>8}" for p in PHASES)
        + f" {'first s':>8} {'setup s':>8}"
        + "".join(f" {g + ' x':>{max(11, len(g) + 2)}}" for g in med if is_gagar(g))
    )
    print(head)
    print("-" * len(head))
    for fw, m in med.items():
        speed = "".join(
            f" {m['total'] / med[g]['total']:>{max(11, len(g) + 2) - 1}.2f}x"
            for g in med
            if is_gagar(g)
        )
        print(
            f"{fw:10} {m['total']:7.3f} "
            + " ".join(f"{m[p]:8.3f}" for p in PHASES)
            + f" {warm[fw]['total']:8.1f} {setup[fw]['setup_s']:8.1f}{speed}",
            flush=True,
        )
    print_counters(recs)


def print_counters(recs) -> None:
    """Per framework, the medians of what the kernel counted for a step (``getrusage`` of the
    worker, all its threads): CPU seconds (user, kernel), minor page faults, voluntary and
    involuntary context switches. A step that faults in its buffers afresh, or whose threads
    wait on each other, shows it here whatever the machine's other load does to its seconds."""
    if not all(rs and "user_s" in rs[0] for rs in recs.values()):
        return
    print(
        f"{'per step':10} {'cpu s':>7} {'user s':>8} {'sys s':>8} {'faults':>8} {'vol csw':>8} "
        f"{'invol csw':>9}"
    )
    for fw, rs in recs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("user_s", "sys_s", "minflt")}
        m.update({k: statistics.median(r[k] for r in rs) for k in ("vcsw", "ivcsw")})
        cpu = statistics.median(r["user_s"] + r["sys_s"] for r in rs)
        print(
            f"{fw:10} {cpu:7.3f} {m['user_s']:8.3f} {m['sys_s']:8.3f} {m['minflt']:8.0f} "
            f"{m['vcsw']:8.0f} {m['ivcsw']:9.0f}",
            flush=True,
        )


# --------------------------------------------------------------------------------------------
# Worker side (runs in the framework's own interpreter: standard library imports only above)
# --------------------------------------------------------------------------------------------


def _reply(msg: dict) -> None:
    sys.stdout.write("@@" + json.dumps(msg) + "\n")
    sys.stdout.flush()


def _wait_for_step() -> None:
    """Blocks until the driver asks for the next step; exits on 'quit' or a closed pipe."""
    line = sys.stdin.readline()
    if not line or line.strip() == "quit":
        sys.stdout.flush()
        os._exit(0)
    if line.strip() != "step":
        _reply({"error": f"unknown command {line.strip()!r}"})
        os._exit(2)


# What the kernel counted for a step (``getrusage`` of the worker, all its threads): CPU
# seconds in user and kernel mode, minor page faults, voluntary and involuntary context switches.
RUSAGE_FIELDS = (
    ("user_s", "ru_utime"),
    ("sys_s", "ru_stime"),
    ("minflt", "ru_minflt"),
    ("vcsw", "ru_nvcsw"),
    ("ivcsw", "ru_nivcsw"),
)


def rusage_now() -> dict:
    """This process's counters in :data:`RUSAGE_FIELDS` (all its threads)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return {name: getattr(r, field) for name, field in RUSAGE_FIELDS}


class PhaseClock:
    """Per-step phase seconds (a framework's hooks add to them), and the step's rusage."""

    def __init__(self):
        self.t = {p: 0.0 for p in PHASES}
        self.extra = {}
        self.usage = rusage_now()
        self.start = time.perf_counter()

    def reset(self):
        self.__init__()

    def add(self, phase, seconds):
        self.t[phase] = self.t.get(phase, 0.0) + seconds

    def record(self, **derived) -> dict:
        total = time.perf_counter() - self.start
        now = rusage_now()
        rec = dict(self.t, total=total)
        rec.update({k: now[k] - self.usage[k] for k in now})
        rec.update(derived)
        return rec


def _matmul_precision(spec: dict) -> None:
    """The precision of float32 matmuls: full float32 for ``--check`` in every framework (so
    that their scores can be compared to float tolerance); in the race, JAX's default (TF32 on
    a GPU, full float32 on a CPU) and PyTorch switched to TF32 on a GPU to match it."""
    if spec["mode"] == "check":
        try:
            import jax

            jax.config.update("jax_default_matmul_precision", "highest")
        except ImportError:
            pass
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("highest" if spec["mode"] == "check" else "high")


def worker_main(framework: str, spec: dict) -> None:
    sys.stdout.reconfigure(line_buffering=True)
    _matmul_precision(spec)
    # Libraries print to stdout: keep the protocol's lines apart (they start with '@@').
    try:
        if is_gagar(framework):
            spec = dict(spec, devices=HOST_DEVICES.get(framework, 1))
            run = _gagar_worker
        elif framework == "trl":
            run = _trl_worker
        else:
            run = _tunix_worker
        run(spec)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then exit
        import traceback

        traceback.print_exc()
        _reply({"error": f"{type(e).__name__}: {e}"})
        os._exit(1)


def _check_inputs(spec, meta):
    """Prompt texts, the fixed completion ids scored by --check."""
    prompts = meta["prompts"][spec["shape_name"]]
    completion = [(7 * i + 3) % 200 + 10 for i in range(CHECK_COMPLETION)]
    return prompts, completion


# ---- gagar_jax ------------------------------------------------------------------------------


def gagar_update_config(spec: dict):
    """gagar_jax's side of the race: mean-centred advantages without redistribution, PPO-clip
    token mean, no KL / entropy terms, AdamW without weight decay, one optimizer step. As
    the RL loop derives them from ``rollout.max_new_tokens``: the LM head runs on the response
    positions only (``score_window`` = the new tokens), and each prompt runs through the
    model once for its samples (``shared_prefix``)."""
    from gagar_jax.advantages import GagarConfig
    from gagar_jax.update import UpdateConfig

    adv = GagarConfig(estimator="mean_centered", mode="none", filter_unmixed=False)
    return UpdateConfig(
        learning_rate=spec.get("lr", LEARNING_RATE),
        weight_decay=0.0,
        max_grad_norm=spec.get("max_grad_norm", MAX_GRAD_NORM),
        clip_low=spec.get("epsilon", EPSILON),
        clip_high=spec.get("epsilon", EPSILON),
        aggregation="token-mean",
        kl_coef=0.0,
        entropy_coef=0.0,
        num_minibatches=1,
        num_microbatches=1,
        ppo_epochs=1,
        score_window=spec.get("new", 0),
        shared_prefix=spec.get("new", 0) > 0,
        advantages=adv,
    )


def _gagar_worker(spec: dict) -> None:
    t_setup = time.perf_counter()
    from gagar_jax.host_cpu import prepare_cpu_host

    # As the trainer sets up its process, before JAX's backend starts (on a CPU: the heap kept,
    # unless GAGAR_MALLOC_KEEP_HEAP=0).
    prepare_cpu_host()
    import jax
    import numpy as np
    from transformers import AutoTokenizer

    from gagar_jax.advantages import gagar_advantages
    from gagar_jax.models import load_hf_safetensors
    from gagar_jax.rl.collect import Group, Rollout, pack_groups
    from gagar_jax.rl.engines import sampler_mesh
    from gagar_jax.rl.policy import local_params
    from gagar_jax.rollout import SamplingParams
    from gagar_jax.rollout.sampler import Sampler
    from gagar_jax.update import (
        create_train_state,
        jit_update,
        make_mesh,
        shard_batch,
    )
    from gagar_jax.update.step import chunked_token_logprobs_and_entropy

    meta = json.loads((Path(spec["assets"]) / "bench-assets.json").read_text())
    tok = AutoTokenizer.from_pretrained(spec["assets"])
    cfg, model = load_hf_safetensors(spec["assets"])
    G, K, P, R = spec["prompts"], spec["samples"], spec["prompt_len"], spec["new"]
    ucfg = gagar_update_config(spec)
    adv_cfg = ucfg.advantages
    prompts, completion = _check_inputs(spec, meta)
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    if spec["mode"] == "check":
        import jax.numpy as jnp
        from flax import nnx

        rewards = np.array(CHECK_REWARDS, np.float32).reshape(-1, CHECK_GROUP)
        out = gagar_advantages(
            rewards,
            rewards > 0.5,
            np.zeros(rewards.shape, bool),
            np.ones(rewards.shape, np.int32),
            np.ones(rewards.shape, np.int32),
            np.zeros(rewards.shape[0], bool),
            np.ones(rewards.shape, bool),
            config=adv_cfg,
        )
        # The update's own scoring (hidden states -> LM head -> log-softmax at temperature 1).
        ids = np.array([p + completion for p in prompt_ids], np.int32)
        pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
        graphdef, state = nnx.split(model)

        @jax.jit
        def score(state, ids, pos):
            m = nnx.merge(graphdef, state)
            hidden = m.hidden_states(ids, pos)
            lp, _ = chunked_token_logprobs_and_entropy(
                m, hidden, jnp.roll(ids, -1, axis=1), ucfg.temperature
            )
            return lp[:, P - 1 : P - 1 + len(completion)]

        lp = np.asarray(score(state, ids, pos))
        _reply(
            {
                "advantages": np.asarray(out.advantages).reshape(-1).tolist(),
                "first_logprobs": lp.tolist(),
                "prompt_ids": prompt_ids,
            }
        )
        return

    # The race: the loop's own pieces (what gagar_jax.rl.train's step calls), on `devices`
    # devices: the update's batch split over a (devices, 1, 1) mesh, the sampler's rows over
    # the loop's sampler mesh.
    n = spec.get("devices", 1)
    if len(jax.devices()) < n:
        raise RuntimeError(f"{n} devices wanted, {len(jax.devices())} present")
    mesh = make_mesh((n, 1, 1), devices=jax.devices()[:n])
    sampler = Sampler(
        model,
        mesh=sampler_mesh(n),
        pad_id=meta["pad_id"],
        batch_buckets=(G * K,),
        prompt_buckets=(P,),
        new_token_buckets=(R,),
    )
    state = create_train_state(cfg, ucfg, mesh, seed=0)
    update = jit_update(cfg, ucfg, mesh)
    device = jax.devices()[0]
    params = SamplingParams(
        n=K, temperature=1.0, top_p=1.0, top_k=0, max_tokens=R, stop_token_ids=(meta["eos_id"],)
    )
    _reply({"setup_s": time.perf_counter() - t_setup})
    step = 0
    while True:
        _wait_for_step()
        clock = PhaseClock()
        t = time.perf_counter()
        outs = sampler.generate(prompt_ids, params)
        clock.add("generate", time.perf_counter() - t)
        t = time.perf_counter()
        groups = []
        for i, (p, samples) in enumerate(zip(prompt_ids, outs)):
            rollouts = [
                Rollout(
                    prompt_tokens=p,
                    response_tokens=s.tokens,
                    logprobs=s.logprobs,
                    finish_reason=s.finish_reason,
                    policy_version=s.policy_version,
                    passed=reward_of_text(tok.decode(s.tokens)) > 0.5,
                )
                for s in samples
            ]
            groups.append(Group(group_id=str(i), task=None, rollouts=rollouts))
        clock.add("score", time.perf_counter() - t)
        t = time.perf_counter()
        batch = pack_groups(
            groups,
            None,
            num_groups=G,
            num_rollouts=K,
            max_prompt_len=P,
            max_new_tokens=R,
            pad_id=meta["pad_id"],
        )
        ub = shard_batch(batch._replace(evidence=None), mesh)
        clock.add("pack", time.perf_counter() - t)
        t = time.perf_counter()
        state, metrics = update(state, ub)
        m = jax.device_get(metrics)
        if not np.isfinite(m["loss"]):
            raise FloatingPointError(f"non-finite loss at step {step}")
        clock.add("update", time.perf_counter() - t)
        t = time.perf_counter()
        step += 1
        sampler.sync_weights(local_params(state.params, mesh, device), step)
        jax.block_until_ready(sampler.state)
        clock.add("sync", time.perf_counter() - t)
        _reply(clock.record(loss=float(m["loss"])))


# ---- TRL -------------------------------------------------------------------------------------


def _trl_worker(spec: dict) -> None:
    t_setup = time.perf_counter()
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count() or 1)
    meta = json.loads((Path(spec["assets"]) / "bench-assets.json").read_text())
    G, K, R = spec["prompts"], spec["samples"], spec["new"]
    prompts, completion = _check_inputs(spec, meta)
    tok = AutoTokenizer.from_pretrained(spec["assets"])
    model = AutoModelForCausalLM.from_pretrained(spec["assets"], dtype=torch.float32)
    clock = PhaseClock()

    def reward(completions, **kwargs):
        t = time.perf_counter()
        out = [reward_of_text(c) for c in completions]
        clock.extra["reward_fn"] = clock.extra.get("reward_fn", 0.0) + time.perf_counter() - t
        return out

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            t = time.perf_counter()
            out = super()._generate(prompts)
            clock.add("generate", time.perf_counter() - t)
            return out

        def _calculate_rewards(self, *a, **k):
            t = time.perf_counter()
            out = super()._calculate_rewards(*a, **k)
            clock.add("score", time.perf_counter() - t)
            return out

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock.extra["gen_and_score"] = time.perf_counter() - t
            return out

    class Gate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            _wait_for_step()
            clock.reset()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():  # the step's kernels done before its clock stops
                torch.cuda.synchronize()
            gs = clock.extra.get("gen_and_score", 0.0)
            rec = clock.record()
            rec["pack"] = max(gs - clock.t["generate"] - clock.t["score"], 0.0)
            rec["update"] = max(rec["total"] - gs, 0.0)
            rec["sync"] = 0.0
            _reply(rec)

    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=G * K,
        gradient_accumulation_steps=1,
        num_generations=K,
        max_completion_length=R,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=spec["max_grad_norm"],
        optim="adamw_torch",
        beta=0.0,
        epsilon=spec["epsilon"],
        loss_type="dapo",
        scale_rewards="none",
        num_iterations=1,
        max_steps=2000,
        logging_steps=10**9,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        gradient_checkpointing=False,
    )
    # Enough rows for the steps a race takes (the trainer cycles through them once).
    data = Dataset.from_dict({"prompt": [prompts[i % G] for i in range(G * 2000)]})
    trainer = Timed(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Gate()],
    )
    if spec["mode"] == "check":
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        # The advantages: the trainer's own grouping, fed a fixed reward vector.
        adv = _trl_advantages(trainer, CHECK_REWARDS, CHECK_GROUP)
        x = torch.tensor([p + completion for p in ids], device=trainer.model.device)
        with torch.no_grad():
            lp, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, x, torch.ones_like(x), logits_to_keep=len(completion)
            )
        _reply({"advantages": adv, "first_logprobs": lp.cpu().tolist(), "prompt_ids": ids})
        return
    _reply({"setup_s": time.perf_counter() - t_setup})
    trainer.train()


def _trl_advantages(trainer, rewards, group):
    """Advantages from GRPOTrainer._generate_and_score_completions' arithmetic on ``rewards``:
    the trainer's configured scale_rewards path, re-run on a fixed reward vector."""
    import torch

    r = torch.tensor(rewards)
    mean = r.view(-1, group).mean(dim=1).repeat_interleave(group)
    adv = r - mean
    if trainer.scale_rewards != "none":
        std = r.view(-1, group).std(dim=1).repeat_interleave(group)
        adv = adv / (std + 1e-4)
    return adv.tolist()


# ---- Tunix -----------------------------------------------------------------------------------


def _tunix_worker(spec: dict) -> None:
    t_setup = time.perf_counter()
    import jax
    import numpy as np
    import optax
    from transformers import AutoTokenizer
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import common, function_registry
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    meta = json.loads((Path(spec["assets"]) / "bench-assets.json").read_text())
    conf = json.loads((Path(spec["assets"]) / "config.json").read_text())
    G, K, P, R = spec["prompts"], spec["samples"], spec["prompt_len"], spec["new"]
    prompts, completion = _check_inputs(spec, meta)
    tok = AutoTokenizer.from_pretrained(spec["assets"])
    mcfg = qwen2_model.ModelConfig(
        num_layers=conf["num_hidden_layers"],
        vocab_size=conf["vocab_size"],
        embed_dim=conf["hidden_size"],
        hidden_dim=conf["intermediate_size"],
        num_heads=conf["num_attention_heads"],
        head_dim=conf["head_dim"],
        num_kv_heads=conf["num_key_value_heads"],
        rope_theta=int(conf["rope_theta"]),
        norm_eps=conf["rms_norm_eps"],
        use_tied_embedding=conf["tie_word_embeddings"],
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        model = qwen2_params.create_model_from_safe_tensors(spec["assets"], mcfg, mesh)
    algo = grpo_learner.GRPOConfig(
        num_generations=K,
        num_iterations=1,
        beta=0.0,
        epsilon=spec["epsilon"],
        advantage_estimator="drgrpo",
        loss_agg_mode="token-mean",
        policy_loss_fn="grpo",
        loss_algo="grpo",
    )
    if spec["mode"] == "check":
        from flax import nnx

        adv = function_registry.get_advantage_estimator(algo.advantage_estimator)(
            rewards=np.array(CHECK_REWARDS, np.float32), num_generations=CHECK_GROUP
        )
        ids = [list(tok.encode(p, add_special_tokens=False)) for p in prompts]
        graphdef, state = nnx.split(model)
        lp = common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=jax.numpy.array(ids, jax.numpy.int32),
            completion_tokens=jax.numpy.array([completion] * len(ids), jax.numpy.int32),
            pad_id=meta["pad_id"],
            eos_id=meta["eos_id"],
            temperature=1.0,
        )
        _reply(
            {
                "advantages": np.asarray(adv).tolist(),
                "first_logprobs": np.asarray(lp).tolist(),
                "prompt_ids": ids,
            }
        )
        return

    clock = PhaseClock()

    def reward(prompts, completions, **kwargs):
        t = time.perf_counter()
        out = [reward_of_text(c) for c in completions]
        clock.add("score", time.perf_counter() - t)
        return out

    optimizer = optax.chain(
        optax.clip_by_global_norm(spec["max_grad_norm"]),
        optax.adamw(spec["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    training = rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optimizer,
        eval_every_n_steps=10**9,
        max_steps=10**6,
        mini_batch_size=G,
        train_micro_batch_size=G,
        rollout_micro_batch_size=G,
        compute_logps_micro_batch_size=G,
        metrics_logging_options=None,
    )
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=R,
        max_prompt_length=P,
        kv_cache_size=P + R + 8,
        temperature=1.0,
        top_p=None,
        top_k=None,
        eos_tokens=[meta["eos_id"]],
        seed=None,
    )

    class Tokenizer:
        """The HF tokenizer under Tunix's plain tokenizer protocol: the learner repeats the
        prompts with NumPy (``numpy.str_`` items), which transformers' ``encode`` rejects."""

        def encode(self, text, **kw):
            return tok.encode(str(text), add_special_tokens=False)

        def decode(self, ids, **kw):
            return tok.decode(ids, **kw)

        def bos_id(self):
            return None

        def eos_id(self):
            return meta["eos_id"]

        def pad_id(self):
            return meta["pad_id"]

    roles = {
        r: mesh
        for r in (
            rl_cluster_lib.Role.ACTOR,
            rl_cluster_lib.Role.REFERENCE,
            rl_cluster_lib.Role.ROLLOUT,
        )
    }
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=None,
        tokenizer=Tokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh=roles,
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=training,
            rollout_config=rollout,
        ),
    )
    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward])

    def timed(obj, name, phase):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if phase == "update":
                jax.block_until_ready(nnx_state(cluster.actor_trainer.model))
            clock.add(phase, time.perf_counter() - t)
            return out

        setattr(obj, name, wrapper)

    def nnx_state(m):
        from flax import nnx

        return nnx.state(m)

    timed(cluster, "generate", "generate")
    timed(cluster, "update_actor", "update")
    timed(cluster, "sync_weights", "sync")
    orig_prepare = learner._generate_and_compute_advantage

    def prepare(*a, **k):
        t = time.perf_counter()
        out = orig_prepare(*a, **k)
        clock.extra["prepare"] = time.perf_counter() - t
        return out

    learner._generate_and_compute_advantage = prepare

    def batches():
        first = True
        while True:
            if not first:  # the previous step ends when the learner asks for the next batch
                rec = clock.record()
                rec["pack"] = max(
                    clock.extra.get("prepare", 0.0) - rec["generate"] - rec["score"], 0.0
                )
                _reply(rec)
            first = False
            _wait_for_step()
            clock.reset()
            yield {"prompts": np.array(prompts)}  # a batch as a data loader gives it

    _reply(
        {
            "setup_s": time.perf_counter() - t_setup,
            "shares_rollout_model": not learner.should_sync_weights,
        }
    )
    learner.train(batches())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes")
    parser.add_argument("--check", action="store_true", help="only the equal-configuration check")
    parser.add_argument("--rounds", type=int, default=0, help="timed rounds (default 5; quick 2)")
    parser.add_argument("--shapes", default="", help=f"comma list of {tuple(SHAPES)}")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--json", default="", help="write the per-round records here")
    parser.add_argument("--notes", action="store_true", help="print what is not equal")
    parser.add_argument(
        "--warm-together",
        action="store_true",
        help="run the frameworks' first steps (their compiles) at once, for a short time limit "
        "on a many-core machine; their 'first s' then overlap",
    )
    parser.add_argument(
        "--keep-heap",
        action="store_true",
        help="every worker keeps the memory glibc frees (GLIBC_TUNABLES; default: glibc's "
        "defaults in every worker)",
    )
    parser.add_argument(
        "--glibc-heap",
        action="store_true",
        help="every worker with glibc's allocator defaults, gagar_jax's too "
        "(GAGAR_MALLOC_KEEP_HEAP=0; default: gagar_jax keeps its heap as its trainer does)",
    )
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, json.loads(args.spec))
        return
    # The driver's own JAX (assets, GEMM peak) shares the accelerator with the workers.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(race(args))


if __name__ == "__main__":
    main()
