"""QL105 conversion-check: names the failing node with a cause and a fix; reports SQNR on success."""

import copy
import math
import operator

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qlint
from qlint.advice.plan import plan_from_report
from qlint.core.function_paths import resolve_function
from qlint.core.sqnr import sqnr_db as output_sqnr
from qlint.linter.engine import analyse
from qlint.linter.fixes import KeepFloat, KeepFloatFunction, ViewToReshape
from qlint.linter.rule import seeded
from qlint.rules._ql105_onset import _functional_until_weighted
from qlint.rules.ql105_conversion_check import (
    _ConvFlatten,
    _ConvView,
    _Decoder,
    _global_per_channel_x86,
    _image,
    _Mlp,
    _rows,
    _Upsample,
)


def _ql105(model, inputs, backend="x86", mapping=None, options=None):
    report = qlint.lint(
        model,
        inputs,
        backend=backend,
        qconfig_mapping=mapping,
        select=["QL105"],
        options={"QL105": options} if options else None,
    )
    assert not report.skipped, report.skipped
    return report.by_rule("QL105")


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])
def test_view_on_channels_last_quantized_tensor(backend):
    before = torch.backends.quantized.engine
    (finding,) = _ql105(seeded(_ConvView)(), _image(), backend)
    assert torch.backends.quantized.engine == before  # restored
    assert finding.severity.value == "error" and finding.target == "view"
    assert finding.data["kind"] == "view-non-contiguous" and finding.data["stage"] == "quantized run"
    assert finding.data["op"] == "call_method" and finding.data["target"] == "view"
    assert "node 'view'" in finding.message and ".reshape" in finding.message
    assert finding.suggestion == ViewToReshape(node="view")


def test_op_without_quantized_kernel():
    (finding,) = _ql105(seeded(_Upsample)(), _image())
    assert finding.target == "interpolate" and finding.data["kind"] == "no-quantized-kernel"
    assert finding.data["target"] == "torch.nn.functional.interpolate"
    assert "QuantizedCPU" in finding.message and "keep it in float" in finding.message
    assert "set_object_type(torch.nn.functional.interpolate, None)" in finding.message


def test_qconfig_the_module_cannot_take():
    (finding,) = _ql105(seeded(_Decoder)(), _image(), mapping=_global_per_channel_x86())
    assert finding.target == "up" and finding.data["stage"] == "prepare_fx"
    assert finding.data["kind"] == "unsupported-qconfig" and finding.data["module_type"] == "ConvTranspose2d"
    assert "per-tensor weights" in finding.message
    assert finding.suggestion.qscheme == "torch.per_tensor_symmetric"


@pytest.mark.parametrize(
    "build,inputs,backend", [(seeded(_ConvFlatten), _image, "x86"), (seeded(_Mlp), _rows, "qnnpack")]
)
def test_success_reports_the_output_sqnr(build, inputs, backend):
    (finding,) = _ql105(build(), inputs(), backend)
    assert finding.severity.value == "info" and finding.data["kind"] == "conversion-ok"
    # independent reference: the same trial done by hand
    model, x = build(), inputs()
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = backend
    try:
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping(backend), x)
        prepared(*x)
        expected = output_sqnr(model(*x), convert_fx(prepared)(*x))
    finally:
        torch.backends.quantized.engine = previous
    assert math.isfinite(expected)
    assert finding.data["sqnr_db"] == pytest.approx(expected, abs=0.05)
    assert f"{expected:.1f} dB" in finding.message


def test_thresholds_turn_a_low_sqnr_into_a_warning_or_an_error():
    model, x = seeded(_ConvFlatten)(), _image()
    (ok,) = _ql105(model, x)
    sqnr = ok.data["sqnr_db"]
    (low,) = _ql105(model, x, options={"warn_below_db": sqnr + 1.0})
    assert low.severity.value == "warning" and f"below {sqnr + 1.0:g} dB" in low.message
    assert low.data["kind"] == "low-output-sqnr" and low.data["onset"] in {"conv", "fc"}
    # the best of the onset and the weighted layer upstream of it (the conv: its BN is folded into it)
    assert low.data["fix_target"] in {"conv", "fc"} and low.suggestion == KeepFloat(module=low.data["fix_target"])
    (bad,) = _ql105(model, x, options={"warn_below_db": sqnr + 2.0, "error_below_db": sqnr + 1.0})
    assert bad.severity.value == "error"
    assert _ql105(model, x, options={"report_success_sqnr": False}) == []


class _Collapse(torch.nn.Module):
    """One hidden channel is 10^4 times the others: a per-tensor scale leaves the rest no levels."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.fc1.weight[0] *= 1e4
            self.fc2.weight[:, 0] = 0.0  # the huge channel does not reach the output

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_destroyed_model_is_an_error_naming_where_the_error_starts():
    torch.manual_seed(0)
    model = _Collapse().eval()
    x = (torch.randn(64, 16, generator=torch.Generator().manual_seed(2)),)
    (finding,) = _ql105(model, x)
    assert finding.severity.value == "error", finding.message
    assert finding.data["sqnr_db"] < 10.0
    assert finding.target == "fc2" and finding.data["onset"] == "fc2"
    assert "The error starts at 'fc2'" in finding.message
    # fc2 adds little error itself, and neither fc2 nor its producer fc1 kept float alone helps
    # (only both do): the finding stays an error and says that no single fix applies.
    assert finding.impact is not None and finding.impact.kind == "diagnosis"
    assert finding.impact.db < 0.5 and "No single layer kept float recovers it" in finding.message


def test_output_sqnr_definition():
    from qlint.core.sqnr import SQNR_CAP_DB

    ref = torch.tensor([3.0, 4.0])
    assert output_sqnr(ref, ref) == SQNR_CAP_DB  # error-free: capped so that JSON stays finite
    assert output_sqnr(ref, ref + torch.tensor([1.0, 0.0])) == pytest.approx(10 * math.log10(25.0))
    assert output_sqnr((ref, {"a": ref}), (ref, {"a": ref * 0})) == pytest.approx(10 * math.log10(2.0))


def test_a_view_failure_is_measured_with_the_reshape_it_suggests():
    """The trial fails as intended on `.view`; it is then measured with views as reshapes (identical
    in float), so QL105 gives the SQNR its fix reaches and the other rules still get impacts."""
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(2, 3, 8, 8, generator=generator) for _ in range(6)]
    report = qlint.lint(seeded(_ConvView)(), _image(), calibration=data)
    assert report.trial is not None and not report.trial.converted
    assert report.trial.failed_stage == "quantized run" and ".reshape at view" in report.trial.workaround
    [finding] = report.by_rule("QL105")
    assert finding.data["kind"] == "view-non-contiguous" and finding.severity.value == "error"
    assert finding.impact is not None and finding.impact.kind == "diagnosis"
    # by hand: torch's pass with the view replaced by reshape, on the trial's own split
    model = torch.fx.symbolic_trace(seeded(_ConvView)())
    for node in model.graph.nodes:
        if node.op == "call_method" and node.target == "view":
            node.target = "reshape"
    model.recompile()
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (data[0],))
        with torch.no_grad():
            for batch in data[:3]:
                prepared(batch)
            converted = convert_fx(prepared)
            expected = output_sqnr([model(b) for b in data[3:]], [converted(b) for b in data[3:]])
    finally:
        torch.backends.quantized.engine = previous
    assert finding.impact.fixed_sqnr_db == pytest.approx(expected, abs=0.01)
    # what the user reads: from a failure to the fixed SQNR, not a "gain" of the whole SQNR
    from qlint.render.text import impact_text, summary_line

    assert finding.impact.base_sqnr_db is None
    assert impact_text(finding)[0] == f"fails → {expected:.1f} dB"
    assert f"QL105 view fails → {expected:.1f} dB" in summary_line(report)
    assert f"{expected:.1f} → {expected:.1f} dB" not in summary_line(report)
    # the failure is the user's intended quantization failing, never "as intended"
    from qlint.render.text import trial_line

    lines = summary_line(report) + " " + (trial_line(report) or "")
    assert "Quantized as you intend, the model fails at quantized run (QL105)" in lines
    assert "as intended" not in lines
    # in the plan, the view fix made a failing model run: no "gain" of the whole SQNR either
    from qlint.advice.plan import plan_from_report
    from qlint.advice.verify_prune import decisions_of

    plan = plan_from_report(report)
    [why] = next(r for r in plan.rewrites if r.kind == "view_to_reshape").provenance
    assert why.gain_db is None and why.value == pytest.approx(report.trial.output_sqnr_db, abs=1e-3)
    assert why.describe() == f"QL105 on view, measured fails → {why.value:.2f} dB"
    assert decisions_of(plan)[-1].measured_gain == math.inf  # verify's pruning tries it last


class _MaskedAttention(nn.Module):
    """Attention with an additive padding mask, ``(1 - mask) * -10000``, as BERT-style encoders
    build it: quantized, the mask op's range loses the -10000s, and the add that applies the
    mask quantizes the same values again with a range of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = (1.0 - mask[:, None, :]) * -10000.0
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0 + bias
        return self.out(scores.softmax(-1) @ self.v(x))


def test_an_additive_mask_is_kept_float_with_the_ops_that_apply_it():
    torch.manual_seed(0)
    model = _MaskedAttention().eval()
    x = torch.randn(8, 12, 16, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(8, 12)
    mask[:, 9:] = 0  # three padding tokens in every sequence
    report = qlint.lint(model, (x, mask), select=["QL105"])
    (finding,) = report.by_rule("QL105")
    assert finding.severity.value == "error" and finding.data["onset"] == "mul", finding.message
    fix = finding.suggestion
    assert isinstance(fix, KeepFloatFunction) and fix.function == "operator.mul"
    assert "operator.add" in fix.with_functions  # the mul kept float alone leaves the add to lose the mask
    functions = [operator.mul, *(resolve_function(path) for path in fix.with_functions)]
    # by hand: torch's pass with those functions float, calibrated and evaluated on the example
    mapping = get_default_qconfig_mapping("x86")
    for function in functions:
        mapping.set_object_type(function, None)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        prepared = prepare_fx(copy.deepcopy(model), mapping, (x, mask))
        with torch.no_grad():
            prepared(x, mask)
            expected = output_sqnr(model(x, mask), convert_fx(prepared)(x, mask))
    finally:
        torch.backends.quantized.engine = previous
    assert finding.impact is not None and finding.impact.fixed_sqnr_db == pytest.approx(expected, abs=0.01)
    assert finding.impact.db > 10.0
    plan = plan_from_report(report)
    assert {resolve_function(kept.function) for kept in plan.float_functions} == set(functions)


class _ScaledFunctionalConvs(nn.Module):
    """A functional op between two functional convs (F.conv2d on a module's own weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(3, 8, 3, padding=1)
        self.w1, self.w2 = nn.Parameter(torch.randn(8, 8, 3, 3)), nn.Parameter(torch.randn(8, 8, 3, 3))
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c0(x) * 3.0
        y = nn.functional.conv2d(y, self.w1, None, [1, 1], [1, 1], [1, 1], 1) + 1.0
        y = torch.sigmoid(nn.functional.conv2d(y, self.w2, None, [1, 1], [1, 1], [1, 1], 1))
        return self.fc(y.mean((2, 3)))


def test_the_onset_search_never_walks_past_a_functional_conv():
    model = _ScaledFunctionalConvs().eval()
    analysis = analyse(model, (torch.randn(1, 3, 8, 8),), "x86")
    graph, traced = analysis.graph, analysis.traced.graph_module
    function_of = {n.name: n.target for n in traced.graph.nodes if n.op == "call_function" and n.name in graph}
    [mul] = [n for n in graph.ops() if function_of.get(n.name) is operator.mul]
    downstream, _ = _functional_until_weighted(graph, [mul], function_of, upstream=False)
    assert downstream == []  # the conv right after the mul closes the path: nothing of it, nothing past it
    [add] = [n for n in graph.ops() if function_of.get(n.name) is operator.add]
    upstream, layer = _functional_until_weighted(graph, [add], function_of, upstream=True)
    assert upstream == [] and layer is not None and function_of.get(layer.name) is nn.functional.conv2d


def test_a_model_left_all_float_reads_exact_not_the_200_db_cap():
    """Nothing quantized (here an empty mapping; a .pt2 of Conv1d layers under the x86 pt2e
    quantizer did the same): the output is error-free and was printed as 'output SQNR 200.0 dB'."""
    from torch.ao.quantization import QConfigMapping

    from qlint.core.sqnr import SQNR_CAP_DB
    from qlint.render.text import trial_line

    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))().eval()
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(8, 4, generator=generator) for _ in range(8)]
    report = qlint.lint(model, (data[0],), calibration=data, qconfig_mapping=QConfigMapping())
    assert report.trial is not None and report.trial.output_sqnr_db == SQNR_CAP_DB  # stored at the cap
    [finding] = report.by_rule("QL105")
    for text in (trial_line(report) or "", finding.message):
        assert "exact (no error)" in text, text
        assert "200" not in text


class _TwoOutputs(nn.Module):
    """A probability and a large state, as silero_vad returns: pooled by power, the state decides."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.prob = nn.Linear(16, 1)
        self.state = nn.Linear(16, 32)

    def forward(self, x):
        hidden = torch.relu(self.trunk(x))
        return torch.sigmoid(self.prob(hidden)), 10 * self.state(hidden)


def test_the_trial_reports_each_output_tensor_where_the_output_holds_several():
    from qlint.core.sqnr import sqnr_db
    from qlint.render.text import trial_line

    model = seeded(_TwoOutputs)().eval()
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(16, 8, generator=generator) for _ in range(8)]
    report = qlint.lint(model, (data[0],), calibration=data, select=["QL105"])
    trial = report.trial
    assert trial is not None and trial.output_tensor_sqnr_db is not None and len(trial.output_tensor_sqnr_db) == 2
    # by hand: torch's pass, calibrated and evaluated on the trial's split
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "x86"
    try:
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (data[0],))
        with torch.no_grad():
            for batch in data[:4]:
                prepared(batch)
            converted = convert_fx(prepared)
            expected = [model(b) for b in data[4:]]
            got = [converted(b) for b in data[4:]]
    finally:
        torch.backends.quantized.engine = previous
    for index in range(2):
        by_hand = sqnr_db([e[index] for e in expected], [g[index] for g in got])
        assert trial.output_tensor_sqnr_db[index] == pytest.approx(by_hand, abs=0.01)
    assert trial.output_sqnr_db == pytest.approx(sqnr_db(expected, got), abs=0.01)
    assert "the powers of 2 output tensors pooled" in (trial_line(report) or "")
    single = qlint.lint(seeded(_ConvView)(), _image(), select=["QL105"])
    assert single.trial is not None and single.trial.output_tensor_sqnr_db is None
