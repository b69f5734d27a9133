"""A plan rewrite the model has no place for is named, never silently dropped: QuantPlan.quantize
and `qlint quantize` refuse the plan in one line (the int8 model would not be the one the plan was
measured as), and verify reports the rewrite as left out of the verified plan."""

import pytest
import torch
import torch.nn as nn

from qlint.advice.apply import QuantizeError
from qlint.advice.plan import ModuleDecision, Provenance, Rewrite, default_plan
from qlint.advice.verify import verify

NET_SOURCE = """
import torch
import torch.nn as nn


class FlattenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def build():
    torch.manual_seed(0)
    return FlattenNet().eval()
"""


def _build() -> nn.Module:
    namespace: dict = {}
    exec(NET_SOURCE, namespace)
    return namespace["build"]()


def _batches(count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(count)]


def _plan_with_view_rewrite():
    """A plan made for a model that flattened with .view: this one uses .flatten, so the
    view → reshape rewrite has no place in its graph."""
    reshape = Rewrite(kind="view_to_reshape", modules=["view"], provenance=[Provenance(source="user", detail="t")])
    return default_plan("x86", model="net").model_copy(update={"rewrites": [reshape]})


def test_quantize_refuses_a_plan_whose_rewrite_has_no_place_in_the_model():
    model, calibration = _build(), _batches(3, 1)
    plan = _plan_with_view_rewrite()
    with pytest.raises(QuantizeError) as refused:
        plan.quantize(model, calibration)
    message = str(refused.value)
    assert "view_to_reshape view: this model's graph has no place it applies to" in message
    assert "\n" not in message
    without = plan.model_copy(update={"rewrites": []}).quantize(model, calibration)
    assert sum(1 for m in without.modules() if type(m).__module__.startswith("torch.ao.nn.quantized")) >= 2


def test_verify_names_the_rewrite_it_leaves_out_of_the_verified_plan():
    model = _build()
    report = verify(model, _plan_with_view_rewrite(), _batches(3, 1), eval_data=_batches(2, 2))
    left_out = [(r.kind, r.modules, r.reason) for r in report.left_out_rewrites]
    assert left_out == [("view_to_reshape", ["view"], "this model's graph has no place it applies to")]
    assert not report.verified_plan.rewrites
    report.verified_plan.quantize(model, _batches(3, 1))  # the verified plan builds on this model


def test_cli_verify_prints_it_and_quantize_exits_2_in_one_line(run_main, tmp_path):
    (tmp_path / "netmod.py").write_text(NET_SOURCE)
    torch.save(_batches(3, 1), tmp_path / "cal.pt")
    torch.save(_batches(2, 2), tmp_path / "eval.pt")
    (tmp_path / "plan.json").write_text(_plan_with_view_rewrite().model_dump_json())
    model = f"{tmp_path}/netmod.py:build"
    data = ["--calibration", "cal.pt", "--eval-data", "eval.pt"]
    verified = run_main("verify", model, "--plan", "plan.json", *data, cwd=tmp_path)
    assert verified.returncode == 0, verified.stderr
    assert "plan rewrite view_to_reshape view NOT applied (this model's graph has no place" in verified.stdout
    result = run_main("quantize", model, "--plan", "plan.json", *data, "-o", "int8.pt", cwd=tmp_path)
    assert result.returncode == 2
    assert "could not be applied" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "int8.pt").exists()


def test_a_split_waiting_for_a_dynamic_linear_is_not_a_missed_rewrite():
    """A token split for dynamic Linears only waits in a static plan: fix and quantize apply
    nothing for it, and that is the plan, not a rewrite they failed to apply."""
    from qlint.advice.apply import fixed_model
    from qlint.rules.ql205_leading_token_outlier import _TokenMixer, _tokens

    user = [Provenance(source="user", detail="t")]
    split = Rewrite(kind="split_leading_token", modules=["up"], params={"only_dynamic": True}, provenance=user)
    plan = default_plan("x86").model_copy(update={"rewrites": [split]})
    assert plan.waiting_rewrites() == [split]
    calibration = _tokens(50.0)(3)
    _model, applied, _folded = fixed_model(_TokenMixer(), plan, (calibration[0],))
    assert not [r for r in applied if not r.applied]
    plan.quantize(_TokenMixer(), calibration)  # builds: nothing of the plan is missed
    dynamic = plan.model_copy(update={"modules": [ModuleDecision(fqn="up", mode="dynamic", provenance=user)]})
    assert dynamic.waiting_rewrites() == []  # made dynamic, the split applies
    assert any(
        r.applied and r.kind == "split_leading_token" for r in fixed_model(_TokenMixer(), dynamic, (calibration[0],))[1]
    )


class _WithUnusedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)  # never called, as MiniLM's pooler.dense in its encoder-only use

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_an_unused_module_is_a_note_not_a_rewrite_the_plan_cannot_apply():
    """QA (minilm pooler.dense): QL102 said its parameters stay in the converted model as dead
    weight (FX conversion leaves it out) and the plan carried a remove_module rewrite that
    verify then reported as not applied."""
    import qlint
    from qlint.advice.plan import plan_from_report
    from qlint.measure.trial import quantize_fx

    torch.manual_seed(0)
    model = _WithUnusedHead().eval()
    calibration = [torch.randn(4, 8) for _ in range(2)]
    report = qlint.lint(model, (calibration[0],), select=["QL102"])
    (finding,) = [f for f in report.findings if f.target == "pooler"]
    assert "FX conversion leaves it out" in finding.message and "dead weight" not in finding.message
    converted, _ = quantize_fx(model, default_plan("x86").to_qconfig_mapping(), "x86", calibration)
    assert not any(name.startswith("pooler") for name in converted.state_dict())  # what the message says
    plan = plan_from_report(report)
    assert not plan.rewrites and any("remove pooler" in note for note in plan.notes)
    user = [Provenance(source="user", detail="t")]
    older = plan.model_copy(update={"rewrites": [Rewrite(kind="remove_module", modules=["pooler"], provenance=user)]})
    older.quantize(model, calibration)  # a plan written before: tracing already left the module out
