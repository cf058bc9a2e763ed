#!/usr/bin/env bash
# Starts an SGLang server for rollouts (and, on a second port, one for the agentic grader).
#
#   scripts/launch_sglang.sh MODEL_DIR [PORT] [extra sglang args...]
#
# SGLang lives in its OWN virtual environment (it pins torch and downgrades numpy; it must not
# share the JAX venv): create it once with
#   python3 -m venv .venv-sglang && .venv-sglang/bin/pip install sglang
# and set SGLANG_PY=.venv-sglang/bin/python (the default below).
#
# On GPU machines the defaults are fine. On a CPU-only machine (measured: ../shared/STACK.md)
# set SGLANG_CPU=1: it exports SGLANG_USE_CPU_ENGINE=1 and passes the flags that worked
# (torch_native attention, float32, small KV pool, CUDA graphs off). sgl_kernel has no CPU
# build; see STACK.md for the import-only stand-in needed on CPUs without AMX.
#
# Point the training config at it:
#   --config.rollout.engine=sglang --config.rollout.sglang_url=http://127.0.0.1:PORT
#   --config.grading.grader=agentic --config.grading.sglang_url=http://127.0.0.1:GRADER_PORT
# Weight sync: the loop exports safetensors to WORKDIR/sync/step_N and calls
# /update_weights_from_disk, so MODEL_DIR must be the same architecture as the policy.
# Routing replay of a mixture of experts (--config.learner.routing_replay=True): pass
# --enable-return-routed-experts; on a CPU-only machine also put scripts/sglang_cpu/host_memory
# on the server's PYTHONPATH (SGLang page-locks the routes' host buffer with CUDA otherwise).
set -euo pipefail
MODEL_DIR=${1:?usage: launch_sglang.sh MODEL_DIR [PORT] [extra args]}
PORT=${2:-30000}
shift $(( $# >= 2 ? 2 : 1 ))
SGLANG_PY=${SGLANG_PY:-.venv-sglang/bin/python}
ARGS=(--model-path "$MODEL_DIR" --host 127.0.0.1 --port "$PORT")
if [[ "${SGLANG_CPU:-0}" == "1" ]]; then
  export SGLANG_USE_CPU_ENGINE=1 HF_HUB_OFFLINE=1
  ARGS+=(--device cpu --attention-backend torch_native --sampling-backend pytorch
         --dtype float32 --max-total-tokens 8192 --context-length 2048
         --max-running-requests 16 --cuda-graph-backend-decode disabled
         --cuda-graph-backend-prefill disabled --skip-server-warmup)
fi
exec "$SGLANG_PY" -m sglang.launch_server "${ARGS[@]}" "$@"
