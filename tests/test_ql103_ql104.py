"""Behavioural tests for QL103 (qconfig) and QL104 (per-channel)."""

import json
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import (
    DeQuantStub,
    QConfig,
    QConfigMapping,
    QuantStub,
    default_dynamic_qconfig,
    default_per_channel_weight_observer,
    get_default_qat_qconfig_mapping,
    get_default_qconfig,
    get_default_qconfig_mapping,
)
from torch.ao.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    default_fixed_qparams_range_0to1_observer,
    default_fixed_qparams_range_neg1to1_observer,
)
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx, prepare_qat_fx

import qlint
from qlint.core.backends import backend_info
from qlint.errors import ConfigError
from qlint.linter.engine import analyse
from qlint.linter.findings import Report, Severity
from qlint.linter.fixes import SetWeightObserver
from qlint.linter.rule import parse_doc_sections, seeded
from qlint.rules.ql103_qconfig import QConfigCheck
from qlint.rules.ql104_per_channel import PerChannel

BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")
TABLE_KEYS = {"node", "target", "kind", "input_dtype", "output_dtype", "observer", "ch_axis"}


def _image(channels=3, seed=0):
    return (torch.randn(2, channels, 8, 8, generator=torch.Generator().manual_seed(seed)),)


def _lint(model, inputs, code, backend="x86", mapping=None, **options):
    # These tests check each rule's own verdicts; the trial that measures impact (and turns
    # a finding below the threshold into info) is tested in test_impact.py.
    return qlint.lint(
        model,
        inputs,
        backend=backend,
        qconfig_mapping=mapping,
        select=[code],
        options={code: options} if options else None,
        trial_options={"enabled": False},
    )


def _kinds(report, code="QL103"):
    return [f.data["kind"] for f in report.by_rule(code)]


# --- every example, run locally ------------------------------------------------------------

EXAMPLES = []
for _rule in (QConfigCheck, PerChannel):
    _valid, _invalid = _rule.examples()
    EXAMPLES += [pytest.param(_rule, ex, True, id=f"{_rule.code}-valid-{i}") for i, ex in enumerate(_valid)]
    EXAMPLES += [pytest.param(_rule, ex, False, id=f"{_rule.code}-invalid-{i}") for i, ex in enumerate(_invalid)]


@pytest.mark.parametrize("rule,example,is_valid", EXAMPLES)
def test_examples(rule, example, is_valid):
    report = qlint.lint(
        example.build(),
        example.inputs(),
        backend=example.backend,
        qconfig_mapping=example.qconfig_mapping() if example.qconfig_mapping else None,
        select=[rule.code],
        options={rule.code: dict(example.options)} if example.options else None,
    )
    assert not report.skipped, report.skipped
    findings = report.by_rule(rule.code)
    if is_valid:
        assert findings == [], [f.message for f in findings]
    else:
        assert findings
        # a finding about several layers lists them in data["layers"] (QL104)
        targets = {f.target for f in findings} | {
            layer["target"] for f in findings for layer in f.data.get("layers", [])
        }
        assert set(example.flagged) <= targets, (example.flagged, targets)
        for finding in findings:
            assert finding.name == rule.name
            assert isinstance(finding.data["kind"], str) and isinstance(finding.data["node"], str)


@pytest.mark.parametrize("rule", [QConfigCheck, PerChannel], ids=["QL103", "QL104"])
def test_examples_and_docs_are_complete(rule):
    valid, invalid = rule.examples()
    assert len(valid) >= 2 and len(invalid) >= 3
    documented = set()
    for line in parse_doc_sections(rule.__doc__)["Options"].splitlines():
        if line.startswith("- `"):
            documented.add(line[3:].split("`", 1)[0])
    assert documented == set(rule.Options.model_fields)


@pytest.mark.parametrize("rule", [QConfigCheck, PerChannel], ids=["QL103", "QL104"])
def test_unknown_option_is_a_config_error(rule):
    with pytest.raises(ConfigError):
        _lint(seeded(_ConvStack)(), _image(), rule.code, no_such_option=True)


# --- QL103: the backends' own defaults are clean ----------------------------------------------


class _Everything(nn.Module):
    """conv, cat of two conv branches, sigmoid/tanh/hardsigmoid in module and functional form,
    linear, nn.Softmax and F.softmax."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        self.sig = nn.Sigmoid()
        self.tanh = nn.Tanh()
        self.fc = nn.Linear(16, 8)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        y = torch.cat([self.a(y), F.relu(self.b(y))], 1)
        y = y * self.sig(y) + torch.sigmoid(y) * self.tanh(y) + torch.tanh(y) * F.hardsigmoid(y)
        v = self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))
        return self.softmax(v), F.softmax(v, dim=-1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_mapping_is_clean(backend):
    model = seeded(_Everything)()
    explicit = _lint(model, _image(), "QL103", backend, get_default_qconfig_mapping(backend))
    implicit = _lint(model, _image(), "QL103", backend)  # no mapping: the engine uses the default
    assert explicit.by_rule("QL103") == [] and implicit.by_rule("QL103") == []
    assert not explicit.skipped


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])
def test_prepared_models_are_clean(backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(seeded(_Everything)(), get_default_qconfig_mapping(backend), _image())
        qat = prepare_qat_fx(seeded(_Everything)().train(), get_default_qat_qconfig_mapping(backend), _image())
    for model in (prepared, qat):
        report = _lint(model, _image(), "QL103", backend)
        assert report.by_rule("QL103") == [], [f.message for f in report.by_rule("QL103")]


# --- QL103: fixed-qparams ops --------------------------------------------------------------------


class _Gates(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)
        self.sig = nn.Sigmoid()
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        y = self.conv(x)
        return self.sig(y) + torch.tanh(y) + self.softmax(y) + F.softmax(y, dim=1)


def test_generic_observer_on_fixed_ops_names_the_backend_qparams():
    report = _lint(seeded(_Gates)(), _image(), "QL103", mapping=QConfigMapping().set_global(get_default_qconfig("x86")))
    fixed = {f.target: f for f in report.by_rule("QL103") if f.data["kind"] == "fixed-qparams-observer"}
    # F.softmax is not a fixed-qparams op for torch (neither the default mapping nor the
    # backend config lists it), so only the module softmax is reported.
    assert set(fixed) == {"sig", "tanh", "softmax"}
    zero_to_one, minus_one_to_one = (
        default_fixed_qparams_range_0to1_observer(),
        default_fixed_qparams_range_neg1to1_observer(),
    )
    assert fixed["sig"].data["expected_scale"] == pytest.approx(float(zero_to_one.scale))
    assert fixed["sig"].data["expected_zero_point"] == int(zero_to_one.zero_point)
    assert fixed["tanh"].data["expected_scale"] == pytest.approx(float(minus_one_to_one.scale))
    assert fixed["tanh"].data["expected_zero_point"] == int(minus_one_to_one.zero_point)
    assert fixed["tanh"].data["output_range"] == [-1.0, 1.0]
    assert fixed["sig"].suggestion.activation == "FixedQParamsObserver"
    assert fixed["sig"].data["observer"] == "HistogramObserver"
    assert all(f.severity is Severity.WARNING for f in fixed.values())
    assert "get_default_qconfig_mapping('x86')" in fixed["sig"].message
    rows = fixed["sig"].data["qconfig_table"]
    assert rows and set(rows[0]) == TABLE_KEYS and rows[0]["node"] == "sig"


def test_fixed_qparams_with_the_wrong_range_is_reported():
    tanh_qconfig = get_default_qconfig_mapping("x86").object_type_qconfigs[nn.Tanh]
    mapping = get_default_qconfig_mapping("x86").set_module_name("sig", tanh_qconfig)
    report = _lint(seeded(_Gates)(), _image(), "QL103", mapping=mapping)
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "fixed-qparams-mismatch"]
    assert finding.target == "sig"
    assert finding.data["scale"] == pytest.approx(float(default_fixed_qparams_range_neg1to1_observer().scale))
    assert finding.data["expected_scale"] == pytest.approx(float(default_fixed_qparams_range_0to1_observer().scale))


def test_qnnpack_qint8_path_does_not_need_fixed_qparams():
    # qnnpack's symmetric qint8 kernels accept any observer on sigmoid; only the quint8 path is fixed.
    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        weight=MinMaxObserver.with_args(
            dtype=torch.qint8, qscheme=torch.per_tensor_symmetric, quant_min=-127, quant_max=127
        ),
    )
    report = _lint(seeded(_Gates)(), _image(), "QL103", "qnnpack", QConfigMapping().set_global(qconfig))
    assert "fixed-qparams-observer" not in _kinds(report)
    assert report.by_rule("QL103") == []


def test_fixed_qparams_check_can_be_switched_off():
    mapping = QConfigMapping().set_global(get_default_qconfig("x86"))
    report = _lint(seeded(_Gates)(), _image(), "QL103", mapping=mapping, fixed_qparams=False)
    assert "fixed-qparams-observer" not in _kinds(report)


# --- QL103: backend support ---------------------------------------------------------------------


class _ConvStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(y.mean((2, 3)))


def test_one_global_mistake_is_one_finding_listing_every_op():
    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.qint8, reduce_range=True),
        weight=default_per_channel_weight_observer,
    )
    model = seeded(_ConvStack)()
    report = _lint(model, _image(), "QL103", mapping=QConfigMapping().set_global(qconfig))
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "activation-dtype"]
    assert finding.severity is Severity.ERROR
    graph = analyse(model, _image(), "x86", QConfigMapping().set_global(qconfig)).graph
    expected = [n.name for n in graph.ops() if backend_info("x86").dtype_options(n.kind)]
    assert finding.data["nodes"] == expected
    assert finding.data["dtype"] == "torch.qint8" and finding.data["supported"] == ["torch.quint8"]
    assert [row["node"] for row in finding.data["qconfig_table"]] == expected
    assert all(row["output_dtype"] == "torch.qint8" for row in finding.data["qconfig_table"])


def test_quint8_weights_are_an_error():
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True), weight=MinMaxObserver.with_args(dtype=torch.quint8)
    )
    report = _lint(seeded(_ConvStack)(), _image(), "QL103", mapping=QConfigMapping().set_global(qconfig))
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "weight-dtype"]
    assert finding.severity is Severity.ERROR
    assert finding.data["targets"] == ["conv1", "conv2", "fc"]
    assert finding.suggestion.dtype == "torch.qint8"


@pytest.mark.parametrize(
    "backend,severity", [("onednn", Severity.ERROR), ("x86", Severity.WARNING), ("fbgemm", Severity.WARNING)]
)
def test_affine_weights(backend, severity):
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=backend in ("x86", "fbgemm")),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_affine),
    )
    report = _lint(seeded(_ConvStack)(), _image(), "QL103", backend, QConfigMapping().set_global(qconfig))
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "weight-qscheme"]
    assert finding.severity is severity
    assert finding.suggestion.qscheme == "torch.per_tensor_symmetric"


def test_onednn_affine_weights_really_fail_to_convert():
    """The error the rule predicts for onednn is the one torch raises."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no onednn engine")
    from qlint.rules.ql103_qconfig import _gelu_sandwich, _onednn_affine_weights
    from qlint.rules.ql103_qconfig import _image as example_image

    model, inputs = _gelu_sandwich(), example_image()
    report = _lint(model, inputs, "QL103", "onednn", _onednn_affine_weights())
    assert any(f.severity is Severity.ERROR and f.data["kind"] == "weight-qscheme" for f in report.findings)
    previous = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "onednn"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare_fx(model, _onednn_affine_weights(), inputs)
            prepared(*inputs)
            with pytest.raises(RuntimeError, match="symmetric"):
                convert_fx(prepared)
    finally:
        torch.backends.quantized.engine = previous


def test_reduce_range_on_qnnpack_is_info_and_optional():
    mapping = QConfigMapping().set_global(get_default_qconfig("x86"))  # 7-bit activations
    report = _lint(seeded(_ConvStack)(), _image(), "QL103", "qnnpack", mapping)
    [waste] = [f for f in report.by_rule("QL103") if f.data["kind"] == "activation-reduce-range-waste"]
    assert waste.severity is Severity.INFO
    assert waste.data["targets"] == ["conv1", "conv2", "fc"]
    quiet = _lint(seeded(_ConvStack)(), _image(), "QL103", "qnnpack", mapping, report_wasted_reduce_range=False)
    assert "activation-reduce-range-waste" not in _kinds(quiet)


def test_explicit_seven_bit_range_counts_as_reduced():
    qconfig = QConfig(
        activation=HistogramObserver.with_args(quant_min=0, quant_max=127), weight=default_per_channel_weight_observer
    )
    report = _lint(seeded(_ConvStack)(), _image(), "QL103", "x86", QConfigMapping().set_global(qconfig))
    assert "activation-reduce-range" not in _kinds(report)
    full = QConfig(
        activation=HistogramObserver.with_args(reduce_range=False), weight=default_per_channel_weight_observer
    )
    report = _lint(seeded(_ConvStack)(), _image(), "QL103", "fbgemm", QConfigMapping().set_global(full))
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "activation-reduce-range"]
    assert finding.severity is Severity.WARNING
    assert finding.data["quant_range"] == [0, 255]


def test_per_channel_conv_transpose_is_an_error():
    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 1)
            self.up = nn.ConvTranspose2d(8, 8, 2, stride=2)
            self.out = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.out(self.up(self.conv(x)))

    report = _lint(seeded(Up)(), _image(), "QL103", "onednn", get_default_qconfig_mapping("onednn"))
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "weight-qscheme"]
    assert finding.target == "up" and finding.severity is Severity.ERROR
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="ConvTranspose"):
            prepare_fx(seeded(Up)(), get_default_qconfig_mapping("onednn"), _image())
    # x86's default mapping gives ConvTranspose a per-tensor qconfig: fine.
    assert _lint(seeded(Up)(), _image(), "QL103", "x86").by_rule("QL103") == []


# --- QL103: float islands -----------------------------------------------------------------------


class _Island(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(8 * 8 * 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv1(x)
        z = self.norm(torch.flatten(self.act(y), 1)).view(-1, 8, 8, 8)
        return self.conv2(z)


def test_float_island_reports_producers_consumers_and_all_members():
    mapping = get_default_qconfig_mapping("x86").set_module_name("act", None).set_module_name("norm", None)
    mapping.set_object_type(torch.flatten, None)
    report = _lint(seeded(_Island)(), _image(), "QL103", mapping=mapping)
    [island] = report.by_rule("QL103")
    assert island.data["kind"] == "float-island" and island.target == "act"
    assert island.data["island"] == ["act", "flatten", "norm"]
    assert island.data["producers"] == ["conv1"] and island.data["consumers"] == ["conv2"]
    assert island.data["unsupported_kinds"] == ["gelu", "layer_norm"]
    assert {row["node"] for row in island.data["qconfig_table"]} == {"conv1", "act", "flatten", "norm", "conv2"}
    assert all(set(row) == TABLE_KEYS for row in island.data["qconfig_table"])
    assert island.suggestion.like == "conv1"
    fewer = _lint(seeded(_Island)(), _image(), "QL103", mapping=mapping, min_island_ops=3)
    assert fewer.by_rule("QL103") == []


def test_shape_only_float_ops_are_not_islands():
    mapping = get_default_qconfig_mapping("x86").set_object_type(torch.flatten, None).set_object_type("view", None)
    report = _lint(seeded(_Island)(), _image(), "QL103", mapping=mapping)
    assert "float-island" not in _kinds(report)


def test_dynamic_op_between_static_ones_is_an_island():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 16)
            self.fc2 = nn.Linear(16, 16)
            self.fc3 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc3(self.fc2(self.fc1(x)))

    mapping = get_default_qconfig_mapping("x86").set_module_name("fc2", default_dynamic_qconfig)
    report = _lint(seeded(Mixed)(), (torch.randn(4, 16),), "QL103", mapping=mapping)
    [island] = report.by_rule("QL103")
    assert island.target == "fc2" and "dynamic" in island.message


class _EagerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(3, 8, 1)
        self.sig = nn.Sigmoid()
        self.dequant = DeQuantStub()
        self.act = nn.GELU()
        self.quant2 = QuantStub()
        self.conv2 = nn.Conv2d(8, 8, 1)
        self.dequant2 = DeQuantStub()

    def forward(self, x):
        y = self.sig(self.conv1(self.quant(x)))
        y = self.quant2(self.act(self.dequant(y)))
        return self.dequant2(self.conv2(y))


def test_eager_flow_island_and_no_fixed_qparams_false_alarm():
    model = seeded(_EagerNet)()
    model.qconfig = get_default_qconfig("x86")  # eager prepare never observes nn.Sigmoid with it
    report = _lint(model, _image(), "QL103")
    [island] = report.by_rule("QL103")
    assert island.data["kind"] == "float-island" and island.data["eager"] is True
    assert island.target == "act"
    assert island.data["producers"] == ["sig"] and island.data["consumers"] == ["conv2"]


# --- QL103: cat inputs --------------------------------------------------------------------------


class _Cat(nn.Module):
    def __init__(self, sigmoid_first=True):
        super().__init__()
        self.sigmoid_first = sigmoid_first
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.sig = nn.Sigmoid()

    def forward(self, x):
        gate = torch.flatten(self.sig(self.a(x)), 2)
        other = torch.flatten(torch.relu(self.b(x)), 2)
        parts = [gate, other] if self.sigmoid_first else [other, gate]
        return torch.cat(parts, 1)


def test_cat_after_fixed_qparams_input_clips_the_others_as_reported():
    model, (x,) = seeded(_Cat)(), _image()
    x = x * 4
    report = _lint(model, (x,), "QL103", mapping=get_default_qconfig_mapping("x86"))
    [finding] = report.by_rule("QL103")
    assert finding.data["kind"] == "cat-input-qparams" and finding.target == "cat"
    # shape ops (flatten) are looked through: the inputs are the sigmoid and the relu
    assert finding.data["first_input"] == "sig" and finding.data["mismatched"] == ["relu"]
    assert [i["matches_first"] for i in finding.data["inputs"]] == [True, False]
    low, high = finding.data["inputs"][0]["quant_range"]
    scale = finding.data["inputs"][0]["fixed_scale"]
    # What the finding says happens does happen: the relu half is clipped to [0, 255/256].
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), (x,))
        prepared(x)
        quantized = convert_fx(prepared)(x)
    reference = model(x)
    relu_half = slice(4, 8)
    assert float(reference[:, relu_half].max()) > 1.5
    assert float(quantized[:, relu_half].max()) <= (high - low) * scale + 1e-6


def test_cat_with_matching_inputs_is_clean_and_order_matters_for_the_advice():
    mapping = get_default_qconfig_mapping("x86")
    same = QConfigMapping().set_global(get_default_qconfig("x86")).set_object_type(nn.Sigmoid, None)
    assert "cat-input-qparams" not in _kinds(_lint(seeded(_Cat)(), _image(), "QL103", mapping=same))
    report = _lint(seeded(_Cat, False)(), _image(), "QL103", mapping=mapping)
    [finding] = [f for f in report.by_rule("QL103") if f.data["kind"] == "cat-input-qparams"]
    assert finding.data["first_input"] == "relu" and finding.data["mismatched"] == ["sig"]
    assert "clipped" not in finding.message


def test_cat_finding_survives_torch_export_and_json():
    model, inputs = seeded(_Cat)(), _image()
    program = torch.export.export(model, inputs)
    report = qlint.lint(
        model,
        inputs,
        backend="x86",
        qconfig_mapping=get_default_qconfig_mapping("x86"),
        select=["QL103", "QL104"],
        exported_program=program,
    )
    assert "cat-input-qparams" in _kinds(report)
    again = Report.model_validate_json(report.model_dump_json())
    assert again == report
    json.dumps([f.suggestion.model_dump(mode="json") for f in report.findings if f.suggestion])


# --- QL104 --------------------------------------------------------------------------------------


def _flagged(report) -> set:
    """The layers QL104 lists (it reports once per model)."""
    return {layer["target"] for f in report.by_rule("QL104") for layer in f.data["layers"]}


class _ConvBn(nn.Module):
    """A conv whose raw weights are balanced, but whose BN scales its channels 1..512."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        with torch.no_grad():
            self.bn.weight.copy_(2.0 ** torch.arange(8.0))

    def forward(self, x):
        return self.bn(self.conv(x))


def test_per_channel_reads_the_bn_folded_weights():
    model = seeded(_ConvBn)()
    [finding] = _lint(model, _image(), "QL104", mapping=_per_tensor()).by_rule("QL104")
    raw = model.conv.weight.detach().abs().reshape(8, -1).amax(1)
    folded = raw * model.bn.weight.detach() / torch.sqrt(model.bn.running_var + model.bn.eps)
    assert finding.data["folded_batch_norm"] == "bn"
    assert finding.data["channel_spread"] == pytest.approx(float(folded.max() / folded.min()), rel=1e-3)
    assert finding.data["channel_spread"] > 20 * float(raw.max() / raw.min())
    assert finding.data["bits_lost"] <= 8.0


class _Spread(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        with torch.no_grad():
            gains = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0]).view(6, 1, 1, 1)
            self.conv.weight.mul_(gains)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def _per_tensor(qscheme=torch.per_tensor_symmetric):
    return QConfigMapping().set_global(
        QConfig(
            activation=HistogramObserver.with_args(reduce_range=True),
            weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=qscheme),
        )
    )


def test_per_channel_evidence_matches_the_weights():
    model = seeded(_Spread)()
    report = _lint(model, _image(), "QL104", mapping=_per_tensor())
    [finding] = report.by_rule("QL104")  # the 1-output linear head gains nothing from per-channel
    absmax = model.conv.weight.detach().abs().reshape(6, -1).amax(1)
    assert finding.target == "conv" and finding.data["channels"] == 6
    assert finding.data["channel_spread"] == pytest.approx(float(absmax.max() / absmax.min()), rel=1e-3)
    # symmetric per-tensor vs per-channel: the narrowest channel's step grows by exactly the spread
    assert finding.data["resolution_loss"] == pytest.approx(finding.data["channel_spread"], rel=1e-3)
    assert finding.data["bits_lost"] == pytest.approx(math.log2(finding.data["resolution_loss"]), rel=1e-3)
    assert finding.data["narrowest_channel"] == int(absmax.argmin())
    assert finding.data["weight_qscheme"] == "torch.per_tensor_symmetric"
    assert finding.suggestion == SetWeightObserver(
        target="conv",
        node="conv",
        observer="PerChannelMinMaxObserver",
        qscheme="torch.per_channel_symmetric",
        ch_axis=0,
        dtype="torch.qint8",
    )
    # measured weight SQNR, recomputed by hand with torch's fake-quant ops
    flat = model.conv.weight.detach().reshape(6, -1)
    per_tensor = torch.fake_quantize_per_tensor_affine(flat, float(flat.abs().max()) / 127.5, 0, -128, 127)
    expected = 10 * math.log10(float(flat.pow(2).sum()) / float((flat - per_tensor).pow(2).sum()))
    assert finding.data["per_tensor_sqnr_db"] == pytest.approx(expected, abs=1e-3)
    assert finding.data["per_channel_sqnr_db"] > finding.data["per_tensor_sqnr_db"] + 5
    single = _lint(model, _image(), "QL104", mapping=_per_tensor(), min_channels=1)
    [both] = single.by_rule("QL104")  # one finding for the model, listing its layers
    assert {layer["target"] for layer in both.data["layers"]} == {"conv", "head"}
    assert both.suggestion.targets == ["conv", "head"]  # worst (largest measured gain) first


def test_affine_per_tensor_loss_uses_the_affine_step():
    model = seeded(_Spread)()
    report = _lint(model, _image(), "QL104", mapping=_per_tensor(torch.per_tensor_affine))
    [finding] = report.by_rule("QL104")
    weight = model.conv.weight.detach()
    affine_step = (max(float(weight.max()), 0.0) - min(float(weight.min()), 0.0)) / 255
    narrow_step = 2 * float(weight.abs().reshape(6, -1).amax(1).min()) / 255
    assert finding.data["resolution_loss"] == pytest.approx(affine_step / narrow_step, rel=1e-3)


def test_min_channel_spread_filters_on_evidence():
    model = seeded(_Spread)()
    spread = float(
        model.conv.weight.detach().abs().reshape(6, -1).amax(1).max()
        / model.conv.weight.detach().abs().reshape(6, -1).amax(1).min()
    )
    below = _lint(model, _image(), "QL104", mapping=_per_tensor(), min_channel_spread=spread * 0.9)
    above = _lint(model, _image(), "QL104", mapping=_per_tensor(), min_channel_spread=spread * 1.1)
    assert [f.target for f in below.by_rule("QL104")] == ["conv"]
    assert above.by_rule("QL104") == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_channel_defaults(backend):
    report = _lint(seeded(_ConvStack)(), _image(), "QL104", backend, get_default_qconfig_mapping(backend))
    flagged = _flagged(report)
    default_weight = get_default_qconfig(backend).weight()
    if "per_channel" in str(default_weight.qscheme):
        assert flagged == set()
    else:  # qnnpack's default is per-tensor although its kernels take per-channel weights
        assert flagged == {"conv1", "conv2", "fc"}


def test_per_channel_ignores_dynamic_fp16_and_transposed_layers():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(3, 8, 2, stride=2)
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(self.up(x).flatten(2)[..., :16])

    from torch.ao.quantization import float16_dynamic_qconfig

    mapping = get_default_qconfig_mapping("x86").set_object_type(nn.Linear, float16_dynamic_qconfig)
    report = _lint(seeded(Model)(), _image(), "QL104", mapping=mapping, include_dynamic=True)
    assert report.by_rule("QL104") == []


def test_per_channel_on_qat_prepared_model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qnnpack = prepare_qat_fx(seeded(_ConvStack)().train(), get_default_qat_qconfig_mapping("qnnpack"), _image())
        x86 = prepare_qat_fx(seeded(_ConvStack)().train(), get_default_qat_qconfig_mapping("x86"), _image())
    [finding] = _lint(qnnpack, _image(), "QL104", "qnnpack").by_rule("QL104")
    assert {layer["target"] for layer in finding.data["layers"]} == {"conv1", "conv2", "fc"}
    assert "FakeQuantize" in finding.data["weight_observer"]
    assert _lint(x86, _image(), "QL104", "x86").by_rule("QL104") == []


def test_per_channel_in_eager_flow_checks_modules_only():
    class Eager(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 8, 1)
            self.proj = nn.Parameter(torch.randn(4, 8))
            self.dequant = DeQuantStub()

        def forward(self, x):
            y = self.dequant(self.conv(self.quant(x))).mean((2, 3))
            return F.linear(y, self.proj)  # functional: eager mode never quantizes it

    model = seeded(Eager)()
    model.qconfig = get_default_qconfig("qnnpack")  # per-tensor weights
    report = _lint(model, _image(), "QL104", "x86")
    assert [f.target for f in report.by_rule("QL104")] == ["conv"]
    model.qconfig = get_default_qconfig("x86")
    assert _lint(model, _image(), "QL104", "x86").by_rule("QL104") == []
