#!/usr/bin/env bash
# Node health check before grading: driver and GPUs visible, torch sees them, NCCL all-reduce
# across all of them, enough free disk. Prints one line per check; exits non-zero on the first
# failure, with what to do.
#
#   cluster/health_check.sh [EXPECTED_GPUS] [MIN_FREE_GB] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
EXPECTED=${1:-8}
MIN_FREE_GB=${2:-100}
OUT_DIR=${3:-out}
PY=${PYTHON:-.venv/bin/python}

fail() { echo "FAIL: $*" >&2; exit 1; }

command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: no NVIDIA driver on this node"
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1) \
  || fail "nvidia-smi cannot talk to the driver: reboot or drain the node"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
echo "driver $driver, $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
[ "$gpus" -ge "$EXPECTED" ] || fail "$gpus GPU(s) visible, expected $EXPECTED: check CUDA_VISIBLE_DEVICES and the SLURM --gpus request"
busy=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)
[ "$busy" -eq 0 ] || echo "warning: $busy process(es) already use the GPUs; timings will be off"

"$PY" - "$EXPECTED" <<'PY' || fail "torch cannot use the GPUs: check the CUDA build of torch in the venv"
import sys, torch
n = torch.cuda.device_count()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} device(s) visible to torch")
sys.exit(0 if n >= int(sys.argv[1]) else 1)
PY

"$PY" -m torch.distributed.run --standalone --nproc_per_node="$EXPECTED" cluster/nccl_smoke.py \
  || fail "NCCL all-reduce failed: check NCCL_* settings, NVLink (nvidia-smi topo -m) and the driver"

mkdir -p "$OUT_DIR"
for dir in "$OUT_DIR" "${TMPDIR:-/tmp}"; do
  free_gb=$(df -Pk "$dir" | awk 'NR==2 {print int($4 / 1048576)}')
  echo "disk: $free_gb GB free in $dir"
  [ "$free_gb" -ge "$MIN_FREE_GB" ] || fail "only $free_gb GB free in $dir, need $MIN_FREE_GB: clean up or point TMPDIR elsewhere"
done
echo "node healthy"
