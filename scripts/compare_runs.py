r"""Compares training runs: one plot with a line per run and a markdown table.

    python scripts/compare_runs.py --workdirs=runs/compare/gagar,runs/compare/binary,\
runs/compare/discount_only --out=runs/compare

Writes ``OUT/comparison.png`` and ``OUT/comparison.md`` (table of first -> last figures per
metric, averaged over ``--window`` logged steps) and prints the table.

With several seeds per mode (``make compare SEEDS=5`` lays them out as ``ROOT/<mode>/seed<s>``):

    python scripts/compare_runs.py --root=runs/compare --modes=gagar,binary,discount_only,\
gagar_token --seeds=5 --out=runs/compare \
        [--results_page=docs/results/toy_ablation.md --command="make compare SEEDS=5"]

writes ``OUT/ablation.{md,png,json}`` (``--prefix`` renames them): per mode the mean and
standard error over seeds of each metric, a plot with ±1 SE bands, the held-out pass-rate
change over the SFT start, the relation between credit imbalance and entropy drift (per run and
per step) and the paired discount_only - gagar differences (``gagar_jax.analysis.ablation``);
``--results_page`` rewrites a results page's ablation block (``--block``) from them.
"""

import os

from absl import app, flags

flags.DEFINE_list("workdirs", None, "Run directories (each with metrics.jsonl).")
flags.DEFINE_string("root", None, "Multi-seed mode: runs in ROOT/<mode>/seed<s>.")
flags.DEFINE_list(
    "modes",
    ["gagar", "binary", "discount_only", "gagar_token"],
    "Multi-seed mode: the modes under --root.",
)
flags.DEFINE_integer("seeds", 0, "Multi-seed mode: seeds 0..SEEDS-1 under each mode.")
flags.DEFINE_string(
    "results_page", None, "Multi-seed mode: the results page (docs/results/*.md) to rewrite."
)
flags.DEFINE_string("command", "", "Multi-seed mode: the command that produced the runs.")
flags.DEFINE_string(
    "block",
    "ablation-table",
    "Multi-seed mode: the results page's block (<!-- NAME:begin/end -->) to rewrite.",
)
flags.DEFINE_string("image", None, "Multi-seed mode: the plot's link in the markdown.")
flags.DEFINE_string(
    "prefix", "ablation", "Multi-seed mode: output file names OUT/PREFIX.{md,png,json}."
)
flags.DEFINE_string("title", "toy ablation", "Multi-seed mode: the plot's title.")
flags.DEFINE_list(
    "paired",
    ["discount_only-gagar"],
    "Multi-seed mode: A-B mode pairs whose per-seed differences are reported.",
)
flags.DEFINE_list(
    "fit_roots",
    [],
    "Multi-seed mode: further sweep roots pooled into one imbalance-entropy fit.",
)
flags.DEFINE_list("labels", None, "Labels (default: the directory names).")
flags.DEFINE_string("out", None, "Output directory (default: the parent of the first workdir).")
flags.DEFINE_integer("window", 5, "Steps averaged for the first/last figures.")
flags.DEFINE_integer("smooth", 3, "Moving-average window for the plotted train curves.")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.root:
        from gagar_jax.analysis import ablation

        if FLAGS.seeds < 1:
            raise app.UsageError("--root needs --seeds >= 1")
        print(
            ablation.compare_seeds(
                FLAGS.root,
                FLAGS.modes,
                range(FLAGS.seeds),
                FLAGS.out or FLAGS.root,
                window=FLAGS.window,
                command=FLAGS.command,
                results_page=FLAGS.results_page,
                title=f"{FLAGS.title}, mean ± 1 SE over seeds",
                block=FLAGS.block,
                image=FLAGS.image,
                prefix=FLAGS.prefix,
                fit_roots=FLAGS.fit_roots,
                paired_modes=[tuple(p.split("-", 1)) for p in FLAGS.paired],
            )
        )
        return
    if not FLAGS.workdirs:
        raise app.UsageError("pass --workdirs (one run each) or --root with --seeds")
    from gagar_jax.analysis import writers

    labels = FLAGS.labels or [os.path.basename(os.path.normpath(w)) for w in FLAGS.workdirs]
    if len(labels) != len(FLAGS.workdirs):
        raise app.UsageError(f"{len(labels)} labels for {len(FLAGS.workdirs)} workdirs")
    out = FLAGS.out or os.path.dirname(os.path.normpath(FLAGS.workdirs[0]))
    report = writers.compare_runs(
        dict(zip(labels, FLAGS.workdirs)), out, window=FLAGS.window, smooth=FLAGS.smooth
    )
    print(report)


if __name__ == "__main__":
    app.run(main)
