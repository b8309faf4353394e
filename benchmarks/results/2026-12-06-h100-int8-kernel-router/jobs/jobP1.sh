source .gpujob/common.sh
python3 -c "import torch; print('cudnn', torch.backends.cudnn.version())"
python3 -c "import cudnn; print('cudnn frontend', cudnn.__version__)" 2>&1 | tail -1
# issue 43, 0e: int8 moments at 1 x 4096 since dd2cfb2 (uint8 codes), float32 beside it; the int8 kernels kept
B="--preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 8 --warmup 3 --compile blocks --cuda-graphs --quiet --profile /tmp/prof --profile-steps 1"
cd $S
wall m-int8 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind PYTHONPATH=starter_code timeout 300 python3 -m onenode.cli bench $B --set optimizer.moments=int8 --out $OUT/m-int8.json > $OUT/m-int8-table.log 2>&1
mkdir -p $OUT/ind && grep -l bucketize -r /tmp/ind --include=*.py | head -20 | xargs -I{} cp {} $OUT/ind/
wall m-float32 env PYTHONPATH=starter_code timeout 200 python3 -m onenode.cli bench $B --set optimizer.moments=float32 --out $OUT/m-float32.json > $OUT/m-float32-table.log 2>&1
grep -hE "^(tokens/s|MFU)|WALL" $OUT/*-table.log
