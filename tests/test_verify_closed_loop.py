"""The closed loop: verify's plan applied in one step gives the model verify measured; a
failing default is reported as failed while the plan is still measured; selection and
evaluation batches are kept apart; the trial budget holds."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from qlint.advice.plan import default_plan
from qlint.advice.verify import verify
from qlint.core.sqnr import sqnr_db
from tests.test_rewrite import make_fanout_net, make_same_conv_net

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class ViewAfterConv(nn.Module):
    """Float runs; after convert_fx the conv returns a channels-last tensor and ``view`` raises."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        y = self.relu(self.conv(x))
        return self.fc(y.view(y.size(0), -1))


def _batches(seed, n, shape):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _output_sqnr(model, quantized, batches):
    with torch.no_grad():
        reference = torch.cat([model(b) for b in batches])
        approximation = torch.cat([quantized(b) for b in batches])
    return sqnr_db(reference, approximation)


@pytest.mark.parametrize("build", [make_same_conv_net, make_fanout_net], ids=["bn-fold", "fan-out"])
def test_plan_quantize_reproduces_the_verified_sqnr(build):
    calibration, eval_data = _batches(2, 4, (4, 3, 12, 12)), _batches(3, 2, (4, 3, 12, 12))
    model = build()
    report = verify(model, None, calibration, eval_data)
    assert report.plan.sqnr_db > report.default.sqnr_db + 3.0  # the rewrites verify kept matter
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = report.verified_plan.quantize(model, calibration)
    assert _output_sqnr(model, quantized, eval_data) == pytest.approx(report.plan.sqnr_db, abs=0.1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched
    # the plan is a file: read back, it builds the same model
    again = type(report.verified_plan).from_json(report.verified_plan.model_dump_json())
    assert _output_sqnr(model, again.quantize(model, calibration), eval_data) == pytest.approx(
        report.plan.sqnr_db, abs=0.1
    )


def test_a_failing_default_is_reported_failed_and_the_plan_is_still_measured():
    torch.manual_seed(0)
    model = ViewAfterConv().eval()
    calibration, eval_data = _batches(4, 4, (2, 3, 6, 6)), _batches(5, 2, (2, 3, 6, 6))
    with pytest.raises(RuntimeError, match="view"):  # what a user gets from the default
        default_plan("x86").quantize(model, calibration)(eval_data[0])
    report = verify(model, None, calibration, eval_data)
    assert report.default.failure is not None and "view" in report.default.failure
    assert report.default.sqnr_db is None and report.sqnr_gain_db is None
    assert report.plan.failure is None and report.plan.sqnr_db > 20.0
    assert report.plan.int8_fraction == 1.0
    # the view -> reshape rewrite is what makes it run, and pruning measured that
    assert any(r.kind == "view_to_reshape" for r in report.verified_plan.rewrites)
    dropped = next(d for d in report.decisions if d.kind == "rewrite" and d.target.startswith("view_to_reshape"))
    assert dropped.kept and dropped.sqnr_without_db is None  # without it, quantizing fails
    quantized = report.verified_plan.quantize(model, calibration)
    assert _output_sqnr(model, quantized, eval_data) == pytest.approx(report.plan.sqnr_db, abs=0.1)


def test_decisions_are_selected_on_selection_batches_and_reported_on_eval_batches():
    calibration, eval_data = _batches(2, 6, (4, 3, 12, 12)), _batches(3, 2, (4, 3, 12, 12))
    model = make_same_conv_net()
    report = verify(model, None, calibration, eval_data)
    assert report.selection_batches == 4
    assert report.selected_on == (
        "the last 4 of 6 calibration batches; 8-bit activations judged on trials calibrated on the other 2"
    )
    assert report.eval_batches == 2
    # a decision's "with" number is its selection SQNR, so it differs from the eval SQNR reported
    kept = [d for d in report.decisions if d.kept and d.sqnr_with_db is not None]
    assert kept and all(abs(d.sqnr_with_db - report.requested.sqnr_db) > 1e-3 for d in kept[:1])
    chosen = verify(model, None, calibration, eval_data, selection_data=eval_data)
    assert chosen.selection_batches == 2 and chosen.selected_on == "2 selection batches"
    first = chosen.decisions[0]  # the bias-correction trial: the plan as given is its "without"
    assert first.kind == "bias_correction"
    assert first.sqnr_without_db == pytest.approx(chosen.requested.sqnr_db, abs=1e-3)  # selected on eval itself


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_trial_budget_bounds_every_search(budget):
    calibration, eval_data = _batches(2, 4, (4, 3, 12, 12)), _batches(3, 2, (4, 3, 12, 12))
    report = verify(make_same_conv_net(), None, calibration, eval_data, max_trials=budget, target_sqnr=150.0)
    assert report.trials <= budget and report.max_trials == budget
    measured = [d for d in report.decisions if d.kind in ("module", "equalization", "rewrite", "scheme", "keep_float")]
    assert len(measured) <= budget
    if budget == 0:
        assert any("trial budget" in note for note in report.notes)


def test_progress_names_every_quantization():
    calibration, eval_data = _batches(2, 4, (4, 3, 12, 12)), _batches(3, 2, (4, 3, 12, 12))
    seen: list[tuple[str, int, int]] = []
    report = verify(
        make_same_conv_net(), None, calibration, eval_data, max_trials=3, progress=lambda *a: seen.append(a)
    )
    labels = [label for label, _, _ in seen]
    assert labels[:2] == ["default mapping", "plan as given"]
    assert all(budget == 3 and done <= 3 for _, done, budget in seen)
    assert len(seen) >= 2 + report.trials


FANOUT_SOURCE = """
from tests.test_rewrite import make_fanout_net

def build():
    return make_fanout_net()
"""


def _fanout_files(tmp_path):
    """The fan-out net as module:factory, with calibration (cal.pt) and eval (eval.pt) batches saved."""
    calibration, eval_data = _batches(2, 4, (4, 3, 12, 12)), _batches(3, 2, (4, 3, 12, 12))
    (tmp_path / "netmod.py").write_text(FANOUT_SOURCE)
    torch.save(calibration, tmp_path / "cal.pt")
    torch.save(eval_data, tmp_path / "eval.pt")
    return f"{tmp_path}/netmod.py:build", calibration, eval_data


def test_cli_verify_fix_and_the_emitted_mapping_give_the_verified_model(run_cli, tmp_path):
    """The documented CLI path for a plan a QConfigMapping expresses: verify --emit-plan, fix --plan,
    then prepare_fx/convert_fx of the saved model with the plan's mapping reproduces verify's
    SQNR; the folds are in the file."""
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    from qlint.advice.plan import QuantPlan

    model, calibration, eval_data = _fanout_files(tmp_path)
    verified = run_cli(
        "verify",
        model,
        "--calibration",
        "cal.pt",
        "--eval-data",
        "eval.pt",
        "--format",
        "json",
        "--emit-plan",
        "verified.json",
        "--no-bias-correction",
        cwd=tmp_path,
    )  # fmt: skip  (bias correction is no QConfigMapping: that path is qlint quantize's, below)
    assert verified.returncode == 0, verified.stderr
    reported = json.loads(verified.stdout)["plan"]["sqnr_db"]
    plan = QuantPlan.load(str(tmp_path / "verified.json"))
    assert any(r.kind == "fuse" for r in plan.rewrites)  # the fan-out copy pays off, measured
    for out in ("fixed.pt", "fixed.pt2"):
        fixed = run_cli("fix", model, "--plan", "verified.json", "--input-shape", "4,3,12,12", "-o", out, cwd=tmp_path)
        assert fixed.returncode == 0, fixed.stderr
        assert "BatchNorms folded" in fixed.stdout
    program = torch.export.load(str(tmp_path / "fixed.pt2"))
    assert not [n for n in program.graph.nodes if "batch_norm" in str(n.target)]  # the fold really happened
    saved = torch.load(tmp_path / "fixed.pt", weights_only=False)  # the user's own file
    assert not any(isinstance(m, nn.BatchNorm2d) for m in saved.modules())
    assert any(name.endswith("_qlint_fanout") for name, _ in saved.named_modules())
    prepared = prepare_fx(saved, plan.to_qconfig_mapping(), (calibration[0],))
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    quantized = convert_fx(prepared)
    assert _output_sqnr(make_fanout_net(), quantized, eval_data) == pytest.approx(reported, abs=0.1)


def test_cli_quantize_gives_the_model_verify_measured(run_cli, tmp_path):
    """verify --emit-plan, then qlint quantize with that plan: the saved int8 model has the SQNR verify
    reported (bias correction, rewrites and mapping applied alike), and the command says so."""
    model, calibration, eval_data = _fanout_files(tmp_path)
    verified = run_cli(
        "verify", model, "--calibration", "cal.pt", "--eval-data", "eval.pt", "--format", "json",
        "--emit-plan", "verified.json", cwd=tmp_path,
    )  # fmt: skip
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert any(d["kind"] == "bias_correction" for d in report["decisions"])  # the trial ran
    result = run_cli(
        "quantize", model, "--plan", "verified.json", "--calibration", "cal.pt", "--eval-data", "eval.pt",
        "-o", "int8.pt", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    printed = float(result.stdout.split("output SQNR ")[1].split(" dB")[0])
    assert printed == pytest.approx(report["plan"]["sqnr_db"], abs=0.01)
    saved = torch.jit.load(str(tmp_path / "int8.pt"))
    assert _output_sqnr(make_fanout_net(), saved, eval_data) == pytest.approx(report["plan"]["sqnr_db"], abs=0.1)
    refused = run_cli("quantize", model, "--calibration", "cal.pt", "-o", "int8.pt2", cwd=tmp_path)
    assert refused.returncode == 2 and "any other model as .pt (TorchScript)" in refused.stderr  # .pt2: pt2e only
    assert "Traceback" not in refused.stderr
    torch.export.save(torch.export.export(make_fanout_net().eval(), (calibration[0],)), str(tmp_path / "m.pt2"))
    aten = run_cli("quantize", "m.pt2", "--calibration", "cal.pt", "-o", "m.pt", cwd=tmp_path)
    assert aten.returncode == 2 and "saved as .pt2" in aten.stderr  # a .pt2 is quantized with pt2e, saved as .pt2


def test_cli_quantize_traces_a_model_torchscript_cannot_script(run_cli, tmp_path):
    """The demo model's annotations defeat torch.jit.script: qlint quantize traces it instead, says
    so, and the file loads and runs."""
    from examples.compare_demo import batches

    result = run_cli(
        "quantize", "examples.compare_demo:float_model", "--calibration", "examples.compare_demo:batches",
        "-o", str(tmp_path / "demo.pt"), cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "traced on calibration batch 0" in result.stdout
    loaded = torch.jit.load(str(tmp_path / "demo.pt"))
    first = next(iter(batches()))
    assert torch.isfinite(loaded(first if torch.is_tensor(first) else first[0])).all()
