#!/usr/bin/env bash
# DiLoCo across nodes (`parallel.diloco`, starter_code/onenode/parallel/diloco.py): this node is one
# replica group, a torchrun over its own GPUs (cluster/train_torchrun.sh, standalone: no rendezvous
# with the other nodes); the groups meet every H steps at a torchft lighthouse that replica group 0's
# node starts. Under SLURM, one group per node:
#   sbatch --nodes 2 --export=ALL,DILOCO=1 cluster/train_multinode.sbatch a2_pretrain/recipes/baseline.yaml \
#       --out runs/diloco-2n --set parallel.diloco.inner_steps=32 --set parallel.diloco.replicas=2
# By hand, on each of R nodes, group 0 on the node LIGHTHOUSE_HOST names:
#   REPLICA_GROUP_ID=r LIGHTHOUSE_HOST=node-a cluster/train_diloco.sh RECIPE.yaml --out runs/x [--set ...]
# Needs torchft (`pip install -e ".[diloco]"`). The recipe's parallel.diloco.replicas must be the number
# of nodes (NNODES, when set), and is checked here before anything starts. Every group writes under the
# same --out (group r > 0 in replica_r/): put it where every node sees it (the replay reads all groups).
# LIGHTHOUSE_PORT (default 29510) must be open between the nodes, and so must the ports torchft's
# managers pick; TORCHFT_LIGHTHOUSE=http://HOST:PORT of a lighthouse running elsewhere starts none here.
# A group that dies makes the others wait at the next sync (up to an hour); rerun this script on its
# node and it resumes from its last checkpoint (SLURM kills the whole job instead: resubmit it, and
# every group resumes). tests/test_diloco_launch.py runs two such nodes on one machine.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: REPLICA_GROUP_ID=r LIGHTHOUSE_HOST=HOST $0 RECIPE.yaml [onenode train options]" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
replica=${REPLICA_GROUP_ID:-${NODE_RANK:-}}
if ! [[ "$replica" =~ ^[0-9]+$ ]]; then
    echo "error: set REPLICA_GROUP_ID (or NODE_RANK) to this node's replica group, 0 .. R-1" >&2
    exit 2
fi
plan=$("$PYTHON" -m onenode.cli train "$@" --check)
replicas=$(sed -n 's/^DiLoCo: \([0-9]*\) replica groups.*/\1/p' <<<"$plan")
if [ -z "$replicas" ]; then
    echo "error: $1 trains without DiLoCo: add --set parallel.diloco.inner_steps=H (and parallel.diloco.replicas=R)," \
         "or launch it with cluster/train_multinode.sbatch without DILOCO=1" >&2
    exit 2
fi
if [ -n "${NNODES:-}" ] && [ "$NNODES" != "$replicas" ]; then
    echo "error: $NNODES nodes for parallel.diloco.replicas $replicas: launch one node per replica group" \
         "(sbatch --nodes $replicas) or --set parallel.diloco.replicas=$NNODES" >&2
    exit 2
fi
port=${LIGHTHOUSE_PORT:-29510}
if [ -z "${TORCHFT_LIGHTHOUSE:-}" ] && [ "$replica" = 0 ]; then
    # torchft's lighthouse (what `torchft_lighthouse --min_replicas R` runs), until this group ends
    "$PYTHON" -c 'import sys, threading
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind=sys.argv[1], min_replicas=int(sys.argv[2]))
print(f"torchft lighthouse at {server.address()} for {sys.argv[2]} replica groups", flush=True)
threading.Event().wait()' "[::]:$port" "$replicas" &
    lighthouse=$!
    trap 'kill $lighthouse 2>/dev/null || true' EXIT
fi
export REPLICA_GROUP_ID=$replica
export TORCHFT_LIGHTHOUSE=${TORCHFT_LIGHTHOUSE:-http://${LIGHTHOUSE_HOST:?set LIGHTHOUSE_HOST to the node of replica group 0}:$port}
unset MASTER_ADDR MASTER_PORT RDZV_ID NODE_RANK
NNODES=1 cluster/train_torchrun.sh "$@"
