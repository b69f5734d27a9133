"""QL204 and QL205 count bits as QL203 does, for the backend of the lint (QA on MiniLM).

On x86, whose default activation observer has reduce_range (128 levels), QL203 said "of 7
bits" while QL204 and QL205 hard-coded 8 ("3.2 of its 8 bits", "2.1 of their 8 bits"), and
could report more bits lost than the activation has. The bits expected here come from torch's
own default observer for the backend, not from qlint.
"""

from __future__ import annotations

import math

import pytest
from torch.ao.quantization import get_default_qconfig_mapping

import qlint
from qlint.rules.ql204_input_scale_spread import _SpectrumFrontEnd, _waveforms
from qlint.rules.ql205_leading_token_outlier import _TokenMixer, _tokens

BACKENDS = ("x86", "qnnpack")


def _torch_activation_bits(backend: str) -> int:
    """The bits of the backend's default activation observer, as torch builds it."""
    observer = get_default_qconfig_mapping(backend).global_qconfig.activation()
    return math.ceil(math.log2(observer.quant_max - observer.quant_min + 1))


def test_the_backends_differ_in_activation_bits():
    # otherwise the tests below could not tell a hard-coded count from the backend's
    assert _torch_activation_bits("x86") != _torch_activation_bits("qnnpack")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ql204_counts_the_bits_of_the_backends_activation(backend):
    # eight decades of loudness: the median sample is far more than 2**8 below the loudest
    calibration = _waveforms(8.0)(6)
    report = qlint.lint(
        _SpectrumFrontEnd(),
        (calibration[0],),
        calibration=calibration,
        backend=backend,
        qconfig_mapping=get_default_qconfig_mapping(backend),
        select=["QL204"],
    )
    (finding,) = report.by_rule("QL204")
    bits = _torch_activation_bits(backend)
    assert math.log2(finding.data["ratio"]) > bits  # the clamp is what is tested
    assert finding.data["bits_lost"] == pytest.approx(bits)
    assert f"of its {bits} bits" in finding.message
    assert finding.data["dtype_bits"] == bits


@pytest.mark.parametrize("backend", BACKENDS)
def test_ql205_counts_the_bits_ql203_counts_on_the_same_layer(backend):
    calibration = _tokens(1000.0)(4)  # the first token ~1000x the others: more than 2**8
    report = qlint.lint(
        _TokenMixer(),
        (calibration[0],),
        calibration=calibration,
        backend=backend,
        qconfig_mapping=get_default_qconfig_mapping(backend),
        select=["QL203", "QL205"],
        trial_options={"enabled": False},
    )
    (split,) = report.by_rule("QL205")
    bits = _torch_activation_bits(backend)
    assert math.log2(max(layer["ratio"] for layer in split.data["layers"])) > bits
    assert split.data["bits_lost"] == pytest.approx(bits)
    assert f"of their {bits} bits" in split.message
    assert split.data["dtype_bits"] == bits
    # QL203 flags the same layer's input and states the same bit count for it (and did before:
    # it is the reference the other two now follow)
    worst = max(split.data["layers"], key=lambda layer: layer["ratio"])["target"]
    outliers = [f for f in report.by_rule("QL203") if f.data["kind"] == "outlier" and f.target == worst]
    assert outliers and all(f.data["dtype_bits"] == split.data["dtype_bits"] for f in outliers)
