r"""Evaluates a trained run's newest checkpoint on the held-out tasks.

    python scripts/evaluate.py --workdir=runs/toy_gagar [--samples=4] [--temperature=0.7]

Reads ``WORKDIR/config.json`` (written by scripts/train.py), restores the newest complete
checkpoint, samples ``--samples`` patches per held-out task with the embedded sampler (or the
configured SGLang server) and prints pass rate, quality of passing patches, cheat rate and
response length; writes them to ``WORKDIR/eval_<step>.json``.
"""

import json
import os

from absl import app, flags

flags.DEFINE_string("workdir", None, "A run directory written by scripts/train.py.")
flags.DEFINE_integer("samples", 4, "Samples per held-out task.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature.")
flags.DEFINE_integer("step", -1, "Checkpoint step (-1: the newest complete one).")
flags.mark_flags_as_required(["workdir"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gagar_jax.rl import train

    metrics, step = train.evaluate_checkpoint(
        FLAGS.workdir, step=FLAGS.step, samples=FLAGS.samples, temperature=FLAGS.temperature
    )
    out = os.path.join(FLAGS.workdir, f"eval_{step}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"step": step, **metrics}, f, indent=1)
    print(f"checkpoint {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    print(f"written: {out}")


if __name__ == "__main__":
    app.run(main)
