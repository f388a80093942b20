"""Batch-size ramp: the plan, its errors, and DeepSpeed's accumulation boundary after a switch."""

import os
import subprocess
import sys
import textwrap

import pytest

from dstrain.core.dist import free_port
from dstrain.core.errors import ConfigError
from dstrain.settings.ramp import BatchStage, batch_at, batch_plan
from tests.conftest import CPU_ONLY, REPO


def test_plan_keeps_the_micro_batch_and_changes_accumulation():
    plan = batch_plan(1024, 0, [[5, 4096], [8, 8192]], world=4, epochs=10)
    assert plan == [
        BatchStage(0, 1024, 256, 1),
        BatchStage(5, 4096, 256, 4),
        BatchStage(8, 8192, 256, 8),
    ]
    assert [batch_at(e, plan).global_size for e in range(10)] == [1024] * 5 + [4096] * 3 + [
        8192
    ] * 2


def test_paper_style_ramp_with_epoch_zero_entry():
    assert batch_plan(1024, 128, [[0, 1024], [5, 4096]], world=2)[1] == BatchStage(5, 4096, 128, 16)


@pytest.mark.parametrize(
    "ramp, message",
    [
        ([[5, 4096], [3, 8192]], "epochs must increase strictly"),
        ([[0, 2048]], "disagrees with batch.global_size=1024"),
        ([[5, 4000]], "not a multiple of micro batch 256 x 4 ranks = 1024"),
        ([[5]], "must be [epoch, global_size]"),
        ([[12, 4096]], "never happens with epochs=10"),
        ([[2.5, 4096]], "two integers"),
    ],
)
def test_invalid_ramps_are_clear_errors(ramp, message):
    with pytest.raises(ConfigError) as err:
        batch_plan(1024, 0, ramp, world=4, epochs=10)
    assert message in str(err.value)


BOUNDARY_PROBE = textwrap.dedent("""
    import os, sys, torch, deepspeed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from dstrain.core.dist import skip_shm_op
    skip_shm_op()  # as dstrain does on CPU ranks: no JIT build of an op it never uses
    deepspeed.init_distributed(dist_backend="gloo")
    x = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    y = torch.randn(20, 1, generator=torch.Generator().manual_seed(2))
    for mode in ("driven", "deepspeed_counter"):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "gradient_clipping": 0.0}
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        def micro(i, boundary):
            if mode == "driven":
                engine.set_gradient_accumulation_boundary(boundary)
            loss = torch.nn.functional.mse_loss(engine(x[2 * i:2 * i + 2]), y[2 * i:2 * i + 2])
            engine.backward(loss)
            engine.step()
        for i in range(4):                  # stage 1: batch 2, four steps: the micro-step counter is now 4
            micro(i, True)
        w_before = model.weight.detach().clone()
        engine.set_train_batch_size(6)      # stage 2: batch 6 = 3 micro batches
        for i in range(4, 7):               # 4 is not a multiple of 3: DeepSpeed's counter would step after 2
            micro(i, i == 6)
        xs, ys = x[8:14], y[8:14]
        w = w_before.clone().requires_grad_(True)
        torch.nn.functional.mse_loss(xs @ w.t(), ys).backward()   # exact mean over the 6 new images
        expected = w_before - 1.0 * w.grad
        print(mode, "EXACT", torch.allclose(model.weight.detach(), expected, atol=1e-6))
""")


@pytest.fixture(scope="module")
def boundary_probe() -> str:
    """Both modes in one interpreter (one process start, not one per case)."""
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDARY_PROBE, str(free_port())],
        cwd=REPO,
        env={**os.environ, **CPU_ONLY},  # the engine on the CPU, with the probe's batches
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.xdist_group("ramp_probe")  # the cases on one pytest-xdist worker: the probe runs once
@pytest.mark.parametrize("mode, exact", [("driven", True), ("deepspeed_counter", False)])
def test_first_step_after_a_switch_averages_exactly_the_new_batch(mode, exact, boundary_probe):
    """Driving the boundary ourselves (as the trainer does) gives the exact step; DeepSpeed's counter does not.
    This shows why the trainer drives it; the trainer's own loop is checked by
    tests/test_trainer.py::test_the_trainers_first_step_after_a_ramp_switch_averages_exactly_the_new_batch."""
    assert f"{mode} EXACT {exact}" in boundary_probe.splitlines(), boundary_probe


@pytest.mark.parametrize(
    "global_size, ramp",
    [(64, []), (32, [[2, 64]]), (32, [[0, 32], [1, 64], [3, 128]]), (128, [[5, 256], [2, 64]])],
)
def test_the_ramp_rule_without_a_world_size_is_the_plans_rule(global_size, ramp):
    """compat's resume check reads a checkpoint's recorded ramp with ramp.global_size_at: the same
    global batch per epoch as the plan the run trained with (one rule, for any world size)."""
    from dstrain.settings.ramp import global_size_at

    stages = batch_plan(global_size, 16, sorted(ramp), world=2, epochs=8)
    for epoch in range(8):
        assert global_size_at(epoch, global_size, ramp) == batch_at(epoch, stages).global_size
