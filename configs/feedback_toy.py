r"""Feedback training on the toy family: SFT, RW-SFT, Span-KTO and the paper's two baselines.

    python scripts/train_feedback.py --config=configs/feedback_toy.py:span_kto --workdir=runs/fb/kto
    python scripts/train_feedback.py --config=configs/feedback_toy.py:rw_sft,smoke --workdir=/tmp/s
    make feedback-compare        # the five modes x 3 seeds on one shared feedback dataset

The argument is a comma-separated list: a mode (``sft`` | ``rw_sft`` | ``span_kto`` |
``sft_drop_negative`` | ``sft_penalize_negative``; default ``span_kto``) and/or ``smoke`` (a
seconds-long run for CI). Every mode shares ``base.dir``: one warm-started policy and one dataset
of simulated-user feedback on its samples, built by the first run that needs it.

Every field not set here is :class:`gagar_jax.feedback.run.FeedbackRunConfig`'s default
(``configs/common.py``: the policy is the library's ``TransformerConfig``, the optimiser its
``UpdateConfig``) and can still be overridden on the command line.
"""

from configs import common
from gagar_jax.feedback.step import MODES as FEEDBACK_MODES


def get_config(arg=None):
    arg = common.parse_arg(arg, words={"mode": FEEDBACK_MODES}, mode="span_kto", smoke=False)
    c = common.feedback_base()
    c.name = f"feedback_toy_{arg.mode}" + ("_smoke" if arg.smoke else "")
    c.objective.mode = arg.mode
    # 96 training tasks x 4 samples: the feedback dataset; 48 held-out tasks for evaluation
    c.task.update(num_train=96, num_eval=48)
    # one base policy and feedback dataset shared by every mode and seed of the study
    c.base.update(dir="runs/feedback_base", sft_steps=150)
    c.learner.learning_rate = 3e-4  # 60 steps from a warm-started policy
    if arg.smoke:
        c.task.update(num_train=8, num_eval=4)
        c.model.update(common.SMOKE_MODEL)
        c.base.update(
            dir="",
            sft_steps=3,
            sft_batch_size=8,
            sft_warmup_steps=1,
            samples_per_task=2,
            max_new_tokens=16,
        )
        c.loop.update(
            steps=3, batch_size=8, log_every=1, eval_every=2, checkpoint_every=2, eval_samples=1
        )
    return c
