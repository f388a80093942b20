"""A finished run's weights (dstrain/run/finished.py) through the commands users reach for first:
``python -m dstrain.export`` writes them as a plain state dict that the model's own builder loads
(torchvision's, for a torchvision model), atomically; ``python -m dstrain.evaluate`` gives the run's
own validation numbers on one rank and two; ``init.weights`` starts a new run from them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import deepspeed_launcher, run_cli
from tests.test_cli_errors import tree_digest
from tests.test_e2e import FOLDER

# a training run (the module's), then the commands: the full suite; on one pytest-xdist worker,
# which trains the run once (handed out one at a time, the tests trained it on both workers)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("finished_run")]


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


def evaluate(*args: str, launcher: list[str] | None = None):
    return run_cli(list(args), launcher, module="dstrain.evaluate", script="dstrain/evaluate.py")


def test_evaluate_gives_the_runs_own_numbers_on_one_rank_and_two(resnet18_run, tmp_path):
    last = json.loads((resnet18_run / "summary.json").read_text())["history"][-1]
    before = tree_digest(resnet18_run)
    one = evaluate("--checkpoint", str(resnet18_run))
    assert one.returncode == 0, one.stderr[-2000:]
    got = json.loads(one.stdout)  # stdout is the result alone; the log went to stderr
    assert (got["val_top1"], got["val_top5"], got["val_images"]) == (
        last["val_top1"],
        last["val_top5"],
        last["val_images"],
    )
    assert got["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert got["from"].endswith("epoch0001/mp_rank_00_model_states.pt") and got["world_size"] == 1
    ema = evaluate("--checkpoint", str(resnet18_run), "--weights", "ema")
    assert ema.returncode == 0, ema.stderr[-2000:]
    assert json.loads(ema.stdout)["val_top1"] == last["val_top1_ema"]
    out = tmp_path / "two.json"
    two = evaluate(
        "--checkpoint", str(resnet18_run), "--out", str(out), launcher=deepspeed_launcher(2)
    )
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    shared = json.loads(out.read_text())  # each rank its share, summed exactly
    assert shared["world_size"] == 2 and shared["val_images"] == last["val_images"]
    assert shared["val_top1"] == last["val_top1"]
    assert shared["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert tree_digest(resnet18_run) == before  # evaluating writes nothing in the run


def test_a_fine_tune_starts_from_given_weights_under_the_launcher(
    resnet18_run, jpeg_folder, tmp_path
):
    """ImageNet-shaped weights (a 1000-class head, as torchvision's) into a 3-class run on 2 ranks:
    every tensor but the head is loaded, the head is named and keeps its own initialisation."""
    exported = tmp_path / "w.pt"
    proc = run_cli(
        ["--checkpoint", str(resnet18_run), "--out", str(exported)], module="dstrain.export"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the exported file is what a recipe evaluates: the run's own top-1
    data = [*FOLDER, "model.name=resnet18", f"data.root={jpeg_folder}"]
    again = evaluate(*data, f"init.weights={exported}")
    assert again.returncode == 0, again.stderr[-2000:]
    last = json.loads((resnet18_run / "summary.json").read_text())["history"][-1]
    assert json.loads(again.stdout)["val_top1"] == last["val_top1"]
    state = torch.load(exported, weights_only=True)
    wide = {**state, "fc.weight": torch.zeros(1000, 512), "fc.bias": torch.zeros(1000)}
    torch.save({"epoch": 90, "state_dict": wide}, tmp_path / "imagenet.pt")  # timm's layout
    run_dir = tmp_path / "fine_tune"
    # an LR of 1e-9: the weights after one epoch are the ones loaded, to float32 rounding
    args = [*data, "epochs=1", "optim.base_lr=1e-9", f"init.weights={tmp_path / 'imagenet.pt'}"]
    tuned = run_cli(
        ["--deepspeed_config", "ds_configs/fp32.json", *args, f"run_dir={run_dir}"],
        launcher=deepspeed_launcher(2),
    )
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    plan = [line for line in tuned.stdout.splitlines() if " init " in line]
    assert len(plan) == 1, tuned.stdout[-3000:]
    assert f"{len(state) - 2} of the model's {len(state)} tensors loaded" in plan[0]
    assert (
        "fc.weight (file [1000, 512], model [3, 512]), fc.bias (file [1000], model [3])" in plan[0]
    )
    module = torch.load(
        run_dir / "checkpoints" / "epoch0001" / "mp_rank_00_model_states.pt", weights_only=True
    )["module"]
    import torchvision

    params = {name for name, _ in torchvision.models.resnet18().named_parameters()} - {
        "fc.weight",
        "fc.bias",
    }
    for name in params:  # loaded (the BN statistics moved with the new batches: not compared)
        assert torch.allclose(module[name], state[name], atol=1e-6), name
    assert not torch.allclose(module["fc.weight"], torch.zeros(3, 512))  # its own initialisation
