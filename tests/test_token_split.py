"""QL205 leading-token-outlier and the split_leading_token rewrite."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import qlint
from qlint.advice.plan import ModuleDecision, Provenance, Rewrite, default_plan, plan_from_report
from qlint.errors import QlintError
from qlint.measure.token_split import copy_name, split_leading_token
from qlint.rules.ql205_leading_token_outlier import _dynamic, _TokenMixer, _tokens
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
    assert finding.impact is not None and finding.impact.basis == "rule-trial" and finding.impact.db > 10.0
    assert finding.impact.steady_db is not None and 10.0 < finding.impact.steady_db <= finding.impact.db + 1e-3
    plan = plan_from_report(report)
    assert [(r.kind, r.modules) for r in plan.rewrites] == [("split_leading_token", ["up"])]


def test_under_a_static_mapping_the_split_converts_and_its_gain_is_measured_with_dynamic_linears():
    calibration = _tokens(50.0)(8)
    report = qlint.lint(_TokenMixer(), (calibration[0],), calibration=calibration, select=["QL205"])
    (finding,) = report.findings
    # both numbers are in the message: under the static mapping the two parts share one
    # observer (torch.narrow), so the split converts and changes little; dynamic, it pays
    static, dynamic = finding.message.split("Measured: ")[1].split(";")
    assert "failed" not in static and "every Linear dynamic" in dynamic
    assert finding.impact is not None and "quantize_dynamic" in finding.impact.detail
    assert finding.impact.db > 10.0 and finding.severity.value == "warning"


def test_a_model_without_a_leading_outlier_is_not_flagged():
    calibration = _tokens(1.0)(4)
    report = qlint.lint(
        _TokenMixer(), (calibration[0],), calibration=calibration, qconfig_mapping=_dynamic(), select=["QL205"]
    )
    assert report.findings == []
    rows = [row for row in report.lint_rows() if row.rule == "QL205"]
    assert {row.name for row in rows} == {"up", "down"} and all(row.value < 2.0 for row in rows)


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


def test_verify_tries_the_split_again_once_a_scheme_flip_is_kept(monkeypatch):
    """Under the static default the split changes nothing (both parts share one observer), so
    pruning drops it; once the scheme search keeps a flip, the split is measured again on top
    of it, and kept exactly when it gains there."""
    import qlint.advice.verify_search as search
    from qlint.advice.verify import SQNR_TOLERANCE_DB, verify

    # 7-bit activations throughout: the 8-bit trials would take the prune share the split needs
    monkeypatch.setattr(search, "host_vnni", lambda: None)

    calibration = _tokens(50.0)(8)
    split = Rewrite(kind="split_leading_token", modules=["up"], provenance=USER)
    plan = default_plan().model_copy(update={"rewrites": [split]})
    report = verify(_TokenMixer().eval(), plan, calibration, _held_out(), bias_correction=False)
    pruned = [d for d in report.decisions if d.kind == "rewrite" and "split_leading_token" in d.target]
    assert pruned and not pruned[0].kept
    assert any(d.kind == "scheme" and d.kept for d in report.decisions)
    (retried,) = [d for d in report.decisions if d.target.endswith("dropped before the scheme search")]
    assert "split_leading_token" in retried.detail
    assert retried.sqnr_with_db is not None and retried.sqnr_without_db is not None
    assert retried.kept == (retried.sqnr_with_db > retried.sqnr_without_db + SQNR_TOLERANCE_DB)
    assert bool(report.verified_plan.rewrites) == retried.kept
