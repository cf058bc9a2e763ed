r"""End to end on CPU: a real SGLang server in the loop of a multi-turn code-agent RL run.

    python scripts/e2e.py --out=runs/e2e          # what `make e2e` runs

1. builds a tiny random Qwen2 with a locally trained BPE tokenizer and chat template
   (``scripts/sglang_cpu/make_tiny_model.py`` in ``.venv-sglang``; nothing from a model hub);
2. writes the task pool: the fixture repositories of ``tests/fixtures/repos`` as JSONL, each with
   its minimal patch as the reference patch (the SFT demonstrations are built from it);
3. starts a real SGLang server from ``.venv-sglang`` on a free loopback port (or uses
   ``--sglang_url``, a server already serving ``--model_dir``);
4. runs ``configs/swe_agent.py:smoke`` (SFT warm start on the tool-call demonstrations, then 3 RL
   steps with SGLang rollouts and the agentic grader on the same server) into ``OUT/run``,
   SIGKILLs the trainer after its checkpoint of step 1 and runs it again (it resumes);
5. stops the server, prints the per-step metrics and checks them (:func:`check`, exit 1 on a
   failure): episodes of more than one turn, parsed tool calls, the weight version +1 per step,
   a finite training-inference mismatch, a resumed run that repeats and skips no step.

``--execution=ray`` runs the same config with ``execution.backend=ray`` on a simulated Ray
cluster started here (``ray.cluster_utils.Cluster``: a head without CPUs and one worker node),
so every verification and ``run_tests`` call of the run is a Ray task; the check then also
requires calls on the cluster and no infrastructure error.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The local Ray cluster binds to the loopback address, not the machine's network interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, ROOT)

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "repos")
KEYS = (
    "episode/turns_mean",
    "episode/tool_calls_mean",
    "rollout/weight_version",
    "rollout/logprob_mismatch_k3",
    "rollout/logprob_mismatch_max_abs",
    "pass_rate",
    "response_length",
)


def check(rows: list[dict], log: str, execution: str = "local") -> list[str]:
    """What ``make e2e`` must show (``tests/test_e2e.py`` asserts the same); [] when it does."""
    import math

    train = [r for r in rows if r.get("phase") == "train"]
    problems = []
    # (the tiny model seldom calls run_tests or submits: most calls are the warm start's
    # demonstrations, counted in the first step's row, and the verification of submissions)
    if execution == "ray" and not sum(r.get("execution/calls", 0) for r in train) > 0:
        problems.append(
            "execution=ray: no call ran on the Ray cluster "
            f"{[r.get('execution/calls') for r in train]}"
        )
    # the per-step counters of the execution back-end, on every logged step
    wanted = (
        "calls_in_flight",
        "queue_wait_s",
        "retries",
        "node_losses",
        "orphans_reaped",
        "admission_waits",
        "grader_slots_held",
    )
    absent = sorted({k for r in train for k in wanted if f"execution/{k}" not in r})
    if absent:
        problems.append(f"execution: metrics missing from the train rows: {absent}")
    if any(r.get("execution/infra_errors", 0) > 0 for r in train):
        problems.append(
            f"execution: infrastructure errors {[r.get('execution/infra_errors') for r in train]}"
        )
    if "resumed from checkpoint 1" not in log:
        problems.append("the second trainer run did not resume from checkpoint 1")
    if [r["step"] for r in train] != [0, 1, 2]:
        problems.append(f"train steps {[r['step'] for r in train]} != [0, 1, 2]")
    if not any(r.get("phase") == "sft" for r in rows):
        problems.append("no SFT warm-start rows")
    if [r.get("rollout/weight_version") for r in train] != [1.0, 2.0, 3.0]:
        problems.append(
            "rollout/weight_version is not +1 per step from the SFT'd version 0: "
            f"{[r.get('rollout/weight_version') for r in train]}"
        )
    if not any(r.get("episode/turns_mean", 0) > 1.0 for r in train):
        problems.append("no step with more than one turn per episode on average")
    if not any(r.get("episode/tool_calls_mean", 0) > 0.0 for r in train):
        problems.append("no parsed tool call in any step")
    for r in train:
        k3 = r.get("rollout/logprob_mismatch_k3")
        diff = r.get("rollout/logprob_mismatch_max_abs")
        if not (
            isinstance(k3, float)
            and math.isfinite(k3)
            and isinstance(diff, float)
            and math.isfinite(diff)
            and diff >= 0
        ):
            problems.append(f"step {r['step']}: mismatch not finite ({k3}, {diff})")
    # SGLang's kernels are not the trainer's: the mismatch is small, but not exactly zero (an
    # exact 0 would mean the trainer scored its own tokens, not the engine's)
    diffs = [r.get("rollout/logprob_mismatch_max_abs") for r in train]
    if train and all(isinstance(d, float) for d in diffs):
        if not any(d > 0.0 for d in diffs):
            problems.append(f"mismatch exactly 0 on every step ({diffs}): not the engine's tokens?")
        if not all(d < 1.0 for d in diffs):
            problems.append(f"mismatch max |diff| >= 1 nat on some step ({diffs})")
    return problems


def write_pool(path: str) -> str:
    from gagar_jax.envs.repo import RepoTask

    with open(path, "w", encoding="utf-8") as f:
        for name in sorted(os.listdir(FIXTURES)):
            task_dir = os.path.join(FIXTURES, name)
            if not os.path.isfile(os.path.join(task_dir, "task.json")):
                continue
            d = RepoTask.from_dir(task_dir).to_dict()
            with open(os.path.join(task_dir, "patches", "minimal.diff"), encoding="utf-8") as p:
                d["reference_patch"] = p.read()
            f.write(json.dumps(d) + "\n")
    return path


def trainer_cmd(run_dir: str, model_dir: str, pool: str, url: str, extra=()) -> list[str]:
    return [
        sys.executable,
        os.path.join(ROOT, "scripts", "train.py"),
        f"--config={os.path.join(ROOT, 'configs', 'swe_agent.py')}:smoke",
        f"--workdir={run_dir}",
        f"--compilation_cache={os.path.join(run_dir, '..', 'jax')}",
        f"--config.model.hf_checkpoint={model_dir}",
        f"--config.task.data_path={pool}",
        f"--config.rollout.sglang_url={url}",
        f"--config.grading.sglang_url={url}",
        *extra,
    ]


def run_with_kill(cmd: list[str], marker: str, log: str, timeout_s: float) -> None:
    """Runs ``cmd`` until ``marker`` exists, then SIGKILLs it (a crash, not a clean stop)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        try:
            while not os.path.exists(marker):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"trainer exited ({proc.returncode}) before {marker}; see {log}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {marker} after {timeout_s:.0f} s; see {log}")
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def run(cmd: list[str], log: str, timeout_s: float) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, "XLA_FLAGS": ""}
    with open(log, "ab") as out:
        r = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    if r.returncode:
        with open(log, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"trainer failed ({r.returncode}); {log}:\n{tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "e2e"))
    ap.add_argument(
        "--sglang_url",
        default="",
        help="use this running server (serving --model_dir) instead of starting one",
    )
    ap.add_argument("--model_dir", default="", help="the served model (with --sglang_url)")
    ap.add_argument("--timeout_s", type=float, default=1800.0)
    ap.add_argument(
        "--execution",
        choices=("local", "ray"),
        default="local",
        help="where verification and run_tests calls run (ray: a simulated cluster)",
    )
    args = ap.parse_args()

    from gagar_jax.rollout.sglang_server import SGLangServer, make_tiny_model

    out = os.path.abspath(args.out)
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    model_dir = args.model_dir
    if not model_dir:
        model_dir = os.path.join(out, "model")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            make_tiny_model(model_dir, seed=0)
    pool = write_pool(os.path.join(out, "tasks.jsonl"))
    cluster = None
    extra = []
    if args.execution == "ray":  # first: the SGLang server's start loads the machine
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(num_cpus=0, object_store_memory=100 << 20, include_dashboard=False),
        )
        try:
            cluster.add_node(
                num_cpus=2, object_store_memory=100 << 20, env_vars={"PYTHONPATH": ROOT}
            )
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
        extra = [
            "--config.execution.backend=ray",
            f"--config.execution.ray_address={cluster.address}",
        ]
        print(f"e2e: Ray cluster {cluster.address} up", flush=True)
    server = None
    url = args.sglang_url
    if not url:
        server = SGLangServer(model_dir, log_path=os.path.join(out, "sglang.log"))
        try:
            server.start(timeout_s=600)
        except BaseException:
            if cluster is not None:
                cluster.shutdown()
            raise
        url = server.url
        print(f"e2e: SGLang server {url} up in {server.start_seconds:.0f} s", flush=True)
    log = os.path.join(out, "trainer.log")
    try:
        cmd = trainer_cmd(run_dir, model_dir, pool, url, extra)
        marker = os.path.join(run_dir, "checkpoints", "1")
        run_with_kill(cmd, marker, log, args.timeout_s)
        print(
            f"e2e: trainer SIGKILLed after checkpoint 1 ({time.monotonic() - t0:.0f} s)", flush=True
        )
        run(cmd, log, args.timeout_s)
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.shutdown()
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        if r.get("phase") == "train":
            print("e2e: step", r["step"], " ".join(f"{k}={r.get(k)}" for k in KEYS), flush=True)
    with open(log, encoding="utf-8", errors="replace") as f:
        problems = check(rows, f.read(), args.execution)
    print(f"e2e: done in {time.monotonic() - t0:.0f} s; metrics in {run_dir}/metrics.jsonl")
    for p in problems:
        print(f"e2e: FAILED: {p}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
