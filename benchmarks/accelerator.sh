#!/usr/bin/env bash
# The per-stage table on one accelerator, in one command that fits a 15-minute lease:
#
#     bash benchmarks/accelerator.sh OUTDIR [PYTHON [PARTS]]
#     DRY=1 bash benchmarks/accelerator.sh OUTDIR     # the CPU dry run: tiny shapes, seconds each
#
# PARTS: a comma list of env, peak, sampler_0.6b, update_0.6b, sync_0.6b, step_0.6b,
# sampler_1.7b, update_1.7b, sync_1.7b, step_1.7b, tunix (default all). At Qwen3-0.6B and 1.7B
# shapes in bfloat16 (random weights): the chip's measured bf16 matmul peak, the sampler's
# tokens/s at batch 64 with 1,024 new tokens, the update's tokens/s and MFU against that peak
# (full and LoRA), weight-sync seconds (whole weights and LoRA adapters, each verified), and the
# whole RL step (benchmarks/accelerator.py says what each part measures). Each part runs in a
# process of its own under its own time limit (the sum is under 8 minutes) and the run goes on
# when one fails, so a short lease brings back the parts that finished. Every part's output lands
# in OUTDIR/<part>.txt and its numbers in OUTDIR/results.jsonl.
set -u
out=${1:?usage: accelerator.sh OUTDIR [PYTHON [PARTS]]}
py=${2:-python3}
parts=${3:-}
dry=${DRY:-0}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
flags=()
[ "$dry" = 1 ] && flags+=(--dry)

part() {  # part NAME SECONDS COMMAND... (the dry run: 4x the limits, CPU compiles)
    local name=$1 secs=$2
    [ "$dry" = 1 ] && secs=$((secs * 4))
    shift 2
    echo "=== $name (limit ${secs} s) $(date -u +%H:%M:%S)"
    timeout -k 5 "$secs" "$@" 2>&1 | tee "$out/$name.txt" | grep -v -E '^(WARNING|I0000|W0000)'
    echo "=== $name rc=${PIPESTATUS[0]}"
}

want() { [ -z "$parts" ] || [[ ",$parts," == *",$1,"* ]]; }

flags+=(--json "$out/results.jsonl")
bench=("$py" benchmarks/accelerator.py)

want env && part env 15 bash -c "nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version \
    --format=csv 2>/dev/null; $py -c 'import jax, flax, optax; print(jax.__version__, jax.devices(), \
flax.__version__, optax.__version__)'"
peak=0
if want peak; then
    part peak 25 "${bench[@]}" peak "${flags[@]}"
    peak=$(sed -n 's/^RESULT .*"bf16_tflops": \([0-9.e+-]*\).*/\1/p' "$out/peak.txt" | tail -1)
    peak=${peak:-0}
fi
# Budget (seconds; each part's limit includes its process's start-up): env 15, peak 25, 0.6B
# 40 + 60 + 35 + 60, 1.7B 45 + 70 + 40 + 70, tunix 15: 475 at most, under 8 minutes.
limits_06=(40 60 35 60)
limits_17=(45 70 40 70)
for shape in 0.6b 1.7b; do
    if [ "$shape" = 0.6b ]; then lim=("${limits_06[@]}"); else lim=("${limits_17[@]}"); fi
    want "sampler_$shape" && part "sampler_$shape" "${lim[0]}" "${bench[@]}" sampler --shape "$shape" "${flags[@]}"
    want "update_$shape" && part "update_$shape" "${lim[1]}" "${bench[@]}" update --shape "$shape" --peak "$peak" \
        "${flags[@]}"
    want "sync_$shape" && part "sync_$shape" "${lim[2]}" "${bench[@]}" sync --shape "$shape" "${flags[@]}"
    want "step_$shape" && part "step_$shape" "${lim[3]}" "${bench[@]}" step --shape "$shape" "${flags[@]}"
done
want tunix && part tunix 15 "${bench[@]}" tunix "${flags[@]}"
echo "results: $out/results.jsonl"
