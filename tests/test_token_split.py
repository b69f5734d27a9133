"""QL205 leading-token-outlier and the split_leading_token rewrite."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from qlint.rules.ql205_leading_token_outlier import _dynamic, _TokenMixer, _tokens

import qlint
from qlint.advice.plan import ModuleDecision, Provenance, Rewrite, default_plan, plan_from_report
from qlint.errors import QlintError
from qlint.measure.token_split import copy_name, split_leading_token
from tests.models import output_sqnr

USER = [Provenance(source="user", detail="test")]


def _held_out() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(9)
    batches = []
    for _ in range(4):
        x = torch.randn(4, 12, 16, generator=generator)
        x[:, 0] *= 50.0
        batches.append(x)
    return batches


def test_the_split_is_exact_and_shares_the_weights():
    model = _TokenMixer().eval()
    gm = fx.symbolic_trace(model)
    split_leading_token(gm, "up")
    gm.graph.lint()
    gm.recompile()
    twin = gm.get_submodule(copy_name("up"))
    assert twin.weight is gm.get_submodule("up").weight and twin.bias is gm.get_submodule("up").bias
    with torch.no_grad():
        for batch in _held_out():
            torch.testing.assert_close(gm(batch), model(batch), rtol=0, atol=1e-6)


def _sqnr(plan, calibration) -> float:
    model = _TokenMixer().eval()
    return output_sqnr(model, plan.quantize(model, calibration), _held_out())


def test_the_copy_follows_the_original_decision_and_the_split_gains_on_held_out_batches():
    calibration = _tokens(50.0)(8)
    dynamic = [ModuleDecision(fqn=fqn, mode="dynamic", provenance=USER) for fqn in ("up", "down")]
    plain = default_plan().model_copy(update={"modules": dynamic, "float_by_default": True})
    split = plain.model_copy(
        update={"rewrites": [Rewrite(kind="split_leading_token", modules=["up"], provenance=USER)]}
    )
    converted = split.quantize(_TokenMixer().eval(), calibration)
    kinds = {name: type(m).__module__ for name, m in converted.named_modules() if name in ("up", copy_name("up"))}
    assert len(kinds) == 2 and all("quantized.dynamic" in kind for kind in kinds.values()), kinds
    assert _sqnr(split, calibration) > _sqnr(plain, calibration) + 10.0


def test_lint_flags_the_layer_and_its_measured_fix_lands_in_the_plan():
    calibration = _tokens(50.0)(8)
    report = qlint.lint(_TokenMixer(), (calibration[0],), calibration=calibration, qconfig_mapping=_dynamic())
    (finding,) = [f for f in report.findings if f.rule == "QL205"]
    assert [layer["target"] for layer in finding.data["layers"]] == ["up"]  # LayerNorm evens out down's input
    assert finding.data["bits_lost"] <= 8
    assert finding.impact is not None and finding.impact.basis == "fix-trial" and finding.impact.db > 10.0
    plan = plan_from_report(report)
    assert [(r.kind, r.modules) for r in plan.rewrites] == [("split_leading_token", ["up"])]


def test_a_model_without_a_leading_outlier_is_not_flagged():
    calibration = _tokens(1.0)(4)
    report = qlint.lint(
        _TokenMixer(), (calibration[0],), calibration=calibration, qconfig_mapping=_dynamic(), select=["QL205"]
    )
    assert report.findings == []
    rows = [row for row in report.lint_rows() if row.rule == "QL205"]
    assert {row.name for row in rows} == {"up", "down"} and all(row.value < 4.0 for row in rows)


def test_a_linear_called_twice_is_refused():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(self.fc(x))

    gm = fx.symbolic_trace(Twice())
    with pytest.raises(QlintError, match="called once"):
        split_leading_token(gm, "fc")
