r"""Low-precision rollouts on the toy main job: an int8 sampler with and without truncated IS
against the float32 baseline, a few seeds each, then a plot and a table.

    python scripts/precision_compare.py --root=runs/precision --seeds=3 --run \
        --extra="--config.sft.steps=150 --config.loop.total_steps=30"
    python scripts/precision_compare.py --root=runs/precision --seeds=3   # plot only

Conditions (``configs/toy_gagar.py`` in mode ``gagar``, everything else its defaults):

* ``float32``: the embedded sampler in float32 (the baseline; the mismatch metrics on);
* ``int8_tis``: ``rollout.precision=int8`` (weight-only int8, bfloat16 compute), with the
  learner's defaults for a low precision: token TIS (``rollout_is=token``, decoupled clip);
* ``int8_no_tis``: the same sampler with ``learner.rollout_is=none``.

Each run is ``scripts/train.py`` in a process of its own, one after the other, niced and on
one CPU device (``XLA_FLAGS`` cleared; ``--cpu`` pins it to one core with ``taskset``), into
``ROOT/<condition>/seed<s>``; a finished run is kept (an unfinished one resumes). Writes
``OUT/precision_compare.{png,md,json}`` (docs/results/low_precision.md holds the table): per
condition the mean and standard error over seeds of the held-out pass rate, the train pass
rate, the quality of passing solutions and ``mismatch/k3`` (the update's k3 of its log-probs
against the sampler's) at each logged step.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys

from absl import app, flags

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT_DIR)

CONDITIONS = {
    "float32": ["--config.learner.mismatch_metrics=True"],
    "int8_tis": ["--config.rollout.precision=int8"],
    "int8_no_tis": ["--config.rollout.precision=int8", "--config.learner.rollout_is=none"],
}
WINDOW = 5  # train steps averaged for a run's first and last figures
PANELS = (
    ("eval_pass_rate", "held-out pass rate", "eval"),
    ("pass_rate", "train pass rate", "train"),
    ("quality", "quality of passing", "train"),
    ("mismatch/k3", "k3(sampler || update)", "train"),
)

flags.DEFINE_string("root", "runs/precision", "Runs in ROOT/<condition>/seed<s>.")
flags.DEFINE_integer("seeds", 3, "Seeds 0..SEEDS-1 per condition.")
flags.DEFINE_bool("run", False, "Run the missing runs first (else: plot what is there).")
flags.DEFINE_string("extra", "", "Further scripts/train.py arguments for every run.")
flags.DEFINE_string("cpu", "", "taskset CPU list for the runs (e.g. 1); empty: no pinning.")
flags.DEFINE_string("out", None, "Output directory (default: ROOT).")
FLAGS = flags.FLAGS


def run_dir(condition: str, seed: int) -> str:
    return os.path.join(FLAGS.root, condition, f"seed{seed}")


def finished(workdir: str) -> bool:
    """The run ended (its final plot is written after the last step)."""
    return os.path.exists(os.path.join(workdir, "training_dynamics.png"))


def run_all() -> None:
    env = dict(os.environ, XLA_FLAGS="")
    for seed in range(FLAGS.seeds):
        for condition, args in CONDITIONS.items():
            workdir = run_dir(condition, seed)
            if finished(workdir):
                continue
            cmd = ["nice", "-n", "19"]
            if FLAGS.cpu:
                cmd += ["taskset", "-c", FLAGS.cpu]
            cmd += [
                sys.executable,
                os.path.join(ROOT_DIR, "scripts", "train.py"),
                f"--config={os.path.join(ROOT_DIR, 'configs', 'toy_gagar.py')}:gagar",
                f"--workdir={workdir}",
                f"--config.seed={seed}",
                *args,
                *shlex.split(FLAGS.extra),
            ]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, env=env, check=True, cwd=ROOT_DIR)


def curves() -> dict:
    """condition -> key -> step -> {seed: value}."""
    from gagar_jax.analysis import writers

    out: dict = {}
    for condition in CONDITIONS:
        per = out.setdefault(condition, {key: {} for key, _, _ in PANELS})
        for seed in range(FLAGS.seeds):
            path = os.path.join(run_dir(condition, seed), "metrics.jsonl")
            if not os.path.exists(path):
                continue
            for row in writers.read_jsonl(path):
                for key, _, phase in PANELS:
                    if row.get("phase") == phase and row.get(key) is not None:
                        per[key].setdefault(int(row["step"]), {})[seed] = float(row[key])
    return out


def mean_se(values):
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0, n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n), n


def windowed(per_key: dict, steps: list[int]) -> list[float]:
    """Each seed's mean over ``steps`` (the seeds that logged all of them)."""
    seeds = set.intersection(*(set(per_key[s]) for s in steps))
    return [sum(per_key[s][seed] for s in steps) / len(steps) for seed in sorted(seeds)]


def table(data: dict) -> str:
    """Per condition: each panel's first -> last figure, mean +- SE over seeds of each seed's
    mean over the first and the last ``WINDOW`` logged steps (the held-out evaluations: the
    first and the last one), and the k3's mean over all steps."""
    lines = [
        "| condition | seeds | " + " | ".join(title for _, title, _ in PANELS) + " |",
        "|---|---|" + "---|" * len(PANELS),
    ]
    for condition, per in data.items():
        cells, seeds = [], 0
        for key, _, _ in PANELS:
            steps = sorted(per[key])
            if not steps:
                cells.append("-")
                continue
            if key == "mismatch/k3":
                k3 = mean_se(windowed(per[key], steps))
                cells.append(f"{k3[0]:.1e} ± {k3[1]:.0e} (all steps)")
                continue
            w = 1 if key.startswith("eval_") else WINDOW
            first = mean_se(windowed(per[key], steps[:w]))
            last = mean_se(windowed(per[key], steps[-w:]))
            seeds = max(seeds, last[2])
            cells.append(f"{first[0]:.3f} ± {first[1]:.3f} → {last[0]:.3f} ± {last[1]:.3f}")
        lines.append(f"| {condition} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (key, title, _) in zip(axes, PANELS):
        for condition, per in data.items():
            steps = sorted(per[key])
            if not steps:
                continue
            stats = [mean_se(list(per[key][s].values())) for s in steps]
            m = [s[0] for s in stats]
            se = [s[1] for s in stats]
            ax.plot(steps, m, label=condition)
            ax.fill_between(
                steps, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)], alpha=0.2
            )
        ax.set_title(title)
        ax.set_xlabel("RL step")
        if key == "mismatch/k3":
            ax.set_yscale("symlog", linthresh=1e-6)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    del argv
    if FLAGS.run:
        run_all()
    out = FLAGS.out or FLAGS.root
    os.makedirs(out, exist_ok=True)
    data = curves()
    md = table(data)
    print(md)
    with open(os.path.join(out, "precision_compare.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "precision_compare.json"), "w") as f:
        json.dump({c: {k: {str(s): {str(a): b for a, b in v.items()} for s, v in d.items()}
                   for k, d in per.items()} for c, per in data.items()}, f)  # fmt: skip
    plot(data, os.path.join(out, "precision_compare.png"))


if __name__ == "__main__":
    app.run(main)
