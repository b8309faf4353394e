"""`onenode bench`: train a preset for a few steps on synthetic tokens and report how fast it ran.

    onenode bench --preset tiny --steps 5                       # CPU, seconds
    onenode bench --preset a1-1gpu --seq-len 4096 --out run.json --profile prof/
    torchrun --nproc-per-node 2 -m onenode.cli bench --preset a1-1gpu --dp 2 --ep 2

Reports tokens/s (total and per GPU), step time (median and spread, warm-up excluded), MFU from
the tensor-core FLOP model (`onenode.flops`) against the 989 TFLOP/s bf16 peak of H100/H200
(and, with `--measure-ceiling`, against a large bf16 matmul measured on the spot), peak memory,
and the share of a short profiled window spent in compute and in collectives.

Precision follows torchtitan: parameters and optimizer state stay float32 (the master copy) and
each layer computes on bf16 copies made once per step (over several ranks, gathered by FSDP2's
mixed-precision policy; on one GPU, kept by `parallel/mixed_precision.py` with no FSDP), reducing
gradients in float32; nothing runs under autocast. The data are random
token ids from a seeded generator, so no dataset is needed and every run sees the same batches.
"""
