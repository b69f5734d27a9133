"""The CLI in a real project with nested folders, as ruff users expect it.

tmp/
  pyproject.toml            [tool.qlint] select = ["QL102"]       (the outer project)
  fan_out.py                a module:factory model
  other.toml                a --config file
  proj/
    pyproject.toml          [tool.qlint] + [[tool.qlint.files]] with a relative calibration
    data/calib.pt
    models/
      pyproject.toml        no [tool.qlint]: skipped by discovery
      bad.pt2               conv-bn-relu with a fan-out: QL101 (info, measured), and a head
                            with unbalanced input channels: QL202 (warning, measured): exit 1
  bl/                       a project whose baseline path is relative to its pyproject
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import torch

from qlint.cli.main import COMMAND_SUMMARIES, _commands, main
from tests.conftest import ROOT

FAN_OUT = """
from torch import nn


class FanOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x)
        z = self.relu(self.bn(y)) + y   # the fan-out keeps conv-bn-relu unfused: QL101
        return self.head(z.mean((2, 3)))


def build():
    return FanOut().eval()
"""


def _fan_out_module():
    namespace: dict = {}
    exec(compile(FAN_OUT, "fan_out.py", "exec"), namespace)
    return namespace["build"]()


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    (root / "pyproject.toml").write_text('[tool.qlint]\nselect = ["QL102"]\n')
    (root / "fan_out.py").write_text(FAN_OUT)
    (root / "other.toml").write_text('[tool.qlint]\nselect = ["QL102"]\nfail-on = "error"\n')
    proj = root / "proj"
    (proj / "models").mkdir(parents=True)
    (proj / "data").mkdir()
    (proj / "pyproject.toml").write_text(
        '[tool.qlint]\nfail-on = "warning"\n\n'
        '[[tool.qlint.files]]\npath = "models/*.pt2"\ncalibration = "data/calib.pt"\n'
    )
    (proj / "models" / "pyproject.toml").write_text("[tool.black]\nline-length = 100\n")
    # The exit codes below need a finding at warning: with these weights QL202's fix trial gains
    # 2.3 dB; other weights gain less (info). Seeded here, not by whichever tests ran before.
    with torch.random.fork_rng():
        torch.manual_seed(2)
        program = torch.export.export(_fan_out_module(), (torch.randn(1, 3, 8, 8),))
        calibration = [torch.randn(1, 3, 8, 8) for _ in range(3)]
    torch.export.save(program, proj / "models" / "bad.pt2")
    torch.save(calibration, proj / "data" / "calib.pt")
    baseline_project = root / "bl"
    (baseline_project / "models").mkdir(parents=True)
    (baseline_project / "pyproject.toml").write_text('[tool.qlint]\nbaseline = "qlint-baseline.json"\n')
    torch.export.save(program, baseline_project / "models" / "bad.pt2")
    return root


def _findings(result) -> set[str]:
    return {finding["rule"] for finding in json.loads(result.stdout)["findings"]}


# ------------------------------------------------------------------ 17.1 config follows the model
def test_config_is_found_from_the_model_folder(run_main, project):
    """Run from the outer folder: proj/pyproject.toml (not the outer one, not the one without
    [tool.qlint]) applies, and its per-file calibration path is relative to proj/."""
    result = run_main("proj/models/bad.pt2", "--format", "json", cwd=project)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert "QL101" in _findings(result)  # the outer select = ["QL102"] did not apply
    assert not [s for s in report["skipped"] if "calibration" in s["reason"]], report["skipped"]
    assert report["layers"], "the data rules ran on proj/data/calib.pt"


def test_factory_models_use_the_working_directory_and_config_overrides(run_main, project):
    factory = run_main("fan_out:build", "--input-shape", "1,3,8,8", "--format", "json", cwd=project)
    assert _findings(factory) <= {"QL102"}, factory.stdout  # the outer pyproject: select QL102
    chosen = run_main("proj/models/bad.pt2", "--config", "other.toml", "--format", "json", cwd=project)
    assert chosen.returncode == 0, chosen.stderr  # other.toml: QL102 only, fail-on error
    report = json.loads(chosen.stdout)
    assert _findings(chosen) <= {"QL102"} and not report["layers"]


# ------------------------------------------------------------------ 17.4 quiet and machine output
def test_quiet_prints_findings_only(run_main, project):
    full = run_main("proj/models/bad.pt2", cwd=project)
    quiet = run_main("proj/models/bad.pt2", "-q", cwd=project)
    assert full.returncode == quiet.returncode == 1, quiet.stderr
    assert "Per-layer statistics" in full.stdout
    assert "Per-layer statistics" not in quiet.stdout and "┃" not in quiet.stdout
    lines = quiet.stdout.splitlines()
    assert lines and all(line.startswith("proj/models/bad.pt2: ") for line in lines), quiet.stdout
    assert any(" QL101 unfused-pattern " in line for line in lines)
    assert len(lines) < len(full.stdout.splitlines()) / 3


def test_write_baseline_exits_0_and_lands_next_to_its_pyproject(run_main, project):
    written = run_main("bl/models/bad.pt2", "--write-baseline", cwd=project)
    assert written.returncode == 0, written.stderr
    assert (project / "bl" / "qlint-baseline.json").is_file()
    assert not (project / "qlint-baseline.json").exists()
    again = run_main("bl/models/bad.pt2", "-q", cwd=project)
    assert again.returncode == 0, again.stdout + again.stderr  # every finding is in the baseline


@pytest.mark.parametrize("columns", [60, 220])
def test_tables_follow_columns(run_main, project, columns):
    result = run_main("proj/models/bad.pt2", "--show-qconfig", cwd=project, env={"COLUMNS": str(columns)})
    assert result.returncode == 1, result.stderr
    widths = [len(line) for line in result.stdout.splitlines()]
    assert max(widths) <= columns
    if columns > 200:
        assert max(widths) > 120  # not cut at the old fixed width
        assert "PerChannelMinMaxObserver" in result.stdout


def test_piped_tables_keep_their_natural_width(run_main, project):
    result = run_main("proj/models/bad.pt2", "--show-qconfig", cwd=project, env={"COLUMNS": ""})
    assert result.returncode == 1, result.stderr
    assert "PerChannelMinMaxObserver" in result.stdout and "HistogramObserver" in result.stdout


def test_calibration_in_a_log_prints_progress_lines(run_main, project, monkeypatch):
    """stderr is not a terminal here (a CI log): short progress lines, none with -q. The
    interval is set to 0 so that every batch prints one."""
    from qlint.linter.calibration import run as calibration

    monkeypatch.setattr(calibration, "PROGRESS_LINE_SECONDS", 0.0)
    logged = run_main("proj/models/bad.pt2", "--format", "json", cwd=project)
    assert logged.returncode == 1, logged.stderr
    progress = [line for line in logged.stderr.splitlines() if line.startswith("qlint: calibrating: ")]
    assert progress and progress[-1].startswith("qlint: calibrating: 3/3 batches"), logged.stderr
    json.loads(logged.stdout)
    quiet = run_main("proj/models/bad.pt2", "--format", "json", "-q", cwd=project)
    assert quiet.returncode == 1 and "calibrating" not in quiet.stderr


# ------------------------------------------------------------------ 17.5 files and help
def _readme_compare_command() -> list[str]:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^qlint compare .*$", text.replace("\\\n", " "), flags=re.M)
    assert match, "README has no qlint compare example"
    return shlex.split(match.group(0))


def test_readme_compare_example_writes_to_a_named_ignored_path(run_main, tmp_path):
    command = _readme_compare_command()
    html = command[command.index("--html") + 1]
    assert "/" in html, "the example must write into a folder, not the repository root"
    ignored = subprocess.run(["git", "check-ignore", "-q", html], cwd=ROOT)
    assert ignored.returncode == 0, f"{html} is not gitignored"
    result = run_main(*command[1:], "--max-batches", "1", cwd=tmp_path)  # as written, on one batch
    assert result.returncode in (0, 1), result.stderr
    assert (tmp_path / html).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [html.split("/")[0]]  # nothing else left behind


def test_help_lists_every_command(capsys):
    assert set(_commands()) == set(COMMAND_SUMMARIES)
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for command in COMMAND_SUMMARIES:
        assert f"qlint {command} " in text, command
        assert main([command, "--help"]) == 0
        assert f"qlint {command}" in capsys.readouterr().out


def test_precommit_docs_pin_torch_for_the_isolated_hook(tmp_path):
    text = (ROOT / "docs" / "pre-commit.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    isolated = [b for b in blocks if "id: qlint\n" in b and "additional_dependencies" in b]
    assert isolated, "docs/pre-commit.md shows no isolated hook with additional_dependencies"
    import yaml

    config = yaml.safe_load(isolated[0])
    hook = config["repos"][0]["hooks"][0]
    assert any(re.fullmatch(r"torch==[0-9.]+(\+cpu)?", dep) for dep in hook["additional_dependencies"]), hook
    (tmp_path / ".pre-commit-config.yaml").write_text(isolated[0])
    valid = subprocess.run(
        [sys.executable, "-m", "pre_commit", "validate-config", ".pre-commit-config.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert valid.returncode == 0, valid.stdout + valid.stderr
    assert "CPU" in text and "--trust-config" in text
