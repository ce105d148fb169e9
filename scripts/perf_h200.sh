#!/usr/bin/env bash
# The GPU figures of docs/performance.md's optimizer-step and grad-statistics sections, on one GPU (an H200):
#   bash scripts/perf_h200.sh                 # raw outputs into docs/measurements/
#   OUT_DIR=/tmp/out PYTHON=python3 bash scripts/perf_h200.sh
# Runs every benchmark even when one fails (each exits 1 when its paths disagree), then the GPU check on one rank
# (NCCL); exits non-zero when anything failed. About 6-8 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
# shellcheck source=scripts/record.sh
. scripts/record.sh
run optimizer_step_h200.txt "$py" benchmarks/optimizer_step.py --device cuda \
    --configs 1024x16x4,2048x8x8,2048x16x8,1024x8x4,4096x4x8,512x32x4
run grad_stats_h200.txt "$py" benchmarks/grad_stats.py --device cuda --dtype float32
run grad_stats_bf16_h200.txt "$py" benchmarks/grad_stats.py --device cuda --dtype bfloat16 --repeat 10
run grad_stats_mixed_h200.txt "$py" benchmarks/grad_stats.py --device cuda --dtype mixed --repeat 10
run grad_stats_model_h200.txt "$py" benchmarks/grad_stats_model.py --device cuda
run grad_stats_model_bf16_h200.txt "$py" benchmarks/grad_stats_model.py --device cuda --dtype bfloat16 --repeat 10
run dtensor_grad_norm_h200.txt bash -c "'$py' benchmarks/dtensor_grad_norm.py && '$py' benchmarks/dtensor_grad_norm.py --tensors 20000"
run gpu_check_h200x1_nccl.txt env NPROC=1 PYTHON="$py" bash scripts/gpu_check.sh
exit "$status"
