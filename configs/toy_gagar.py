r"""The main job: Gagar on the toy code-repair family, embedded sampler + heuristic grader, CPU.

    python scripts/train.py --config=configs/toy_gagar.py --workdir=runs/toy_gagar
    python scripts/train.py --config=configs/toy_gagar.py:binary --workdir=runs/toy_binary
    python scripts/train.py --config=configs/toy_gagar.py:discount_only,smoke --workdir=/tmp/s

The argument is a comma-separated list: a mode (``gagar`` | ``binary`` | ``discount_only`` |
``gagar_token``), ``imbalanced`` and/or ``smoke`` (a seconds-long run for CI and tests).
``make train`` runs the default (about 10 minutes on 2 CPU cores); ``make compare`` runs the four
modes and compares them.

``imbalanced`` is the regime for the discount-only question (README "The discount-only
question"): the heuristic grader puts only the ``minimal`` patch kind in T1 (every other passing
kind is T2, the cheat T3), and the default warm start demonstrates ``minimal`` among the five
kinds, so RL with any quality signal drives the T1 share to ~0.9 and the discounted credit --
the imbalance ``discount_only`` is about -- vanishes. ``imbalanced`` warm-starts on the
``sprawling``, ``out_of_scope`` and ``side_effect`` kinds only (``task.demo_kinds``; no
``minimal``, no ``inconsistent``, its one-token reordering), with the weaker 150-step SFT, a
higher learning rate (1e-3) and ``IMBALANCED_STEPS`` RL steps.
"""

import ml_collections
from ml_collections import config_dict

MODES = ("gagar", "binary", "discount_only", "gagar_token")
IMBALANCED_DEMO_KINDS = "sprawling,out_of_scope,side_effect"
IMBALANCED_STEPS = 40


def parse_arg(arg):
    """'binary,smoke' -> ('binary', False, True): (mode, imbalanced, smoke). Unknown words are
    an error naming them."""
    words = [w.strip() for w in (arg or "").split(",") if w.strip()]
    mode, imbalanced, smoke = "gagar", False, False
    for w in words:
        if w in MODES:
            mode = w
        elif w == "smoke":
            smoke = True
        elif w == "imbalanced":
            imbalanced = True
        else:
            raise ValueError(f"config argument {w!r} not understood; expected one of "
                             f"{MODES + ('imbalanced', 'smoke')}")
    return mode, imbalanced, smoke


def get_config(arg=None):
    mode, imbalanced, smoke = parse_arg(arg)
    c = ml_collections.ConfigDict()
    c.name = (f"toy_{mode}" + ("_imbalanced" if imbalanced else "")
              + ("_smoke" if smoke else ""))
    c.mode = mode
    c.seed = 0

    # skip_saturated: pass over tasks whose last saturation_window rollouts all passed or all
    # failed (README "Skipping saturated tasks in training"); off: selection is unchanged
    c.task = dict(family="toy", seed=0, difficulty=1, num_train=512, num_eval=32,
                  skip_saturated=False, saturation_window=8, saturation_min_attempts=4,
                  demo_kinds="")
    c.model = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                   intermediate_size=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                   qkv_bias=False, tie_embeddings=True, dtype="float32",
                   param_dtype="float32", remat=False, hf_checkpoint="",
                   # execution (also applied to an hf_checkpoint): layers through nnx.scan
                   # (compile time flat in depth), the remat policy ("full", "dots", ...),
                   # causal attention in query blocks of this many tokens (0: one block)
                   scan_layers=False, remat_policy="full", causal_block_size=32,
                   # architecture of a from-scratch policy (an hf_checkpoint brings its own):
                   # Qwen3's per-head q/k RMSNorm; a mixture of experts when num_experts > 0
                   qk_norm=False, num_experts=0, num_experts_per_tok=2,
                   moe_intermediate_size=config_dict.placeholder(int), norm_topk_prob=True)
    c.rollout = dict(engine="embedded", sglang_url="", num_prompts=8, num_rollouts=8,
                     max_prompt_len=48, max_new_tokens=32, temperature=1.0, top_p=1.0,
                     top_k=0, request_timeout_s=120.0, weight_writer=0,
                     # the embedded sampler's rows over this many local devices (0: all)
                     embedded_data_parallel=1)
    c.sampling = dict(enabled=True, oversample=1.5, max_rounds=8, allow_partial=True)
    c.grading = dict(grader="heuristic", sglang_url="", max_concurrency=2, deadline_s=60.0,
                     enabled=True)
    # the update (gagar_jax.update.UpdateConfig; advantages: gagar_jax.advantages.GagarConfig).
    # Left to the run config: temperature (= rollout.temperature), decay_steps, advantages.mode
    # (the mode's redistribution) and token_credit (mode gagar_token: "evidence").
    c.learner = dict(learning_rate=3e-4, warmup_steps=3, weight_decay=0.0, max_grad_norm=1.0,
                     b1=0.9, b2=0.99, clip_low=0.2, clip_high=0.28, ppo_epochs=1,
                     num_minibatches=1, num_microbatches=1, kl_coef=0.0, entropy_coef=0.0,
                     aggregation="token-mean", schedule="constant", end_lr_ratio=0.1,
                     dual_clip=config_dict.placeholder(float), token_gamma=0.5,
                     # logits/log-softmax in chunks of this many tokens (0: whole sequence);
                     # MoE load-balancing loss weight (router metrics are logged either way)
                     logits_chunk_size=0, router_aux_loss_coef=0.0,
                     advantages=dict(estimator="mean_centered", tier_factors=(1.0, 0.6, 0.3),
                                     rank_decay=0.5, cheat_reward=0.0, mixed_tol=1e-6))
    if mode == "gagar_token":  # the importance provider of the token credit
        c.learner.token_credit = "evidence"
    c.sft = dict(steps=300, lr=3e-3, batch_size=32, warmup_steps=10)
    c.loop = dict(total_steps=60, log_every=1, eval_every=10, checkpoint_every=10,
                  keep_checkpoints=2, eval_rollouts=4, eval_temperature=0.7, plot=True)
    c.mesh = dict(shape=(1, -1, 1), coordinator_address="", num_processes=1, process_id=0,
                  host_timeout_s=900.0, heartbeat_timeout_s=100)
    # where verification, run_tests, grading and its checks run: local | ray (docs/cluster.md)
    c.execution = dict(backend="local", ray_address="auto", max_inflight=64, max_retries=3,
                       num_cpus=1.0, memory=0, resources={}, deadline_grace_s=10.0,
                       llm_requests_per_s=0.0)

    if imbalanced:
        c.task.demo_kinds = IMBALANCED_DEMO_KINDS
        c.sft.steps = 150
        c.learner.learning_rate = 1e-3
        c.loop.total_steps = IMBALANCED_STEPS
    if smoke:
        # Plumbing, not learning: a 3-step SFT policy rarely passes, so dynamic sampling is off
        # (each step takes its G groups as drawn) and eval rows = G*K reuse one sampler bucket.
        c.task.num_train, c.task.num_eval = 16, 8
        c.model.update(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64)
        c.rollout.update(num_prompts=2, num_rollouts=4, max_new_tokens=16)
        c.sampling.update(enabled=False, max_rounds=3)
        c.sft.update(steps=3, batch_size=8, warmup_steps=1)
        c.loop.update(total_steps=3, eval_every=2, checkpoint_every=1, eval_rollouts=1)
    return c
