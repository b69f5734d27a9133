"""Output shows names literally, and the model's own prints stay off the report stream.

Attacks: module names holding rich markup (``[/]``, ``[link=...]``) and ESC/BEL control
sequences, a model file whose name holds a newline and a GitHub workflow command, and a
model whose factory and forward print to stdout.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

MARKUP = "[/]bn[link=https://evil/x]x[bold]"
ESCAPE = "r\x1b[31mRED\x07"

MODEL_SOURCE = f'''
import torch.nn as nn


class Named(nn.Module):
    """conv -> bn -> relu with a fan-out: QL101 reports the three names."""

    def __init__(self):
        super().__init__()
        self.add_module("conv", nn.Conv2d(3, 8, 3))
        self.add_module({MARKUP!r}, nn.BatchNorm2d(8))
        self.add_module({ESCAPE!r}, nn.ReLU())

    def forward(self, x):
        conv, bn, relu = self.children()
        print('{{"printed": "by forward"}}')
        y = conv(x)
        return relu(bn(y)) + y


def build():
    print("printed by the factory [bold]")
    return Named().eval()
'''


@pytest.fixture
def project(tmp_path):
    (tmp_path / "named_model.py").write_text(MODEL_SOURCE)
    return tmp_path


def _no_control_characters(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text, repr(text)


def test_markup_and_escape_sequences_are_shown_literally(run_main, project):
    for extra in ([], ["-q"]):
        result = run_main(
            "named_model:build", "--input-shape", "1,3,8,8", "--no-trial", "--select", "QL101", *extra, cwd=project
        )
        assert result.returncode == 1, result.stderr  # findings, not a rendering crash
        assert MARKUP in result.stdout, result.stdout
        assert "r\\x1b[31mRED\\x07" in result.stdout, result.stdout
        _no_control_characters(result.stdout)


def test_print_in_user_code_never_reaches_json_or_sarif(run_main, project):
    for output_format in ("json", "sarif"):
        result = run_main(
            "named_model:build",
            "--input-shape",
            "1,3,8,8",
            "--no-trial",  # the findings' severity, not their measured impact, decides the exit here
            "--select",
            "QL101,QL203",
            "--random-calibration",
            "2",
            "--format",
            output_format,
            cwd=project,
        )
        assert result.returncode == 1, result.stderr
        payload = json.loads(result.stdout)  # the report alone: no printed line mixed in
        assert "printed by the factory" in result.stderr and '{"printed": "by forward"}' in result.stderr
        if output_format == "json":
            targets = {f["target"] for f in payload["findings"]}
            assert "conv" in targets


class FanOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.conv(x)
        return self.relu(self.bn(y)) + y  # QL101: the fan-out keeps conv-bn-relu unfused


def _check_annotations(stdout: str) -> None:
    _no_control_characters(stdout)
    assert stdout.strip(), "expected at least one annotation"
    assert all(line.startswith(("::warning ", "::notice ", "::error ")) for line in stdout.splitlines()), stdout
    assert not any(line.startswith("::error title=injected") for line in stdout.splitlines()), stdout


def test_a_file_name_cannot_inject_workflow_commands(run_main, tmp_path):
    name = "m\n::error title=injected::pwned\x1b[2J.pt2"
    torch.export.save(torch.export.export(FanOut().eval(), (torch.randn(1, 3, 8, 8),)), tmp_path / name)
    github = run_main(name, "--format", "github", "--select", "QL101", cwd=tmp_path)
    assert github.returncode == 1, github.stderr
    _check_annotations(github.stdout)
    assert "file=m%0A%3A%3Aerror title=injected%3A%3Apwned\\x1b[2J.pt2" in github.stdout, github.stdout
    text = run_main(name, "--select", "QL101", "-q", cwd=tmp_path)
    assert text.returncode == 1, text.stderr
    _no_control_characters(text.stdout)
    assert not any(line.startswith("::") for line in text.stdout.splitlines()), text.stdout
    assert "m\\n::error title=injected::pwned\\x1b[2J.pt2: warning QL101" in text.stdout, text.stdout


def test_github_annotations_escape_module_names(run_main, project):
    result = run_main(
        "named_model:build",
        "--input-shape",
        "1,3,8,8",
        "--no-trial",
        "--select",
        "QL101",
        "--format",
        "github",
        cwd=project,
    )
    assert result.returncode == 1, result.stderr
    _check_annotations(result.stdout)
    assert "r\\x1b[31mRED\\x07" in result.stdout
