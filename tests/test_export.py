"""``python -m dstrain.export``: a finished run's weights as a plain state dict that the model's own
builder loads (torchvision's, for a torchvision model), read as data, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.test_e2e import FOLDER

pytestmark = pytest.mark.slow  # a training run (the module's), then the command: the full suite


@pytest.fixture(scope="module")
def resnet18_run(jpeg_folder, tmp_path_factory) -> Path:
    """One epoch of torchvision's resnet18 on the 3-class JPEG folder, with the EMA of its weights."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    args = ["--deepspeed_config", "ds_configs/fp32.json", *FOLDER, "model.name=resnet18"]
    args += ["epochs=1", "optim.ema.decay=0.9", f"data.root={jpeg_folder}", f"run_dir={run_dir}"]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return run_dir


def export(*args: str):
    return run_cli(list(args), module="dstrain.export")


def test_an_exported_state_dict_loads_into_torchvisions_own_model(resnet18_run, tmp_path):
    import torchvision

    proc = export("--checkpoint", str(resnet18_run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    out = resnet18_run / "exported" / "trained.pt"
    assert info["out"] == str(out) and info["model"] == "resnet18"
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes, not 0600
    state = torch.load(out, weights_only=True)
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(state)  # strict: every key, every shape
    module = torch.load(
        resnet18_run / "checkpoints" / "epoch0001" / "mp_rank_00_model_states.pt",
        weights_only=True,
    )["module"]
    for key, value in module.items():
        assert torch.equal(state[key], value.float() if value.is_floating_point() else value), key
    # the EMA of the weights, beside them
    ema = export("--checkpoint", str(resnet18_run), "--weights", "ema")
    assert ema.returncode == 0, ema.stderr[-2000:]
    torchvision.models.resnet18(num_classes=3).load_state_dict(
        torch.load(resnet18_run / "exported" / "ema.pt", weights_only=True)
    )
    # kept unless --force; the default file is not overwritten by a second export
    before = out.read_bytes()
    again = export("--checkpoint", str(resnet18_run))
    assert again.returncode == 2 and "pass --force" in again.stderr and out.read_bytes() == before
    assert export("--checkpoint", str(resnet18_run), "--force").returncode == 0


def test_what_cannot_be_exported_is_one_line(resnet18_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(resnet18_run, run_dir)
    polished = export("--checkpoint", str(run_dir), "--weights", "polished")
    lines = [line for line in polished.stderr.splitlines() if line.startswith("dstrain.export:")]
    assert polished.returncode == 2 and len(lines) == 1, polished.stderr[-2000:]
    assert "python -m dstrain.polish --checkpoint" in lines[0]
    (run_dir / "polished").mkdir()
    torch.save([1, 2, 3], run_dir / "polished" / "model.pt")  # not a state dict
    bad = export(
        "--checkpoint", str(run_dir), "--weights", "polished", "--out", str(tmp_path / "x.pt")
    )
    assert bad.returncode == 2 and "holds no state dict of tensors" in bad.stderr
    assert not (tmp_path / "x.pt").exists()
    assert export("--checkpoint", str(tmp_path)).returncode == 2  # not a run directory
