"""Per-layer SQNR that verify shows (qlint.advice.layer_outputs)."""

import math

import torch
from torch import nn

from qlint.advice.layer_outputs import compare_layer_outputs


def _pair(poison: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    other.load_state_dict(reference.state_dict())
    with torch.no_grad():
        other[2].weight.add_(0.01)
        if poison:
            other[0].bias[1] = math.nan
    return reference, other


def test_a_layer_with_nan_outputs_has_no_sqnr_rather_than_zero_db():
    reference, other = _pair(poison=True)
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sqnr = compare_layer_outputs(reference, other, ["0", "2"], batches, lambda m, b: m(b), {})
    assert "0" not in sqnr and "2" not in sqnr  # NaN flows into both layers' outputs
    clean = compare_layer_outputs(*_pair(poison=False), ["0", "2"], batches, lambda m, b: m(b), {})
    assert clean["0"] == 200.0  # identical layer: the cap, a measured number
    assert 0.0 < clean["2"] < 200.0
