# issue 43: int8 moments' curve at HEAD (the one-pass Triton kernel, cb8ca54 on) on the A2 baseline, then float32's
# seeds 0 and 1 at HEAD, one run at a time (41 GiB each), as time allows
source .gpujob/common.sh > $OUT/common.log 2>&1
export ONENODE_CACHE=$PWD/.cache/onenode
T0=$(date +%s); left() { echo $(( ${BUDGET:-560} - $(date +%s) + T0 )); }
curve() { if [ $(left) -lt 150 ]; then echo "SKIP curve-$1-$2"; return; fi
  PYTHONPATH=$S/starter_code timeout $(left) python3 -m onenode.cli train a2_pretrain/recipes/baseline.yaml --out /tmp/curve-$1-seed$2 \
   --fresh --set seed=$2 --set optimizer.moments=$1 --set data.path=data/default --set parallel.ep=1 \
   --set train.global_batch_size=8 --set train.micro_batch_size=4 --set train.compile=true --set train.token_budget=6553600 \
   --set checkpoint.enabled=false --set checkpoint.export_hf=false --set eval.every_steps=50 --set log.every_steps=5 \
   --set log.tensorboard=false --set log.progress_bar=false > $OUT/curve-$1-$2.log 2>&1; echo "WALL curve-$1-$2 rc=$? $(( $(date +%s) - T0 )) s"; }
curve int8 0; curve float32 0; curve float32 1
tail -n 2 $OUT/curve-*.log
python3 benchmarks/moments_curves.py $OUT 2>&1 | tail -5
