"""The eager-hooks front end for models neither symbolic_trace nor torch.export can trace."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from qlint.core.eager_fallback import FRONTEND_EAGER, eager_analysis, eager_graph
from qlint.core.graph import ModelGraph, TensorInfo
from qlint.core.intent import NodeQConfig
from qlint.core.trace import private_copy, trace
from qlint.errors import TraceError


class DataDependent(nn.Module):
    """Python control flow on a tensor value: both real front ends fail on it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8, 4)
        self.alt = nn.Linear(8, 4)

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        z = torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)
        if x.sum() > 0:
            return self.fc(z) + 1
        return self.alt(z)


def _no_qconfig(call, node, info):
    return None


def test_real_front_ends_fail_on_the_model():
    x = torch.ones(1, 3, 8, 8)
    with pytest.raises(TraceError):
        trace(private_copy(DataDependent().eval()), (x,))


def test_leaf_layers_shapes_and_edges_positive_branch():
    torch.manual_seed(0)
    graph = eager_graph(DataDependent().eval(), (torch.ones(2, 3, 8, 8),), _no_qconfig)
    assert isinstance(graph, ModelGraph) and graph.frontend == FRONTEND_EAGER
    modules = [n.module for n in graph.ops() if n.op == "module"]
    assert modules == ["conv", "bn", "relu", "fc"]  # alt is on the branch not taken
    conv = graph.node("conv")
    assert conv.kind == "conv2d" and conv.weight == "conv.weight" and conv.bias == "conv.bias"
    assert conv.inputs == (TensorInfo((2, 3, 8, 8), "torch.float32"),)
    assert conv.output == TensorInfo((2, 8, 6, 6), "torch.float32")
    assert [p.name for p in graph.producers("conv")] == ["x"]
    assert [p.name for p in graph.producers("bn")] == ["conv"]
    assert [p.name for p in graph.producers("relu")] == ["bn"]
    # functional ops between the leaves are recorded too, so fc is not linked straight to relu
    assert [p.kind for p in graph.producers("fc")] == ["flatten"]
    assert graph.node("fc").output == TensorInfo((2, 4), "torch.float32")
    kinds = [n.kind for n in graph.ops()]
    assert "sum" not in kinds  # the control-flow-only sum is left out
    assert graph.modules["alt"].is_leaf
    assert [p.name for p in graph.producers("output")][0].startswith("add")


def test_negative_branch_and_notes():
    graph, notes = eager_analysis(DataDependent().eval(), (-torch.ones(1, 3, 8, 8),), _no_qconfig)
    assert [n.module for n in graph.ops() if n.op == "module"] == ["conv", "bn", "relu", "alt"]
    assert any("ONE forward pass" in n and "control flow" in n for n in notes)
    assert any("left out" in n for n in notes)


def test_shared_module_gets_two_call_sites_and_qconfig_is_resolved():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x):
            if x.mean() > 100:
                x = x * 2
            return self.act(self.lin(self.act(x)))

    seen = []

    def resolve(call, node, info):
        seen.append((call.is_module_call, call.module_path))
        return NodeQConfig(activation=None, weight=None, source="test")

    graph = eager_graph(Twice(), (torch.randn(3, 4),), resolve)
    assert [n.name for n in graph.call_sites("act")] == ["act", "act_1"]
    assert all(n.qconfig is not None and n.qconfig.source == "test" for n in graph.ops())
    assert (True, "lin") in seen


def test_model_is_left_untouched():
    model = DataDependent().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hooks_before = len(model.conv._forward_hooks) + len(model.conv._forward_pre_hooks)
    eager_graph(model, (torch.randn(2, 3, 8, 8),), _no_qconfig)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN running stats unchanged
    assert model.training and model.bn.training
    assert len(model.conv._forward_hooks) + len(model.conv._forward_pre_hooks) == hooks_before


def test_failures_are_trace_errors():
    with pytest.raises(TraceError, match="example inputs"):
        eager_graph(DataDependent(), None, _no_qconfig)
    with pytest.raises(TraceError, match="failed on the example inputs"):
        eager_graph(DataDependent(), (torch.randn(1, 5, 8, 8),), _no_qconfig)


def test_lint_falls_back_and_data_rules_still_run():
    import qlint

    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.fc = nn.Linear(8, 4)
            self.other = nn.Linear(8, 4)

        def forward(self, x):
            y = torch.relu(self.conv(x)).mean((2, 3))
            if y.sum() > 0:  # Python control flow on a tensor value: no tracer can follow it
                return self.fc(y)
            return self.other(y)

    torch.manual_seed(0)
    model = DataDependent().eval()
    batches = [torch.randn(4, 3, 12, 12) * (k + 1) ** 2 for k in range(6)]
    report = qlint.lint(model, (torch.randn(2, 3, 12, 12),), calibration=batches)
    assert report.frontend == "eager-hooks"
    assert any("eager" in n.message for n in report.notices)
    assert not [s for s in report.skipped if s.rule in ("QL201", "QL202", "QL203")]
    assert {row.name for row in report.layers} >= {"conv", "fc"}
    # the statistic gathered by hooks equals S = mean batch range / epoch range of fc's output
    fc_rows = [row for row in report.layers if row.name == "fc" and row.rule == "QL201"]
    outputs = []
    handle = model.fc.register_forward_hook(lambda _m, _a, out: outputs.append(out.detach()))
    with torch.no_grad():
        for batch in batches:
            model(batch)
    handle.remove()
    mean_range = sum(float(o.max() - o.min()) for o in outputs) / len(outputs)
    epoch = torch.cat([o.flatten() for o in outputs])
    expected = mean_range / float(epoch.max() - epoch.min())
    assert fc_rows and abs(fc_rows[0].value - expected) <= 1e-4 * expected
