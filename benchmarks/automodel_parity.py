"""The kit's NemotronH against NeMo Automodel's NemotronV3 on one GPU: the same weights, the same
tokens, float32 logits compared, in both directions (the kit's weights into Automodel's model through
its own `state_dict_adapter.from_hf`, and Automodel's weights into the kit's through `to_hf`).

Automodel's Mamba mixer runs mamba_ssm's Triton kernels (`mamba_split_conv1d_scan_combined`, the
gated RMSNorm), so this runs on a GPU only. The install, the fewest of its dependencies that work
(no CUDA build; README.md, "NeMo Automodel"):

    pip install --no-deps nemo-automodel==0.7.0
    MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation --no-deps mamba-ssm==2.3.2.post1 einops

mamba_ssm's fused scan calls causal-conv1d's CUDA convolution for its first step, a package that
needs an nvcc build. Where it is not installed, the short causal depthwise convolution it computes is
given in plain PyTorch (`automodel_peer.stand_in_causal_conv1d`); the scan and the norm stay
mamba_ssm's own. Automodel's model is built as `automodel_peer.py` builds the training peer. Triton's
float32 matrix products run in IEEE float32 (`TRITON_F32_DEFAULT=ieee`), not TF32.

    python benchmarks/automodel_parity.py --out benchmarks/results/DATE-h200-automodel-parity/parity.json
    python benchmarks/automodel_parity.py --cpu --out /tmp/parity.json   # the layouts without Mamba, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")

import torch  # noqa: E402

KIT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(KIT_ROOT / "starter_code"))
sys.path.insert(0, str(KIT_ROOT / "benchmarks"))
from automodel_peer import automodel_nemotron_h, mamba_kernels_or_exit  # noqa: E402

# Both kinds of hybrid layout (Mamba first, attention first with a dense MLP), on the tiny preset and
# on one with wider Mamba heads; sequences of several scan chunks.
CONFIGS = [
    {"hybrid_override_pattern": "MEM*EM-E"},
    {"hybrid_override_pattern": "*EME-M"},
    {"hybrid_override_pattern": "MEM*EM-E", "mamba_head_dim": 16, "chunk_size": 32, "hidden_size": 128},
    {"hybrid_override_pattern": "*EME-M", "mamba_head_dim": 16, "chunk_size": 32, "hidden_size": 128},
]
# On a CPU (`--cpu`), layouts without Mamba layers: attention, routed experts and the dense MLP run
# in plain PyTorch there, so the adapter and every other layer are checked without a GPU.
CPU_CONFIGS = [
    {"hybrid_override_pattern": "*E-E"},
    {"hybrid_override_pattern": "-E*E", "hidden_size": 128},
]
BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch", experts="torch_mm", dispatcher="torch",
               enable_hf_state_dict_adapter=True)
TOLERANCE = 1e-4  # relative (norm of the difference over the norm of the kit's logits)


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).norm() / ours.double().norm())


def compare(overrides: dict, device: torch.device, seq_len: int, seed: int) -> dict:
    from onenode.model import hf_io
    from onenode.model.config import get_preset
    from onenode.model.nemotron_h import NemotronHForCausalLM

    config = get_preset("tiny", **overrides)
    torch.manual_seed(seed)
    kit = NemotronHForCausalLM(config).to(device).eval()
    # the kit's weights into Automodel's model through its adapter
    theirs = automodel_nemotron_h(config, BACKEND, device, torch.float32, kit.state_dict()).eval()
    tokens = torch.randint(0, config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)
    result = {"config": overrides, "seq_len": seq_len}
    with torch.no_grad():
        ours_logits = kit(tokens).logits.float()
        result["kit_into_automodel"] = _relative(ours_logits, theirs(tokens).logits.float())
        # Automodel's own initialisation into the kit's model through `to_hf`
        fresh = automodel_nemotron_h(config, BACKEND, device, torch.float32).eval()
        fresh.initialize_weights(buffer_device=device, dtype=torch.float32)
        back = fresh.state_dict_adapter.to_hf(fresh.state_dict())
        again = NemotronHForCausalLM(config).to(device).eval()
        again.load_state_dict(hf_io.adapt_state_dict(back, again), strict=True)
        result["automodel_into_kit"] = _relative(again(tokens).logits.float(), fresh(tokens).logits.float())
    result["passed"] = all(result[way] < TOLERANCE for way in ("kit_into_automodel", "automodel_into_kit"))  # NaN fails
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the record (JSON)")
    parser.add_argument("--seq-len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="on the CPU: the layouts without Mamba layers only")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("automodel_parity.py: no CUDA device; Automodel's forward runs mamba_ssm's Triton "
                         "kernels, so run this on a GPU (the adapter alone is tested on CPUs: "
                         "tests/test_automodel_adapter.py)")
    try:
        import nemo_automodel  # noqa: F401
    except ImportError:
        raise SystemExit("automodel_parity.py: nemo-automodel is not installed: "
                         "pip install --no-deps nemo-automodel==0.7.0") from None
    convolution = None
    if not args.cpu:
        convolution = mamba_kernels_or_exit("automodel_parity.py")
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu" if args.cpu else "cuda")
    configs = CPU_CONFIGS if args.cpu else CONFIGS
    results = [compare(overrides, device, args.seq_len, args.seed) for overrides in configs]
    from importlib.metadata import version

    record = {
        "what": "logits of the kit's NemotronH and NeMo Automodel's NemotronV3 on the same weights and tokens, "
                "float32, relative error (norm of the difference over the kit's norm), both directions",
        "command": "python benchmarks/automodel_parity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": os.environ.get("ONENODE_COMMIT", "unknown"),
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{name: version(name) for name in ("nemo-automodel", "transformers")
                        + (() if args.cpu else ("mamba-ssm", "triton"))}},
        "causal_conv1d": convolution,
        "tolerance": TOLERANCE,
        "results": results,
        "passed": all(r["passed"] for r in results),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for r in results:
        print(f"{json.dumps(r['config'])}: kit->automodel {r['kit_into_automodel']:.2e}, "
              f"automodel->kit {r['automodel_into_kit']:.2e}")
    print("PASS" if record["passed"] else f"FAIL: a relative error is over {TOLERANCE}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
