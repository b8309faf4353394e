"""The training step's optimizer and clipping: the AdamW kernel per device, and clipping that never
makes the host wait for the device (the norm stays a tensor until the step has been queued)."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from onenode.model import build_model, get_preset
from onenode.parallel import ParallelDims, ParallelModel, parallelize
from onenode.parallel.fsdp import apply_fsdp_on_one_rank
from onenode.train.step import build_optimizer, clip_grad_norm_, train_step

# aten ops that read a device value on the host (`.item()`, `float(t)`, `if t:`) or size an output by the data
HOST_SYNCS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten.bincount"}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in HOST_SYNCS:
            self.syncs.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def no_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _model_with_grads(layout="plain"):
    """The tiny model after one backward: as built ("plain"), in bf16 as one process runs it
    ("one-process-bf16"), or sharded as several ranks run it, on a group of one ("fsdp-one-rank-bf16":
    DTensor gradients)."""
    config = get_preset("tiny")
    if layout == "fsdp-one-rank-bf16":
        model = build_model(config, seed=0)
        model = ParallelModel(model, dp_mesh=apply_fsdp_on_one_rank(model, torch.bfloat16))
    else:
        param_dtype = torch.bfloat16 if layout == "one-process-bf16" else None
        model = parallelize(build_model(config, seed=0), ParallelDims(), param_dtype=param_dtype)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    model.stage_modules[0](ids[:, :-1], labels=ids[:, 1:]).loss.backward()
    return model


@pytest.mark.parametrize("layout", ["plain", "one-process-bf16", "fsdp-one-rank-bf16"])
def test_clipping_matches_torch_and_waits_for_nothing(layout):
    model = _model_with_grads(layout)
    params = list(model.parameters())
    assert all(hasattr(p.grad, "full_tensor") == (layout == "fsdp-one-rank-bf16") for p in params)
    before = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in params]
    expected = torch.nn.utils.get_total_norm(before)
    max_norm = expected.item() / 4
    with SyncCounter() as counter:
        norm = clip_grad_norm_(params, max_norm=max_norm)
    assert counter.syncs == []
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float32 and norm.dim() == 0
    torch.testing.assert_close(norm, expected)
    after = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    torch.testing.assert_close(torch.nn.utils.get_total_norm(after), expected / 4, rtol=1e-5, atol=0)
    unclipped = clip_grad_norm_(params, max_norm=1e9)  # below the threshold: the gradients stay as they are
    torch.testing.assert_close(unclipped, expected / 4, rtol=1e-5, atol=0)


def test_adamw_is_foreach_off_cuda_and_the_step_reports_floats():
    model = _model_with_grads()
    optimizer = build_optimizer(model, lr=1e-3)
    assert optimizer.defaults["foreach"] is True and optimizer.defaults["fused"] is False
    config = get_preset("tiny")
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    out = train_step(model, optimizer, ids[:, :-1], ids[:, 1:], grad_clip=1.0)
    assert isinstance(out["loss"], float) and isinstance(out["grad_norm"], float)
