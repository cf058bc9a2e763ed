r"""The feedback study: five objectives x seeds on one shared simulated-user feedback dataset.

    python scripts/feedback_compare.py --out=runs/feedback_compare --seeds=0,1,2
    python scripts/feedback_compare.py --out=/tmp/fc --seeds=0 --steps=10     # a reduced run
    python scripts/feedback_compare.py --out=runs/fc_bal --modes=span_kto \
        --base_dir=runs/feedback_compare/base --config.objective.lambda_w=20  # a variant

Every (mode, seed) run trains from the same warm-started base policy on the same feedback data
(``<out>/base``); the seed changes the batch order and the evaluation samples. Writes
``<out>/comparison.md`` (held-out pass rate, quality, negative-feedback rate: mean and standard
deviation over seeds, the base policy's figures beside them) and ``<out>/comparison.png``.
Re-running resumes finished or interrupted runs from their checkpoints.
"""

import json
import math
import os
import sys

from absl import app, flags
from ml_collections import config_flags

# The config files import `configs.common` of this checkout: its root on the path, as for
# `python -m` from the root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

config_flags.DEFINE_config_file(
    "config", "configs/feedback_toy.py", "Base config file.", lock_config=False
)
flags.DEFINE_string("out", "runs/feedback_compare", "Output directory.")
flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds.")
flags.DEFINE_string(
    "modes", "sft,rw_sft,span_kto,sft_drop_negative,sft_penalize_negative", "Comma-separated modes."
)
flags.DEFINE_integer("steps", 0, "Override loop.steps (0: the config's).")
flags.DEFINE_string("base_dir", "", "Shared base (policy + feedback data); '' = <out>/base.")
flags.DEFINE_string("compilation_cache", "runs/.jax_cache", "JAX compilation cache ('' = off).")
FLAGS = flags.FLAGS
KEYS = ("eval_pass_rate", "eval_quality", "eval_negative_rate", "eval_response_length")


def _stats(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def main(argv):
    del argv
    from gagar_jax.analysis import writers
    from gagar_jax.feedback.run import FeedbackRunConfig, train_feedback

    if FLAGS.compilation_cache:
        from gagar_jax.rl.train import enable_compilation_cache

        enable_compilation_cache(FLAGS.compilation_cache)
    seeds = [int(s) for s in FLAGS.seeds.split(",") if s.strip()]
    modes = [m.strip() for m in FLAGS.modes.split(",") if m.strip()]
    out = os.path.abspath(FLAGS.out)
    summaries = {}
    for mode in modes:
        for seed in seeds:
            d = FLAGS.config.to_dict()
            d["seed"] = seed
            d["objective"]["mode"] = mode
            d["base"]["dir"] = os.path.abspath(FLAGS.base_dir or os.path.join(out, "base"))
            d["name"] = f"feedback_{mode}_s{seed}"
            if FLAGS.steps:
                d["loop"]["steps"] = FLAGS.steps
                d["loop"]["eval_every"] = min(d["loop"]["eval_every"], FLAGS.steps)
                d["loop"]["checkpoint_every"] = min(d["loop"]["checkpoint_every"], FLAGS.steps)
            cfg = FeedbackRunConfig.from_config_dict(d)
            summaries[(mode, seed)] = train_feedback(cfg, os.path.join(out, mode, f"s{seed}"))

    base_eval = next(iter(summaries.values()))["base_eval"]
    lines = [
        "# Feedback objectives on the toy family",
        "",
        f"Modes x seeds {seeds}, {cfg.loop.steps} steps each, batch {cfg.loop.batch_size}, "
        f"lr {cfg.learner.learning_rate}; one shared base policy and feedback dataset "
        f"({next(iter(summaries.values()))['records']} records). Held-out: "
        f"{cfg.task.num_eval} tasks x {cfg.loop.eval_samples} samples at T="
        f"{cfg.loop.eval_temperature}. Mean +- sd over seeds of the final evaluation.",
        "",
        "| mode | " + " | ".join(KEYS) + " |",
        "|---|" + "---|" * len(KEYS),
        "| base (before training) | "
        + " | ".join("n/a" if base_eval.get(k) is None else f"{base_eval[k]:.3f}" for k in KEYS)
        + " |",
    ]
    table = {}
    for mode in modes:
        cells = []
        for k in KEYS:
            m, sd = _stats([summaries[(mode, s)]["final_eval"].get(k) for s in seeds])
            table[(mode, k)] = (m, sd)
            cells.append("n/a" if m is None else f"{m:.3f} +- {sd:.3f}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    lines += ["", "![comparison](comparison.png)", ""]
    with open(os.path.join(out, "comparison.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "comparison.json"), "w", encoding="utf-8") as f:
        json.dump({f"{m}/{k}": v for (m, k), v in table.items()} | {"base": base_eval}, f, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key in zip(axes, KEYS[:3]):
        for mode in modes:
            curves = []
            for s in seeds:
                rows = writers.read_jsonl(os.path.join(out, mode, f"s{s}", "metrics.jsonl"))
                xs, ys = writers.series(rows, key, phase="eval")
                curves.append((xs, ys))
            xs = curves[0][0]
            ys = [
                sum(c[1][i] for c in curves if i < len(c[1])) / len(curves) for i in range(len(xs))
            ]
            ax.plot(xs, ys, marker="o", ms=3, label=mode)
        ax.set_title(key + f" (mean of {len(seeds)} seeds)", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "comparison.png"), dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
