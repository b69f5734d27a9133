"""A plan says which flow it is for: one made from an exported program (a .pt2) is a pt2e plan,
shown in the number format of the pt2e quantizer (torchao's X86InductorQuantizer: no
reduce_range), and it has no QConfigMapping; a schema-1 plan file reads as an fx plan."""

import json

import pytest
import torch
import torch.nn as nn
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import get_default_x86_inductor_quantization_config

from qlint.advice.plan import ModuleDecision, Provenance, QuantPlan, default_plan
from qlint.errors import ConfigError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.head(torch.relu(self.fc(y.reshape(y.size(0), -1))))


@pytest.fixture
def pt2_folder(tmp_path):
    """net.pt2 with its calibration and eval batches."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(4)]
    program = torch.export.export(_Net().eval(), (calibration[0],))
    torch.export.save(program, str(tmp_path / "net.pt2"))
    torch.save(calibration, tmp_path / "cal.pt")
    torch.save([torch.randn(4, 3, 8, 8, generator=generator) for _ in range(2)], tmp_path / "eval.pt")
    return tmp_path


def _range(spec) -> str:
    return f"{spec.quant_min}..{spec.quant_max}"


def test_a_plan_linted_from_a_pt2_is_a_pt2e_plan_shown_in_its_quantizers_format(run_main, pt2_folder):
    linted = run_main("net.pt2", "--calibration", "cal.pt", "--emit-plan", "plan.json", cwd=pt2_folder)
    assert linted.returncode in (0, 1), linted.stderr
    plan = QuantPlan.load(str(pt2_folder / "plan.json"))
    assert plan.flow == "pt2e"
    shown = run_main("plan", "show", "plan.json", cwd=pt2_folder)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    activation = next(line for line in lines if "global activation" in line)
    weight = next(line for line in lines if "global weight" in line)
    config = get_default_x86_inductor_quantization_config()  # what prepare_pt2e quantizes to
    assert "uint8" in activation and _range(config.input_activation) in activation
    assert "int8" in weight and _range(config.weight) in weight and "per-channel symmetric" in weight
    assert "reduce_range" not in shown.stdout and "pt2e flow" in lines[0]


def test_a_pt2e_plans_module_decision_shows_its_observer_without_fx_number_format():
    plan = default_plan("x86", model="net.pt2").model_copy(update={"flow": "pt2e"})
    clipped = plan.activation.changed(observer="percentile", percentile=99.9)
    source = Provenance(rule="QL203", target="fc")
    plan = plan.model_copy(update={"modules": [ModuleDecision(fqn="fc", activation=clipped, provenance=[source])]})
    text = plan.pretty()
    assert "fc: static, activation percentile percentile=99.9  [QL203 on fc]" in text
    assert "reduce_range" not in text
    # the same plan for prepare_fx keeps its number format, reduce_range included
    assert "reduce_range" in plan.model_copy(update={"flow": "fx"}).pretty()


def test_a_pt2e_plan_has_no_qconfig_mapping_and_says_so_in_one_line(run_main, pt2_folder):
    plan = default_plan("x86", model="net.pt2").model_copy(update={"flow": "pt2e"})
    (pt2_folder / "plan.json").write_text(plan.model_dump_json())
    with pytest.raises(ConfigError, match="to_pt2e_quantizer"):
        plan.to_qconfig_mapping()
    for args in (("plan", "qconfig", "plan.json"), ("net.pt2", "--calibration", "cal.pt", "--emit-qconfig", "q.py")):
        refused = run_main(*args, cwd=pt2_folder)
        assert refused.returncode == 2 and refused.stdout == ""
        assert len(refused.stderr.strip().splitlines()) == 1 and "to_pt2e_quantizer" in refused.stderr
    assert not (pt2_folder / "q.py").exists()
    checked = run_main("plan", "check", "plan.json", cwd=pt2_folder)
    assert checked.returncode == 0 and "pt2e flow" in checked.stdout, checked.stderr


def test_verify_of_a_pt2_writes_a_pt2e_plan_that_quantize_applies(run_main, pt2_folder):
    (pt2_folder / "plan.json").write_text(default_plan("x86", model="net.pt2").model_dump_json())
    data = ["--calibration", "cal.pt", "--eval-data", "eval.pt"]
    verified = run_main("verify", "net.pt2", "--plan", "plan.json", *data, "--emit-plan", "v.json", cwd=pt2_folder)
    assert verified.returncode == 0, verified.stderr
    assert json.loads((pt2_folder / "v.json").read_text())["flow"] == "pt2e"
    result = run_main("quantize", "net.pt2", "--plan", "v.json", *data, "-o", "int8.pt2", cwd=pt2_folder)
    assert result.returncode == 0, result.stderr
    assert "int8 3/3" in result.stdout


def test_a_schema_1_plan_reads_as_an_fx_plan_and_a_pt2e_plan_is_newer():
    raw = json.loads(default_plan("x86").model_dump_json())
    old = {key: value for key, value in raw.items() if key != "flow"} | {"schema_version": 1}
    plan = QuantPlan.from_json(json.dumps(old))
    assert plan.flow == "fx" and plan.schema_version == 2  # written back as schema 2
    assert "reduce_range" in plan.pretty()
    # a qlint reading schema 1 only refuses a pt2e plan as newer ("upgrade qlint"), not as an fx plan
    written = json.loads(plan.model_copy(update={"flow": "pt2e"}).model_dump_json())
    assert written["schema_version"] > 1 and written["flow"] == "pt2e"
