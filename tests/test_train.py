"""The A2 trainer on CPU: token budget, falling loss, exact resume, the checkpoint chain from the
seeded initialisation, checkpoint errors and files that would run code, Muon, MoE balancing,
sweeps, and FSDP on two gloo processes matching one process."""

import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from onenode.cli import main
from onenode.model import build_model, get_preset
from onenode.parallel.compile_and_checkpoint import apply_activation_checkpointing
from onenode.train.balance import RouterBalancer
from onenode.train.checkpoint import CheckpointError, full_model_state_dict, latest_checkpoint, weights_sha256
from onenode.train.logging import read_metrics
from onenode.train.optim import OptimizerList, is_muon_param
from onenode.train.recipe import RecipeError, load_recipe
from onenode.train.schedule import lr_factor
from onenode.train.step import build_optimizer
from onenode.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"
# 6 steps of 4 x 32 tokens in 2 micro-batches: a couple of seconds.
SMALL = {"train.seq_len": 32, "train.global_batch_size": 4, "train.micro_batch_size": 2,
         "train.token_budget": 768, "checkpoint.every_steps": 0, "eval.every_steps": 0,
         "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the CI machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small(**overrides):
    return load_recipe(TINY, {**SMALL, **overrides})


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The shipped tiny recipe through the CLI, as a student would run it."""
    out = tmp_path_factory.mktemp("tiny")
    torch.set_num_threads(1)
    assert main(["train", str(TINY), "--out", str(out), "--set", "log.progress_bar=false"]) == 0
    return out


def test_tiny_stops_exactly_at_budget_and_loss_falls(tiny_run):
    recipe = load_recipe(TINY)
    manifest = json.loads((tiny_run / "run_manifest.json").read_text())
    assert manifest["tokens_seen"] == recipe.train.token_budget == manifest["data_tokens_served"]
    assert manifest["steps"] == recipe.total_steps
    assert manifest["status"] == "finished" and len(manifest["data_digest"]) == 64
    records = [r for r in read_metrics(tiny_run) if "loss" in r]
    assert records[-1]["tokens"] == recipe.train.token_budget
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert manifest["final_losses"]["val"] < records[0]["loss"]
    # the lr the trainer used follows the schedule (records are logged after their step)
    for r in records:
        scheduled = recipe.optimizer.lr * lr_factor(recipe.schedule, r["step"] - 1, recipe.total_steps)
        assert r["lr"] == pytest.approx(scheduled)
    last = tiny_run / "checkpoints" / f"step_{recipe.total_steps:08d}"
    checkpoint_meta = json.loads((last / "meta.json").read_text())
    assert checkpoint_meta["tokens_seen"] == manifest["tokens_seen"]
    assert checkpoint_meta["data_digest"] == manifest["data_digest"]
    assert len(list((tiny_run / "checkpoints").glob("step_*"))) == recipe.checkpoint.keep_last


def test_the_collector_runs_between_steps_not_inside_them():
    """`TrainingRun.step` pauses Python's cycle collector for the step and sweeps its young
    generations after it, once: a collection inside a step promotes what the step holds alive and
    brings on full collections of the whole process (`assembly.collecting_after`); under CUDA
    graphs the automatic collector stays."""
    import dataclasses
    import gc

    from onenode.train.assembly import assemble

    run = assemble(_small())
    ids = torch.randint(0, run.config.vocab_size, (4, 32))
    run.step(ids, ids)
    collections = []

    def record(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.set_threshold(10)  # a collection every 10 objects, were the collector on: many inside a step
    gc.callbacks.append(record)
    try:
        for _ in range(2):
            run.step(ids, ids)
        assert collections == [1, 1] and gc.isenabled()
        # as the recipe's step would take it under CUDA graphs (which need a GPU): the automatic collector stays
        run.recipe = dataclasses.replace(run.recipe, train=dataclasses.replace(run.recipe.train, cuda_graphs=True))
        collections.clear()
        run.step(ids, ids)
        assert 0 in collections
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*thresholds)


def test_final_export_loads_back(tiny_run):
    import onenode

    model = onenode.load_pretrained(tiny_run / "final")
    assert json.loads((tiny_run / "final" / "run_manifest.json").read_text())["status"] == "finished"
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    assert torch.isfinite(model(ids).logits).all()


def test_budget_is_never_exceeded(tmp_path):
    recipe = _small(**{"train.token_budget": 700})  # 5.47 steps of 128 tokens
    manifest = Trainer(recipe, tmp_path, resume=None).fit()
    assert manifest["steps"] == 5 and manifest["tokens_seen"] == 640 <= 700


def test_stop_and_resume_matches_uninterrupted_run(tmp_path):
    recipe = _small()
    straight = Trainer(recipe, tmp_path / "a", resume=None)
    straight.fit()
    first = Trainer(recipe, tmp_path / "b", resume=None)
    assert first.fit(stop_after_steps=3)["status"] == "stopped"
    assert Trainer(recipe, tmp_path / "elsewhere", resume=str(tmp_path / "b")).step == 3  # a run folder
    resumed = Trainer(recipe, tmp_path / "b", resume="auto")
    assert resumed.step == 3
    manifest = resumed.fit()
    assert resumed.losses == straight.losses  # bitwise on CPU
    assert manifest["data_digest"] == json.loads((tmp_path / "a" / "run_manifest.json").read_text())["data_digest"]
    for a, b in zip(straight.parallel.model.state_dict().values(), resumed.parallel.model.state_dict().values()):
        assert torch.equal(a, b)
    assert [r["step"] for r in read_metrics(tmp_path / "b") if "loss" in r] == list(range(1, 7))


def test_checkpoints_chain_from_the_seeded_initialisation_to_the_export(tmp_path):
    import onenode

    recipe = _small(**{"checkpoint.every_steps": 2, "checkpoint.keep_last": 0})
    Trainer(recipe, tmp_path, resume=None).fit(stop_after_steps=4)
    Trainer(recipe, tmp_path, resume="auto").fit()  # a resumed run continues the chain
    metas = [json.loads(p.read_text()) for p in sorted((tmp_path / "checkpoints").glob("step_*/meta.json"))]
    assert [m["step"] for m in metas] == [0, 2, 4, 6]
    init = build_model(recipe.model_config(), seed=recipe.seed)
    assert metas[0]["weights_sha256"] == weights_sha256(full_model_state_dict(init)) and metas[0]["previous"] is None
    for before, meta in zip(metas, metas[1:]):
        assert meta["previous"] == {"step": before["step"], "weights_sha256": before["weights_sha256"]}
        assert meta["training_sha256"] == recipe.training_sha256 and meta["seed"] == recipe.seed
        assert meta["layout"] == {"world_size": 1, "dp": 1, "ep": 1, "pp": 1, "micro_batch_size": 2,
                                  "accumulation": 2, "device": "cpu", "threads": 1}
        assert meta["loader"]["batches"] == meta["step"] * 2 and meta["versions"]["torch"] == torch.__version__
    exported = onenode.load_pretrained(tmp_path / "final")
    assert weights_sha256(full_model_state_dict(exported)) == metas[-1]["weights_sha256"]
    other = recipe.with_overrides({"log.every_steps": 3, "data.path": "elsewhere", "checkpoint.every_steps": 1})
    assert other.training_sha256 == recipe.training_sha256  # where data lives and what is logged do not count
    assert recipe.with_overrides({"optimizer.lr": 1e-3}).training_sha256 != recipe.training_sha256


def test_a_deterministic_recipe_trains_on_deterministic_kernels(tmp_path, monkeypatch):
    """`train.deterministic: true` switches the process to kernels that give the same bits on
    every run (the GPU replay of A2 needs it), and a run with it trains as usual on a CPU."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    try:
        trainer = Trainer(_small(**{"train.deterministic": True}), tmp_path, resume=None)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        losses = [trainer.train_step()["loss"] for _ in range(3)]
        assert losses[-1] < losses[0]
    finally:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cuda.enable_cudnn_sdp(before[1])
    assert _small().training_sha256 != _small(**{"train.deterministic": True}).training_sha256  # it decides the bits


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="inductor's Triton reductions are a GPU's"))])
def test_the_tiled_reduction_rule_is_taken_by_compiled_deterministic_runs_on_a_gpu(device, monkeypatch):
    """`assemble` installs the kit's rule for inductor's tiled reductions only where it applies: a
    compiled run under deterministic kernels on a GPU (no other run pays its in-process compile)."""
    from onenode.train import assembly

    installs = []
    monkeypatch.setattr(assembly, "tile_deterministic_reductions", lambda: installs.append(device) or True)
    monkeypatch.setattr(assembly, "use_deterministic_kernels", lambda: None)  # the process's kernels stay as they are
    for deterministic, compiled in ((True, True), (True, False), (False, True)):
        assembly.assemble(_small(**{"train.deterministic": deterministic, "train.compile": compiled}), device=device)
    assert installs == (["cuda"] if device == "cuda" else [])


def test_a_checkpoint_that_would_run_code_does_not_load(tmp_path):
    """The trainer state and DCP's metadata are pickles: loading them runs no code from the file."""
    import pickle

    recipe = _small(**{"train.token_budget": 256})
    Trainer(recipe, tmp_path, resume=None).fit()
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    for name in ("trainer_state_rank0.pt", ".metadata"):
        original = (checkpoint / name).read_bytes()
        (checkpoint / name).write_bytes(pickle.dumps(Payload()))
        with pytest.raises(CheckpointError, match="is corrupt"):
            Trainer(recipe, tmp_path, resume=str(checkpoint))
        assert not marker.exists(), f"loading {name} ran code from it"
        (checkpoint / name).write_bytes(original)
    assert Trainer(recipe, tmp_path, resume=str(checkpoint)).step == 2


def test_corrupt_or_incomplete_checkpoint_is_one_line(tmp_path):
    recipe = _small(**{"train.token_budget": 256})
    Trainer(recipe, tmp_path, resume=None).fit()
    checkpoint = tmp_path / "checkpoints" / "step_00000002"
    data_file = next(checkpoint.glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="is corrupt") as info:
        Trainer(recipe, tmp_path, resume=str(checkpoint))
    assert "\n" not in str(info.value)
    (checkpoint / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        Trainer(recipe, tmp_path, resume=str(checkpoint))
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer(recipe, tmp_path, resume=str(tmp_path / "nowhere"))


def test_muon_takes_hidden_matrices_only():
    model = build_model(get_preset("tiny"))
    optimizer = build_optimizer(model, "muon", lr=1e-3)
    assert isinstance(optimizer, OptimizerList)
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert all(model.get_parameter(n).ndim == 2 for n in on_muon)
    assert any("experts.0.up_proj" in n for n in on_muon) and any("in_proj" in n for n in on_muon)
    for n, p in model.named_parameters():
        assert (n in on_muon) == is_muon_param(n, p)
        if any(key in n for key in ("embeddings", "lm_head", "gate.weight", "norm", "conv1d")):
            assert n not in on_muon


@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw", "original"])
def test_muon_takes_torch_muons_steps(adjust_lr_fn):
    """On unsharded matrices (wide, tall, with weight decay and Nesterov) the kit's Muon is torch's, bit for bit."""
    from onenode.train.optim import Muon

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(6, 10, generator=gen), torch.randn(12, 5, generator=gen)]
    grads = [[torch.randn(t.shape, generator=gen) for t in start] for _ in range(3)]
    params = {kind: [torch.nn.Parameter(t.clone()) for t in start] for kind in ("kit", "torch")}
    options = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": adjust_lr_fn}
    optimizers = {"kit": Muon(params["kit"], **options), "torch": torch.optim.Muon(params["torch"], **options)}
    for step_grads in grads:
        for kind, optimizer in optimizers.items():
            for param, grad in zip(params[kind], step_grads):
                param.grad = grad.clone()
            optimizer.step()
    for ours, theirs, first in zip(params["kit"], params["torch"], start):
        assert not torch.equal(ours, first)
        assert torch.equal(ours, theirs)


def test_muon_with_aux_loss_trains(tmp_path):
    recipe = _small(**{"optimizer.name": "muon", "moe.aux_loss_coef": 0.01, "train.token_budget": 1280,
                       "optimizer.lr": 1.0e-2})
    trainer = Trainer(recipe, tmp_path, resume=None)
    trainer.fit()
    assert sum(trainer.losses[-3:]) < sum(trainer.losses[:3]) - 0.1
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert all(r["aux_loss"] > 0 and r["load_cv"] >= 0 for r in records)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_router_loads_counted_once_and_bias_moves_toward_balance(checkpointing):
    config = get_preset("tiny", hybrid_override_pattern="ME")
    model = build_model(config)
    if checkpointing:
        apply_activation_checkpointing(model)
    balancer = RouterBalancer(model)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model(ids).logits.sum().backward()
    metrics = balancer.finish_step(rate=0.1)
    loads = balancer.last_loads
    assert loads.shape == (1, config.n_routed_experts)
    assert loads.sum().item() == ids.numel() * config.num_experts_per_tok  # recompute not counted
    bias = dict(balancer.routers)[next(iter(balancer.routers))].e_score_correction_bias
    assert torch.equal(bias, 0.1 * torch.sign(loads.mean() - loads[0]))  # busy experts down, idle up
    assert metrics["load_cv"] == pytest.approx(float(loads.std(unbiased=False) / loads.mean()))


def test_sweep_writes_table_and_reuses_finished_runs(tmp_path):
    pytest.importorskip("matplotlib")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"""
name: mini
base: {TINY}
axes:
  optimizer: {{adamw: {{optimizer.name: adamw}}, muon: {{optimizer.name: muon}}}}
""")
    args = ["sweep", str(sweep), "--out", str(tmp_path / "out")]
    for key, value in {**SMALL, "train.token_budget": 256, "checkpoint.export_hf": False}.items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    assert main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["run"] for r in results["runs"]] == ["adamw", "muon"]
    assert results["runs"][0]["final_train_loss"] != results["runs"][1]["final_train_loss"]
    assert (tmp_path / "out" / "loss_curves.png").stat().st_size > 0
    assert "| run | optimizer |" in (tmp_path / "out" / "summary.md").read_text()
    stamp = (tmp_path / "out" / "adamw" / "run_manifest.json").stat().st_mtime_ns
    assert main(args) == 0  # finished points are reused, not retrained
    assert (tmp_path / "out" / "adamw" / "run_manifest.json").stat().st_mtime_ns == stamp


def _fsdp_run(out: str, optimizer: str, interrupt_at: int | None = None, micro: int = 2) -> tuple[list[float], dict]:
    # float32 Newton-Schulz: in bfloat16 a one-ulp difference between the layouts' summed gradients
    # can flip a routing decision, and the runs part by more than float32 rounding
    recipe = _small(**{"optimizer.name": optimizer, "train.micro_batch_size": micro,
                       "optimizer.muon.ns_precision": "float32"})
    if interrupt_at:
        Trainer(recipe, out, resume=None).fit(stop_after_steps=interrupt_at)
    trainer = Trainer(recipe, out, resume="auto" if interrupt_at else None)
    manifest = trainer.fit()
    return trainer.losses, manifest


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_two_processes_match_one(tmp_path, optimizer):
    """Two FSDP ranks (2 micro-batches of 1 each per step), interrupted and resumed from their
    sharded checkpoint half way, train like one uninterrupted process (2 micro-batches of 2), to
    float32 rounding: Muon orthogonalises each sharded matrix whole, as one process does (torch's
    own Muon, orthogonalising through DTensor matmuls, parted by 2.8e-4 here)."""
    from dist_utils import run_distributed

    single, _ = _fsdp_run(str(tmp_path / "one"), optimizer)
    ranks = run_distributed(_fsdp_run, world_size=2, args=(str(tmp_path / "two"), optimizer, 3, 1))
    (losses, manifest), (losses_1, _) = ranks
    assert losses == losses_1
    assert losses == pytest.approx(single, rel=1e-5)
    assert manifest["tokens_seen"] == manifest["data_tokens_served"] == _small().train.token_budget


def test_every_field_of_the_log_line_is_explained_in_help():
    """Each field of the line `onenode train` prints for a logged step (a record with every field)
    is one `onenode train --help` explains, in the order printed, and the help explains no other."""
    from onenode.cli import build_parser
    from onenode.train.logging import LOG_FIELDS

    record = {"step": 3, "tokens": 96, "loss": 5.0, "val_loss": 5.1, "lr": 1e-3, "grad_norm": 1.2,
              "tokens_per_s": 40.0, "mfu": 0.1, "load_cv": 0.2}
    printed = [field.split()[0] for field in Trainer._log_line(record, 10, 1.0).split(" | ")]
    assert printed == list(LOG_FIELDS), f"the line prints {printed}, the help explains {list(LOG_FIELDS)}"
    parser = build_parser("train")._subparsers._group_actions[0].choices["train"]
    help_text = " ".join(parser.format_help().split())
    for name, (_, meaning) in LOG_FIELDS.items():
        assert f"{name} {' '.join(meaning.split()[:6])}" in help_text, f"`onenode train --help` lacks {name!r}"


def test_a_resumed_run_takes_the_tiles_its_kernels_chose(tmp_path, monkeypatch):
    """mamba_ssm's tuned tiles (a stand-in autotuned kernel here) go into each checkpoint, a record per
    process, and a resumed run takes them again before its first step; a checkpoint recorded for
    another number of processes is refused in one line."""
    from onenode.model import mamba_ssm_scan

    module = types.ModuleType(mamba_ssm_scan.KERNEL_PACKAGE + "onenode_test_train")
    module.scan = SimpleNamespace(configs=["BLOCK_SIZE_M: 32", "BLOCK_SIZE_M: 64"], cache={})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    recipe = _small()
    first = Trainer(recipe, tmp_path, resume=None)
    module.scan.cache[(64, "torch.bfloat16")] = module.scan.configs[1]  # as if it had tuned
    assert first.fit(stop_after_steps=3)["status"] == "stopped"
    meta_file = latest_checkpoint(tmp_path / "checkpoints") / "meta.json"
    meta = json.loads(meta_file.read_text())
    assert meta["kernel_tiles"] == [{"onenode_test_train.scan": [[[64, "torch.bfloat16"], 1, "BLOCK_SIZE_M: 64"]]}]
    module.scan.cache.clear()
    assert Trainer(recipe, tmp_path, resume="auto").step == 3
    assert module.scan.cache == {(64, "torch.bfloat16"): "BLOCK_SIZE_M: 64"}
    meta_file.write_text(json.dumps({**meta, "kernel_tiles": meta["kernel_tiles"] * 2}))
    with pytest.raises(RecipeError, match="recorded for 2 processes, this run has 1") as info:
        Trainer(recipe, tmp_path, resume="auto")
    assert "\n" not in str(info.value)
