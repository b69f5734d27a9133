"""The trial of an exported (aten) graph runs torch's pt2e flow (prepare_pt2e / convert_pt2e with
torchao's X86InductorQuantizer), as a user of a .pt2 model would quantize it."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import (
    MinMaxObserver,
    QConfig,
    default_per_channel_weight_observer,
    default_weight_observer,
    get_default_qconfig_mapping,
)
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

import qlint
from qlint.core.intent import default_mapping
from qlint.core.sqnr import SqnrSums
from qlint.linter.fixes import SetActivationObserver
from qlint.linter.mapping import PercentileObserver
from qlint.measure.pt2e_trial import Pt2eBench, as_torch_layers, pt2e_blocker, quantizer_for


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.relu(self.bn(self.conv(x))).mean((2, 3)))


class _AudioNet(nn.Module):
    """conv1d (X86InductorQuantizer annotates conv2d only) and an LSTMCell (recurrent)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 5)
        self.cell = nn.LSTMCell(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h, _ = self.cell(torch.relu(self.conv(x)).mean(2))
        return self.head(h)


def _exported(model: nn.Module, example: torch.Tensor):
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():  # BN statistics that are not the identity
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return torch.export.export(model, (example,))


def _lint(program, batches, **kwargs):
    return qlint.lint(
        program.module(),
        (batches[0],),
        exported_program=program,
        calibration=batches,
        calibration_options={"quiet": True},
        **kwargs,
    )


def test_lint_of_an_exported_graph_measures_the_model_pt2e_builds():
    torch.manual_seed(1)
    batch = torch.randn(4, 3, 12, 12)
    program = _exported(_ConvNet(), batch)
    report = _lint(program, [batch], select=["QL105"], options={"QL105": {"report_success_sqnr": True}})
    assert report.trial is not None and report.trial.converted
    assert (report.trial.int8_ops, report.trial.weighted_ops) == (2, 2)
    # the reference: the same flow run by hand, calibrated and evaluated on the one batch
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(copy.deepcopy(program.module()), quantizer)
    prepared(batch)
    converted = convert_pt2e(prepared)
    sums = SqnrSums()
    sums.add(program.module()(batch), converted(batch))
    expected = sums.sqnr_db()
    assert expected is not None and 20 < expected < 80
    assert report.trial.output_sqnr_db == pytest.approx(expected, abs=2e-3)
    (finding,) = report.findings
    assert "prepare_pt2e" in finding.message and "convert_pt2e" in finding.message


def _conv_net_bench(seed: int):
    """A bench of the exported conv net, calibrated and evaluated on one batch; and the intended mapping."""
    torch.manual_seed(seed)
    batch = torch.randn(4, 3, 12, 12)
    program = _exported(_ConvNet(), batch)
    intended = default_mapping("x86")
    return Pt2eBench(lambda: copy.deepcopy(program.module()), "x86", [batch], [batch], "b", "b", intended), intended


def test_layers_are_named_by_module_and_the_last_one_carries_the_output_error():
    bench, mapping = _conv_net_bench(2)
    result = bench.run(mapping)
    assert result.converted and result.converter == "convert_pt2e"
    assert {layer.name for layer in result.layers} == {"conv", "fc"}
    fc = result.layer("fc")
    assert fc is not None
    assert fc.propagated_db == pytest.approx(result.output_sqnr_db, abs=1e-3)  # fc's output is the model's
    conv = result.layer("conv")
    # compared with the float conv after prepare_pt2e folded the BN into it, not before the BN
    assert conv is not None and conv.propagated_db is not None and conv.propagated_db > 25
    # the conv reads the graph input: what it gets in the int8 model is what its shadow run gets
    assert conv.shadow_db == pytest.approx(conv.propagated_db, abs=1e-6)


def test_shadow_and_activation_errors_follow_torch_ns_definitions():
    """The reference: the prepared graph's own observers, frozen into fake-quant by hand. The
    fc's shadow run gets the float mean rounded with its observer's qparams, and its weight
    rounded per channel; each activation is its float value rounded with its observer's qparams."""
    torch.manual_seed(3)
    batch = torch.randn(4, 3, 12, 12)
    program = _exported(_ConvNet(), batch)
    intended = default_mapping("x86")
    bench = Pt2eBench(lambda: copy.deepcopy(program.module()), "x86", [batch], [batch], "b", "b", intended)
    result = bench.run(intended)
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(copy.deepcopy(program.module()), quantizer)
    prepared(batch)
    observers = {
        node.args[0].name: prepared.get_submodule(node.target)
        for node in prepared.graph.nodes
        if node.op == "call_module" and "activation_post_process" in str(node.target)
    }
    captured = {}
    hooks = [
        observer.register_forward_pre_hook(lambda _m, args, name=name: captured.setdefault(name, args[0]))
        for name, observer in observers.items()
    ]
    with torch.no_grad():
        prepared(batch)
    for hook in hooks:
        hook.remove()

    def rounded(name):
        observer = observers[name]
        scale, zero_point = observer.calculate_qparams()
        if scale.numel() > 1:
            return torch.fake_quantize_per_channel_affine(
                captured[name], scale.float(), zero_point.int(), 0, observer.quant_min, observer.quant_max
            )
        return torch.fake_quantize_per_tensor_affine(
            captured[name], float(scale), int(zero_point), observer.quant_min, observer.quant_max
        )

    for activation in ("x", "mean"):
        sums = SqnrSums()
        sums.add(captured[activation], rounded(activation))
        measured = result.activation(activation)
        assert measured is not None and measured.sqnr_db == pytest.approx(sums.sqnr_db(), abs=1e-3)
        assert measured.levels == 256  # X86InductorQuantizer: uint8 over 0..255, no reduce_range
    fc = prepared.get_submodule("fc")
    expected = torch.nn.functional.linear(captured["mean"], fc.weight, fc.bias)
    shadow = torch.nn.functional.linear(rounded("mean"), rounded("fc_weight"), fc.bias)
    sums = SqnrSums()
    sums.add(expected, shadow)
    layer = result.layer("fc")
    assert layer is not None and layer.shadow_db == pytest.approx(sums.sqnr_db(), abs=1e-3)
    assert layer.shadow_db > layer.propagated_db  # its own error is part of what reaches its output


def test_a_keep_float_entry_reaches_the_quantizer_and_a_change_of_number_format_is_not_expressed():
    bench, intended = _conv_net_bench(3)
    kept = copy.deepcopy(intended).set_module_name("fc", None)
    result = bench.run(kept)
    assert [(layer.target, layer.reason) for layer in result.float_layers] == [("fc", "kept-float")]
    assert (result.int8_ops, result.weighted_ops) == (1, 2)
    weight = intended.global_qconfig.weight
    own_range = QConfig(activation=MinMaxObserver.with_args(quant_min=0, quant_max=100), weight=weight)
    own_weight = QConfig(activation=intended.global_qconfig.activation, weight=default_weight_observer)
    for qconfig in (own_range, own_weight):
        changed = copy.deepcopy(intended).set_module_name("fc", qconfig)
        assert quantizer_for(changed, intended, {"fc": "linear"}) is None
        assert bench.output_sqnr(changed) is None  # not run: pt2e would build the default
    changed_global = copy.deepcopy(intended).set_global(own_range)
    assert quantizer_for(changed_global, intended, {}) is None


def test_an_activation_observer_choice_reaches_the_input_edge_of_the_module_in_pt2e():
    """QL203's clipping observer for fc: X86InductorQuantizer's histogram observer on fc's input
    edge becomes a percentile-band observer, in the quantizer's own number format (0..255)."""
    bench, intended = _conv_net_bench(5)
    planned = intended.global_qconfig
    clip = QConfig(activation=PercentileObserver.with_args(percentile=99.0, reduce_range=True), weight=planned.weight)
    changed = copy.deepcopy(intended).set_module_name("fc", clip)
    quantizer = quantizer_for(changed, intended, {"conv": "conv2d", "fc": "linear"})
    assert quantizer is not None
    prepared = prepare_pt2e(bench.model_factory(), quantizer)
    for batch in bench.calibration:
        prepared(batch)
    observers = {
        node.args[0].name: prepared.get_submodule(node.target)
        for node in prepared.graph.nodes
        if node.op == "call_module" and "activation_post_process" in str(node.target)
    }
    chosen, graph_input = observers["mean"], observers["x"]
    assert chosen.percentile == 99.0 and (chosen.quant_min, chosen.quant_max) == (0, 255)
    assert type(graph_input).__name__ == "HistogramObserver"  # the conv's input keeps the quantizer's choice
    # the band it keeps is the one torch.ao's twin keeps on the same values
    captured = []
    hook = chosen.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    prepared(bench.calibration[0])
    hook.remove()
    twin = PercentileObserver(percentile=99.0, quant_min=0, quant_max=255)
    twin(captured[0])
    assert torch.allclose(chosen.calculate_qparams()[0], twin.calculate_qparams()[0])
    base, clipped = bench.output_sqnr(intended), bench.output_sqnr(changed)
    assert base is not None and clipped is not None and clipped != pytest.approx(base, abs=1e-6)


def test_ops_pt2e_leaves_float_are_reported_with_their_reason_and_no_trial_is_spent_on_them():
    torch.manual_seed(4)
    batches = [torch.randn(6, 1, 40) for _ in range(3)]
    program = _exported(_AudioNet(), batches[0])
    report = _lint(program, batches, select=["QL105", "QL106"], options={"QL105": {"report_success_sqnr": True}})
    assert report.trial is not None and report.trial.converted
    assert (report.trial.int8_ops, report.trial.weighted_ops) == (1, 3)
    by_target = {f.target: f for f in report.findings if f.rule == "QL106"}
    assert set(by_target) == {"conv", "cell"}
    assert "no annotation" in by_target["conv"].message
    assert "recurrent" in by_target["cell"].message
    for target, finding in by_target.items():
        assert "convert_pt2e" in finding.message and "prepare_fx" in finding.message  # the way out
        assert finding.data["layers"] == [target]
        # no fix exists in this flow: the op is measured as it runs (float), not as "kept float: 0 dB",
        # which would make the finding info and a model left all float read as having no problem
        assert finding.impact is not None and finding.impact.kind == "coverage" and finding.impact.db == 0.0
        assert finding.impact.basis == "stays-float" and finding.impact.int8_ops_gained == 0
        assert finding.severity.value == "warning"
    assert report.trial.fix_trials == 0
    (overall,) = [f for f in report.findings if f.rule == "QL105"]
    assert overall.data["kind"] == "mostly-float" and "only 1 of the model's 3" in overall.message


def test_non_x86_backends_and_a_missing_quantizer_say_why_no_trial_runs():
    reason = pt2e_blocker("qnnpack")
    assert reason is not None and "x86" in reason
    assert pt2e_blocker("x86") is None
    torch.manual_seed(5)
    batch = torch.randn(2, 3, 12, 12)
    program = _exported(_ConvNet(), batch)
    report = _lint(program, [batch], backend="qnnpack", select=["QL105"])
    assert report.trial is None
    assert any("X86InductorQuantizer" in skipped.reason for skipped in report.skipped)


class _SpikyNet(nn.Module):
    """fc1 passes its input through (identity weights), so one input feature's rare spikes
    reach fc2's input: QL203's outlier channel."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.eye(8))
            self.fc1.bias.zero_()

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_ql203_on_an_exported_graph_clips_the_layer_input_and_measures_that_fix():
    torch.manual_seed(6)
    batches = [torch.randn(64, 8) for _ in range(6)]
    for batch in batches:
        batch[0, 0] = 40.0  # one spike per batch in feature 0
    program = _exported(_SpikyNet(), batches[0])
    report = _lint(program, batches, select=["QL203"])
    findings = {f.target: f for f in report.findings if f.rule == "QL203" and f.data.get("kind") == "outlier"}
    assert set(findings) == {"fc1", "fc2"}  # the spike enters as fc1's input and passes on to fc2's
    for target, finding in findings.items():
        # in pt2e each input edge has an observer: the clip goes on the layer itself
        assert f"{target}'s input" in finding.message
        assert finding.suggestion == SetActivationObserver(targets=[target], percentile=99.99)
        assert finding.data["dtype_bits"] == 8  # X86InductorQuantizer's uint8, as the trial measured
        assert finding.impact is not None and finding.impact.basis == "fix-trial"  # the clip itself was run


class _PaddedConv(nn.Conv2d):
    """A custom nn.Conv2d subclass, as EfficientNet's Conv2dStaticSamePadding: it pads, then convolves."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), self.weight, self.bias)


class _PaddedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = _PaddedConv(3, 8, 3), _PaddedConv(8, 8, 3)
        self.act = nn.ReLU6()  # called twice
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.act(self.conv2(self.act(self.conv1(x)))).mean((2, 3)))


class _TorchLayersNet(nn.Module):
    """_PaddedNet as the fix makes it: torch's own Conv2d after a ZeroPad2d, one ReLU6 per call."""

    def __init__(self, padded: _PaddedNet) -> None:
        super().__init__()
        self.pad1, self.pad2 = nn.ZeroPad2d(1), nn.ZeroPad2d(1)
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)
        self.act1, self.act2 = nn.ReLU6(), nn.ReLU6()
        self.fc = padded.fc
        self.conv1.load_state_dict(padded.conv1.state_dict())
        self.conv2.load_state_dict(padded.conv2.state_dict())

    def forward(self, x):
        y = self.act2(self.conv2(self.pad2(self.act1(self.conv1(self.pad1(x))))))
        return self.fc(y.mean((2, 3)))


def test_layers_of_a_custom_conv_class_are_named_by_module_and_their_fix_is_measured():
    torch.manual_seed(7)
    batches = [torch.randn(4, 3, 10, 10) for _ in range(6)]
    model = _PaddedNet().eval()
    program = _exported(model, batches[0])
    report = _lint(program, batches, select=["QL106"])
    assert report.trial is not None and (report.trial.int8_ops, report.trial.weighted_ops) == (1, 3)
    (finding,) = [f for f in report.findings if f.rule == "QL106"]
    # module fqns, never aten node names: a plan entry on them reaches the quantizer
    assert finding.target == "conv1" and finding.data["layers"] == ["conv1", "conv2"]
    assert finding.data["called_by"] == [f"{_PaddedConv.__module__}.{_PaddedConv.__qualname__}"]
    assert finding.data["repeated_calls"] == ["act"]
    assert finding.impact is not None and finding.impact.kind == "coverage" and finding.impact.int8_ops_gained == 2

    # the measured fix is the model the fix builds: torch's layers, one module per call
    mapping = default_mapping("x86")
    bench = Pt2eBench(lambda: copy.deepcopy(program.module()), "x86", batches[:3], batches[3:], "c", "e", mapping)
    emulated = bench.variant(lambda: as_torch_layers(copy.deepcopy(program.module()), frozenset({"conv1", "conv2"})))
    measured = emulated.run(mapping, measure_layers=False)
    assert (measured.int8_ops, measured.weighted_ops) == (3, 3)
    fixed = _exported(_TorchLayersNet(model), batches[0]).module()
    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(fixed, quantizer)
    for batch in batches[:3]:
        prepared(batch)
    converted = convert_pt2e(prepared)
    sums = SqnrSums()
    with torch.no_grad():
        for batch in batches[3:]:
            sums.add(model(batch), converted(batch))
    assert measured.output_sqnr_db == pytest.approx(sums.sqnr_db(), abs=1e-4)


class _BlockWithHead(nn.Module):
    """A module whose own forward computes one conv and which holds a Linear child."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(F.conv2d(x, self.weight).mean((2, 3)))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _BlockWithHead()

    def forward(self, x):
        return self.block(x)


def test_a_module_is_named_as_a_layer_only_when_its_whole_subtree_holds_that_one_layer():
    from qlint.measure.pt2e_errors import weighted_ops

    batch = torch.randn(2, 3, 8, 8)
    program = _exported(_Outer(), batch)
    # `block` computes a conv and holds `block.fc`: an entry on `block` would reach both
    assert [(op.target, op.kind) for op in weighted_ops(program.module())] == [
        ("conv2d", "conv2d"),
        ("block.fc", "linear"),
    ]
    # the conv named by its node still gets its pt2e fix measured: as a torch layer of its own
    mapping = default_mapping("x86")
    bench = Pt2eBench(lambda: copy.deepcopy(program.module()), "x86", [batch], [batch], "c", "e", mapping)
    assert bench.run(mapping, measure_layers=False).int8_ops == 1
    fixed = bench.variant(lambda: as_torch_layers(copy.deepcopy(program.module()), frozenset({"conv2d"})))
    assert fixed.run(mapping, measure_layers=False).int8_ops == 2


def test_nested_positional_batches_are_measured_layer_by_layer():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fa, self.fb = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, pair):
            return self.fa(pair[0]) + self.fb(pair[1])

    torch.manual_seed(8)
    batch = ((torch.randn(4, 4), torch.randn(4, 4)),)
    program = torch.export.export(Pair().eval(), batch)
    mapping = default_mapping("x86")
    bench = Pt2eBench(lambda: copy.deepcopy(program.module()), "x86", [batch], [batch], "c", "e", mapping)
    result = bench.run(mapping)
    assert {layer.name for layer in result.layers} == {"fa", "fb"} and len(result.activations) == 2


class _TwoConv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Conv1d(1, 4, 3), nn.Conv1d(4, 4, 3)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.second(torch.relu(self.first(x))).mean(2))


def test_ops_of_one_kind_pt2e_cannot_quantize_are_one_finding_that_lists_them():
    torch.manual_seed(6)
    batches = [torch.randn(6, 1, 32) for _ in range(3)]
    report = _lint(_exported(_TwoConv1d(), batches[0]), batches, select=["QL106"])
    (finding,) = [f for f in report.findings if f.rule == "QL106"]
    assert finding.data["layers"] == ["first", "second"] and finding.data["op"] == "conv1d"
    assert "2 conv1d ops stay float after convert_pt2e (first, second)" in finding.message
    assert "quantizes them" in finding.message
    assert finding.severity.value == "warning" and finding.impact is not None and finding.impact.kind == "coverage"


def test_an_exported_program_is_linted_as_its_pt2_file_is():
    torch.manual_seed(7)
    batches = [torch.randn(4, 3, 12, 12) for _ in range(2)]
    program = _exported(_ConvNet(), batches[0])
    options = {"QL105": {"report_success_sqnr": True}}
    direct = qlint.lint(program, calibration=batches, select=["QL105"], options=options)  # its own example inputs
    spelled_out = _lint(program, batches, select=["QL105"], options=options)
    assert direct.trial is not None and spelled_out.trial is not None and direct.frontend == spelled_out.frontend
    assert direct.trial.output_sqnr_db == spelled_out.trial.output_sqnr_db
    assert "convert_pt2e" in direct.findings[0].message  # the pt2e trial, not prepare_fx on the module
    assert [f.message for f in direct.findings] == [f.message for f in spelled_out.findings]


def test_equalization_on_an_exported_graph_is_the_layer_kept_float_which_pt2e_can_apply():
    # half of the conv's input channels 50x wider than the rest: QL202's case; pt2e has no equalization
    generator = torch.Generator().manual_seed(8)
    scale = torch.tensor([50.0, 50.0, 1.0, 1.0]).view(1, 4, 1, 1)
    batches = [torch.randn(4, 4, 10, 10, generator=generator) * scale for _ in range(8)]
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(4, 8, 3)).eval()
    report = qlint.lint(torch.export.export(model, (batches[0],)), calibration=batches, select=["QL202"])
    (finding,) = [f for f in report.findings if f.rule == "QL202"]
    assert finding.suggestion is not None and finding.suggestion.action == "keep_float"
    assert "pt2e flow has no input-weight equalization" in finding.message
    assert finding.impact is not None and finding.impact.basis == "fix-trial"  # the suggested fix itself, applied
    # the same model as an nn.Module keeps torch's equalization as the fix
    module_report = qlint.lint(model, (batches[0],), calibration=batches, select=["QL202"])
    (module_finding,) = [f for f in module_report.findings if f.rule == "QL202"]
    assert module_finding.suggestion is not None and module_finding.suggestion.action == "equalize"


@pytest.mark.parametrize(
    ("layer", "shape", "until"),
    [
        (lambda: nn.Conv1d(4, 8, 3), (8, 4, 64), None),  # pt2e never quantizes conv1d
        # a conv2d of a custom class (EfficientNet's): quantized only once rewritten as torch's Conv2d
        (lambda: _PaddedConv(4, 8, 3), (8, 4, 8, 8), "until it is a torch.nn.Conv2d of its own"),
    ],
    ids=["conv1d", "custom-conv2d"],
)
def test_a_finding_on_a_layer_pt2e_leaves_float_puts_nothing_in_the_plan(layer, shape, until):
    # rare spikes in one input channel: QL203's outlier, on a layer pt2e does not quantize
    generator = torch.Generator().manual_seed(9)
    batches = []
    for _ in range(8):
        batch = torch.randn(*shape, generator=generator)
        batch[:, 0].view(shape[0], -1)[:, ::16] *= 40.0
        batches.append(batch)
    torch.manual_seed(9)
    model = nn.Sequential(layer()).eval()
    report = qlint.lint(torch.export.export(model, (batches[0],)), calibration=batches, select=["QL203"])
    flagged = [f for f in report.findings if f.rule == "QL203" and f.suggestion is not None]
    assert flagged, [f.message for f in report.findings]
    for finding in flagged:
        assert finding.severity.value == "info" and finding.impact is not None and finding.impact.db == 0.0
        assert finding.impact.basis == "stays-float" and "whatever the quantizer's settings" in finding.impact.detail
        assert until is None or until in finding.impact.detail
    assert report.suggestions().modules == []  # a fix of a float layer changes nothing: no decision


def test_a_fix_that_quantizes_a_layer_prepare_fx_left_float_stays_in_the_plan():
    # the contrast with pt2e: a qint32 activation qconfig leaves fc1 float after convert_fx, and the
    # QL103 fix (quint8 activations) quantizes it; keeping it float measures 0 dB, which bounds nothing

    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    qint32 = QConfig(
        activation=MinMaxObserver.with_args(dtype=torch.qint32), weight=default_per_channel_weight_observer
    )
    mapping = get_default_qconfig_mapping("x86").set_module_name("0", qint32)
    generator = torch.Generator().manual_seed(10)
    batches = [torch.randn(8, 8, generator=generator) for _ in range(8)]
    report = qlint.lint(model, (batches[0],), calibration=batches, qconfig_mapping=mapping, select=["QL103"])
    (finding,) = [f for f in report.findings if f.rule == "QL103" and f.target == "0"]
    assert finding.suggestion is not None
    assert [decision.fqn for decision in report.suggestions().modules] == ["0"]
    # its value is coverage, measured with the fix applied: one more op in int8, at its SQNR cost
    assert finding.impact is not None and finding.impact.basis == "fix-trial" and finding.impact.kind == "coverage"
    assert finding.impact.int8_ops_gained == 1 and finding.severity.value != "info"
    assert report.trial is not None and finding.impact.base_sqnr_db == pytest.approx(
        report.trial.output_sqnr_db, abs=1e-3
    )


def test_a_fallback_no_setting_fixes_reads_float_no_fix_here():
    from qlint.render.text import impact_text

    torch.manual_seed(6)
    batches = [torch.randn(6, 1, 32) for _ in range(3)]
    report = _lint(_exported(_TwoConv1d(), batches[0]), batches, select=["QL106"])
    (finding,) = [f for f in report.findings if f.rule == "QL106"]
    assert impact_text(finding) == ("float", "no fix here")


class _SharedConv(nn.Module):
    """One nn.Conv2d called twice: prepare_pt2e refuses the module ("more than one output node")."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.relu(self.conv(x)))


def test_a_module_called_twice_is_diagnosed_and_measured_with_a_module_per_call():
    torch.manual_seed(11)
    batches = [torch.randn(2, 4, 8, 8) for _ in range(3)]
    shared = _SharedConv().eval()
    report = _lint(_exported(shared, batches[0]), batches, select=["QL105"])
    (finding,) = report.findings
    assert finding.severity.value == "error" and finding.data["kind"] == "module-called-twice"
    assert "a module of its own" in finding.message
    trial = report.trial
    assert trial is not None and not trial.converted and trial.failed_stage == "prepare_pt2e"
    assert trial.workaround is not None and (trial.int8_ops, trial.weighted_ops) == (2, 2)
    # the reference: the model written by hand with a module per call (same weights), same flow
    two = _TwoConvs(copy.deepcopy(shared.conv), copy.deepcopy(shared.conv)).eval()
    options = {"QL105": {"report_success_sqnr": True}}
    split = _lint(_exported(two, batches[0]), batches, select=["QL105"], options=options)
    assert split.trial is not None and split.trial.converted and split.trial.output_sqnr_db is not None
    assert trial.output_sqnr_db == pytest.approx(split.trial.output_sqnr_db, abs=1e-3)


class _TwoConvs(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_importing_torchao_leaves_the_warning_filters_as_they_were():
    """torchao's import installs warning filters process-wide; qlint's lazy import of it (the
    first pt2e trial, in the user's process) gives the filters back. A fresh interpreter, since
    this one imported torchao above."""
    import subprocess
    import sys

    script = (
        "import warnings\n"
        "from qlint.measure.pt2e_trial import QUANTIZER_MODULE, import_torchao\n"
        "before = list(warnings.filters)\n"
        "import_torchao(QUANTIZER_MODULE)\n"
        "import sys\n"
        "print('torchao' in sys.modules, warnings.filters == before)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"], result.stdout
