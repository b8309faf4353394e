"""What a DiLoCo sync moves against what DDP moves each step, on CPU with gloo, and DiLoCo's loss
against plain data parallelism on the same tokens. The record: benchmarks/results/2026-12-04-cpu-diloco-bytes/.

    python benchmarks/diloco_bytes.py OUT          # needs torchft: pip install -e ".[diloco]"

Measured on the tiny preset (a2_pretrain/recipes/tiny.yaml, float32, 2 x 2 sequences of 32 tokens
a step, `STEPS` steps):
- DiLoCo (`parallel.diloco`, two replica groups of one process each, a lighthouse in this process),
  for each H in `INNER_STEPS`: every collective torchft's Manager hands gloo (a wrapped
  `torchft.process_group.ProcessGroupWrapper`), by op, dtype and bytes, per step; each group's
  losses.
- DDP: torch's DistributedDataParallel over two gloo ranks on the same model, the bytes of every
  gradient bucket it all-reduces in a step (a communication hook).
- Plain data parallelism as the kit trains it (two FSDP ranks, `parallel.dp: 2`) on the same tokens:
  its losses, against the mean of the two groups' (each group reads the slice that rank reads).
- The wire: the whole benchmark runs in a network namespace of its own (`unshare --net`, only the
  loopback up), so the loopback's byte count (/proc/net/dev) is this benchmark's traffic alone: gloo's
  algorithm, TCP/IP headers, torchft's quorum and heartbeats included. Each step's count is read by
  group 0 (DiLoCo) or rank 0 (DDP) around its step, so it holds both processes' sends; the record
  halves it for one process. Without unshare the loopback fields are null.

Computed from parameter counts (the model built on the meta device) for the a1-1gpu preset and the
A2 baseline recipe's model: a sync hands the all-reduce every float32 parameter and the routers'
float32 balancing biases (`parallel/diloco.py`); DDP all-reduces a float32 gradient per parameter
every step (the kit's FSDP reduces in float32 too). A ring all-reduce of B bytes over n processes
sends 2 (n - 1) / n x B from each (reduce-scatter, then all-gather); the record's `sent_per_process`
figures use that convention for n = 2 replica groups (DDP over 2 ranks): B.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(KIT_ROOT / "tests"), str(KIT_ROOT / "starter_code")]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from dist_utils import run_distributed  # noqa: E402

TINY = KIT_ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
BASELINE = KIT_ROOT / "a2_pretrain" / "recipes" / "baseline.yaml"
STEPS = 48
INNER_STEPS = (4, 8)
H_QUOTED = (4, 32, 250)  # the seed's author synced every 250 steps
SMALL = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 0,
         "train.token_budget": STEPS * 4 * 32, "checkpoint.every_steps": 0, "checkpoint.export_hf": False,
         "eval.every_steps": 0, "eval.batches": 2, "log.every_steps": 1, "log.progress_bar": False,
         "log.tensorboard": False}
COUNTED = ("allreduce", "allreduce_coalesced", "allgather", "broadcast", "reduce_scatter",
           "reduce_scatter_tensor_coalesced", "send", "recv")
NAMESPACE_ENV = "ONENODE_BENCH_NETNS"


def loopback_bytes() -> int | None:
    """Bytes the loopback has sent, in this network namespace (None outside the benchmark's own)."""
    if not os.environ.get(NAMESPACE_ENV):
        return None
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmit bytes
    raise RuntimeError("no loopback in /proc/net/dev")


def _tensor_bytes(value) -> list[tuple[str, int]]:
    if isinstance(value, torch.Tensor):
        return [(str(value.dtype).removeprefix("torch."), value.numel() * value.element_size())]
    if isinstance(value, (list, tuple)):
        return [item for v in value for item in _tensor_bytes(v)]
    return []


def _count_collectives(calls: list) -> None:
    """Every collective torchft's process groups hand gloo, appended to `calls` as (op, dtype, bytes)."""
    from torchft.process_group import ProcessGroupWrapper

    for op in COUNTED:
        method = getattr(ProcessGroupWrapper, op)

        def counted(self, *args, _op=op, _method=method, **kwargs):
            first = args[0] if args else None  # the tensors sent (allgather: the outputs, then the inputs)
            sent = args[1] if _op == "allgather" else first
            calls.extend((_op, dtype, size) for dtype, size in _tensor_bytes(sent))
            return _method(self, *args, **kwargs)

        setattr(ProcessGroupWrapper, op, counted)


def _replica_group(out: str, replica: int, lighthouse: str, inner: int) -> None:
    """One DiLoCo replica group of one process; writes out/result_{replica}.pt."""
    from onenode.parallel.diloco import LIGHTHOUSE_ENV, REPLICA_ENV
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
        os.environ.pop(key, None)
    os.environ.update({REPLICA_ENV: str(replica), LIGHTHOUSE_ENV: lighthouse})
    torch.set_num_threads(1)
    calls, steps = [], []
    _count_collectives(calls)
    recipe = load_recipe(TINY, {**SMALL, "parallel.diloco.inner_steps": inner, "parallel.diloco.replicas": 2})
    trainer = Trainer(recipe, out, resume=None)
    step = trainer.run.step

    def counted_step(*args):
        before = loopback_bytes()
        record = step(*args)
        after = loopback_bytes()
        steps.append({"collectives": list(calls), "loopback": None if before is None else after - before})
        calls.clear()
        return record

    trainer.run.step = counted_step
    manifest = trainer.fit()
    torch.save({"losses": list(trainer.losses), "steps": steps, "after_last_step": list(calls),
                "val_loss": manifest["final_losses"]["val"], "tokens_seen": manifest["tokens_seen"]},
               Path(out) / f"result_{replica}.pt")


def diloco(out: Path, inner: int) -> list[dict]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200)
    try:
        processes = [mp.get_context("forkserver").Process(target=_replica_group,
                                                          args=(str(out), r, lighthouse.address(), inner))
                     for r in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(600)
    finally:
        lighthouse.shutdown()
    if [p.exitcode for p in processes] != [0, 0]:
        raise RuntimeError(f"DiLoCo H={inner}: replica groups exited {[p.exitcode for p in processes]}")
    return [torch.load(out / f"result_{r}.pt", weights_only=False) for r in range(2)]


def _data_parallel(out: str) -> dict:
    """One rank of the kit's plain data parallelism (FSDP over run_distributed's gloo group)."""
    from onenode.train.recipe import load_recipe
    from onenode.train.trainer import Trainer

    trainer = Trainer(load_recipe(TINY, SMALL), out, resume=None)
    manifest = trainer.fit()
    return {"losses": list(trainer.losses), "val_loss": manifest["final_losses"]["val"],
            "tokens_seen": manifest["tokens_seen"]}


def _ddp(steps: int) -> dict:
    """One rank of torch's DDP on the tiny model: each step's all-reduced gradient buckets, in bytes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from onenode.model import build_model, get_preset

    config = get_preset("tiny")
    model = build_model(config, seed=0, device="cpu")
    ddp = DistributedDataParallel(model, find_unused_parameters=True, broadcast_buffers=False)
    buckets = []

    def counted(state, bucket):
        buffer = bucket.buffer()
        buckets.append((str(buffer.dtype).removeprefix("torch."), buffer.numel() * buffer.element_size()))
        work = dist.all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda future: future.value()[0].div_(dist.get_world_size()))

    ddp.register_comm_hook(None, counted)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    per_step = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 33), generator=generator)
        before = loopback_bytes()
        ddp(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = loopback_bytes()
        per_step.append({"buckets": list(buckets), "loopback": None if before is None else after - before})
        buckets.clear()
    return {"steps": per_step, "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def model_bytes(config) -> dict:
    """Parameters and the routers' balancing biases of `config`'s model, counted on the meta device."""
    from onenode.model import build_model

    model = build_model(config, device="meta")
    params = sum(p.numel() for p in model.parameters())
    biases = sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return {"parameters": params, "router_biases": biases}


def comparison(counts: dict, replicas: int = 2) -> dict:
    """A sync's bytes (float32 parameters and biases) against DDP's float32 gradients each step, for
    each H quoted, and what one process sends for each in a ring all-reduce over `replicas`."""
    sync = 4 * (counts["parameters"] + counts["router_biases"])
    ddp_step = 4 * counts["parameters"]
    ring = 2 * (replicas - 1) / replicas
    return {**counts, "sync_bytes": sync, "ddp_bytes_per_step": ddp_step, "ring_factor": ring,
            "sync_gb": sync / 1e9, "ddp_gb_per_step": ddp_step / 1e9,
            "per_H": {str(h): {"diloco_bytes_per_step": sync / h, "diloco_mb_per_step": sync / h / 1e6,
                               "ddp_bytes_per_H_steps": ddp_step * h, "ddp_over_diloco": ddp_step * h / sync,
                               "diloco_sent_per_process_per_step": ring * sync / h,
                               "ddp_sent_per_process_per_step": ring * ddp_step} for h in H_QUOTED}}


def _sum(items) -> int:
    return sum(size for *_, size in items)


def summarize_diloco(groups: list[dict], inner: int, dp: dict) -> dict:
    steps = groups[0]["steps"]
    handed = [_sum(step["collectives"]) for step in steps]
    syncs = [i for i, size in enumerate(handed) if size]
    by_op: dict[str, int] = {}
    for op, dtype, size in steps[syncs[-1]]["collectives"]:
        by_op[f"{op} {dtype}"] = by_op.get(f"{op} {dtype}", 0) + size
    loop = [step["loopback"] for step in steps]
    mean_losses = [(a + b) / 2 for a, b in zip(groups[0]["losses"], groups[1]["losses"])]
    last = lambda losses: sum(losses[-4:]) / 4  # noqa: E731
    record = {
        "inner_steps": inner, "sync_steps": [i + 1 for i in syncs],
        "handed_to_gloo_per_sync": handed[syncs[-1]], "handed_by_op_and_dtype": by_op,
        "handed_per_step_mean": sum(handed) / len(handed),
        "handed_the_same_at_every_sync": len({handed[i] for i in syncs}) == 1,
        "handed_between_syncs": sum(handed) - sum(handed[i] for i in syncs),
        "after_the_last_step": _sum(groups[0]["after_last_step"]),
        "losses_group_0": groups[0]["losses"], "losses_group_1": groups[1]["losses"], "losses_mean": mean_losses,
        "last_4_mean_loss": last(mean_losses), "data_parallel_last_4_mean_loss": last(dp["losses"]),
        "loss_minus_data_parallel": last(mean_losses) - last(dp["losses"]),
        # after the last sync both groups hold one model; each evaluates its own slice, the two slices
        # data parallelism's two ranks evaluate and average
        "val_loss_groups": [group["val_loss"] for group in groups],
        "val_loss": (groups[0]["val_loss"] + groups[1]["val_loss"]) / 2, "data_parallel_val_loss": dp["val_loss"],
        "tokens_seen": groups[0]["tokens_seen"],
    }
    if loop[0] is not None:
        first = syncs[0]  # the first sync also configures gloo over the groups (its rendezvous)
        steady = [loop[i] for i in syncs if i != first]
        between = [loop[i] for i in range(len(loop)) if i not in syncs]
        record["loopback"] = {
            "per_sync_both_processes": steady, "first_sync_both_processes": loop[first],
            "per_sync_per_process_mean": sum(steady) / len(steady) / 2,
            "between_syncs_per_step_both_processes_mean": sum(between) / len(between),
            "per_sync_per_process_over_handed": sum(steady) / len(steady) / 2 / handed[syncs[-1]]}
    return record


def summarize_ddp(ranks: list[dict]) -> dict:
    steps = ranks[0]["steps"]
    handed = [_sum(step["buckets"]) for step in steps]
    record = {"parameters": ranks[0]["parameters"], "steps": len(steps), "handed_to_gloo_per_step": handed[-1],
              "handed_the_same_every_step": len(set(handed)) == 1,
              "dtypes": sorted({dtype for step in steps for dtype, _ in step["buckets"]})}
    if steps[0]["loopback"] is not None:
        steady = [step["loopback"] for step in steps[1:]]  # the first step also builds gloo's pairs
        record["loopback"] = {"per_step_both_processes": steady,
                              "per_step_per_process_mean": sum(steady) / len(steady) / 2,
                              "per_step_per_process_over_handed": sum(steady) / len(steady) / 2 / handed[-1]}
    return record


def measure(out: Path) -> dict:
    from onenode.model import get_preset
    from onenode.train.recipe import load_recipe

    started = time.monotonic()
    dp = run_distributed(_data_parallel, world_size=2, args=(str(out / "data-parallel"),), timeout=600)[0]
    runs = {}
    for inner in INNER_STEPS:
        runs[f"H{inner}"] = summarize_diloco(diloco(out / f"diloco-H{inner}", inner), inner, dp)
    ddp = summarize_ddp(run_distributed(_ddp, world_size=2, args=(6,), timeout=600))
    tiny = model_bytes(get_preset("tiny"))
    return {
        "setup": {"recipe": "a2_pretrain/recipes/tiny.yaml", "overrides": SMALL, "steps": STEPS,
                  "replica_groups": 2, "processes_per_group": 1, "backend": "gloo", "device": "cpu",
                  "torch": torch.__version__, "torchft": _version("torchft"),
                  "commit": os.environ.get("ONENODE_COMMIT") or _commit(),
                  "wire_measured": loopback_bytes() is not None,
                  "ring_convention": "a ring all-reduce of B bytes over n processes sends 2(n-1)/n x B from each"},
        "tiny": {"computed": comparison(tiny), "diloco": runs, "ddp": ddp,
                 "data_parallel": {"losses": dp["losses"], "val_loss": dp["val_loss"],
                                   "tokens_seen": dp["tokens_seen"]}},
        "a1_1gpu": {"computed": comparison(model_bytes(get_preset("a1-1gpu")))},
        "a2_baseline": {"computed": comparison(model_bytes(load_recipe(BASELINE).model_config()))},
        "seconds": time.monotonic() - started,
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _commit() -> str | None:
    done = subprocess.run(["git", "-C", str(KIT_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _in_own_network() -> list[str] | None:
    """The command that runs this benchmark again in a network namespace of its own (loopback only,
    host name localhost, so torchft's advertised addresses resolve there); None where unshare cannot."""
    if os.environ.get(NAMESPACE_ENV) or not shutil.which("unshare") or not shutil.which("ip"):
        return None
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        return None
    inner = " ".join(f"'{arg}'" for arg in [sys.executable, *sys.argv])
    return ["unshare", "--user", "--map-root-user", "--net", "--uts", "sh", "-c",
            f"ip link set lo up && hostname localhost && {NAMESPACE_ENV}=1 exec {inner}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="folder for record.json (and the runs, in a temporary folder)")
    args = parser.parse_args()
    command = _in_own_network()
    if command is not None:
        os.environ.setdefault("ONENODE_COMMIT", _commit() or "")
        return subprocess.run(command, env=os.environ).returncode
    if not os.environ.get(NAMESPACE_ENV):
        print("no network namespace of its own (unshare --user --net): the loopback fields are null", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="diloco-bytes-") as runs:
        record = measure(Path(runs))
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'record.json'} in {record['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
