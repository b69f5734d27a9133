"""A bench's later trials reuse the qparams its earlier trials calibrated, and measure exactly
what a fresh calibration measures."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import QConfig, get_default_qconfig_mapping
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, default_per_channel_weight_observer

from qlint.core.batches import call_model
from qlint.measure.calibrated import CalibratedQParams
from qlint.measure.trial import prepare_model
from qlint.measure.trial_bench import TrialBench


class Block(nn.Module):
    """conv-bn-relu, a pool and a flatten (ops whose output shares its input's observer),
    a sigmoid gate (fixed qparams), a residual add and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.gate = nn.Conv2d(8, 8, 1)
        self.mix = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(self.act(self.bn(self.conv(x))))
        y = y * torch.sigmoid(self.gate(y)) + self.mix(y)
        return self.head(torch.flatten(y, 1))


def _model() -> fx.GraphModule:
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():  # BN statistics of its own, so folding is not an identity
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return fx.symbolic_trace(model)


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 3, 8, 8, generator=generator) * 3 for _ in range(count)]


def _bench(model: fx.GraphModule) -> TrialBench:
    batches = _batches(6)
    return TrialBench(lambda: copy.deepcopy(model), "x86", batches[:4], batches[4:], "calibration", "evaluation")


def _clipped() -> QConfig:
    return QConfig(
        activation=MinMaxObserver.with_args(quant_min=0, quant_max=127), weight=default_per_channel_weight_observer
    )


def _changed_mappings() -> dict[str, object]:
    base = get_default_qconfig_mapping("x86")
    changed: dict[str, object] = {
        name: copy.deepcopy(base).set_module_name(name, None) for name in ("conv", "act", "pool", "gate", "mix", "head")
    }
    changed["clip mix"] = copy.deepcopy(base).set_module_name("mix", _clipped())
    changed["clip conv"] = copy.deepcopy(base).set_module_name("conv", _clipped())
    changed["clip gate and head"] = (
        copy.deepcopy(base).set_module_name("gate", _clipped()).set_module_name("head", _clipped())
    )
    changed["clip gate, mix float"] = (
        copy.deepcopy(base).set_module_name("gate", _clipped()).set_module_name("mix", None)
    )
    changed["sigmoid float"] = copy.deepcopy(base).set_object_type(torch.sigmoid, None)
    return changed


def test_observers_of_the_same_tensors_and_settings_are_reused() -> None:
    model = _model()
    mapping = get_default_qconfig_mapping("x86")
    example = (_batches(1)[0],)
    calibrated = copy.deepcopy(model).eval()
    prepared = prepare_model(calibrated, mapping, example)
    with torch.no_grad():
        for batch in _batches(4):
            call_model(prepared, batch)
    recorded = CalibratedQParams()
    recorded.record(prepared)
    histograms = sum(isinstance(m, HistogramObserver) for m in prepared.modules())
    assert histograms > 4
    assert len(recorded) == histograms  # every per-tensor activation observer (fixed ones excluded)
    fresh = prepare_model(copy.deepcopy(model).eval(), mapping, example)
    assert recorded.reuse(fresh) == histograms
    assert not any(isinstance(m, HistogramObserver) for m in fresh.modules())
    # a changed observer of one module is not reused: it is calibrated afresh
    clipped = prepare_model(
        copy.deepcopy(model).eval(), copy.deepcopy(mapping).set_module_name("mix", _clipped()), example
    )
    assert recorded.reuse(clipped) < histograms
    assert any(isinstance(m, MinMaxObserver) for m in clipped.modules())


def test_trials_reusing_qparams_measure_what_fresh_ones_do() -> None:
    model = _model()
    reusing = _bench(model)
    base = reusing.run(get_default_qconfig_mapping("x86"))
    assert base.failure is not None or len(reusing._calibrated) > 0
    assert base.failure is None
    changed = 0
    for label, mapping in _changed_mappings().items():
        reused_powers = reusing.output_powers(mapping)  # type: ignore[arg-type]
        fresh_powers = _bench(model).output_powers(mapping)  # type: ignore[arg-type]
        assert reused_powers is not None and fresh_powers is not None, label
        assert reused_powers == fresh_powers, label  # bit for bit: the same qparams, the same kernels
        changed += fresh_powers.sqnr_db() != base.output_sqnr_db
    assert changed >= 6  # the mappings change the int8 model: the comparison is not of the base trial


class BandObserver(MinMaxObserver):
    """A user's observer with a setting of a type qlint cannot compare (a list)."""

    def __init__(self, band: list[float] | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.band = band if band is not None else [0.0, 1.0]


def test_observers_with_settings_qlint_cannot_compare_are_calibrated_every_time() -> None:
    model = _model()
    example = (_batches(1)[0],)
    mapping = get_default_qconfig_mapping("x86").set_module_name(
        "mix", QConfig(activation=BandObserver.with_args(band=[0.1, 0.9]), weight=default_per_channel_weight_observer)
    )
    prepared = prepare_model(copy.deepcopy(model).eval(), mapping, example)
    with torch.no_grad():
        for batch in _batches(4):
            call_model(prepared, batch)
    recorded = CalibratedQParams()
    recorded.record(prepared)
    fresh = prepare_model(copy.deepcopy(model).eval(), mapping, example)
    recorded.reuse(fresh)
    assert any(isinstance(m, BandObserver) for m in fresh.modules())  # kept, to be calibrated
    assert not any(isinstance(m, HistogramObserver) for m in fresh.modules())  # the others reused
