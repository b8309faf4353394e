#!/usr/bin/env bash
# Grade an A1 cohort on this node (no scheduler needed): health check, the hardware profile
# picked from the GPUs found, then `onenode-grade a1 --cohort`. Safe to re-run: graded
# submissions are skipped, an interrupted one is graded again.
#
#   cluster/grade_node.sh COHORT_DIR OUT_DIR [extra onenode-grade args, e.g. --force]
#   PROFILE=h200x2 cluster/grade_node.sh ...      # force a profile
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 COHORT_DIR OUT_DIR [onenode-grade args]" >&2; exit 2; }
COHORT=$1; OUT=$2; shift 2
PY=${PYTHON:-.venv/bin/python}

# The rubric's profiles, from the GPUs nvidia-smi lists.
pick_profile() {
  command -v nvidia-smi >/dev/null || { echo cpu-tiny; return; }
  local names count
  names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true)
  count=$(printf '%s\n' "$names" | grep -c . || true)
  case "$names" in
    *H100*) [ "$count" -ge 8 ] && { echo h100x8; return; } ;;
    *H200*) [ "$count" -ge 2 ] && { echo h200x2; return; }; [ "$count" -ge 1 ] && { echo h200x1; return; } ;;
  esac
  echo "no rubric profile for $count x '$(printf '%s\n' "$names" | head -n 1)': set PROFILE=..." >&2
  return 1
}
PROFILE=${PROFILE:-$(pick_profile)}
echo "profile: $PROFILE"

if [ "$PROFILE" != cpu-tiny ]; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  cluster/health_check.sh "$gpus" "${MIN_FREE_GB:-100}" "$OUT"
fi

# Caches stay beside the outputs, never in $HOME.
export HF_HOME=${HF_HOME:-$PWD/.cache/hf} XDG_CACHE_HOME=${XDG_CACHE_HOME:-$PWD/.cache/xdg}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.cache/triton}
export PATH="$(dirname "$PY"):$PATH"
exec "$PY" -m grader.cli a1 --cohort "$COHORT" --out "$OUT" --profile "$PROFILE" "$@"
