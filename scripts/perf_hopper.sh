#!/usr/bin/env bash
# The GPU figures of docs/performance.md's optimizer-step and grad-statistics sections, on one Hopper GPU (an H100 or
# an H200; the raw outputs are named for the card, e.g. grad_stats_model_h100.txt):
#   bash scripts/perf_hopper.sh                       # raw outputs into docs/measurements/
#   OUT_DIR=/tmp/out PYTHON=python3 bash scripts/perf_hopper.sh
#   ONLY=grad_stats_model bash scripts/perf_hopper.sh # only the runs whose output file names contain ONLY
#   CARD=h200 bash scripts/perf_hopper.sh             # name the outputs for another card than nvidia-smi's
# Runs every benchmark even when one fails (each exits 1 when its paths disagree or a row's work did not happen),
# then the GPU check on one rank (NCCL); exits non-zero when anything failed. About 8-10 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
export NCCL_NVLS_ENABLE=0
card="${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200' | tr 'A-Z' 'a-z')}"
if [ -z "$card" ]; then
    echo "perf_hopper.sh: no H100 or H200 found by nvidia-smi; set CARD=h100 or CARD=h200" >&2
    exit 2
fi
# shellcheck source=scripts/record.sh
. scripts/record.sh
only() { [[ "$1" == *"${ONLY:-}"* ]]; }
perf() {  # perf FILE COMMAND...: run (scripts/record.sh) unless ONLY leaves it out
    only "$1" && run "$@"
    return 0
}
perf "optimizer_step_$card.txt" "$py" benchmarks/optimizer_step.py --device cuda \
    --configs 1024x16x4,2048x8x8,2048x16x8,1024x8x4,4096x4x8,512x32x4
perf "grad_stats_$card.txt" "$py" benchmarks/grad_stats.py --device cuda --dtype float32 --configs 1024x8
perf "grad_stats_bf16_$card.txt" "$py" benchmarks/grad_stats.py --device cuda --dtype bfloat16 --repeat 10 --configs 1024x32
perf "grad_stats_mixed_$card.txt" "$py" benchmarks/grad_stats.py --device cuda --dtype mixed --repeat 10
perf "grad_stats_model_$card.txt" "$py" benchmarks/grad_stats_model.py --device cuda --pieces --stages
perf "grad_stats_model_bf16_$card.txt" "$py" benchmarks/grad_stats_model.py --device cuda --dtype bfloat16 --repeat 10
perf "dtensor_grad_norm_$card.txt" bash -c \
    "'$py' benchmarks/dtensor_grad_norm.py && '$py' benchmarks/dtensor_grad_norm.py --tensors 20000"
perf "gpu_check_${card}x1_nccl.txt" env NPROC=1 PYTHON="$py" bash scripts/gpu_check.sh
exit "$status"
