"""Schedules are pure functions of progress t (epochs at the end of the step): exact tables at boundaries."""

import math

import pytest

from dstrain.settings.config import OptimConfig, load_config
from dstrain.techniques.schedule import (
    LRSchedule,
    decay_lr,
    lr_at,
    scaled_lr,
    warmup_lr,
    weight_decay_factor,
)


@pytest.mark.parametrize(
    "rule, batch, expected",
    [("linear", 4096, 1.6), ("linear", 128, 0.05), ("sqrt", 1024, 0.2), ("none", 4096, 0.1)],
)
def test_scaling_rules(rule, batch, expected):
    assert scaled_lr(0.1, batch, 256, rule) == pytest.approx(expected)


# base 0.1 per 256 images at batch 2560: peak 1.0; 10 epochs, 2 warmup epochs
COMMON = dict(base_lr=0.1, peak_lr=1.0, epochs=10)


def optim(**fields) -> OptimConfig:
    """The optim section with 2 warmup epochs and ``fields`` (the config's own names)."""
    return OptimConfig(**{"warmup_epochs": 2, **fields})


@pytest.mark.parametrize(
    "t, expected", [(0.01, 0.005), (1.0, 0.5), (2.0, 1.0), (6.0, 0.5), (10.0, 0.0)]
)
def test_linear_warmup_then_cosine(t, expected):
    assert lr_at(t, optim(decay="cosine"), **COMMON) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("t, expected", [(1e-9, 0.1), (1.0, 0.55), (2.0, 1.0)])
def test_gradual_warmup_starts_at_the_base_lr(t, expected):
    assert lr_at(t, optim(warmup="gradual"), **COMMON) == pytest.approx(expected)


def test_gradual_warmup_below_the_reference_batch_is_flat():
    assert warmup_lr(
        0.5, OptimConfig(warmup_epochs=1, warmup="gradual"), base_lr=0.1, peak_lr=0.05
    ) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "t, expected",
    [
        (1e-12, 1e-3),  # starts at start_factor * peak
        (0.5, math.sqrt(1e-3 * 0.1)),  # geometric midpoint of the exponential half
        (1.0, 0.1),  # reaches the base LR at hybrid_exp_fraction of the warmup
        (1.5, 0.55),  # then linear from base to peak
        (2.0, 1.0),
    ],
)
def test_hybrid_warmup_exponential_then_linear(t, expected):
    assert lr_at(
        t, optim(warmup="hybrid", warmup_start_factor=1e-3, hybrid_exp_fraction=0.5), **COMMON
    ) == pytest.approx(expected)


def test_hybrid_warmup_is_continuous_and_increasing():
    ts = [i / 1000 for i in range(1, 2001)]
    lrs = [lr_at(t, optim(warmup="hybrid"), **COMMON) for t in ts]
    assert all(b > a for a, b in zip(lrs, lrs[1:]))
    assert max(abs(b - a) for a, b in zip(lrs, lrs[1:])) < 0.002


@pytest.mark.parametrize(
    "t, power, expected",
    [
        (2.0, 2.0, 1.0),
        (6.0, 2.0, 0.01 + 0.99 * 0.25),
        (10.0, 2.0, 0.01),
        (6.0, 2.2, 0.01 + 0.99 * 0.5**2.2),
    ],
)
def test_poly_decay_to_end_lr(t, power, expected):
    assert lr_at(
        t, optim(decay="poly", poly_power=power, end_lr_factor=0.01), **COMMON
    ) == pytest.approx(expected)


@pytest.mark.parametrize(
    "t, expected", [(2.5, 1.0), (5.0, 1.0), (5.01, 0.1), (8.0, 0.1), (8.5, 0.01), (10, 0.01)]
)
def test_step_decay_at_milestone_epochs(t, expected):
    assert lr_at(
        t, optim(decay="step", step_milestones=[5, 8], step_gamma=0.1), **COMMON
    ) == pytest.approx(expected)


def test_no_warmup_starts_at_peak():
    assert lr_at(1e-9, OptimConfig(decay="constant"), base_lr=0.1, peak_lr=2.0, epochs=10) == 2.0
    assert decay_lr(0.0, OptimConfig(), peak_lr=2.0) == 2.0


def test_weight_decay_follows_the_lr_curve():
    assert 5e-5 * weight_decay_factor(0.5, 1.0) == pytest.approx(2.5e-5)
    assert weight_decay_factor(0.0, 1.0) == 0.0


def test_trainer_lr_follows_the_batch_through_a_ramp():
    """lr/B stays on one curve when the batch changes: the schedule is continuous in lr/B."""
    o = load_config(None, ["optim.warmup_epochs=2", "optim.decay=poly", "epochs=10"]).optim
    schedule = LRSchedule.from_config(o, epochs=10)  # optim.base_lr's default: 0.1
    lr_small, _ = schedule.at(5.0, 1024)
    lr_large, _ = schedule.at(5.0, 4096)
    assert lr_large == pytest.approx(4 * lr_small)
    assert schedule.at(2.0, 4096)[0] == pytest.approx(0.1 * 4096 / 256)  # peak at the end of warmup
    assert schedule.peak(4096) == pytest.approx(1.6)
    assert schedule.at(5.0, 4096)[1] is None  # weight decay untouched by default
    o.wd_follows_lr = True
    lr, wd_factor = LRSchedule.from_config(o, 10).at(5.0, 4096)
    assert wd_factor == pytest.approx(lr / 1.6)
    o.base_lr = 0.2  # optim.base_lr, the LR's one home
    assert LRSchedule.from_config(o, 10).peak(4096) == pytest.approx(3.2)
