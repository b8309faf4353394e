"""Pipeline parallelism: a decoder-only LM split into stages, run by a `torch.distributed.pipelining` schedule.

An automatic splitter in the style of NeMo Automodel's AutoPipeline: it finds the standard
transformers layout (`model.embed_tokens`, `model.layers`, `model.norm`, `model.rotary_emb`,
`lm_head`), gives every stage an equal share of the decoder layers, and calls each layer with the
standard decoder-layer signature. The first stage owns the embeddings, the last the final norm,
`lm_head` and the loss. Each stage keeps the full model's parameter names, so checkpoints,
weight-decay groups and FSDP see the same tensors as without pipelining.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
# Schedules that run several (virtual) stages per rank, stage s on rank s % pp.
LOOPED_SCHEDULES = {"interleaved_1f1b"}


def split_layers_evenly(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges of (nearly) equal length; the first stages take the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages: use at most {num_layers} stages"
        )
    base, extra = divmod(num_layers, num_stages)
    counts = [base + (s < extra) for s in range(num_stages)]
    return _ranges_from_counts(counts, num_stages, num_layers)


class PipelineStageModule(nn.Module):
    """One stage of a decoder-only LM: a slice of its layers, with the full model's parameter names.

    `model.embed_tokens` is present on the first stage only, `model.norm` and `lm_head` on the last
    only; `model.layers` is a ModuleDict keyed by the original layer index. Every stage keeps the
    rotary embedding: each layer needs the position embeddings.
    """

    def __init__(self, decoder: nn.Module, lm_head: nn.Module | None):
        super().__init__()
        self.model = decoder
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        decoder = self.model
        if decoder.embed_tokens is not None:
            x = decoder.embed_tokens(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        position_embeddings = decoder.rotary_emb(x, position_ids)
        for layer in decoder.layers.values():
            x = layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
        if decoder.norm is not None:
            x = decoder.norm(x)
        return x if self.lm_head is None else self.lm_head(x)


def split_stage(model: nn.Module, layer_ids: range, *, first: bool, last: bool) -> PipelineStageModule:
    """Copy what one stage owns out of the full model, leaving the model untouched.

    The copy is a deep copy that maps every submodule the stage does not own to None (through
    deepcopy's memo), so a stage never holds, even briefly, another stage's weights.
    """
    decoder = model.model
    not_owned = [layer for i, layer in enumerate(decoder.layers) if i not in layer_ids]
    if not first:
        not_owned.append(decoder.embed_tokens)
    if not last:
        not_owned.append(decoder.norm)
    stage_decoder = copy.deepcopy(decoder, {id(module): None for module in not_owned})
    stage_decoder.layers = nn.ModuleDict({str(i): stage_decoder.layers[i] for i in layer_ids})
    return PipelineStageModule(stage_decoder, copy.deepcopy(model.lm_head) if last else None)


def _materialize(stage: nn.Module, device: torch.device) -> nn.Module:
    """The stage's weights on its device."""
    for param in stage.parameters():
        param.data = param.data.to(device)
    return stage


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
    stage_layers: list[int] | None = None,
    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> PipelineRunner:
    """Split `model` over the ranks of `pp_mesh` and return this rank's runner.

    `stages_per_rank` (virtual stages) defaults to 2 for interleaved 1F1B, 1 otherwise. Every
    stage gets the same number of layers, unless `stage_layers` gives each stage's number of
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
        layer_ranges = split_layers_evenly(config.num_hidden_layers, num_stages)
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

