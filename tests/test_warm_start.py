"""``init.weights`` (dstrain/techniques/warm_start.py): the state dicts users hold load as data, what
does not fit is named and keeps the model's own initialisation, what is not weights is refused."""

from __future__ import annotations

import pytest
import torch

from dstrain.core.errors import ConfigError
from dstrain.techniques import warm_start
from dstrain.techniques.models import build_model


def small(num_classes: int = 10) -> torch.nn.Module:
    return build_model("resnet_small", num_classes, in_channels=1, width=8)


@pytest.fixture
def trained(tmp_path):
    torch.manual_seed(1)
    model = small()
    return model, model.state_dict()


@pytest.mark.parametrize(
    "wrap",
    ["plain", "deepspeed", "timm", "lightning", "ddp prefix", "compiled prefix"],
)
def test_the_state_dicts_users_hold_load_whole(wrap, trained, tmp_path):
    model, state = trained
    saved = {
        "plain": state,
        "deepspeed": {"module": state, "buffer_names": ["x"], "ds_version": "0.19"},
        "timm": {"epoch": 3, "arch": "resnet", "state_dict": state},
        "lightning": {"epoch": 3, "model": state},
        "ddp prefix": {f"module.{k}": v for k, v in state.items()},
        "compiled prefix": {f"_orig_mod.{k}": v for k, v in state.items()},
    }[wrap]
    torch.save(saved, tmp_path / "w.pt")
    fresh = small()
    found = warm_start.load(fresh, tmp_path / "w.pt", "resnet_small", strict=True)
    assert found.complete and len(found.loaded) == found.total == len(state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key
    line = warm_start.describe(found, "w.pt")
    assert line == f"w.pt: {len(state)} of the model's {len(state)} tensors loaded"


def test_a_new_head_keeps_its_own_initialisation_and_is_named(trained, tmp_path):
    _, state = trained
    half = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    torch.save(half, tmp_path / "w.pt")  # FP16 weights, as an FP16 run's module states hold them
    torch.manual_seed(2)
    fresh = small(num_classes=4)
    head = fresh.fc.weight.detach().clone()
    found = warm_start.load(fresh, tmp_path / "w.pt", "resnet_small")
    assert found.mismatched == (("fc.weight", (10, 32), (4, 32)), ("fc.bias", (10,), (4,)))
    assert len(found.loaded) == len(state) - 2 and not found.missing and not found.unexpected
    assert torch.equal(fresh.fc.weight, head)  # not loaded: the model's own initialisation
    conv = fresh.stem[0].weight
    assert conv.dtype == torch.float32 and torch.equal(conv, state["stem.0.weight"].half().float())
    line = warm_start.describe(found, "w.pt")
    assert "54 of the model's 56 tensors loaded" in line
    assert "fc.weight (file [10, 32], model [4, 32]), fc.bias (file [10], model [4])" in line
    with pytest.raises(ConfigError, match=r"init.strict=true .*\(shape differs: fc.weight"):
        warm_start.load(small(num_classes=4), tmp_path / "w.pt", "resnet_small", strict=True)


def test_torchvisions_own_weights_fit_its_model_by_name(tmp_path):
    import torchvision

    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "tv.pt")  # 1000 classes
    found = warm_start.load(build_model("resnet18", 3), tmp_path / "tv.pt", "resnet18")
    assert [k for k, _, _ in found.mismatched] == ["fc.weight", "fc.bias"]
    assert len(found.loaded) == found.total - 2 and not found.missing and not found.unexpected


@pytest.mark.parametrize(
    "content, expected",
    [
        ([1, 2, 3], "holds no state dict of tensors, so it is not weights"),
        ({}, "holds no state dict of tensors"),
        ({"epoch": 3, "optimizer": {"lr": 0.1}}, "holds no state dict of tensors"),
        ({"encoder.w": torch.zeros(3)}, "none of its tensors fits model.name=resnet_small"),
        ({"fc.bias": torch.zeros(7)}, "none of its tensors fits"),
    ],
    ids=["a list", "empty", "no tensors", "another network", "only a wrong shape"],
)
def test_what_is_not_these_weights_is_refused_in_one_line(content, expected, tmp_path):
    torch.save(content, tmp_path / "w.pt")
    fresh = small()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        warm_start.load(fresh, tmp_path / "w.pt", "resnet_small")
    message = str(err.value)
    assert message.startswith(f"init.weights={tmp_path / 'w.pt'}: ") and expected in message
    assert "\n" not in message
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


class Planted:
    def __reduce__(self):
        return (print, ("ran",))


def test_a_file_naming_code_is_refused_unrun(tmp_path, capsys):
    torch.save({"fc.bias": Planted()}, tmp_path / "w.pt")
    with pytest.raises(ConfigError, match=r"^init.weights: .*w.pt: refused: unpickling it would"):
        warm_start.read_weights(tmp_path / "w.pt")
    assert "ran" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="a directory; name a weights file"):
        warm_start.read_weights(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        warm_start.read_weights(tmp_path / "none.pt")
