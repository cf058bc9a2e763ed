r"""At scale: SGLang rollouts, the agentic grader through SGLang, a Hugging Face policy.

Start the servers first (see scripts/launch_sglang.sh), then:

    python scripts/train.py --config=configs/sglang_qwen.py --workdir=runs/qwen \
        --config.model.hf_checkpoint=/models/Qwen2.5-Coder-1.5B-Instruct \
        --config.task.data_path=/data/repo_tasks/train.jsonl \
        --config.rollout.sglang_url=http://127.0.0.1:30000 \
        --config.grading.sglang_url=http://127.0.0.1:30001

The repository-task job of ``configs/swe_agent.py`` (python_repo family: prompts through the
checkpoint's own tokenizer and chat template, never the toy tokenizer); kept under this name for
existing launch scripts.
"""

import importlib.util
import os


def _swe():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swe_agent.py")
    spec = importlib.util.spec_from_file_location("_swe_agent_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    c = _swe().get_config(arg)
    c.name = c.name.replace("swe_agent", "sglang_qwen", 1)
    return c
