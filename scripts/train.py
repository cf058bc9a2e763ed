r"""Trains a policy with Gagar (or a baseline mode) from an ml_collections config.

    python scripts/train.py --config=configs/toy_gagar.py --workdir=runs/toy_gagar
    python scripts/train.py --config=configs/toy_gagar.py:binary,smoke --workdir=/tmp/smoke \
        --config.learner.learning_rate=1e-4

Re-running with the same --workdir resumes from the newest complete checkpoint. SIGTERM (a pod's
preemption notice) saves a checkpoint at the next step boundary and exits with status
128 + SIGTERM; a rerun resumes there. Multi-host:
``--config.mesh.coordinator_address/num_processes/process_id`` or the JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID environment variables (see configs/tpu_pod.py).

Memory: the script first sets glibc's allocator to keep freed memory for reuse
(``gagar_jax.update.malloc.keep_heap``), so the update's large temporary buffer is not faulted
in afresh every step; ``GAGAR_MALLOC_KEEP_HEAP=0`` in the environment turns that off.

Console: the progress bar and summaries. Library logging (orbax, absl) is at WARNING unless
``--verbosity`` asks for more (``--verbosity=0`` is absl's INFO, ``1`` DEBUG).
"""

import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# The config files import `configs.common` of this checkout: its root on the path, as for
# `python -m` from the root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py[:arg]).", lock_config=True
)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.DEFINE_string(
    "compilation_cache",
    "runs/.jax_cache",
    "JAX persistent compilation cache directory ('' disables): reruns and the "
    "three modes of `make compare` reuse compiled programs.",
)
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gagar_jax.update.malloc import keep_heap

    keep_heap()  # before any JAX computation: process-wide, GAGAR_MALLOC_KEEP_HEAP=0 opts out
    if not FLAGS["verbosity"].present:  # orbax logs every save/restore step at INFO
        logging.set_verbosity(logging.WARNING)
    from gagar_jax.rl import train
    from gagar_jax.rl.config import RunConfig
    from gagar_jax.rl.multihost import HostError

    cfg = RunConfig.from_config_dict(FLAGS.config)
    train.initialize_distributed(cfg.mesh)  # before any JAX computation
    if FLAGS.compilation_cache:
        train.enable_compilation_cache(FLAGS.compilation_cache)
    try:
        summary = train.train_and_evaluate(cfg, FLAGS.workdir)
    except HostError as e:
        # Another host is dead or hung: end now. A normal exit would wait in jax.distributed's
        # shutdown barrier for the host that never comes (minutes, then an abort).
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)
    if summary.get("preempted"):  # checkpoint saved at the step boundary after SIGTERM
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    app.run(main)
