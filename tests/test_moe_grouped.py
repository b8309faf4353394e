"""Grouped experts (A1 part 1) against the starter's per-expert loop: same forward, same backward,
and checkpoints cross between the two layouts.

The starter side runs in this process (the kit's own `onenode`); the grouped side runs in a copy
of starter_code with part 1 applied (`patched_copy.run_in_tree`), reading what the starter wrote.
"""

from __future__ import annotations

import pytest
import torch
from patched_copy import patched_tree, run_in_tree

PATTERN = "ME"  # one MoE layer behind a Mamba layer: whole-model checkpoints and logits too


def _config():
    from onenode.model import get_preset

    return get_preset("tiny", hybrid_override_pattern=PATTERN)


def _moe_run(model, x, grad_out) -> dict:
    """One MoE layer forward+backward: output, input gradient, parameter gradients."""
    moe = model.backbone.layers[1].mixer
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = moe(x)
    y.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads}


def grouped_side(folder: str) -> dict:
    """In the part-1 tree: load the starter's weights, rerun its inputs, report the differences."""
    from pathlib import Path

    import torch

    from onenode import load_pretrained
    from onenode.model import build_model
    from onenode.model import moe as moe_module
    from onenode.model.hf_io import adapt_state_dict, save_pretrained

    folder = Path(folder)
    saved = torch.load(folder / "starter.pt", weights_only=False)
    model = build_model(_config(), seed=1)
    model.load_state_dict(adapt_state_dict(saved["state_dict"], model))

    def errors(run: dict) -> dict:
        ref = saved["run"]
        out = {"y": float((run["y"] - ref["y"]).abs().max()), "dx": float((run["dx"] - ref["dx"]).abs().max())}
        for name, grad in run["grads"].items():
            if name.startswith("experts."):  # stacked [E, ...] vs one [.., ..] per expert
                proj = name.split(".")[1]
                expected = torch.stack([ref["grads"][f"experts.{j}.{proj}.weight"] for j in range(grad.shape[0])])
            else:
                expected = ref["grads"][name]
            out[name] = float((grad - expected).abs().max())
        return out

    result = {"grouped_mm": errors(_moe_run(model, saved["x"], saved["grad_out"]))}
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None:  # the fallback for devices without the kernel
        del torch._grouped_mm
        try:
            result["fallback"] = errors(_moe_run(model, saved["x"], saved["grad_out"]))
        finally:
            torch._grouped_mm = grouped_mm
    result["expert_layout"] = {k: list(v.shape) for k, v in model.state_dict().items() if ".experts." in k}
    result["has_grouped_experts"] = hasattr(moe_module, "GroupedExperts")
    # Checkpoints: the starter's (per-expert) loads here; ours loads back and in the starter.
    ids = saved["ids"]
    loaded = load_pretrained(folder / "starter_ckpt")
    result["starter_ckpt_logits"] = float((loaded(ids).logits - saved["logits"]).abs().max())
    save_pretrained(loaded, folder / "grouped_ckpt")
    again = load_pretrained(folder / "grouped_ckpt")
    result["roundtrip_logits"] = float((again(ids).logits - saved["logits"]).abs().max())
    return result


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    from onenode import load_pretrained
    from onenode.model import build_model
    from onenode.model.hf_io import save_pretrained

    folder = tmp_path_factory.mktemp("moe")
    model = build_model(_config(), seed=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, model.config.hidden_size, generator=gen)
    grad_out = torch.randn(x.shape, generator=gen)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits
    torch.save({"state_dict": model.state_dict(), "run": _moe_run(model, x, grad_out), "x": x,
                "grad_out": grad_out, "ids": ids, "logits": logits}, folder / "starter.pt")
    save_pretrained(model, folder / "starter_ckpt")
    result = run_in_tree(patched_tree(["1-moe"]), "test_moe_grouped:grouped_side", folder=str(folder))
    result["folder"] = folder
    result["starter_reload"] = load_pretrained(folder / "grouped_ckpt")(ids).logits.sub(logits).abs().max().item()
    return result


def test_part1_stacks_the_experts(compared):
    assert compared["has_grouped_experts"]
    shapes = compared["expert_layout"]
    assert shapes["backbone.layers.1.mixer.experts.up_proj"] == [8, 32, 64]  # [E, I, H]
    assert shapes["backbone.layers.1.mixer.experts.down_proj"] == [8, 64, 32]  # [E, H, I]


@pytest.mark.parametrize("path", ["grouped_mm", "fallback"])
def test_grouped_experts_match_the_loop(compared, path):
    if path not in compared:
        pytest.skip("this torch has no torch._grouped_mm: only the fallback ran")
    errors = compared[path]
    assert set(errors) >= {"y", "dx", "experts.up_proj", "experts.down_proj", "gate.weight"}
    bad = {name: err for name, err in errors.items() if err > 1e-5}
    assert not bad, f"{path}: grouped experts differ from the starter's loop (max abs error): {bad}"


def test_checkpoints_cross_layouts(compared):
    assert compared["starter_ckpt_logits"] < 1e-5, "a per-expert (starter) checkpoint loads into stacked experts"
    assert compared["roundtrip_logits"] < 1e-5, "a stacked-experts checkpoint saves and loads back"
    assert compared["starter_reload"] < 1e-5, "the starter loads what the grouped model saved"


@pytest.mark.slow
def test_moe_benchmark_smoke(tmp_path):
    """benchmarks/moe_layer.py --tiny: both implementations run from the same weights and agree."""
    import json
    import subprocess
    import sys

    from patched_copy import KIT_ROOT

    out = tmp_path / "moe_layer.json"
    proc = subprocess.run([sys.executable, "benchmarks/moe_layer.py", "--tiny", "--warmup", "0", "--repeats", "1",
                           "--out", str(out)], cwd=KIT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["outputs_rel_diff"] < 1e-5, "loop and grouped MoE disagree on the same weights"
    for name in ("loop", "grouped"):
        result = report["results"][name]
        assert result["layer_ms"] > 0 and result["expert_matmul_flops"] == 3 * 256 * 2 * 2 * (2 * 64 * 32)
    assert report["results"]["grouped"]["onenode"] != report["results"]["loop"]["onenode"]
