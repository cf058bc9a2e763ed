r"""Multi-host template: the paper's controlled-run batch (128 prompts x 16 rollouts) on a pod.

On every host of the slice (TPU sets the coordinator itself; on GPU/CPU clusters pass
``--config.mesh.coordinator_address=host0:1234 --config.mesh.num_processes=N
--config.mesh.process_id=i`` or the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID environment variables):

    python scripts/train.py --config=configs/tpu_pod.py --workdir=gs://bucket/runs/pod \
        --config.model.hf_checkpoint=/models/policy

Rollouts and grading go to SGLang servers (router URLs); the update is sharded over the mesh
('data', 'fsdp', 'tensor'); only process 0 writes logs and checkpoint metadata.
"""

import importlib.util
import os


def _sglang():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_qwen.py")
    spec = importlib.util.spec_from_file_location("_sglang_qwen_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config(arg=None):
    words = [w for w in (arg or "").split(",") if w]
    c = _sglang().get_config(",".join(w for w in words if w != "smoke"))
    c.name = "tpu_pod_" + c.mode
    c.rollout.update(num_prompts=128, num_rollouts=16, max_prompt_len=8192,
                     max_new_tokens=16384)
    c.model.remat = True
    c.mesh.shape = (-1, 8, 2)  # data x fsdp x tensor; data takes the remaining devices
    c.learner.update(num_minibatches=8, num_microbatches=16)
    c.grading.max_concurrency = 64
    c.loop.update(total_steps=300)
    if "smoke" in words:
        c.rollout.update(num_prompts=4, num_rollouts=4, max_prompt_len=512, max_new_tokens=64)
        c.mesh.shape = (1, -1, 1)
        c.learner.update(num_minibatches=1, num_microbatches=1)
        c.loop.update(total_steps=2, eval_every=1, checkpoint_every=1)
    return c
