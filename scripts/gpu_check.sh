#!/usr/bin/env bash
# pgregistry's optimizer checks on a real backend (see scripts/gpu_check.py): 2 GPUs with NCCL by default.
#   bash scripts/gpu_check.sh                            # NCCL, 2 processes
#   NPROC=4 bash scripts/gpu_check.sh --backend gloo     # CPU, 4 processes
# Prints one PASS/FAIL line per check and exits non-zero when any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
    scripts/gpu_check.py "$@"
