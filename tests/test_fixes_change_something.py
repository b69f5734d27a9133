"""A fix that equals what the layer already gets is a bug: every qconfig fix of every rule's
INVALID examples changes the qconfig prepare_fx assigns to some node.

The reference is prepare_fx's own assignment (``node_name_to_qconfig``, a private attribute
tests may read), compared as the observers each qconfig builds.
"""

import copy
import warnings

import pytest
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_fx

import qlint
from qlint.core.backends import backend_config
from qlint.core.trace import symbolic_graph
from qlint.linter.impact import fix_mapping
from qlint.linter.registry import Registry


def _observer_text(factory):
    """What decides how a tensor is quantized: the observer class and its quantization attributes."""
    if factory is None:
        return None
    observer = factory()
    fields = (
        "dtype",
        "qscheme",
        "quant_min",
        "quant_max",
        "reduce_range",
        "ch_axis",
        "is_dynamic",
        "percentile",
        "bins",
        "averaging_constant",
    )
    return (type(observer).__name__,) + tuple(str(getattr(observer, name, None)) for name in fields)


def _assignment(model, mapping, inputs, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model), mapping, inputs, backend_config=backend_config(backend))
    table = prepared.meta["_observed_graph_module_attrs"].node_name_to_qconfig
    return {
        name: None if qc is None else (_observer_text(qc.activation), _observer_text(qc.weight))
        for name, qc in table.items()
    }


CASES = [
    pytest.param(rule, example, id=f"{rule.code}-invalid-{index}")
    for rule in Registry.default(include_plugins=False).all()
    for index, example in enumerate(rule.examples()[1])
]


@pytest.mark.parametrize("rule,example", CASES)
def test_every_qconfig_fix_changes_the_assignment(rule, example):
    mapping = example.qconfig_mapping() if example.qconfig_mapping else get_default_qconfig_mapping(example.backend)
    inputs = example.inputs()
    report = qlint.lint(
        example.build(),
        inputs,
        backend=example.backend,
        qconfig_mapping=mapping,
        calibration=example.calibration() if example.calibration else None,
        select=[rule.code],
        trial_options={"enabled": False},
        options={rule.code: dict(example.options)} if example.options else None,
    )
    fixes = [(f, fix_mapping(mapping, [f], example.backend)) for f in report.by_rule(rule.code)]
    fixes = [(f, fixed) for f, fixed in fixes if fixed is not None]
    if not fixes:
        pytest.skip(f"{example.description}: no qconfig fix (a rewrite, or a fix outside the mapping)")
    traced = symbolic_graph(copy.deepcopy(example.build()))
    try:
        before = _assignment(traced, mapping, inputs, example.backend)
    except Exception as error:  # the example's own mapping fails prepare_fx (what QL105 reports)
        pytest.skip(f"{example.description}: prepare_fx fails on the mapping itself: {type(error).__name__}")
    for finding, fixed in fixes:
        try:
            after = _assignment(traced, fixed, inputs, example.backend)
        except Exception:
            continue  # a fix that prepare_fx rejects changes something, just not usefully: the trial says so
        changed = [name for name in before if before[name] != after.get(name)]
        assert changed, f"{finding.rule} on {finding.target}: the fix {finding.suggestion} changes nothing"
