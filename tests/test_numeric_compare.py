"""compare(): findings on a deliberately broken layer, parity with torch's FX numeric suite,
shadow vs propagated, model immutability, and the bad-case search."""

import copy
import operator
import warnings

import pytest
import torch

# torch's FX numeric suite is private API: the reference in tests only.
import torch.ao.ns._numeric_suite_fx as torch_ns
import torch.nn as nn
from torch.ao.ns.fx.utils import compute_sqnr

from qlint.linter.findings import CompareRow, Report
from qlint.measure.matching import match_layers
from qlint.numeric.badcases import BadCaseSet, compare_badcases, find_badcases, per_sample_scores
from qlint.numeric.compare import compare
from qlint.numeric.examples import (
    EagerConvNet,
    SmallConvNet,
    bad_layer_qconfig_mapping,
    image_batches,
    prepare_eager_ptq,
    quantize_fx_ptq,
    randomize_batch_norm,
)

warnings.filterwarnings("ignore")


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

BAD_LAYER = "block2.conv"


@pytest.fixture(scope="module")
def broken():
    """SmallConvNet quantized with 4-level weights for BAD_LAYER only, and its report."""
    torch.manual_seed(0)
    model = randomize_batch_norm(SmallConvNet()).eval()
    data = image_batches(3, batch_size=4, size=8, seed=1)
    prepared, converted = quantize_fx_ptq(model, data, bad_layer_qconfig_mapping(BAD_LAYER))
    report = compare(model, converted, data)
    return model, data, prepared, converted, report


def test_broken_layer_is_named_by_low_sqnr_and_error_onset(broken):
    *_, report = broken
    assert [finding.target for finding in report.by_rule("QL301")] == [BAD_LAYER]
    onsets = report.by_rule("error-onset")
    assert onsets and onsets[0].target == BAD_LAYER
    onset = onsets[0]
    assert onset.data["kind"] == "local" and onset.data["local_share"] > 0.9
    assert onset.data["inherited_sqnr_db"] - onset.data["sqnr_propagated_db"] >= 6.0
    low = report.by_rule("QL301")[0]
    assert low.data["kind"] == "weight" and low.suggestion.module == BAD_LAYER
    for finding in report.findings:  # what, why and the fix
        assert BAD_LAYER in finding.message and "Why:" in finding.message and "Fix:" in finding.message


def test_rows_are_float_fqns_in_forward_order_and_survive_json(broken):
    model, _, _, converted, report = broken
    names = [row.name for row in report.layers]
    float_modules = dict(model.named_modules())
    graph_order = [node.target for node in torch.fx.symbolic_trace(model).graph.nodes if node.op == "call_module"]
    module_rows = [name for name in names if name in float_modules]
    assert module_rows == [target for target in graph_order if target in module_rows]
    assert {"stem.conv", BAD_LAYER, "head"} <= set(module_rows)
    for row in report.layers:
        if row.name in float_modules:
            assert row.weight_sqnr is not None and row.sqnr_shadow is not None and row.cosine is not None
        assert row.sqnr_propagated is not None
        assert {"quantized_target", "propagated", "predecessors"} <= set(row.extra)
    assert Report.model_validate_json(report.model_dump_json()) == report


def test_propagated_sqnr_equals_torch_add_loggers(broken):
    model, data, prepared, converted, _ = broken
    ours = compare(model, converted, data[:1], modes=("propagated",))
    loggers = torch_ns.add_loggers(
        "fp32", copy.deepcopy(prepared), "int8", copy.deepcopy(converted), torch_ns.OutputLogger
    )
    with torch.no_grad():
        loggers[0](data[0])
        loggers[1](data[0])
    results = torch_ns.extract_logger_info(loggers[0], loggers[1], torch_ns.OutputLogger, "int8")
    torch_ns.extend_logger_results_with_comparison(results, "fp32", "int8", compute_sqnr, "sqnr")
    reference = {}
    for layer in results.values():
        for entry in layer["node_output"]["int8"]:
            if entry["fqn"] and entry.get("sqnr"):
                reference.setdefault(entry["fqn"], float(entry["sqnr"][0]))
    rows = {row.name: row for row in ours.layers}
    compared = [name for name in reference if name in rows and name in dict(model.named_modules())]
    assert len(compared) >= 12
    for name in compared:
        assert abs(rows[name].sqnr_propagated - reference[name]) < 0.01, name


def test_torch_numeric_suite_finds_the_same_worst_layers(broken):
    model, data, prepared, converted, report = broken
    weights = torch_ns.extract_weights("fp32", prepared, "int8", converted)
    torch_ns.extend_logger_results_with_comparison(weights, "fp32", "int8", compute_sqnr, "sqnr")
    torch_weight = {
        entry["fqn"]: float(entry["sqnr"][0]) for layer in weights.values() for entry in layer["weight"]["int8"]
    }
    shadow = torch_ns.add_shadow_loggers(
        "fp32", copy.deepcopy(prepared), "int8", copy.deepcopy(converted), torch_ns.OutputLogger
    )
    with torch.no_grad():
        for batch in data:
            shadow(batch)
    shadow_results = torch_ns.extract_shadow_logger_info(shadow, torch_ns.OutputLogger, "int8")
    torch_ns.extend_logger_results_with_comparison(shadow_results, "fp32", "int8", compute_sqnr, "sqnr")
    torch_shadow = {
        entry["fqn"]: min(float(value) for value in entry["sqnr"])
        for layer in shadow_results.values()
        for entry in layer["node_output"]["int8"]
        if entry.get("sqnr")
    }
    ours_weight = {row.name: row.weight_sqnr for row in report.layers if row.weight_sqnr is not None}
    ours_shadow = {row.name: row.sqnr_shadow for row in report.layers if row.sqnr_shadow is not None}
    assert min(torch_weight, key=torch_weight.get) == min(ours_weight, key=ours_weight.get) == BAD_LAYER
    assert min(torch_shadow, key=torch_shadow.get) == min(ours_shadow, key=ours_shadow.get) == BAD_LAYER
    for name, value in torch_weight.items():  # weight SQNR agrees layer by layer (BN folded like prepare_fx)
        assert abs(ours_weight[name] - value) < 0.05, name


def test_shadow_shows_only_local_error(broken):
    *_, report = broken
    rows = {row.name: row for row in report.layers}
    downstream = ["res2.conv1", "res2.conv2", "block3.conv", "pointwise"]
    for name in downstream:
        # propagated carries the broken layer's error; shadow runs the float layer on the quantized
        # layer's own input, so both sides start equal and only this layer's int8 noise shows
        assert rows[name].sqnr_propagated < 15.0 < 25.0 < rows[name].sqnr_shadow, name
    first = rows["stem.conv"]
    # the model input's quantization error is inherited too: shadow leaves it out, propagated does not
    assert first.sqnr_shadow > first.sqnr_propagated + 1.0


@pytest.mark.parametrize("counterpart", ["fx-prepared", "eager-prepared"])
def test_models_are_left_exactly_as_they_were(broken, counterpart):
    model, data, prepared, _, _ = broken
    if counterpart == "fx-prepared":
        float_model = copy.deepcopy(model).train()  # BN in training mode would update its statistics
        quantized = copy.deepcopy(prepared)
    else:
        # eager observers run inside the model's own hooks: they do see the comparison data
        float_model = randomize_batch_norm(EagerConvNet()).train()
        quantized = prepare_eager_ptq(float_model.eval(), data)
        float_model.train()

    def snapshot(module):
        return (
            {name: value.clone() for name, value in module.state_dict().items()},
            [child.training for child in module.modules()],
            sum(len(child._forward_hooks) + len(child._forward_pre_hooks) for child in module.modules()),
        )

    before = snapshot(float_model), snapshot(quantized)
    report = compare(float_model, quantized, [batch * 3.0 for batch in data])  # a range the observers never saw
    assert report.layers
    after = snapshot(float_model), snapshot(quantized)
    for (state_before, modes_before, hooks_before), (state_after, modes_after, hooks_after) in zip(before, after):
        assert state_before.keys() == state_after.keys()
        assert all(torch.equal(state_before[key], state_after[key]) for key in state_before)
        assert modes_before == modes_after and hooks_before == hooks_after


def test_modes_and_thresholds(broken):
    model, data, _, converted, _ = broken
    data = data[:2]
    propagated_only = compare(model, converted, data, modes=("propagated",))
    assert all(row.sqnr_shadow is None for row in propagated_only.layers)
    # without a shadow run the local error is estimated from the jump, and still pins the layer
    assert [finding.target for finding in propagated_only.by_rule("QL301")] == [BAD_LAYER]
    lenient = compare(model, converted, data, sqnr_threshold=0.0, weight_sqnr_threshold=0.0)
    # no layer adds error below 0 dB itself; the SQNR does cross 0 dB after the broken layer, whose large
    # drop stops above it, so QL302 names that layer as the onset of the crossing, and nothing else
    assert [(f.rule, f.target) for f in lenient.findings] == [("QL302", BAD_LAYER)]
    assert lenient.findings[0].data["crosses_threshold_at"] is not None
    strict = compare(model, converted, data, modes=("shadow",), sqnr_threshold=60.0)
    assert len(strict.by_rule("QL301")) == sum(row.sqnr_shadow is not None for row in strict.layers)
    with pytest.raises(ValueError):
        compare(model, converted, data, modes=("sideways",))


def test_badcases_find_the_outlier_inputs_and_round_trip(broken, tmp_path):
    model, data, _, converted, _ = broken
    generator = torch.Generator().manual_seed(7)
    dataset = [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(5)]
    outliers = {6, 13}  # global sample indices: batch 1 row 2, batch 3 row 1
    dataset[1][2] *= 6.0  # far outside the calibrated ranges: activations clip
    dataset[3][1] *= 6.0
    found = find_badcases(model, converted, dataset, top=3)
    assert found.samples_seen == 20
    for metric in ("l1", "max_abs"):
        cases = found.worst(metric)
        assert len(cases) == 3 and {case.index for case in cases[:2]} == outliers
        assert [case.value for case in cases] == sorted((case.value for case in cases), reverse=True)
    cosine_values = [case.value for case in found.worst("cosine")]
    assert cosine_values == sorted(cosine_values)
    # values are the per-sample metrics of the full outputs
    case = found.worst("max_abs")[0]
    with torch.no_grad():
        expected = per_sample_scores(
            model(case.sample),
            converted(case.sample).dequantize() if converted(case.sample).is_quantized else converted(case.sample),
        )
    assert case.value == pytest.approx(float(expected["max_abs"][0]), rel=1e-6)
    assert torch.equal(case.sample[0], dataset[case.index // 4][case.index % 4])
    path = found.save(tmp_path / "badcases.pt")
    loaded = BadCaseSet.load(path)
    assert {metric: [c.index for c in cases] for metric, cases in loaded.cases.items()} == {
        metric: [c.index for c in cases] for metric, cases in found.cases.items()
    }
    rerun = compare_badcases(model, converted, path, metric="max_abs")
    assert isinstance(rerun, Report) and rerun.layers
    assert BAD_LAYER in [finding.target for finding in rerun.by_rule("QL301")]


def test_functional_layers_are_compared_too(broken):
    model, data, _, converted, report = broken
    match = match_layers(model, converted)
    functional = [layer.name for layer in match.layers if not layer.is_module]
    rows = {row.name: row for row in report.layers}
    assert functional and all(name in rows for name in functional)
    assert all(rows[name].sqnr_propagated is not None for name in functional)


def test_a_quantized_model_that_fails_on_the_data_is_one_clear_error():
    """torch's int8 model of a conv followed by `.view` raises on its channels-last output: compare
    says which model failed and torch's own words (".reshape"), as a QlintError (exit 2, one line),
    not an internal error."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    from qlint.errors import ModelRunError
    from qlint.linter.rule import seeded
    from qlint.rules.ql105_conversion_check import _ConvView, _image

    model = seeded(_ConvView)().eval()
    data = [_image(), (_image()[0] * 2,)]
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), data[0])
    for batch in data:
        prepared(*batch)
    quantized = convert_fx(prepared)
    with pytest.raises(
        ModelRunError, match=r"^the quantized model raised RuntimeError on the data: view size.*reshape"
    ):
        compare(model, quantized, data)


def test_weights_of_another_float_model_are_named_not_blamed_on_quantization():
    """A quantized model made from an equalized copy (fc1's rows scaled by 4, fc2's columns by
    1/4: the same function in float) against the original float model: fc1's int8 weights sit
    further from the original weights than 0 does (below 0 dB, which no rounding can do), so
    compare says the weights come from another float model instead of 'quantize per channel'."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    generator = torch.Generator().manual_seed(0)
    original = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    with torch.no_grad():
        for parameter in original.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    equalized = copy.deepcopy(original)
    with torch.no_grad():
        equalized[0].weight.mul_(4)
        equalized[0].bias.mul_(4)
        equalized[2].weight.div_(4)
    data = [torch.randn(4, 8, generator=generator) for _ in range(3)]
    assert torch.allclose(original(data[0]), equalized(data[0]), atol=1e-5)
    prepared = prepare_fx(copy.deepcopy(equalized), get_default_qconfig_mapping("x86"), (data[0],))
    for batch in data:
        prepared(batch)
    report = compare(original, convert_fx(prepared), data)
    row = next(row for row in report.compare_rows() if row.name == "0")
    assert row.weight_sqnr is not None and row.weight_sqnr < 0
    [finding] = [f for f in report.findings if f.target == "0"]
    assert finding.rule == "QL301" and finding.data["kind"] == "other-weights" and finding.suggestion is None
    assert "not a quantization of this float model's weights" in finding.message
    assert not [f for f in report.findings if f.rule == "QL302" and f.target == "0"]


def test_weights_rescaled_column_by_column_are_named_though_their_sqnr_stays_positive():
    """silero_vad quantized from its verified plan: conv4, equalized (its input columns scaled by
    factors from 0.4 to 2.6), kept a weight SQNR of 0.2 dB, above what the SQNR test can tell,
    and compare blamed its precision ('quantize its weights to 8 bits per channel', which they
    were). Re-rounding the float weights on the layer's own scales tells it: most integers are
    more than one step away, where quantizing moves none by more than one."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    generator = torch.Generator().manual_seed(0)
    original = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    with torch.no_grad():
        for parameter in original.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    data = [torch.randn(4, 8, generator=generator) for _ in range(3)]

    def quantized(model):
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (data[0],))
        for batch in data:
            prepared(batch)
        return convert_fx(prepared)

    plain = compare(original, quantized(original), data)
    assert all(row.weight_off_grid == 0.0 for row in plain.compare_rows() if row.name in ("0", "2"))
    assert not [f for f in plain.findings if f.data.get("kind") == "other-weights"]

    scales = torch.linspace(0.8, 1.25, 16)  # per channel of fc1's output, as equalization makes them
    equalized = copy.deepcopy(original)
    with torch.no_grad():
        equalized[0].weight.mul_(scales[:, None])
        equalized[0].bias.mul_(scales)
        equalized[2].weight.div_(scales)
    assert torch.allclose(original(data[0]), equalized(data[0]), atol=1e-5)
    report = compare(original, quantized(equalized), data)
    row = next(row for row in report.compare_rows() if row.name == "2")
    assert row.weight_sqnr is not None and row.weight_sqnr > 0  # the SQNR test alone misses it
    assert row.weight_off_grid is not None and row.weight_off_grid > 0.3
    [finding] = [f for f in report.findings if f.target == "2" and f.rule == "QL301"]
    assert finding.data["kind"] == "other-weights" and finding.suggestion is None
    assert f"{row.weight_off_grid:.0%} of its integer weights are more than one step" in finding.message
    # and said once for the report: every number after that layer is affected
    [notice] = [n for n in report.notices if "not quantized from this float model" in n.message]
    assert notice.level.value == "warning" and "(0, 2: see QL301/QL302): from 0 on" in notice.message
    assert not [n for n in plain.notices if "not quantized from this float model" in n.message]


def test_an_onset_at_exact_inputs_with_little_error_of_its_own_names_other_inputs():
    """silero_vad quantized from a plan with normalize_input: stft_conv's propagated SQNR fell
    from exact model inputs to -5.4 dB with 0 % of the error its own, and QL302 said it
    'amplifies noise it receives' and to 'improve the precision of its inputs (model input)'."""
    from qlint.linter.findings import CompareRow
    from qlint.numeric.diagnose import error_onset_findings

    first = CompareRow(name="stft", kind="conv1d", sqnr_propagated=-5.4, sqnr_shadow=45.0, extra={"predecessors": []})
    later = CompareRow(
        name="conv", kind="conv1d", sqnr_propagated=-30.0, sqnr_shadow=45.0, extra={"predecessors": ["stft"]}
    )
    by_target = {f.target: f for f in error_onset_findings([first, later], 20.0, 6.0)}
    onset = by_target["stft"]
    assert onset.data["kind"] == "other-inputs"
    assert "amplifies" not in onset.message and "improve the precision of its inputs" not in onset.message
    assert "compare against the float model the quantized model was built from" in onset.message
    assert by_target["conv"].data["kind"] == "amplified"  # inherited noise, which it can amplify
    assert "improve the precision of its inputs (stft)" in by_target["conv"].message


def test_weights_clipped_by_a_narrow_quantizer_range_are_on_the_grid():
    """A 4-bit clipping quantizer stores qint8 integers in [-8, 7]: rounded on the layer's scales
    and clamped to the dtype's range instead, the clipped float weights sat many steps off."""
    from qlint.measure.weights import off_grid_fraction

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=generator)
    scales = (weight.abs().amax(1) / 16).double()  # the largest weights round to 16: clipped to 7
    integers = torch.clamp(torch.round(weight / scales[:, None].float()), -8, 7).to(torch.int8)
    quantized = torch._make_per_channel_quantized_tensor(integers, scales, torch.zeros(8, dtype=torch.long), 0)
    assert float((integers.abs() >= 7).float().mean()) > 0.05  # many clipped

    class Converted(torch.nn.Module):  # what a converted layer exposes: weight() -> its quantized tensor
        def weight(self):
            return quantized

    assert off_grid_fraction(weight, Converted()) == 0.0
    other = weight.clone()
    other[:, :8] *= 2.5  # another float weight: its integers are not these
    assert off_grid_fraction(other, Converted()) > 0.2


class _StatefulCell(nn.Module):
    """x (batch, 8) and a state (layers, batch, 8), silero_vad-style: the state is not batch-first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, state):
        out = torch.relu(self.fc(torch.cat([x, state[0]], dim=1)))
        return out, torch.stack([out, state[1]])


def test_badcases_split_a_state_whose_batch_is_not_its_first_dim():
    """compare --badcases failed on silero_vad ("Input batch size 1 doesn't match hidden0 batch size
    8"): its state (2, batch, 128) was handed whole to every one-sample batch."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = _StatefulCell().eval()
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=generator), torch.randn(2, 4, 8, generator=generator)) for _ in range(3)]
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), data[0])
    for batch in data:
        prepared(*batch)
    converted = convert_fx(prepared)
    found = find_badcases(model, converted, data, top=2)
    assert found.samples_seen == 12
    case = found.worst("max_abs")[0]
    x, state = case.sample
    assert x.shape == (1, 8) and state.shape == (2, 1, 8)
    batch, row = data[case.index // 4], case.index % 4
    assert torch.equal(x[0], batch[0][row]) and torch.equal(state[:, 0], batch[1][:, row])


def _row(scale: float, float_min: float, float_max: float, quantized: float) -> CompareRow:
    summary = {
        "scale": scale,
        "rmse_over_scale": 0.01,
        "float_min": float_min,
        "float_max": float_max,
        "quantized_min": quantized,
        "quantized_max": quantized,
    }
    return CompareRow(name="mul", kind="mul", sqnr_propagated=0.0, sqnr_shadow=0.0, extra={"shadow": summary})


def test_ql301_says_when_the_output_step_is_wider_than_every_value_spread():
    """MiniLM's attention-mask mul (values 0 and -1e4) got an output scale of 787401: every value
    became 0, and QL301 blamed "a few large values" and suggested equalization or clamping."""
    from qlint.numeric.diagnose import low_sqnr_findings

    (finding,) = low_sqnr_findings([_row(787401.6, -1e4, 0.0, 0.0)], sqnr_threshold=20.0, weight_sqnr_threshold=25.0)
    assert "wider than the whole float range" in finding.message and "a few large values" not in finding.message
    assert "equalization" not in finding.message
    (spread,) = low_sqnr_findings([_row(40.0, -1e4, 0.0, -9960.0)], sqnr_threshold=20.0, weight_sqnr_threshold=25.0)
    assert "a few large values" in spread.message


class _MaskedScores(nn.Module):
    """MiniLM's attention mask in small: scores plus (1 - mask) * -1e4, a functional mul whose
    int8 output step is wider than its values' spread."""

    def __init__(self):
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x, mask):
        return self.out(torch.softmax(self.query(x) + (1.0 - mask) * -1e4, dim=-1))


def test_a_functional_layer_is_kept_float_by_its_function_and_the_plan_applies():
    """compare's keep-float fix for MiniLM's mask `mul` named a module "mul": the plan made from
    the report was refused ("names 3 module(s) this model does not have") and its mapping's
    set_module_name("mul", None) did nothing. A functional row now carries its function."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    from qlint.advice.plan import plan_from_report
    from qlint.linter.fixes import KeepFloat, KeepFloatFunction

    torch.manual_seed(0)
    model = _MaskedScores().eval()
    mask = torch.ones(4, 8)
    mask[:, 6:] = 0
    data = [(torch.randn(4, 8), mask) for _ in range(3)]
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), data[0])
    for batch in data:
        prepared(*batch)
    report = compare(model, convert_fx(prepared), data)
    rows = {row.name: row for row in report.layers}
    assert rows["mul"].functional and rows["mul"].function == "operator.mul"
    assert not rows["query"].functional and rows["query"].function is None
    fixes = [finding.suggestion for finding in report.findings if finding.target == "mul" and finding.suggestion]
    assert fixes and all(isinstance(fix, KeepFloatFunction) and fix.function == "operator.mul" for fix in fixes)
    module_fixes = [f.suggestion for f in report.findings if isinstance(f.suggestion, KeepFloat)]
    assert all(fix.module in dict(model.named_modules()) for fix in module_fixes)
    plan = plan_from_report(report)
    assert [entry.function for entry in plan.float_functions] == ["operator.mul"]
    assert not [entry.fqn for entry in plan.modules if entry.fqn not in dict(model.named_modules())]
    quantized = plan.quantize(model, data)  # was refused: the plan named modules the model lacks
    muls = [node for node in quantized.graph.nodes if node.name.startswith("mul")]
    assert muls and all(node.target is operator.mul for node in muls)  # float: not quantized.mul


class _TwoConvs(nn.Module):
    def __init__(self, shift: bool = False) -> None:
        super().__init__()
        self.shift = shift  # another float model: its inputs are rescaled before the first layer
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        if self.shift:
            x = x * 0.5 + 0.25
        return self.conv2(torch.relu(self.conv1(x)))


def _x86_quantized(model: nn.Module, data: list) -> tuple[nn.Module, nn.Module]:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (data[0],))
    for batch in data:
        prepared(batch)
    return prepared, convert_fx(copy.deepcopy(prepared))


def test_inputs_beyond_the_calibrated_range_are_the_quantized_models_own_input_quantization():
    """digit_cnn calibrated by torch's x86 flow, compared on brighter digits (inputs up to 4.8 where
    the input observer's range ends at 2.82): QL302 said conv_layers.0's inputs were other values 'as
    one built from another float model would', and the report warned QUANT was not quantized from
    this float model. The loss was the quantized model's own input quantization (9.2 dB)."""
    torch.manual_seed(0)
    model = _TwoConvs().eval()
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.rand(4, 3, 8, 8, generator=generator) for _ in range(3)]
    shifted = [batch * 3.0 for batch in calibration]
    for quantized in _x86_quantized(model, calibration):
        report = compare(model, quantized, shifted)
        (onset,) = [f for f in report.by_rule("QL302") if f.target == "conv1"]
        assert onset.data["kind"] == "input-quantization", onset.message
        assert not [n for n in report.notices if "not quantized from this float model" in n.message]
        assert "another float model" not in onset.message and "compare against the float model" not in onset.message
        assert "are clipped" in onset.message and "calibrate on data that covers the inputs' range" in onset.message
        row = {row.name: row for row in report.compare_rows()}["conv1"]
        measured = row.input_quantization
        assert measured is not None and measured.sqnr is not None and measured.match_sqnr is not None
        assert measured.sqnr < 20.0 and measured.match_sqnr > measured.sqnr + 20.0
        assert measured.low <= 0.0 < measured.high < 3.0 and measured.data_max > 2.9
        assert 0.2 < measured.clipped < 0.8  # x3 data on a grid that ends near 1 (prepared) or 2 (converted)
        assert f"{measured.clipped:.1%} of the input values" in onset.message
        assert {row.name: row for row in report.compare_rows()}["conv2"].input_quantization is None


def test_inputs_rescaled_by_another_float_model_are_still_other_inputs():
    """A quantized model built from a float model that rescales its inputs before the first layer
    (same weights): its first layer's input is not the float input on its grid, so QL302 keeps
    naming other inputs and the report says QUANT was not quantized from this float model."""
    torch.manual_seed(0)
    model = _TwoConvs().eval()
    other = copy.deepcopy(model)
    other.shift = True
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.rand(4, 3, 8, 8, generator=generator) for _ in range(3)]
    for quantized in _x86_quantized(other, calibration):
        report = compare(model, quantized, calibration)
        (onset,) = [f for f in report.by_rule("QL302") if f.target == "conv1"]
        assert onset.data["kind"] == "other-inputs", onset.message
        assert [n for n in report.notices if "not quantized from this float model" in n.message]
        measured = {row.name: row for row in report.compare_rows()}["conv1"].input_quantization
        assert measured is not None and measured.match_sqnr is not None and measured.match_sqnr < 20.0


def test_a_small_share_of_the_error_is_not_written_as_none():
    """QL302 said "only about 0% of the error is added here" for a share of 0.09 %: read as none."""
    from qlint.numeric.diagnose import error_onset_findings

    first = CompareRow(name="stem", kind="conv2d", sqnr_propagated=30.0, sqnr_shadow=60.0, extra={"predecessors": []})
    later = CompareRow(
        name="head", kind="linear", sqnr_propagated=2.0, sqnr_shadow=50.0, extra={"predecessors": ["stem"]}
    )
    (onset,) = error_onset_findings([first, later], 20.0, 6.0)
    assert 0 < onset.data["local_share"] < 0.01
    assert "about <1% of the error" in onset.message and "about 0%" not in onset.message
