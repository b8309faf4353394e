"""The kit's NemotronH trains, runs under bf16 autocast, builds deterministically, counts its
parameters, and fails clearly on bad checkpoints."""

import json

import pytest
import torch

from onenode import load_pretrained
from onenode.model import (
    PRESETS,
    NemotronHForCausalLM,
    build_model,
    count_parameters,
    cross_entropy_loss,
    get_preset,
    linear_cross_entropy,
    routed_expert_parameters,
)
from onenode.model.expert_index import count_per_expert, gather_columns
from onenode.model.hf_io import adapt_state_dict, save_pretrained
from onenode.model.moe import MoE


def _batch(config, batch=2, seq=24, seed=0):
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1].clone(), ids[:, 1:].clone()


def test_adamw_steps_lower_the_loss():
    config = get_preset("tiny")
    model = build_model(config, seed=0)
    ids, labels = _batch(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_loss_is_mean_cross_entropy_over_shifted_labels_ignoring_minus_100():
    config = get_preset("tiny")
    model = build_model(config, seed=0)
    ids, labels = _batch(config)
    labels[0, :5] = -100
    out = model(ids, labels=labels, return_logits=True)
    assert out.logits.shape == (*ids.shape, config.vocab_size)
    keep = labels != -100
    log_probs = out.logits.float().log_softmax(-1)[keep]
    expected = -log_probs.gather(1, labels[keep][:, None]).mean()
    torch.testing.assert_close(out.loss, expected)


def test_labels_give_the_loss_without_logits_unless_asked():
    config = get_preset("tiny")
    model = build_model(config, seed=0)
    ids, labels = _batch(config)
    assert model(ids, labels=labels).logits is None
    assert model(ids).loss is None and model(ids).logits.shape == (*ids.shape, config.vocab_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_head_loss_matches_the_plain_one(dtype):
    """The fused head + loss, a few tokens at a time, gives the loss and gradients of the plain
    head and cross entropy over the whole batch's logits (ignored labels included)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 32, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(200, 32, generator=gen) / 6).to(dtype).requires_grad_()
    labels = torch.randint(0, 200, (3, 11), generator=gen)
    labels[0, :4] = labels[2, -1] = -100
    plain = cross_entropy_loss(torch.nn.functional.linear(hidden, weight), labels)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    for chunk in (4, 7, 33, None):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
        grads = torch.autograd.grad(loss * 3, (hidden, weight))
        torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
        for got, want in zip(grads, plain_grads):
            assert got.dtype == want.dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want * 3)
            else:  # bf16 rounds each chunk's product: compare against the gradient's scale
                assert (got.float() - 3 * want.float()).abs().max() < 1e-2 * (3 * want.float()).abs().max()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, labels, chunk_tokens=5), plain)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's float32-output GEMM runs on a GPU")
def test_head_weight_gradient_adds_up_in_float32_on_a_gpu():
    """On a GPU each chunk's product goes into the float32 weight gradient unrounded: nearer the
    float64 answer than the same chunks' products rounded to bf16 and then added."""
    from onenode.model.loss import accumulate_product_

    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = [(torch.randn(256, 64, device="cuda", generator=gen).bfloat16(),
               torch.randn(64, 512, device="cuda", generator=gen).bfloat16()) for _ in range(16)]
    total = torch.zeros(256, 512, device="cuda")
    rounded = torch.zeros_like(total)
    for a, b in chunks:
        accumulate_product_(total, a, b)
        rounded += (a @ b).float()
    want = sum(a.double() @ b.double() for a, b in chunks)
    assert total.dtype == torch.float32
    assert (total - want).abs().max() < 1e-4 * want.abs().max() < (rounded - want).abs().max()


def test_router_weights_gather_columns_bit_for_bit():
    """The router's masked-sum gather gives gather's values and gather's gradient, bit for bit
    (the router's choices and a deterministic run's replay depend on it)."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(50, 16, generator=gen).requires_grad_()
    idx = torch.rand(50, 16, generator=gen).topk(4, dim=-1).indices
    upstream = torch.randn(50, 4, generator=gen)
    picked = gather_columns(scores, idx)
    want = scores.gather(1, idx)
    assert torch.equal(picked, want)
    assert torch.equal(torch.autograd.grad(picked, scores, upstream)[0], torch.autograd.grad(want, scores, upstream)[0])


def test_count_per_expert_is_bincount():
    """The compare-and-sum count gives bincount's counts, zeros for experts nobody chose included,
    in integers and in float32 (the balancer's load buffer), eager and compiled."""
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 13, (300, 6), generator=gen)  # 16 experts: the last three never chosen
    want = torch.bincount(idx.flatten(), minlength=16)
    assert torch.equal(count_per_expert(idx, 16), want)
    assert torch.equal(count_per_expert(idx, 16, torch.float32), want.float())
    compiled = torch.compile(count_per_expert, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(idx, 16), want)


def test_compiled_chunk_math_equals_eager():
    """The head's per-chunk loss and logit gradient compile to one graph (as on a GPU) and give
    what the eager code gives; ignored rows get no gradient."""
    from onenode.model.loss import chunk_loss_and_logit_grad

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 50, generator=gen) * 4).to(torch.bfloat16)
    target = torch.randint(0, 50, (6,), generator=gen)
    kept = torch.tensor([True, True, False, True, True, False])
    eager = chunk_loss_and_logit_grad(logits, target, kept)
    compiled = torch.compile(chunk_loss_and_logit_grad, fullgraph=True, backend="eager")(logits, target, kept)
    want = torch.nn.functional.cross_entropy(logits.float()[kept], target[kept], reduction="sum")
    torch.testing.assert_close(eager[0], want)
    for got in (eager, compiled):
        torch.testing.assert_close(got[0], want)
        assert got[1].dtype == torch.bfloat16 and not got[1][~kept].any()
        torch.testing.assert_close(got[1][kept].float(), torch.softmax(logits.float()[kept], -1)
                                   - torch.nn.functional.one_hot(target[kept], 50), atol=4e-3, rtol=0)


def test_layers_compose_one_by_one():
    config = get_preset("tiny")
    model = build_model(config, seed=0)
    ids, _ = _batch(config, seq=20)
    hidden = model.backbone.embeddings(ids)
    for layer in model.backbone.layers:
        hidden = layer(hidden)
        assert hidden.shape == (*ids.shape, config.hidden_size)
    torch.testing.assert_close(model.lm_head(model.backbone.norm_f(hidden)), model(ids).logits)


def test_flex_attention_is_sdpas_causal_attention():
    """`attention_kernel: flex` (FlexAttention over a causal block mask, `model/attention.py`) is the
    model's SDPA attention: the same weights give the same loss (float32, a length that is no
    multiple of the mask's blocks; a CPU has FlexAttention's forward only, the GPU test below
    checks the backward); the choice stays out of config.json; a kernel the kit has not, or flex
    training on a CPU, is refused in one line."""
    from onenode.model import attention
    from onenode.train.assembly import assemble
    from onenode.train.recipe import RecipeError, from_dict

    attention._BLOCK_MASKS.clear()
    configs = get_preset("tiny"), get_preset("tiny", attention_kernel="flex")
    models = [build_model(config, seed=0) for config in configs]
    ids, labels = _batch(configs[0], seq=150)
    with torch.no_grad():
        losses = [model(ids, labels).loss for model in models]
    torch.testing.assert_close(losses[1], losses[0])
    assert list(attention._BLOCK_MASKS) == [(150, "cpu")]  # the flex model's attention ran FlexAttention
    assert "attention_kernel" not in configs[1].to_hf_dict()
    with pytest.raises(ValueError, match="attention_kernel is sdpa or flex"):
        get_preset("tiny", attention_kernel="flash")
    recipe = from_dict({"name": "flex", "model": {"preset": "tiny", "overrides": {"attention_kernel": "flex"}},
                        "data": {"source": "synthetic"}, "train": {"token_budget": 64, "seq_len": 32,
                                                                   "global_batch_size": 2, "device": "cpu"}})
    with pytest.raises(RecipeError, match="attention_kernel flex trains on a GPU"):
        assemble(recipe)


def test_flex_attentions_mask_is_made_outside_the_compiled_layers():
    """The backbone makes FlexAttention's causal mask before its layers run, so a compiled attention
    layer finds it made and compiles once; made inside, dynamo would trace its making and compile the
    layer again at the next call, when the cache no longer matches its guards."""
    from torch._dynamo.testing import CompileCounter

    from onenode.model import attention

    config = get_preset("tiny", attention_kernel="flex")
    model = build_model(config, seed=0)
    attention._BLOCK_MASKS.clear()
    counter = CompileCounter()
    for layer in model.backbone.layers:
        if layer.kind == "attention":
            layer.forward = torch.compile(layer.forward, backend=counter, fullgraph=True)
    ids, _ = _batch(config, seq=64)
    with torch.no_grad():
        model(ids)
        model(ids)
    assert list(attention._BLOCK_MASKS) == [(64, "cpu")] and counter.frame_count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's Triton kernels run on a GPU")
def test_flex_attention_is_deterministic_compiled_on_a_gpu():
    """Compiled on a GPU under torch's deterministic algorithms, FlexAttention's backward gives the
    same bits twice (no atomics: what graded A2 runs need) and SDPA's numbers within bf16."""
    from onenode.model.attention import flex_attention

    torch.use_deterministic_algorithms(True)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(2, heads, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for heads in (16, 2, 2))
        grads = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            flex_attention(*leaves, grouped_query=True).float().square().sum().backward()
            grads.append([t.grad for t in leaves])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sdpa = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        sdpa.float().square().sum().backward()
        for flex, sdpa in zip(grads[0], (t.grad for t in leaves)):
            torch.testing.assert_close(flex.float(), sdpa.float(), rtol=0.05, atol=0.05)
    finally:
        torch.use_deterministic_algorithms(False)


def test_bf16_autocast_forward_backward_on_cpu():
    config = get_preset("tiny")
    model = build_model(config, seed=0)
    ids, labels = _batch(config)
    reference = model(ids, labels=labels).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=labels, return_logits=True)
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    assert abs(out.loss.item() - reference.item()) < 0.05
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_bf16_weights_keep_router_in_float32():
    config = get_preset("tiny")
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    ids, labels = _batch(config)
    assert model.backbone.layers[1].mixer.gate.weight.dtype == torch.float32
    assert model.backbone.layers[1].mixer.gate.e_score_correction_bias.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
    out = model(ids, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.loss)


def test_residual_in_fp32_keeps_the_stream_in_float32_with_bf16_weights():
    config = get_preset("tiny", residual_in_fp32=True)
    model = build_model(config, seed=0, dtype=torch.bfloat16)
    ids, labels = _batch(config, seq=8)
    hidden = model.backbone.layers[0](model.backbone.embeddings(ids))
    assert hidden.dtype == torch.float32
    assert torch.isfinite(model(ids, labels=labels).loss)


def test_every_expert_gets_a_gradient_even_without_tokens():
    config = get_preset("tiny", n_routed_experts=8, num_experts_per_tok=2)
    moe = build_model(config).backbone.layers[1].mixer
    assert isinstance(moe, MoE)
    moe(torch.randn(1, 1, config.hidden_size)).sum().backward()  # one token: 6 experts idle
    grads = [expert.up_proj.weight.grad for expert in moe.experts]
    assert all(g is not None for g in grads)
    assert sum(bool(g.abs().sum() > 0) for g in grads) == 2


def test_build_is_deterministic_per_seed_and_per_tensor_name():
    config = get_preset("tiny")
    a, b, c = (build_model(config, seed=s).state_dict() for s in (0, 0, 1))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    random_keys = [k for k in a if a[k].std() > 0 and not k.endswith("A_log")]
    assert random_keys and all(not torch.equal(a[k], c[k]) for k in random_keys)

    # A part of the model (a pipeline stage keeping layers 0-2) initialises like the full model.
    part = build_model(config, seed=0, device="meta")
    del part.backbone.layers[3:]
    part.lm_head = None
    part.to_empty(device="cpu")
    part.init_weights(seed=0)
    for key, tensor in part.state_dict().items():
        torch.testing.assert_close(tensor, a[key], rtol=0, atol=0, msg=key)


def test_init_follows_the_reference_scheme():
    config = get_preset("tiny", hidden_size=256)
    model = build_model(config, seed=0)
    mamba = model.backbone.layers[0].mixer
    heads = config.mamba_num_heads
    torch.testing.assert_close(mamba.A_log, torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
    torch.testing.assert_close(mamba.D, torch.ones(heads))
    dt = torch.nn.functional.softplus(mamba.dt_bias)
    assert ((dt >= config.time_step_min * 0.999) & (dt <= config.time_step_max * 1.001)).all()
    bound = 1 / config.mamba_inner_size**0.5 / config.num_hidden_layers**0.5  # kaiming-uniform / sqrt(L)
    assert mamba.out_proj.weight.abs().max() <= bound and mamba.out_proj.weight.abs().max() > 0.9 * bound
    assert abs(model.backbone.embeddings.weight.std().item() - config.initializer_range) < 0.002
    assert (model.backbone.norm_f.weight == 1).all() and (mamba.conv1d.bias == 0).all()


@pytest.mark.parametrize("name", list(PRESETS))
def test_count_parameters_matches_meta_model(name):
    config = get_preset(name)
    model = build_model(config, device="meta")
    total, active = count_parameters(config)
    assert total == sum(p.numel() for p in model.parameters())
    idle = config.n_routed_experts - config.num_experts_per_tok
    expert = sum(p.numel() for p in next(m for m in model.modules() if isinstance(m, MoE)).experts[0].parameters())
    assert active == total - config.layer_kinds.count("moe") * idle * expert
    assert routed_expert_parameters(config) == config.layer_kinds.count("moe") * config.n_routed_experts * expert
    if name == "nemotron-3-nano-30b-a3b":
        assert 31.5e9 < total < 31.7e9 and 3.4e9 < active < 3.7e9
        assert all(p.device.type == "meta" for p in model.parameters())


def test_tied_embeddings_share_one_tensor_and_roundtrip(tmp_path):
    config = get_preset("tiny", tie_word_embeddings=True)
    model = build_model(config, seed=0)
    assert model.lm_head.weight is model.backbone.embeddings.weight
    ids, _ = _batch(config)
    loaded = NemotronHForCausalLM.from_pretrained(model.save_pretrained(tmp_path))
    assert loaded.lm_head.weight is loaded.backbone.embeddings.weight
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_bad_checkpoints_fail_with_one_clear_line(tmp_path):
    config = get_preset("tiny")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    config.save(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_pretrained(tmp_path)

    good = save_pretrained(build_model(config), tmp_path / "good")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_pretrained(tmp_path)

    hf_config = json.loads((good / "config.json").read_text())
    (good / "config.json").write_text(json.dumps(hf_config | {"vocab_size": 256}))
    with pytest.raises(ValueError, match="shape mismatch for backbone.embeddings.weight"):
        load_pretrained(good)
    shorter = hf_config | {"layers_block_type": hf_config["layers_block_type"][:-1]}
    (good / "config.json").write_text(json.dumps(shorter))
    with pytest.raises(ValueError, match="lacks, e.g. backbone.layers.7"):
        load_pretrained(good)


class _StackedExperts(torch.nn.Module):
    """What A1's fix may put in place of the ModuleList: one 3-D tensor per projection."""

    def __init__(self, config, up_shape):
        super().__init__()
        e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.up_proj = torch.nn.Parameter(torch.zeros(e, *up_shape))
        self.down_proj = torch.nn.Parameter(torch.zeros(e, h, i))


@pytest.mark.parametrize("orientation", ["out_in", "in_out"])
def test_checkpoints_follow_a_stacked_expert_layout(tmp_path, orientation):
    config = get_preset("tiny")
    ids, _ = _batch(config)
    per_expert = build_model(config, seed=0)
    stacked = build_model(config, seed=1)
    up_shape = (config.moe_intermediate_size, config.hidden_size)
    for moe in (m for m in stacked.modules() if isinstance(m, MoE)):
        moe.experts = _StackedExperts(config, up_shape if orientation == "out_in" else up_shape[::-1])
    stacked.load_state_dict(adapt_state_dict(per_expert.state_dict(), stacked))
    moe, ref = stacked.backbone.layers[1].mixer.experts, per_expert.backbone.layers[1].mixer.experts
    up = moe.up_proj[3] if orientation == "out_in" else moe.up_proj[3].T
    torch.testing.assert_close(up, ref[3].up_proj.weight)
    torch.testing.assert_close(moe.down_proj[5], ref[5].down_proj.weight)
    # saving the stacked model writes what the per-expert model (and transformers) reads
    reloaded = load_pretrained(save_pretrained(stacked, tmp_path))
    torch.testing.assert_close(reloaded(ids).logits, per_expert(ids).logits)
