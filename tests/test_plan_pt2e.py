"""pt2e export of a plan (torchao, the extra qlint[pt2e], is in the test extra: these run in CI)."""

import copy

import pytest
import torch
import torch.nn as nn
import torchao.quantization.pt2e.quantize_pt2e as pt2e

from qlint.core.sqnr import SqnrSums
from qlint.measure.metrics import sqnr_db


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.head(torch.relu(self.fc(y)))


def _quantize(model, quantizer, batches):
    exported = torch.export.export(copy.deepcopy(model), (batches[0],)).module()
    prepared = pt2e.prepare_pt2e(exported, quantizer)
    for batch in batches:
        prepared(batch)
    return pt2e.convert_pt2e(prepared)


def test_plan_exports_to_a_working_pt2e_quantizer():
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan

    torch.manual_seed(0)
    model = Net().eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    base = default_plan("x86")
    keep_head = base.model_copy(
        update={
            "modules": [
                ModuleDecision(fqn="head", quantize=False, provenance=[Provenance(source="user", detail="test")])
            ]
        }
    )

    converted = _quantize(model, keep_head.to_pt2e_quantizer(), batches)
    with torch.no_grad():
        reference, output = model(batches[0]), converted(batches[0])
    assert sqnr_db(reference, output) > 20
    # the keep-float decision reached the quantizer: head's linear runs on float weights
    code = converted.code
    assert code.count("quantize_per_tensor") > 0
    everything = _quantize(model, base.to_pt2e_quantizer(), batches)
    assert everything.code.count("dequantize") > code.count("dequantize")


def test_non_x86_backend_is_refused_with_a_clear_error():
    from qlint.advice.plan import default_plan
    from qlint.errors import ConfigError

    with pytest.raises(ConfigError, match="XNNPACK"):
        default_plan("qnnpack").to_pt2e_quantizer()


def test_an_exported_observer_choice_builds_the_model_the_trial_measured():
    """A plan clipping fc's input (QL203's fix): the exported quantizer converts to the same
    model, to the last bit of output SQNR, as the pt2e trial of the plan's mapping."""
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan
    from qlint.core.intent import default_mapping
    from qlint.measure.pt2e_trial import Pt2eBench

    torch.manual_seed(1)
    model = Net().eval()
    batches = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    batches[1][0, 0, 0, 0] = 40.0  # a spike the clipping observer saturates
    base = default_plan("x86")
    clip = base.activation.changed(observer="percentile", percentile=99.0)
    source = Provenance(source="user", detail="test")
    plan = base.model_copy(update={"modules": [ModuleDecision(fqn="fc", activation=clip, provenance=[source])]})
    quantizer = plan.to_pt2e_quantizer()
    converted = _quantize(model, quantizer, batches)
    program = torch.export.export(copy.deepcopy(model), (batches[0],))
    bench = Pt2eBench(lambda: program.module(), "x86", batches, batches, "c", "e", default_mapping("x86"))
    measured = bench.output_sqnr(plan.to_qconfig_mapping())
    sums = SqnrSums()
    with torch.no_grad():
        for batch in batches:
            sums.add(model(batch), converted(batch))
    assert measured is not None and measured == pytest.approx(sums.sqnr_db(), abs=1e-6)
    unclipped = bench.output_sqnr(default_plan("x86").to_qconfig_mapping())
    assert unclipped is not None and unclipped != pytest.approx(measured, abs=1e-3)  # the choice changed the model


class PooledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)
        self.relu, self.relu2, self.pool = nn.ReLU(), nn.ReLU(), nn.MaxPool2d(2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.relu2(self.conv2(self.pool(self.relu(self.conv1(x)))))
        return self.fc(y.mean((2, 3)))


def test_a_clipping_choice_reaches_the_observer_a_max_pool_shares():
    """conv2 reads conv1's ReLU output through a max-pool, whose int8 output shares its input's
    observer (and prepare_pt2e joins observers of one tensor by number format alone): the
    choice must change that shared observer, and nothing else, in the trial and the export alike."""
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan
    from qlint.core.intent import default_mapping
    from qlint.measure.pt2e_trial import Pt2eBench

    torch.manual_seed(2)
    model = PooledNet().eval()
    batches = [torch.randn(4, 3, 14, 14) for _ in range(3)]
    base = default_plan("x86")
    clip = base.activation.changed(observer="percentile", percentile=99.0)
    source = Provenance(source="user", detail="test")
    plan = base.model_copy(update={"modules": [ModuleDecision(fqn="conv2", activation=clip, provenance=[source])]})
    program = torch.export.export(copy.deepcopy(model), (batches[0],))
    prepared = pt2e.prepare_pt2e(copy.deepcopy(program.module()), plan.to_pt2e_quantizer())
    kinds = {
        node.args[0].name: type(prepared.get_submodule(node.target)).__name__
        for node in prepared.graph.nodes
        if node.op == "call_module"
        and "activation_post_process" in str(node.target)
        and "weight" not in node.args[0].name
    }
    assert kinds["max_pool2d"] == kinds["relu"] == "Pt2ePercentileObserver"  # the pool's shared observer
    assert kinds["x"] == "HistogramObserver" and kinds["mean"] == "HistogramObserver"  # the others keep theirs
    bench = Pt2eBench(lambda: program.module(), "x86", batches, batches, "c", "e", default_mapping("x86"))
    measured = bench.output_sqnr(plan.to_qconfig_mapping())
    converted = _quantize(model, plan.to_pt2e_quantizer(), batches)
    sums = SqnrSums()
    with torch.no_grad():
        for batch in batches:
            sums.add(model(batch), converted(batch))
    assert measured is not None and measured == pytest.approx(sums.sqnr_db(), abs=1e-6)
    # the default keeps all four int8 ops (the choice must not break conv2's fusion with its ReLU)
    default = bench.run(default_mapping("x86"), measure_layers=False)
    chosen = bench.run(plan.to_qconfig_mapping(), measure_layers=False)
    assert chosen.int8_ops == default.int8_ops == 3


class FanOutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0, self.a, self.b = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.conv0(x))
        return self.a(y) + self.b(y)


def test_an_observer_choice_belongs_to_the_tensor_every_reader_shares():
    """Choosing for `a` or for `b` gives their one input tensor the observer, whichever is chosen
    (prepare_pt2e gives a tensor one observer); the outputs of the chosen layer keep theirs."""
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan

    model = FanOutNet().eval()
    batch = torch.randn(2, 3, 10, 10)
    program = torch.export.export(copy.deepcopy(model), (batch,))
    base = default_plan("x86")
    clip = base.activation.changed(observer="percentile", percentile=99.0)
    source = Provenance(source="user", detail="test")
    for chosen in ("a", "b"):
        plan = base.model_copy(update={"modules": [ModuleDecision(fqn=chosen, activation=clip, provenance=[source])]})
        prepared = pt2e.prepare_pt2e(copy.deepcopy(program.module()), plan.to_pt2e_quantizer())
        kinds = {}
        for node in prepared.graph.nodes:
            if node.op == "call_module" and "activation_post_process" in str(node.target):
                readers = tuple(sorted(user.name for user in node.users))
                kinds[(node.args[0].name, readers)] = type(prepared.get_submodule(node.target)).__name__
        assert kinds[("relu", ("conv2d_1", "conv2d_2"))] == "Pt2ePercentileObserver", chosen
        outputs = [kind for (producer, _), kind in kinds.items() if producer in ("conv2d_1", "conv2d_2")]
        assert outputs and all(kind == "HistogramObserver" for kind in outputs), chosen


def test_a_dynamic_decision_beside_static_quantization_is_a_gap_not_a_silent_default():
    """X86InductorQuantizer skips a dynamic config beside static ones (with a warning): the
    export says so, and the trial does not run it (it would measure the default)."""
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan
    from qlint.advice.pt2e import pt2e_gaps
    from qlint.core.intent import default_mapping
    from qlint.measure.pt2e_trial import quantizer_for

    source = Provenance(source="user", detail="test")
    plan = default_plan("x86").model_copy(
        update={"modules": [ModuleDecision(fqn="fc", mode="dynamic", provenance=[source])]}
    )
    assert [fqn for fqn, _ in pt2e_gaps(plan)] == ["fc"]
    with pytest.warns(UserWarning, match="leaves out 1 plan decision"):
        plan.to_pt2e_quantizer()
    assert quantizer_for(plan.to_qconfig_mapping(), default_mapping("x86"), {"fc": "linear"}) is None
    only_dynamic = plan.model_copy(update={"float_by_default": True})
    assert pt2e_gaps(only_dynamic) == []  # torch's quantize_dynamic recipe: every entry dynamic


def test_compare_names_a_pt2e_converted_model_as_such():
    """compare's report called a convert_pt2e model 'converted-fx' (it has quantize_per_tensor ops)."""
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as quantizer_module

    import qlint
    from qlint.measure.match_result import CounterpartKind
    from qlint.measure.matching import detect_counterpart

    quantizer = quantizer_module.X86InductorQuantizer().set_global(
        quantizer_module.get_default_x86_inductor_quantization_config()
    )
    torch.manual_seed(0)
    model = Net().eval()
    batches = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    converted = _quantize(model, quantizer, batches)
    assert detect_counterpart(converted) is CounterpartKind.CONVERTED_PT2E
    report = qlint.compare(model, converted, batches)
    assert report.frontend == "converted-pt2e"
    assert any("of a converted-pt2e model" in notice.message for notice in report.notices)
