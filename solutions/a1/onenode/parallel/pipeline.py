"""Pipeline parallelism: split NemotronH into stages and run them with a `torch.distributed.pipelining` schedule.

The splitter follows the hybrid model's own layout: the first stage owns `backbone.embeddings`,
the last owns `backbone.norm_f`, `lm_head` and the loss, and every layer in between is called as
`layer(hidden) -> hidden` whatever its mixer (Mamba2, attention, MoE or MLP). Layers are assigned to
stages by their cost, not their count: a MoE layer and a Mamba layer do very different amounts of
work per token. Each stage keeps the full model's parameter names, so checkpoints, weight-decay
groups and FSDP see the same tensors as without pipelining.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..flops import model_flops
from ..model.config import NemotronHConfig

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
# Schedules that run several (virtual) stages per rank, stage s on rank s % pp.
LOOPED_SCHEDULES = {"interleaved_1f1b"}


def layer_costs(config: NemotronHConfig, seq_len: int) -> tuple[list[float], float]:
    """Forward FLOPs of each layer for one sequence, and of the head (norm_f, lm_head, loss).

    Hybrid layers are nothing alike: a MoE layer runs only top_k of its experts, attention's
    score and value products grow with the sequence, Mamba's scan does work without weights. So
    each layer is weighed by its FLOPs (tensor-core and other alike, from `onenode.flops`), not
    counted as one. The embeddings are a lookup and cost nothing.
    """
    costs = [layer.matmul_total + layer.other_total for layer in model_flops(config, seq_len).layers]
    return [float(c) for c in costs[1:-1]], float(costs[-1])


def balance_stages(costs: list[float], num_stages: int, last_stage_extra: float = 0.0) -> list[range]:
    """Contiguous layer ranges, one per stage, that minimise the cost of the most expensive stage.

    `last_stage_extra` is work only the last stage does (lm_head and loss). Exact dynamic program
    over split points: O(stages x layers^2), nothing for a few dozen layers.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} pipeline stages: use at most {n} stages")
    prefix = list(itertools.accumulate(costs, initial=0.0))
    # best[s][i]: the smallest possible max-stage cost when stages 0..s-1 hold layers 0..i-1.
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        extra = last_stage_extra if s == num_stages else 0.0
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


class PipelineStageModule(nn.Module):
    """One stage of NemotronH: a slice of its layers, with the full model's parameter names.

    `backbone.embeddings` is present on the first stage only, `backbone.norm_f` and `lm_head` on the
    last only; `backbone.layers` is a ModuleDict keyed by the original layer index.
    """

    def __init__(self, backbone: nn.Module, lm_head: nn.Module | None):
        super().__init__()
        self.backbone = backbone
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backbone = self.backbone
        if backbone.embeddings is not None:
            x = backbone.embeddings(x)
        for layer in backbone.layers.values():
            x = layer(x)
        if backbone.norm_f is not None:
            x = backbone.norm_f(x)
        return x if self.lm_head is None else self.lm_head(x.to(self.lm_head.weight.dtype))


def split_stage(model: nn.Module, layer_ids: range, *, first: bool, last: bool) -> PipelineStageModule:
    """Copy what one stage owns out of the full model, leaving the model untouched.

    The copy is a deep copy that maps every submodule the stage does not own to None (through
    deepcopy's memo), so a stage never holds, even briefly, another stage's weights.
    """
    backbone = model.backbone
    not_owned = [layer for i, layer in enumerate(backbone.layers) if i not in layer_ids]
    if not first:
        not_owned.append(backbone.embeddings)
    if not last:
        not_owned.append(backbone.norm_f)
    stage_backbone = copy.deepcopy(backbone, {id(module): None for module in not_owned})
    stage_backbone.layers = nn.ModuleDict({str(i): stage_backbone.layers[i] for i in layer_ids})
    return PipelineStageModule(stage_backbone, copy.deepcopy(model.lm_head) if last else None)


def _materialize(stage: nn.Module, device: torch.device) -> nn.Module:
    """Every parameter and buffer on the stage's device (router biases too), values unchanged."""
    meta = [name for name, t in itertools.chain(stage.named_parameters(), stage.named_buffers()) if t.is_meta]
    if meta:
        raise ValueError(
            f"{meta[0]} is on the meta device: build the model with real values "
            f"(build_model(config, seed, device='cpu')) before splitting it into pipeline stages"
        )
    return stage.to(device)


class PipelineRunner:
    """This rank's pipeline stages and their schedule (`parallelize` returns it in a `ParallelModel`).

    `step` runs forward and backward over all microbatches and returns the mean microbatch loss
    on the rank holding the last stage (None elsewhere). The gradients equal those of the whole
    batch when the microbatches hold equally many labelled tokens.
    """

    def __init__(self, schedule, stages: list[PipelineStage], microbatches: int):
        self.schedule = schedule
        self.stages = stages
        self.microbatches = microbatches
        self.has_first_stage = any(stage.is_first for stage in stages)
        self.has_last_stage = any(stage.is_last for stage in stages)

    @property
    def stage_modules(self) -> list[nn.Module]:
        return [stage.submod for stage in self.stages]

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        if input_ids.shape[0] % self.microbatches:
            raise ValueError(
                f"batch size {input_ids.shape[0]} is not a multiple of {self.microbatches} microbatches: "
                f"change the batch size or the number of microbatches"
            )
        args = (input_ids,) if self.has_first_stage else ()
        losses: list[torch.Tensor] | None = [] if self.has_last_stage else None
        self.schedule.step(
            *args, target=labels if self.has_last_stage else None, losses=losses, return_outputs=False
        )
        return torch.stack(losses).detach().mean() if self.has_last_stage else None


def build_pipeline(
    model: nn.Module,
    pp_mesh,
    *,
    schedule: str = "1f1b",
    microbatches: int,
    device: torch.device | str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    stages_per_rank: int | None = None,
    seq_len: int = 4096,
    stage_layers: list[int] | None = None,
    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> PipelineRunner:
    """Split `model` over the ranks of `pp_mesh` and return this rank's runner.

    `stages_per_rank` (virtual stages) defaults to 2 for interleaved 1F1B, 1 otherwise. Layers
    are balanced by `layer_costs` at `seq_len`, unless `stage_layers` gives each stage's number of
    layers. `parallelize_fn` (expert parallel, FSDP and its mixed precision) is applied to each
    stage module on its device before the schedule is built.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    looped = schedule in LOOPED_SCHEDULES
    stages_per_rank = stages_per_rank or (2 if looped else 1)
    if stages_per_rank != 1 and not looped:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank: use interleaved_1f1b for virtual stages")
    config = model.config
    if config.tie_word_embeddings:
        raise ValueError("tied embeddings live on the first and the last stage: untie them to use pipeline parallelism")
    device = torch.device(device)
    pp_size, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    num_stages = pp_size * stages_per_rank
    if stage_layers is None:
        costs, head_cost = layer_costs(config, seq_len)
        layer_ranges = balance_stages(costs, num_stages, last_stage_extra=head_cost)
    else:
        layer_ranges = _ranges_from_counts(stage_layers, num_stages, config.num_hidden_layers)

    stages = []
    for stage_index in range(pp_rank, num_stages, pp_size):
        module = split_stage(
            model, layer_ranges[stage_index], first=stage_index == 0, last=stage_index == num_stages - 1
        )
        module = _materialize(module, device)
        if parallelize_fn is not None:
            module = parallelize_fn(module)
        stages.append(PipelineStage(module, stage_index, num_stages, device, group=pp_mesh.get_group()))

    schedule_cls = SCHEDULES[schedule]
    runner_schedule = schedule_cls(stages if looped else stages[0], microbatches, loss_fn=loss_fn)
    return PipelineRunner(runner_schedule, stages, microbatches)


def _ranges_from_counts(stage_layers: list[int], num_stages: int, num_layers: int) -> list[range]:
    if len(stage_layers) != num_stages or sum(stage_layers) != num_layers or min(stage_layers) < 1:
        raise ValueError(
            f"stage_layers {stage_layers} must give {num_stages} positive layer counts summing to {num_layers}"
        )
    bounds = list(itertools.accumulate(stage_layers, initial=0))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]

