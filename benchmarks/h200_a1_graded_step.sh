#!/usr/bin/env bash
# The A1 graded step on one H200, in one job: the profile's `onenode bench` command (the handout's)
# on the reference solution's tree and on the unpatched starter, then `onenode-grade a1` of the
# reference solution and the unchanged starter on h200x1, whose timed step is that command's step;
# last, the same command on the unpatched starter.
# The reference's graded tokens/s is then read beside its bench figure (benchmarks/README.md).
#   bash benchmarks/h200_a1_graded_step.sh OUT [PROFILE]
# SUBMISSIONS="reference-full" grades that one alone (a name that is a folder, e.g. a red-team case
# built by tests/redteam, is graded as it is); BENCH_STARTER=0 leaves out the starter's bench,
# BENCH_SOLUTION=0 the reference's (a re-grade alone).
set -uo pipefail
OUT=${1:?usage: h200_a1_graded_step.sh OUT [PROFILE]}
PROFILE=${2:-h200x1}
KIT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
cd "$KIT"
CMD=$(python3 -c "from grader.a1.rubric import load_rubric; print(load_rubric().profiles['$PROFILE'].bench_command(0))")
ARGS=${CMD#onenode bench }
echo "graded step: $CMD" | tee "$OUT/command.txt"
if [ "${BENCH_SOLUTION:-1}" = 1 ]; then
    S=$(python3 benchmarks/run_a1_gpu.py --prepare | head -1)  # the reference solution applied to a copy of the starter
    (cd "$S" && eval PYTHONPATH=starter_code timeout 400 python3 -m onenode.cli bench $ARGS --steps 10 --warmup 3 \
        --quiet --out "$OUT/bench-solution.json") 2>&1 | tail -12
fi
COHORT=$(mktemp -d)
for name in ${SUBMISSIONS:-reference-full starter-unchanged}; do
    if [ -d "$name" ]; then cp -r "$name" "$COHORT/"; continue; fi
    mkdir -p "$COHORT/$name"
    case $name in
        reference-full) cp solutions/a1/submission.patch "$COHORT/$name/" ;;
        starter-unchanged) : > "$COHORT/$name/submission.patch" ;;
    esac
done
PYTHONPATH=starter_code:. python3 -m grader.cli a1 --cohort "$COHORT" --profile "$PROFILE" --out "$OUT/grade" --no-notebook --quiet 2>&1 | tail -20
if [ "${BENCH_STARTER:-1}" = 1 ]; then
    eval PYTHONPATH=starter_code timeout 400 python3 -m onenode.cli bench $ARGS --steps 5 --warmup 2 --quiet \
        --out "$OUT/bench-starter.json" 2>&1 | tail -12
fi
