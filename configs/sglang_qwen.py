r"""At scale: SGLang rollouts, the agentic grader through SGLang, a Hugging Face policy.

Start the servers first (see scripts/launch_sglang.sh), then:

    python scripts/train.py --config=configs/sglang_qwen.py --workdir=runs/qwen \
        --config.model.hf_checkpoint=/models/Qwen2.5-Coder-1.5B-Instruct \
        --config.rollout.sglang_url=http://127.0.0.1:30000 \
        --config.grading.sglang_url=http://127.0.0.1:30001

Only the config changes against the toy job: the engine, the grader, the model source and the
batch. Weights are synced to the rollout server after each update by exporting safetensors
to ``workdir/sync/`` and calling ``/update_weights_from_disk``.
"""

import importlib.util
import os


def _toy():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_gagar.py")
    spec = importlib.util.spec_from_file_location("_toy_gagar_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    words = [w for w in (arg or "").split(",") if w]
    c = _toy().get_config(",".join(words))
    c.name = "sglang_qwen_" + c.mode
    c.model.hf_checkpoint = os.environ.get("GAGAR_HF_CHECKPOINT", "/models/policy")
    c.model.dtype = "bfloat16"
    c.rollout.update(engine="sglang",
                     sglang_url=os.environ.get("GAGAR_ROLLOUT_URL", "http://127.0.0.1:30000"),
                     num_prompts=32, num_rollouts=16, max_prompt_len=4096,
                     max_new_tokens=4096, request_timeout_s=900.0)
    c.grading.update(grader="agentic",
                     sglang_url=os.environ.get("GAGAR_GRADER_URL", "http://127.0.0.1:30001"),
                     max_concurrency=16, deadline_s=600.0)
    c.optim.update(lr=1e-6, warmup_steps=10, num_minibatches=4, num_microbatches=8)
    c.sft.steps = 0  # start from an SFT'd checkpoint, as the paper does
    c.loop.update(total_steps=200, eval_every=20, checkpoint_every=10)
    if "smoke" in words:
        c.rollout.update(num_prompts=2, num_rollouts=4, max_prompt_len=512, max_new_tokens=64)
        c.optim.update(num_minibatches=1, num_microbatches=1)
        c.loop.update(total_steps=2, eval_every=1, checkpoint_every=1)
    return c
