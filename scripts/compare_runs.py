r"""Compares training runs: one plot with a line per run and a markdown table.

    python scripts/compare_runs.py --workdirs=runs/compare/gagar,runs/compare/binary,\
runs/compare/discount_only --out=runs/compare

Writes ``OUT/comparison.png`` and ``OUT/comparison.md`` (table of first -> last figures per
metric, averaged over ``--window`` logged steps) and prints the table.
"""

import os

from absl import app, flags

flags.DEFINE_list("workdirs", None, "Run directories (each with metrics.jsonl).")
flags.DEFINE_list("labels", None, "Labels (default: the directory names).")
flags.DEFINE_string("out", None, "Output directory (default: the parent of the first workdir).")
flags.DEFINE_integer("window", 5, "Steps averaged for the first/last figures.")
flags.DEFINE_integer("smooth", 3, "Moving-average window for the plotted train curves.")
flags.mark_flags_as_required(["workdirs"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gagar_jax.train import metrics_io

    labels = FLAGS.labels or [os.path.basename(os.path.normpath(w)) for w in FLAGS.workdirs]
    if len(labels) != len(FLAGS.workdirs):
        raise app.UsageError(f"{len(labels)} labels for {len(FLAGS.workdirs)} workdirs")
    out = FLAGS.out or os.path.dirname(os.path.normpath(FLAGS.workdirs[0]))
    report = metrics_io.compare_runs(dict(zip(labels, FLAGS.workdirs)), out,
                                     window=FLAGS.window, smooth=FLAGS.smooth)
    print(report)


if __name__ == "__main__":
    app.run(main)
