"""`optimizer.state: cpu` (issue 43: optimizer state in CPU memory) and the `group6-7b` preset it is for.

The float32 masters and AdamW's moments live in host memory; each step streams them through the
device a chunk at a time (`train/offload.py`). On a CPU the "device" is the CPU, so the same code
runs here: it must take the non-offloaded fused step's numbers bit for bit, save and resume the same
optimizer state, and verify under A2's replay."""

from __future__ import annotations

from onenode.model import count_parameters, get_preset


def test_group6_preset_is_about_7b_total_and_1b_active():
    """Group 6's shape (issue 43), counted by the kit on the meta-device model: 7B total (within
    10%), 1B active per token (within 20%), 38 layers in the NemotronH hybrid layout, 64 experts top-4."""
    config = get_preset("group6-7b")
    total, active = count_parameters(config)
    assert abs(total - 7e9) <= 0.7e9, total
    assert abs(active - 1e9) <= 0.2e9, active
    assert config.num_hidden_layers == 38 and set(config.layer_kinds) == {"mamba", "moe", "attention"}
    assert (config.n_routed_experts, config.num_experts_per_tok) == (64, 4)
