#!/usr/bin/env bash
# One node: `onenode train` on every GPU of this machine through torchrun.
#   cluster/train_torchrun.sh a2_pretrain/recipes/baseline.yaml --out runs/baseline [--set key=value ...]
# NPROC (default: all visible GPUs) picks how many; the run resumes from its latest checkpoint.
# Under SLURM with several nodes, cluster/train_multinode.sbatch calls this script once per node
# with NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT set (c10d's rendezvous numbers the nodes
# itself, so torchrun notes that it ignores NODE_RANK). tests/test_multinode.py runs two such
# nodes on one machine.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 RECIPE.yaml [onenode train options]" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
NPROC=${NPROC:-$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
NNODES=${NNODES:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# Caches stay inside the kit, never in $HOME.
export ONENODE_CACHE=${ONENODE_CACHE:-$PWD/.cache/onenode}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}

if [ "$NNODES" -gt 1 ]; then
    rendezvous=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}"
                --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}"
                --rdzv-id "${RDZV_ID:-onenode-train}")
else
    rendezvous=(--standalone)
fi
exec "$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node "$NPROC" \
    -m onenode.cli train "$@"
