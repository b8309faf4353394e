"""`optimizer.state: cpu` on a GPU (`train/offload.py`): is it the device step, and how fast does it stream?

Run from the kit root on one GPU (about 12 GB of pinned host memory for the throughput part):

    PYTHONPATH=starter_code python3 benchmarks/offload_check.py OUT/offload-check.json

- `equal`: four steps of the tiny model in bf16 on CUDA under the deterministic mode, the state
  on the GPU and in host memory, float32 and bfloat16 moments: the same losses, weights and
  optimizer state, bit for bit (the CPU tests prove it where the device is the CPU); where the
  masters and the state live (pinned host memory) and the copies (the GPU);
- `resume`: an offloaded run stopped after 2 steps and resumed, against one that was not;
- `update`: the fused update alone over `--params` float32 parameters (64 equal matrices, their
  bf16 copies' gradients on the GPU), the state on the GPU and streamed from host memory: seconds a
  step, the state's bytes each way per second, the peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from onenode.parallel.mixed_precision import MasterWeights
from onenode.train import master_update
from onenode.train.offload import AdamWOffloaded
from onenode.train.recipe import load_recipe
from onenode.train.trainer import Trainer

KIT = Path(__file__).resolve().parents[1]
TINY = KIT / "a2_pretrain" / "recipes" / "tiny.yaml"
SETTINGS = {"train.precision": "bf16", "train.device": "cuda", "train.seq_len": 64, "train.global_batch_size": 4,
            "train.micro_batch_size": 0, "train.token_budget": 4 * 4 * 64, "train.deterministic": True,
            "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False}


def _run(folder: Path, stop: int | None = None, resume: str | None = None, **overrides) -> Trainer:
    trainer = Trainer(load_recipe(TINY, {**SETTINGS, **overrides}), folder, resume=resume)
    trainer.fit(stop_after_steps=stop)
    return trainer


def _tensors(trainer: Trainer) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weights = [t.detach().cpu() for t in trainer.parallel.model.state_dict().values()]
    return weights, [t.cpu() for state in trainer.optimizer.state.values() for t in state.values()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def equal(out: Path) -> dict:
    found = {}
    for moments in ("float32", "bfloat16"):
        device = _run(out / f"device-{moments}", **{"optimizer.moments": moments})
        host = _run(out / f"cpu-{moments}", **{"optimizer.moments": moments, "optimizer.state": "cpu"})
        (dw, ds), (hw, hs) = _tensors(device), _tensors(host)
        weights = host.parallel.master_weights
        masters = [m for unit in weights.units for m in unit.masters]
        found[moments] = {
            "losses": host.losses, "losses_equal": host.losses == device.losses,
            "weights_equal": _same(dw, hw), "state_equal": _same(ds, hs),
            "max_weight_difference": max(float((a.float() - b.float()).abs().max()) for a, b in zip(dw, hw)),
            "offloaded": isinstance(host.optimizer, AdamWOffloaded),
            "masters_pinned_on_host": all(m.device.type == "cpu" and m.is_pinned() for m in masters),
            "state_pinned_on_host": all(t.is_pinned() for s in host.optimizer.state.values() for t in s.values()),
            "copies_on_gpu": all(copy.is_cuda for copy in weights.copy_of.values()),
        }
        print(moments, json.dumps(found[moments]), flush=True)
    return found


def resume(out: Path) -> dict:
    straight = _run(out / "straight", **{"optimizer.state": "cpu"})
    _run(out / "resumed", stop=2, **{"optimizer.state": "cpu"})
    resumed = _run(out / "resumed", resume="auto", **{"optimizer.state": "cpu"})
    (sw, ss), (rw, rs) = _tensors(straight), _tensors(resumed)
    found = {"losses_equal": straight.losses == resumed.losses, "weights_equal": _same(sw, rw),
             "state_equal": _same(ss, rs)}
    print("resume", json.dumps(found), flush=True)
    return found


def update(params: int, offload: bool, steps: int = 5) -> dict:
    """The fused update's step time over `params` parameters, its state on the GPU or streamed."""
    device = torch.device("cuda")
    shape = (params // 64 // 2048, 2048)
    masters = [torch.nn.Parameter(torch.randn(shape, device=device)) for _ in range(64)]
    weights, grads = MasterWeights(), {}
    for master in masters:
        weights.copy_of[id(master)] = torch.empty(shape, dtype=torch.bfloat16, device=device)
        grads[id(master)] = torch.randn(shape, dtype=torch.bfloat16, device=device)
    if offload:
        for master in masters:
            master.data = master.detach().cpu().pin_memory()
        optimizer = AdamWOffloaded(masters, device=device, lr=1e-3)
    else:
        optimizer = torch.optim.AdamW(masters, lr=1e-3, fused=True)

    def step() -> None:
        for master in masters:
            weights.copy_of[id(master)].grad = grads[id(master)]
        master_update.clip_and_update(weights, optimizer, 1.0)

    step()
    step()  # compiled, the state made
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    numel = sum(m.numel() for m in masters)
    found = {"parameters": numel, "step_s": seconds, "state_gb_per_s_each_way": 12 * numel / seconds / 1e9,
             "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}
    print("update", "cpu" if offload else "device", json.dumps(found), flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSON record to write")
    parser.add_argument("--params", type=float, default=2**30, help="parameters of the update's timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("offload_check.py: no GPU (on a CPU, tests/test_optimizer_offload.py checks the same)")
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as folder:
        record["equal"] = equal(Path(folder))
        record["resume"] = resume(Path(folder))
    record["update"] = {state: update(int(args.params), offload=state == "cpu") for state in ("device", "cpu")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
