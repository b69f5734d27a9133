"""A setting in [tool.qlint] that cannot mean anything: one line that names the pyproject.toml
and the key, exit 2 (a bad input-shape said 'bad --input-shape', as if it were a flag)."""

import pytest

MODEL = "import torch.nn as nn\n\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()\n"


def _one_line_error(result):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture
def project(tmp_path):
    (tmp_path / "m.py").write_text(MODEL)
    return tmp_path


BAD_SETTINGS = [
    ('input-shape = ["1,x,4"]', "[tool.qlint] input-shape: '1,x,4'", "comma-separated integers"),
    ('input-shape = ["4,0"]', "[tool.qlint] input-shape: '4,0'", "positive"),
    ('input-shape = ["1,4:complex"]', "[tool.qlint] input-shape: '1,4:complex'", "dtype"),
    ('backend = "tpu"', "[tool.qlint] backend: unknown backend 'tpu'", "x86"),
    ('select = ["QL999"]', "[tool.qlint] select: unknown rule selector 'QL999'", "qlint rules"),
    ('ignore = ["QL101", "nope"]', "[tool.qlint] ignore: unknown rule selector 'nope'", "qlint rules"),
    (
        '[[tool.qlint.files]]\npath = "models/*.pt2"\ninput-shape = ["1,,4"]',
        "[[tool.qlint.files]] path = 'models/*.pt2': input-shape: '1,,4'",
        "comma-separated integers",
    ),
    (
        '[[tool.qlint.files]]\npath = "models/*.pt2"\nbackend = "gpu"',
        "[[tool.qlint.files]] path = 'models/*.pt2': backend: unknown backend 'gpu'",
        "x86",
    ),
]


@pytest.mark.parametrize("setting, where, problem", BAD_SETTINGS)
def test_a_bad_setting_names_its_pyproject_and_key(run_main, project, setting, where, problem):
    pyproject = project / "pyproject.toml"
    pyproject.write_text(f"[tool.qlint]\n{setting}\n")
    # the shape settings are the only example inputs; the others get theirs from the flag
    flags = () if "input-shape" in setting else ("--input-shape", "1,4")
    line = _one_line_error(run_main("m:build", *flags, "--no-trial", cwd=project))
    assert f"{pyproject} {where}" in line and problem in line, line


def test_the_flag_still_names_the_flag(run_main, project):
    line = _one_line_error(run_main("m:build", "--input-shape", "1,x,4", "--no-trial", cwd=project))
    assert "bad --input-shape '1,x,4': expected comma-separated integers" in line, line
    assert "pyproject" not in line
