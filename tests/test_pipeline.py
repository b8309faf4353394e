"""Pipeline parallelism (A1 part 3): stages of the hybrid model train exactly like one process.

Everything runs in a copy of starter_code with the reference part 3 applied (parts 2+3 for
pipeline x expert parallelism), through `patched_copy.run_in_tree`. One launch of gloo processes
runs several schedules in turn, so the process start-up is paid once per layout.
"""

from __future__ import annotations

import itertools

import pytest
from dist_utils import assert_same_training, run_distributed
from patched_copy import patched_tree, run_in_tree
from test_expert_parallel import _global_grads  # full gradients under the one-process names

STEPS = 3
BATCH, SEQ = 4, 16
LR = 0.5  # plain SGD: the loss moves visibly in 3 steps, and tiny gradient noise stays tiny

# (schedule, pattern, layers per stage or None for the cost balance). The custom layouts put the
# stage boundaries where the hybrid model is awkward: stages of Mamba layers only, stages that
# end in a MoE layer (its output is what crosses to the next rank), attention at a stage start.
PP2_CASES = [
    ("gpipe", "MEM*EM-E", None),
    ("1f1b", "MMEM*E-E", [2, 6]),  # stage 0: only Mamba
    ("interleaved_1f1b", "MEMM*E-E", [2, 2, 2, 2]),  # ME | MM | *E | -E on ranks 0, 1, 0, 1
]
PP4_CASES = [
    ("gpipe", "MEM*EM-E", None),
    ("1f1b", "MEM*EM-E", [2, 2, 2, 2]),  # ME | M* | EM | -E
    ("interleaved_1f1b", "MEMM*EME", [1] * 8),  # one layer per virtual stage
]


# -- helpers that run inside the patched tree -------------------------------------------------
def _batches(vocab: int) -> list:
    import torch

    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _train(model, rows: slice, vocab: int) -> dict:
    """STEPS SGD steps through the kit's train_step (global grad-norm clipping included)."""
    import torch

    from onenode.train.step import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for tokens in _batches(vocab):
        shard = tokens[rows]
        out = train_step(model, optimizer, shard[:, :-1], shard[:, 1:], grad_clip=1.0)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    return {"losses": losses, "grad_norms": norms, "grads": _global_grads(model)}


def reference_run(pattern: str | None = None) -> dict:
    """The single-process run every layout must reproduce (the tiny preset, or another pattern)."""
    from onenode.model import build_model, get_preset

    config = get_preset("tiny", **({"hybrid_override_pattern": pattern} if pattern else {}))
    return _train(build_model(config, seed=0), slice(None), config.vocab_size)


def pipeline_worker(cases: list) -> list[dict]:
    """Each (schedule, pattern, stage_layers) case on this rank: its stages' layers and training."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from onenode.model import build_model, cross_entropy_loss, get_preset
    from onenode.parallel import ParallelModel
    from onenode.parallel.pipeline import build_pipeline

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    results = []
    for schedule, pattern, stage_layers in cases:
        config = get_preset("tiny", hybrid_override_pattern=pattern)
        runner = build_pipeline(
            build_model(config, seed=0), mesh["pp"], schedule=schedule, microbatches=BATCH, device="cpu",
            loss_fn=cross_entropy_loss, stage_layers=stage_layers, seq_len=SEQ,
        )
        result = _train(ParallelModel(pipeline=runner, pp_mesh=mesh["pp"]), slice(None), config.vocab_size)
        result["layers"] = [[int(i) for i in module.backbone.layers] for module in runner.stage_modules]
        results.append(result)
    return results


def run_pipeline_cases(pp: int, cases: list) -> dict:
    patterns = sorted({pattern for _, pattern, _ in cases})
    return {"references": {p: reference_run(p) for p in patterns},
            "ranks": run_distributed(pipeline_worker, pp, args=(cases,))}


def parallelize_worker(dp: int, ep: int, pp: int) -> dict:
    """The tiny model through `parallelize` (pp x dp, ep borrowed from dp), this rank's rows."""
    import torch.distributed as dist

    from onenode.model import build_model, get_preset
    from onenode.parallel import ParallelDims, parallelize

    config = get_preset("tiny")
    model = parallelize(build_model(config, seed=0), ParallelDims(dp=dp, ep=ep, pp=pp))
    dp_rank = dist.get_rank() % dp  # rank = pp_index * dp + dp_index (parallel/mesh.py)
    rows = BATCH // dp
    return _train(model, slice(dp_rank * rows, (dp_rank + 1) * rows), config.vocab_size)


def run_parallelized(dp: int, ep: int, pp: int) -> dict:
    return {"reference": reference_run(), "ranks": run_distributed(parallelize_worker, dp * pp, args=(dp, ep, pp))}


def split_report(pattern: str, stage_layers: list[int]) -> dict:
    """Split the tiny model by hand; check names, values and forward against the full model."""
    import torch

    from onenode.model import build_model, get_preset
    from onenode.parallel.pipeline import split_stage

    config = get_preset("tiny", hybrid_override_pattern=pattern)
    model = build_model(config, seed=0)
    full = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    bounds = list(itertools.accumulate(stage_layers, initial=0))
    stages = [split_stage(model, range(bounds[s], bounds[s + 1]), first=s == 0, last=s == len(stage_layers) - 1)
              for s in range(len(stage_layers))]
    owned = [{**dict(stage.named_parameters()), **dict(stage.named_buffers())} for stage in stages]
    for names in owned:
        for name, tensor in names.items():
            assert torch.equal(tensor, full[name]), f"{name} differs from the full model's"
            assert tensor.data_ptr() != full[name].data_ptr(), f"{name} shares storage with the full model"
    tokens = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    x = tokens
    with torch.no_grad():
        for stage in stages:
            x = stage(x)
        expected = model(tokens).logits
    return {
        "names": [sorted(names) for names in owned],
        "full_names": sorted(full),
        "model_layers": len(model.backbone.layers),
        "max_logit_error": float((x - expected).abs().max()),
    }


def balance_report(pattern: str, seq_len: int) -> dict:
    """Layer costs of `pattern` in a1-1gpu's sizes and the balanced split into 2 and 4 stages."""
    from onenode.model import get_preset
    from onenode.parallel.pipeline import balance_stages, layer_costs

    costs, head = layer_costs(get_preset("a1-1gpu", hybrid_override_pattern=pattern), seq_len)
    ranges = {n: balance_stages(costs, n, last_stage_extra=head) for n in (2, 4)}
    return {"costs": costs, "head": head, "ranges": {n: [[r.start, r.stop] for r in rs] for n, rs in ranges.items()}}


SPLIT_PATTERN, SPLIT_STAGES = "MEM*EM-E", [1, 3, 2, 2]
SKEWED_PATTERN = "EEEEEE" + "M" * 12 + "*"  # six heavy MoE layers first, then cheap Mamba layers


def single_process_reports() -> dict:
    """Everything the single-process tests check, from one interpreter (start-up is the cost)."""
    return {"split": split_report(SPLIT_PATTERN, SPLIT_STAGES), "balance": balance_report(SKEWED_PATTERN, 4096),
            "errors": error_messages()}


def error_messages() -> list[str]:
    """The errors of bad pipeline settings, one per attempt ("no error" where none was raised)."""
    from onenode.model import build_model, cross_entropy_loss, get_preset
    from onenode.parallel.pipeline import build_pipeline

    class TwoRankMesh:  # build_pipeline validates before it touches a process group
        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    model = build_model(get_preset("tiny"), seed=0)
    tied = build_model(get_preset("tiny", tie_word_embeddings=True), seed=0)
    attempts = [(model, dict(schedule="zero_bubble")), (model, dict(schedule="1f1b", stages_per_rank=2)),
                (model, dict(stage_layers=[4, 3])), (model, dict(stage_layers=[9, -1])), (tied, {})]
    messages = []
    for target, options in attempts:
        try:
            build_pipeline(target, TwoRankMesh(), microbatches=2, device="cpu", loss_fn=cross_entropy_loss, **options)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


# -- assertions -------------------------------------------------------------------------------
def _merge_ranks(ranks: list[dict]) -> dict:
    """One result from the ranks of a pipeline: the loss from the last stage, grads from all."""
    last = [r for r in ranks if r["losses"][0] is not None]
    merged = {"losses": last[0]["losses"], "grad_norms": ranks[0]["grad_norms"], "grads": {}}
    for r in ranks:
        merged["grads"].update(r["grads"])
    return merged


def _check_cases(result: dict, pp: int, cases: list) -> None:
    for i, (schedule, pattern, stage_layers) in enumerate(cases):
        what = f"pp={pp} {schedule} on {pattern!r}"
        reference = result["references"][pattern]
        ranks = [rank_results[i] for rank_results in result["ranks"]]
        merged = _merge_ranks(ranks)
        assert set(merged["grads"]) == set(reference["grads"]), f"{what}: the stages do not hold every parameter"
        assert_same_training(reference, merged, what)
        norms = {tuple(r["grad_norms"]) for r in ranks}
        assert len(norms) == 1, f"{what}: ranks disagree on the global gradient norm"
        held = sorted(i for r in ranks for layers in r["layers"] for i in layers)
        assert held == list(range(len(pattern))), f"{what}: layers held {held}"
        if stage_layers is not None:
            stages = sorted((layers for r in ranks for layers in r["layers"]), key=lambda ls: ls[0])
            assert [len(s) for s in stages] == stage_layers, f"{what}: stages {stages}"


# -- tests ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tree():
    return patched_tree(["3-pp"])


@pytest.fixture(scope="module")
def reports(tree):
    return run_in_tree(tree, "test_pipeline:single_process_reports")


def test_split_stages_own_exactly_their_tensors_and_compose_to_the_model(reports):
    report = reports["split"]
    names = report["names"]
    assert sorted(n for ns in names for n in ns) == report["full_names"], "stages must partition the tensors"
    assert any(n.endswith("gate.e_score_correction_bias") for n in names[1]), "router buffer missing"
    assert "backbone.embeddings.weight" in names[0] and "lm_head.weight" in names[-1]
    assert all(n.split(".")[2] in {"4", "5"} for n in names[2]), "stage 2 holds layers 4, 5 under their names"
    assert report["model_layers"] == len(SPLIT_PATTERN), "splitting must leave the full model untouched"
    assert report["max_logit_error"] == 0.0, "stage by stage must compute exactly what the model computes"


@pytest.mark.parametrize("num_stages", [2, 4])
def test_cost_balance_beats_layer_count_on_a_skewed_pattern(reports, num_stages):
    costs, head, ranges = reports["balance"]["costs"], reports["balance"]["head"], reports["balance"]["ranges"]
    ranges, n = ranges[str(num_stages)], len(SKEWED_PATTERN)

    def max_stage_cost(bounds):
        return max(sum(costs[a:b]) + (head if b == n else 0.0) for a, b in zip(bounds, bounds[1:]))

    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:])), f"not contiguous: {ranges}"
    balanced = max_stage_cost([r[0] for r in ranges] + [n])
    per_stage, extra = divmod(n, num_stages)
    by_count = max_stage_cost(list(itertools.accumulate([per_stage + (s < extra) for s in range(num_stages)],
                                                        initial=0)))
    assert balanced < 0.9 * by_count, f"{num_stages} stages: {balanced:.3g} FLOPs, no better than by count"
    optimum = min(max_stage_cost([0, *cuts, n]) for cuts in itertools.combinations(range(1, n), num_stages - 1))
    assert balanced == pytest.approx(optimum), f"{num_stages} stages: not the best contiguous split"


def test_bad_pipeline_settings_fail_with_one_clear_line(reports):
    expected = ["unknown pipeline schedule", "one stage per rank", "must give 2 positive layer counts",
                "must give 2 positive layer counts", "tied embeddings"]
    assert len(reports["errors"]) == len(expected), reports["errors"]
    for message, needle in zip(reports["errors"], expected):
        assert needle in message and "\n" not in message, message


@pytest.mark.dist
@pytest.mark.slow
def test_pp2_schedules_train_like_one_process(tree):
    result = run_in_tree(tree, "test_pipeline:run_pipeline_cases", pp=2, cases=PP2_CASES)
    _check_cases(result, 2, PP2_CASES)


@pytest.mark.dist
@pytest.mark.slow
def test_pp4_schedules_train_like_one_process(tree):
    result = run_in_tree(tree, "test_pipeline:run_pipeline_cases", pp=4, cases=PP4_CASES)
    _check_cases(result, 4, PP4_CASES)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("parts,dp,ep", [(["3-pp"], 2, 1), (["2-ep", "3-pp"], 2, 2)], ids=["pp2xfsdp2", "pp2xep2"])
def test_pipeline_composes_with_fsdp_and_expert_parallel(parts, dp, ep):
    result = run_in_tree(patched_tree(parts), "test_pipeline:run_parallelized", dp=dp, ep=ep, pp=2)
    reference, ranks = result["reference"], result["ranks"]
    merged = _merge_ranks(ranks)
    # Each data-parallel replica reports the loss of its own rows: the global loss is their mean.
    last = [r["losses"] for r in ranks if r["losses"][0] is not None]
    merged["losses"] = [sum(step) / len(last) for step in zip(*last)]
    assert set(merged["grads"]) == set(reference["grads"]), "the stages do not hold every parameter"
    assert_same_training(reference, merged, f"pp=2 x dp={dp} (ep={ep})")


@pytest.mark.dist
@pytest.mark.slow
def test_pipeline_benchmark_smoke(tmp_path):
    """benchmarks/pipeline.py --tiny: one GPU (here one CPU process) against pp=2 1F1B, on gloo."""
    import json
    import subprocess
    import sys

    from patched_copy import KIT_ROOT

    proc = subprocess.run([sys.executable, str(KIT_ROOT / "benchmarks" / "pipeline.py"), str(tmp_path), "--tiny",
                           "--schedules", "1f1b", "--microbatches", "4"],
                          cwd=KIT_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + (tmp_path / "log.txt").read_text()[-3000:]
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert set(runs) == {"1gpu", "pp2-1f1b"}
    assert runs["pp2-1f1b"]["bubble_fraction"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1), p=2, m=4
    record = json.loads((tmp_path / "pp2-1f1b.json").read_text())
    assert sorted(i for layers in record["stage_layers_per_rank"] for i in layers) == list(range(8))
    assert record["tokens_per_s"] > 0 and all(loss is not None for loss in record["losses"])
