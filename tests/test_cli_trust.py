"""A cloned repository's pyproject.toml never runs its code behind the user's back.

Each attack is a real hostile repository: a .pt2 model next to a pyproject.toml whose
[tool.qlint] names a module of the repository; importing that module writes a marker
file. Running `qlint model.pt2` there must refuse (exit 2, one line naming the setting
and --trust-config) without importing it, and run it only when the user opts in.
"""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn as nn

PAYLOAD = """\
import pathlib
pathlib.Path(__file__).with_name("PWNED").write_text("repository code ran")

def mapping():
    from torch.ao.quantization import get_default_qconfig_mapping
    return get_default_qconfig_mapping("x86")

def batches():
    import torch
    return [torch.randn(2, 8) for _ in range(2)]
"""


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exported")
    path = folder / "model.pt2"
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),)), path)
    return path


def _hostile_repo(tmp_path, model_file, pyproject: str):
    """The repository; its code module gets a fresh name so that no earlier import is reused."""
    module = f"repo_code_{uuid.uuid4().hex[:12]}"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "model.pt2").write_bytes(model_file.read_bytes())
    (tmp_path / f"{module}.py").write_text(PAYLOAD)
    (tmp_path / "pyproject.toml").write_text(pyproject.replace("repo_code", module))
    return tmp_path / "PWNED", module


def _one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "pyproject, setting",
    [
        ('[tool.qlint]\nqconfig-mapping = "repo_code:mapping"\n', "qconfig-mapping"),
        ('[tool.qlint]\ncalibration = "repo_code:batches"\n', "calibration"),
        ('[[tool.qlint.files]]\npath = "models/*.pt2"\ncalibration = "repo_code.py:batches"\n', "calibration"),
        (
            '[[tool.qlint.files]]\npath = "models/model.pt2"\nqconfig-mapping = "repo_code.py:mapping"\n',
            "qconfig-mapping",
        ),
    ],
)
def test_code_settings_are_refused_without_trust(run_main, tmp_path, model_file, pyproject, setting):
    marker, _ = _hostile_repo(tmp_path, model_file, pyproject)
    line = _one_line(run_main("models/model.pt2", cwd=tmp_path))
    assert not marker.exists(), "qlint imported code named by the repository's pyproject.toml"
    assert setting in line and "--trust-config" in line and "pyproject.toml" in line, line
    if "files" in pyproject:
        assert "[[tool.qlint.files]]" in line, line


def test_trust_config_runs_it_and_flags_need_no_opt_in(run_cli, run_main, tmp_path, model_file):
    marker, module = _hostile_repo(tmp_path, model_file, '[tool.qlint]\nqconfig-mapping = "repo_code:mapping"\n')
    trusted = run_cli("models/model.pt2", "--trust-config", "--select", "QL103", cwd=tmp_path)
    assert trusted.returncode in (0, 1), trusted.stderr
    assert marker.exists(), "--trust-config should allow the setting"
    marker.unlink()
    # The same code named on the command line is the user's own intent.
    (tmp_path / "pyproject.toml").write_text("[tool.qlint]\n")
    flagged = run_main(
        "models/model.pt2",
        "--qconfig-mapping",
        f"{module}:mapping",
        "--calibration",
        f"{module}:batches",
        "--select",
        "QL103,QL201",
        cwd=tmp_path,
    )
    assert flagged.returncode in (0, 1), flagged.stderr
    assert marker.exists()


def test_plain_data_settings_need_no_trust(run_main, tmp_path, model_file):
    """A calibration file (not code) in the settings is loaded weights_only, without --trust-config."""
    marker, _ = _hostile_repo(tmp_path, model_file, '[tool.qlint]\ncalibration = "calib.pt"\nfail-on = "error"\n')
    torch.save([torch.randn(2, 8) for _ in range(3)], tmp_path / "calib.pt")
    result = run_main("models/model.pt2", "--select", "QL201", "--format", "json", cwd=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    assert '"QL201"' in result.stdout and "no calibration data" not in result.stdout
    assert not marker.exists()


def test_a_look_alike_file_in_the_working_directory_does_not_turn_code_into_data(run_main, tmp_path, model_file):
    """A setting is judged where it points (beside its pyproject.toml): an empty file in the
    working directory named exactly like the spec must not pass 'file.py:function' off as data."""
    repo = tmp_path / "repo"
    repo.mkdir()
    marker, module = _hostile_repo(repo, model_file, '[tool.qlint]\ncalibration = "repo_code.py:batches"\n')
    (tmp_path / f"{module}.py:batches").write_bytes(b"")
    line = _one_line(run_main("repo/models/model.pt2", "--no-trial", cwd=tmp_path))
    assert not marker.exists(), "qlint ran repository code behind a look-alike file"
    assert "calibration" in line and "--trust-config" in line, line
