"""qlint.measure.rewrite: float-preserving rewrites on a traced copy, checked on example inputs."""

import copy
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.advice.plan import Provenance, QuantPlan, Rewrite
from qlint.errors import QlintError
from qlint.measure.rewrite import apply_rewrites, relative_error
from qlint.measure.rewrite_candidates import find_rewrites


class SameConv2d(nn.Conv2d):
    """A conv subclass with a custom 'same' padding forward: traces to F.pad + F.conv2d."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class SameConvNet(nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        self.convs = nn.ModuleList(
            [SameConv2d(3, width, 3, bias=False)]
            + [SameConv2d(width, width, 3, bias=i % 2 == 0) for i in range(depth - 1)]
        )
        self.bns = nn.ModuleList(nn.BatchNorm2d(width) for _ in range(depth))
        self.fc = nn.Linear(width, 4)

    def forward(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = F.relu(bn(conv(x)))
        x = x.mean((2, 3))
        return self.fc(x.view(x.shape[0], -1))


def make_same_conv_net(seed=0):
    """Near-dead filters re-amplified by their BN: harmless in float, fatal when the conv output is int8."""
    torch.manual_seed(seed)
    model = SameConvNet()
    with torch.no_grad():
        for conv, bn in zip(model.convs, model.bns):
            bn.eps = 1e-9
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            for c in (1, 3, 4, 6):
                conv.weight[c] *= 1e-3
                if conv.bias is not None:
                    conv.bias[c] *= 1e-3
                bn.running_mean[c] *= 1e-3
                bn.running_var[c] *= 1e-6
    return model.eval()


def _sqnr(reference, other):
    return 10 * math.log10(float((reference**2).sum()) / float(((reference - other) ** 2).sum()))


def _ptq(model, calibration):
    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (calibration[0],))
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    return convert_fx(prepared)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 12, 12, generator=g) for _ in range(4)]


def test_fold_keeps_float_outputs_and_removes_bn(data):
    model = make_same_conv_net()
    before = copy.deepcopy(model.state_dict())
    gm, applied = apply_rewrites(model, None, (data[0],))
    folds = [a for a in applied if a.kind == "fold_bn_into_functional_conv"]
    assert len(folds) == 3 and all(a.applied for a in folds)
    assert all(a.max_relative_error <= 1e-5 for a in folds)
    assert not any(n.op == "call_module" and "bns" in str(n.target) for n in gm.graph.nodes)
    with torch.no_grad():
        for batch in data:  # held-out batches too, not only the example the check used
            ref, out = model(batch), gm(batch)
            assert relative_error([ref], [out]) <= 1e-5
    # the user's model is untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_fold_lifts_ptq_sqnr(data):
    model = make_same_conv_net()
    gm, _ = apply_rewrites(model, None, (data[0],))
    plain, folded = _ptq(fx.symbolic_trace(model), data), _ptq(gm, data)
    with torch.no_grad():
        ref = torch.cat([model(b) for b in data])
        plain_sqnr = _sqnr(ref, torch.cat([plain(b) for b in data]))
        folded_sqnr = _sqnr(ref, torch.cat([folded(b) for b in data]))
    assert plain_sqnr < 15.0
    assert folded_sqnr >= 25.0
    assert folded_sqnr > plain_sqnr + 15.0


def test_rewrite_refused_when_float_outputs_change(data):
    model = make_same_conv_net()
    gm, applied = apply_rewrites(
        model, None, (data[0],), kinds=["fold_bn_into_functional_conv"], max_relative_error=0.0
    )
    refused = [a for a in applied if not a.applied and a.max_relative_error and a.max_relative_error > 0]
    assert refused and all("float outputs changed" in a.reason for a in refused)
    assert sum(n.op == "call_module" and "bns" in str(n.target) for n in gm.graph.nodes) == len(refused)


def test_view_to_reshape_and_plan_request(data):
    model = make_same_conv_net()
    plan = QuantPlan(
        rewrites=[
            Rewrite(
                kind="fold_bn_into_functional_conv",
                modules=["convs.0", "bns.0"],
                provenance=[Provenance(source="user", detail="test")],
            )
        ]
    )
    gm, applied = apply_rewrites(model, plan, (data[0],))
    views = [a for a in applied if a.kind == "view_to_reshape"]
    assert views and views[0].applied
    assert not any(n.op == "call_method" and n.target == "view" for n in gm.graph.nodes)
    requested = {tuple(a.modules): a.requested_by_plan for a in applied if a.kind.startswith("fold")}
    assert requested[("convs.0", "bns.0")] is True and requested[("convs.1", "bns.1")] is False


def test_training_bn_is_not_folded_and_no_inputs_is_an_error(data):
    model = make_same_conv_net()
    gm = fx.symbolic_trace(model)
    gm.get_submodule("bns.1").train()
    kinds = [(c.kind, c.modules) for c in find_rewrites(gm)]
    assert ("fold_bn_into_functional_conv", ["convs.1", "bns.1"]) not in kinds
    assert ("fold_bn_into_functional_conv", ["convs.0", "bns.0"]) in kinds
    with pytest.raises(QlintError):
        apply_rewrites(model, None, ())


# ----------------------------------------------------------------- fan-out conv → BN
class FanOutNet(nn.Module):
    """conv output feeds its BN *and* a skip add: prepare_fx cannot fuse conv-bn."""

    def __init__(self, width=8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, 4)

    def forward(self, x):
        x = F.relu(self.stem(x))
        y = self.conv(x)
        x = F.relu(self.bn(y)) + y
        return self.fc(x.mean((2, 3)))


def make_fanout_net(seed=0):
    """Near-dead conv filters re-amplified by the BN, as in make_same_conv_net."""
    torch.manual_seed(seed)
    model = FanOutNet()
    with torch.no_grad():
        model.bn.eps = 1e-9
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.uniform_(0.5, 1.5)
        for c in (1, 3, 4, 6):
            model.conv.weight[c] *= 1e-3
            model.conv.bias[c] *= 1e-3
            model.bn.running_mean[c] *= 1e-3
            model.bn.running_var[c] *= 1e-6
    return model.eval()


def test_fanout_duplication_keeps_float_and_unblocks_fusion(data):
    model = make_fanout_net()
    before = copy.deepcopy(model.state_dict())
    gm, applied = apply_rewrites(model, None, (data[0],))
    dup = [a for a in applied if a.kind == "fuse"]
    assert len(dup) == 1 and dup[0].applied and dup[0].modules == ["conv", "bn"]
    assert dup[0].max_relative_error <= 1e-5
    conv_node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "conv")
    assert [u.target for u in conv_node.users] == ["bn"]  # the skip add now reads the copy
    copies = [n for n in gm.graph.nodes if n.op == "call_module" and str(n.target).endswith("_qlint_fanout")]
    assert len(copies) == 1 and copies[0].args == conv_node.args
    with torch.no_grad():
        for batch in data:
            assert relative_error([model(batch)], [gm(batch)]) <= 1e-5
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    # prepare_fx now fuses conv-bn(-relu): no BatchNorm survives in the converted graph
    def batch_norms(m):
        return [
            name
            for name, sub in _ptq(m, data).named_modules()
            if "BatchNorm" in type(sub).__name__ or "BNReLU" in type(sub).__name__
        ]

    assert batch_norms(fx.symbolic_trace(model)) == ["bn"]
    assert batch_norms(gm) == []


def test_fanout_duplication_lifts_ptq_sqnr(data):
    model = make_fanout_net()
    gm, _ = apply_rewrites(model, None, (data[0],), kinds=["fuse"])
    plain, split = _ptq(fx.symbolic_trace(model), data), _ptq(gm, data)
    with torch.no_grad():
        ref = torch.cat([model(b) for b in data])
        plain_sqnr = _sqnr(ref, torch.cat([plain(b) for b in data]))
        split_sqnr = _sqnr(ref, torch.cat([split(b) for b in data]))
    assert split_sqnr > plain_sqnr + 6.0


def test_fanout_not_duplicated_without_fanout_or_in_training(data):
    gm = fx.symbolic_trace(make_fanout_net())
    assert [c.modules for c in find_rewrites(gm) if c.kind == "fuse"] == [["conv", "bn"]]
    gm.get_submodule("bn").train()
    assert not [c for c in find_rewrites(gm) if c.kind == "fuse"]
    single = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval())
    assert not [c for c in find_rewrites(single) if c.kind == "fuse"]
