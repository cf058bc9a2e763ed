#!/usr/bin/env bash
# The race of the whole step against TRL and Tunix on an accelerator (the earlier accelerator.sh;
# benchmarks/accelerator.sh is now the per-stage table at Qwen3 shapes), in one command that fits a short lease:
#
#     bash benchmarks/accelerator_race.sh OUTDIR [PYTHON [PARTS]]
#
# PARTS: a comma list of env, update_f32, race_rl, race_multiturn, update_bf16 (default all).
#
# PYTHON (default python3) must have jax with its GPU plugin, torch with CUDA, transformers,
# flax, optax and orbax, plus TRL and Tunix for the race (on PYTHONPATH is enough: the race's
# workers inherit it through GAGAR_BENCH_PYTHON instead of building their own environments).
# Each part has its own time limit and the run goes on when one fails, so a short lease still
# brings back the parts that finished. Everything printed lands in OUTDIR/*.txt.
set -u
out=${1:?usage: accelerator_race.sh OUTDIR [PYTHON [PARTS]]}
py=${2:-python3}
parts=${3:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."

part() {  # part NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    echo "=== $name (limit ${secs} s) $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    timeout -k 10 "$secs" "$@" 2>&1 | tee "$out/$name.txt" | grep -v -E '^(WARNING|I0000|W0000)'
    echo "=== $name rc=${PIPESTATUS[0]}"
}

want() { [ -z "$parts" ] || [[ ",$parts," == *",$1,"* ]]; }

want env && part env 40 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version \
    --format=csv; $py -c 'import jax, torch, transformers, flax, optax; \
print(jax.__version__, jax.devices(), torch.__version__, torch.cuda.is_available(), \
transformers.__version__, flax.__version__, optax.__version__)'; \
$py -c 'import trl, tunix; print(\"trl\", trl.__version__, \"tunix ok\")'"
# The update against PyTorch at 5M and ~100M (float32: TF32 products on both sides), all in one
# process (each process's start and CUDA set-up costs tens of seconds on such a machine).
want update_f32 && part update_f32 240 "$py" benchmarks/update.py --in-process --no-scan \
    --configs small,100m --steps 5 --depths '' --logits-vocabs ''
# The whole step raced against TRL and Tunix, one shape per part. On a GPU a round takes about a
# second and the workers' start-up and compiles take the rest of the limit: 9 rounds, not 3, for
# medians that one slow round does not move.
export GAGAR_BENCH_PYTHON=$py
for shape in rl multiturn; do
    secs=150
    [ "$shape" = multiturn ] && secs=240  # longer sequences: slower compiles and steps
    want "race_$shape" && part "race_$shape" "$secs" "$py" benchmarks/rl_step.py --rounds 9 --notes --warm-together \
        --shapes "$shape" --json "$out/race_$shape.json"
done
# The update in bfloat16 at a batch that fills the GPU.
want update_bf16 && part update_bf16 150 "$py" benchmarks/update.py --in-process --no-scan \
    --configs small,100m --steps 5 --depths '' --logits-vocabs '' --dtype bfloat16 --batch-scale 16
# The race's worker logs (their ends), for a part that failed.
tail -n 40 runs/bench_rl_step/logs/*.log > "$out/worker_logs.txt" 2>&1
