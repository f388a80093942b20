"""The gradient noise scale (dstrain/techniques/noise_scale.py) against the truth: on a tiny FP64
model its estimates of |G|² and tr(Σ) are those of the per-example gradients over the same images,
whatever the accumulation, the loss scale and the micro-batch order; what cannot be measured says so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dstrain.techniques.noise_scale import (
    Averages,
    GradientNoise,
    estimates,
    plan_line,
    unmeasurable,
)


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def data(n: int = 12):
    """Images whose labels lean to class 0: a mean gradient clearly above the noise (|G|² > 0)."""
    g = torch.Generator().manual_seed(1)
    y = torch.where(torch.rand(n, generator=g) < 0.75, 0, torch.randint(0, 3, (n,), generator=g))
    return torch.randn(n, 5, generator=g, dtype=torch.float64), y


def per_example_truth(model: nn.Module, x, y) -> tuple[float, float]:
    """Unbiased |G|² and tr(Σ) from each image's own gradient: tr(Σ) the sample covariance's trace
    (Bessel), |G|² the squared mean gradient less tr(Σ)/N."""
    grads = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    g = torch.stack(grads)
    mean = g.mean(0)
    trace = ((g - mean) ** 2).sum(1).sum().item() / (len(g) - 1)
    return mean.square().sum().item() - trace / len(g), trace


def measure(model, x, y, micro: int, ranks: int = 1, loss_scale: float = 1.0) -> dict:
    """One optimizer step as the trainer takes it: each rank's micro batches' losses divided by the
    accumulation (DeepSpeed) and multiplied by ``loss_scale`` (the scaler), backward accumulating,
    the ranks' gradients averaged, then the window; ``ranks`` emulated one after the other."""
    n = len(x)
    accumulation = n // (micro * ranks)
    noises, summed = [], None
    for rank in range(ranks):
        noise = GradientNoise(model.parameters(), 0.0, torch.device("cpu"))
        noise.stage(micro, accumulation, ranks)
        noise.begin_step(1)
        model.zero_grad()
        for k in range(accumulation):
            lo = (rank * accumulation + k) * micro
            loss = nn.functional.cross_entropy(model(x[lo : lo + micro]), y[lo : lo + micro])
            (loss / accumulation * loss_scale).backward()
            noise.micro_batch_done(accumulation / loss_scale)
        noise.close()  # the next emulated rank's backward is not this one's
        grads = [p.grad.clone() for p in model.parameters()]
        summed = grads if summed is None else [a + b for a, b in zip(summed, grads, strict=True)]
        noises.append(noise)
    for p, g in zip(model.parameters(), summed, strict=True):  # the all-reduce's average
        p.grad = g / ranks
    for noise in noises:
        noise.step_done(1 / loss_scale)
    # the window's all-reduce, by hand: the ranks' sums added (its steps count each rank's)
    noises[0]._window = sum(noise._window for noise in noises)
    return noises[0].window_values(None)


def test_micro_batches_of_one_image_give_the_per_example_truth():
    model = tiny()
    x, y = data(12)
    grad_sq, trace = per_example_truth(model, x, y)
    assert grad_sq > 0 and trace > 0
    got = measure(model, x, y, micro=1)
    assert got["noise_b_small"] == 1 and got["noise_b_big"] == 12
    assert got["noise_grad_sq"] == pytest.approx(grad_sq, rel=1e-10)
    assert got["noise_trace"] == pytest.approx(trace, rel=1e-10)
    assert got["noise_scale"] == pytest.approx(trace / grad_sq, rel=1e-10)


def test_ranks_accumulation_and_the_loss_scale_do_not_change_it():
    """The same 12 images as 1 rank x 6 micro batches of 2, 3 ranks x 2, 6 ranks x 1, and under
    a loss scale of 2**16: the same estimates (the micro batches' norms are each one's own)."""
    model = tiny()
    x, y = data(12)
    one = measure(model, x, y, micro=2)
    for ranks, scale in ((3, 1.0), (6, 1.0), (1, 2.0**16)):
        other = measure(model, x, y, micro=2, ranks=ranks, loss_scale=scale)
        for key in ("noise_grad_sq", "noise_trace", "noise_scale"):
            assert other[key] == pytest.approx(one[key], rel=1e-9), (ranks, scale, key)


def test_a_step_with_an_overflow_is_left_out_and_hooks_leave_with_the_step():
    model = tiny()
    x, y = data(4)
    noise = GradientNoise(model.parameters(), 0.0, torch.device("cpu"), every_steps=2)
    noise.stage(2, 2, 1)
    noise.begin_step(1)  # not a measured step: no hooks on the parameters
    assert not noise.active and not noise._handles
    noise.begin_step(2)
    assert noise.active and len(noise._handles) == 4
    nn.functional.cross_entropy(model(x[:2]), y[:2]).backward()
    noise.micro_batch_done(float("inf"))  # an FP16 overflow: a non-finite norm
    noise.step_done(1.0)
    assert not noise._handles and noise.window_values(None) == {}  # nothing measured


def test_the_estimators_and_their_averages():
    # E|G_B|^2 = |G|^2 + tr/B: exact inputs give the exact parts back
    grad_sq, trace = estimates(8, 2.0 + 40.0 / 8, 64, 2.0 + 40.0 / 64)
    assert (grad_sq, trace) == (pytest.approx(2.0), pytest.approx(40.0))
    a = Averages()
    assert a.noise_scale() is None
    a.update(2.0, 40.0, steps=3, decay=0.5)  # bias-corrected: the first window is itself
    assert a.grad_sq / a.weight == pytest.approx(2.0) and a.noise_scale() == pytest.approx(20.0)
    a.update(-1.0, 10.0, steps=1, decay=0.5)
    assert a.grad_sq == pytest.approx(0.5 * 0.875 * 2.0 + 0.5 * -1.0)
    b = Averages()
    b.update(-1.0, 10.0, steps=1, decay=0.5)
    assert b.noise_scale() is None  # |G|^2 not yet above 0: no value rather than a negative one
    c = Averages()
    c.update(2.0, -0.5, steps=1, decay=0.5)
    assert c.noise_scale() is None  # tr(Σ) below resolution: no value, rather than B_noise < 0
    assert c.trace == pytest.approx(-0.5 * 0.5)  # the part itself is kept for the history


def test_what_cannot_be_measured_says_why():
    assert "one rank and one micro batch" in unmeasurable(1, 1, False)
    assert unmeasurable(1, 2, False) == unmeasurable(2, 1, False) == ""
    assert "lossy compressed" in unmeasurable(4, 1, True) and unmeasurable(4, 2, True) == ""
    from dstrain.settings.ramp import BatchStage

    stages = [BatchStage(0, 64, 16, 2), BatchStage(2, 128, 16, 4)]
    line = plan_line(True, 4, {}, False, stages, 2)
    assert line.startswith("B_noise every 4 step(s)")
    assert "from epoch 1: B_small 16 (a micro batch) vs B_big 64 (the global batch)" in line
    assert plan_line(False, 4, {}, False, stages, 2) == "off (log.noise_scale=false)"
    assert "BF16_Optimizer" in plan_line(True, 4, {"bf16": {"enabled": True}}, False, stages, 2)
    assert "ZeRO" in plan_line(True, 4, {"zero_optimization": {"stage": 2}}, False, stages, 2)
    single = [BatchStage(0, 64, 64, 1)]
    assert plan_line(True, 4, {}, False, single, 1).startswith("not measured: one rank")
    # BN groups: a rank's gradient carries its group's other images through the shared statistics
    grouped = plan_line(True, 4, {}, False, stages, 2, bn_group=2)
    assert grouped.startswith("not measured: model.bn_group=2: BN statistics shared"), grouped


def test_the_loss_scale_in_force_is_read_without_a_host_sync():
    from types import SimpleNamespace

    from dstrain.techniques.loss_scaling import scale_in_force

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # its scale tensor exists once it has scaled a loss
    autocast = SimpleNamespace(torch_autocast_z0_gradscaler=scaler, optimizer=None)
    got = scale_in_force(autocast)
    assert isinstance(got, torch.Tensor) and got.item() == 1024.0
    config = SimpleNamespace(cur_scale=65536.0, use_grad_scaling=True)  # the native fp16 engine
    native = SimpleNamespace(optimizer=SimpleNamespace(loss_scale_config=config))
    assert scale_in_force(native) == 65536.0
    assert scale_in_force(SimpleNamespace(optimizer=object())) == 1.0  # FP32, BF16


# ---------------------------------------------------------------- batch.follow_noise
def test_the_batch_grows_in_whole_micro_batches_up_to_the_cap():
    from dstrain.settings.ramp import BatchStage, grown

    stage = BatchStage(0, 32, 16, 2)
    assert grown(stage, 2.0, 1024, 1) == 64 and grown(stage, 1.5, 1024, 1) == 48
    assert grown(stage, 2.0, 40, 1) is None  # 40 holds no larger whole batch of 16
    assert grown(BatchStage(0, 64, 16, 2), 1.5, 1024, 2) == 96  # 3 x (16 x 2 ranks)
    assert grown(BatchStage(0, 64, 16, 2), 1.25, 1024, 2) is None  # 80 -> 64: units of 32
    assert grown(BatchStage(0, 64, 16, 2), 2.0, 1024, 2) == 128
    # the LR moves from the old batch's to the new one's over the rewarm epochs
    ramp = BatchStage(2, 64, 16, 4, lr_from=32, lr_ramp_epochs=1.0)
    assert [ramp.lr_batch(t) for t in (2.0, 2.5, 3.0, 7.0)] == [32, 48, 64, 64]
    assert BatchStage(2, 64, 16, 4).lr_batch(2.0) == 64


def ramp_trainer(noise_scale: float, epochs: int = 5, switches=()):
    from types import SimpleNamespace

    from dstrain.settings.ramp import BatchStage
    from dstrain.techniques.noise_scale import NoiseRamp

    noise = GradientNoise([], 0.9, torch.device("cpu"))
    noise.averages = Averages(grad_sq=1.0, trace=noise_scale, weight=1.0, steps=4)
    state = SimpleNamespace(batch_switches=[list(s) for s in switches])
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(epochs=epochs), stages=[BatchStage(0, 32, 16, 2)], state=state
    )
    return trainer, NoiseRamp(noise, 2.0, 128, 0.5)


def test_the_batch_follows_the_noise_scale_and_a_resume_rebuilds_it():
    trainer, ramp = ramp_trainer(noise_scale=40.0)
    ramp.epoch_end(trainer, 0, {})  # B_noise 40 >= 32: 64 from epoch 2 (0-based 1)
    ramp.epoch_end(trainer, 1, {})  # 40 < 64: stays
    assert trainer.state.batch_switches == [[1, 64, 40.0]]
    last = trainer.stages[-1]
    assert (last.epoch, last.global_size, last.accumulation) == (1, 64, 4)
    assert (last.lr_from, last.lr_ramp_epochs) == (32, 0.5)
    trainer.stages[-1:] = []
    ramp.noise.averages.trace = 1000.0
    ramp.epoch_end(trainer, 4, {})  # the last epoch: nothing after it to switch
    assert trainer.state.batch_switches == [[1, 64, 40.0]]
    resumed, again = ramp_trainer(noise_scale=40.0, switches=[[1, 64, 40.0], [3, 128, 200.0]])
    again.fit_start(resumed)
    assert [(s.epoch, s.global_size, s.lr_from) for s in resumed.stages] == [
        (0, 32, 0),
        (1, 64, 32),
        (3, 128, 64),
    ]


def test_a_resume_keeps_following_the_noise_on_ranks_that_divide_its_batches():
    from dstrain.core.errors import ConfigError
    from dstrain.run.compat import check_batch_switches
    from dstrain.settings.config import load_config

    switches = [[1, 64, 40.0]]
    on = load_config(
        None,
        ["batch.global_size=32", "batch.micro_per_rank=16", "batch.follow_noise=true"]
        + ["batch.noise_cap=128"],
    )
    check_batch_switches(on, 1, switches)
    check_batch_switches(on, 2, switches)  # 64 = 2 x 16 x 2
    with pytest.raises(ConfigError, match="resume it with batch.follow_noise=true"):
        check_batch_switches(load_config(None, ["batch.micro_per_rank=16"]), 1, switches)
    with pytest.raises(ConfigError, match="not whole micro batches of 16 on 2 ranks"):
        check_batch_switches(on, 2, [[1, 48, 50.0]])


def test_the_progress_line_puts_the_batch_beside_b_noise(tmp_path, caplog):
    """The line a user watches says how far past B_noise the batch is (McCandlish's B/B_noise)."""
    import logging

    from dstrain.loop.monitor import Monitor, Progress

    monitor = Monitor(tmp_path, enabled=True, tensorboard=False)
    values = {"loss": 0.5, "lr": 1.0, "global_batch": 4096, "images_per_sec": 100.0}
    with caplog.at_level(logging.INFO):
        monitor.step(10, Progress(0, 90, 10, 13), {**values, "noise_scale": 425.0})
        monitor.step(11, Progress(0, 90, 11, 13), {**values, "noise_scale": None})
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("img/s  B_noise 425 (batch/B_noise 9.64)")
    assert lines[1].endswith("img/s")  # not measured yet: nothing said
