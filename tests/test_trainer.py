"""The Trainer driven in this process, no subprocess or launcher: set-up phases, epochs, ramp, stop signal."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dstrain import dist, fault, train
from dstrain.config import load_config
from dstrain.errors import Preempted
from tests.conftest import REPO, TINY


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process, for this module's tests (DeepSpeed caches its groups:
    one group, taken down after the last test), and the environment as it was."""
    import deepspeed

    saved = dict(os.environ)
    dist.setup_env_for_single_process()  # a world of one, as `python -m dstrain` makes it
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def make_trainer(fake_fmnist, tmp_path, *overrides):
    cfg = load_config(
        TINY[1],
        [
            *TINY[2:],
            f"data.root={fake_fmnist}",
            "data.download=false",
            f"run_dir={tmp_path / 'run'}",
            "log.tensorboard=false",
            *overrides,
        ],
    )
    plan = train.prepare(cfg, str(REPO / "ds_configs" / "fp32.json"))
    signals = fault.StopSignals()
    trainer = train.build_trainer(plan, tmp_path / "run", signals)
    return trainer, plan


def test_fit_follows_the_batch_plan_in_process(fake_fmnist, tmp_path, world_of_one):
    trainer, plan = make_trainer(
        fake_fmnist, tmp_path, "epochs=2", "batch.ramp=[[1,64]]", "batch.micro_per_rank=32"
    )
    assert [(s.global_size, s.accumulation) for s in plan.stages] == [(32, 1), (64, 2)]
    trainer.fit()
    state = trainer.state
    assert (state.epoch, state.step) == (2, 512 // 32 + 512 // 64)
    assert [h["global_batch"] for h in state.history] == [32, 64]
    assert trainer.engine.gradient_accumulation_steps() == 2
    assert state.history[-1]["train_loss"] < state.history[0]["train_loss"]
    last_lr = trainer.schedule.at(2.0, 64)[0]  # the last step lands on the end of the schedule
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(last_lr)
    assert (trainer.checkpoint_root / "latest").read_text().strip() == "epoch0002"
    summary = trainer.summary(world=1, precision=plan.spec.precision)
    assert summary["steps"] == 24 and summary["global_batch"] == 64 and summary["final_top1"] > 0.1


def test_a_stop_signal_ends_the_epoch_after_the_step_in_flight(fake_fmnist, tmp_path, world_of_one):
    trainer, _ = make_trainer(fake_fmnist, tmp_path, "epochs=1")
    trainer.checks.signals.signum = (
        signal.SIGTERM
    )  # as if the handler had run during the first step
    assert trainer.train_epoch(0, trainer.plan[0]) is None
    assert trainer.state.step == trainer.state.epoch_step == 1
    loss_sum, top1, top5, n = trainer.state.epoch_sums
    assert n == 32 and 0 <= top1 <= top5 <= n and loss_sum > 0
    with pytest.raises(
        Preempted, match=r"stopped by SIGTERM after global step 1 \(step 1 of epoch 1\)"
    ):
        trainer.stop_with_checkpoint("epoch0000-step00000001", 0)
    assert (trainer.checkpoint_root / "epoch0000-step00000001" / "trainer_state.json").is_file()
    assert dist.world_size() == 1
