r"""The held-out pass-rate change of RL runs over their SFT start, paired by seed.

    python scripts/heldout_gain.py --root=runs/heldout_gain --modes=gagar,binary --seeds=5 \
        --num_tasks=512 --samples=4 --out=runs/heldout_gain

Each run ``ROOT/<mode>/seed<s>`` (written by scripts/train.py with ``loop.keep_checkpoints``
large enough to keep step 0, the SFT start) is evaluated at step 0 and at its last checkpoint
on the same ``--num_tasks`` tasks, each task sampled ``--samples`` times with the same seeds at
both steps (``gagar_jax.rl.paired_eval``). Per run: the pass rate at both steps and its change,
with the change's standard error over tasks (the noise of one run's paired evaluation). Per
mode: the mean and standard error over seeds of the per-seed changes; per pair of modes
(``--paired=gagar-binary``): the per-seed difference of their changes (the modes of one seed
share the SFT start). ``--split=train`` evaluates on the training pool instead, for choosing a
setting without looking at the held-out tasks.

Writes ``OUT/PREFIX.json`` (every task's pass counts stay in each run's
``paired_eval_<split>_<tasks>x<samples>_t<temperature>.json``), ``OUT/PREFIX.md`` (or, with
``--results_page``, that page's ``--page_block``) and ``OUT/PREFIX.png``.
"""

import json
import math
import os
import sys

from absl import app, flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

flags.DEFINE_string("root", None, "Directory of <mode>/seed<s> run directories.")
flags.DEFINE_list("modes", ["gagar", "binary"], "Modes (sub-directories of --root).")
flags.DEFINE_integer("seeds", 5, "Seeds 0..n-1.")
flags.DEFINE_enum("split", "heldout", ["heldout", "train"], "Which tasks to evaluate on.")
flags.DEFINE_integer("num_tasks", 512, "Tasks evaluated (the split's first n).")
flags.DEFINE_integer("samples", 4, "Samples per task.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature.")
flags.DEFINE_integer("end_step", -1, "Checkpoint compared with step 0 (-1: each run's last).")
flags.DEFINE_list(
    "paired",
    [],
    "Mode pairs a-b whose per-seed changes are differenced (default: the first mode against "
    "each other one).",
)
flags.DEFINE_integer(
    "block",
    32,
    "Also report the change as evaluations of this many tasks would see it (disjoint blocks of "
    "the evaluated tasks; 32 is the default toy job's held-out set). 0: off.",
)
flags.DEFINE_string("out", None, "Output directory (default: --root).")
flags.DEFINE_string("prefix", "heldout_gain", "Output file names.")
flags.DEFINE_string(
    "results_page",
    None,
    "A results page (docs/results/*.md) whose --page_block is rewritten with the report and the "
    "plot (PREFIX.md is then not written).",
)
flags.DEFINE_string(
    "page_block", "heldout-gain", "The results page's <!-- NAME:begin/end --> block."
)
flags.DEFINE_string("command", "", "The command that trained the runs, for the report.")
flags.mark_flags_as_required(["root"])
FLAGS = flags.FLAGS


def _fmt(mean, se):
    return f"{mean:+.4f} ± {se:.4f}"


def _verdict(mean, se):
    if math.isnan(se):
        return "one seed: no error bar"
    return "beyond 2 SE" if abs(mean) > 2 * se else "within 2 SE (not distinguishable from 0)"


def run_counts(workdir):
    """(start step, end step, {step: records}) of one run; every evaluated step is kept in a
    cache in the run directory, and only missing steps are evaluated."""
    from gagar_jax.rl import paired_eval

    cache = os.path.join(
        workdir,
        f"paired_eval_{FLAGS.split}_{FLAGS.num_tasks}x{FLAGS.samples}_t{FLAGS.temperature:g}.json",
    )
    end = FLAGS.end_step
    if end < 0:  # the last checkpoint: orbax keeps each step in a directory named by it
        ckpts = os.path.join(workdir, "checkpoints")
        steps = (
            sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) if os.path.isdir(ckpts) else []
        )
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {ckpts}")
        end = steps[-1]
    got = {}
    if os.path.exists(cache):
        with open(cache, encoding="utf-8") as f:
            got = {int(k): v for k, v in json.load(f).items()}
    missing = [s for s in (0, end) if s not in got]
    if missing:
        got.update(
            paired_eval.checkpoint_pass_counts(
                workdir,
                missing,
                split=FLAGS.split,
                num_tasks=FLAGS.num_tasks,
                samples=FLAGS.samples,
                temperature=FLAGS.temperature,
            )
        )
        with open(cache, "w", encoding="utf-8") as f:
            json.dump({str(k): v for k, v in sorted(got.items())}, f)
    return 0, end, got


def run_summary(start, end, got):
    from gagar_jax.rl import paired_eval

    a, b = got[start], got[end]
    per_task = [
        (y["passed"] / y["n"] - x["passed"] / x["n"]) for x, y in zip(a, b) if x["n"] and y["n"]
    ]
    _, se = paired_eval.paired_mean_se(per_task)
    blocks = []
    if FLAGS.block:
        for i in range(0, len(a) - FLAGS.block + 1, FLAGS.block):
            blocks.append(
                paired_eval.pass_rate(b[i : i + FLAGS.block])
                - paired_eval.pass_rate(a[i : i + FLAGS.block])
            )
    kinds = {}
    for x, y in zip(a, b):
        k = kinds.setdefault(x["kind"], [0, 0, 0])
        k[0] += x["n"]
        k[1] += x["passed"]
        k[2] += y["passed"]
    return {
        "end_step": end,
        "start": paired_eval.pass_rate(a),
        "end": paired_eval.pass_rate(b),
        "change": paired_eval.pass_rate(b) - paired_eval.pass_rate(a),
        "change_se_tasks": se,
        "never_passed": [sum(1 for x in r if x["passed"] == 0) / len(r) for r in (a, b)],
        "always_passed": [sum(1 for x in r if x["passed"] == x["n"]) / len(r) for r in (a, b)],
        "block_changes": blocks,
        "kinds": {
            k: {"samples": n, "start": s / n, "end": e / n} for k, (n, s, e) in kinds.items()
        },
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:  # orbax logs every restore at INFO
        logging.set_verbosity(logging.WARNING)
    from gagar_jax.rl import paired_eval

    out = FLAGS.out or FLAGS.root
    os.makedirs(out, exist_ok=True)
    runs = {}
    for m in FLAGS.modes:
        for s in range(FLAGS.seeds):
            wd = os.path.join(FLAGS.root, m, f"seed{s}")
            runs[(m, s)] = run_summary(*run_counts(wd))
            r = runs[(m, s)]
            print(
                f"{m} seed {s}: {r['start']:.4f} -> {r['end']:.4f} (step {r['end_step']}), "
                f"change {_fmt(r['change'], r['change_se_tasks'])} (SE over tasks)",
                flush=True,
            )
    modes = {}
    for m in FLAGS.modes:
        ch = [runs[(m, s)]["change"] for s in range(FLAGS.seeds)]
        mean, se = paired_eval.paired_mean_se(ch)
        st = [runs[(m, s)]["start"] for s in range(FLAGS.seeds)]
        en = [runs[(m, s)]["end"] for s in range(FLAGS.seeds)]
        modes[m] = {
            "change_mean": mean,
            "change_se": se,
            "seeds_up": sum(1 for c in ch if c > 0),
            "start_mean": sum(st) / len(st),
            "end_mean": sum(en) / len(en),
            "noise_one_run": sum(runs[(m, s)]["change_se_tasks"] for s in range(FLAGS.seeds))
            / FLAGS.seeds,
        }
    pairs = {}
    for p in FLAGS.paired or [f"{FLAGS.modes[0]}-{m}" for m in FLAGS.modes[1:]]:
        a, b = p.split("-")
        d = [runs[(a, s)]["change"] - runs[(b, s)]["change"] for s in range(FLAGS.seeds)]
        mean, se = paired_eval.paired_mean_se(d)
        pairs[p] = {"mean": mean, "se": se, "seeds_ahead": sum(1 for x in d if x > 0)}

    n_eval = FLAGS.num_tasks * FLAGS.samples
    lines = []
    if FLAGS.command:
        lines += [f"Command: `{FLAGS.command}`", ""]
    lines += [
        f"Evaluation: {FLAGS.split} split, {FLAGS.num_tasks} tasks x {FLAGS.samples} samples "
        f"({n_eval}) at temperature {FLAGS.temperature:g}, the same per-task sample seeds at "
        "step 0 (the SFT start) and at the run's last checkpoint.",
        "",
        "| mode | seed | pass rate at the SFT start | after RL | change (± SE over tasks) "
        "| tasks no sample passes | tasks every sample passes |",
        "|---|---|---|---|---|---|---|",
    ]
    for (m, s), r in runs.items():
        lines.append(
            f"| {m} | {s} | {r['start']:.4f} | {r['end']:.4f} | "
            f"{_fmt(r['change'], r['change_se_tasks'])} | "
            f"{r['never_passed'][0]:.3f} -> {r['never_passed'][1]:.3f} | "
            f"{r['always_passed'][0]:.3f} -> {r['always_passed'][1]:.3f} |"
        )
    lines += [
        "",
        "Change over the SFT start, mean ± standard error over seeds (paired per seed):",
        "",
    ]
    for m, v in modes.items():
        lines.append(
            f"- {m}: {v['start_mean']:.4f} -> {v['end_mean']:.4f}, change "
            f"{_fmt(v['change_mean'], v['change_se'])}, {v['seeds_up']} of {FLAGS.seeds} seeds up: "
            f"{_verdict(v['change_mean'], v['change_se'])}"
        )
    for p, v in pairs.items():
        lines.append(
            f"- {p} (difference of the changes, per seed): {_fmt(v['mean'], v['se'])}, "
            f"first ahead in {v['seeds_ahead']} of {FLAGS.seeds} seeds: "
            f"{_verdict(v['mean'], v['se'])}"
        )
    if FLAGS.block and all(len(r["block_changes"]) >= 2 for r in runs.values()):
        lines += ["", f"The same changes measured on {FLAGS.block}-task blocks (disjoint):", ""]
        for m in FLAGS.modes:
            bl = [x for s in range(FLAGS.seeds) for x in runs[(m, s)]["block_changes"]]
            _, se = paired_eval.paired_mean_se(bl)
            sd = se * math.sqrt(len(bl))
            down = sum(1 for x in bl if x <= 0)
            lines.append(
                f"- {m}: {len(bl)} blocks, change {min(bl):+.3f} .. {max(bl):+.3f} "
                f"(standard deviation {sd:.3f}); {down} of {len(bl)} show no rise"
            )
    kinds = sorted({k for r in runs.values() for k in r["kinds"]})
    if any(kinds):
        lines += ["", "By bug kind (pooled over seeds; start -> end):", ""]
        for m in FLAGS.modes:
            parts = []
            for k in kinds:
                rs = [
                    runs[(m, s)]["kinds"][k]
                    for s in range(FLAGS.seeds)
                    if k in runs[(m, s)]["kinds"]
                ]
                st = sum(r["start"] * r["samples"] for r in rs) / sum(r["samples"] for r in rs)
                en = sum(r["end"] * r["samples"] for r in rs) / sum(r["samples"] for r in rs)
                parts.append(f"{k} {st:.3f} -> {en:.3f}")
            lines.append(f"- {m}: " + ", ".join(parts))
    text = "\n".join(lines) + "\n"
    print(text)
    if FLAGS.results_page:
        from gagar_jax.analysis.ablation import replace_results_block

        image = os.path.relpath(
            os.path.join(out, FLAGS.prefix + ".png"), os.path.dirname(FLAGS.results_page)
        )
        replace_results_block(
            FLAGS.results_page, text + f"\n![held-out gain]({image})", block=FLAGS.page_block
        )
    else:
        with open(os.path.join(out, FLAGS.prefix + ".md"), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(out, FLAGS.prefix + ".json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "command": FLAGS.command,
                "split": FLAGS.split,
                "num_tasks": FLAGS.num_tasks,
                "samples": FLAGS.samples,
                "temperature": FLAGS.temperature,
                "runs": [{"mode": m, "seed": s, **r} for (m, s), r in runs.items()],
                "modes": modes,
                "paired": pairs,
            },
            f,
            indent=1,
        )
    _plot(runs, modes, os.path.join(out, FLAGS.prefix + ".png"))


def _plot(runs, modes, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    for i, m in enumerate(modes):
        for s in range(FLAGS.seeds):
            r = runs[(m, s)]
            ax.plot(
                [0, 1],
                [r["start"], r["end"]],
                color=f"C{i}",
                alpha=0.5,
                marker="o",
                label=m if s == 0 else None,
            )
    ax.set_xticks([0, 1], ["SFT start", "after RL"])
    ax.set_ylabel(f"{FLAGS.split} pass rate ({FLAGS.num_tasks} x {FLAGS.samples})")
    ax.set_title("per seed")
    ax.legend()
    ax = axes[1]
    names = list(modes)
    ax.bar(
        range(len(names)),
        [modes[m]["change_mean"] for m in names],
        yerr=[2 * modes[m]["change_se"] for m in names],
        color=[f"C{i}" for i in range(len(names))],
        capsize=6,
    )
    for i, m in enumerate(names):
        ch = [runs[(m, s)]["change"] for s in range(FLAGS.seeds)]
        ax.scatter([i] * len(ch), ch, color="k", s=12, zorder=3)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("pass-rate change over the SFT start")
    ax.set_title(f"mean ± 2 SE over {FLAGS.seeds} seeds (dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
