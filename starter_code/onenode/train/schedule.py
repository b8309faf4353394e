"""Learning-rate schedules as pure functions of the step: resuming needs only the step number.

Warmup-Stable-Decay (MiniCPM, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training
Durations"): linear warmup, a long constant phase, then a short decay over the last
`decay_fraction` of the steps. Its stable phase can be branched into runs of different lengths,
which is why proxy studies like it. Cosine: linear warmup, then half a cosine to `min_lr_ratio`.
"""

from __future__ import annotations

import math

from .recipe import ScheduleSection


def _decay(shape: str, progress: float) -> float:
    """Fraction of the way from the peak to the floor, for progress in [0, 1]."""
    if shape == "linear":
        return progress
    if shape == "cosine":
        return 0.5 * (1 - math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return math.sqrt(progress)
    raise ValueError(f"unknown decay shape {shape!r}: use linear, cosine or 1-sqrt")


def lr_factor(schedule: ScheduleSection, step: int, total_steps: int) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based) of `total_steps`."""
    warmup = round(schedule.warmup_fraction * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    floor = schedule.min_lr_ratio
    if schedule.name == "constant":
        return 1.0
    if schedule.name == "cosine":
        progress = (step - warmup) / max(1, total_steps - warmup - 1)
        return 1.0 - (1.0 - floor) * _decay("cosine", min(1.0, progress))
    if schedule.name == "wsd":
        decay_steps = round(schedule.decay_fraction * total_steps)
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / decay_steps
        return 1.0 - (1.0 - floor) * _decay(schedule.decay_shape, min(1.0, progress))
    raise ValueError(f"unknown schedule {schedule.name!r}: use wsd, cosine or constant")


def set_lr(optimizer, peak_lr: float, factor: float) -> float:
    """Write `peak_lr * factor` into every param group; returns the lr set."""
    lr = peak_lr * factor
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
