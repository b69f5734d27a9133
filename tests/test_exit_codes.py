"""Exit codes never lie: every failure is exit 2 with one clear line, never a silent 0,
an exit 3 or an "internal error".

Cases that depend on the process (plugins found on PYTHONPATH, a closed stdout) run the
console script in a subprocess (run_cli); the others call the same ``main()`` in-process
(run_main), which saves the interpreter start-up.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tests.conftest import ROOT


def _one_line(result) -> str:
    """The run's one error line: exit 2, one stderr line (the model's own prints aside), no
    traceback and no "internal error"."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("printed")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr
    return lines[0]


def _mentions(line: str, *needles: str) -> bool:
    return all(needle.lower() in line.lower() for needle in needles)


TINY = "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU())\n"


# ------------------------------------------------------------------ user code calling sys.exit
@pytest.mark.parametrize(
    "module, source, code",
    [
        ("quits_in_factory", "def build():\n    raise SystemExit(0)\n", "0"),
        (
            "quits_in_forward",
            "import sys, torch.nn as nn\n\nclass M(nn.Module):\n    def forward(self, x):\n"
            "        sys.exit(3)\n\ndef build():\n    return M()\n",
            "3",
        ),
    ],
)
def test_sys_exit_in_user_code_is_exit_2(run_main, tmp_path, module, source, code):
    (tmp_path / f"{module}.py").write_text(source)
    result = run_main(f"{module}:build", "--input-shape", "1,4", "--select", "QL105", cwd=tmp_path)
    line = _one_line(result)
    assert _mentions(line, f"sys.exit({code})"), line


# ------------------------------------------------------------------ plugins: sys.exit and crashes
def _install_plugin(site, name: str, body: str) -> None:
    package = site / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(body))
    dist = site / f"{name}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[qlint.rules]\n{name} = {name}\n")


CRASHING_RULE = '''
from qlint.linter.findings import Severity
from qlint.linter.rule import Rule, RuleOptions


class Crashes(Rule):
    """Raises in check().

    ## What it does
    Crashes.
    ## Why is this bad?
    A test.
    ## Example
    Any model.
    ## Use instead
    Nothing.
    ## Options
    None.
    ## References
    - none
    """
    code = "XQ900"
    name = "crashes"
    summary = "Always crashes."
    severity = Severity.WARNING

    class Options(RuleOptions):
        pass

    def check(self, ctx):
        raise RuntimeError("boom in XQ900")
'''

FAN_OUT = """
from torch import nn


class FanOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        y = self.conv(x)
        return self.relu(self.bn(y)) + y


def build():
    return FanOut().eval()
"""


def test_a_crashed_rule_exits_2_and_the_other_findings_are_printed(run_cli, tmp_path):
    _install_plugin(tmp_path / "site", "qlint_crashing_rule", CRASHING_RULE)
    (tmp_path / "fan_out.py").write_text(FAN_OUT)
    result = run_cli(
        "fan_out:build",
        "--input-shape",
        "1,3,8,8",
        "--select",
        "QL101,XQ900",
        "-q",
        cwd=tmp_path,
        env={"PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"},
    )
    line = _one_line(result)
    assert _mentions(line, "analysis incomplete", "XQ900", "boom"), line
    assert "fan_out:build" in line
    assert "QL101" in result.stdout  # the rules that ran still report


def test_sys_exit_in_a_plugin_is_exit_2(run_cli, tmp_path):
    _install_plugin(tmp_path / "site", "qlint_quitting_plugin", "import sys\nsys.exit(0)\n")
    result = run_cli("rules", cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"})
    line = _one_line(result)
    assert _mentions(line, "sys.exit(0)"), line


# ------------------------------------------------------------------ settings and arguments
@pytest.mark.parametrize(
    "pyproject, needles",
    [
        ("[tool.qlint.rules.QL999]\nthreshold = 1\n", ("QL999", "unknown rule")),
        ('[tool.qlint]\nfail-on = "sometimes"\n', ("fail-on", "error", "warning")),
        ("[tool.qlint]\nnum-batches = 0\n", ("num-batches",)),
        ("[tool.qlint]\nselect = " + "[" * 5000 + "]" * 5000 + "\n", ("nested too deeply",)),
    ],
)
def test_bad_settings_are_one_line(run_main, tmp_path, pyproject, needles):
    (tmp_path / "tiny_settings_model.py").write_text(TINY)
    (tmp_path / "pyproject.toml").write_text(pyproject)
    line = _one_line(run_main("tiny_settings_model:build", "--input-shape", "1,4"))
    assert _mentions(line, "pyproject.toml", *needles), line


@pytest.mark.parametrize(
    "args, needles",
    [
        (("--random-calibration", "0"), ("--random-calibration", "positive")),
        (("--random-calibration", "-3"), ("--random-calibration", "positive")),
        # no upper bound ran one forward pass per batch for hours, or overflowed an index
        (("--random-calibration", "10001"), ("--random-calibration", "at most 10,000", "--calibration")),
        (("--random-calibration", "1" + "0" * 25), ("--random-calibration", "at most 10,000")),
        (("--num-batches", "0"), ("--num-batches", "positive")),
        (("--input-shape", "1000000,1000000,1000"), ("--input-shape", "elements", "--example-inputs")),
    ],
)
def test_bad_arguments_are_one_line(run_main, tmp_path, args, needles):
    (tmp_path / "tiny_args_model.py").write_text(TINY)
    line = _one_line(run_main("tiny_args_model:build", *args))
    assert _mentions(line, *needles), line


def test_deeply_nested_baseline_and_plan_are_one_line(run_main, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "baseline.json").write_text(deep)
    (tmp_path / "plan.json").write_text(deep)
    (tmp_path / "tiny_deep_model.py").write_text(TINY)
    line = _one_line(
        run_main("tiny_deep_model:build", "--input-shape", "1,4", "--select", "QL102", "--baseline", "baseline.json")
    )
    assert _mentions(line, "baseline", "nested too deeply"), line
    line = _one_line(run_main("plan", "check", "plan.json"))
    assert _mentions(line, "nested too deeply"), line


def test_weights_with_the_wrong_shape(run_main, tmp_path):
    (tmp_path / "tiny_weights_model.py").write_text(TINY)
    wrong = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    torch.save(wrong.state_dict(), tmp_path / "wrong.pt")
    line = _one_line(run_main("tiny_weights_model:build", "--weights", "wrong.pt", "--input-shape", "1,4"))
    assert _mentions(line, "wrong.pt", "does not fit", "size mismatch"), line


def test_html_pointing_at_a_directory(run_main, tmp_path):
    (tmp_path / "out").mkdir()
    result = run_main(
        "compare",
        "examples.compare_demo:float_model",
        "examples.compare_demo:quantized_model",
        "--calibration",
        "examples.compare_demo:batches",
        "--html",
        "out",
        cwd=tmp_path,
    )
    line = _one_line(result)
    assert _mentions(line, "--html", "directory"), line


def test_outputs_never_overwrite_the_input_model(run_main, tmp_path):
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    torch.export.save(torch.export.export(model, (torch.randn(1, 4),)), tmp_path / "model.pt2")
    original = (tmp_path / "model.pt2").read_bytes()
    for flags in (
        ("-o", "model.pt2"),
        ("--baseline", "model.pt2", "--write-baseline"),
        ("--emit-qconfig", "./model.pt2"),
    ):
        line = _one_line(run_main("model.pt2", *flags))
        assert _mentions(line, "model.pt2", "input", "overwrite"), line
    assert (tmp_path / "model.pt2").read_bytes() == original


_SOURCE = """\
import torch, torch.nn as nn

def build():
    return nn.Sequential(nn.Linear(4, 4)).eval()

def batches():
    return [torch.randn(2, 4) for _ in range(2)]
"""


@pytest.mark.parametrize(
    "flags",
    [
        ("qlint_src_model:build", "--input-shape", "2,4", "-o", "qlint_src_model.py"),
        ("pkg.data:build", "--input-shape", "2,4", "--emit-plan", "pkg/data.py"),
        ("qlint_src_model:build", "--input-shape", "2,4", "--calibration", "pkg/data.py:batches", "-o", "pkg/data.py"),
        ("qlint_src_model:build", "--input-shape", "2,4", "--emit-plan", "out.txt", "--emit-qconfig", "out.txt"),
    ],
)
def test_outputs_never_overwrite_the_code_they_run_nor_each_other(run_main, tmp_path, flags):
    """The source of a module:function model or file.py:function data is an input too, and two
    outputs naming one file would leave only the last; nothing is written in either case."""
    (tmp_path / "qlint_src_model.py").write_text(_SOURCE)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "data.py").write_text(_SOURCE)
    line = _one_line(run_main(*flags, "-q", "--no-trial"))
    assert ("input" in line and "overwrite" in line) or "both write" in line, line
    assert (tmp_path / "qlint_src_model.py").read_text() == _SOURCE
    assert (tmp_path / "pkg" / "data.py").read_text() == _SOURCE
    assert not (tmp_path / "out.txt").exists()


# ------------------------------------------------------------------ stdout that cannot be written
@pytest.mark.parametrize(
    "redirect, needles", [(">&-", ("stdout is closed",)), ("> /dev/full", ("cannot write", "stdout"))]
)
def test_unwritable_stdout_is_one_line(tmp_path, redirect, needles):
    if redirect.endswith("/dev/full") and not __import__("os").path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    command = f"{sys.executable} -m qlint rules --format json {redirect}"
    result = subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    line = _one_line(result)
    assert _mentions(line, *needles), line


# ------------------------------------------------------------------ random calibration is lazy
def test_random_batches_are_made_when_used():
    from qlint.core.load import random_calibration

    example = (torch.zeros(2, 3, 16, 16),)
    batches = random_calibration(example, 4)
    assert not isinstance(batches, list) and len(batches) == 4  # nothing is stored up front
    first, again = batches[3], batches[3]
    assert first is not again and torch.equal(first[0], again[0])  # made on access, reproducibly
    assert not torch.equal(batches[0][0], batches[1][0])
    assert [list(b[0].shape) for b in batches] == [[2, 3, 16, 16]] * 4


def test_random_batches_are_bounded_from_python_too():
    from qlint.core.load import MAX_RANDOM_BATCHES, random_calibration
    from qlint.errors import QlintError

    example = (torch.zeros(1, 4),)
    assert len(random_calibration(example, MAX_RANDOM_BATCHES)) == MAX_RANDOM_BATCHES == 10_000
    with pytest.raises(QlintError, match="at most 10,000"):
        random_calibration(example, MAX_RANDOM_BATCHES + 1)


def test_an_output_into_a_missing_folder_is_refused_before_any_work(run_main, tmp_path):
    """verify ran every trial before finding it could not write -o; lint linted first. The folder
    must exist (--html and --badcases-path create theirs)."""
    (tmp_path / "m.py").write_text("import torch.nn as nn\n\ndef build():\n    return nn.Linear(4, 2)\n")
    line = _one_line(run_main("m:build", "--input-shape", "1,4", "-o", "missing/report.txt"))
    assert _mentions(line, "--output", "missing", "does not exist"), line
    started = run_main(
        "verify", "m:build", "--calibration", "nope.pt", "--eval-data", "nope.pt",
        "-o", "missing/report.txt",
    )  # fmt: skip
    assert _mentions(_one_line(started), "missing", "does not exist")  # before it looks for the data
