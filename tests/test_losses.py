import pytest
import torch

from dstrain.techniques.losses import smoothed_cross_entropy


@pytest.mark.parametrize("s", [0.0, 0.1, 0.5])
def test_label_smoothing_matches_the_target_formula(s):
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [0.1, 0.2, 0.3, 3.0], [-2.0, 1.0, 1.0, 0.0]])
    y = torch.tensor([0, 3, 1])
    k = logits.shape[1]
    target = (1 - s) * torch.nn.functional.one_hot(y, k).double() + s / k
    expected = -(target * torch.log_softmax(logits.double(), dim=1)).sum(1).mean()
    assert smoothed_cross_entropy(logits, y, s).item() == pytest.approx(expected.item(), rel=1e-6)


def test_low_precision_logits_are_scored_in_fp32():
    logits = torch.randn(4, 10).bfloat16()
    y = torch.arange(4)
    assert smoothed_cross_entropy(logits, y, 0.1).dtype == torch.float32
