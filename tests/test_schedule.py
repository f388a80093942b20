import math

import pytest

from dstrain.schedule import lr_at, scaled_lr


@pytest.mark.parametrize("rule, batch, expected", [("linear", 4096, 1.6), ("linear", 128, 0.05),
                                                   ("sqrt", 1024, 0.2), ("none", 4096, 0.1)])
def test_scaling_rules(rule, batch, expected):
    assert scaled_lr(0.1, batch, 256, rule) == pytest.approx(expected)


COMMON = dict(peak_lr=1.0, total_steps=100, warmup_steps=10)


@pytest.mark.parametrize("step, expected", [(0, 0.1), (4, 0.5), (9, 1.0), (10, 1.0), (99, 0.0)])
def test_linear_warmup_then_cosine_table(step, expected):
    assert lr_at(step, **COMMON, decay="cosine") == pytest.approx(expected, abs=1e-12)


def test_cosine_midpoint():
    # progress 0.5 halfway between step 10 and the last step 99
    assert lr_at(10 + 89 / 2, **COMMON, decay="cosine") == pytest.approx(0.5)


@pytest.mark.parametrize("step, expected", [(10, 1.0), (99, 0.01), (54.5, 0.01 + 0.99 * 0.25)])
def test_poly_power_2_to_end_lr(step, expected):
    assert lr_at(step, **COMMON, decay="poly", poly_power=2.0, end_lr_factor=0.01) == pytest.approx(expected)


@pytest.mark.parametrize("step, expected", [(10, 1.0), (49, 1.0), (50, 0.1), (79, 0.1), (80, 0.01), (99, 0.01)])
def test_step_decay_at_milestones(step, expected):
    assert lr_at(step, **COMMON, decay="step", milestone_steps=(50, 80), step_gamma=0.1) == pytest.approx(expected)


def test_no_warmup_starts_at_peak():
    assert lr_at(0, peak_lr=2.0, total_steps=10, warmup_steps=0, decay="constant") == 2.0
    assert math.isclose(lr_at(0, peak_lr=2.0, total_steps=10, warmup_steps=0, decay="cosine"), 2.0)
