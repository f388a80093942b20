"""The EMA of the weights (dstrain/techniques/ema.py): its arithmetic against an FP64 reference, and
a run that evaluates, checkpoints, resumes bit for bit and polishes it."""

import json

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from dstrain.settings.config import EMAConfig
from dstrain.techniques.ema import EMA_FILE, WeightEMA, decay_at
from tests.conftest import TINY, run_cli


def _cfg(**kw) -> EMAConfig:
    return OmegaConf.structured(EMAConfig(**kw))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))


def test_the_decay_is_timms_counted_in_updates():
    """timm's ModelEmaV3.get_decay with update_after_step 0: 0 at the first update, then the decay,
    or 1 - (1 + t/gamma)^-power up to it."""
    plain = _cfg(decay=0.999)
    assert [decay_at(t, plain) for t in range(3)] == [0.0, 0.999, 0.999]
    warm = _cfg(decay=0.999, warmup=True, warmup_gamma=1.0, warmup_power=0.75)
    assert decay_at(1, warm) == pytest.approx(1 - 2**-0.75)
    assert decay_at(10, warm) == pytest.approx(1 - 11**-0.75)
    assert decay_at(10**6, warm) == 0.999  # capped at the decay
    gamma = _cfg(decay=0.99, warmup=True, warmup_gamma=4.0, warmup_power=2 / 3)
    assert decay_at(8, gamma) == pytest.approx(1 - 3 ** (-2 / 3))


def _run_cfg(**ema):
    """The trainer's config with ``optim.ema`` set (what dstrain/run/train.py's weight_ema reads)."""
    from dstrain.settings.config import TrainConfig

    cfg = OmegaConf.structured(TrainConfig)
    for key, value in ema.items():
        cfg.optim.ema[key] = value
    return cfg


# the model's device: cuda where there is one (the GPU pass), else skipped with why
MODEL_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("model_device", MODEL_DEVICES)
@pytest.mark.parametrize("placement", ["model", "cpu"])
def test_the_average_matches_an_fp64_reference(placement, model_device):
    """optim.ema.device: the average kept on the model's device or on the CPU (weights copied over
    at each update), built by the run's own weight_ema; either way FP32 and equal to an FP64
    reference of timm's formula."""
    from dstrain.run.train import weight_ema

    cfg = _cfg(decay=0.9, warmup=True, warmup_gamma=2.0, warmup_power=0.75, device=placement)
    model = _net().to(model_device)
    ema = weight_ema(_run_cfg(**cfg), model, torch.device(model_device))
    kept = model_device if placement == "model" else "cpu"
    assert {t.device.type for t in ema.module.state_dict().values()} == {kept}
    reference = {k: v.double().cpu().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    for t in range(6):
        with torch.no_grad():  # the weights and BN statistics move as training would move them
            for p in list(model.parameters()) + [model[1].running_mean, model[1].running_var]:
                p.add_(torch.randn(p.shape, generator=g).to(model_device))
            model[1].num_batches_tracked.add_(1)
        used = ema.update(model)
        d = 0.0 if t == 0 else min(0.9, 1 - (1 + t / 2.0) ** -0.75)
        assert used == pytest.approx(d, abs=1e-15)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                reference[k] = d * reference[k] + (1 - d) * v.double().cpu()
            else:
                reference[k] = v.cpu().clone()  # integer buffers are copied
    got = ema.module.state_dict()
    assert {v.device.type for v in got.values()} == {kept}  # updates keep it where it was put
    got = {k: v.cpu() for k, v in got.items()}
    for k, v in reference.items():
        if v.is_floating_point():
            assert got[k].dtype == torch.float32
            torch.testing.assert_close(got[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)
        else:
            assert torch.equal(got[k], v), k
    assert ema.updates == 6
    # ema.pt's payload (CPU tensors) round-trips exactly
    assert {v.device.type for v in ema.state_dict()["module"].values()} == {"cpu"}
    again = WeightEMA(_net(), cfg, "cpu")
    again.load_state_dict(ema.state_dict())
    assert again.updates == 6
    for k, v in again.module.state_dict().items():
        assert torch.equal(v, got[k]), k


@pytest.mark.parametrize("placement", ["model", "cpu"])
def test_the_average_is_kept_where_optim_ema_device_says(placement):
    """weight_ema puts the average on the model's device (``model``) or on the CPU (``cpu``). Checked
    without a GPU: PyTorch's ``meta`` device stands for the model's accelerator."""
    from dstrain.run.train import weight_ema

    assert weight_ema(_run_cfg(decay=0.0, device=placement), _net(), torch.device("meta")) is None
    ema = weight_ema(_run_cfg(decay=0.9, device=placement), _net(), torch.device("meta"))
    kept = "meta" if placement == "model" else "cpu"
    assert {t.device.type for t in ema.module.state_dict().values()} == {kept}


def test_the_average_is_fp32_whatever_the_model_holds():
    model = _net().to(torch.bfloat16)
    ema = WeightEMA(model, _cfg(decay=0.5), "cpu")
    assert all(p.dtype == torch.float32 for p in ema.module.parameters())
    assert not any(p.requires_grad for p in ema.module.parameters())
    ema.update(model)
    ema.update(model)
    for mine, theirs in zip(ema.module.parameters(), model.parameters()):
        assert torch.equal(mine, theirs.float())


EMA_RUN = [*TINY, "optim.ema.decay=0.9", "optim.ema.warmup=true", "checkpoint.every_epochs=1"]


@pytest.mark.gpu  # on cuda:0 where there is one (TINY: deterministic cuDNN, so bit for bit)
@pytest.mark.slow
def test_a_run_evaluates_checkpoints_resumes_and_polishes_its_ema(fake_fmnist, tmp_path):
    """The EMA top-1 beside the trained model's in the history, TensorBoard and summary.json; ema.pt
    in every checkpoint, the same bit for bit after a kill at step 21 and a resume; the refit of the
    EMA in polished_ema/ and summary.json."""
    common = [*EMA_RUN, f"data.root={fake_fmnist}", "polish.enabled=true", "polish.images=256"]
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    done = run_cli(common + [f"run_dir={straight}"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "EMA of the weights: decay 0.9 (timm's warmup" in done.stdout
    killed = run_cli(common + [f"run_dir={broken}"], env={"DSTRAIN_FAULT_KILL_AT_STEP": "21"})
    assert killed.returncode == -9
    resumed = run_cli(common + [f"run_dir={broken}", "resume=auto"])
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "EMA: resumed from" in resumed.stdout

    def ema_state(run_dir):
        tag = (run_dir / "checkpoints" / "latest").read_text().strip()
        return torch.load(run_dir / "checkpoints" / tag / EMA_FILE, weights_only=True)

    a, b = ema_state(straight), ema_state(broken)
    assert a["updates"] == b["updates"] == 48  # 3 epochs of 16 steps
    for key, value in a["module"].items():
        assert torch.equal(value, b["module"][key]), key
    sa = json.loads((straight / "summary.json").read_text())
    sb = json.loads((broken / "summary.json").read_text())
    assert sa["ema"] == sb["ema"] and sa["ema"]["updates"] == 48
    assert [h["val_top1_ema"] for h in sa["history"]] == [h["val_top1_ema"] for h in sb["history"]]
    assert sa["ema"]["final_top1"] == sa["history"][-1]["val_top1_ema"]
    assert sa["polish_ema"]["before"]["val_top1"] == sa["ema"]["final_top1"]
    assert sa["polish_ema"]["images"] == 256
    for key in ("before", "after", "top1_gain"):  # not its timings
        assert sa["polish_ema"][key] == sb["polish_ema"][key], key
    polished = json.loads((straight / "polished_ema" / "polish.json").read_text())
    assert polished["weights"] == "ema"
    refit = torch.load(straight / "polished_ema" / "model.pt", weights_only=True)
    # the refit changed the EMA's BN statistics and nothing else
    assert not torch.equal(refit["stem.1.running_mean"], a["module"]["stem.1.running_mean"])
    assert torch.equal(refit["fc.weight"], a["module"]["fc.weight"])
    # the polish command takes either weights: the EMA's refit equals the one the run made
    command = run_cli(
        ["--checkpoint", str(straight), "--weights", "ema", "--force", "polish.images=256"],
        module="dstrain.polish",
    )
    assert command.returncode == 0, command.stderr[-2000:]
    again = json.loads((straight / "polished_ema" / "polish.json").read_text())
    assert again["weights"] == "ema" and again["after"] == sa["polish_ema"]["after"]
    assert again["before"] == sa["polish_ema"]["before"]
    # a run without optim.ema: test_cli_errors' test_polish_refuses_a_checkpoint_it_cannot_use
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(straight / "tb"))
    events.Reload()
    assert len(events.Scalars("epoch/val_top1_ema")) == 3
    assert "polish/val_top1_ema_after" in events.Tags()["scalars"]


def test_the_disk_check_counts_the_average_in_each_checkpoint():
    from dstrain.run.rundir import checkpoint_bytes

    model = _net()
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert checkpoint_bytes(model, "fp32", ema=True) - checkpoint_bytes(model, "fp32") == (
        params + buffers
    )
