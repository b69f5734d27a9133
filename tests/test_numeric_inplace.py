"""In-place activations do not change what per-layer comparisons see.

``ReLU6(inplace=True)`` clamps the very tensor the layer before it returned.  A
capture that keeps a reference to that tensor compares the clamped float values
with the unclamped quantized ones and reports healthy convs at a few dB.  The
same network written with ``inplace=False`` is the reference: every per-layer
number must be the same for both, in compare, sensitivity and verify.
"""

import copy
import warnings

import pytest
import torch
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.advice.verify import verify
from qlint.numeric.compare import compare
from qlint.numeric.diagnose import DEFAULT_SQNR_THRESHOLD_DB
from qlint.numeric.sensitivity import sensitivity_rows
from tests.models import mobilenet_style

warnings.filterwarnings("ignore")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def twins():
    """The MobileNet-style net with in-place ReLU6s and its out-of-place twin (same weights), and data."""
    generator = torch.Generator().manual_seed(4)
    batches = [torch.randn(4, 3, 16, 16, generator=generator) for _ in range(3)]
    return mobilenet_style(inplace=True), mobilenet_style(inplace=False), batches


def _quantize(model, batches, convert=True):
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (batches[0],))
    with torch.no_grad():
        for batch in batches:
            prepared(batch)
    return convert_fx(copy.deepcopy(prepared)) if convert else prepared


def _numbers(report):
    return {row.name: (row.sqnr_propagated, row.sqnr_shadow, row.weight_sqnr) for row in report.layers}


def _output_sqnr(report) -> float:
    note = next(notice.message for notice in report.notices if "model output SQNR" in notice.message)
    return float(note.split("model output SQNR ")[1].split(" dB")[0])


@pytest.mark.parametrize("convert", [True, False], ids=["converted", "prepared"])
def test_compare_sees_the_same_numbers_with_inplace_activations(twins, convert):
    inplace, out_of_place, batches = twins
    report = compare(inplace, _quantize(inplace, batches, convert), batches)
    reference = compare(out_of_place, _quantize(out_of_place, batches, convert), batches)
    numbers, expected = _numbers(report), _numbers(reference)
    assert numbers.keys() == expected.keys()
    assert sum(row.kind == "conv2d" for row in report.layers) == 11
    for name, values in expected.items():
        assert numbers[name] == pytest.approx(values, abs=1e-6), name
    # Consistent with a model whose output is fine: no layer is blamed, none is below the threshold.
    assert _output_sqnr(report) > 30.0
    assert report.by_rule("QL301") == [] and report.by_rule("QL302") == []
    for row in report.layers:
        assert row.sqnr_propagated > DEFAULT_SQNR_THRESHOLD_DB, row.name
        assert row.sqnr_shadow is None or row.sqnr_shadow > DEFAULT_SQNR_THRESHOLD_DB, row.name


def test_sensitivity_is_the_same_with_inplace_activations(twins):
    inplace, out_of_place, batches = twins
    rows = {row.name: row for row in sensitivity_rows(inplace, batches, max_batches=2)}
    expected = {row.name: row for row in sensitivity_rows(out_of_place, batches, max_batches=2)}
    assert rows.keys() == expected.keys() and len(rows) >= 11
    for name, row in expected.items():
        assert rows[name].score == pytest.approx(row.score, rel=1e-5, abs=1e-12), name
        assert rows[name].local_sqnr_db == pytest.approx(row.local_sqnr_db, abs=1e-6), name


def test_verify_layer_table_is_the_same_with_inplace_activations(twins):
    inplace, out_of_place, batches = twins
    options = dict(prune=False, search_schemes=False)
    report = verify(inplace, None, batches[:2], batches[2:], **options)
    reference = verify(out_of_place, None, batches[:2], batches[2:], **options)
    table = {layer.fqn: layer.default_sqnr_db for layer in report.layers}
    assert table == pytest.approx({layer.fqn: layer.default_sqnr_db for layer in reference.layers}, abs=1e-3)
    assert len(table) == 12 and all(value > DEFAULT_SQNR_THRESHOLD_DB for value in table.values())
    assert report.default.sqnr_db == pytest.approx(reference.default.sqnr_db, abs=1e-3)
