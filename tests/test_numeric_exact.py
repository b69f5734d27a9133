"""Layers whose module the quantized model shares with the float model are still measured.

``prepare_fx`` does not copy the model it is given: modules it does not swap
(``MaxPool2d``, ``ReLU``, ``Hardtanh`` running on quantized tensors) are the very
same objects in the float model and in the converted one.  One module then carries
the capture hooks of both sides; before the fix the quantized side's hook also fired
in the float run (comparing the float output with itself) and the float side's hook
kept the quantized output as "float" reference, so the propagated SQNR of such a
layer read exactly the cap (200 dB, "exact") while its outputs differed by ~0.03.

References are torch's Numeric Suite: propagated = ``add_loggers`` (both models run
on their own), shadow = ``add_shadow_loggers``.
"""

import copy
import warnings

import pytest
import torch

# torch's FX numeric suite is private API: the reference in tests only.
import torch.ao.ns._numeric_suite_fx as torch_ns
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.sqnr import SQNR_CAP_DB
from qlint.measure.metrics import PairwiseErrorStats
from qlint.numeric.compare import compare
from qlint.numeric.sensitivity import sensitivity_rows

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class PoolThenActivation(nn.Module):
    def __init__(self, activation: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.pool = nn.MaxPool2d(2)
        self.act = activation
        self.fc = nn.Linear(8 * 3 * 3, 4)

    def forward(self, x):
        return self.fc(self.act(self.pool(self.conv(x))).flatten(1))


def _batches():
    return [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]


def _quantized(model: nn.Module, batches, *, share: bool) -> torch.fx.GraphModule:
    """prepare_fx/convert_fx as users write it (``share``: on the model itself) or on a copy."""
    prepared = prepare_fx(model if share else copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return convert_fx(prepared)


def _model(activation: str) -> nn.Module:
    torch.manual_seed(0)
    return PoolThenActivation(nn.ReLU() if activation == "relu" else nn.Hardtanh()).eval()


def _pooled_sqnr(entries_a, entries_b) -> float | None:
    stats = PairwiseErrorStats()
    for entry_a, entry_b in zip(entries_a, entries_b):
        for reference, quantized in zip(entry_a["values"], entry_b["values"]):
            stats.update(reference, quantized)
    return stats.sqnr_db()


def torch_ns_sqnr(float_model, converted, batches) -> tuple[dict[str, float], dict[str, float]]:
    """(propagated, shadow) SQNR per float node name from torch's loggers, pooled over the batches.

    torch's models get deep copies: its loggers must not see qlint's state, nor each other's.
    """
    float_logged, quant_logged = torch_ns.add_loggers(
        "fp32", copy.deepcopy(float_model), "int8", copy.deepcopy(converted), torch_ns.OutputLogger
    )
    shadow = torch_ns.add_shadow_loggers(
        "fp32", copy.deepcopy(float_model), "int8", copy.deepcopy(converted), torch_ns.OutputLogger
    )
    with torch.no_grad():
        for batch in batches:
            float_logged(batch)
            quant_logged(batch)
            shadow(batch)
    propagated = torch_ns.extract_logger_info(float_logged, quant_logged, torch_ns.OutputLogger, "int8")
    shadowed = torch_ns.extract_shadow_logger_info(shadow, torch_ns.OutputLogger, "int8")
    return (
        {name: _pooled_sqnr(r["node_output"]["fp32"], r["node_output"]["int8"]) for name, r in propagated.items()},
        {name: _pooled_sqnr(r["node_output"]["fp32"], r["node_output"]["int8"]) for name, r in shadowed.items()},
    )


@pytest.mark.parametrize("activation", ["relu", "hardtanh"])
def test_shared_pass_through_layers_match_torch_numeric_suite(activation):
    model, batches = _model(activation), _batches()
    converted = _quantized(model, batches, share=True)
    # The situation under test: the converted model runs the float model's own modules.
    assert converted.act is model.act and converted.pool is model.pool
    propagated, shadow = torch_ns_sqnr(model, converted, batches)
    rows = {row.name: row for row in compare(model, converted, batches).layers}
    assert set(rows) == {"conv", "act", "fc"}
    for name, row in rows.items():
        assert abs(row.sqnr_propagated - propagated[name]) < 0.01, (name, row.sqnr_propagated, propagated[name])
        assert abs(row.sqnr_shadow - shadow[name]) < 0.01, (name, row.sqnr_shadow, shadow[name])
    # The activation inherits the conv's error: its propagated SQNR is a real measurement, not the cap.
    assert rows["act"].sqnr_propagated < 40.0 < SQNR_CAP_DB
    # ReLU on a quantized input adds no error of its own (the shadow is legitimately exact);
    # Hardtanh's bounds are not on the grid, so it adds a little.
    if activation == "relu":
        assert rows["act"].sqnr_shadow == SQNR_CAP_DB
    else:
        assert rows["act"].sqnr_shadow < 60.0


@pytest.mark.parametrize("activation", ["relu", "hardtanh"])
def test_shared_modules_measure_like_a_private_copy(activation):
    """compare and sensitivity give the same numbers whether or not prepare_fx got a copy."""
    batches = _batches()
    shared_model, copied_model = _model(activation), _model(activation)
    shared = _quantized(shared_model, batches, share=True)
    copied = _quantized(copied_model, batches, share=False)
    assert shared.act is shared_model.act and copied.act is not copied_model.act

    def compared(model, converted):
        return {r.name: (r.sqnr_propagated, r.sqnr_shadow) for r in compare(model, converted, batches).layers}

    def ranked(model, converted):
        rows = sensitivity_rows(model, batches, quantized_model=converted)
        return {r.name: (r.local_sqnr_db, r.score) for r in rows}

    for measure in (compared, ranked):
        got, expected = measure(shared_model, shared), measure(copied_model, copied)
        assert got.keys() == expected.keys() and "act" in got
        for name, values in expected.items():
            assert got[name] == pytest.approx(values, rel=1e-6), (measure.__name__, name)
