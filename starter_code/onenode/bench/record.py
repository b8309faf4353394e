"""The bench's record as strict JSON, the command that repeats it, and its table."""

from __future__ import annotations

import math
import textwrap

RECORD_VERSION = 1

# What each row of the table (`format_table`) and each column of the top-kernels table says:
# `onenode bench --help` prints them, so that no word of the output goes unexplained.
TABLE_ROWS = {
    "model": "the preset and whose model it is (onenode, or transformers' NemotronHForCausalLM with the same "
             "weights), sequences x tokens each data-parallel rank trains per step",
    "layout": "processes (world) and how they split: dp data-parallel replicas, ep expert-parallel ranks (inside "
              "dp), pp pipeline stages; AC on/off: activation checkpointing (on: each layer's activations are "
              "recomputed in the backward pass instead of kept); compile: torch.compile per layer (off, mixers, "
              "blocks), + CUDA graphs; the precision the layers compute in",
    "tokens/s": "tokens of one step, over every data-parallel rank, / the median step time; per GPU: divided by "
                "the processes",
    "step time": "one optimizer step, timed between two device synchronisations: median, min, max and standard "
                 "deviation over the measured steps (the warm-up steps are not measured)",
    "FLOPs/token": "tensor-core (matmul) FLOPs per token, forward + backward, from onenode.flops (causal "
                   "attention counted half); other: CUDA-core work (the scan's elementwise part, norms, "
                   "activations), left out of MFU",
    "MFU": "model FLOPs utilisation: FLOPs/token x tokens/s per GPU / the peak (--peak: the dense bf16 peak of "
           "an H100 or H200); in brackets the FLOP/s each GPU achieved",
    "vs ceiling": "(--measure-ceiling) the same FLOP/s against a large bf16 matmul timed in this process",
    "peak memory": "the most memory one rank held: torch.cuda.max_memory_allocated on a GPU (cuda_max_allocated), "
                   "the process's peak resident memory on a CPU (cpu_max_rss); on a GPU also the host's: the "
                   "process's peak resident memory (where optimizer.state: cpu keeps the optimizer state)",
    "time split": "(--profile, or several processes) shares of the profiled steps' wall time: compute kernels; "
                  "collective kernels (NCCL; gloo on a CPU); exposed: collective time no compute overlapped; "
                  "idle: time no kernel ran (on a GPU: the host was behind, or waiting on a sync)",
    "launches": "(with the time split) kernels (CPU: ops) per step and their mean self time; thousands of a few "
                "microseconds each make a step launch-bound",
    "kernel mix": "(with the time split) each kind's share of all kernel (CPU: op) self time: matmul, attention, "
                  "compiled (torch.compile's fused kernels), optimizer, copy, communication, other",
}
TOP_KERNEL_COLUMNS = {
    "self time": "time in the kernel (CPU: op) itself, not in what it calls, over the profiled window",
    "share": "that time's share of all kernel (CPU: op) self time in the window",
    "calls": "how many times it ran in the window (--profile-steps steps)",
    "kernel": "its name (CPU: the aten op)",
}


def output_help() -> str:
    """What `onenode bench` prints, row by row: the epilog of its `--help`."""
    def section(title: str, entries: dict[str, str]) -> list[str]:
        width = max(map(len, entries)) + 2
        lines = [title]
        for name, meaning in entries.items():
            wrapped = textwrap.wrap(meaning, 96 - width)
            lines += [f"  {name:<{width}}{wrapped[0]}", *(" " * (width + 2) + rest for rest in wrapped[1:])]
        return lines

    return "\n".join(["while it runs, the progress bar shows each step's loss and tokens/s (tok_s), warm-up included",
                      ""] + section("then it prints, row by row:", TABLE_ROWS) + [""]
                     + section("the top-kernels table (--profile), column by column:", TOP_KERNEL_COLUMNS))


def json_safe(value):
    """`value` with infinities and NaNs as strings, so the record is strict JSON (jq, browsers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def command_line(args, world: int) -> str:
    """The command that repeats this run, every option spelled out."""
    launcher = f"torchrun --nproc-per-node {world} -m onenode.cli" if world > 1 else "onenode"
    words = [launcher, "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        for one in value if isinstance(value, list) else [value]:
            words.append(f"--{key.replace('_', '-')}" + ("" if one is True else f" {one}"))
    return " ".join(words)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


def format_table(record: dict) -> str:
    r, lay = record["results"], record["layout"]
    rows = [
        ("model", f"{record['preset']} ({record['impl']}), {lay['micro_batch']} x {lay['seq_len']} tokens per rank"),
        ("layout", f"world {lay['world_size']}: dp {lay['dp']} ep {lay['ep']} pp {lay['pp']}, "
                   f"AC {'on' if lay['activation_checkpointing'] else 'off'}, compile {lay['compile']}"
                   f"{' + CUDA graphs' if lay.get('cuda_graphs') else ''}, {lay['dtype']}"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f} total, {r['tokens_per_s_per_gpu']:,.0f} per GPU (or CPU process)"),
        ("step time", f"median {r['step_time_median_s'] * 1e3:.1f} ms (min {r['step_time_min_s'] * 1e3:.1f}, "
                      f"max {r['step_time_max_s'] * 1e3:.1f}, stdev {r['step_time_stdev_s'] * 1e3:.1f}) "
                      f"over {record['steps']['measured']} steps"),
        ("FLOPs/token", f"{r['matmul_flops_per_token'] / 1e9:.3f} G tensor-core (fwd+bwd, causal-half attention), "
                        f"{r['other_flops_per_token'] / 1e9:.3f} G other"),
        ("MFU", f"{_percent(r['mfu'])} of {r['peak_tflops']:.0f} TFLOP/s "
                f"({r['achieved_tflops_per_gpu']:.3g} TFLOP/s per GPU)"),
    ]
    if r["ceiling_tflops"]:
        rows.append(("vs ceiling", f"{_percent(r['mfu_vs_ceiling'])} of a measured "
                                   f"{r['ceiling_tflops']:.3g} TFLOP/s matmul"))
    host = r.get("peak_cpu_memory_gib")  # records before it have none; on a CPU it is the peak memory itself
    host = f", host {host:.2f} GiB resident" if host is not None and r["memory_kind"] != "cpu_max_rss" else ""
    rows.append(("peak memory", f"{r['peak_memory_gib']:.2f} GiB ({r['memory_kind']}){host}"))
    if r["step_split"]:
        rows.append(("time split", f"compute {r['compute_share']:.1%}, communication {r['comm_share']:.1%} "
                                   f"(exposed {r['exposed_comm_share']:.1%}), idle {r['idle_share']:.1%} "
                                   f"of {r['step_split']['window_s']:.2f} s "
                                   f"profiled ({record['steps']['profiled']} steps)"))
    if r["kernels_per_step"]:
        what = "kernels" if record["env"]["device_type"] == "cuda" else "ops"
        rows.append(("launches", f"{r['kernels_per_step']:,.0f} {what} per step, "
                                 f"{r['mean_kernel_s'] * 1e6:.1f} us each on average"))
    if record["kernel_mix"]:
        rows.append(("kernel mix", ", ".join(f"{kind} {share:.1%}" for kind, share in record["kernel_mix"].items())))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
