"""NeMo Automodel's NemotronV3, the peer students would pick instead of the kit, trained on the batches
and from the weights of `onenode bench`, and timed the way the bench times the kit.

    python3 benchmarks/automodel_peer.py --preset a1-1gpu --seq-len 4096 --micro-batch 1 --steps 5 --warmup 2 \
        --measure-ceiling --out automodel.json     # on one GPU, beside `onenode bench` with the same options

The kit's model is built as `onenode bench` builds it (the same recipe through `bench_recipe`, the
same seed and device), its weights go into Automodel's model through Automodel's own state-dict
adapter (`from_hf`, the kit's experts first unstacked to the per-expert layout it reads), and each
step trains on the bench's seeded synthetic batch; so the first loss is the kit's first loss. With
the kit's tree on PYTHONPATH (a patched copy), that tree's model gives the weights.

The step, as Automodel trains (`recipes/llm/train_ft.py`, one GPU, no FSDP):
- precision: parameters stored in bf16, Automodel's default dtype (`NeMoAutoModelForCausalLM`'s
  `torch_dtype="auto"`), cast by its `cast_model_to_dtype`, which keeps its fp32 modules (the Mamba
  A_log, D and dt_bias holders, the routers' correction bias) in float32; bf16 gradients; no autocast.
  On one GPU its FSDP2 policy (bf16 parameters, float32 gradient reduction) changes nothing.
  Automodel warns that bf16 Adam state may cost stability and names float32 parameters under FSDP
  mixed precision, or Transformer Engine's FusedAdam with master weights, as the stabler choices:
  both move more bytes per step, and neither is its default.
- forward, then Automodel's `MaskedCrossEntropy` (its default float32 upcast of the bf16 logits),
  the mean over the batch's tokens; backward; Automodel's `clip_grad_norm` at the recipe's
  `train.grad_clip` (torch's foreach clipping for plain tensors); torch's fused AdamW through
  Automodel's `AdamWConfig(fused=True)` (one group, the recipe's lr, betas, eps and weight decay);
  `zero_grad(set_to_none=True)`.
Why it is the fair comparison: it is what Automodel gives a student on one GPU, with the fastest
AdamW torch has (Automodel's own Nano benchmark uses the unfused `torch.optim.Adam`). It moves fewer
bytes per parameter than the kit (bf16 weights, gradients and moments: 8 bytes, against the kit's
float32 masters, gradients and moments and their bf16 copies: 18), so what it changes favours
Automodel. Its routing is the learned gate (Automodel's Nano benchmark forces balanced routing with
`fake_balanced_gate`, which would change the loss).

Each step is timed between two device synchronisations (`time.perf_counter`), as `onenode bench`
times the kit's; the record's `results` hold the same figures as the bench's (tokens/s, MFU with
the kit's FLOPs per token against 989 TFLOP/s and, with `--measure-ceiling`, a measured bf16 matmul,
peak memory), its `steps.losses` the loss of every step. Peak memory counts from the second step on
(the first picks the backends; the kit's weights are freed after it): Automodel's model, optimizer
and steps only.

Backends (`BACKENDS`), tried in order of expected speed: Automodel's BackendConfig with Transformer
Engine's attention, linear layers and RMSNorm, then SDPA with torch's layers; routed experts on
`torch._grouped_mm` (`torch_mm`), the per-expert loop last. The first that builds and trains a step
is timed; each one before it is recorded with its exact error. Automodel builds Transformer
Engine's grouped experts (`experts="te"`) only with an expert-parallel dispatcher on several GPUs
(`components/moe/layers.py`): on one GPU that choice runs the per-expert loop, so it is not a
candidate. The Mamba mixer trains through mamba_ssm's Triton `mamba_split_conv1d_scan_combined`
(installed without its CUDA build: `make mamba-ssm`); its causal convolution is causal-conv1d's CUDA
kernel where that package imports, else `stand_in_causal_conv1d` (torch's conv1d, forward and
backward), and the record says which, with the import's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

KIT_ROOT = Path(__file__).resolve().parents[1]
# The kit's own package, last: a PYTHONPATH (a patched tree) or an install comes first.
sys.path.append(str(KIT_ROOT / "starter_code"))

# BackendConfig fields on one GPU, in the order of expected speed; each with `COMMON_BACKEND`.
BACKENDS = {
    "te+torch_mm": dict(attn="te", linear="te", rms_norm="te", experts="torch_mm"),
    "sdpa+torch_mm": dict(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch_mm"),
    "sdpa+torch": dict(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch"),
}
COMMON_BACKEND = dict(dispatcher="torch", fake_balanced_gate=False, enable_hf_state_dict_adapter=True)


def _causal_conv1d(x, weight, bias=None, activation: bool = False):
    """x (batch, channels, length), weight (channels, width): each channel's causal convolution."""
    width = weight.shape[-1]
    out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., : x.shape[-1]]
    return F.silu(out) if activation else out


def stand_in_causal_conv1d() -> str:
    """The causal-conv1d package, or, where it does not import, a stand-in in plain PyTorch with the
    entry points mamba_ssm's fused scan calls (forward and backward of whole sequences); which one,
    and the import's error."""
    try:
        import causal_conv1d
        from causal_conv1d import cpp_functions  # noqa: F401  (what mamba_ssm's scan calls)

        return f"causal-conv1d {getattr(causal_conv1d, '__version__', '')} (CUDA)".replace("  ", " ")
    except ImportError as e:
        error = f"{type(e).__name__}: {e}"

    def whole_sequences(seq_idx, initial_states, final_states=None):
        if seq_idx is not None or initial_states is not None or final_states is not None:
            raise NotImplementedError("the stand-in causal convolution runs whole sequences only")

    def fwd(x, weight, bias, seq_idx, initial_states, final_states_out, silu_activation):
        whole_sequences(seq_idx, initial_states, final_states_out)
        return _causal_conv1d(x, weight, bias, silu_activation)

    def bwd(x, weight, bias, dout, seq_idx, initial_states, dfinal_states, dx, return_dinitial_states,
            silu_activation):
        whole_sequences(seq_idx, initial_states, dfinal_states)
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
            out = _causal_conv1d(*inputs[:2], inputs[2] if bias is not None else None, silu_activation)
            grads = torch.autograd.grad(out, inputs, dout)
        if dx is not None:
            dx.copy_(grads[0])
        return dx if dx is not None else grads[0], grads[1], grads[2] if bias is not None else None, None

    def fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
           final_states_out=None, activation=None):
        return fwd(x, weight, bias, seq_idx, initial_states, final_states_out, activation in ("silu", "swish"))

    def not_given(*args, **kwargs):
        raise NotImplementedError("the stand-in causal convolution has no single-step update (decoding)")

    package, cpp = types.ModuleType("causal_conv1d"), types.ModuleType("causal_conv1d.cpp_functions")
    package.causal_conv1d_fn, package.causal_conv1d_update = fn, not_given
    cpp.causal_conv1d_fwd_function, cpp.causal_conv1d_bwd_function = fwd, bwd
    cpp.causal_conv1d_update_function = not_given
    package.cpp_functions = cpp
    sys.modules.update({"causal_conv1d": package, "causal_conv1d.cpp_functions": cpp})
    return f"stand-in: torch conv1d, forward and backward (causal-conv1d: {error})"


def load_mamba_ssm_kernels() -> None:
    """mamba_ssm's Triton modules Automodel imports in its forward, loaded past the package's
    `__init__` (which needs its CUDA extension) and kept in sys.modules for those imports."""
    from onenode.model.mamba_ssm_scan import import_skipping_package_init

    for module in ("mamba_ssm.ops.triton.ssd_combined", "mamba_ssm.ops.triton.layernorm_gated"):
        import_skipping_package_init(module)



def mamba_kernels_or_exit(script: str) -> str:
    """mamba_ssm's Triton kernels loaded, with causal-conv1d's convolution stood in where that package
    is absent; which convolution runs. One line naming `script` where the kernels are missing."""
    convolution = stand_in_causal_conv1d()
    try:
        load_mamba_ssm_kernels()
    except ImportError as e:
        raise SystemExit(f"{script}: mamba_ssm's Triton kernels are missing ({e}): install them with "
                         "`make mamba-ssm`") from None
    return convolution

def automodel_nemotron_h(config, backend: dict, device: torch.device, dtype: torch.dtype,
                         weights: dict[str, torch.Tensor] | None = None):
    """Automodel's NemotronV3 for the kit's `config`, built on `device` with `backend` (BackendConfig
    fields), its parameters in `dtype` as Automodel casts them (its fp32 modules stay float32), and
    `weights` (a kit state dict, either expert layout, on any device) loaded through Automodel's
    adapter; without `weights`, its constructor's values."""
    from nemo_automodel.components.models.common.utils import BackendConfig, cast_model_to_dtype
    from nemo_automodel.components.models.nemotron_v3.model import NemotronHForCausalLM as AutomodelNemotronH
    from transformers import NemotronHConfig

    from onenode.model import hf_io

    with torch.device(device):
        model = AutomodelNemotronH.from_config(NemotronHConfig(**config.to_hf_dict()), BackendConfig(**backend))
    model.to(device)  # anything its constructor placed elsewhere
    cast_model_to_dtype(model, dtype)  # before loading: float32 weights are rounded once, into the final dtype
    if weights is not None:
        adapter = model.state_dict_adapter
        per_expert = {key: tensor.shape for key, tensor in adapter.to_hf(model.state_dict()).items()}
        model.load_state_dict(adapter.from_hf(hf_io.convert_layout(weights, per_expert)), strict=True)
    return model


def peer_recipe(args):
    """The recipe `onenode bench` runs with the same options (one process)."""
    from onenode.bench.measure import bench_recipe
    from onenode.train.recipe import RecipeError

    try:
        recipe = bench_recipe(args, 1, args.warmup + args.steps)
    except RecipeError as e:
        raise SystemExit(f"automodel_peer.py: {e}") from None
    if recipe.optimizer.name != "adamw":
        raise SystemExit(f"automodel_peer.py: optimizer.name {recipe.optimizer.name}: the peer trains with AdamW")
    return recipe


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _versions(names: list[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def run(args) -> dict:
    """Build the kit's weights, then Automodel's model on the first backend that trains a step, then
    time the steps; the record."""
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
    from nemo_automodel.components.optim.optimizer import AdamWConfig
    from nemo_automodel.components.training.utils import clip_grad_norm

    from onenode.bench.device import matmul_ceiling, peak_memory_bytes, sync, synthetic_batches
    from onenode.flops import mfu, model_flops
    from onenode.model import build_model
    from onenode.parallel.distributed import local_device
    from onenode.train.logging import environment, git_commit

    recipe = peer_recipe(args)
    t, o, config = recipe.train, recipe.optimizer, recipe.model_config()
    device = local_device() if t.device == "auto" else torch.device(t.device)
    dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32
    mamba = "no Mamba layers in this layout"
    convolution = None
    if "M" in config.hybrid_override_pattern:
        if device.type != "cuda":
            raise SystemExit("automodel_peer.py: Automodel's Mamba layers run mamba_ssm's Triton kernels: run on a "
                             "GPU, or a layout without Mamba layers (--set model.overrides.pattern=...)")
        convolution = mamba_kernels_or_exit("automodel_peer.py")
        mamba = f"mamba_ssm {_versions(['mamba-ssm']).get('mamba-ssm', '?')}: Triton mamba_split_conv1d_scan_combined"

    torch.manual_seed(recipe.seed)  # as `assemble` builds the bench's model
    kit = build_model(config, seed=recipe.seed, device=device)
    weights = {key: tensor.detach().cpu() for key, tensor in kit.state_dict().items()}
    del kit
    _free(device)
    batches = synthetic_batches(config.vocab_size, t.global_batch_size, t.seq_len, recipe.seed, 0, 1)
    first_batch = [x.to(device) for x in next(batches)]
    loss_fn = MaskedCrossEntropy()

    def timed_step(model, optimizer, input_ids, labels) -> tuple[float, float]:
        """One training step between two device synchronisations: its seconds and its loss."""
        sync(device)
        start = time.perf_counter()
        logits = model(input_ids).logits
        loss = loss_fn(logits, labels, num_label_tokens=labels.numel())
        loss.backward()
        clip_grad_norm(t.grad_clip, [model], foreach=True, use_torch_clip_grad_norm=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - start, loss.item()

    names = args.backends or list(BACKENDS)
    tried, times, losses = [], [], []
    model = optimizer = None
    for name in names:
        try:
            model = automodel_nemotron_h(config, BACKENDS[name] | COMMON_BACKEND, device, dtype, weights).train()
            optimizer = AdamWConfig(lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps,
                                    fused=True).build(model)[0]
            elapsed, loss = timed_step(model, optimizer, *first_batch)
        except Exception as e:  # the next backend; this one's error goes in the record
            tried.append({"backends": name, "error": f"{type(e).__name__}: {' '.join(str(e).split())}"})
            model = optimizer = None
            _free(device)
            continue
        tried.append({"backends": name, "error": None})
        times.append(elapsed)
        losses.append(loss)
        break
    if model is None:
        raise SystemExit("automodel_peer.py: no backend trained a step: " + "; ".join(
            f"{entry['backends']}: {entry['error']}" for entry in tried))
    del weights, first_batch
    _free(device)
    if device.type == "cuda":  # from here: Automodel's model, optimizer and steps only
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup + args.steps - 1):
        input_ids, labels = (x.to(device, non_blocking=True) for x in next(batches))
        elapsed, loss = timed_step(model, optimizer, input_ids, labels)
        times.append(elapsed)
        losses.append(loss)
        if not args.quiet:
            print(f"step {len(losses)}: loss {loss:.4f}, {t.global_batch_size * t.seq_len / elapsed:,.0f} tokens/s",
                  flush=True)

    step_times = times[args.warmup:]
    median = statistics.median(step_times)
    tokens_per_step = t.global_batch_size * t.seq_len
    report = model_flops(config, t.seq_len, t.global_batch_size)
    tokens_per_s = tokens_per_step / median
    memory, memory_kind = peak_memory_bytes(device)
    results = {
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_s,
        "step_time_median_s": median,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "matmul_flops_per_token": report.matmul_flops_per_token,
        "achieved_tflops_per_gpu": tokens_per_s * report.matmul_flops_per_token / 1e12,
        "peak_tflops": args.peak / 1e12,
        "mfu": mfu(tokens_per_s, report.matmul_flops_per_token, 1, args.peak),
        "ceiling_tflops": None,
        "mfu_vs_ceiling": None,
        "peak_memory_gib": memory / 2**30,
        "memory_kind": memory_kind,
    }
    if args.measure_ceiling:
        ceiling = matmul_ceiling(device)
        results["ceiling_tflops"] = ceiling / 1e12
        results["mfu_vs_ceiling"] = mfu(tokens_per_s, report.matmul_flops_per_token, 1, ceiling)
    ran = tried[-1]["backends"]
    return {
        "record": "automodel-peer",
        "command": "python3 benchmarks/automodel_peer.py " + " ".join(args.argv),
        "commit": git_commit() or "unknown",
        "impl": f"nemo-automodel/{ran}",
        "preset": recipe.model.preset,
        "config": dataclasses.asdict(config),
        "layout": {"world_size": 1, "micro_batch": t.global_batch_size, "seq_len": t.seq_len, "dtype": t.precision,
                   "seed": recipe.seed, "compile": "off"},
        "precision": f"parameters, gradients and moments {t.precision} (Automodel's fp32 modules float32), no "
                     "autocast, cross entropy on float32-upcast logits",
        "optimizer": {"name": "torch.optim.AdamW (fused), Automodel's AdamWConfig", "lr": o.lr, "betas": list(o.betas),
                      "eps": o.eps, "weight_decay": o.weight_decay, "grad_clip": t.grad_clip},
        "backends": {"ran": ran, "backend_config": BACKENDS[ran] | COMMON_BACKEND, "mamba": mamba,
                     "causal_conv1d": convolution, "tried": tried},
        "env": environment(1) | {"cuda": torch.version.cuda, "device_type": device.type,
                                 "peer_versions": _versions(["nemo-automodel", "mamba-ssm", "causal-conv1d",
                                                             "transformer-engine", "triton"])},
        "steps": {"warmup": args.warmup, "measured": args.steps, "step_times_s": step_times, "losses": losses},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    from onenode.flops import H100_H200_BF16_PEAK

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    parser.add_argument("--preset", default=None, help="model.preset, as onenode bench takes it (default tiny)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first and not measured (at least 1)")
    parser.add_argument("--device", default=None, help="train.device (default: the GPU, else cpu)")
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                        help="train.precision: the parameters' dtype (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                        help="a recipe field, as onenode bench takes it (repeatable)")
    parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=None,
                        help="the backend combinations to try, in this order (default: all, fastest first)")
    parser.add_argument("--measure-ceiling", action="store_true", help="also report MFU against a measured matmul")
    parser.add_argument("--peak", type=float, default=H100_H200_BF16_PEAK, help="peak FLOP/s per GPU for MFU")
    parser.add_argument("--quiet", action="store_true", help="no line per step")
    parser.set_defaults(recipe=None, unfused_update=False)  # the bench options the peer does not take
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if args.steps < 1 or args.warmup < 1:
        raise SystemExit("automodel_peer.py: --steps and --warmup must be >= 1 (the first step picks the backends)")
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        raise SystemExit("automodel_peer.py: nemo-automodel is not installed: "
                         "pip install --no-deps nemo-automodel==0.7.0") from None
    from onenode.bench.record import json_safe

    record = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(json_safe(record), indent=2, allow_nan=False) + "\n")
    r = record["results"]
    print(f"nemo-automodel ({record['backends']['ran']}): {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.2%}, "
          f"peak {r['peak_memory_gib']:.1f} GiB, first loss {record['steps']['losses'][0]:.4f}; record: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
