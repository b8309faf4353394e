"""`onenode bench` on the tiny preset: a valid JSON record, a profiler trace, the transformers peer."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kit_scripts import load_script

from onenode import cli
from onenode.flops import model_flops
from onenode.model import build_model, get_preset
from onenode.profiling import kernel_mix, launches, self_times, time_split, union_us

TINY = ["bench", "--preset", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1", "--quiet"]


def _strict(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _bench(tmp_path, *extra) -> dict:
    out = tmp_path / "record.json"
    assert cli.main([*TINY, "--out", str(out), *extra]) == 0
    return json.loads(out.read_text(), parse_constant=_strict)  # strict JSON: no Infinity or NaN


def test_bench_writes_a_valid_record(tmp_path, capsys):
    record = _bench(tmp_path, "--measure-ceiling")
    assert "tokens/s" in capsys.readouterr().out  # the table
    r = record["results"]
    assert record["record"] == "onenode-bench" and record["preset"] == "tiny"
    assert record["config"]["hidden_size"] == get_preset("tiny").hidden_size
    assert record["layout"] == record["layout"] | {"world_size": 1, "dp": 1, "micro_batch": 1, "seq_len": 32,
                                                   "dtype": "fp32", "compile": "off"}
    assert record["command"].startswith("onenode bench") and "--preset tiny" in record["command"]
    assert record["commit"] and record["env"]["versions"]["torch"]
    assert len(record["steps"]["step_times_s"]) == 2 and len(record["steps"]["losses"]) == 3
    assert len(record["steps"]["warmup_step_times_s"]) == 1 and record["steps"]["warmup_step_times_s"][0] > 0
    # where the time to the first number went: each part once, the parts adding up to the total
    phases = record["steps"]["phases_s"]
    assert set(phases) == {"assemble", "warmup", "measured", "ceiling", "total"}
    assert phases["warmup"] >= record["steps"]["warmup_step_times_s"][0]
    parts = sum(v for k, v in phases.items() if k != "total")
    assert 0 < parts <= phases["total"] < parts + 1
    # Random tokens over 512 ids: the loss at initialisation is close to log(512).
    assert all(abs(loss - math.log(512)) < 0.5 for loss in record["steps"]["losses"])
    assert r["tokens_per_step"] == 32
    assert r["tokens_per_s"] == pytest.approx(32 / r["step_time_median_s"])
    assert r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"]
    flops = model_flops(get_preset("tiny"), 32).matmul_flops_per_token
    assert r["matmul_flops_per_token"] == pytest.approx(flops)
    assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / 989e12)
    assert r["mfu_vs_ceiling"] == pytest.approx(r["mfu"] * 989 / r["ceiling_tflops"])
    assert r["peak_memory_gib"] > 0 and r["memory_kind"] == "cpu_max_rss"
    assert r["step_split"] is None  # one process and no --profile: nothing profiled


def test_profile_writes_a_trace_and_top_kernels(tmp_path, capsys):
    record = _bench(tmp_path, "--profile", str(tmp_path / "prof"), "--profile-steps", "1")
    assert {"profile", "profile_read", "trace"} <= set(record["steps"]["phases_s"])
    trace = json.loads((tmp_path / "prof" / "trace_rank0.json").read_text())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert record["trace"].endswith("trace_rank0.json")
    names = [k["name"] for k in record["top_kernels"]]
    assert "aten::mm" in names
    assert sum(k["share"] for k in record["top_kernels"]) <= 1.0 + 1e-9
    r = record["results"]
    assert r["comm_share"] == 0.0 and 0 < r["compute_share"] <= 1.0 + 1e-9
    # one profiled step: every op's calls, and their self time spread over them
    assert r["kernels_per_step"] >= sum(k["calls"] for k in record["top_kernels"])
    assert 0 < r["mean_kernel_s"] * r["kernels_per_step"] <= r["step_split"]["window_s"]
    mix = record["kernel_mix"]
    assert set(mix) <= {"communication", "compiled", "matmul", "attention", "optimizer", "copy", "other"}
    assert sum(mix.values()) == pytest.approx(1.0) and mix["matmul"] > 0
    out = capsys.readouterr().out
    assert "top kernels" in out and "kernel mix" in out and "matmul" in out
    assert f"{r['kernels_per_step']:,.0f} ops per step" in out


def test_transformers_peer_runs_the_same_weights(tmp_path):
    pytest.importorskip("transformers")
    ours = _bench(tmp_path)
    peer = _bench(tmp_path, "--impl", "transformers", "--steps", "1", "--warmup", "0")
    assert peer["impl"] == "transformers/grouped_mm"
    assert peer["layout"]["module"] == "onenode.bench.peer.TransformersPeer", peer["layout"]  # not the kit's model
    assert ours["layout"]["module"] == "onenode.model.nemotron_h.NemotronHForCausalLM", ours["layout"]
    # Same weights, same batch: the first loss agrees before any update.
    assert peer["steps"]["losses"][0] == pytest.approx(ours["steps"]["losses"][0], rel=1e-4)


def test_activation_checkpointing_keeps_the_losses(tmp_path):
    plain = _bench(tmp_path)
    checkpointed = _bench(tmp_path, "--activation-checkpointing")
    assert checkpointed["layout"]["activation_checkpointing"] is True
    # Recomputing activations changes memory, not the math: same losses over every step.
    assert checkpointed["steps"]["losses"] == pytest.approx(plain["steps"]["losses"], rel=1e-5)


def test_union_of_intervals():
    assert union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert union_us([]) == 0


def test_bad_arguments_say_what_to_do():
    with pytest.raises(SystemExit, match="--steps"):
        cli.main([*TINY, "--steps", "0"])
    with pytest.raises(SystemExit, match="train.cuda_graphs: replays compiled layers: set train.compile"):
        cli.main([*TINY, "--cuda-graphs"])  # no --compile (and, here, no GPU)


def _bench_on_rank(argv: list[str]) -> None:
    cli.main(argv)


def bench_on_two_ranks(argv: list[str], out: str) -> dict:
    """`onenode bench` on 2 gloo ranks; the record rank 0 wrote (also called in patched trees)."""
    from dist_utils import run_distributed

    run_distributed(_bench_on_rank, world_size=2, args=([*argv, "--out", out],))
    return json.loads(Path(out).read_text())


def _check_two_rank_record(record: dict, dp: int, tokens: int) -> None:
    assert record["layout"]["world_size"] == 2 and record["layout"]["dp"] == dp
    assert record["command"].startswith("torchrun --nproc-per-node 2 -m onenode.cli bench")
    r = record["results"]
    assert r["tokens_per_step"] == tokens
    assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)
    assert r["comm_share"] > 0  # collectives (or stage sends and receives) in the profiled window
    assert 0 < r["compute_share"] < 1


@pytest.mark.dist
@pytest.mark.slow
def test_bench_fsdp_and_ep_on_two_gloo_ranks(tmp_path):
    record = bench_on_two_ranks([*TINY, "--dp", "2", "--ep", "2"], str(tmp_path / "record.json"))
    _check_two_rank_record(record, dp=2, tokens=2 * 32)  # two data-parallel ranks, one sequence each


@pytest.mark.dist
@pytest.mark.slow
def test_bench_pipeline_on_two_gloo_ranks(tmp_path):
    """The starter's splitter fails on NemotronH (A1 slow path 3): run the fixed pipeline part."""
    from patched_copy import patched_tree, run_in_tree

    record = run_in_tree(patched_tree(["3-pp"]), "test_bench:bench_on_two_ranks",
                         argv=[*TINY, "--pp", "2", "--micro-batch", "2"], out=str(tmp_path / "record.json"))
    _check_two_rank_record(record, dp=1, tokens=2 * 32)  # two stages share one batch of two sequences


def test_kernel_mix_sorts_gpu_kernels_by_kind():

    times = {"nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": 30,
             "triton_red_fused__to_copy_arange_eq_exp_logsumexp_mul_sub_unsqueeze_0": 20,
             "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": 10,
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": 10,
             "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>": 10,
             "Memcpy DtoD (Device -> Device)": 10,
             "void at::native::vectorized_elementwise_kernel<4, MulFunctor<float>>": 10}
    events = [_RawEvent(name, 0, t * 1000) for name, t in times.items()]  # t microseconds
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    rows = self_times(prof, torch.device("cuda"))
    assert launches(rows, steps=2) == pytest.approx({"kernels_per_step": 3.5, "mean_kernel_s": 100e-6 / 7})
    mix = kernel_mix(rows)
    assert mix == pytest.approx({"matmul": 0.3, "compiled": 0.2, "communication": 0.1, "attention": 0.1,
                                 "optimizer": 0.1, "copy": 0.1, "other": 0.1})
    assert list(mix)[:2] == ["matmul", "compiled"]


def test_out_of_memory_is_one_line_that_says_what_to_change(monkeypatch):
    from onenode.bench import measure

    def too_big(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB. GPU 0 has 139.80 GiB")

    monkeypatch.setattr(measure, "run", too_big)
    with pytest.raises(SystemExit) as stop:
        cli.main([*TINY, "--micro-batch", "4"])
    message = str(stop.value)
    assert "\n" not in message and "4 x 32 tokens per rank" in message and "CUDA out of memory" in message
    assert "--micro-batch" in message and "--activation-checkpointing" in message


def test_step_probes_run_bench_with_one_setting_changed(tmp_path):
    """benchmarks/step_probes.py: the bench's record with the longer kernel list, three probes at once
    (the router's bf16 GEMMs keep the float32 path off a GPU); on a machine without CUDA the
    host-sync probe refuses in one line."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_probes.py"
    out = tmp_path / "probe.json"
    bench_options = ["--preset", "tiny", "--seq-len", "32", "--steps", "1", "--warmup", "0", "--quiet",
                     "--profile", str(tmp_path / "prof"), "--out", str(out)]
    done = subprocess.run([sys.executable, str(script), "router-bf16-gemm", "ssd-carry-recurrence", "loss-chunk",
                           "--logits", "4096", "--", *bench_options],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(json.loads(out.read_text())["top_kernels"]) > 15
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, str(script), "host-syncs", "--", *bench_options],
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2
        assert "host-syncs needs a CUDA GPU: none is visible here" in refused.stderr.splitlines()[-1]
    refused = subprocess.run([sys.executable, str(script), "compile-mode", "--", *bench_options],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "compile-mode needs --mode" in refused.stderr.splitlines()[-1]
    refused = subprocess.run([sys.executable, str(script), "update-chunk", "--chunk", "0", "--", *bench_options],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "update-chunk needs --chunk N, N >= 1" in refused.stderr.splitlines()[-1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="liger-kernel's Triton kernels run on a GPU"))])
def test_liger_loss_probe_is_the_models_loss(monkeypatch, device):
    """step_probes.py's liger-loss: the model's mean loss over the labels that are not -100 through
    liger-kernel's fused linear cross-entropy, the kit's value (and on a GPU its gradients) to
    rounding. On a CPU a stand-in with liger's signature checks the wiring (flattened rows, the
    ignore index, the mean); without liger-kernel the probe refuses in one line."""
    import sys
    import types

    import torch.nn.functional as F

    from onenode.model import nemotron_h

    probes = load_script("benchmarks/step_probes.py")
    monkeypatch.setattr(nemotron_h, "linear_cross_entropy", nemotron_h.linear_cross_entropy)
    if device == "cpu":
        def stand_in(input, weight, target, ignore_index=-100, reduction="mean", **unused):
            assert input.dim() == 2 and target.dim() == 1 and not unused
            return F.cross_entropy(F.linear(input, weight).float(), target, ignore_index=ignore_index,
                                   reduction=reduction)

        liger = types.ModuleType("liger_kernel.transformers.functional")
        liger.liger_fused_linear_cross_entropy = stand_in
        monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", liger)
    else:
        pytest.importorskip("liger_kernel")
    config = get_preset("tiny")
    model = build_model(config, seed=0).to(device)
    ids = torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)).to(device)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    want = model(ids[:, :-1], labels).loss
    want_grad = torch.autograd.grad(want, model.lm_head.weight)[0]
    probes.loss_by_liger()
    got = model(ids[:, :-1], labels).loss
    got_grad = torch.autograd.grad(got, model.lm_head.weight)[0]
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", None)
    with pytest.raises(SystemExit, match="liger-loss needs liger-kernel .*: pip install liger-kernel"):
        probes.loss_by_liger()


def test_reductions_benchmarked_probe_lets_inductor_time_every_config(monkeypatch):
    """step_probes.py's reductions-benchmarked: under deterministic algorithms inductor keeps one
    config of a persistent reduction's candidates (a fixed rule); with the probe it keeps them all,
    to time them. Read from inductor's own heuristics for an H100-like device."""
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.runtime.hints import DeviceProperties, ReductionHint

    monkeypatch.setattr(triton_heuristics, "filter_reduction_configs_for_determinism",
                        triton_heuristics.filter_reduction_configs_for_determinism)
    h100 = DeviceProperties(type="cuda", index=0, multi_processor_count=132, cc=90, major=9,
                            regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            max_threads_per_block=1024, warp_size=32)

    def candidates():
        return triton_heuristics.persistent_reduction(
            {"x": 1 << 20, "r0_": 64}, reduction_hint=ReductionHint.DEFAULT,
            triton_meta={"device": h100, "signature": {}},
            inductor_meta={"are_deterministic_algorithms_enabled": True}, return_configs=True)

    assert len(candidates()) == 1
    load_script("benchmarks/step_probes.py").reductions_benchmarked()
    assert len(candidates()) > 1


def test_fork_workers_probe_keeps_the_rule_and_forks_inductors_workers():
    """step_probes.py's fork-workers: the kit's tiled-reduction rule installed, then inductor's compile
    workers forked (they inherit the rule) and as many as inductor would start, not the rule's one."""
    import torch._inductor.config as inductor_config

    probes = load_script("benchmarks/step_probes.py")
    saved = inductor_config.compile_threads, inductor_config.worker_start_method
    try:  # restored by hand: pytest's monkeypatch deletes an inductor option on undo
        assert probes.forking_workers(lambda: inductor_config.__setattr__("compile_threads", 1) or True)()
        assert inductor_config.worker_start_method == "fork"
        assert inductor_config.compile_threads == inductor_config.decide_compile_threads()
    finally:
        inductor_config.compile_threads, inductor_config.worker_start_method = saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.mm's out_dtype runs on a GPU")
def test_router_bf16_gemm_probe_matches_float32_routing():
    """step_probes.py's router logits from bf16 GEMMs with float32 output: on bf16 values the forward
    is float32's to summation order, the gradients to the bf16 rounding of the logits' gradient."""
    probes = load_script("benchmarks/step_probes.py")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 512, 256, device="cuda", generator=gen).bfloat16().float().requires_grad_()
    w = (torch.randn(64, 256, device="cuda", generator=gen) / 16).bfloat16().float().requires_grad_()
    upstream = torch.randn(4, 512, 64, device="cuda", generator=gen)
    got = probes._Bf16RouterLogits.apply(x, w)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    got_x, got_w = torch.autograd.grad(got, (x, w), upstream)
    want_x, want_w = upstream.double() @ w.double(), upstream.double().flatten(0, 1).t() @ x.double().flatten(0, 1)
    assert (got_x.double() - want_x).abs().max() < 2 ** -7 * want_x.abs().max()
    assert (got_w.double() - want_w).abs().max() < 2 ** -7 * want_w.abs().max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the side stream is a GPU's"))])
def test_update_overlap_probe_is_the_fused_update_cut_per_unit(monkeypatch, request, device):
    """update_overlap.py: each unit's share of the fused update, queued
    at the step and run at that unit's next forward (a CPU) or on a side stream it waits on (a GPU),
    trains the tiny model in bf16 to the fused update's bits, losses, masters and moments, over three
    steps (two micro-batches in the last); every unit has its share queued after a step, the root's
    first."""
    from onenode.model import build_model
    from onenode.parallel import ParallelDims, parallelize
    from onenode.parallel.mixed_precision import CastUnit
    from onenode.train import adamw_kernel, master_update
    from onenode.train.step import build_optimizer, train_step

    overlap = load_script("benchmarks/update_overlap.py")
    if device == "cuda":  # the two runs compared bit for bit: no kernel that adds in a varying order
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        sdp, deterministic = torch.backends.cuda.cudnn_sdp_enabled(), torch.are_deterministic_algorithms_enabled()
        request.addfinalizer(lambda: (torch.backends.cuda.enable_cudnn_sdp(sdp),
                                      torch.use_deterministic_algorithms(deterministic)))
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.use_deterministic_algorithms(True)
    config = get_preset("tiny")
    ids = torch.randint(0, config.vocab_size, (3, 4, 32), generator=torch.Generator().manual_seed(0)).to(device)

    def train():
        parallel = parallelize(build_model(config, seed=0, device=device), ParallelDims(), param_dtype=torch.bfloat16)
        optimizer = build_optimizer(parallel, lr=3e-3)
        losses, queued = [], []
        for step, batch in enumerate(ids):
            losses.append(train_step(parallel, optimizer, batch, batch.roll(-1, 1), 0.5,
                                     accumulation_steps=2 if step == 2 else 1)["loss"])
            if overlap.ACTIVE is not None:
                queued.append(set(overlap.ACTIVE.pending))
        if overlap.ACTIVE is not None:
            overlap.ACTIVE.settle_all()
        return parallel, optimizer, losses, queued

    reference, reference_optimizer, want, _ = train()
    for module, name in [(master_update, "clip_and_update"), (CastUnit, "swap_in"), (adamw_kernel, "TABLES_KEPT"),
                         (overlap, "ACTIVE")]:
        monkeypatch.setattr(module, name, getattr(module, name))
    overlap.install(clone_grads=False)
    parallel, optimizer, got, queued = train()
    units = parallel.master_weights.units
    assert overlap.ACTIVE.order[0] is units[-1] and len(units) == config.num_hidden_layers + 1
    assert queued == [{id(unit) for unit in units}] * 3
    assert got == want
    for (name, master), expected in zip(parallel.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(master, expected), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[master][key], reference_optimizer.state[expected][key]), (name, key)


def test_update_overlap_times_both_updates_in_one_process(tmp_path):
    """benchmarks/update_overlap.py: the fused update as it is and overlapped (each unit's
    update queued), by turns in one process, each round's tokens/s and losses in its record, then
    a profiled step of each (`--trace-steps`); a run
    without the bf16 masters it overlaps (float32) is refused in one line."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "update_overlap.py"
    bench = ["--preset", "tiny", "--seq-len", "32", "--steps", "2", "--warmup", "1"]
    out = tmp_path / "overlap.json"
    done = subprocess.run([sys.executable, str(script), "--rounds", "2", "--trace-steps", "1", "--out", str(out),
                           "--", *bench, "--dtype", "bf16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert [r["overlapped"] for r in record["rounds"]] == [False, True, False, True]
    assert all(r["tokens_per_s"] > 0 and len(r["losses"]) == 2 for r in record["rounds"])
    assert [r["units_queued"] for r in record["rounds"]] == [0, 9, 0, 9]  # tiny: 8 layers and the root
    assert record["overlapped_over_fused"] == record["tokens_per_s"]["overlapped"] / record["tokens_per_s"]["fused"]
    assert set(record["streams"]) == {"fused", "overlapped"}  # profiled after the rounds (a CPU has no kernels)
    refused = subprocess.run([sys.executable, str(script), "--out", str(out), "--", *bench, "--dtype", "fp32"],
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "one process, --dtype bf16" in refused.stderr.splitlines()[-1]


def test_every_row_and_column_of_the_output_is_explained_in_help():
    """Each row `onenode bench` prints (a record with every optional row: a profile, a measured
    ceiling) and each column of its top-kernels table is one `onenode bench --help` explains, and
    the help explains no row the table does not print."""
    from onenode.bench.record import TABLE_ROWS, TOP_KERNEL_COLUMNS, format_table
    from onenode.cli import build_parser
    from onenode.profiling import format_top_kernels

    results = dict.fromkeys(("tokens_per_s", "tokens_per_s_per_gpu", "step_time_median_s", "step_time_min_s",
                             "step_time_max_s", "step_time_stdev_s", "matmul_flops_per_token", "other_flops_per_token",
                             "mfu", "peak_tflops", "achieved_tflops_per_gpu", "ceiling_tflops", "mfu_vs_ceiling",
                             "peak_memory_gib", "compute_share", "comm_share", "exposed_comm_share", "idle_share",
                             "kernels_per_step", "mean_kernel_s"), 1.0)
    record = {"preset": "tiny", "impl": "onenode", "steps": {"measured": 2, "profiled": 1},
              "layout": {"micro_batch": 1, "seq_len": 32, "world_size": 1, "dp": 1, "ep": 1, "pp": 1,
                         "activation_checkpointing": False, "compile": "off", "dtype": "fp32"},
              "results": {**results, "memory_kind": "cpu_max_rss", "step_split": {"window_s": 1.0}},
              "env": {"device_type": "cpu"}, "kernel_mix": {"matmul": 1.0}}
    printed = [line.split("  ")[0] for line in format_table(record).splitlines()]
    assert printed == list(TABLE_ROWS), f"the table prints rows {printed}, the help explains {list(TABLE_ROWS)}"
    columns = [c.strip() for c in format_top_kernels([]).split("  ") if c.strip()]
    assert columns == list(TOP_KERNEL_COLUMNS), f"the top kernels' columns are {columns}"
    help_text = " ".join(build_parser("bench")._subparsers._group_actions[0].choices["bench"].format_help().split())
    for name, meaning in {**TABLE_ROWS, **TOP_KERNEL_COLUMNS}.items():
        assert f"{name} {' '.join(meaning.split()[:6])}" in help_text, f"`onenode bench --help` lacks {name!r}"


def test_the_bench_says_what_its_first_step_compiles_on_a_gpu(monkeypatch):
    """The note a GPU bench prints before a first step that compiles (90 to 145 s cold on one H200):
    what compiles follows the layout (the fused update only in one bf16 process with AdamW), and
    whether that step is measured follows --warmup; nothing on a CPU or when nothing compiles."""
    import dataclasses

    from onenode.bench.measure import compile_note
    from onenode.train.assembly import assemble
    from onenode.train.recipe import load_recipe

    tiny = Path(__file__).resolve().parents[1] / "a2_pretrain" / "recipes" / "tiny.yaml"

    def note(warmup=1, **settings):
        settings = {"train.seq_len": 32, "train.micro_batch_size": 8, **settings}  # one micro-batch a step
        training = assemble(load_recipe(tiny, settings), device="cpu")
        return compile_note(dataclasses.replace(training, device=torch.device("cuda")), warmup), \
            compile_note(training, warmup)

    from onenode.train import adamw_kernel

    # the fused update's Triton kernel compiles in seconds: nothing to say, unless the layers compile
    monkeypatch.setattr(adamw_kernel, "available", lambda: None)
    assert note(**{"train.precision": "bf16"}) == (None, None)
    on_gpu, _ = note(0, **{"train.precision": "bf16", "train.compile": "blocks",
                           "train.fused_update_kernel": "triton"})
    assert "compiles the layers with torch.compile" in on_gpu and "--warmup 0 measures it" in on_gpu
    on_gpu, _ = note(**{"train.precision": "bf16", "train.compile": "blocks"})  # auto: Triton's update there too
    assert "compiles the layers with torch.compile" in on_gpu and "optimizer" not in on_gpu
    on_gpu, _ = note(**{"train.precision": "bf16", "train.compile": "blocks", "train.fused_update_kernel": "inductor"})
    assert "the fused optimizer update and the layers" in on_gpu
    # int8 moments: Triton's kernel of their own, as fast to compile
    assert note(**{"train.precision": "bf16", "optimizer.moments": "int8"}) == (None, None)
    on_gpu, _ = note(**{"train.precision": "bf16", "optimizer.moments": "int8",
                        "train.fused_update_kernel": "inductor"})
    assert "compiles the fused optimizer update with torch.compile" in on_gpu
    # without Triton the update is inductor's: a graph per distinct chunk, a minute or more cold
    monkeypatch.setattr(adamw_kernel, "available", lambda: "triton does not import")
    on_gpu, on_cpu = note(**{"train.precision": "bf16"})
    assert on_cpu is None and "compiles the fused optimizer update with torch.compile" in on_gpu
    assert "warm-up, not measured" in on_gpu
    on_gpu, _ = note(0, **{"train.precision": "bf16", "train.compile": "blocks"})
    assert "the fused optimizer update and the layers" in on_gpu and "--warmup 0 measures it" in on_gpu
    assert note(**{"train.precision": "bf16", "train.fused_update": False})[0] is None
    # two micro-batches: fused too, over the float32 gradients they add up on the masters
    assert "compiles the fused optimizer update" in note(**{"train.precision": "bf16", "train.micro_batch_size": 4})[0]
    assert note(**{"train.precision": "fp32"})[0] is None  # float32: no copies, torch's own AdamW


def test_update_graphs_counts_what_the_fused_update_compiles():
    """benchmarks/update_graphs.py on the tiny preset (meta device): every parameter is in one call,
    a graph never traces more parameters than its chunk holds, and smaller chunks trace fewer."""
    from onenode.model import build_model
    from onenode.train import master_update

    update_graphs = load_script("benchmarks/update_graphs.py")
    params = sum(1 for _ in build_model(get_preset("tiny"), device="meta").parameters())
    large, small = update_graphs.count("tiny", 16), update_graphs.count("tiny", 2)
    assert master_update.CHUNK == 16  # put back
    assert large["calls"] * 16 >= params and small["calls"] * 2 >= params > (small["calls"] - 2) * 2
    assert large["parameters_traced"] <= 16 * large["graphs"] and small["parameters_traced"] <= 2 * small["graphs"]
    assert small["parameters_traced"] < large["parameters_traced"] <= params


class _RawEvent:
    """One of the profiler's raw (kineto) events, as `profiling.device_kernels` reads it."""

    def __init__(self, name, start_ns, end_ns, on_gpu=True, annotation=False):
        from torch.autograd import DeviceType

        self._name, self._span, self._annotation = name, (start_ns, end_ns), annotation
        self._device = DeviceType.CUDA if on_gpu else DeviceType.CPU

    def name(self):
        return self._name

    def start_ns(self):
        return self._span[0]

    def end_ns(self):
        return self._span[1]

    def device_type(self):
        return self._device

    def is_user_annotation(self):
        return self._annotation


def test_loss_curves_hold_each_setting_to_its_references_seed_noise(tmp_path):
    """benchmarks/moments_curves.py: each run against the reference's seed 0, within noise only where
    both its differences (the last validation loss all three evaluated, the last training losses'
    mean) are no larger than the reference's seed 1 against its seed 0; any setting can be the
    reference (`--reference`), float32 moments by default."""
    curves = load_script("benchmarks/moments_curves.py")
    runs = {"sdpa-seed0": 3.00, "sdpa-seed1": 3.05, "flex-seed0": 3.02, "other-seed0": 3.20}
    for name, loss in runs.items():
        folder = tmp_path / f"curve-{name}"
        folder.mkdir()
        rows = [{"step": step, "loss": loss + 1 / step} for step in range(1, 101)]
        rows += [{"step": 50, "val_loss": loss + 0.1}, {"step": 100, "val_loss": loss}]
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    assert curves.main([str(tmp_path), "--reference", "sdpa"]) == 0
    record = json.loads((tmp_path / "record.json").read_text())
    assert set(record["comparison"]) == {"flex-seed0", "other-seed0"} and record["reference"] == "sdpa"
    flex, other = record["comparison"]["flex-seed0"], record["comparison"]["other-seed0"]
    assert flex["val_step"] == 100 and flex["minus_sdpa_seed0"]["val"] == pytest.approx(0.02)
    assert flex["sdpa_seed1_minus_seed0"]["val"] == pytest.approx(0.05)
    assert flex["within_noise"] and not other["within_noise"]
    assert curves.compare(json.loads((tmp_path / "record.json").read_text())["curves"]) == {}  # no float32 runs


def test_loss_curves_are_read_from_the_trainers_output(tmp_path):
    """Where only `onenode train`'s output came back (curve-<setting>-<seed>.log), the curve comes from
    its step lines, the last validation loss from its `finished:` line, and the run's throughput
    from its last line."""
    curves = load_script("benchmarks/moments_curves.py")
    log = tmp_path / "curve-flex-0.log"
    log.write_text("\n".join([
        "step 5/10 | tokens 40,960 | loss 7.5000 | lr 1.0e-04",
        "step 10/10 | tokens 81,920 | loss 7.2500 | val_loss 7.3000 | lr 1.0e-04",
        "finished: 10 steps, 81,920 of 81,920 budgeted tokens, train loss 7.2500, val loss 7.2900 -> /tmp/x",
        "throughput: 117,680 tokens/s (117,680 per rank), MFU 19.1%"]))
    curve = curves.read_log(log)
    assert curve["train"] == [[5, 7.5], [10, 7.25]] and curve["val"] == [[10, 7.3]]
    assert curve["tokens_per_s"] == 117680 and curve["tail_mean"] == pytest.approx(7.375)


def test_a_gpu_profile_is_read_from_its_raw_events():
    """On a GPU the kernels' tally and the busy time come from the profiler's raw events (no CPU op
    tree: minutes for the starter's window): per kernel name its calls and summed durations, largest
    first; CPU ops left out, and annotated ranges (the optimizer's `Optimizer.step#...` spans its
    kernels on the GPU's timeline: counted as a kernel it doubled their time and covered the idle
    gaps between them); overlaps counted once."""
    from types import SimpleNamespace

    from onenode.profiling import self_times

    events = [_RawEvent("gemm", 0, 4000), _RawEvent("gemm", 10000, 12000), _RawEvent("add", 3000, 5000),
              _RawEvent("ncclKernel_AllReduce", 4500, 9000), _RawEvent("aten::mm", 0, 20000, on_gpu=False),
              _RawEvent("Optimizer.step#AdamW.step", 0, 12000, annotation=True)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    cuda = torch.device("cuda")
    assert self_times(prof, cuda) == [("gemm", 2, pytest.approx(6e-6)),
                                      ("ncclKernel_AllReduce", 1, pytest.approx(4.5e-6)),
                                      ("add", 1, pytest.approx(2e-6))]
    split = time_split(prof, cuda)
    assert split == pytest.approx({"busy_s": 11e-6, "compute_s": 7e-6, "comm_s": 4.5e-6, "exposed_comm_s": 4e-6})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's profile")
def test_the_raw_events_tally_the_kernels_as_key_averages_does():
    """On a GPU: the raw events' tally (`self_times`) is torch's `key_averages` for the kernels."""
    from torch.autograd import DeviceType

    from onenode.profiling import profiled, self_times

    device = torch.device("cuda")
    x = torch.randn(512, 512, device=device)
    with profiled(device) as prof:
        for _ in range(3):
            x = (x @ x).relu_() / 512
        torch.cuda.synchronize()
    raw = {name: (calls, seconds) for name, calls, seconds in self_times(prof, device)}
    averaged = {e.key: (e.count, e.self_device_time_total / 1e6) for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.self_device_time_total > 0}
    assert raw.keys() == averaged.keys() and raw
    for name, (calls, seconds) in raw.items():
        assert calls == averaged[name][0] and seconds == pytest.approx(averaged[name][1], rel=1e-3, abs=2e-6), name
