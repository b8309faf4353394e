"""`optimizer.moments: bfloat16 | int8` (issue 43: low-bit optimizer state): AdamW's two moments
stored in bfloat16 or as 8-bit codes with a float32 scale per block (`train/master_update.
AdamWCompactMoments`), 4 or about 2 bytes of state a parameter instead of 8. It must be torch's
AdamW with its moments rounded once a step, resume bit for bit from a checkpoint (torch's
`load_state_dict` casts state to the parameters' dtype), train the tiny model like float32 moments
on the fused bf16 path and the unfused float32 path alike, and verify as an A2 run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onenode.parallel.mixed_precision import MasterWeights
from onenode.train import master_update
from onenode.train.master_update import AdamWCompactMoments
from onenode.train.recipe import RecipeError, load_recipe
from onenode.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "a2_pretrain" / "recipes" / "tiny.yaml"


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((16, 8), (8,), (4, 4, 3))]


def _grads(step: int, params) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) * 0.1 for p in params]


OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_bfloat16_moments_are_adamw_with_its_moments_rounded_each_step():
    """Against torch's own AdamW whose moments are rounded to bfloat16 after every step: the same
    parameters to float32 rounding; against plain float32 moments: another trajectory (so the
    rounding is really there), and half the state's bytes."""
    compact_params, rounded_params, full_params = _params(), _params(), _params()
    compact = AdamWCompactMoments(compact_params, **OPTIONS)
    rounded = torch.optim.AdamW(rounded_params, foreach=False, **OPTIONS)
    full = torch.optim.AdamW(full_params, foreach=False, **OPTIONS)
    for step in range(6):
        for params, optimizer in ((compact_params, compact), (rounded_params, rounded), (full_params, full)):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
        for state in rounded.state.values():
            for moment in ("exp_avg", "exp_avg_sq"):
                state[moment].copy_(state[moment].bfloat16())
    for a, b, c in zip(compact_params, rounded_params, full_params):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, c)
    for p, reference in zip(compact_params, rounded_params):
        state = compact.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.allclose(state["exp_avg"].float(), rounded.state[reference]["exp_avg"], rtol=1e-2, atol=0)
    def state_bytes(optimizer):
        return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert state_bytes(compact) * 2 == state_bytes(full)


def test_bfloat16_moments_resume_from_a_state_dict_bit_for_bit():
    """torch's `load_state_dict` casts the moments to float32; the optimizer casts them back as it
    loads, so a resumed run takes the uninterrupted run's steps exactly, in bfloat16 state."""
    straight_params, resumed_params = _params(), _params()
    straight = AdamWCompactMoments(straight_params, **OPTIONS)
    first = AdamWCompactMoments(resumed_params, **OPTIONS)
    for step in range(3):
        for params, optimizer in ((straight_params, straight), (resumed_params, first)):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
    resumed = AdamWCompactMoments(resumed_params, **OPTIONS)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state[resumed_params[0]]["exp_avg"].dtype == torch.bfloat16  # torch's cast undone on load
    for step in range(3, 5):
        for params, optimizer in ((straight_params, straight), (resumed_params, resumed)):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(straight_params, resumed_params))
    assert resumed.state[resumed_params[0]]["exp_avg"].dtype == torch.bfloat16


def test_the_recipe_says_what_bfloat16_moments_need():
    with pytest.raises(RecipeError, match=r"optimizer.moments: is float32, bfloat16 or int8"):
        load_recipe(TINY, {"optimizer.moments": "float16"})
    with pytest.raises(RecipeError, match=r"bfloat16 moments need betas\[1\] <= 0.99 .*use float32"):
        load_recipe(TINY, {"optimizer.moments": "bfloat16", "optimizer.betas": [0.9, 0.999]})
    default, explicit = load_recipe(TINY), load_recipe(TINY, {"optimizer.moments": "float32"})
    compact = load_recipe(TINY, {"optimizer.moments": "bfloat16"})
    assert default.training_sha256 == explicit.training_sha256 != compact.training_sha256


@pytest.mark.slow  # about 20 s each: two short runs of the tiny model
@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"], ids=["fused-update", "unfused"])
def test_compact_moments_train_the_tiny_model_like_float32_moments(tmp_path, precision, moments):
    """bf16 with one micro-batch takes the fused update (`master_update.clip_and_update`); fp32
    takes torch's clip and the optimizer's own step. Either way the state is compact and the
    losses stay within a few hundredths of float32 moments' over 12 steps."""
    settings = {"train.precision": precision, "train.seq_len": 32, "train.global_batch_size": 4,
                "train.micro_batch_size": 4, "train.token_budget": 12 * 4 * 32, "checkpoint.enabled": False,
                "eval.every_steps": 0, "eval.batches": 1, "log.every_steps": 1, "log.progress_bar": False,
                "optimizer.lr": 3e-3}
    runs = {}
    for kind in ("float32", moments):
        trainer = Trainer(load_recipe(TINY, {**settings, "optimizer.moments": kind}), tmp_path / kind, resume=None)
        assert trainer.fit()["status"] == "finished"
        runs[kind] = trainer
    dtype = {"bfloat16": torch.bfloat16, "int8": torch.uint8}[moments]
    states = [(p, s) for p, s in runs[moments].optimizer.state.items()]
    assert states and all(s["exp_avg"].dtype == (dtype if p.ndim > 1 or dtype != torch.uint8 else torch.float32)
                          for p, s in states)
    full, compact = runs["float32"].losses, runs[moments].losses
    assert len(full) == len(compact) == 12 and compact[-1] < compact[0] - 0.1
    assert max(abs(a - b) for a, b in zip(full, compact)) < 0.05
    assert full != compact  # the option changed the run


def test_the_optimizer_state_bound_allows_bfloat16_rounding_only_where_the_recipe_stores_it():
    """A2's optimizer-state check (`verify/replay_harness.optimizer_state_problem`): |exp_avg| <=
    ratio x sqrt(exp_avg_sq) holds exactly for float32 moments; bfloat16 moments round each once a
    step, which may put one 0.4% over (seen on the tiny model's embeddings). That slack is allowed
    only for a recipe with `optimizer.moments: bfloat16`, and nothing near a forgery's excess."""
    from onenode.verify.replay_harness import adam_moment_ratio, optimizer_state_problem

    group = {"params": ["w"], "betas": (0.9, 0.95), "lr": 0.1, "eps": 1e-8}
    zeros = torch.zeros(4, dtype=torch.float64)
    fresh = {"param_groups": [group], "state": {"w": {"step": torch.tensor(1.0), "exp_avg": zeros,
                                                      "exp_avg_sq": zeros}}}
    v = torch.full((4,), 2.59e-6, dtype=torch.float64)

    def stored(excess: float) -> dict:
        m = excess * adam_moment_ratio(0.9, 0.95, 2) * v.sqrt()
        return {"param_groups": [dict(group)], "state": {"w": {"step": torch.tensor(3.0), "exp_avg": m,
                                                               "exp_avg_sq": v}}}

    assert optimizer_state_problem(stored(0.999), fresh, 2, 0.0) is None
    assert "steps of any gradients give" in optimizer_state_problem(stored(1.004), fresh, 2, 0.0)
    assert optimizer_state_problem(stored(1.004), fresh, 2, 0.0, "bfloat16") is None
    assert "steps of any gradients give" in optimizer_state_problem(stored(1.05), fresh, 2, 0.0, "bfloat16")


@pytest.mark.slow  # about 40 s each: 20 steps of the tiny model, then the spans the profile draws replayed
@pytest.mark.parametrize("moments, state", [("int8", "device"), ("bfloat16", "cpu")])
def test_a_run_with_compact_moments_verifies(tmp_path, capsys, moments, state):
    """`onenode verify` on a tiny run with int8 or bfloat16 moments: the replay loads each
    checkpoint's state (cast to float32 by torch, back to its dtypes by the optimizer) and takes
    the same rounded steps, weights and optimizer state bit for bit. The bfloat16 run keeps its state
    in host memory (`optimizer.state: cpu`, one process in bf16, one micro-batch a step:
    `train/offload.py`), and its replay streams it through the device the same way."""
    from onenode import cli

    run = tmp_path / "run"
    settings = [f"optimizer.moments={moments}", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                "train.token_budget=10240", "log.progress_bar=false"]
    if state == "cpu":
        settings += ["optimizer.state=cpu", "train.precision=bf16", "train.micro_batch_size=0"]
    assert cli.main(["train", str(TINY), "--out", str(run), *[a for s in settings for a in ("--set", s)]]) == 0
    capsys.readouterr()
    assert cli.main(["verify", str(run), "--profile", "cpu-tiny"]) == 0
    assert "replayed bit for bit" in capsys.readouterr().out


INT8 = {**OPTIONS, "moments_dtype": torch.uint8}


def _step(params, optimizer, step: int) -> None:
    for p, g in zip(params, _grads(step, params)):
        p.grad = g
    optimizer.step()


def test_int8_codes_round_the_first_moment_toward_zero_and_the_second_up():
    """Each value becomes a code of its block's scale (the block's largest magnitude, kept exactly)
    no larger in magnitude than it (exp_avg) or no smaller (exp_avg_sq), within one code of it:
    a few percent for values near their block's largest, 256 values a block along each row."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(3, 600, generator=gen) * torch.logspace(-3, 0, 600)
    v = m.square() * 1.5
    books = master_update.int8_codebooks(torch.device("cpu"))
    decoded = []
    for x, book, toward_zero, signed in ((m, books[0], True, True), (v, books[1], False, False)):
        codes, scale = torch.empty(x.shape, dtype=torch.uint8), torch.empty(3, 3)  # 600 = 256 + 256 + 88
        master_update._encode(x, codes, scale, book, toward_zero=toward_zero)
        assert torch.equal(scale, torch.stack([b.abs().amax(-1) for b in (x[:, :256], x[:, 256:512], x[:, 512:])], 1))
        y = master_update._decode(codes, scale, book)
        assert torch.equal(y.double(), master_update.int8_values(codes, scale, signed).float().double())
        decoded.append(y)
    (qm, qv), big = decoded, m.abs() > 0.2 * torch.repeat_interleave(torch.stack(
        [b.abs().amax(-1) for b in (m[:, :256], m[:, 256:512], m[:, 512:])], 1), torch.tensor([256, 256, 88]), dim=1)
    assert bool((qm.abs() <= m.abs()).all()) and bool((qm * m >= 0).all())
    assert bool((qv >= v).all())
    assert float(((m - qm).abs() / m.abs())[big].max()) < 0.9 / 64 / 0.2  # a code's step at a fifth of the largest
    assert not torch.equal(qm, m) and not torch.equal(qv, v)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_stay_in_the_map_where_a_compiled_division_overshoots_one(signed):
    """A GPU's compiled division is not correctly rounded: a block's largest value over itself can be
    a float above 1 (or below -1). Its code must be the map's end, never the index past it (256),
    which wrapped to code 0 in uint8: int8 moments diverged on one H200 (their update was wrong on one H100)."""
    book = master_update.int8_codebooks(torch.device("cpu"))[0 if signed else 1]
    above = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    for toward_zero in ((True, False) if signed else (False,)):
        codes = master_update.int8_codes(torch.stack([above, torch.tensor(1.0)]), book, toward_zero)
        assert codes.tolist() == [255, 255], (toward_zero, codes)
        if signed:
            low = master_update.int8_codes(torch.stack([-above, torch.tensor(-1.0)]), book, toward_zero)
            assert low.tolist() == [0, 0], (toward_zero, low)


def test_int8_moments_are_adamw_within_its_codes_and_keep_its_moment_ratio():
    """int8 state: matrices as uint8 codes plus a float32 scale per row block, 1-D tensors in
    float32 (torch's AdamW there, to float32 rounding); the matrices near float32 moments' trajectory but not on
    it; every stored state within AdamW's |exp_avg| <= ratio x sqrt(exp_avg_sq) (A2's bound on a
    step), and about a quarter of float32's bytes on rows of 512."""
    from onenode.verify.replay_harness import adam_moment_ratio

    int8_params, full_params = _params(), _params()
    int8, full = AdamWCompactMoments(int8_params, **INT8), torch.optim.AdamW(full_params, foreach=False, **OPTIONS)
    for step in range(8):
        _step(int8_params, int8, step)
        _step(full_params, full, step)
        ratio = adam_moment_ratio(*OPTIONS["betas"], step + 1)
        for p in int8_params:
            state = int8.state[p]
            if p.ndim > 1:
                m = master_update.int8_values(state["exp_avg"], state["exp_avg_scale"], signed=True)
                v = master_update.int8_values(state["exp_avg_sq"], state["exp_avg_sq_scale"], signed=False)
                assert bool((m.abs() <= ratio * v.sqrt() * (1 + 1e-6)).all())
    for p, q in zip(int8_params, full_params):
        state = int8.state[p]
        if p.ndim == 1:
            assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and torch.allclose(p, q, rtol=1e-6, atol=1e-7)
            continue
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.uint8
        assert state["exp_avg_scale"].shape == (*p.shape[:-1], 1) == state["exp_avg_sq_scale"].shape
        assert not torch.equal(p, q) and torch.allclose(p, q, atol=0.02)

    def state_bytes(optimizer):
        return sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    wide_int8, wide_full = (torch.nn.Parameter(torch.ones(4, 512)) for _ in range(2))
    int8, full = AdamWCompactMoments([wide_int8], **INT8), torch.optim.AdamW([wide_full], foreach=False, **OPTIONS)
    _step([wide_int8], int8, 0)
    _step([wide_full], full, 0)
    assert state_bytes(full) == 8 * 2048 and state_bytes(int8) == 2 * 2048 + 2 * 4 * 2 * 4  # codes, 2 scales a row


def test_int8_moments_resume_from_a_state_dict_bit_for_bit():
    """torch's `load_state_dict` casts the codes to float32 (and leaves the scales): the optimizer
    gives them their uint8 back as it loads, and the resumed run takes the uninterrupted run's steps
    exactly. A state whose codes are not 8-bit codes is refused in one line."""
    straight_params, resumed_params = _params(), _params()
    straight, first = AdamWCompactMoments(straight_params, **INT8), AdamWCompactMoments(resumed_params, **INT8)
    for step in range(3):
        _step(straight_params, straight, step)
        _step(resumed_params, first, step)
    resumed = AdamWCompactMoments(resumed_params, **INT8)
    resumed.load_state_dict(first.state_dict())
    state = resumed.state[resumed_params[0]]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_scale"].dtype == torch.float32
    assert all(torch.equal(state[k], first.state[resumed_params[0]][k]) for k in state)
    for step in range(3, 5):
        _step(straight_params, straight, step)
        _step(resumed_params, resumed, step)
    assert all(torch.equal(a, b) for a, b in zip(straight_params, resumed_params))
    assert all(torch.equal(straight.state[a][k], resumed.state[b][k])
               for a, b in zip(straight_params, resumed_params) for k in straight.state[a])
    forged = first.state_dict()
    forged["state"][0]["exp_avg"] = forged["state"][0]["exp_avg"].float() + 0.5
    with pytest.raises(ValueError, match="not 8-bit codes"):
        AdamWCompactMoments(_params(), **INT8).load_state_dict(forged)


def test_int8_moments_fused_and_unfused_steps_are_one_update():
    """The fused bf16 step (`clip_and_update`, gradients on the bf16 copies, no clip) and the
    optimizer's own step on the same gradients in float32 run the same function: the same
    parameters, codes and scales, bit for bit. Traced as one graph (as inductor gets it; aot_eager's
    decompositions round in their own order) it computes the same to float32 rounding, codes within one."""
    fused_params, unfused_params = _params(), _params()
    fused, unfused = AdamWCompactMoments(fused_params, **INT8), AdamWCompactMoments(unfused_params, **INT8)
    weights = MasterWeights()
    for p in fused_params:
        weights.copy_of[id(p)] = torch.nn.Parameter(p.detach().bfloat16())
    for step in range(3):
        grads = [g.bfloat16() for g in _grads(step, fused_params)]
        for p, g in zip(fused_params, grads):
            weights.copy_of[id(p)].grad = g
        master_update.clip_and_update(weights, fused, 0.0)
        for p, g in zip(unfused_params, grads):
            p.grad = g.float()
        unfused.step()
    assert all(torch.equal(a, b) for a, b in zip(fused_params, unfused_params))
    assert all(torch.equal(fused.state[a][k], unfused.state[b][k])
               for a, b in zip(fused_params, unfused_params) for k in fused.state[a])
    assert all(torch.equal(weights.copy_of[id(p)], p.bfloat16()) for p in fused_params)

    compiled = torch.compile(master_update._adamw, backend="aot_eager", fullgraph=True)
    runs = []
    for update in (master_update.ChunkedUpdate(master_update._adamw), master_update.ChunkedUpdate(compiled)):
        params = _params()
        optimizer = AdamWCompactMoments(params, **INT8)
        for step in range(2):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            with torch.no_grad():
                groups, _ = master_update._groups(optimizer, lambda param: None)
                master_update.apply_update(groups, torch.ones(()), update)
        runs.append((params, optimizer))
    (eager_params, eager), (traced_params, traced) = runs
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(eager_params, traced_params))
    assert all(int((eager.state[a][k].int() - traced.state[b][k].int()).abs().max()) <= 1
               for a, b in zip(eager_params, traced_params) for k in ("exp_avg", "exp_avg_sq") if a.ndim > 1)


def test_the_recipe_says_what_int8_moments_need():
    with pytest.raises(RecipeError, match=r"int8 moments need betas\[1\] <= 0.95 .*use bfloat16 or float32"):
        load_recipe(TINY, {"optimizer.moments": "int8", "optimizer.betas": [0.9, 0.99]})
    int8, compact = (load_recipe(TINY, {"optimizer.moments": kind}) for kind in ("int8", "bfloat16"))
    assert int8.training_sha256 not in (compact.training_sha256, load_recipe(TINY).training_sha256)


def test_the_optimizer_state_bound_reads_int8_codes_only_where_the_recipe_stores_them():
    """A2's optimizer-state check on int8 state: the codes are decoded with their scales, with no
    slack on the ratio bound (the rounding keeps it) and no sum bound on exp_avg_sq's codes (their
    upward rounding compounds; a larger one only shrinks steps). A float32 recipe gets neither: the
    same decoded moments stored as float32 fail its sum bound, and a state of codes fails its
    state's keys; codes that are not 8-bit codes, or over the ratio bound, fail in one line."""
    from onenode.verify.replay_harness import adam_moment_ratio, moment_rounding, optimizer_state_problem

    signed, unsigned = master_update.dynamic_map(True), master_update.dynamic_map(False)
    group = {"params": ["w"], "betas": (0.9, 0.95), "lr": 0.1, "eps": 1e-8}
    zero_codes, zero_scale = torch.zeros(1, 4, dtype=torch.uint8), torch.zeros(1, 1)
    int8_fresh = {"param_groups": [group], "state": {"w": {
        "step": torch.tensor(1.0), "exp_avg": zero_codes + 127, "exp_avg_scale": zero_scale,  # signed 0 is code 127
        "exp_avg_sq": zero_codes, "exp_avg_sq_scale": zero_scale}}}
    float_fresh = {"param_groups": [group], "state": {"w": {
        "step": torch.tensor(1.0), "exp_avg": torch.zeros(1, 4), "exp_avg_sq": torch.zeros(1, 4)}}}
    clip, steps = 1.0, 2
    v_codes = torch.tensor([[255, 200, 200, 200]], dtype=torch.uint8)
    v_scale = torch.tensor([[10 * clip ** 2 * (1 - 0.95 ** steps)]])  # sum(exp_avg_sq) far over the clip's bound
    m_codes = torch.tensor([[254, 127, 127, 127]], dtype=torch.uint8)
    m_scale = torch.tensor([[0.1 / signed[254]]])  # ||exp_avg|| 0.1 of its bound's 0.19
    v = torch.tensor([[unsigned[int(c)] for c in v_codes[0]]]) * v_scale
    m = torch.tensor([[signed[int(c)] for c in m_codes[0]]]) * m_scale

    def int8_stored(m_codes=m_codes, v_codes=v_codes) -> dict:
        return {"param_groups": [dict(group)], "state": {"w": {
            "step": torch.tensor(3.0), "exp_avg": m_codes.float(), "exp_avg_scale": m_scale,
            "exp_avg_sq": v_codes.float(), "exp_avg_sq_scale": v_scale}}}

    float_stored = {"param_groups": [dict(group)], "state": {"w": {
        "step": torch.tensor(3.0), "exp_avg": m.float(), "exp_avg_sq": v.float()}}}
    assert optimizer_state_problem(int8_stored(), int8_fresh, steps, clip, "int8") is None
    assert "sum(exp_avg_sq)" in optimizer_state_problem(float_stored, float_fresh, steps, clip, "float32")
    assert "optimizer state holds" in optimizer_state_problem(int8_stored(), float_fresh, steps, clip, "float32")
    assert moment_rounding("int8") == moment_rounding("float32") < moment_rounding("bfloat16")
    assert "not 8-bit codes" in optimizer_state_problem(int8_stored(v_codes=v_codes.float() + 0.5), int8_fresh,
                                                        steps, clip, "int8")
    assert float(m[0, 0]) <= adam_moment_ratio(0.9, 0.95, steps) * float(v[0, 0].sqrt())
    over = v_codes.clone()
    over[0, 0] = 1  # exp_avg_sq 3e-7 of its scale under exp_avg 0.1: over the ratio bound
    assert "steps of any gradients give" in optimizer_state_problem(int8_stored(v_codes=over), int8_fresh, steps,
                                                                    clip, "int8")


def _train_on_rank(argv: list[str]) -> None:
    from onenode import cli

    assert cli.main(argv) == 0


@pytest.mark.dist
@pytest.mark.slow  # about 45 s: three runs of the tiny model on two gloo ranks
def test_int8_moments_shard_with_fsdp_and_resume_bit_for_bit(tmp_path):
    """On two FSDP2 ranks the codes and their scales are DTensors sharded as their parameter (rows:
    each rank's shard holds its rows' blocks): DCP saves each rank's rows, and a run stopped at its
    step-3 checkpoint and resumed ends on the uninterrupted run's weights, bit for bit."""
    import json

    import torch.distributed.checkpoint as dcp
    from dist_utils import run_distributed

    settings = ["optimizer.moments=int8", "train.token_budget=3072", "checkpoint.every_steps=3",
                "checkpoint.keep_last=0", "log.progress_bar=false", "eval.every_steps=0", "checkpoint.export_hf=false"]
    train = ["train", str(TINY), *[a for s in settings for a in ("--set", s)]]
    for out, stop in (("full", []), ("part", ["--stop-after", "3"]), ("part", [])):  # the second resumes
        run_distributed(_train_on_rank, world_size=2, args=([*train, "--out", str(tmp_path / out), *stop],))
    final = [tmp_path / run / "checkpoints" / "step_00000006" for run in ("full", "part")]
    metas = [json.loads((path / "meta.json").read_text()) for path in final]
    assert metas[0]["layout"]["dp"] == 2 and metas[0]["weights_sha256"] == metas[1]["weights_sha256"]
    stored = dcp.FileSystemReader(str(final[0])).read_metadata().state_dict_metadata
    key = "optim.state.backbone.layers.0.mixer.in_proj.weight"
    codes, scales = stored[f"{key}.exp_avg_sq"], stored[f"{key}.exp_avg_sq_scale"]
    assert codes.properties.dtype == torch.uint8 and tuple(scales.size) == (codes.size[0], 1)
    assert [c.offsets[0] for c in codes.chunks] == [c.offsets[0] for c in scales.chunks] == [0, codes.size[0] // 2]
