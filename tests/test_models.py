"""Model-side helpers of the precision and compile paths (dstrain/techniques/models.py)."""

import pytest
import torch

from dstrain.techniques.models import build_model, keep_batchnorm_fp32

pytestmark = pytest.mark.oldest


@pytest.mark.parametrize(
    "fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"]
)
def test_native_fp16_model_keeps_batchnorm_fp32_and_runs_in_both_layouts(fmt):
    """As after DeepSpeed's native fp16 engine cast every parameter to FP16 (buffers stay FP32): the
    NCHW backward then failed on a GPU ("Expected running_mean to have type Half but got Float")."""
    model = build_model("resnet_small", 10, in_channels=3, width=8)
    params_before = {id(p) for p in model.parameters()}
    for p in model.parameters():  # DeepSpeed 0.19: parameters only
        p.data = p.data.half()
    n = keep_batchnorm_fp32(model)
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert n == len(bns) > 0
    assert all(m.weight.dtype == m.running_mean.dtype == torch.float32 for m in bns)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(m.weight.dtype == torch.float16 for m in convs)
    assert {id(p) for p in model.parameters()} == params_before  # the engine's masters still map
    model.to(memory_format=fmt)
    x = torch.randn(4, 3, 16, 16, dtype=torch.float16).to(memory_format=fmt)
    loss = torch.nn.functional.cross_entropy(model(x).float(), torch.arange(4))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.weight.grad.dtype == torch.float32 for m in bns)
