"""The fused update overlapped with the next step's forward, a probe timed against the update as it is.

Why: at 1 x 4096 the fused update took 16.5 ms of the 64 ms step on one H200, at the memory
roofline (benchmarks/results/2026-12-04-h200-bf16-moments-cuda-graphs/), so it cannot get faster,
only hidden. The clip needs every gradient, so the update cannot start before the backward ends;
it can run while the next step's forward computes.

How: after the clip's coefficient, the step's parameters are cut by unit (`parallel/mixed_precision.py`:
the root's embedding, final norm and head first, with the parameters that have no bf16 copy, then
each layer's, in forward order) and each unit's update is queued on a side stream, an event
recorded after it. Each unit's forward pre-hook waits on its own event before it swaps its copies
in. The kernels and their inputs are the fused update's, cut per unit (the update is elementwise,
each parameter on its own), so the bits are the same. Memory the side stream reads stays out of
reuse: the gradients are recorded on its stream; under CUDA graphs the backward leaves them in the
graphs' pool, which the next step's replays overwrite, so they are cloned first (on the main
stream: 4 bytes a parameter).

On a CPU there are no streams: each unit's update runs at its forward's pre-hook instead, which
checks the cut and the order (the bits are the fused update's: `tests/test_bench.py`).

Measured on one H100 (benchmarks/results/2026-12-07-h100-update-overlap/): 0.96x at 1 x 4096 with
CUDA graphs. `--trace-steps` showed why: the queued update ran beside the forward's kernels for 1.3
ms of its 47, since each unit's launch takes every SM; the clones and the root's wait added the rest.

It times both in one process (one compile), in alternating rounds of the same steps, each round
between full device syncs (the overlapped update's last one inside it):

    PYTHONPATH=starter_code python3 benchmarks/update_overlap.py --rounds 3 --out OUT.json -- BENCH_OPTIONS

The root's share (the embedding, the final norm and the head: 11% of a1-1gpu's parameters) is
waited on before the first layer, since one unit swaps them all in: it is not hidden. Units of
their own for the embedding and for the head would hide it too.

What the kit would need to adopt it, which a probe leaves out: `onenode bench` syncs the whole device
between steps, which runs the update before the next step can start (these rounds time a window of
steps instead, as `onenode train` does); and everything that reads the masters or the optimizer
state between steps (a checkpoint, the replay's hashes, DiLoCo's outer step, the A1 grader's
evidence) must first wait on every unit (`OverlappedUpdate.settle_all`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from onenode.bench import measure
from onenode.bench.device import sync, synthetic_batches
from onenode.cli import build_parser
from onenode.parallel.mixed_precision import CastUnit, MasterWeights
from onenode.profiling import device_kernels, profiled, union_us
from onenode.train import adamw_kernel, master_update
from onenode.train.assembly import assemble
from onenode.train.logging import environment, git_commit

ACTIVE: OverlappedUpdate | None = None  # the process's overlapped update, made at its first step
UPDATE_KERNEL = "adamw"  # in the names of the fused update's kernels (train/adamw_kernel.py)
ENABLED = True  # False: `install`'s step is the fused update as it is (the A/B rounds switch it)


class OverlappedUpdate:
    """The fused update of one model's units, queued per unit; `settle(unit)` before its forward."""

    def __init__(self, weights: MasterWeights, device: torch.device, clone_grads: bool):
        *layers, root = weights.units
        self.root = root
        self.order = [root, *layers]  # the forward's order: the root's pre-hook runs before any layer's
        self.unit_of = {master.data_ptr(): unit for unit in weights.units for master in unit.masters}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.clone_grads = clone_grads
        self.pending: dict[int, torch.cuda.Event | functools.partial] = {}  # id(unit) -> its event (GPU) or update

    def cut(self, groups: list[tuple]) -> dict[int, list[tuple]]:
        """Each unit's share of the step's groups (`master_update.clip_and_update`'s), by id; a
        parameter with no bf16 copy (a router kept in float32) goes with the root's, which the
        first forward hook waits on."""
        shares: dict[int, list[tuple]] = {id(unit): [] for unit in self.order}
        for members, lr, hyper in groups:
            by_unit: dict[int, list] = {}
            for member in members:
                by_unit.setdefault(id(self.unit_of.get(member[0].data_ptr(), self.root)), []).append(member)
            for key, share in by_unit.items():
                shares[key].append((share, lr, hyper))
        return shares

    def launch(self, groups: list[tuple], coef: torch.Tensor, update) -> None:
        """`clip_and_update`'s `apply`: queue each unit's update (what a unit has not waited on yet
        is waited on first)."""
        self.settle_all()
        if self.stream is None:
            self.pending = {key: functools.partial(master_update.apply_update, share, coef, update)
                            for key, share in self.cut(groups).items() if share}
            return
        if self.clone_grads:
            groups = [([(param, grad.clone(), state, copy) for param, grad, state, copy in members], lr, hyper)
                      for members, lr, hyper in groups]
        self.stream.wait_stream(torch.cuda.current_stream())
        for members, lr, _ in groups:
            lr.record_stream(self.stream)
            for _, grad, _, _ in members:
                grad.record_stream(self.stream)
        coef.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            for key, share in self.cut(groups).items():
                if share:
                    master_update.apply_update(share, coef, update)
                    self.pending[key] = torch.cuda.Event()
                    self.pending[key].record()

    def settle(self, unit: CastUnit) -> None:
        """`unit`'s update done before what follows on this stream reads its parameters."""
        waiting = self.pending.pop(id(unit), None)
        if isinstance(waiting, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(waiting)
        elif waiting is not None:
            with torch.no_grad():  # a forward's hook runs with grad mode on: the update is no part of the graph
                waiting()
            unit.copied_versions = [master._version for master in unit.masters]  # the update wrote the copies

    def settle_all(self) -> None:
        for unit in self.order:
            self.settle(unit)


def install(clone_grads: bool) -> None:
    """Take the fused update through `OverlappedUpdate` (while `ENABLED`) and wait on a unit before
    its forward. Before the model is built: the units' hooks are bound when they are registered."""
    clip_and_update, swap_in = master_update.clip_and_update, CastUnit.swap_in

    def overlapped(weights, optimizer, max_norm, update=None, kernel="triton"):
        global ACTIVE
        if not ENABLED:
            return clip_and_update(weights, optimizer, max_norm, update, kernel)
        if hasattr(optimizer, "update_groups") and type(optimizer).update_groups is not \
                master_update.AdamWCompactMoments.update_groups:
            raise ValueError("update-overlap: the optimizer streams its own state (optimizer.state: cpu): "
                             "use optimizer.state: device")
        if ACTIVE is None:
            device = next(iter(weights.copy_of.values())).device
            ACTIVE = OverlappedUpdate(weights, device, clone_grads)
        return clip_and_update(weights, optimizer, max_norm, update, kernel, apply=ACTIVE.launch)

    def settled_swap_in(unit, *hook_args):
        if ACTIVE is not None:
            ACTIVE.settle(unit)
        swap_in(unit, *hook_args)

    master_update.clip_and_update = overlapped
    CastUnit.swap_in = settled_swap_in
    adamw_kernel.TABLES_KEPT = max(adamw_kernel.TABLES_KEPT, 1024)  # a block map and offsets per unit and kind


def switch(training, batches, overlapped: bool) -> None:
    """The update overlapped or not from here on, one untimed step taken to settle the switch."""
    global ENABLED
    if ACTIVE is not None:
        ACTIVE.settle_all()
    ENABLED = overlapped
    training.step(*next(batches))
    sync(training.device)


def timed_rounds(training, batches, steps: int, rounds: int) -> list[dict]:
    """Rounds of `steps` steps, the fused update as it is and overlapped by turns (`switch`), each
    timed between full device syncs."""
    results = []
    for _ in range(rounds):
        for overlapped in (False, True):
            switch(training, batches, overlapped)
            start = time.perf_counter()
            losses = [training.step(*next(batches))["loss"] for _ in range(steps)]
            queued = len(ACTIVE.pending) if ACTIVE is not None else 0  # units the last step queued
            sync(training.device)
            elapsed = time.perf_counter() - start
            results.append({"overlapped": overlapped, "seconds": elapsed, "losses": losses, "units_queued": queued,
                            "tokens_per_s": steps * training.recipe.tokens_per_step / elapsed})
    return results


def streams(training, batches, steps: int) -> dict:
    """Where the update's kernels ran against the rest, in `steps` profiled steps of each kind
    (on a CPU, no kernels: zeros): seconds of the update's kernels (the fused AdamW's, by name), of
    the others, of both at once, and of none (the GPU idle, waiting on the host). Overlapped rounds that are no faster
    show here whether the update ran beside the forward at all."""
    split = {}
    for overlapped in (False, True):
        switch(training, batches, overlapped)
        with profiled(training.device) as prof:
            for _ in range(steps):
                training.step(*next(batches))
            sync(training.device)
        kernels = device_kernels(prof)
        update = [(start, end) for name, start, end in kernels if UPDATE_KERNEL in name]
        rest = [(start, end) for name, start, end in kernels if UPDATE_KERNEL not in name]
        busy = union_us(update + rest)
        both = union_us(update) + union_us(rest) - busy
        window = (max(end for _, _, end in kernels) - min(start for _, start, _ in kernels)) if kernels else 0.0
        split["overlapped" if overlapped else "fused"] = {
            "window_s": window / 1e6, "update_s": union_us(update) / 1e6, "other_s": union_us(rest) / 1e6,
            "both_s": both / 1e6, "idle_s": (window - busy) / 1e6, "update_kernels": len(update)}
    return split


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--rounds N] --out FILE -- BENCH_OPTIONS")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (alternating)")
    parser.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="then profile this many steps of each kind: where the update's kernels ran (GPU)")
    args = parser.parse_args(argv[:split])
    bench = build_parser("bench").parse_args(["bench", *argv[split + 1:]])
    if args.rounds < 1 or bench.steps < 1:
        parser.error("--rounds and the bench's --steps must be >= 1")
    recipe = measure.bench_recipe(bench, 1, bench.warmup + 2 * args.rounds * (bench.steps + 1)
                                  + 2 * (args.trace_steps + 1))
    install(clone_grads=recipe.train.cuda_graphs)
    training = assemble(recipe)
    if training.parallel.master_weights is None or training.layout.world > 1:
        parser.error("the overlapped update is one process's fused update in bf16: one process, --dtype bf16")
    device = training.device
    batches = ((ids.to(device), labels.to(device)) for ids, labels in
               synthetic_batches(training.config.vocab_size, recipe.train.global_batch_size, recipe.train.seq_len,
                                 recipe.seed, 0, 1))
    for _ in range(bench.warmup):
        training.step(*next(batches))
    rounds = timed_rounds(training, batches, bench.steps, args.rounds)
    split = streams(training, batches, args.trace_steps) if args.trace_steps else None
    medians = {kind: statistics.median(r["tokens_per_s"] for r in rounds if r["overlapped"] == (kind == "overlapped"))
               for kind in ("fused", "overlapped")}
    record = {"record": "update-overlap", "command": " ".join(["benchmarks/update_overlap.py", *argv]),
              "commit": git_commit(), "env": environment(1), "recipe": recipe.to_dict(),
              "tokens_per_step": recipe.tokens_per_step, "rounds": rounds, "tokens_per_s": medians,
              "overlapped_over_fused": medians["overlapped"] / medians["fused"], "streams": split}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"fused {medians['fused']:,.0f} tokens/s, overlapped {medians['overlapped']:,.0f} "
          f"({record['overlapped_over_fused']:.3f}x), the median of {args.rounds} round(s) of {bench.steps} steps: "
          f"{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
