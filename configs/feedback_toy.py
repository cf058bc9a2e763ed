r"""Feedback training on the toy family: SFT, RW-SFT, Span-KTO and the paper's two baselines.

    python scripts/train_feedback.py --config=configs/feedback_toy.py:span_kto --workdir=runs/fb/kto
    python scripts/train_feedback.py --config=configs/feedback_toy.py:rw_sft,smoke --workdir=/tmp/s
    make feedback-compare        # the five modes x 3 seeds on one shared feedback dataset

The argument is a comma-separated list: a mode (``sft`` | ``rw_sft`` | ``span_kto`` |
``sft_drop_negative`` | ``sft_penalize_negative``; default ``span_kto``) and/or ``smoke`` (a
seconds-long run for CI). Every mode shares ``base.dir``: one warm-started policy and one dataset
of simulated-user feedback on its samples, built by the first run that needs it.
"""

import ml_collections

from configs import common
from gagar_jax.feedback.step import MODES as FEEDBACK_MODES


def get_config(arg=None):
    arg = common.parse_arg(arg, words={"mode": FEEDBACK_MODES}, mode="span_kto", smoke=False)
    mode, smoke = arg.mode, arg.smoke
    c = ml_collections.ConfigDict()
    c.name = f"feedback_toy_{mode}" + ("_smoke" if smoke else "")
    c.seed = 0
    c.mesh_shape = (1, -1, 1)
    c.task = dict(difficulty=1, seed=0, num_train=96, num_eval=48)
    c.model = dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    c.base = dict(
        dir="runs/feedback_base",
        sft_steps=150,
        sft_lr=3e-3,
        sft_batch_size=32,
        sft_warmup_steps=10,
        samples_per_task=4,
        temperature=1.0,
        max_prompt_len=48,
        max_new_tokens=32,
    )
    c.data = dict(jsonl="", max_spans=16, uncovered="neutral")
    # Who gives the feedback: "rule" (gagar_jax.envs.simulated_user) or "llm" (a chat model at
    # sglang_url, gagar_jax.envs.llm_user; re-asked once, then the rule-based user, counted).
    c.feedback = dict(
        user="rule",
        sglang_url="",
        max_attempts=2,
        max_tokens=512,
        temperature=0.0,
        request_timeout_s=120.0,
        prompt_version="v1",
    )
    c.objective = dict(
        mode=mode,
        w_pos=1.5,
        w_neu=1.0,
        w_neg=0.1,
        penalty=1.0,
        beta=0.1,
        lambda_w=1.0,
        lambda_l=1.0,
        alpha=0.9,
        neutral_coef=1.0,
        reference_point="ema",
        reward_norm="sum",
        ref_logprobs="inside",
    )
    c.optim = dict(
        lr=3e-4,
        warmup_steps=0,
        schedule="constant",
        weight_decay=0.0,
        grad_clip=1.0,
        b1=0.9,
        b2=0.99,
    )
    c.loop = dict(
        steps=60,
        batch_size=32,
        log_every=5,
        eval_every=20,
        checkpoint_every=20,
        keep_checkpoints=2,
        eval_samples=2,
        eval_temperature=0.7,
    )
    if smoke:
        c.task.update(num_train=8, num_eval=4)
        c.model.update(
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=16,
            intermediate_size=64,
        )
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
