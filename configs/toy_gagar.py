r"""The main job: Gagar on the toy code-repair family, embedded sampler + heuristic grader, CPU.

    python scripts/train.py --config=configs/toy_gagar.py --workdir=runs/toy_gagar
    python scripts/train.py --config=configs/toy_gagar.py:binary --workdir=runs/toy_binary
    python scripts/train.py --config=configs/toy_gagar.py:discount_only,smoke --workdir=/tmp/s
    python scripts/train.py --config=configs/toy_gagar.py:gagar_token,distinguishing \
        --workdir=runs/toy_distinguishing

The argument is a comma-separated list: a mode (``gagar`` | ``binary`` | ``discount_only`` |
``gagar_token``), ``imbalanced``, ``distinguishing``, ``weak_start`` and/or ``smoke`` (a
seconds-long run for CI and tests).

``distinguishing`` (mode ``gagar_token`` only) selects the contrastive token credit instead of
the evidence importance: ``learner.token_credit=distinguishing`` at ``learner.token_gamma=1``,
Gagar's redistribution moved onto the tokens where a pass parts from the passes of another
quality, the tokens they share left at the binary advantage
(``gagar_jax.advantages.contrastive_tokens``; docs/results/token_credit.md).
``make train`` runs the default (about 10 minutes on 2 CPU cores); ``make compare`` runs the four
modes and compares them.

``imbalanced`` is the regime for the discount-only question (docs/results/discount_only.md):
the heuristic grader puts only the ``minimal`` patch kind in T1 (every other passing kind is
T2, the cheat T3), and the default warm start demonstrates ``minimal`` among the five kinds, so
RL with any quality signal drives the T1 share to ~0.9 and the discounted credit -- the
imbalance ``discount_only`` is about -- vanishes. ``imbalanced`` warm-starts on the
``sprawling``, ``out_of_scope`` and ``side_effect`` kinds only (``task.demo_kinds``; no
``minimal``, no ``inconsistent``, its one-token reordering), with the weaker 150-step SFT, a
higher learning rate (1e-3) and ``IMBALANCED_STEPS`` RL steps.

``weak_start`` is the setting where RL visibly raises the held-out pass rate
(docs/results/heldout_gain.md): the weaker 150-step warm start (pass rate ~0.28 on training
tasks, against ~0.53 after 300 steps), chosen on the training split, and a held-out
evaluation of ``WEAK_START_EVAL_TASKS`` tasks x 4 samples at the SFT start and the end only
(two standard errors of the change ~0.03, against ~0.12 for the default 32 tasks). Every
checkpoint is kept, so ``scripts/heldout_gain.py`` can re-evaluate the SFT start (step 0) and
the end on the same draws.

Every field not set here is :class:`gagar_jax.rl.config.RunConfig`'s default
(``configs/common.py``) and can still be overridden on the command line.
"""

from configs import common
from gagar_jax.rl.config import TRAINING_MODES

IMBALANCED_DEMO_KINDS = "sprawling,out_of_scope,side_effect"
IMBALANCED_STEPS = 40
WEAK_START_SFT_STEPS = 150
WEAK_START_EVAL_TASKS = 512


def get_config(arg=None):
    arg = common.parse_arg(
        arg,
        words={"mode": TRAINING_MODES},
        mode="gagar",
        imbalanced=False,
        distinguishing=False,
        weak_start=False,
        smoke=False,
    )
    if arg.distinguishing and arg.mode != "gagar_token":
        raise ValueError(
            f"config argument 'distinguishing' is a token credit: it needs mode gagar_token, "
            f"got mode {arg.mode!r}"
        )
    c = common.base()
    c.name = (
        f"toy_{arg.mode}"
        + ("_imbalanced" if arg.imbalanced else "")
        + ("_distinguishing" if arg.distinguishing else "")
        + ("_weak_start" if arg.weak_start else "")
        + ("_smoke" if arg.smoke else "")
    )
    c.mode = arg.mode

    c.task.num_train = 512  # a pool large enough that 60 steps x 8 prompts rarely repeat a task
    # A policy from scratch twice the default's width: small enough for 2 CPU cores, large
    # enough to learn every passing patch kind in the warm start.
    c.model.update(hidden_size=128, head_dim=32, intermediate_size=256)
    # A toy prompt fits 48 tokens and a line-edit patch 32.
    c.rollout.update(max_prompt_len=48, max_new_tokens=32)
    # A step may go on with fewer mixed groups than asked when the refill rounds run out.
    c.sampling.allow_partial = True
    c.grading.max_concurrency = 2  # one grader per CPU core
    c.learner.update(learning_rate=3e-4, warmup_steps=3)  # a short run from a small policy
    if arg.mode == "gagar_token":  # the importance provider of the token credit
        c.learner.token_credit = "evidence"
    if arg.distinguishing:  # the contrastive token credit, at full strength
        c.learner.update(token_credit="distinguishing", token_gamma=1.0)
    c.sft.update(steps=300, lr=3e-3)  # the warm start: demonstrations of five patch kinds
    # 60 RL steps, evaluated (32 tasks x 4 samples) and checkpointed every 10.
    c.loop.update(total_steps=60, checkpoint_every=10, eval_rollouts=4)

    if arg.imbalanced:
        c.task.demo_kinds = IMBALANCED_DEMO_KINDS
        c.sft.steps = 150
        c.learner.learning_rate = 1e-3
        c.loop.total_steps = IMBALANCED_STEPS
    if arg.weak_start:
        c.sft.steps = WEAK_START_SFT_STEPS
        c.task.num_eval = WEAK_START_EVAL_TASKS
        # held-out evaluations at the SFT start and the end only; every checkpoint kept
        c.loop.update(eval_every=c.loop.total_steps, keep_checkpoints=c.loop.total_steps)
    if arg.smoke:
        # Plumbing, not learning: a 3-step SFT policy rarely passes, so dynamic sampling is off
        # (each step takes its G groups as drawn) and eval rows = G*K reuse one sampler bucket.
        c.task.num_train, c.task.num_eval = 16, 8
        c.model.update(common.SMOKE_MODEL)
        c.rollout.update(num_prompts=2, num_rollouts=4, max_new_tokens=16)
        c.sampling.update(enabled=False, max_rounds=3)
        c.sft.update(steps=3, batch_size=8, warmup_steps=1)
        c.loop.update(total_steps=3, eval_every=2, checkpoint_every=1, eval_rollouts=1)
    return c
