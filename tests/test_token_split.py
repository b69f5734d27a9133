"""QL205 leading-token-outlier and the split_leading_token rewrite."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import qlint
from qlint.advice.plan import ModuleDecision, Provenance, Rewrite, default_plan, plan_from_report
from qlint.errors import QlintError
from qlint.linter.fixes import SetActivationObserver, SetQConfig, SplitLeadingToken
from qlint.linter.suggestions_from_fixes import collect_suggestions
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


def test_under_a_static_mapping_the_split_waits_in_the_plan_for_dynamic_linears():
    """The finding's impact is what the split gains under the mapping linted with, the one its
    plan keeps: under a static mapping both parts read one observer, so the split is for
    dynamic Linears only and changes nothing there (0 dB, info). Its gain with every Linear
    dynamic is information (message and data), not the impact: on MiniLM that figure
    (+3.4 dB) put the split into a static plan, where it cost another entry's gain. The plan
    keeps the split for where it runs the Linear dynamic."""
    calibration = _tokens(50.0)(8)
    report = qlint.lint(_TokenMixer(), (calibration[0],), calibration=calibration, select=["QL205"])
    (finding,) = report.findings
    assert "runs these Linears static" in finding.message and "every Linear dynamic" in finding.message
    recipe = finding.data["dynamic_recipe"]
    assert recipe["split_sqnr_db"] > recipe["base_sqnr_db"] + 10.0  # dynamic, the split pays
    assert finding.impact is not None and finding.impact.basis == "rule-trial"
    assert finding.impact.base_sqnr_db == finding.impact.fixed_sqnr_db == report.trial.output_sqnr_db
    assert finding.severity.value == "info"
    plan = plan_from_report(report)
    (split,) = plan.rewrites
    assert split.only_dynamic() and split.provenance[0].gain_db == 0.0
    assert plan.token_split_linears() == [] and _sqnr(plan, calibration) == _sqnr(default_plan(), calibration)
    up_dynamic = [ModuleDecision(fqn="up", mode="dynamic", provenance=USER)]
    dynamic = plan.model_copy(update={"modules": up_dynamic})
    assert dynamic.token_split_linears() == ["up"]
    without = default_plan().model_copy(update={"modules": up_dynamic})
    assert _sqnr(dynamic, calibration) > _sqnr(without, calibration) + 10.0


def test_verify_splits_once_its_scheme_search_runs_the_linear_dynamic(monkeypatch):
    """A split for dynamic Linears applies in the trial that makes its Linear dynamic: the
    rewritten graph verify caches is keyed by the Linears split, not only the plan's rewrites."""
    import qlint.advice.verify_search as search
    from qlint.advice.verify import verify

    monkeypatch.setattr(search, "host_vnni", lambda: None)  # 7-bit activations: fewer trials
    calibration = _tokens(50.0)(8)
    waiting = Rewrite(kind="split_leading_token", modules=["up"], params={"only_dynamic": True}, provenance=USER)
    plan = default_plan().model_copy(update={"rewrites": [waiting]})
    report = verify(_TokenMixer().eval(), plan, calibration, _held_out(), bias_correction=False, prune=False)
    flips = [d for d in report.decisions if d.kind == "scheme" and d.kept]
    assert flips and "up" in report.verified_plan.token_split_linears()
    reference = verify(
        _TokenMixer().eval(), default_plan(), calibration, _held_out(), bias_correction=False, prune=False
    )
    assert flips[0].sqnr_with_db is not None and flips[0].sqnr_without_db is not None
    (plain,) = [d for d in reference.decisions if d.kind == "scheme" and d.target == flips[0].target]
    assert plain.sqnr_with_db is not None and flips[0].sqnr_with_db > plain.sqnr_with_db + 10.0


def test_a_dynamic_linear_split_in_a_static_plan_gets_each_part_its_own_range():
    """The ops the split adds (two narrows, a cat) follow their Linear's qconfig. Under the
    global static one they quantized the dynamic Linear's input first, with one range for
    every token, and the split gained little."""
    calibration = _tokens(50.0)(8)
    up_dynamic = [ModuleDecision(fqn="up", mode="dynamic", provenance=USER)]
    plain = default_plan().model_copy(update={"modules": up_dynamic})
    split = plain.model_copy(
        update={"rewrites": [Rewrite(kind="split_leading_token", modules=["up"], provenance=USER)]}
    )
    assert _sqnr(split, calibration) > _sqnr(plain, calibration) + 10.0


def test_a_static_split_changes_no_decision():
    """A static Linear's split reads its input through the observer its own qconfig names (not
    the global one), and quantizes it as without the split."""
    calibration = _tokens(50.0)(8)
    minmax = default_plan().activation.changed(observer="minmax")
    plain = default_plan().model_copy(
        update={"modules": [ModuleDecision(fqn="up", activation=minmax, provenance=USER)]}
    )
    split = plain.model_copy(
        update={"rewrites": [Rewrite(kind="split_leading_token", modules=["up"], provenance=USER)]}
    )
    assert _sqnr(split, calibration) == _sqnr(plain, calibration)


def test_a_static_linear_with_an_observer_of_its_own_is_left_out_of_the_split():
    """A static Linear's split parts share one observer, which also sees the first token alone:
    an observer chosen for the whole input (QL203's percentile) would measure something else
    (on MiniLM the two together gave 3.5 dB, the observer alone 5.6 dB). The plan keeps the
    observer and says so; a dynamic Linear keeps its split."""
    ql203 = Provenance(rule="QL203", target="up", gain_db=0.6)
    ql205 = Provenance(rule="QL205", target="up", gain_db=0.7)
    percentile = SetActivationObserver(targets=["up"], observer="PercentileObserver", percentile=99.99)
    split = SplitLeadingToken(modules=["up", "down"])
    planned = collect_suggestions("x86", None, [(percentile, ql203), (split, ql205)])
    assert [(r.kind, r.modules) for r in planned.rewrites] == [("split_leading_token", ["down"])]
    assert [note for note in planned.notes if "up not split" in note and "QL203" in note]
    alone = collect_suggestions("x86", None, [(percentile, ql203), (SplitLeadingToken(modules=["up"]), ql205)])
    assert alone.rewrites == [] and alone.decision("up") is not None
    dynamic = SetQConfig(targets=["up"], mode="dynamic")
    planned = collect_suggestions("x86", None, [(dynamic, ql203), (percentile, ql203), (split, ql205)])
    assert [r.modules for r in planned.rewrites] == [["up", "down"]] and planned.notes == []
    # a split for dynamic Linears only never reaches the static one: nothing to leave out
    waiting = SplitLeadingToken(modules=["up", "down"], only_dynamic=True)
    planned = collect_suggestions("x86", None, [(percentile, ql203), (waiting, ql205)])
    assert [r.modules for r in planned.rewrites] == [["up", "down"]] and planned.notes == []
    assert planned.token_split_linears() == []


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
