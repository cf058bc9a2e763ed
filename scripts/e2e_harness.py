"""End to end: RL steps whose every episode is an unmodified mini-swe-agent run through the
gateway, on a real-package task made by the task factory, with the embedded sampler or a real
CPU SGLang server.

    python scripts/e2e_harness.py --out=runs/e2e_harness                  # embedded sampler
    python scripts/e2e_harness.py --out=runs/e2e_harness --engine=sglang  # CPU SGLang server
    python scripts/e2e_harness.py --out=runs/e2e_harness --async          # asynchronous loop
    python scripts/e2e_harness.py --out=runs/e2e_harness --pool=fixtures  # the fixture repos

1. builds the tiny random Qwen2 with its locally trained BPE tokenizer and chat template
   (``make_tiny_model``, in ``.venv-sglang``; nothing from a model hub);
2. writes the pool: the task factory's row of a real package
   (``tests/fixtures/factory/instances.jsonl``, cachetools), its git repository rebuilt from the
   release's source distribution on the registry (``synth.rebuild_repos``) and its environment
   built with ``uv`` (cached), as ``scripts/e2e.py`` does; or, with ``--pool=fixtures``, the
   fixture repositories (``tests/fixtures/repos``);
3. with ``--engine=sglang`` starts a real SGLang server from ``.venv-sglang`` on a free loopback
   port (or uses ``--sglang-url``, a server already serving ``--model-dir``);
4. trains 3 RL steps of ``configs/swe_agent.py:smoke`` with ``rollout.harness=mini_swe_agent``
   on that engine (one group of two episodes a step, at most three calls each): each rollout is
   mini-swe-agent (from ``.venv-agents``, built by ``scripts/setup_agents.sh``) in the sandbox,
   the run's gateway its only endpoint, its commands run in the task's checkout with the task's
   environment; its diff verified by the standard verifier;
5. checks (:func:`check`) the steps ran, every step's episodes made model calls through the
   gateway on the pool's tasks, the update's log-probs at the sampling weights equal the
   recorded ones (the embedded sampler's k3 is 0; SGLang's is small and not exactly 0: its
   kernels are not the trainer's, and its figure is printed) and the losses are finite. A
   random model's episodes mostly fail: the plumbing is what is checked, not learning;
6. exports the run's episodes (the gateway's records under ``RUN_DIR/episodes``) as ATIF
   trajectories (``python -m gagar_jax.data.trajectories export RUN_DIR --format atif``) and
   reads each back (:func:`check_export`): every episode of every step, each call's ids,
   log-probs and policy version as recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

KEYS = (
    "episode/segments",
    "episode/calls",
    "episode/tokens",
    "rollout/logprob_mismatch_k3",
    "rollout/logprob_mismatch_max_abs",
    "pass_rate",
    "infra_errors",
    "loss",
    "token_credit/conservation_error",
)


def check(rows: list[dict], steps: int, engine: str = "embedded") -> list[str]:
    """What the run must show; [] when it does."""
    train = [r for r in rows if r.get("phase") == "train"]
    problems = []
    if [r["step"] for r in train] != list(range(steps)):
        problems.append(f"train steps {[r['step'] for r in train]}, expected 0..{steps - 1}")
    for r in train:
        if not (r.get("episode/calls") or 0) > 0:
            problems.append(f"step {r['step']}: no model call went through the gateway")
        k3 = r.get("rollout/logprob_mismatch_k3")
        mx = r.get("rollout/logprob_mismatch_max_abs")
        if engine == "embedded":  # the update's program is the sampler's: exactly its log-probs
            if k3 is None or not abs(k3) < 1e-6:
                problems.append(f"step {r['step']}: logprob_mismatch_k3={k3} (expected 0)")
            if mx is None or not mx < 1e-3:
                problems.append(f"step {r['step']}: logprob_mismatch_max_abs={mx}")
        else:  # SGLang's kernels: small, finite, and not 0 (else not the engine's tokens)
            if k3 is None or not (math.isfinite(k3) and abs(k3) < 1e-2):
                problems.append(f"step {r['step']}: logprob_mismatch_k3={k3} (expected small)")
            if mx is None or not 0.0 < mx < 1.0:
                problems.append(f"step {r['step']}: logprob_mismatch_max_abs={mx} (0 < x < 1)")
        for key in ("loss", "grad_norm"):
            v = r.get(key)
            if v is None or not math.isfinite(v):
                problems.append(f"step {r['step']}: {key}={v}")
        if r.get("infra_errors"):
            problems.append(f"step {r['step']}: {r['infra_errors']} infra errors")
    return problems


def check_export(
    run_dir: str, steps: int, episodes_per_step: int, task_ids: tuple[str, ...] = ()
) -> tuple[list[str], str]:
    """The ATIF export of the run's episodes, read back: (problems, a summary line). With
    ``task_ids``, every training episode must be of one of those tasks."""
    from gagar_jax.data import trajectories

    problems = []
    records = {r["episode_id"]: r for r in trajectories.find_records(run_dir)}
    train = sorted(e for e in records if e.startswith("s"))
    for step in range(steps):
        got = [e for e in train if e.startswith(f"s{step}-")]
        if len(got) < episodes_per_step:
            problems.append(f"step {step}: {len(got)} recorded episodes, want {episodes_per_step}")
    # episode ids: s<step>-r<round>-<index>-<task id>-k<slot>-d<draw>
    off = [e for e in train if task_ids and not any(f"-{t}-k" in e for t in task_ids)]
    if off:
        problems.append(f"training episodes not of the pool's tasks {task_ids}: {off}")
    out = subprocess.run(
        [sys.executable, "-m", "gagar_jax.data.trajectories", "export", run_dir],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=600,
    )
    if out.returncode:
        return problems + [f"export exited {out.returncode}: {out.stderr[-2000:]}"], ""
    files = out.stdout.split()
    calls = 0
    for path in files:
        try:
            traj = trajectories.read_atif(path)
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
            continue
        rec = records.get(traj["session_id"])
        got = trajectories.atif_calls(traj)
        calls += len(got)
        keys = ("prompt_ids", "completion_ids", "logprobs", "policy_version", "linked_call")
        if rec is None or [{k: c[k] for k in keys} for c in got] != [
            {k: c[k] for k in keys} for c in rec["calls"]
        ]:
            problems.append(f"{path}: its calls differ from the episode's record")
    if len(files) != len(records):
        problems.append(f"{len(files)} ATIF files for {len(records)} recorded episodes")
    return problems, (
        f"exported {len(files)} episodes ({len(train)} of training, {calls} calls) as ATIF "
        f"and read them back"
    )


def trainer_cmd(
    run_dir, model_dir, pool, agents_venv, steps, asynchronous, *, repos_dir="", sglang_url=""
) -> list[str]:
    """The trainer's command line: the embedded sampler, or the SGLang server at
    ``sglang_url``."""
    engine = "sglang" if sglang_url else "embedded"
    return [
        sys.executable,
        os.path.join(ROOT, "scripts", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'swe_agent.py')}:smoke",
        f"--workdir={run_dir}",
        f"--compilation_cache={os.path.join(run_dir, '..', 'jax')}",
        f"--config.model.hf_checkpoint={model_dir}",
        f"--config.task.data_path={pool}",
        f"--config.task.repos_dir={repos_dir}",
        f"--config.rollout.engine={engine}",
        f"--config.rollout.sglang_url={sglang_url}",
        "--config.rollout.harness=mini_swe_agent",
        f"--config.rollout.harness_agents_venv={agents_venv}",
        "--config.rollout.harness_max_calls=3",
        "--config.rollout.harness_max_wall_s=300",
        "--config.rollout.harness_max_segments=2",
        "--config.rollout.max_turn_tokens=48",
        "--config.rollout.num_prompts=1",
        "--config.grading.grader=heuristic",
        "--config.sft.steps=0",
        f"--config.loop.total_steps={steps}",
        "--config.loop.checkpoint_every=100",
        *(["--config.rollout.async_scheduler=True"] if asynchronous else []),
    ]


def prepare_pool(out: str, kind: str) -> tuple[str, str, tuple[str, ...]]:
    """The pool file, its repositories' folder and its task ids: the factory's real-package
    task (its repository rebuilt, its environment built) or the fixture repositories."""
    from e2e import FACTORY_ROWS, factory_expectations, write_pool

    if kind == "fixtures":
        return write_pool(os.path.join(out, "tasks.jsonl")), "", ()
    from gagar_jax.data import synth

    t0 = time.monotonic()
    factory_dir = os.path.join(out, "factory")
    rows = synth.rebuild_repos(FACTORY_ROWS, factory_dir, log=lambda m: print("e2e-harness:", m))
    repos_dir = os.path.join(factory_dir, "repos")
    expect = factory_expectations(rows, repos_dir)  # builds (or reuses) the environments
    print(
        f"e2e-harness: factory tasks {sorted(expect)} ready in {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    pool = os.path.join(out, "tasks_factory.jsonl")
    with open(rows, encoding="utf-8") as src, open(pool, "w", encoding="utf-8") as dst:
        dst.writelines(line for line in src if line.strip())
    return pool, repos_dir, tuple(sorted(expect))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "e2e_harness"))
    ap.add_argument("--model-dir", default="", help="an existing tiny HF model (else built)")
    ap.add_argument("--agents-venv", default=os.path.join(ROOT, ".venv-agents"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--async", dest="asynchronous", action="store_true")
    ap.add_argument("--engine", choices=("embedded", "sglang"), default="embedded")
    ap.add_argument(
        "--sglang-url", default="", help="with --engine=sglang: a server serving --model-dir"
    )
    ap.add_argument("--pool", choices=("factory", "fixtures"), default="factory")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another config override (e.g. mode=gagar_token), repeatable",
    )
    ap.add_argument("--run-name", default="", help="the run's folder under --out")
    ap.add_argument("--timeout-s", type=float, default=1200.0)
    args = ap.parse_args()

    from gagar_jax.rollout.sglang_server import SGLangServer, make_tiny_model

    out = os.path.abspath(args.out)
    name = "run" + ("_sglang" if args.engine == "sglang" else "")
    name = args.run_name or name + ("_async" if args.asynchronous else "")
    run_dir = os.path.join(out, name)
    os.makedirs(out, exist_ok=True)
    if os.path.isdir(run_dir):
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.monotonic()
    model_dir = args.model_dir or os.path.join(out, "model")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        make_tiny_model(model_dir, seed=0)
    pool, repos_dir, task_ids = prepare_pool(out, args.pool)
    log = os.path.join(out, f"trainer_{os.path.basename(run_dir)}.log")
    server, url = None, ""
    if args.engine == "sglang":
        url = args.sglang_url
        if not url:
            server = SGLangServer(model_dir, log_path=os.path.join(out, "sglang.log"))
            server.start(timeout_s=600)
            url = server.url
            print(f"e2e-harness: SGLang server {url} up in {server.start_seconds:.0f} s")
    cmd = trainer_cmd(
        run_dir,
        model_dir,
        pool,
        args.agents_venv,
        args.steps,
        args.asynchronous,
        repos_dir=repos_dir,
        sglang_url=url,
    ) + [f"--config.{kv}" for kv in args.set]
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    t_train = time.monotonic()
    try:
        with open(log, "wb") as f:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s
            ).returncode
    finally:
        if server is not None:
            server.stop()
    if rc:
        with open(log, encoding="utf-8", errors="replace") as f:
            print(f.read()[-4000:])
        print(f"e2e-harness: FAILED: trainer exited {rc} (log: {log})")
        return 1
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        if r.get("phase") == "train":
            print("e2e-harness: step", r["step"], " ".join(f"{k}={r.get(k)}" for k in KEYS))
    problems = check(rows, args.steps, args.engine)
    export_problems, summary = check_export(
        run_dir, args.steps, episodes_per_step=2, task_ids=task_ids
    )
    problems += export_problems
    if summary:
        print(f"e2e-harness: {summary}")
    print(
        f"e2e-harness: engine {args.engine}, pool {args.pool} {list(task_ids)}: trainer "
        f"{time.monotonic() - t_train:.0f} s, done in {time.monotonic() - t0:.0f} s; metrics "
        f"in {run_dir}"
    )
    for p in problems:
        print(f"e2e-harness: FAILED: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
