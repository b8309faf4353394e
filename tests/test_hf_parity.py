"""The kit's NemotronH computes what transformers' NemotronHForCausalLM computes, and the two
exchange checkpoints in both directions (and in NVIDIA's remote-code layout)."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import onenode  # noqa: E402
from onenode.cli import main as onenode_main  # noqa: E402
from onenode.model import NemotronHForCausalLM, build_model, get_preset  # noqa: E402
from onenode.model.hf_io import adapt_state_dict  # noqa: E402

# transformers clamps dt at time_step_min whatever time_step_limit says; setting the limit to the
# same value makes both compute the same thing (the kit honours time_step_limit, as NVIDIA's code).
CONFIGS = {
    # attention x2, MoE x3, a dense layer, 2 Mamba groups, group-limited routing, T=37 with chunk 16
    "mixed": dict(hybrid_override_pattern="MEM*EM-E*", seq=37),
    # one group everywhere, no GQA, no renormalisation of the top-k weights, T = the chunk
    "plain": dict(hybrid_override_pattern="*M-E", n_groups=1, n_group=1, topk_group=1, num_key_value_heads=4,
                  norm_topk_prob=False, seq=16),
    # 4 routing groups keeping 2, top-3, biased projections, T shorter than a chunk
    "groups": dict(hybrid_override_pattern="EMEM", n_group=4, topk_group=2, num_experts_per_tok=3,
                   mamba_proj_bias=True, mlp_bias=True, n_groups=4, seq=7),
}


def _config(name):
    overrides = dict(CONFIGS[name])
    seq = overrides.pop("seq")
    config = get_preset("tiny", **overrides)
    return config.replace(time_step_limit=(config.time_step_min, float("inf"))), seq


def _hf_model(config):
    hf_config = transformers.NemotronHConfig(**copy.deepcopy(config.to_hf_dict()))
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(hf_config).float()
    with torch.no_grad():  # exercise the bias: it changes the choice, not the weights
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    return model


def _pair(name):
    config, seq = _config(name)
    hf = _hf_model(config)
    ours = build_model(config, seed=1)
    ours.load_state_dict(adapt_state_dict(hf.state_dict(), ours))
    ids = torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(2))
    return config, hf, ours, ids


def _shifted(ids):
    """The kit's labels: already shifted targets, -100 where no next token exists."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_gradients_match_transformers(name):
    config, hf, ours, ids = _pair(name)
    hf_out, our_out = hf(ids, labels=ids, use_cache=False), ours(ids, labels=_shifted(ids), return_logits=True)
    torch.testing.assert_close(our_out.logits, hf_out.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_out.loss, hf_out.loss, rtol=1e-5, atol=1e-6)

    hf_out.loss.backward()
    our_out.loss.backward()
    hf_grads = adapt_state_dict({k: p.grad for k, p in hf.named_parameters()} | dict(hf.named_buffers()), ours)
    for key, param in ours.named_parameters():
        assert param.grad is not None, key
        scale = hf_grads[key].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(param.grad / scale, hf_grads[key] / scale, rtol=0, atol=2e-5, msg=key)


def test_our_checkpoint_loads_in_transformers(tmp_path):
    config, _, ours, ids = _pair("mixed")
    ours.save_pretrained(tmp_path)
    keys = json.loads((tmp_path / "config.json").read_text())
    assert keys["model_type"] == "nemotron_h"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    hf.config._attn_implementation = "sdpa"
    hf.train()  # the torch path as in training; eval only changes dropout, which is off
    assert isinstance(hf, transformers.NemotronHForCausalLM)
    torch.testing.assert_close(hf(ids, use_cache=False).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


def test_transformers_checkpoint_loads_here_sharded(tmp_path):
    _, hf, _, ids = _pair("groups")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = onenode.load_pretrained(tmp_path)
    torch.testing.assert_close(ours(ids).logits, hf(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    buffers = dict(ours.named_buffers())
    assert buffers["backbone.layers.0.mixer.gate.e_score_correction_bias"].abs().sum() > 0
    assert ours.backbone.layers[0].mixer.gate.weight.dtype == torch.float32


def test_nvidia_layout_roundtrip_through_convert(tmp_path, capsys):
    _, hf, _, ids = _pair("mixed")
    hf.save_pretrained(tmp_path / "hf")
    assert onenode_main(["convert", str(tmp_path / "hf"), str(tmp_path / "nv"), "--layout", "nvidia"]) == 0
    from safetensors import safe_open

    with safe_open(tmp_path / "nv" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "backbone.layers.1.mixer.experts.7.down_proj.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    ours = NemotronHForCausalLM.from_pretrained(tmp_path / "nv")
    torch.testing.assert_close(ours(ids).logits, hf(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    # and back to the transformers layout, which transformers reads
    assert onenode_main(["convert", str(tmp_path / "nv"), str(tmp_path / "hf2")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", dtype=torch.float32)
    back.config._attn_implementation = "sdpa"
    torch.testing.assert_close(back(ids, use_cache=False).logits, hf(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    assert "wrote" in capsys.readouterr().out
