"""QuantPlan: JSON round trip, format refusal, plan_from_report, exporters, CLI."""

import copy
import json
import math

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import (
    QConfig,
    QConfigMapping,
    get_default_qconfig,
    get_default_qconfig_mapping,
    qconfig_equals,
)
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qlint
from qlint.advice.export import PercentileObserver
from qlint.advice.plan import (
    ActivationSpec,
    EqualizationPair,
    FloatFunction,
    ModuleDecision,
    PlanFormatError,
    Provenance,
    QuantPlan,
    Rewrite,
    WeightSpec,
    default_plan,
    plan_from_report,
)
from qlint.cli.plan import emit_plan_outputs, plan_command
from qlint.errors import ConfigError

# --- models -------------------------------------------------------------------------------


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.relu2 = nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.fc2(self.relu(self.fc1(x))))


class LinearStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.fc2(self.fc1(x)))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.sigmoid = nn.Sigmoid()
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(x * self.sigmoid(self.fc(x)))


def _build(cls):
    torch.manual_seed(0)
    model = cls().eval()
    for m in model.modules():  # non-trivial BN statistics so folding matters
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model


def _inputs(cls):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4, 3, 8, 8, generator=g),) if cls is Cnn else (torch.randn(8, 16, generator=g),)


def _sqnr(ref, out):
    noise = (ref - out).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def _quantize(model, mapping, inputs, backend):
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = backend
    try:
        prepared = prepare_fx(copy.deepcopy(model), mapping, inputs)
        prepared(*inputs)
        converted = convert_fx(prepared)
        return converted, converted(*inputs)
    finally:
        torch.backends.quantized.engine = previous


def _prov(**kw):
    return [Provenance(**kw)]


def _rich_plan(backend="x86"):
    return QuantPlan(
        backend=backend,
        model="Mlp",
        activation=ActivationSpec(observer="moving_average", averaging_constant=0.02),
        weight=WeightSpec(per_channel=backend != "qnnpack"),
        modules=[
            ModuleDecision(
                fqn="fc1",
                activation=ActivationSpec(observer="percentile", percentile=99.9),
                weight=WeightSpec(per_channel=False),
                provenance=_prov(rule="QL104", target="fc1"),
            ),
            ModuleDecision(
                fqn="fc2",
                activation=ActivationSpec(observer="histogram", bins=1024, reduce_range=True),
                provenance=_prov(source="measurement", metric="sqnr_db", value=21.5),
            ),
            ModuleDecision(fqn="head", quantize=False, provenance=_prov(source="user", detail="accuracy")),
        ],
        equalization=[EqualizationPair(module="fc2", previous="fc1", provenance=_prov(rule="QL202", target="fc2"))],
        rewrites=[
            Rewrite(
                kind="fold_bn_into_functional_conv",
                modules=["conv", "bn"],
                params={"pattern": ["a"]},
                provenance=_prov(rule="QL101", target="conv"),
            )
        ],
        notes=["something"],
    )


# --- JSON ---------------------------------------------------------------------------------


_PER_TENSOR_WEIGHTS = QConfigMapping().set_global(
    QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
)


def test_plan_takes_only_fixes_that_were_not_measured_useless():
    """A fix the trial measured and found to gain less than the threshold stays out of the plan;
    a kept decision carries the gain lint measured for it."""
    report = qlint.lint(_build(Cnn), _inputs(Cnn), qconfig_mapping=_PER_TENSOR_WEIGHTS)
    suggested = [f for f in report.findings if f.suggestion is not None]
    useless = {f.fingerprint() for f in suggested if f.fix_measured_useless()}
    kept = {f.fingerprint(): f for f in suggested if not f.fix_measured_useless()}
    assert useless or kept, "the model should have findings with fixes"
    plan = plan_from_report(report)
    reasons = [p for d in plan.modules for p in d.provenance] + [p for r in plan.rewrites for p in r.provenance]
    assert not useless & {p.fingerprint for p in reasons}
    for p in reasons:
        finding = kept[p.fingerprint]
        assert p.gain_db == (finding.impact.db if finding.fix_measured() else None)


def test_json_round_trip_hand_built_and_from_report():
    plan = _rich_plan()
    assert QuantPlan.model_validate_json(plan.model_dump_json()) == plan
    assert QuantPlan.from_json(plan.model_dump_json(indent=2)) == plan
    report = qlint.lint(
        _build(Cnn),
        _inputs(Cnn),
        qconfig_mapping=_PER_TENSOR_WEIGHTS,
        trial_options={"enabled": False},  # unmeasured: every suggestion goes into the plan
    )
    from_report = plan_from_report(report)
    assert from_report.modules, "QL104 findings should become module decisions"
    assert QuantPlan.model_validate_json(from_report.model_dump_json()) == from_report
    raw = json.loads(from_report.model_dump_json())
    assert raw["type"] == "qlint.QuantPlan" and raw["schema_version"] == 2
    assert raw["flow"] == "fx"  # an nn.Module traced with torch.fx: the findings were measured with prepare_fx


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"type": "other.Plan"}, "not a qlint plan"),
        ({"schema_version": 99}, "newer than this qlint reads"),
        ({"schema_version": "1"}, "bad plan schema_version"),
    ],
)
def test_refuses_unknown_type_and_newer_version(change, fragment):
    raw = {**json.loads(default_plan("x86").model_dump_json()), **change}
    text = json.dumps(raw)
    for parse in (QuantPlan.from_json, QuantPlan.model_validate_json):
        with pytest.raises(PlanFormatError) as info:
            parse(text)
        assert isinstance(info.value, ConfigError)
        assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_content_is_a_one_line_config_error():
    raw = json.loads(default_plan("x86").model_dump_json())
    raw["activation"] = {"observer": "minmax", "bins": 10}
    with pytest.raises(PlanFormatError, match="bad plan at activation") as info:
        QuantPlan.from_json(json.dumps(raw))
    assert "\n" not in str(info.value)
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        QuantPlan.from_json("{")


def test_duplicate_module_decisions_are_rejected():
    with pytest.raises(ValueError, match="more than one decision"):
        QuantPlan(
            modules=[
                ModuleDecision(fqn="a", provenance=_prov(source="user")),
                ModuleDecision(fqn="a", quantize=False, provenance=_prov(source="user")),
            ]
        )


# --- exporters ----------------------------------------------------------------------------


def _planned_decisions(cls, backend):
    per_channel = backend != "qnnpack"
    if cls is Cnn:
        return [
            ModuleDecision(
                fqn="conv2",
                weight=WeightSpec(per_channel=not per_channel),
                activation=ActivationSpec(observer="percentile", percentile=99.5),
                provenance=_prov(rule="QL104", target="conv2"),
            ),
            ModuleDecision(fqn="fc", quantize=False, provenance=_prov(source="user")),
        ]
    if cls is Mlp:
        return [
            ModuleDecision(fqn="fc1", mode="dynamic", provenance=_prov(rule="QL201", target="fc1")),
            ModuleDecision(fqn="head", quantize=False, provenance=_prov(source="user")),
        ]
    return [
        ModuleDecision(
            fqn="sigmoid",
            activation=ActivationSpec(observer="fixed", scale=1.0 / 256.0, zero_point=0, quant_min=0, quant_max=255),
            provenance=_prov(rule="QL103", target="sigmoid"),
        ),
        ModuleDecision(
            fqn="out", activation=ActivationSpec(observer="minmax", symmetric=False), provenance=_prov(source="user")
        ),
    ]


@pytest.mark.parametrize("backend", ["x86", "qnnpack"])
@pytest.mark.parametrize("cls", [Cnn, Mlp, Gate])
def test_exported_mapping_quantizes_and_runs(cls, backend):
    model, inputs = _build(cls), _inputs(cls)
    plan = default_plan(backend, cls.__name__).model_copy(update={"modules": _planned_decisions(cls, backend)})
    plan = QuantPlan.model_validate(plan.model_dump())  # re-validate the copy
    mapping = plan.to_qconfig_mapping()
    converted, out = _quantize(model, mapping, inputs, backend)
    ref = model(*inputs)
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert _sqnr(ref, out) > 10.0
    kinds = {name: type(m).__module__ for name, m in converted.named_modules() if name}
    float_modules = [d.fqn for d in plan.modules if not d.quantize]
    for fqn in float_modules:
        assert kinds[fqn].startswith("torch.nn.modules"), f"{fqn} should stay float, is {kinds[fqn]}"
    if cls is Mlp:
        assert ".quantized.dynamic" in kinds["fc1"]  # fc1 (+relu) is dynamic
        assert kinds["fc2"].startswith("torch.ao.nn.quantized")  # static after a dynamic layer
    if cls is Cnn:  # conv-bn-relu fused and quantized
        assert type(converted.get_submodule("conv1")).__name__ == "ConvReLU2d"
        assert kinds["conv1"].startswith("torch.ao.nn.intrinsic.quantized")
    if cls is Gate:
        code = converted.code
        assert "sigmoid" in code and kinds["out"].startswith("torch.ao.nn.quantized")


def test_backend_defaults_export_to_the_default_mapping():
    for backend in ("x86", "qnnpack"):
        mapping = default_plan(backend).to_qconfig_mapping()
        assert qconfig_equals(mapping.global_qconfig, get_default_qconfig(backend))
        assert mapping.module_name_qconfigs == {}


def test_global_override_and_module_qconfigs():
    plan = _rich_plan()
    mapping = plan.to_qconfig_mapping()
    act = mapping.global_qconfig.activation()
    assert type(act).__name__ == "MovingAverageMinMaxObserver" and act.averaging_constant == 0.02
    fc1 = mapping.module_name_qconfigs["fc1"]
    assert isinstance(fc1.activation(), PercentileObserver) and fc1.weight().qscheme == torch.per_tensor_symmetric
    assert mapping.module_name_qconfigs["fc2"].activation().bins == 1024
    assert mapping.module_name_qconfigs["head"] is None


def test_int16_is_refused_where_the_backend_lacks_it():
    plan = default_plan("x86").model_copy(update={"activation": ActivationSpec(observer="minmax", dtype="int16")})
    with pytest.raises(ConfigError, match="int16"):
        plan.to_qconfig_mapping()


def _same_mapping(a: QConfigMapping, b: QConfigMapping) -> bool:
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and qconfig_equals(x, y))

    if not same(a.global_qconfig, b.global_qconfig):
        return False
    if list(a.module_name_qconfigs) != list(b.module_name_qconfigs):
        return False
    if not all(same(a.module_name_qconfigs[k], b.module_name_qconfigs[k]) for k in a.module_name_qconfigs):
        return False
    if list(a.object_type_qconfigs) != list(b.object_type_qconfigs):
        return False
    return all(same(a.object_type_qconfigs[k], b.object_type_qconfigs[k]) for k in a.object_type_qconfigs)


@pytest.mark.parametrize(
    "plan",
    [
        _rich_plan("x86"),
        _rich_plan("qnnpack"),
        default_plan("onednn"),
        default_plan("x86").model_copy(update={"modules": _planned_decisions(Gate, "x86")}),
    ],
)
def test_to_python_exec_builds_an_equivalent_mapping(plan):
    source = plan.to_python()
    namespace: dict = {}
    exec(compile(source, "qconfig.py", "exec"), namespace)
    assert _same_mapping(namespace["qconfig_mapping"], plan.to_qconfig_mapping())
    assert not _same_mapping(
        namespace["qconfig_mapping"], get_default_qconfig_mapping("fbgemm").set_module_name("zzz", None)
    )
    for decision in plan.modules:
        assert repr(decision.fqn) in source


def test_decisions_made_for_the_rewritten_model_stay_out_of_the_mapping_for_the_model_as_given():
    """EfficientNet-Lite0: QL101's fixed [0, 6] range on each functional conv assumes the BN folded
    into it first. The emitted file and report.qconfig_mapping() set it by module name on the
    model as given too, where prepare_fx put it on the conv's raw output (before the BN) and on
    the padded network input: 0.96 dB held-out -> -0.00 dB, each line saying "+9.56 dB"."""
    fixed = ActivationSpec(observer="fixed", quant_min=0, quant_max=127, scale=6 / 127, zero_point=0)
    finding = _prov(rule="QL101", target="conv", fingerprint="f1")
    plan = _rich_plan("x86")
    rewrite = plan.rewrites[0].model_copy(update={"provenance": finding})
    both = finding + _prov(rule="QL104", target="fc1", fingerprint="f2")
    decisions = [
        ModuleDecision(fqn="conv", activation=fixed, provenance=finding),  # made for the rewritten model
        ModuleDecision(fqn="fc1", activation=fixed, provenance=both),  # also asked for by a plain finding
    ]
    plan = plan.model_copy(update={"rewrites": [rewrite], "modules": decisions})
    assert plan.needs_rewrites(decisions[0]) and not plan.needs_rewrites(decisions[1])
    as_given, rewritten = plan.to_qconfig_mapping(), plan.to_qconfig_mapping(rewritten=True)
    assert "conv" not in as_given.module_name_qconfigs and "fc1" in as_given.module_name_qconfigs
    assert {"conv", "fc1"} <= set(rewritten.module_name_qconfigs)
    namespace: dict = {}
    exec(compile(plan.to_python(), "qconfig.py", "exec"), namespace)
    assert _same_mapping(namespace["qconfig_mapping"], as_given)
    assert _same_mapping(namespace["build_qconfig_mapping"](rewritten=True), rewritten)
    assert not _same_mapping(as_given, rewritten)


def test_equalization_mapping_drives_prepare_fx():
    from torch.ao.quantization.fx._equalize import default_equalization_qconfig  # private: reference only

    plan = _rich_plan("x86")
    with pytest.raises(ConfigError, match="equalization_qconfig"):
        plan.to_equalization_mapping()
    eq = plan.to_equalization_mapping(default_equalization_qconfig)
    assert list(eq.module_name_qconfigs) == ["fc2"]
    model, inputs = _build(LinearStack), _inputs(LinearStack)
    prepared = prepare_fx(
        copy.deepcopy(model), default_plan("x86").to_qconfig_mapping(), inputs, _equalization_config=eq
    )
    names = [type(m).__name__ for m in prepared.modules()]
    assert names.count("_InputEqualizationObserver") == 1  # only fc2, as planned
    prepared(*inputs)
    out = convert_fx(prepared)(*inputs)
    reference = prepare_fx(
        copy.deepcopy(model),
        get_default_qconfig_mapping("x86"),
        inputs,
        _equalization_config=QConfigMapping().set_module_name("fc2", default_equalization_qconfig),
    )
    reference(*inputs)
    assert out.shape == model(*inputs).shape and torch.equal(out, convert_fx(reference)(*inputs))
    namespace: dict = {}
    exec(plan.to_python(), namespace)
    # the emitted file hands torch's equalization to no one: the plan's equalization is qlint's rescale
    assert "build_equalization_mapping" not in namespace and "qlint fix" in namespace["__doc__"]
    assert default_plan("x86").to_equalization_mapping().module_name_qconfigs == {}


def test_percentile_observer_clips_outliers():
    data = torch.cat([torch.linspace(-1, 1, 10000), torch.tensor([50.0])])
    clipped, plain = PercentileObserver(percentile=99.9), MinMaxObserver()
    clipped(data), plain(data)
    assert clipped.max_val.item() < 1.01 and plain.max_val.item() == 50.0
    assert clipped.calculate_qparams()[0].item() < plain.calculate_qparams()[0].item()


# --- plan_from_report ----------------------------------------------------------------------


def test_plan_from_report_follows_findings_and_fixes_conversion():
    """QL105 flags per-channel ConvTranspose; the plan's mapping converts cleanly."""
    from qlint.linter.rule import seeded
    from qlint.rules.ql105_conversion_check import _Decoder, _global_per_channel_x86, _image

    build = seeded(_Decoder)
    report = qlint.lint(build(), _image(), qconfig_mapping=_global_per_channel_x86(), select=["QL105"])
    assert report.by_rule("QL105")[0].severity.value == "error"
    plan = plan_from_report(report)
    decision = plan.decision("up")
    assert decision is not None and decision.weight is not None and not decision.weight.per_channel
    assert decision.provenance[0].rule == "QL105" and decision.provenance[0].target == "up"
    fixed = qlint.lint(build(), _image(), qconfig_mapping=plan.to_qconfig_mapping(), select=["QL105"])
    # it converts and runs now; x86's int8 ConvTranspose2d then measures a noisy output, which
    # QL105 reports as a low output SQNR (not a conversion failure)
    [after] = fixed.by_rule("QL105")
    assert after.data["kind"] in ("conversion-ok", "low-output-sqnr") and "stage" not in after.data


def test_plan_from_report_maps_weight_and_fixed_qparams_suggestions():
    per_tensor = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    report = qlint.lint(
        _build(Gate),
        _inputs(Gate),
        qconfig_mapping=QConfigMapping().set_global(per_tensor),
        trial_options={"enabled": False},  # unmeasured: every suggestion goes into the plan
    )
    plan = plan_from_report(report)
    flagged_weights = {f.target for f in report.by_rule("QL104")}
    assert flagged_weights, "expected QL104 findings for per-tensor linear weights"
    for fqn in flagged_weights:
        assert plan.effective_weight(fqn).per_channel
        assert any(p.rule == "QL104" for p in plan.decision(fqn).provenance)
    fixed = [
        f
        for f in report.by_rule("QL103")
        if f.suggestion is not None and getattr(f.suggestion, "activation", None) == "FixedQParamsObserver"
    ]
    for f in fixed:
        spec = plan.effective_activation(f.suggestion.target)
        assert spec.observer == "fixed" and spec.scale == pytest.approx(f.suggestion.scale)
    converted, out = _quantize(_build(Gate), plan.to_qconfig_mapping(), _inputs(Gate), "x86")
    assert torch.isfinite(out).all()
    # the report's own shortcut makes the same decisions, on top of the mapping it was linted with
    # (a plan file cannot hold that mapping: it starts from the backend default, as does a report
    # read back from JSON)
    assert report.qconfig_mapping().global_qconfig is not None
    assert report.qconfig_mapping().global_qconfig.weight.p.keywords["qscheme"] == torch.per_tensor_symmetric
    assert report.qconfig_mapping().module_name_qconfigs.keys() == {d.fqn for d in plan.modules}
    again = type(report).model_validate_json(report.model_dump_json())
    assert _same_mapping(again.qconfig_mapping(), plan.to_qconfig_mapping())


# --- CLI ----------------------------------------------------------------------------------


def test_cli_show_qconfig_check_and_emit(tmp_path, capsys):
    report = qlint.lint(_build(Mlp), _inputs(Mlp), select=["QL105"])
    plan_path, py_path = tmp_path / "plan.json", tmp_path / "qconfig.py"
    plan = emit_plan_outputs(report, str(plan_path), str(py_path))
    assert QuantPlan.load(str(plan_path)) == plan
    namespace: dict = {}
    exec(py_path.read_text(), namespace)
    assert _same_mapping(namespace["qconfig_mapping"], plan.to_qconfig_mapping())

    rich = tmp_path / "rich.json"
    rich.write_text(_rich_plan().model_dump_json())
    assert plan_command(["show", str(rich)]) == 0
    shown = capsys.readouterr().out
    assert "fc1" in shown and "keep float" in shown and "QL104 on fc1" in shown
    assert plan_command(["show", str(rich), "--format", "json"]) == 0
    assert QuantPlan.from_json(capsys.readouterr().out) == _rich_plan()
    assert plan_command(["qconfig", str(rich), "-o", str(tmp_path / "m.py")]) == 0
    assert (tmp_path / "m.py").read_text() == _rich_plan().to_python()
    assert plan_command(["check", str(rich)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(_rich_plan().model_dump_json()), "schema_version": 7}))
    with pytest.raises(PlanFormatError):
        plan_command(["show", str(bad)])
    with pytest.raises(ConfigError):
        plan_command(["frobnicate"])


@pytest.mark.parametrize("name", ["nope.layer", "0.weight_typo"])
def test_a_plan_naming_a_module_the_model_lacks_is_refused_not_silently_ignored(name):
    """torch's QConfigMapping ignores a name it never meets: a plan made for another model would
    quantize as if it were empty. quantize names what is missing; a prefix of real modules is fine."""
    from qlint.advice.apply import QuantizeError

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    data = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    dynamic = ModuleDecision(fqn=name, mode="dynamic", provenance=[Provenance(source="user")])
    with pytest.raises(QuantizeError, match=f"does not have: {name} "):
        default_plan("x86").model_copy(update={"modules": [dynamic]}).quantize(model, data)
    fine = ModuleDecision(fqn="2", quantize=False, provenance=[Provenance(source="user")])
    quantized = default_plan("x86").model_copy(update={"modules": [fine]}).quantize(model, data)
    assert isinstance(quantized.get_submodule("2"), nn.Linear)  # kept float, as the plan says


@pytest.mark.parametrize(
    "weight, message",
    [
        ({"quant_min": 5, "quant_max": 1}, "quant_min must be below quant_max"),
        ({"ch_axis": 7}, "ch_axis"),
        ({"quant_min": -300, "quant_max": 127}, "outside qint8's -128..127"),
    ],
)
def test_plan_check_refuses_weight_settings_quantize_would_reject(weight, message):
    """'qlint plan check' passed these, and quantize then failed in convert_fx (IndexError)."""
    text = default_plan("x86").model_dump_json()
    data = json.loads(text)
    data["weight"].update(weight)
    with pytest.raises(PlanFormatError, match=message):
        QuantPlan.from_json(json.dumps(data))


def test_plan_check_refuses_an_activation_range_its_dtype_cannot_hold():
    """quant_max 1000 over quint8 calibrated without a word: a fix trial measured 31.6 -> 5.4 dB."""
    data = json.loads(default_plan("x86").model_dump_json())
    data["activation"].update({"quant_min": 0, "quant_max": 1000})
    with pytest.raises(PlanFormatError, match="outside quint8's 0..255"):
        QuantPlan.from_json(json.dumps(data))
    data["activation"].update({"quant_min": 0, "quant_max": 127})  # reduce_range's 7 bits: fine
    assert QuantPlan.from_json(json.dumps(data)).activation.quant_max == 127


def test_plan_check_counts_every_kind_of_decision(tmp_path, capsys):
    """It counted module decisions only ('1 module decisions'), as if rewrites and kept-float
    functions were not part of the plan."""
    user = [Provenance(source="user")]
    plan = default_plan("x86").model_copy(
        update={
            "modules": [ModuleDecision(fqn="fc", mode="dynamic", provenance=user)],
            "rewrites": [Rewrite(kind="view_to_reshape", modules=["view"], provenance=user)],
            "float_functions": [FloatFunction(function="operator.add", provenance=user)],
        }
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    assert plan_command(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "backend x86: 1 module decision, 0 equalization pairs, 1 rewrite, 1 float function)" in out


def test_plan_qconfig_says_which_decisions_only_the_rewritten_model_gets(run_main, tmp_path):
    """The emitted file's default mapping leaves QL101's rewrite-bound decisions out: the user is
    told, or a fix lint measured would silently not be applied."""
    finding = _prov(rule="QL101", target="conv", fingerprint="f1")
    plan = _rich_plan("x86")
    plan = plan.model_copy(
        update={
            "rewrites": [plan.rewrites[0].model_copy(update={"provenance": finding})],
            "modules": [ModuleDecision(fqn="conv", quantize=False, provenance=finding), *plan.modules[:1]],
        }
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    result = run_main("plan", "qconfig", path, "-o", tmp_path / "q.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1 decision of the plan (conv) is for the model its rewrites make" in result.stderr
    assert "build_qconfig_mapping(rewritten=True)" in result.stderr
    plain = plan.model_copy(update={"rewrites": []})
    path.write_text(plain.model_dump_json())
    quiet = run_main("plan", "qconfig", path, "-o", tmp_path / "q2.py", cwd=tmp_path)
    assert quiet.returncode == 0 and "rewrites make" not in quiet.stderr
