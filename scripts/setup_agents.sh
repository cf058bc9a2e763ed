#!/usr/bin/env bash
# Builds .venv-agents: the reference agent harness (mini-swe-agent, pinned in setup.py's `agents`
# extra) in a venv of its own, beside (never inside) the JAX venv: its litellm pins stay out of the
# trainer's packages. The harness runs inside the sandbox, which binds this venv read-only.
#
# Usage: scripts/setup_agents.sh [VENV_DIR]   (default .venv-agents; idempotent via a stamp file)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-agents}"
# /usr/bin/python3: an interpreter the sandbox's unprivileged uid can run (a pyenv one under /root
# is not visible inside the sandbox).
PYTHON="${AGENTS_PYTHON:-/usr/bin/python3}"
STAMP="$VENV/.installed"
PIN="mini-swe-agent==2.4.6"
if [[ -f "$STAMP" && "$STAMP" -nt "$0" ]]; then
  echo "setup_agents: $VENV up to date"; exit 0
fi
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$PIN" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import importlib.metadata as md; print('setup_agents: mini-swe-agent', md.version('mini-swe-agent'))"
touch "$STAMP"
echo "setup_agents: built $VENV in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
