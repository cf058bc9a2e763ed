"""The update and the greedy sampler under several XLA flag settings, each in a process of its own.

    XLA_FLAGS= .venv/bin/python benchmarks/xla_flags.py \\
        --setting="--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED" \\
        --setting="--xla_cpu_use_fusion_emitters=false"
    XLA_FLAGS= .venv/bin/python benchmarks/xla_flags.py --what sampler --batch 64 \\
        --setting="--xla_cpu_experimental_ynn_fusion_type=+dot"

XLA reads its flags once per process, so a setting cannot be compared with another inside one
process (``benchmarks/compare_trees.py`` compares two checkouts that way). Here every setting,
and first the baseline (this process's ``XLA_FLAGS``), runs in a worker process of its own with
``XLA_FLAGS`` set to the baseline's flags followed by the setting's (a later flag overrides an
earlier one). Each worker compiles its program, runs it once, and then answers the driver's
rounds: every worker runs ``--calls`` calls per round, the order reversed every other round, so
a change of the machine's load hits every setting alike. Reported: the median and the fastest
call, the median against the baseline's, the cores a call kept busy (CPU seconds over wall
seconds), the compile seconds (the sampler's: its first call, compile included), and whether
the setting computes the same numbers: the parameters after one update step (from the same seed
and batch), or the greedy tokens and their log-probabilities, against the baseline's. A setting
XLA rejects (an unknown flag aborts the process) is reported with its error and left out of
the rounds.

What runs: ``update`` is the update step of ``benchmarks/update.py``'s config (``--config``,
default ``small``: 5.1M parameters, 8 sequences of 256 tokens); ``sampler`` is one greedy call
of the embedded sampler on that config's model (``--batch`` distinct prompts of
``--prompt-len`` tokens, ``--new-tokens`` new ones, as ``benchmarks/sampler.py``'s greedy table).
Every worker runs with glibc's allocator keeping freed memory, as ``scripts/train.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# A tiny model for the benchmark's own tests: the same code paths in seconds.
TINY = dict(
    vocab_size=256,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    rope_theta=10000.0,
)


def _load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _base_flags() -> str:
    """This process's XLA_FLAGS without a host device count (one device per worker)."""
    return " ".join(
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    )


# ----------------------------------------------------------------------------- worker


def _build(args):
    """(call, compile seconds, numbers): the program to time, and the numbers its first call
    computed (arrays the driver compares across settings)."""
    import dataclasses

    import jax
    import numpy as np
    import update as bench_update

    from gagar_jax.models import TransformerConfig, create_model
    from gagar_jax.rollout import SamplingParams
    from gagar_jax.rollout.sampler import Sampler

    if args.config == "tiny":
        c, batch, length = TransformerConfig(**TINY), 4, 32
    else:
        c, batch, length = bench_update.config_of(args.config)
    if args.what == "update":
        compiled = []
        step, compile_s, _ = bench_update.bench_jax(c, batch, length, compiled_out=compiled)
        # The parameters after one step of the same compiled program from the seeded state.
        mesh = bench_update.make_mesh((1, 1, 1), devices=jax.devices()[:1])
        train = bench_update.create_train_state(c, bench_update.UPDATE, mesh, seed=0)
        data = bench_update.shard_batch(bench_update.make_batch(c, batch, length), mesh)
        new_state, _ = compiled[0](train, data)
        numbers = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(new_state.params)]
        step()  # warm-up
        return step, compile_s, numbers
    model = create_model(dataclasses.replace(c, dtype="float32"), seed=0)
    sampler = Sampler(
        model,
        batch_buckets=(args.batch,),
        prompt_buckets=(args.prompt_len,),
        new_token_buckets=(args.new_tokens,),
    )
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, c.vocab_size, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    t0 = time.perf_counter()
    first = sampler.generate(prompts, params)
    compile_s = time.perf_counter() - t0
    samples = [sample for group in first for sample in group]
    tokens = np.concatenate([np.asarray(x.tokens, np.float64) for x in samples])
    logprobs = np.concatenate([np.asarray(x.logprobs, np.float64) for x in samples])

    def call():
        sampler.generate(prompts, params)

    call()
    return call, compile_s, [tokens, logprobs]


def worker(args) -> None:
    """Builds the program, saves its numbers to ``args.out``, then times a call per ``call``
    line on standard input (one JSON line each: wall and CPU seconds) until ``stop``."""
    # This checkout's package (the venv's editable install may point at another one), and
    # benchmarks/ for the update benchmark's builders.
    sys.path[:0] = [ROOT, HERE]
    from gagar_jax.update.malloc import keep_heap

    keep_heap()
    call, compile_s, numbers = _build(args)
    import numpy as np

    np.savez(args.out, *numbers)
    print(json.dumps({"ready": True, "compile_s": compile_s}), flush=True)
    for line in sys.stdin:
        if line.strip() != "call":
            break
        t, c = time.perf_counter(), time.process_time()
        call()
        print(
            json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c}),
            flush=True,
        )


# ----------------------------------------------------------------------------- driver


class Worker:
    """One setting's process."""

    def __init__(self, setting: str, args, tmp: str, index: int):
        self.setting = setting
        self.out = os.path.join(tmp, f"numbers{index}.npz")
        self.err_path = os.path.join(tmp, f"stderr{index}.txt")
        env = dict(os.environ, XLA_FLAGS=f"{_base_flags()} {setting}".strip())
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--what", args.what,
            "--config", args.config,
            "--batch", str(args.batch),
            "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens),
            "--out", self.out,
        ]  # fmt: skip
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True
        )
        self.error = None
        self.compile_s = float("nan")
        self.times: list[tuple[float, float]] = []
        ready = self._read()
        if ready is None:
            self.error = self._last_error()
        else:
            self.compile_s = ready["compile_s"]

    def _read(self):
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):
            line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def _last_error(self) -> str:
        self.proc.wait()
        self.err.flush()
        with open(self.err_path) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        return (lines[-1] if lines else f"exit status {self.proc.returncode}")[:300]

    def call(self) -> None:
        self.proc.stdin.write("call\n")
        self.proc.stdin.flush()
        got = self._read()
        if got is None:
            self.error = self._last_error()
            return
        self.times.append((got["wall"], got["cpu"]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.err.close()


def numbers_diff(a_path: str, b_path: str) -> float:
    """The largest absolute difference between two workers' numbers (inf if shapes differ)."""
    import numpy as np

    a, b = np.load(a_path), np.load(b_path)
    if sorted(a.files) != sorted(b.files):
        return float("inf")
    worst = 0.0
    for k in a.files:
        if a[k].shape != b[k].shape:
            return float("inf")
        if a[k].size:
            worst = max(worst, float(np.max(np.abs(a[k] - b[k]))))
    return worst


def run(args) -> list[dict]:
    """Every setting's row (the baseline first), as printed."""
    settings = [""] + list(args.setting)
    tmp = tempfile.mkdtemp(prefix="xla-flags-")
    workers = []
    try:
        for i, s in enumerate(settings):  # one at a time: a compile does not overlap another's
            w = Worker(s, args, tmp, i)
            workers.append(w)
            print(
                f"[{s or 'baseline'}] "
                + (f"compiled in {w.compile_s:.1f} s" if w.error is None else f"failed: {w.error}"),
                flush=True,
            )
        if workers[0].error is not None:
            raise SystemExit(f"the baseline did not start: {workers[0].error}")
        live = [w for w in workers if w.error is None]
        start = _load()
        for r in range(args.rounds):
            for w in live if r % 2 == 0 else live[::-1]:
                for _ in range(args.calls):
                    if w.error is None:
                        w.call()
        end = _load()
    finally:
        for w in workers:
            w.stop()
    base = statistics.median(t for t, _ in workers[0].times)
    rows = []
    for w in workers:
        row = {"setting": w.setting or "(baseline)", "error": w.error, "calls": len(w.times)}
        if w.error is None and w.times:
            walls = [t for t, _ in w.times]
            med = statistics.median(walls)
            row.update(
                median_s=med,
                min_s=min(walls),
                vs_baseline=med / base,
                cores=sum(c for _, c in w.times) / sum(walls),
                compile_s=w.compile_s,
                max_abs_diff=numbers_diff(workers[0].out, w.out),
            )
        rows.append(row)
    what = (
        f"update of {args.config}"
        if args.what == "update"
        else f"greedy sampler, {args.config} model, batch {args.batch}, "
        f"{args.prompt_len} + {args.new_tokens} tokens"
    )
    print(
        f"\n{what}; {args.rounds} rounds of {args.calls} calls per setting, the order reversed "
        f"every other round; {start} at the start, {end} at the end; baseline XLA_FLAGS: "
        f"{_base_flags() or '(none)'}"
    )
    print(f"{'median s':>9} {'min s':>8} {'vs base':>8} {'cores':>6} {'compile s':>9} "
          f"{'max |diff|':>10}  setting")  # fmt: skip
    for row in rows:
        if "median_s" in row:
            print(
                f"{row['median_s']:9.4f} {row['min_s']:8.4f} {row['vs_baseline']:7.3f}x "
                f"{row['cores']:6.2f} {row['compile_s']:9.1f} {row['max_abs_diff']:10.2e}  "
                f"{row['setting']}"
            )
        else:
            how = f"failed after {row['calls']} calls" if row["calls"] else "not run"
            print(f"{'':>56}  {row['setting']}: {how} ({row['error']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"what": what, "load_start": start, "load_end": end, "rows": rows}, f, indent=1
            )
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--setting",
        action="append",
        default=[],
        help="XLA flags of one setting, appended to the baseline's, written "
        "--setting='--xla_...' (repeat the option for more settings)",
    )
    ap.add_argument("--what", choices=("update", "sampler"), default="update")
    ap.add_argument(
        "--config", default="small", help="benchmarks/update.py config (small, 100m) or tiny"
    )
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3, help="calls per setting per round")
    ap.add_argument("--batch", type=int, default=64, help="sampler: distinct prompts")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("rounds", "calls", "batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        run(a)
