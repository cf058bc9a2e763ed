r"""Multi-host template: the paper's controlled-run batch (128 prompts x 16 rollouts) on a pod.

Start the same command on every host of the slice (one JAX process per host):

    python scripts/train.py --config=configs/tpu_pod.py --workdir=gs://bucket/runs/pod \
        --config.model.hf_checkpoint=/models/policy \
        --config.task.data_path=/data/repo_tasks/train.jsonl \
        --config.rollout.sglang_url=http://router:30000 \
        --config.grading.sglang_url=http://grader-router:30001

What a pod run needs (docs/how_to/clusters.md):

* **Processes.** On a TPU slice ``jax.distributed`` finds the coordinator, the number of
  processes and this host's index itself. Elsewhere (GPU/CPU clusters) set, on every host,
  ``JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=P JAX_PROCESS_ID=i`` (or
  ``--config.mesh.coordinator_address/num_processes/process_id``).
* **Mesh.** ``mesh.shape = (-1, 8, 2)``: ``data`` takes what is left of ``8 x 2``; the batch
  axes ``data x fsdp`` must split the ``G * K`` rows by process (the ``tensor`` axis stays inside
  a host: 2 of its chips). ``rollout.num_prompts`` must be a multiple of the processes.
* **Shared storage.** ``--workdir`` is one directory every host reads and writes (GCS, NFS):
  every host writes its shards of the orbax checkpoint there, and the SGLang servers read the
  weight exports from ``workdir/sync`` (so it must be readable by the servers too).
* **SGLang.** Every host sends its block of prompts to ``rollout.sglang_url`` (a router in front
  of the servers). After each update the weights are streamed tensor by tensor (every host takes
  part in each tensor's gather, no host holds the whole model); ``rollout.weight_writer``
  (default process 0) alone writes the export and calls ``/update_weights_from_disk``; the other
  hosts wait for its outcome and for the servers to report the new version before they sample
  again; a failed update is the same error on every host.
* **Deadlines.** ``mesh.host_timeout_s`` (default 900 s) must exceed a generation round, the
  grading deadline and a checkpoint save; a host dead or hung past it ends the run on every
  other host with an error naming it (exit status 3). Restart all hosts to resume.

``:smoke`` runs as two CPU processes on one machine (what ``tests/test_train_multiprocess.py``
runs): the same multi-host machinery -- the mesh spanning both processes with the ``fsdp`` axis
across them, the sharded update with rematerialisation and 2 micro-batches of gradient
accumulation, per-host rollout blocks, verdict exchange, device-to-device weight sync,
checkpoints -- on the toy family with the embedded sampler and the heuristic grader, so its
tokenizer, model and rollouts are self-consistent without any server or checkpoint:

    for i in 0 1; do JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
      JAX_COORDINATOR_ADDRESS=127.0.0.1:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$i \
      python scripts/train.py --config=configs/tpu_pod.py:smoke --workdir=/tmp/pod & done; wait

``:smoke,sglang`` is the same run with SGLang rollouts, for a served Hugging Face checkpoint:
pass ``--config.model.hf_checkpoint=DIR`` (the model the server serves; the toy family then
speaks its tokenizer) and ``--config.rollout.sglang_url=URL``
(``tests/test_train_multiprocess_sglang.py``: two processes, one real server, the tiny random
Qwen2 of ``make e2e``).
"""

import os

from configs import common, swe_agent, toy_gagar
from gagar_jax.rl.config import TRAINING_MODES


def get_config(arg=None):
    arg = common.parse_arg(
        arg, words={"mode": TRAINING_MODES}, mode="gagar", smoke=False, sglang=False
    )
    if arg.sglang and not arg.smoke:
        raise ValueError(
            "tpu_pod.py: 'sglang' is a variant of 'smoke' (the full config "
            "already rolls out on SGLang)"
        )
    if not arg.smoke:
        c = swe_agent.get_config(arg.mode)
        c.name = "tpu_pod_" + c.mode
        c.rollout.update(
            num_prompts=128, num_rollouts=16, max_prompt_len=8192, max_new_tokens=16384
        )
        c.model.remat = True
        c.mesh.shape = (-1, 8, 2)  # data x fsdp x tensor; data takes the remaining devices
        c.learner.update(num_minibatches=8, num_microbatches=16)
        c.grading.max_concurrency = 64
        c.loop.update(total_steps=300)
        return c

    # the toy smoke run (toy family, embedded sampler, heuristic grader, tiny model) with the
    # pod's structure
    c = toy_gagar.get_config(arg.mode + ",smoke")
    c.name = "tpu_pod_" + c.mode + "_smoke"
    c.model.remat = True
    c.mesh.shape = (1, -1, 1)  # fsdp over every device of every process
    c.learner.update(num_minibatches=1, num_microbatches=2)
    c.rollout.num_prompts = 2  # a multiple of the 2 processes: one group per host
    c.loop.update(total_steps=2, eval_every=1, checkpoint_every=1, plot=False)
    if arg.sglang:
        c.name += "_sglang"
        c.rollout.update(
            engine="sglang",
            sglang_url=os.environ.get("GAGAR_ROLLOUT_URL", "http://127.0.0.1:30000"),
            # the toy prompt through a BPE tokenizer and chat template: ~70 ids
            max_prompt_len=128,
        )
        c.model.hf_checkpoint = os.environ.get("GAGAR_HF_CHECKPOINT", "")
        c.sft.steps = 0  # the served checkpoint is the start (the plumbing is under test)
    return c
