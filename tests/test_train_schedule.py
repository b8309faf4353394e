"""Learning-rate schedules follow their shapes: warmup, WSD's plateau and decay, cosine."""

import math

import pytest

from onenode.train.recipe import ScheduleSection
from onenode.train.schedule import lr_factor

TOTAL = 100


def _curve(**kwargs) -> list[float]:
    schedule = ScheduleSection(**kwargs)
    return [lr_factor(schedule, step, TOTAL) for step in range(TOTAL)]


@pytest.mark.parametrize("shape, midpoint", [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_warmup_plateau_decay(shape, midpoint):
    lr = _curve(name="wsd", warmup_fraction=0.1, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.0)
    assert lr[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])  # linear warmup
    assert lr[10:80] == [1.0] * 70  # stable
    decay = lr[80:]
    assert all(a > b for a, b in zip(decay, decay[1:]))  # strictly decreasing
    assert decay[-1] == pytest.approx(0.0)
    assert decay[9] == pytest.approx(midpoint)  # half way through the 20 decay steps


def test_wsd_floor_and_one_sqrt_drops_fastest_early():
    lr = _curve(name="wsd", warmup_fraction=0.0, decay_fraction=0.5, decay_shape="1-sqrt", min_lr_ratio=0.1)
    assert lr[0] == 1.0 and lr[-1] == pytest.approx(0.1)
    linear = _curve(name="wsd", warmup_fraction=0.0, decay_fraction=0.5, decay_shape="linear", min_lr_ratio=0.1)
    assert lr[55] < linear[55]


def test_cosine_and_constant():
    lr = _curve(name="cosine", warmup_fraction=0.05, min_lr_ratio=0.1)
    assert lr[4] == 1.0 and lr[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[5:], lr[6:]))
    assert _curve(name="constant", warmup_fraction=0.0) == [1.0] * TOTAL
