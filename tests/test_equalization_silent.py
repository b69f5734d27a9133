"""Equalization on channels the calibration never saw active, or that the next layer ignores.

qlint's equalization rescale gave an input channel of the next layer that was all zeros in
calibration (after a ReLU) its scale from the 1e-8 floor of its range: up to 4e4 on silero_vad
(QL202's pair conv3 -> conv4), and that floor also pulled every other channel's scale down
through the geometric mean. The large scale itself is what int8 wants there (the next layer's
weights for the channel round to 0, so held-out data that wakes it loses its contribution
instead of passing through a range set by other channels: +0.6 dB on 48 held-out silero_vad
chunks against scale 1), so it is now explicit, outside the mean, and said in the rewrite's
note (verify's per-layer SQNR of the layer before sees those channels saturate). A channel
with live inputs but zero weights keeps scale 1: a large one would widen the calibrated range.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from qlint.measure.equalization import apply_equalization

SILENT = 5  # conv1's output channel that calibration never wakes
IGNORED = 6  # conv1's output channel that conv2 gives zero weights


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(8, 4, 1)

    def forward(self, x):
        return self.conv2(self.relu(self.conv1(x)))


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Pair().eval()
    with torch.no_grad():
        model.conv1.weight.abs_()  # inputs are positive: every other channel is active
        model.conv1.bias.fill_(0.1)
        model.conv1.weight[SILENT] = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
        model.conv1.bias[SILENT] = -10.0  # input channel 0 stays in [0, 1] in calibration: relu gives 0
        model.conv1.bias[IGNORED] = 5.0  # always active
        model.conv2.weight[:, IGNORED] = 0.0
    return model


def _batches(seed: int, wake: bool) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.rand(16, 4, 32, generator=generator) for _ in range(4)]
    if wake:
        for batch in batches:
            batch[:, 0, :4] = 14.0  # the silent channel now reaches 4
    return batches


def _scales(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per output channel of conv1: how much equalization multiplied its weights."""
    return after.flatten(1).norm(dim=1) / before.flatten(1).norm(dim=1)


def test_silent_channels_get_a_large_scale_outside_the_mean_and_ignored_ones_keep_one():
    model = _model()
    equalized, applied = apply_equalization(fx.symbolic_trace(model), ["conv2"], _batches(0, wake=False))
    assert applied[0].applied
    assert applied[0].note is not None and "1 output channel(s) of conv1 silent in calibration" in applied[0].note
    conv1, conv2 = equalized.get_submodule("conv1"), equalized.get_submodule("conv2")
    scales = _scales(model.conv1.weight, conv1.weight)
    assert float(scales[SILENT]) == pytest.approx(1e4)
    assert torch.allclose(conv2.weight[:, SILENT] * 1e4, model.conv2.weight[:, SILENT])
    assert float(scales[IGNORED]) == pytest.approx(1.0)  # live input, zero weights: its range is left alone
    balanced = [c for c in range(8) if c not in (SILENT, IGNORED)]
    assert float(torch.exp(torch.log(scales[balanced]).mean())) == pytest.approx(1.0, rel=1e-4)
    assert not torch.allclose(scales[balanced], torch.ones(len(balanced)))  # they are balanced


def test_the_rescale_keeps_the_float_function_on_data_that_wakes_the_silent_channel():
    model = _model()
    equalized, _ = apply_equalization(fx.symbolic_trace(model), ["conv2"], _batches(0, wake=False))
    for batch in _batches(1, wake=True):
        with torch.no_grad():
            assert torch.allclose(equalized(batch), model(batch), rtol=1e-4, atol=1e-4)


def test_verify_compares_the_layer_before_as_the_original_model_computes_it():
    """verify showed silero_vad's conv3 at 0.03 dB: its output was compared in the rescaled graph,
    where held-out data that wakes a channel scaled x1e4 saturates it. Divided back, the layer
    compares as the original model computes it."""
    import qlint
    from qlint.advice.plan import default_plan
    from qlint.linter.suggestions import EqualizationPair, Provenance

    pair = EqualizationPair(module="conv2", previous="conv1", provenance=[Provenance(source="user")])
    plan = default_plan("x86").model_copy(update={"equalization": [pair]})
    report = qlint.verify(
        _model(), plan, _batches(0, wake=False), _batches(1, wake=True), max_trials=0, prune=False, search_schemes=False
    )
    assert any(r.kind == "equalize" and r.applied and r.note for r in report.rewrites)
    conv1 = next(row for row in report.layers if row.fqn == "conv1")
    assert conv1.default_sqnr_db is not None and conv1.plan_sqnr_db is not None
    assert conv1.plan_sqnr_db > conv1.default_sqnr_db - 1.0  # the rescale changes the layer's int8 error little


class _NormPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.relu(self.norm(x)))


def test_after_a_norm_layer_a_silent_channel_keeps_scale_one():
    """prepare_fx observes a LayerNorm's output before the ReLU (it fuses ReLUs into convs and
    Linears only): a dead channel's negative values x1e4 would set that observer's range."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _NormPair().eval()
    with torch.no_grad():
        model.norm.weight[SILENT] = 0.1
        model.norm.bias[SILENT] = -5.0  # always negative: the ReLU silences it
    batches = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    equalized, applied = apply_equalization(fx.symbolic_trace(model), ["fc"], batches)
    assert applied[0].applied and applied[0].note is None
    scale = equalized.get_submodule("norm").weight / model.norm.weight
    assert float(scale[SILENT]) == pytest.approx(1.0)
    assert float(torch.exp(torch.log(scale[[c for c in range(8) if c != SILENT]]).mean())) == pytest.approx(
        1.0, rel=1e-4
    )


def test_a_pair_with_no_active_channel_is_not_equalized():
    model = _model()
    with torch.no_grad():
        model.conv1.bias.fill_(-100.0)  # every channel silent in calibration
    _, applied = apply_equalization(fx.symbolic_trace(model), ["conv2"], _batches(0, wake=False))
    assert not applied[0].applied and applied[0].reason == "no input channel was active in calibration"


class _ConvNormPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(4, 8, 1)
        self.bn = nn.BatchNorm1d(8)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(8, 4, 1)

    def forward(self, x):
        return self.conv2(self.relu(self.bn(self.conv1(x))))


def test_verify_divides_back_the_rescale_of_a_norm_in_the_layer_it_is_fused_into():
    """With a BatchNorm as the pair's previous layer, prepare_fx fuses it into conv1, whose row then
    showed the rescaled output (33.0 dB where the original units give 27.1). The row must be the
    SQNR of conv1 + bn + relu (fused) as the original model computes them against the int8 model's, divided back."""
    import qlint
    from qlint.advice.plan import default_plan
    from qlint.linter.suggestions import EqualizationPair, Provenance

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _ConvNormPair().eval()
    with torch.no_grad():  # channel ranges far apart: scales from ~0.02 to ~34
        model.bn.weight.copy_(torch.tensor([20.0, 0.05, 1.0, 1.0, 5.0, 0.2, 1.0, 3.0]))
        model.conv2.weight[:, 0] *= 0.01
        model.conv2.weight[:, 1] *= 50
    generator = torch.Generator().manual_seed(0)
    calibration, held_out = ([torch.randn(16, 4, 32, generator=generator) for _ in range(4)] for _ in range(2))
    pair = EqualizationPair(module="conv2", previous="bn", provenance=[Provenance(source="user")])
    plan = default_plan("x86").model_copy(update={"equalization": [pair]})
    report = qlint.verify(model, plan, calibration, held_out, max_trials=0, prune=False, search_schemes=False)
    rescale = next(r for r in report.rewrites if r.kind == "equalize" and r.applied)
    assert rescale.modules == ["bn", "conv2"] and rescale.output_scale is not None
    shown = next(row for row in report.layers if row.fqn == "conv1").plan_sqnr_db

    converted = plan.quantize(model, calibration)
    scale = torch.tensor(rescale.output_scale, dtype=torch.float64).reshape(1, -1, 1)
    outputs: list[torch.Tensor] = []
    handle = converted.get_submodule("conv1").register_forward_hook(
        lambda _m, _i, out: outputs.append(out.dequantize().double() / scale)
    )
    signal = noise = 0.0
    with torch.no_grad():
        for batch in held_out:
            expected = model.relu(model.bn(model.conv1(batch))).double()  # fused: conv1 + bn + relu
            converted(batch)
            signal += float(expected.square().sum())
            noise += float((expected - outputs.pop()).square().sum())
    handle.remove()
    assert shown == pytest.approx(10 * math.log10(signal / noise), abs=0.05)


class _LinearPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def test_a_silent_channel_keeps_scale_one_where_the_next_layer_runs_dynamic():
    """A dynamic Linear quantizes its input on each call's own range: the x1e4 of a channel silent in
    calibration then sets that range on data that wakes it. bench/advice.py's imbalanced MLP, its
    Linears all dynamic with two equalized pairs, fell from 35 dB to 9 dB held-out (5 dB on the
    batches that woke one), while verify had measured 35 dB on calibration batches."""
    from qlint.advice.plan import ModuleDecision, default_plan
    from qlint.core.sqnr import SqnrSums
    from qlint.linter.suggestions import EqualizationPair, Provenance

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _LinearPair().eval()
    with torch.no_grad():
        model.fc1.weight.abs_()
        model.fc1.bias.fill_(0.1)
        model.fc1.weight[SILENT] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        model.fc1.bias[SILENT] = -10.0  # input 0 stays in [0, 1] in calibration: relu gives 0
    generator = torch.Generator().manual_seed(0)
    calibration = [torch.rand(64, 4, generator=generator) for _ in range(4)]
    woken = [torch.rand(64, 4, generator=generator) for _ in range(4)]
    for batch in woken:
        batch[:4, 0] = 14.0  # four rows wake the silent channel (it reaches 4)

    _, applied = apply_equalization(fx.symbolic_trace(model), ["fc2"], calibration, dynamic=["fc2"])
    assert applied[0].applied and applied[0].note is None
    assert applied[0].output_scale is not None and applied[0].output_scale[SILENT] == pytest.approx(1.0)

    user = [Provenance(source="user")]
    dynamic = [ModuleDecision(fqn=name, mode="dynamic", provenance=user) for name in ("fc1", "fc2")]
    pair = EqualizationPair(module="fc2", previous="fc1", provenance=user)
    plain = default_plan("x86").model_copy(update={"modules": dynamic})
    equalized = plain.model_copy(update={"equalization": [pair]})

    def sqnr(plan) -> float:
        converted, sums = plan.quantize(model, calibration), SqnrSums()
        with torch.no_grad():
            for batch in woken:
                sums.add(model(batch), converted(batch))
        return sums.sqnr_db()

    assert sqnr(equalized) > sqnr(plain) - 3.0 and sqnr(equalized) > 25.0

    # verify reuses one rescaled graph while the rewrites stay the same: a scheme search that
    # makes fc2 dynamic must not measure it on the graph rescaled for a static fc2
    from qlint.advice.verify_session import Session

    session = Session(model, calibration, woken, woken, max_trials=4)
    static = equalized.model_copy(update={"modules": []})
    session.measure("static", static)
    assert session.measure("dynamic", equalized).result.sqnr_db == pytest.approx(sqnr(equalized), abs=0.01)
