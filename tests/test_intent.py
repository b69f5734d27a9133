"""qconfig resolution matches prepare_fx's precedence (prepare_fx is the reference)."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import QConfigMapping, get_default_qconfig
from torch.ao.quantization.quantize_fx import prepare_fx

from qlint.core.intent import describe_observer
from qlint.linter.engine import analyse


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = F.relu(self.conv(x))
        y = y + x
        return torch.sigmoid(self.fc(y.permute(0, 2, 3, 1)))


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Inner()
        self.b = Inner()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        x = self.conv(x)
        y = self.a(x).permute(0, 3, 1, 2)
        z = self.b(y).permute(0, 3, 1, 2)
        return F.relu(z) + torch.add(y, z)


def _mappings():
    x86, qnn = get_default_qconfig("x86"), get_default_qconfig("qnnpack")
    yield "global", QConfigMapping().set_global(x86)
    yield "object_type", QConfigMapping().set_global(x86).set_object_type(nn.Linear, qnn).set_object_type(F.relu, None)
    yield "regex", QConfigMapping().set_global(x86).set_module_name_regex(r"a\..*", qnn)
    yield (
        "module_name",
        (
            QConfigMapping()
            .set_global(x86)
            .set_object_type(nn.Conv2d, None)
            .set_module_name("b", qnn)
            .set_module_name("a.conv", x86)
        ),
    )
    yield "order", (QConfigMapping().set_global(x86).set_module_name_object_type_order("", operator.add, 1, None))


@pytest.mark.parametrize("label,mapping", list(_mappings()), ids=lambda v: v if isinstance(v, str) else "")
def test_resolution_matches_prepare_fx(label, mapping):
    model = Outer().eval()
    x = torch.randn(1, 4, 5, 5)
    prepared = prepare_fx(model, mapping, example_inputs=(x,))
    reference = prepared.meta["_observed_graph_module_attrs"].node_name_to_qconfig
    graph = analyse(model, (x,), "x86", mapping).graph
    compared = 0
    for node in graph.ops():
        if node.name not in reference:
            continue
        expected = reference[node.name]
        ours = node.qconfig.qconfig if node.qconfig is not None else None
        assert (ours is None) == (expected is None), (label, node.name, node.qconfig)
        if expected is not None:
            # prepare_fx wraps factories with device kwargs, so compare what they build.
            assert describe_observer(ours.activation) == describe_observer(expected.activation), (label, node.name)
            assert describe_observer(ours.weight) == describe_observer(expected.weight), (label, node.name)
        compared += 1
    assert compared >= 10


def test_fixed_qparams_and_fake_quantize_are_known_by_class_not_by_name():
    """A FakeQuantize that wraps a fixed-qparams observer is fixed; a user's observer whose name merely
    contains "FixedQParams" is not (its scale is computed from the data)."""
    from torch.ao.quantization import FakeQuantize, FixedQParamsObserver, MinMaxObserver

    wrapped = FakeQuantize.with_args(observer=FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0))
    spec = describe_observer(wrapped)
    assert spec.observer == "FakeQuantize(FixedQParamsObserver)"
    assert (spec.fixed_scale, spec.fixed_zero_point) == (1 / 256, 0)  # the observer's, not the placeholder 1.0

    class NotFixedQParamsObserver(MinMaxObserver):
        pass

    assert not describe_observer(NotFixedQParamsObserver).is_fixed_qparams


def test_only_a_relu_fused_into_a_layer_counts_as_one():
    """LinearLeakyReLU (onednn) ends in a leaky ReLU, whose negatives a comparison must keep."""
    import torch.ao.nn.intrinsic as nni
    import torch.ao.nn.intrinsic.quantized as nniq
    import torch.nn as nn

    from qlint.core.ops import fuses_relu

    assert fuses_relu(nni.LinearReLU(nn.Linear(4, 4), nn.ReLU()))
    assert fuses_relu(nniq.ConvReLU2d(3, 4, 1))
    assert not fuses_relu(nniq.LinearLeakyReLU(4, 4, 0.01))
    assert not fuses_relu(nn.ReLU()) and not fuses_relu(nn.Linear(4, 4))
