"""Run records: metrics as JSONL (always) and TensorBoard (when installed), and the facts about
the run that the manifest needs (commit, versions, hardware)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

# The fields of the line `onenode train` prints for each logged step (when no progress bar shows),
# in order, with their format and what they are: `onenode train --help` prints them.
LOG_FIELDS = {
    "step": (None, "optimizer steps done / steps the token budget allows"),
    "tokens": (None, "tokens trained so far (every data-parallel rank's), the count the budget is charged"),
    "loss": (".4f", "this step's training loss (cross entropy, nats per token), averaged over the ranks"),
    "val_loss": (".4f", "(every eval.every_steps) the mean loss on eval.batches held-out batches"),
    "lr": (".2e", "this step's learning rate, as the recipe's schedule sets it"),
    "grad_norm": (".3f", "the gradient's global norm, before clipping to train.grad_clip"),
    "tokens_per_s": (",.0f", "tokens trained per second since the previous logged step"),
    "mfu": (".1%", "(on GPUs) model FLOPs utilisation of that rate: matmul FLOPs against the dense bf16 peak"),
    "load_cv": (".3f", "(MoE models) how unevenly the routers spread this step's tokens over their experts: the "
                       "standard deviation of the tokens each expert got over their mean (the coefficient of "
                       "variation), averaged over the MoE layers; 0 is perfect balance (the routers' biases move "
                       "to lower it at moe.bias_update_rate)"),
    "eta": (None, "time left to the end of the run at the run's mean step time so far (h:mm:ss)"),
}



def log_help() -> str:
    """What `onenode train` prints, field by field: the epilog of its `--help`."""
    import textwrap

    width = max(map(len, LOG_FIELDS)) + 2
    lines = ["each logged step's line, field by field (every log.every_steps steps; printed where no progress bar",
             "shows, i.e. stderr is not a terminal or log.progress_bar is false; metrics.jsonl keeps the same fields):"]
    for name, (_, meaning) in LOG_FIELDS.items():
        wrapped = textwrap.wrap(meaning, 96 - width)
        lines += [f"  {name:<{width}}{wrapped[0]}", *(" " * (width + 2) + rest for rest in wrapped[1:])]
    lines += ["", "at the end: the status (finished, or stopped by --stop-after), steps, tokens of the budget, "
                  "the last train and",
              "val loss; then the throughput: the median tokens/s (and MFU) of the logged intervals, the first "
              "(warm-up) left out."]
    return "\n".join(lines)


class MetricsLog:
    """Appends one JSON object per record to `metrics.jsonl`; mirrors scalars to TensorBoard."""

    def __init__(self, folder: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.path = Path(folder) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self.writer = None
        self.note = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.note = "TensorBoard logging off: pip install tensorboard to get it"
            else:
                self.writer = SummaryWriter(log_dir=str(Path(folder) / "tensorboard"))

    def _truncate_after(self, step: int | None) -> None:
        """On resume, drop records past the checkpoint (the steps that are about to be redone)."""
        if not self.path.exists():
            return
        if step is None:
            self.path.unlink()
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def git_commit(cwd: str | Path | None = None) -> str | None:
    """HEAD of the checkout this code runs from, with "+dirty" when files changed; None outside git.

    `ONENODE_COMMIT` names it where the tree arrives without its .git (a copy on a GPU machine)."""
    if os.environ.get("ONENODE_COMMIT"):
        return os.environ["ONENODE_COMMIT"]
    cwd = cwd or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment(world_size: int) -> dict:
    """Versions and hardware, for the manifest."""
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("onenode", "transformers", "numpy"):
        try:
            versions[name] = metadata.version(name)  # without importing: transformers takes seconds
        except metadata.PackageNotFoundError:
            pass
    hardware = {"platform": platform.platform(), "world_size": world_size}
    if torch.cuda.is_available():
        hardware["gpu"] = torch.cuda.get_device_name()
        hardware["gpus_per_node"] = torch.cuda.device_count()
    return {"versions": versions, "hardware": hardware}
