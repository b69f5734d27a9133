"""QL102's fix, ``split_module``: each call of a shared module gets a module of its own, so the
converted model gives each call its own output qparams. Measured on held-out batches, through
the plan, as a user would apply it."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.ao.quantization import QConfig, QConfigMapping, get_default_qconfig_mapping
from torch.ao.quantization.observer import HistogramObserver, default_per_channel_weight_observer

import qlint
from qlint.advice.plan import Provenance, QuantPlan, Rewrite, default_plan, plan_from_report
from qlint.measure.rewrite import apply_requested_rewrites, fanout_follows_original
from tests.models import output_sqnr


class SharedLinear(nn.Module):
    """One Linear applied to a tensor and to 40x that tensor: one converted module, one output scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.fc(x)
        large = self.fc(x * 40.0)
        return self.head(torch.cat([small, large * 0.025], dim=1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.act = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.second(self.act(self.first(x))))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def _batches(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 16, generator=generator) for _ in range(count)]


def test_split_module_gives_each_call_its_own_quantized_module_and_gains_on_held_out_data():
    torch.manual_seed(0)
    model, calibration, held_out = SharedLinear().eval(), _batches(8, 1), _batches(4, 2)
    report = qlint.lint(model, (calibration[0],), calibration=[(b,) for b in calibration], select=["QL102"])
    [finding] = report.findings
    plan = plan_from_report(report)
    assert [(r.kind, r.modules) for r in plan.rewrites] == [("split_module", ["fc"])]

    gm, applied = apply_requested_rewrites(model, plan, (calibration[0],))
    [split] = [r for r in applied if r.kind == "split_module"]
    assert split.applied and split.requested_by_plan and split.max_relative_error == 0.0
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith("fc")]
    assert targets == ["fc", "fc_qlint_call2"]
    assert gm.get_submodule("fc_qlint_call2") is not gm.get_submodule("fc")
    assert torch.equal(gm.get_submodule("fc_qlint_call2").weight, model.fc.weight)

    default = output_sqnr(model, default_plan().quantize(model, calibration), held_out)
    fixed = output_sqnr(model, plan.quantize(model, calibration), held_out)
    unsplit = output_sqnr(model, plan.model_copy(update={"rewrites": []}).quantize(model, calibration), held_out)
    assert fixed > default + 1.5 and fixed > unsplit + 1.5
    # the finding's measured gain is the split's, not zero: the trial applies the rewrite
    assert finding.impact is not None and finding.impact.db > 1.5


def test_split_copies_sit_beside_the_original_and_follow_its_qconfig():
    model = Nested().eval()
    example = (torch.randn(2, 3, 12, 12),)
    plan = QuantPlan(
        rewrites=[Rewrite(kind="split_module", modules=["block.act"], provenance=[Provenance(rule="QL102")])]
    )
    gm, applied = apply_requested_rewrites(model, plan, example)
    assert [r.applied for r in applied if r.kind == "split_module"] == [True]
    assert [n.target for n in gm.graph.nodes if n.op == "call_module" and "act" in str(n.target)] == [
        "block.act",
        "block.act_qlint_call2",
    ]
    special = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True), weight=default_per_channel_weight_observer
    )
    mapping = get_default_qconfig_mapping("x86").set_module_name("block.act", special)
    followed: QConfigMapping = fanout_follows_original(mapping, gm)
    copied = followed.module_name_qconfigs["block.act_qlint_call2"]
    assert copied is followed.module_name_qconfigs["block.act"] and copied.activation().reduce_range


def test_split_of_a_module_called_once_is_refused_with_the_reason():
    model = SharedLinear().eval()
    plan = QuantPlan(rewrites=[Rewrite(kind="split_module", modules=["head"], provenance=[Provenance(rule="QL102")])])
    gm, applied = apply_requested_rewrites(model, plan, (torch.randn(4, 16),))
    [split] = [r for r in applied if r.kind == "split_module"]
    assert not split.applied and split.reason is not None and "head is called 1 time(s)" in split.reason
    assert not hasattr(gm, "head_qlint_call2")
