#!/usr/bin/env bash
# Builds .venv-sglang: a real SGLang server for CPU-only machines, beside (never inside) the JAX venv.
#
# Why a separate venv: sglang pins torch and downgrades numpy, which must not touch the JAX stack.
# Why the stand-in: SGLANG_USE_CPU_ENGINE=1 imports a handful of names from `sgl_kernel` at load
# time; no CPU build of sgl_kernel is published. On a CPU without AMX those kernels are never called,
# so scripts/sgl_kernel_stub/sgl_kernel raises if any of them ever is (see gagar_jax/rollout/sglang_server.py).
#
# Usage: scripts/setup_sglang.sh [VENV_DIR]   (default .venv-sglang; idempotent via a stamp file)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.installed"
REQS=scripts/sglang-requirements.txt
if [[ -f "$STAMP" && "$STAMP" -nt "$REQS" && "$STAMP" -nt "$0" ]]; then
  echo "setup_sglang: $VENV up to date"; exit 0
fi
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$REQS"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("sglang", "sglang-router", "torch", "transformers", "tokenizers", "safetensors"):
    print(f"setup_sglang: {name}=={md.version(name)}")
PY
touch "$STAMP"
echo "setup_sglang: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
