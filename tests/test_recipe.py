"""A2 recipes: the shipped ones load, and every kind of bad input fails with one line naming the key."""

from pathlib import Path

import pytest

from onenode.train.recipe import RecipeError, load_recipe, parse_override
from onenode.train.sweep import load_sweep

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "a2_pretrain" / "recipes"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_files_validate(path):
    if path.name.startswith("sweep_"):
        name, runs = load_sweep(path)
        assert len(runs) >= 2 and len({r.name for _, _, r in runs}) == len(runs)
    elif path.name.startswith("data_"):  # a data config the proxy recipes build from
        from onenode.data import load_config

        assert load_config(path)["sources"]
    else:
        recipe = load_recipe(path)
        assert recipe.total_steps >= 1
        assert recipe.model_config().num_hidden_layers >= 1


def test_baseline_is_a_one_node_moe():
    from onenode.model import count_parameters

    recipe = load_recipe(RECIPES / "baseline.yaml")
    config = recipe.model_config()
    total, active = count_parameters(config)
    assert "E" in config.hybrid_override_pattern
    assert 0.5e9 < total < 2e9 and active < total / 2
    assert recipe.train.token_budget >= 10e9
    assert (recipe.schedule.name, recipe.optimizer.name) == ("wsd", "adamw")
    # gradable: the whole chain kept, spans short enough for the grader to replay (10% of the run)
    assert recipe.checkpoint.keep_last == 0 and recipe.checkpoint.every_steps <= 0.1 * recipe.total_steps


def test_a_recipe_starts_from_its_base(tmp_path):
    offline = load_recipe(RECIPES / "tiny_offline.yaml")
    tiny = load_recipe(RECIPES / "tiny.yaml")
    assert (offline.data.source, offline.data.path, offline.model.overrides) == ("shards", "data/default",
                                                                                 {"vocab_size": 50304})
    assert offline.train == tiny.train and offline.optimizer == tiny.optimizer and offline.model.preset == "tiny"
    (tmp_path / "orphan.yaml").write_text("base: nowhere.yaml\nname: orphan\n")
    with pytest.raises(RecipeError, match="base .*nowhere.yaml is not a recipe"):
        load_recipe(tmp_path / "orphan.yaml")


# A valid recipe; each case below replaces one section (in YAML the later key wins).
VALID = "model: {preset: tiny}\ntrain: {token_budget: 4096, seq_len: 16, global_batch_size: 4}\n"


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, key", [
    ("optimizer: {lrr: 1}", "optimizer.lrr: unknown key"),
    ("train: {seq_len: long}", "train.seq_len: expected int"),
    ("train: {token_budget: 100, seq_len: 64, global_batch_size: 8}", "train.token_budget"),
    ("schedule: {name: linear}", "schedule.name"),
    ("schedule: {decay_shape: sqrt}", "schedule.decay_shape"),
    ("data: {source: shards}", "data.path"),
    ("model: {preset: tiny, hiden_size: 3}", "model.hiden_size: not a NemotronHConfig field"),
    ("model: {preset: tiny, pattern: MXE}", "model: hybrid_override_pattern"),
    ("model: {preset: huge}", "model: unknown preset 'huge'"),
    ("model: {preset: tiny, mamba_kernel: auto}\ntrain: {token_budget: 4096, seq_len: 16, global_batch_size: 4, "
     "deterministic: true}", "train.deterministic: needs model.mamba_kernel torch or mamba_ssm"),
    ("seeds: 1", "seeds: unknown key"),
    ("train: [1, 2]", "train: must be a mapping"),
    ("train: {token_budget: 1e6, seq_len: 8", "not valid YAML"),
])
def test_bad_recipe_names_the_key(tmp_path, text, key):
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, VALID + text))
    message = str(info.value)
    assert key in message and "\n" not in message


def test_numbers_as_strings_and_custom_pattern(tmp_path):
    recipe = load_recipe(_write(tmp_path, """
model: {pattern: "M*E-", hidden_size: 32, vocab_size: 256, num_attention_heads: 2, num_key_value_heads: 1,
        head_dim: 16, mamba_num_heads: 4, mamba_head_dim: 8, n_groups: 1, ssm_state_size: 8,
        n_routed_experts: 4, num_experts_per_tok: 2}
train: {token_budget: "2e4", seq_len: 16, global_batch_size: 4}
optimizer: {lr: 1e-3}
"""))
    assert recipe.model_config().hybrid_override_pattern == "M*E-"
    assert recipe.train.token_budget == 20000 and recipe.optimizer.lr == 1e-3
    assert recipe.total_steps == 20000 // 64  # floor: never more tokens than the budget


def test_overrides_and_missing_file(tmp_path):
    recipe = load_recipe(RECIPES / "tiny.yaml", dict([parse_override("optimizer.name=muon"),
                                                      parse_override("train.token_budget=4096")]))
    assert recipe.optimizer.name == "muon" and recipe.train.token_budget == 4096
    assert recipe.with_overrides({"schedule.name": "cosine"}).schedule.name == "cosine"
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(tmp_path / "absent.yaml")
    with pytest.raises(RecipeError, match="section.key=value"):
        parse_override("optimizer.name")


def test_the_fused_update_kernel_is_triton_by_default_and_keeps_the_hash():
    """auto: Triton's update whether or not the layers compile (as fast as inductor's, and a minute
    sooner to a first step); a recipe names either, its hash then says which (the two round
    differently), and keeps the hash it had before the option where it names none."""
    tiny = RECIPES / "tiny.yaml"
    assert load_recipe(tiny, {"train.compile": "off"}).train.update_kernel() == "triton"
    assert load_recipe(tiny, {"train.compile": "blocks"}).train.update_kernel() == "triton"
    named = load_recipe(tiny, {"train.compile": "blocks", "train.fused_update_kernel": "inductor"})
    assert named.train.update_kernel() == "inductor"
    default, auto = load_recipe(tiny), load_recipe(tiny, {"train.fused_update_kernel": "auto"})
    assert default.training_sha256 == auto.training_sha256 != named.training_sha256
    with pytest.raises(RecipeError, match="train.fused_update_kernel: is auto, triton or inductor"):
        load_recipe(tiny, {"train.fused_update_kernel": "cuda"})
