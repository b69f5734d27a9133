"""Several models in one command (what a pre-commit hook runs): one document on stdout, one
baseline with an entry per model, and no output file that each model would overwrite (QA: the
baseline and --emit-plan kept the last model only, and JSON/SARIF printed one document per
model one after another, which no JSON reader takes)."""

import json

import pytest
import torch

from qlint.linter.findings import Report

MODELS = (
    "import torch.nn as nn\n\n"
    "class WithSpare(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.conv, self.spare = nn.Conv2d(3, 4, 3), nn.Linear(4, 4)  # spare: never called (QL102)\n\n"
    "    def forward(self, x):\n        return self.conv(x)\n\n"
    "def conv():\n    return WithSpare().eval()\n\n"
    "def linear():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()\n"
)


@pytest.fixture
def project(tmp_path):
    (tmp_path / "nets.py").write_text(MODELS)
    (tmp_path / "pyproject.toml").write_text(
        "[tool.qlint]\ntrial = false\n\n"
        '[[tool.qlint.files]]\npath = "nets:conv"\ninput-shape = ["1,3,8,8"]\n\n'
        '[[tool.qlint.files]]\npath = "nets:linear"\ninput-shape = ["2,4"]\n'
    )
    return tmp_path


def test_json_and_sarif_of_several_models_are_one_document(run_main, project):
    as_json = run_main("nets:conv", "nets:linear", "--format", "json", cwd=project)
    assert as_json.returncode in (0, 1), as_json.stderr
    reports = [Report.model_validate(item) for item in json.loads(as_json.stdout)]
    assert [report.model for report in reports] == ["nets:conv", "nets:linear"]
    as_sarif = run_main("nets:conv", "nets:linear", "--format", "sarif", cwd=project)
    log = json.loads(as_sarif.stdout)
    assert log["version"] == "2.1.0"
    assert [run["properties"]["model"] for run in log["runs"]] == [report.model for report in reports]


def test_one_baseline_holds_every_model_and_each_is_checked_against_its_own(run_main, project):
    baseline = ("--baseline", "qlint-baseline.json")
    first = run_main("nets:conv", "nets:linear", *baseline, "--write-baseline", cwd=project)
    assert first.returncode == 0, first.stderr
    recorded = json.loads((project / "qlint-baseline.json").read_text())["models"]
    assert sorted(recorded) == ["nets:conv", "nets:linear"]
    assert recorded["nets:conv"]["fingerprints"]  # the unfused conv-bn-relu at least
    again = run_main("nets:conv", "nets:linear", *baseline, cwd=project)
    assert again.returncode == 0, again.stdout + again.stderr  # nothing new in either model


@pytest.mark.parametrize("flag", [("--emit-plan", "plan.json"), ("--emit-qconfig", "q.py"), ("-o", "r.txt")])
def test_an_output_file_takes_one_model(run_main, project, flag):
    result = run_main("nets:conv", "nets:linear", *flag, cwd=project)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "takes one model" in lines[0], result.stderr
    assert not (project / flag[1]).exists()


def test_failing_models_still_leave_one_document(run_main, project):
    result = run_main("nets:nope", "nets:linear", "nets:gone", "--format", "json", cwd=project)
    assert result.returncode == 2
    assert [Report.model_validate(item).model for item in json.loads(result.stdout)] == ["nets:linear"]
    none = run_main("nets:nope", "nets:gone", "--format", "sarif", cwd=project)
    assert none.returncode == 2 and json.loads(none.stdout)["runs"] == []


def test_models_whose_settings_ask_for_different_formats_are_refused_before_any_lint(run_main, tmp_path):
    for folder, output in (("a", "json"), ("b", "text")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "net.py").write_text(MODELS)
        (tmp_path / folder / "pyproject.toml").write_text(f'[tool.qlint]\ntrial = false\nformat = "{output}"\n')
        torch.save(torch.nn.Linear(4, 2), tmp_path / folder / "m.pt")
    result = run_main("a/m.pt", "b/m.pt", "--trust-pickle", "--input-shape", "2,4", cwd=tmp_path)
    assert result.returncode == 2 and not result.stdout
    assert "several output formats (json, text) on one stdout" in result.stderr
