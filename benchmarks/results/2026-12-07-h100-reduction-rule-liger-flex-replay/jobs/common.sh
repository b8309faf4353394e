# sourced by every device job, from the kit root
export ONENODE_COMMIT=$(cat .gpujob/commit) S=$(ls -d $PWD/.cache/patched/submission-* | head -1) P=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, 'cudnn', torch.backends.cudnn.version())"
wall() { local name=$1; shift; local t0=$(date +%s.%N); "$@"; local rc=$?; echo "WALL $name $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s rc=$rc"; }
python3 -m pip install -q --no-index --no-deps dist/*.whl 2>&1 | tail -1
# a compile cache brought back from an earlier call (inductor's graphs and Triton's kernels): warm-ups compile less
if [ -f .gpujob/inductor-cache.tgz ]; then tar xzf .gpujob/inductor-cache.tgz -C /tmp && echo "inductor cache: seeded"; fi
