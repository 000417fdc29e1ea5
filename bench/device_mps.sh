#!/usr/bin/env bash
# One device call: the job path with head and tail sharing one GPU, as the CUDA driver time-slices two processes
# (plain) and under NVIDIA's Multi-Process Service (mps: one daemon of this call's own, private pipe directory,
# stopped at the end), so the two workers' kernels can run side by side. Issue 26's setup (bench/device_round.sh).
#   OUT=$OUT bash bench/device_mps.sh [JOBS_S_EACH]            # NS=1,64,256 by default; ORDER="mps plain" ...
# MPS changes no setting of the card (compute mode, clocks): it is a user-space daemon that the workers' CUDA
# contexts connect to through CUDA_MPS_PIPE_DIRECTORY; without it they get contexts of their own.
set -uo pipefail
OUT=${OUT:-bench/out/device_mps}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,compute_mode --format=csv,noheader
mps_on() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/sf-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/sf-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || return 1
  python3 -c "import torch; x = torch.ones(4, device='cuda'); print('mps check', float(x.sum()))" || return 1
}
mps_off() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
for v in ${ORDER:-plain mps}; do
  echo "== $v"
  if [ "$v" = mps ]; then
    mps_on || { echo "MPS could not start"; cat /tmp/sf-mps/log/control.log 2>/dev/null | tail -5; mps_off; continue; }
  fi
  OUT=$OUT/$v bash bench/device_round.sh "${1:-200}" 0 0
  [ "$v" = mps ] && { tail -3 /tmp/sf-mps/log/control.log 2>/dev/null; mps_off; }
done
