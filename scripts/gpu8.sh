#!/usr/bin/env bash
# The 8-GPU runs of issue 23, each printing a table and PASS/FAIL lines; raw outputs into docs/measurements/:
#   bash scripts/gpu8.sh                                             # 8 GPUs, NCCL
#   NPROC=4 LAYOUTS="tp=2,ep=2,expt_tp=1 tp=2,pp=2" OUT_DIR=/tmp/out bash scripts/gpu8.sh   # a smaller world
# 1. Megatron-Core GPT with routed experts, 20 steps, on its own initialize_model_parallel and on pgregistry's
#    collection through to_megatron, per layout (megatron_parity_*); 2. communicators and start-up of both paths of
#    pgregistry against initialize_model_parallel (communicators_*); 3. DTensor TP + FSDP2 + EP against the float64
#    oracle (dtensor_*); 4. scripts/gpu_check.sh and `pgregistry verify --backend nccl` on three layouts.
# Runs everything even when one fails; exits non-zero when anything failed. Needs megatron-core for 1 and 2.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
n="${NPROC:-8}"
case "${1:-}" in -h | --help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')"
if [ "$gpus" -lt "$n" ]; then
    echo "gpu8.sh: needs $n NVIDIA GPUs (NCCL), nvidia-smi lists $gpus; set NPROC for a smaller world" >&2
    exit 2
fi
tag="${TAG:-h200x$n}"
layouts="${LAYOUTS:-tp=2,ep=4,expt_tp=1 tp=2,pp=2,ep=2}"
verify_layouts="${VERIFY_LAYOUTS:-tp=2,ep=4,expt_tp=1 tp=2,pp=2,ep=2 tp=2,gtp_remat=2,ep=2,expt_gtp_remat=2}"
export NCCL_NVLS_ENABLE=0
# shellcheck source=scripts/record.sh
. scripts/record.sh
name() { echo "$1" | sed 's/=//g; s/,/-/g'; }                                  # tp=2,ep=4 -> tp2-ep4
flags() { echo "--$1" | sed 's/,/ --/g; s/=/ /g; s/_/-/g'; }               # tp=2,expt_tp=1 -> --tp 2 --expt-tp 1
launch=("$py" -m torch.distributed.run --standalone --nproc-per-node "$n")
for layout in $layouts; do
    run "megatron_parity_$(name "$layout")_$tag.txt" "${launch[@]}" scripts/megatron_parity.py --layout "$layout"
done
# shellcheck disable=SC2086  # one argument per layout
run "communicators_$tag.txt" "$py" scripts/communicators.py --nproc "$n" --layouts $layouts
for layout in $layouts; do
    case "$layout" in *pp=*) continue ;; esac  # the DTensor check takes no pipeline
    run "dtensor_tp_fsdp_ep_$(name "$layout")_$tag.txt" "${launch[@]}" scripts/dtensor_tp_fsdp_ep.py --layout "$layout"
done
run "gpu_check_${tag}_nccl.txt" env NPROC="$n" PYTHON="$py" bash scripts/gpu_check.sh
for layout in $verify_layouts; do
    # shellcheck disable=SC2046  # the layout's flags, one word each
    run "verify_${tag}_nccl_$(name "$layout").txt" "${launch[@]}" -m pgregistry verify --backend nccl $(flags "$layout")
done
exit "$status"
