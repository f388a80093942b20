"""The Trainer driven in this process, no subprocess or launcher: set-up phases, epochs, ramp, stop signal."""

from __future__ import annotations

import json
import math
import os
import re
import signal

import pytest
import torch

from dstrain.core import dist
from dstrain.core.errors import Preempted
from dstrain.core.hooks import Hook, Hooks
from dstrain.loop import fault, final_polish
from dstrain.loop.mlperf import events
from dstrain.loop.monitor import StepMeter
from dstrain.loop.target import TargetStop
from dstrain.run import startup, train
from dstrain.run.plan import prepare
from dstrain.settings.config import load_config
from tests.conftest import REPO, TINY
from tests.test_mlperf import values

pytestmark = pytest.mark.oldest  # ./run.sh test-oldest runs this module on torch 2.11
# @pytest.mark.gpu: a trainer built here trains on cuda:0 on a GPU node (dist.device()), in
# its CUDA precisions, GradScaler, cuDNN, inductor's GPU code; the GPU pass (-m gpu) runs these


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo process group of one rank in this process, for this module's tests (DeepSpeed caches its groups:
    one group, taken down after the last test), and the environment as it was."""
    import deepspeed

    saved = dict(os.environ)
    dist.setup_env_for_single_process()  # a world of one, as `python -m dstrain` makes it
    dist.skip_shm_op()  # as dist.init_process_group does on CPU ranks
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def make_trainer(fake_fmnist, tmp_path, *overrides, ds="fp32", cuda=None):
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
    path = ds if ds.endswith(".json") else str(REPO / "ds_configs" / f"{ds}.json")
    plan = prepare(cfg, path, cuda=cuda)
    signals = fault.StopSignals()
    start = startup.check(plan, torch.device("cpu"))  # the run's start-up checks, as it makes them
    trainer = train.build_trainer(plan, start, signals)
    return trainer, plan


class Recorder(Hook):
    """Every event the loop sends, in order; ends training at ``stop_at`` (an eval_end)."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[tuple] = []
        self.stop_at = stop_at

    def fit_start(self, trainer) -> bool:
        self.events.append(("fit_start", trainer.state.epoch))
        return False

    def epoch_start(self, trainer, epoch):
        self.events.append(("epoch_start", epoch))

    def train_end(self, trainer, epoch):
        self.events.append(("train_end", epoch))

    def eval_start(self, trainer, epoch):
        self.events.append(("eval_start", epoch))

    def eval_end(self, trainer, epoch, metrics):
        self.events.append(("eval_end", epoch, round(metrics["val_top1"], 6)))
        return epoch == self.stop_at

    def epoch_end(self, trainer, epoch, metrics):
        self.events.append(("epoch_end", epoch, "val_top1" in metrics))

    def step_end(self, trainer, step):
        self.events.append(("step_end", step))

    def log_window(self, trainer, step):
        self.events.append(("log_window", step))

    def checkpoint_files(self, trainer):
        self.events.append(("checkpoint_files", trainer.state.epoch))
        return {"recorder.pt": {"epoch": trainer.state.epoch}}

    def fit_end(self, trainer, completed):
        self.events.append(("fit_end", completed))

    def summary(self, trainer):
        return {"recorded": len(self.events)}


@pytest.mark.slow  # a 2-epoch run in process: the full suite only
def test_a_hook_hears_the_loop_and_can_end_it(fake_fmnist, tmp_path, world_of_one):
    """Issue 53, item 2: what rides on the loop is a hook (dstrain/core/hooks.py). A hook hears every
    event in order, with the evaluated metrics; its eval_end ends training (the checkpoint of that
    epoch is written, as for target_top1); its summary lands in summary.json. The loop's module
    names none of the concerns that now ride on it."""
    trainer, plan = make_trainer(
        fake_fmnist, tmp_path, "epochs=3", "eval_every_epochs=2", "log.every_steps=8"
    )
    recorder = Recorder(stop_at=1)
    trainer.hooks = Hooks([*trainer.hooks, recorder])
    trainer.fit()
    events = recorder.events
    names = [e[0] for e in events if e[0] not in ("log_window", "step_end")]
    assert names == [
        "fit_start",
        # epoch 1: no evaluation (every 2); a checkpoint (every epoch) holds the hook's file
        *["epoch_start", "train_end", "epoch_end", "checkpoint_files"],
        *["epoch_start", "train_end", "eval_start", "eval_end", "epoch_end", "checkpoint_files"],
        "fit_end",
    ]
    assert [e[1] for e in events if e[0] == "step_end"] == list(range(1, 33))
    saved = trainer.checkpoint_root / "epoch0002" / "recorder.pt"
    assert torch.load(saved, weights_only=True) == {"epoch": 2}
    assert ("epoch_end", 0, False) in events and ("epoch_end", 1, True) in events
    assert events[-1] == ("fit_end", True) and trainer.state.epoch == 2  # ended after epoch 2
    assert [e[1] for e in events if e[0] == "log_window"] == [8, 16, 24, 32]  # 16 steps an epoch
    assert (trainer.checkpoint_root / "latest").read_text().strip() == "epoch0002"
    summary = trainer.summary(world=1, precision=plan.spec.precision)
    assert summary["recorded"] == len(events) and summary["final_top1_epoch"] == 2
    source = (REPO / "dstrain" / "loop" / "trainer.py").read_text().lower()
    assert not re.search(r"mlperf|lars_tensors|target_top1|tensor_stats", source)


@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
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
    # TINY: peak 0.2 (lr_scaling none), cosine to end_lr_factor 0: the last step's LR is 0
    assert [h["peak_lr"] for h in state.history] == [0.2, 0.2]
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert (trainer.checkpoint_root / "latest").read_text().strip() == "epoch0002"
    summary = trainer.summary(world=1, precision=plan.spec.precision)
    assert summary["steps"] == 24 and summary["global_batch"] == 64 and summary["final_top1"] > 0.1


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_fill_trains_every_epoch_on_its_whole_data_set_across_a_ramp(
    fake_fmnist, tmp_path, world_of_one
):
    """data.last_batch=fill (issue 74, item 1): 512 images at batch 96 (6 steps, the sixth
    completed from epoch 2's order), then at 64 (the 448 left, 7 steps): 2 epochs are 1,024
    images, where drop trains 992 (5 x 96 + 8 x 64). The plan says so, the history and the train state count it,
    and the loader's batches of each epoch hold every image of that epoch's order once."""
    ramp = ("epochs=2", "batch.global_size=96", "batch.ramp=[[1,64]]", "batch.micro_per_rank=32")
    trainer, plan = make_trainer(fake_fmnist, tmp_path, *ramp, "data.last_batch=fill")
    lines = startup.stage_lines(plan, 512, trainer.schedule)
    assert "5.33 steps/epoch (data.last_batch=fill" in lines[0] and "8 steps/epoch" in lines[1]
    assert lines[-1].startswith("13 optimizer steps")
    trainer.fit()
    state = trainer.state
    assert [h["steps_per_epoch"] for h in state.history] == [6, 7]
    assert (state.step, state.train_images) == (13, 1024)
    loader, order = trainer.data.train, []
    for epoch, stage in enumerate(trainer.stages):
        loader.start_epoch(
            epoch, accumulation=stage.accumulation, offset=trainer.epoch_offset(epoch)
        )
        order += [i for batch in loader.batches() for i in batch.tolist()]
    assert trainer.epoch_offset(1) == 64 and sorted(order) == sorted(list(range(512)) * 2)
    dropping, plan = make_trainer(fake_fmnist, tmp_path / "drop", *ramp)  # 5 x 96 + 8 x 64 = 992
    lines = startup.stage_lines(plan, 512, dropping.schedule)
    assert "5 steps/epoch" in lines[0] and "8 steps/epoch" in lines[1]
    assert dropping.epoch_offset(1) == 0


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_a_run_with_the_shipped_muon_json_trains_through_deepspeed(
    fake_fmnist, tmp_path, world_of_one
):
    """ds_configs/muon_fp32.json through the trainer (DeepSpeed's engine steps the client
    optimizer, channels_last filters): the loss falls and every filter moved as a matrix."""
    trainer, plan = make_trainer(
        fake_fmnist,
        tmp_path,
        "epochs=2",
        "optim.lr_scaling=none",
        "optim.base_lr=0.1",
        "model.channels_last=true",
        ds="muon_fp32",
    )
    assert plan.spec.optimizer.kind == "muon"
    before = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    trainer.fit()
    history = trainer.state.history
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    for name, p in trainer.engine.module.named_parameters():
        assert not torch.equal(p, before[name]), name
    optimizer = trainer.optimizer
    filters = [p for g in optimizer.param_groups if g["muon"] for p in g["params"]]
    assert filters and all(
        optimizer.state[p]["momentum_buffer"].shape == (p.shape[0], p[0].numel()) for p in filters
    )


@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_a_resume_steps_with_the_settings_it_was_given_and_the_state_it_saved(
    fake_fmnist, tmp_path, world_of_one
):
    """Momentum and weight decay changed at resume (the resume check allows it): torch's
    load_state_dict would keep the checkpoint's values; the run steps with the new ones, from the
    saved momentum buffers, and says so."""
    from dstrain.loop import checkpoint

    first, _ = make_trainer(fake_fmnist, tmp_path / "a", "epochs=1")
    first.fit()
    tag = "epoch0001"
    saved = {
        id(p): first.optimizer.state[p]["momentum_buffer"].clone()
        for p in first.engine.module.parameters()
    }
    changed = json.loads((REPO / "ds_configs/fp32.json").read_text())
    changed["optimizer"]["params"].update(momentum=0.5, weight_decay=1e-3)
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(changed))
    again, _ = make_trainer(fake_fmnist, tmp_path / "b", "epochs=2", ds=str(path))
    checkpoint.load(again.engine, first.checkpoint_root, tag)
    groups = again.optimizer.param_groups  # load_state_dict replaces the list
    assert [g["momentum"] for g in groups] == [0.5, 0.5]
    assert [g["weight_decay"] for g in groups] == [1e-3, 0.0]  # BN/bias: none, as built
    assert "initial_weight_decay" not in groups[0] or groups[0]["initial_weight_decay"] == 1e-3
    loaded = [again.optimizer.state[p]["momentum_buffer"] for p in again.engine.module.parameters()]
    assert all(torch.equal(b, s) for b, s in zip(loaded, saved.values()))


@pytest.mark.gpu
def test_a_stop_signal_ends_the_epoch_after_the_step_in_flight(fake_fmnist, tmp_path, world_of_one):
    trainer, _ = make_trainer(fake_fmnist, tmp_path, "epochs=1")
    trainer.checks.signals.signum = (
        signal.SIGTERM
    )  # as if the handler had run during the first step
    assert trainer.train_epoch(0, trainer.stages[0]) is None
    assert trainer.state.step == trainer.state.epoch_step == 1
    loss_sum, top1, top5, n = trainer.state.epoch_sums
    assert n == 32 and 0 <= top1 <= top5 <= n and loss_sum > 0
    with pytest.raises(
        Preempted, match=r"stopped by SIGTERM after global step 1 \(step 1 of epoch 1\)"
    ):
        trainer.stop_with_checkpoint("epoch0000-step00000001", 0)
    assert (trainer.checkpoint_root / "epoch0000-step00000001" / "trainer_state.json").is_file()
    assert dist.world_size() == 1


# ---------------------------------------------------------------- precision, communication, torch versions
def _one_step(trainer):
    """One optimizer step of the first batch, as train_epoch takes it."""
    stage = trainer.stages[0]
    trainer.start_loader(0, stage, 0)
    x, y = next(iter(trainer.data.train))
    meter = StepMeter(trainer.device, 1, None)
    trainer.train_micro_batch(x, y, True, meter, 1)
    trainer.state.step += 1
    trainer.after_step()


@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_fp16_autocast_skips_overflowing_steps_counts_them_and_halves_the_scale(
    fake_fmnist, tmp_path, world_of_one, caplog
):
    """ds_configs/fp16.json (torch_autocast float16, GradScaler in the engine) runs on the CPU too:
    an overflow skips the step (weights unchanged), the skip is counted and logged with the scale."""
    trainer, plan = make_trainer(fake_fmnist, tmp_path, "epochs=1", "log.every_steps=1", ds="fp16")
    assert plan.spec.precision == "autocast-float16" and trainer.input_dtype == torch.float32
    scaler = trainer.engine.torch_autocast_z0_gradscaler
    scaler._init_scale = 2.0**40  # GradScaler(init_scale=2**40): no FP16 gradient survives it
    before = [p.detach().clone() for p in trainer.engine.module.parameters()]
    _one_step(trainer)
    after = list(trainer.engine.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step moved the weights"
    assert trainer.checks.skips.total == 1 and scaler.get_scale() == 2.0**39
    scaler.update(2.0**30)
    with caplog.at_level("INFO"):
        metrics = trainer.train_epoch(0, trainer.stages[0])
    skipped = trainer.checks.skips.total - 1
    # GradScaler halves the scale once per skipped step (it grows only after 2000 clean ones)
    assert 0 < skipped < 16 and scaler.get_scale() == 2.0 ** (30 - skipped)
    assert trainer.steps_taken.taken == 16 - skipped  # 512 images / 32
    assert "FP16 gradient overflow, step skipped" in caplog.text
    assert f"scale {2.0 ** (30 - skipped):g}" in caplog.text
    assert math.isfinite(metrics["train_loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "clean steps must train"


# torch's GradScaler.step reads found_inf on the host once a step (a bare AMP loop makes the same wait)
GRADSCALER_READ = "torch/amp/grad_scaler.py"


@pytest.mark.gpu
@pytest.mark.parametrize("ds", ["fp32", "bf16", "fp16", "lars_bf16", "lamb_bf16"])
def test_a_training_step_makes_no_host_synchronisation(fake_fmnist, tmp_path, world_of_one, ds):
    """Between log lines a step never waits for the device (tests/host_syncs.py counts what would):
    DeepSpeed's throughput timer synchronised twice a step (off in the engine config now), so the
    host could not queue the next step while the GPU ran (issue 50: 3-4 ms a step behind the bare
    loop on the H100). FP16 autocast keeps the one read a bare AMP loop makes too."""
    from tests.host_syncs import HostSyncs

    trainer, _ = make_trainer(fake_fmnist, tmp_path, "epochs=1", "log.every_steps=1000", ds=ds)
    stage = trainer.stages[0]
    trainer.start_loader(0, stage, 0)
    batches, meter = iter(trainer.data.train), StepMeter(trainer.device, 1000, None)

    def step():
        x, y = next(batches)
        trainer.set_lr(0.1, stage.global_size)
        trainer.train_micro_batch(x, y, True, meter, 1)
        trainer.state.step += 1
        assert trainer.after_step() == ""

    step()  # the first step builds state (momentum buffers, the scaler's per-device copies)
    steps = 3
    with HostSyncs() as syncs:
        for _ in range(steps):
            step()
    scaler_reads = sum(n for site, n in syncs.sites.items() if site.startswith(GRADSCALER_READ))
    assert scaler_reads == (steps if ds == "fp16" else 0)
    assert syncs.total() == scaler_reads, f"host synchronisations in a step: {dict(syncs.sites)}"


@pytest.mark.gpu
def test_the_sync_counter_sees_reads_and_waits():
    """The counter the test above relies on: each kind it names is counted, with its line."""
    from deepspeed.accelerator import get_accelerator

    from tests.host_syncs import HostSyncs

    t = torch.ones(3)
    with HostSyncs() as syncs:
        t.sum().item()
        bool(t.sum() > 0)
        t.tolist()
        t.to("cpu")
        t.to(t.device)  # a variable target: the model's device on a GPU node, not counted
        get_accelerator().synchronize()
    assert syncs.total() == 5
    assert all(site.startswith("tests/test_trainer.py:") for site in syncs.sites)


def _fc_update(trainer) -> torch.Tensor:
    """How much one optimizer step moves the classifier's weights (FP32)."""
    fc = [m for m in trainer.engine.module.modules() if isinstance(m, torch.nn.Linear)][-1]
    before = fc.weight.detach().float().clone()
    _one_step(trainer)
    return fc.weight.detach().float() - before


@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 53: the quick loop under 1 minute)
def test_native_fp16_engine_updates_as_fp32_does_and_reports_its_scale(
    fake_fmnist, tmp_path, world_of_one, caplog, monkeypatch
):
    """ds_configs/fp16_native.json: DeepSpeed 0.19's engine.backward leaves the loss unscaled with
    ZeRO 0 while its wrapper divides the gradients by the scale (65,536) in step(), so ResNet-50's
    weights did not move on the H100. dstrain multiplies the loss itself (dstrain/techniques/loss_scaling.py):
    one step moves the weights as FP32 does. Run here on the CPU (the engine runs FP16 on gloo),
    with the GPU check answered yes. Fails if the workaround goes, and if a DeepSpeed that scales
    by itself is installed (the scale applied twice: every step overflows)."""
    from dstrain.techniques.loss_scaling import backward_multiplier, loss_scale_of

    # 64 images: the epoch below, FP16 on a CPU, only has to print a progress line (2 steps)
    overrides = ("epochs=1", "optim.warmup_epochs=0", "optim.base_lr=0.1", "log.every_steps=1")
    overrides += ("data.limit_train=64",)
    reference = _fc_update(make_trainer(fake_fmnist, tmp_path / "fp32", *overrides)[0])
    # DeepSpeed's CPU accelerator refuses FP16 where oneDNN has no FP16 kernels for the CPU
    # (AVX512-FP16/AMX; this session's AMD EPYC lacks them): the math runs anyway
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)
    trainer, plan = make_trainer(
        fake_fmnist, tmp_path / "fp16", *overrides, ds="fp16_native", cuda=True
    )
    assert plan.spec.precision == "fp16" and trainer.input_dtype == torch.float16
    assert backward_multiplier(trainer.engine)() == loss_scale_of(trainer.engine) == 2.0**16
    update = _fc_update(trainer)
    assert trainer.checks.skips.total == 0, "the scaled loss overflowed: scaled twice?"
    # FP16 activations and gradients: the same step within FP16's rounding, not 65,536x smaller
    assert torch.linalg.norm(update - reference) < 0.05 * torch.linalg.norm(reference)
    with caplog.at_level("INFO"):
        trainer.train_epoch(0, trainer.stages[0])
    assert " scale 65536" in caplog.text  # the progress line shows the native engine's scale


@pytest.mark.gpu
def test_engines_that_scale_the_loss_themselves_get_no_second_multiply(
    fake_fmnist, tmp_path, world_of_one
):
    from dstrain.techniques.loss_scaling import backward_multiplier, loss_scale_of

    for ds, scale in (("fp32", None), ("fp16", 2.0**16)):
        trainer, _ = make_trainer(fake_fmnist, tmp_path / ds, "epochs=1", ds=ds)
        assert backward_multiplier(trainer.engine) is None
        assert loss_scale_of(trainer.engine) == scale


@pytest.mark.gpu
@pytest.mark.parametrize("ds, wire", [("bf16", torch.float32), ("bf16_comm_bf16", torch.bfloat16)])
def test_gradient_communication_dtype_is_what_the_json_says(
    fake_fmnist, tmp_path, world_of_one, monkeypatch, ds, wire
):
    """communication_data_type puts bf16 on the wire (half the bytes), seen at DeepSpeed's all-reduce."""
    import deepspeed.comm

    trainer, _ = make_trainer(fake_fmnist, tmp_path, "epochs=1", ds=ds)
    trainer.engine.enable_backward_allreduce = (
        True  # one rank: dstrain skips it, turn it on to look
    )
    sent = []
    real = deepspeed.comm.all_reduce

    def spy(tensor, *args, **kwargs):
        sent.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(deepspeed.comm, "all_reduce", spy)
    _one_step(trainer)
    grads = sum(p.numel() for p in trainer.engine.module.parameters())
    assert sent and {dtype for dtype, _ in sent} == {wire}
    assert sum(n for _, n in sent) == grads * (2 if wire == torch.bfloat16 else 4)


@pytest.mark.gpu
def test_training_runs_on_a_torch_without_the_public_set_timeout(
    fake_fmnist, tmp_path, world_of_one, monkeypatch, caplog
):
    """torch 2.11 has no torch.distributed.set_timeout (the GPU image a first run died on)."""
    assert dist.set_timeout_everywhere(600) >= 1
    monkeypatch.delattr(torch.distributed, "set_timeout", raising=False)
    assert dist.set_timeout_everywhere(600) >= 1  # through ProcessGroup.set_timeout, as 2.11 has it
    monkeypatch.delattr(torch.distributed.ProcessGroup, "set_timeout")
    with caplog.at_level("WARNING"):
        assert dist.set_timeout_everywhere(600) == 0
        trainer, _ = make_trainer(fake_fmnist, tmp_path, "epochs=1")
    assert "cannot change a process group's timeout" in caplog.text
    assert trainer.train_epoch(0, trainer.stages[0])["train_loss"] > 0


def test_fused_lamb_with_channels_last_is_refused_before_anything_starts(fake_fmnist, tmp_path):
    import json

    from dstrain.core.errors import ConfigError

    raw = json.loads((REPO / "ds_configs" / "lamb_fp32.json").read_text())
    raw["optimizer"]["type"] = "FusedLamb"
    path = tmp_path / "fused.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(TINY[1], [*TINY[2:], "model.channels_last=true", f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ConfigError, match=r"fused.json: optimizer type FusedLamb .* \"Lamb\""):
        prepare(cfg, str(path))
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- torch.compile
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_compiled_training_composes_with_ramp_eval_checkpoints_and_resume(
    fake_fmnist, tmp_path, world_of_one, caplog
):
    """model.compile=true: no new graphs when the ramp changes accumulation or in a second epoch,
    checkpoint keys as uncompiled, and a compiled run's checkpoint resumes uncompiled and back;
    with a BN span throughout (compiled, refit, resumed). What it checks is dynamo's and the
    module's (graphs, recompiles, state-dict keys), so it traces with aot_eager: inductor's code
    generation costs ~70 s of CPU here on a cold machine and is tested by the compiled tests below
    and test_bn_span's."""
    from dstrain.techniques.models import compiled_graphs

    common = ["batch.micro_per_rank=32", "polish.enabled=true", "model.bn_span=16"]
    common += ["model.compile_backend=aot_eager"]
    plain, _ = make_trainer(fake_fmnist, tmp_path, "epochs=1", *common)  # run 1: uncompiled
    plain.fit()
    keys = set(plain.engine.module.state_dict())
    ramp = ["batch.ramp=[[2,64]]"]  # accumulation 1 -> 2 inside the compiled run
    with caplog.at_level("INFO"):  # run 2: compiled, resumes run 1's checkpoint
        compiled, _ = make_trainer(
            fake_fmnist, tmp_path, "epochs=3", "model.compile=true", "resume=auto", *ramp, *common
        )
        assert compiled.state.epoch == 1
        compiled.fit()
    assert set(compiled.engine.module.state_dict()) == keys  # no _orig_mod. prefix
    assert "torch.compile: first step" in caplog.text and "torch.compile: evaluation" in caplog.text
    assert "torch.compile: aot_eager, mode default" in caplog.text
    epochs = compiled.state.history
    assert [h["global_batch"] for h in epochs] == [32, 32, 64]
    graphs = compiled_graphs()
    compiled.state.epoch = 2  # one epoch more: every shape and mode has been seen
    compiled.cfg.epochs = 3
    compiled.fit()
    assert compiled_graphs() == graphs, "a repeated epoch recompiled"
    assert epochs[-1]["val_top1"] > 0.1
    saved = {k: v.clone() for k, v in compiled.engine.module.state_dict().items()}
    polished = final_polish.polish(compiled, tmp_path / "run")  # BN refit, compiled module
    assert polished["after"]["val_top1"] > 0.1 and polished["images"] > 0
    resumed, _ = make_trainer(fake_fmnist, tmp_path, "epochs=4", "resume=auto", *ramp, *common)
    assert resumed.state.epoch == 3
    for (name, a), b in zip(saved.items(), resumed.engine.module.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
@pytest.mark.parametrize(
    "ds, comm",
    [("lamb_bf16", {"compression": "sign", "warmup_steps": 0}), ("lars_fp16", None)],
    ids=["lamb-bf16-sign", "lars-fp16autocast"],
)
def test_compiled_training_composes_with_channels_last_precision_optimizers_and_comm(
    fake_fmnist, tmp_path, world_of_one, ds, comm
):
    """model.compile=true with NHWC, bf16 / fp16 autocast (GradScaler), LAMB / LARS and, for one, our
    compressed all-reduce and a BN span: it trains, and a second epoch with evaluation builds no
    new graph. Inductor on a GPU for both; on a CPU for the bf16 one (the BN span's graph), while
    the fp16-autocast one traces the same graphs with aot_eager (inductor's C++ build of it took
    ~60 s of CPU, and fp16 autocast is a GPU recipe: its inductor build is the GPU pass's) on half
    the training images."""
    import json

    from dstrain.techniques.models import compiled_graphs

    raw = json.loads((REPO / "ds_configs" / f"{ds}.json").read_text())
    if comm:
        raw["dstrain_communication"] = {"mode": "allreduce", "bucket_mb": 25, **comm}
    path = tmp_path / f"{ds}.json"
    path.write_text(json.dumps(raw))
    trainer, _ = make_trainer(
        fake_fmnist,
        tmp_path,
        "epochs=2",
        "model.compile=true",
        "model.channels_last=true",
        "optim.base_lr=0.01" if ds.startswith("lamb") else "optim.base_lr=2.0",
        *(["model.bn_span=8"] if comm else []),
        # the fp16-autocast case on a CPU: aot_eager, and 8 steps an epoch (FP16 is slow there;
        # measured: the loss 2.30 then 2.11, top-1 0.39)
        *(
            []
            if comm or torch.cuda.is_available()
            else ["model.compile_backend=aot_eager", "data.limit_train=256"]
        ),
        ds=str(path),
    )
    assert trainer.memory_format == torch.channels_last
    assert (trainer.grad_sync is not None) == bool(comm)
    spans = {
        getattr(m, "span", 0)
        for m in trainer.engine.module.modules()
        if "BatchNorm" in type(m).__name__
    }
    assert spans == ({8} if comm else {0})
    stage = trainer.stages[0]
    first = trainer.train_epoch(0, stage)
    trainer.evaluate()
    graphs = compiled_graphs()
    second = trainer.train_epoch(1, stage)
    metrics = trainer.evaluate()
    assert compiled_graphs() == graphs, "the second epoch recompiled"
    assert second["train_loss"] < first["train_loss"] and metrics["val_top1"] > 0.2


@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_the_trainers_first_step_after_a_ramp_switch_averages_exactly_the_new_batch(
    fake_fmnist, tmp_path, world_of_one, monkeypatch
):
    """The trainer's own loop (tests/test_ramp.py drives DeepSpeed by hand): at the first optimizer
    step after the switch from 32 to 64 images (2 micro batches of 32), the gradient the optimizer
    receives is the mean gradient of exactly those 64 images, computed here independently on a
    fresh copy of the weights (on the trainer's device), and not the last micro batch's alone."""
    import torch.nn.functional as F

    from dstrain.techniques.models import model_from_config

    # on a GPU, FP32 convolutions (cuDNN's TF32 default would differ by ~1e-3 between the two)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    trainer, _ = make_trainer(
        fake_fmnist,
        tmp_path,
        "epochs=2",
        "batch.ramp=[[1,64]]",
        "batch.micro_per_rank=32",
        "optim.label_smoothing=0",
    )
    trainer.train_epoch(0, trainer.enter_stage(0))
    device = trainer.device
    fresh = model_from_config(trainer.cfg.model).to(device)
    fresh.load_state_dict(trainer.engine.module.state_dict())
    stage = trainer.enter_stage(1)
    assert (stage.global_size, stage.accumulation) == (64, 2)
    loader = trainer.data.train
    loader.start_epoch(1, accumulation=2)
    batches = iter(loader)
    # what the first step of epoch 2 will read
    micro = [tuple(t.to(device) for t in next(batches)) for _ in range(2)]
    params = list(trainer.engine.module.parameters())
    seen, step = [], trainer.engine.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append([p.grad.detach().clone() for p in params])
        return step(*args, **kwargs)

    trainer.engine.optimizer.step = recording_step
    trainer.train_epoch(1, stage)
    assert len(seen) == 512 // 64  # one optimizer step per 64 images
    fresh.train()
    for x, y in micro:
        (F.cross_entropy(fresh(x), y) / 2).backward()
    for p, got in zip(fresh.parameters(), seen[0]):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6)
    last_only = model_from_config(trainer.cfg.model).to(device)
    last_only.load_state_dict(fresh.state_dict())
    last_only.train()
    F.cross_entropy(last_only(micro[1][0]), micro[1][1]).backward()
    apart = max(float((a.grad - b).abs().max()) for a, b in zip(last_only.parameters(), seen[0]))
    assert apart > 1e-3  # the check can tell one micro batch from two


# ---------------------------------------------- MLPerf log and target (the checker: tests/test_mlperf.py)
@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_target_top1_ends_training_and_a_resume_trains_no_more(fake_fmnist, tmp_path, world_of_one):
    """The first evaluation at or above target_top1 ends the run there (its checkpoint written), in
    the summary and the MLPerf log as success; a resumed run trains nothing more."""
    pytest.importorskip("mlperf_logging", reason="log.mlperf needs mlperf-logging")
    over = ("target_top1=0.05", "eval_every_epochs=2", "log.mlperf=true")
    trainer, run_plan = make_trainer(fake_fmnist, tmp_path, *over)
    trainer.fit()
    target = next(hook for hook in trainer.hooks if isinstance(hook, TargetStop))
    assert target.reached == 2 and trainer.state.epoch == 2  # of 3: evaluated at 2
    assert "target_epoch" not in trainer.state.state_dict()  # TargetStop's, not the loop's
    assert (trainer.checkpoint_root / "latest").read_text().strip() == "epoch0002"
    summary = trainer.summary(world=1, precision=run_plan.spec.precision)
    assert summary["target_epoch"] == 2 and summary["epochs"] == 2
    log = events(tmp_path / "run" / "mlperf.log")
    assert [e["metadata"]["epoch_num"] for e in log if e["key"] == "eval_accuracy"] == [2]
    assert log[-1]["key"] == "run_stop" and log[-1]["metadata"]["status"] == "success"
    trainer.hooks.close()

    again, _ = make_trainer(fake_fmnist, tmp_path, *over, "resume=auto")
    again.fit()
    assert again.state.epoch == 2 and again.state.step == trainer.state.step
    assert (tmp_path / "run" / "mlperf-2.log").is_file()  # one log per attempt, none overwritten
    assert events(tmp_path / "run" / "mlperf.log") == log
    again.hooks.close()


@pytest.mark.gpu
@pytest.mark.slow  # over ~5 s on 2 cores: the full suite only (issue 42: quick loop < 3 min)
def test_the_mlperf_log_holds_the_values_the_run_uses(
    fake_fmnist, tmp_path, world_of_one, monkeypatch
):
    """Keys in MLPerf's order (init, submission, hyperparameters, run, epochs with their
    evaluations, run_stop), values resolved from the run: the peak LR after the scaling rule, the
    end LR, the decay's steps, BN over the micro batch; call sites as repository paths."""
    pytest.importorskip("mlperf_logging", reason="log.mlperf needs mlperf-logging")
    monkeypatch.setenv("DSTRAIN_CACHE_CLEARED", "1")  # as ./launch.sh --drop-caches sets it
    trainer, _ = make_trainer(
        fake_fmnist,
        tmp_path,
        "log.mlperf=true",
        "optim.lr_scaling=linear",
        "optim.base_lr=0.1",  # per 256 images: 0.0125 at batch 32
        "optim.decay=poly",
        "optim.end_lr=0.0001",
        "eval_every_epochs=2",
    )
    trainer.fit()
    trainer.hooks.close()
    log = events(tmp_path / "run" / "mlperf.log")
    keys = [e["key"] for e in log]
    assert keys[0] == "init_start" and keys[-1] == "run_stop"
    assert keys.index("init_stop") < keys.index("run_start") < keys.index("epoch_start")
    got = values(log)
    assert got["submission_benchmark"] == "resnet" and got["submission_division"] == "open"
    device = "CPU" if trainer.device.type == "cpu" else torch.cuda.get_device_name(trainer.device)
    assert got["submission_platform"] == f"1x{device}" and got["cache_clear"] is True
    assert got["opt_name"] == "sgd" and got["global_batch_size"] == 32
    assert got["sgd_opt_base_learning_rate"] == pytest.approx(0.0125)
    assert got["sgd_opt_end_learning_rate"] == 0.0001
    assert got["sgd_opt_learning_rate_decay_poly_power"] == 2.0
    assert got["sgd_opt_learning_rate_decay_steps"] == round(2.75 * 512 / 32)  # after warmup
    assert got["model_bn_span"] == 32 and got["train_samples"] == 512
    # on MLPerf's grid alone (every 2 epochs here): the last epoch, 3, is off it and not evaluated
    assert [e["metadata"]["epoch_num"] for e in log if e["key"] == "eval_accuracy"] == [2]
    # the run's set-up (train.py) and the loop's marks (mlperf.py's MLPerfMarks, a loop hook)
    assert {e["metadata"]["file"] for e in log} <= {
        "dstrain/run/train.py",
        "dstrain/loop/mlperf.py",
    }
    assert log[-1]["metadata"]["status"] == "aborted"  # no quality target: not MLPerf's success


def test_the_train_state_round_trips_through_its_state_dict_and_refuses_unknown_keys():
    """What a checkpoint keeps is TrainState.state_dict() (plain values, copied); load_state_dict
    takes it back, keeps defaults for keys an older dstrain did not write, refuses unknown ones."""
    from dstrain.core.errors import ConfigError
    from dstrain.loop.trainer import TrainState

    state = TrainState(epoch=3, step=42, best_top1=0.5, history=[{"epoch": 1, "top1": 0.4}])
    saved = state.state_dict()
    saved["history"].append({"epoch": 2})  # a copy: the live state is not changed through it
    assert len(state.history) == 1 and json.loads(json.dumps(saved)) == saved
    back = TrainState()
    back.load_state_dict(state.state_dict())
    assert back == state
    with pytest.raises(ConfigError, match=r"\['lr_sched'\].*newer dstrain"):
        TrainState().load_state_dict({**state.state_dict(), "lr_sched": 1})
    # a checkpoint from before TargetStop kept its own file: its key is read there, not refused
    old = TrainState()
    old.load_state_dict({**state.state_dict(), "target_epoch": 2})
    assert old == state


def test_how_the_run_uses_its_directory_is_found_before_building_creates_it(
    fake_fmnist, tmp_path, world_of_one
):
    """The plan line the run logs after building says what the checks found: a new directory
    is "(new)", although building has created it by then."""
    cfg = load_config(
        TINY[1],
        [
            *TINY[2:],
            f"data.root={fake_fmnist}",
            f"run_dir={tmp_path / 'run'}",
            "log.tensorboard=false",
        ],
    )
    start = startup.check(prepare(cfg, str(REPO / "ds_configs/fp32.json")), torch.device("cpu"))
    (tmp_path / "run").mkdir()  # what building does next
    assert start.run_dir_use == f"{tmp_path / 'run'} (new)"
    assert startup.run_dir_use(tmp_path / "run", None).endswith("(exists; empty)")


# ---------------------------------------------- the loop knows only training (issue 5)
def test_the_hooks_are_typed_by_the_events_the_trainer_calls():
    """LoopHook (dstrain/core/hooks.py) lists exactly the events dstrain calls on its hooks; every
    hook dstrain builds has each of them, and a stand-in lacking some is refused when the hooks
    are put together, naming what it lacks (not when the loop first calls it)."""
    from types import SimpleNamespace

    from dstrain.core.hooks import EVENTS, LoopHook
    from dstrain.loop.mlperf import MLPerfLog, MLPerfMarks
    from dstrain.techniques.ema import EMAHook
    from dstrain.techniques.lars import LARSLog

    called = set()
    for path in (REPO / "dstrain").rglob("*.py"):
        called |= set(re.findall(r"\b(?:self|trainer)\.hooks\.(\w+)", path.read_text()))
    assert called == set(EVENTS)
    built = [MLPerfMarks(MLPerfLog(False)), TargetStop(0.5), LARSLog(), EMAHook(SimpleNamespace())]
    assert all(isinstance(hook, LoopHook) for hook in built)
    assert list(Hooks(built)) == built

    class Partial:
        def fit_start(self, trainer) -> bool:
            return False

    with pytest.raises(TypeError, match="Partial is not a loop hook: it lacks epoch_start, "):
        Hooks([Recorder(), Partial()])


def test_the_loop_module_names_no_technique_that_rides_on_it():
    """Final Polishing is dstrain/loop/final_polish.py, LARS's trust ratios its hook's, the quality
    target TargetStop's (its own state): the Trainer and its TrainState name none of them."""
    from dstrain.loop.trainer import Trainer, TrainState

    source = (REPO / "dstrain" / "loop" / "trainer.py").read_text()
    code = "\n".join(line.split("#")[0] for line in source.splitlines())  # comments may name them
    assert not re.search(r"bn_refit|polish_batch|trust|target_top1|TargetStop|mlperf", code)
    assert not {"polish", "refit", "trust_summary"} & set(vars(Trainer))
    assert "target_epoch" not in TrainState().state_dict()
    assert callable(final_polish.polish) and callable(final_polish.refit)


def test_target_stop_keeps_its_own_state_and_reads_an_old_checkpoints_key(tmp_path):
    """TargetStop's reached epoch is its own: saved as its file in each checkpoint and read back on
    resume; a checkpoint written before that file existed holds it as the train state's
    target_epoch, which is read too (and not refused by the train state)."""
    from types import SimpleNamespace

    from dstrain.loop.target import TARGET_FILE
    from dstrain.loop.trainer import TrainState

    trainer = SimpleNamespace(checks=SimpleNamespace(last_checkpoint=None))
    stop = TargetStop(0.5)
    assert stop.fit_start(trainer) is False and stop.reached == 0
    assert not stop.eval_end(trainer, 0, {"val_top1": 0.4}) and stop.reached == 0
    assert stop.eval_end(trainer, 1, {"val_top1": 0.6}) and stop.reached == 2
    new = tmp_path / "checkpoints" / "epoch0002"
    new.mkdir(parents=True)
    for name, payload in stop.checkpoint_files(trainer).items():
        torch.save(payload, new / name)  # as checkpoint.save writes the hooks' files
    (new / "trainer_state.json").write_text(json.dumps(TrainState(epoch=2).state_dict()))
    assert (new / TARGET_FILE).is_file()
    old = tmp_path / "checkpoints" / "epoch0003"
    old.mkdir()
    state = {**TrainState(epoch=3).state_dict(), "target_epoch": 3}  # before issue 5
    (old / "trainer_state.json").write_text(json.dumps(state))
    for ckpt, epoch in ((new, 2), (old, 3)):
        trainer.checks.last_checkpoint = ckpt
        resumed = TargetStop(0.5)
        assert resumed.fit_start(trainer) is True and resumed.reached == epoch  # nothing to train
        assert resumed.summary(trainer) == {"target_top1": 0.5, "target_epoch": epoch}
    TrainState().load_state_dict(state)  # the old key is not a newer dstrain's


def test_lars_trust_ratios_ride_on_lars_own_hook(fake_fmnist):
    """LARS's min/median/max trust ratios reach the log line through its hook (LARSLog's
    window_values), which the run adds for a LARS optimizer only."""
    from dstrain.loop.mlperf import MLPerfLog
    from dstrain.run.train import loop_hooks
    from dstrain.techniques.lars import LARS, LARSLog

    cfg = load_config(TINY[1], [*TINY[2:], f"data.root={fake_fmnist}"])
    weight = torch.nn.Parameter(torch.ones(3, 2))
    lars = LARS([{"params": [weight]}], lr=0.1)
    sgd = torch.optim.SGD([weight], lr=0.1)
    assert not any(isinstance(h, LARSLog) for h in loop_hooks(cfg, MLPerfLog(False), sgd))
    hooks = loop_hooks(cfg, MLPerfLog(False), lars)
    (hook,) = [h for h in hooks if isinstance(h, LARSLog)]
    trainer = type("T", (), {"optimizer": lars})()
    assert hooks.window_values(trainer) == {}  # before a step: nothing to report
    weight.grad = torch.ones(3, 2)
    lars.step()
    got = hooks.window_values(trainer)
    assert set(got) == {"trust_min", "trust_median", "trust_max"} and got["trust_median"] > 0
