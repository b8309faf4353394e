"""The kit's NemotronH weights through NeMo Automodel's own NemotronV3 state-dict adapter, both ways,
on a CPU: Automodel's model is built (its constructor runs anywhere; its forward needs mamba_ssm's
Triton kernels, so the parity of the Mamba layouts runs on a GPU), the kit's checkpoint layout (the one NVIDIA's
checkpoints use, one tensor per expert matrix) goes in through `from_hf` and must fill every one of
its parameters at its shape, and what `to_hf` gives back must load into the kit's model unchanged.

nemo-automodel is installed without its dependencies (`make setup` does: its model code imports
with the kit's torch, transformers, safetensors, pyyaml and einops)."""

from __future__ import annotations

import pytest
import torch

from onenode.model import hf_io
from onenode.model.config import get_preset
from onenode.model.nemotron_h import NemotronHForCausalLM

pytestmark = pytest.mark.slow  # importing Automodel and building its model: about a minute on 2 cores

automodel = pytest.importorskip(
    "nemo_automodel.components.models.nemotron_v3.model",
    reason="nemo-automodel is not installed: pip install --no-deps nemo-automodel==0.7.0 (make setup does)")
from nemo_automodel.components.models.common.utils import BackendConfig  # noqa: E402
from transformers import NemotronHConfig  # noqa: E402

# The plain-PyTorch backends: what builds on any machine.
BACKEND = dict(attn="sdpa", linear="torch", rms_norm="torch", experts="torch_mm", dispatcher="torch",
               enable_hf_state_dict_adapter=True)
# Both kinds of hybrid layout: Mamba first (the tiny preset's) and attention first, with a dense MLP.
PATTERNS = ["MEM*EM-E", "*EME-M"]


def _models(pattern: str):
    config = get_preset("tiny", hybrid_override_pattern=pattern)
    torch.manual_seed(0)
    kit = NemotronHForCausalLM(config)
    theirs = automodel.NemotronHForCausalLM.from_config(NemotronHConfig(**config.to_hf_dict()),
                                                       BackendConfig(**BACKEND))
    return config, kit, theirs


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_kits_weights_fill_automodels_model_through_its_adapter(pattern):
    _, kit, theirs = _models(pattern)
    ours = {key: tensor.clone() for key, tensor in kit.state_dict().items()}
    native = theirs.state_dict_adapter.from_hf(dict(ours))
    target = theirs.state_dict()
    assert native.keys() == target.keys(), (sorted(set(target) - set(native)), sorted(set(native) - set(target)))
    wrong = [key for key in target if native[key].shape != target[key].shape]
    assert not wrong, wrong
    theirs.load_state_dict(native, strict=True)
    # every routed expert's matrices landed in its own slot of the grouped tensors
    layer = next(i for i, kind in enumerate(pattern) if kind == "E")
    down = theirs.state_dict()[f"model.layers.{layer}.mixer.experts.down_projs"]
    for expert in range(kit.config.n_routed_experts):
        theirs_row = down[expert]
        our_matrix = ours[f"backbone.layers.{layer}.mixer.experts.{expert}.down_proj.weight"]
        assert torch.equal(theirs_row, our_matrix) or torch.equal(theirs_row, our_matrix.T), expert


@pytest.mark.parametrize("pattern", PATTERNS)
def test_automodels_weights_come_back_into_the_kits_model_unchanged(pattern):
    config, kit, theirs = _models(pattern)
    theirs.load_state_dict(theirs.state_dict_adapter.from_hf(dict(kit.state_dict())), strict=True)
    back = theirs.state_dict_adapter.to_hf(theirs.state_dict())
    again = NemotronHForCausalLM(config)
    again.load_state_dict(hf_io.adapt_state_dict(back, again), strict=True)
    for key, tensor in kit.state_dict().items():
        assert torch.equal(again.state_dict()[key], tensor), key


def _script(name: str):
    """A benchmarks/ script as a module, in this process (where Automodel is imported already)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_logits_match_automodels_on_the_layers_a_cpu_runs(tmp_path):
    """benchmarks/automodel_parity.py --cpu: on layouts without Mamba layers (attention, routed experts,
    the dense MLP), Automodel's forward runs in plain PyTorch, and its float32 logits must match the
    kit's on the same weights and tokens, both ways. The Mamba layouts run on a GPU (recorded). Run
    in this process, where Automodel is imported already."""
    import json

    parity = _script("automodel_parity")
    out = tmp_path / "parity.json"
    assert parity.main(["--cpu", "--out", str(out), "--seq-len", "40"]) == 0
    record = json.loads(out.read_text())
    assert len(record["results"]) == 2 and record["passed"]
    for result in record["results"]:
        assert result["kit_into_automodel"] < record["tolerance"], result
        assert result["automodel_into_kit"] < record["tolerance"], result
    if not torch.cuda.is_available():  # the Mamba layouts: one line that says where they run
        with pytest.raises(SystemExit, match="no CUDA device; .* run this on a GPU"):
            parity.main(["--out", str(tmp_path / "gpu.json")])


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-5), ("bf16", 2e-3)])
def test_the_automodel_peer_trains_from_the_kits_first_loss(tmp_path, dtype, tolerance):
    """benchmarks/automodel_peer.py (run_a1_gpu.py's `automodel` run) on a CPU, on a layout without
    Mamba layers: built from the weights `onenode bench` builds with the same options and trained on
    its first batch, Automodel's first loss is the kit's (to float rounding, or bf16's); its record
    has the bench's figures and the backends, each that would not train with its error."""
    import importlib.util
    import json

    from onenode import cli
    from onenode.flops import model_flops

    peer = _script("automodel_peer")
    options = ["--preset", "tiny", "--seq-len", "32", "--steps", "1", "--warmup", "1", "--dtype", dtype,
               "--set", "model.overrides.pattern=-E*E"]
    assert cli.main(["bench", *options, "--quiet", "--out", str(tmp_path / "kit.json")]) == 0
    assert peer.main([*options, "--quiet", "--out", str(tmp_path / "peer.json")]) == 0
    kit, record = (json.loads((tmp_path / name).read_text()) for name in ("kit.json", "peer.json"))
    assert record["steps"]["losses"][0] == pytest.approx(kit["steps"]["losses"][0], rel=tolerance)
    assert record["precision"].startswith(f"parameters, gradients and moments {dtype}")
    r = record["results"]
    assert r["tokens_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(32 / r["step_time_median_s"])
    flops = model_flops(get_preset("tiny", hybrid_override_pattern="-E*E"), 32).matmul_flops_per_token
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / 989e12)
    backends = record["backends"]
    assert backends["ran"] in peer.BACKENDS and record["impl"] == f"nemo-automodel/{backends['ran']}"
    assert backends["tried"][-1] == {"backends": backends["ran"], "error": None}
    assert [entry["backends"] for entry in backends["tried"]] == list(peer.BACKENDS)[:len(backends["tried"])]
    assert all(entry["error"] for entry in backends["tried"][:-1])  # each one before it failed, and says how
    if importlib.util.find_spec("transformer_engine") is None:
        assert backends["tried"][0] == {"backends": "te+torch_mm",
                                        "error": "ModuleNotFoundError: No module named 'transformer_engine'"}
        with pytest.raises(SystemExit, match=r"no backend trained a step: te\+torch_mm: ModuleNotFoundError"):
            peer.main([*options, "--backends", "te+torch_mm", "--out", str(tmp_path / "none.json")])
    if not torch.cuda.is_available():  # Automodel's Mamba layers: one line that says where they run
        with pytest.raises(SystemExit, match="mamba_ssm's Triton kernels: run on a GPU"):
            peer.main(["--preset", "tiny", "--out", str(tmp_path / "mamba.json")])
