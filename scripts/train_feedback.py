r"""Trains a policy from user-feedback spans (SFT, RW-SFT, Span-KTO or a baseline).

    python scripts/train_feedback.py --config=configs/feedback_toy.py:span_kto --workdir=runs/fb
    python scripts/train_feedback.py --config=configs/feedback_toy.py:rw_sft,smoke \
        --workdir=/tmp/fb --config.objective.reference_point=batch_kl

Re-running with the same --workdir resumes from the newest checkpoint (z_ref included).
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

# The config files import `configs.common` of this checkout: its root on the path, as for
# `python -m` from the root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

config_flags.DEFINE_config_file(
    "config", None, "Experiment config (configs/feedback_toy.py:arg).", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the summary.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import json

    from gagar_jax.feedback.run import FeedbackRunConfig, train_feedback

    cfg = FeedbackRunConfig.from_config_dict(FLAGS.config.to_dict())
    summary = train_feedback(cfg, FLAGS.workdir)
    print(
        json.dumps(
            {k: summary[k] for k in ("mode", "seed", "final_eval", "base_eval")},
            indent=1,
            default=str,
        )
    )


if __name__ == "__main__":
    app.run(main)
