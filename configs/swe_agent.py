r"""Code-agent RL on Python repositories: HF checkpoint and tokenizer, SGLang, agentic grader.

    python scripts/train.py --config=configs/swe_agent.py --workdir=runs/swe \
        --config.model.hf_checkpoint=/models/Qwen2.5-Coder-1.5B-Instruct \
        --config.task.data_path=data/tasks/instances.jsonl \
        --config.task.repos_dir=data/tasks/repos \
        --config.rollout.sglang_url=http://127.0.0.1:30000 \
        --config.grading.sglang_url=http://127.0.0.1:30001

``:smoke`` is what ``make e2e`` runs (scripts/e2e.py passes the tiny model, the task pool, its
repositories and the server URL on the command line): the tiny random Qwen2 with its locally
trained BPE tokenizer, the two fixture repositories and one factory-made task of a real package
(its repository rebuilt from the registry, its own ``uv`` environment), 2 x 2 episodes per step,
a short SFT warm start on the tool-call demonstrations of the reference patches, 3 RL steps.

Each rollout is a multi-turn episode (``task.family = "python_repo"``): Qwen/Hermes
``<tool_call>`` JSON calls to ``read_file``, ``edit``, ``run_tests``, ``submit``; observations as
tool messages of the checkpoint's chat template; the submitted patch verified in the sandbox
with the hidden tests. Weights go to the SGLang server after every update through the engine's
sync protocol (``gagar_jax.rollout.SGLangEngine``); the agentic grader talks to
``grading.sglang_url`` in the same loop.
"""

import os

from configs import common, toy_gagar
from gagar_jax.rl.config import TRAINING_MODES


def get_config(arg=None):
    arg = common.parse_arg(arg, words={"mode": TRAINING_MODES}, mode="gagar", smoke=False)
    smoke = arg.smoke
    c = toy_gagar.get_config(arg.mode)
    c.name = "swe_agent_" + c.mode + ("_smoke" if smoke else "")
    # the pool: $GAGAR_TASKS (SWE-bench rows with their repositories in $GAGAR_TASK_REPOS, or
    # RepoTask JSONL without), else the real-package tasks `make tasks` builds in data/tasks/
    tasks, repos = os.environ.get("GAGAR_TASKS", ""), os.environ.get("GAGAR_TASK_REPOS", "")
    if not tasks and not smoke:
        tasks, repos = "data/tasks/instances.jsonl", repos or "data/tasks/repos"
    c.task.update(
        family="python_repo",
        data_path=tasks,
        repos_dir=repos,
        num_train=100_000,
        num_eval=0,
        max_turns=12,
        max_observation_tokens=1024,
    )
    c.model.hf_checkpoint = os.environ.get("GAGAR_HF_CHECKPOINT", "/models/policy")
    c.model.dtype = "bfloat16"
    c.rollout.update(
        engine="sglang",
        sglang_url=os.environ.get("GAGAR_ROLLOUT_URL", "http://127.0.0.1:30000"),
        num_prompts=32,
        num_rollouts=16,
        max_prompt_len=4096,
        max_new_tokens=16384,
        max_turn_tokens=2048,
        temperature=1.0,
        request_timeout_s=900.0,
    )
    c.sampling.update(enabled=True, allow_partial=True)
    c.grading.update(
        grader="agentic",
        sglang_url=os.environ.get("GAGAR_GRADER_URL", "http://127.0.0.1:30001"),
        max_concurrency=16,
        deadline_s=600.0,
    )
    c.learner.update(learning_rate=1e-6, warmup_steps=10, num_minibatches=4, num_microbatches=8)
    c.sft.steps = 0  # start from an SFT'd checkpoint, as the paper does
    c.loop.update(total_steps=200, eval_every=20, checkpoint_every=10, eval_rollouts=1)
    if smoke:
        # the tiny model seldom submits: every episode's final tree is verified, so each task's
        # rollouts (the factory-made one's too) run its tests in its environment
        c.task.update(max_turns=6, max_observation_tokens=256, autosubmit=True)
        c.model.dtype = "float32"
        # a low temperature: the briefly warm-started tiny model then emits the tool calls it
        # was shown (at 1.0 after 40 SFT steps none parsed); the update scores at the same T
        # 1280 + 768 tokens: the tiny model's 2048 positions; the factory-made task's prompt
        # (its issue and the release's file list) needs more than the fixtures' 700
        c.rollout.update(
            num_prompts=2,
            num_rollouts=2,
            max_prompt_len=1280,
            max_new_tokens=768,
            max_turn_tokens=256,
            temperature=0.3,
            request_timeout_s=300.0,
        )
        # plumbing, not learning: groups are kept as drawn (a tiny model rarely passes)
        c.sampling.update(enabled=False)
        c.grading.update(max_concurrency=2, deadline_s=30.0)
        c.learner.update(learning_rate=1e-4, warmup_steps=0, num_minibatches=1, num_microbatches=1)
        c.sft.update(steps=60, lr=3e-3, batch_size=2, warmup_steps=4)
        c.loop.update(total_steps=3, eval_every=100, checkpoint_every=1, plot=False)
    return c
