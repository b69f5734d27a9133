"""Bad input: exit code 2 and one line that names the problem, never a traceback."""

import pytest
import torch
import torch.nn as nn


def _check_one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle.lower() in lines[0].lower(), lines[0]


def test_missing_path(run_cli, tmp_path):
    _check_one_line_error(run_cli(tmp_path / "nope.pt"), "not found", "nope.pt")


def test_directory(run_cli, tmp_path):
    (tmp_path / "adir").mkdir()
    _check_one_line_error(run_cli(tmp_path / "adir"), "directory")


def test_empty_file(run_cli, tmp_path):
    path = tmp_path / "empty.pt"
    path.write_bytes(b"")
    _check_one_line_error(run_cli(path), "empty")


def test_truncated_file(run_cli, tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"w": torch.randn(64, 64)}, good)
    data = good.read_bytes()
    bad = tmp_path / "truncated.pt"
    bad.write_bytes(data[: len(data) // 2])
    _check_one_line_error(run_cli(bad), "truncated.pt", "corrupt")


def test_truncated_pt2(run_cli, tmp_path):
    program = torch.export.export(nn.Linear(4, 2), (torch.randn(1, 4),))
    good = tmp_path / "m.pt2"
    torch.export.save(program, str(good))
    bad = tmp_path / "cut.pt2"
    bad.write_bytes(good.read_bytes()[:300])
    _check_one_line_error(run_cli(bad), "cut.pt2", ".pt2")


def test_state_dict_without_factory(run_cli, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(nn.Linear(4, 2).state_dict(), path)
    _check_one_line_error(run_cli(path), "state_dict", "module:factory", "--weights")


def test_factory_that_raises(run_cli, tmp_path):
    (tmp_path / "broken_factory.py").write_text("def build():\n    raise ValueError('no GPU here')\n")
    _check_one_line_error(run_cli("broken_factory:build", cwd=tmp_path), "broken_factory:build", "no GPU here")


def test_factory_module_missing(run_cli, tmp_path):
    _check_one_line_error(run_cli("no_such_module_xyz:build"), "no_such_module_xyz")


def test_bad_flag_is_one_line(run_cli, tmp_path):
    _check_one_line_error(run_cli("examples.badnet:build", "--backend", "tpu"), "backend")


def test_bad_input_shape(run_cli, repo_root):
    _check_one_line_error(run_cli("examples.badnet:build", "--input-shape", "1,x,3", cwd=repo_root), "input-shape")


def test_debug_shows_traceback(run_cli, tmp_path):
    result = run_cli(tmp_path / "nope.pt", "--debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr


def test_weights_that_do_not_fit(run_cli, tmp_path, repo_root):
    path = tmp_path / "other.pt"
    torch.save(nn.Linear(4, 2).state_dict(), path)
    _check_one_line_error(
        run_cli("examples.badnet:build", "--weights", path, "--input-shape", "1,3,32,32", "--no-trial", cwd=repo_root),
        "does not fit",
    )


def test_bad_pyproject_option(run_cli, tmp_path, repo_root):
    (tmp_path / "pyproject.toml").write_text("[tool.qlint]\nbackend = 'x86'\nnot_an_option = 1\n")
    result = run_cli(f"{repo_root}/examples/badnet.py:build", "--input-shape", "1,3,32,32", "--no-trial", cwd=tmp_path)
    _check_one_line_error(result, "not_an_option")


def test_unknown_rule_option(run_cli, tmp_path, repo_root):
    (tmp_path / "pyproject.toml").write_text("[tool.qlint.rules.QL101]\nno_such = true\n")
    result = run_cli(f"{repo_root}/examples/badnet.py:build", "--input-shape", "1,3,32,32", "--no-trial", cwd=tmp_path)
    _check_one_line_error(result, "QL101", "no_such")


def test_a_file_torch_save_did_not_write_is_named_as_such_wherever_it_is_given(run_main, tmp_path):
    """A text file (a .py, a log) given as the model, weights, example inputs or calibration data
    is 'not a file torch.save wrote', not an internal KeyError, nor 'pickled objects: trust it'."""
    (tmp_path / "notes.pt").write_text("hello, not a tensor\n")
    (tmp_path / "model.py").write_text("import torch.nn as nn\n\ndef build():\n    return nn.Linear(4, 2)\n")
    cases = [
        (["notes.pt", "--input-shape", "1,4"], "model file"),
        (["model.py"], "model.py:function"),
        (["model.py:build", "--weights", "notes.pt", "--input-shape", "1,4"], "weights file"),
        (["model.py:build", "--example-inputs", "notes.pt"], "example inputs file"),
        (["model.py:build", "--input-shape", "1,4", "--calibration", "notes.pt"], "calibration file"),
    ]
    for args, needle in cases:
        result = run_main(*args, "--no-trial", cwd=tmp_path)
        _check_one_line_error(result, "not a file torch.save wrote", needle)
        assert "internal error" not in result.stderr and "--trust-pickle" not in result.stderr


def test_a_data_function_whose_generator_raises_is_one_line(run_main, tmp_path):
    """A generator (or DataLoader) that fails on its second batch: the user's error in one line
    naming the data, from lint and from verify, never an internal error."""
    (tmp_path / "flaky_data.py").write_text(
        "import torch, torch.nn as nn\n\n"
        "def build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()\n\n"
        "def batches():\n    yield torch.randn(2, 4)\n    raise ValueError('disk went away')\n"
    )
    lint = run_main("flaky_data:build", "--input-shape", "2,4", "--calibration", "flaky_data:batches", cwd=tmp_path)
    _check_one_line_error(lint, "calibration data", "ValueError", "disk went away")
    torch.save([torch.randn(2, 4) for _ in range(2)], tmp_path / "calib.pt")
    verify = run_main(
        "verify",
        "flaky_data:build",
        "--calibration",
        "calib.pt",
        "--eval-data",
        "flaky_data:batches",
        cwd=tmp_path,
    )
    _check_one_line_error(verify, "eval data", "disk went away")
    assert "internal error" not in lint.stderr + verify.stderr


def test_flags_before_a_command_go_to_the_command(run_main, tmp_path):
    """`qlint --debug plan check P` checks the plan (it linted 'plan' as a model file before), a
    binary file as a plan is one line saying so, and `--debug` shows plan's traceback."""
    from qlint.advice.plan import default_plan

    (tmp_path / "plan.json").write_text(default_plan("x86").model_dump_json())
    (tmp_path / "binary.json").write_bytes(b"PK\x03\x04\x8b\xff\x00garbage")
    checked = run_main("--debug", "plan", "check", "plan.json", cwd=tmp_path)
    assert checked.returncode == 0 and "valid qlint plan" in checked.stdout, checked.stderr
    _check_one_line_error(run_main("plan", "check", "binary.json", cwd=tmp_path), "binary.json", "not a qlint plan")
    verify = run_main("--trust-pickle", "verify", cwd=tmp_path)
    _check_one_line_error(verify, "qlint verify")
    assert "model file not found" not in verify.stderr


def test_numbers_that_cannot_mean_anything_are_refused_by_the_flag(run_main, tmp_path):
    """nan, inf and out-of-range values are refused by argparse in one line naming the flag,
    not accepted ('target nan dB: NOT met') nor passed to pydantic's wording."""
    cases = [
        (["examples.badnet:build", "--min-impact", "nan"], "--min-impact", "finite"),
        (
            ["verify", "m:build", "--calibration", "c", "--eval-data", "e", "--target-sqnr", "inf"],
            "--target-sqnr",
            "finite",
        ),
        (
            ["verify", "m:build", "--calibration", "c", "--eval-data", "e", "--max-float-fraction", "-0.5"],
            "fraction",
            "-0.5",
        ),
        (["compare", "a:f", "b:q", "--calibration", "c", "--sqnr-threshold", "nan"], "--sqnr-threshold", "finite"),
        (["compare", "a:f", "b:q", "--calibration", "c", "--badcases", "-3"], "--badcases", "0 or more"),
        (["compare", "a:f", "b:q", "--calibration", "c", "--backend", "foo"], "--backend", "foo"),
    ]
    for args, *needles in cases:
        _check_one_line_error(run_main(*args, cwd=tmp_path), *needles)


def test_a_data_function_returning_none_and_two_calibration_sources_are_usage_errors(run_main, tmp_path):
    """A forgotten `return` in a data function was read as 'no calibration data' (exit 0 with the
    data rules skipped); two sources of calibration data were resolved silently."""
    (tmp_path / "forgot.py").write_text(
        "import torch, torch.nn as nn\n\n"
        "def build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()\n\n"
        "def batches():\n    [torch.randn(2, 4) for _ in range(2)]\n"
    )
    torch.save([torch.randn(2, 4)], tmp_path / "calib.pt")
    base = ("forgot:build", "--input-shape", "2,4", "--no-trial")
    _check_one_line_error(run_main(*base, "--calibration", "forgot:batches", cwd=tmp_path), "returned None")
    both = run_main(*base, "--calibration", "calib.pt", "--random-calibration", "2", cwd=tmp_path)
    _check_one_line_error(both, "--random-calibration", "--calibration", "pass one")


def test_verify_shows_no_counts_for_a_plan_that_failed(run_main, tmp_path):
    """A plan that failed built no model: its column says '-', not '0/0 (0%)' and '0.0 KiB'. Here
    the default fails (convert_fx makes the conv's output channels-last and `view` raises)."""
    (tmp_path / "view_model.py").write_text(
        "import torch.nn as nn\n\n"
        "class ViewAfterConv(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv, self.relu, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Linear(8 * 6 * 6, 5)\n\n"
        "    def forward(self, x):\n"
        "        y = self.relu(self.conv(x))\n"
        "        return self.fc(y.view(y.size(0), -1))\n\n"
        "def build():\n    return ViewAfterConv().eval()\n"
    )
    torch.save(
        [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)], tmp_path / "d.pt"
    )
    result = run_main(
        "verify", "view_model:build", "--calibration", "d.pt", "--eval-data", "d.pt", "--max-trials", "2", cwd=tmp_path
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    row = next(line for line in result.stdout.splitlines() if "int8 conv/linear/recurrent/attention ops" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[1] == "-" and cells[2] != "-" and "0/0" not in row, row
    # each quantization is logged with the budget spent so far, not as a numbered trial that
    # repeats ('trial 0/2: default mapping', 'trial 0/2: plan as given')
    logged = [line for line in result.stderr.splitlines() if line.startswith("qlint verify: ")]
    assert logged[:2] == [
        "qlint verify: default mapping (0 of 2 trials used)",
        "qlint verify: plan as given (0 of 2 trials used)",
    ], result.stderr


def test_verify_refuses_a_plan_for_another_model_before_any_trial(run_main, tmp_path):
    """A plan naming modules the model lacks ran every trial (minutes on a transformer) and only
    then said so, with a count that depended on how far pruning got."""
    from qlint.advice.plan import ModuleDecision, Provenance, default_plan

    (tmp_path / "tiny_model.py").write_text(
        "import torch.nn as nn\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()\n"
    )
    torch.save([torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)], tmp_path / "d.pt")
    elsewhere = [
        ModuleDecision(fqn=fqn, mode="dynamic", provenance=[Provenance(source="user")])
        for fqn in ("no.such.layer", "0", "lstm")
    ]
    (tmp_path / "plan.json").write_text(default_plan("x86").model_copy(update={"modules": elsewhere}).model_dump_json())
    for trials in ("1", "10"):
        result = run_main(
            "verify", "tiny_model:build", "--calibration", "d.pt", "--eval-data", "d.pt",
            "--plan", "plan.json", "--max-trials", trials, cwd=tmp_path,
        )  # fmt: skip
        _check_one_line_error(result, "the plan names 2 module(s) this model does not have: no.such.layer, lstm")
        assert "trial" not in result.stderr


def test_more_example_inputs_than_the_model_takes_is_a_usage_error(run_main, tmp_path):
    """Two --input-shape for a one-input model: exit 2 naming the inputs, not a QL105 'error'
    finding (exit 1) about the float model failing."""
    (tmp_path / "one_input.py").write_text(
        "import torch.nn as nn\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()\n"
    )
    result = run_main("one_input:build", "--input-shape", "2,4", "--input-shape", "2,4", cwd=tmp_path)
    _check_one_line_error(result, "do not fit the model", "takes 1 input(s)", "got 2")


def test_fewer_example_inputs_than_the_model_needs_names_them(run_main, tmp_path):
    """silero_vad takes (x, state): one --input-shape said 'do not fit the model: StopIteration'."""
    (tmp_path / "two_inputs.py").write_text(
        "import torch, torch.nn as nn\n\n"
        "class Two(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(4, 4)\n\n"
        "    def forward(self, x, state, scale=None):\n        return self.fc(x) + state\n\n"
        "def build():\n    return Two().eval()\n"
    )
    result = run_main("two_inputs:build", "--input-shape", "2,4", "--no-trial", cwd=tmp_path)
    _check_one_line_error(result, "takes 2 input(s) and 1 optional one(s) (x, state, scale), got 1")
    assert "StopIteration" not in result.stderr
    both = run_main("two_inputs:build", "--input-shape", "2,4", "--input-shape", "2,4", "--no-trial", cwd=tmp_path)
    assert both.returncode in (0, 1), both.stderr  # the optional input may be left out


def test_selecting_a_compare_diagnostic_in_lint_says_where_it_lives(run_main, tmp_path):
    """`qlint rule QL301` documents QL301; `--select QL301` said 'unknown rule selector'."""
    (tmp_path / "m.py").write_text("import torch.nn as nn\n\ndef build():\n    return nn.Linear(4, 2)\n")
    result = run_main("m:build", "--input-shape", "1,4", "--select", "QL301", cwd=tmp_path)
    _check_one_line_error(result, "QL301", "qlint compare", "not a lint rule")


def test_badcases_go_into_a_folder_that_compare_creates(run_main, repo_root, tmp_path):
    """As for --html, the folder of --badcases-path is created (it was an internal error)."""
    target = tmp_path / "new" / "folder" / "bc.pt"
    result = run_main(
        "compare", "examples.compare_demo:float_model", "examples.compare_demo:quantized_model",
        "--calibration", "examples.compare_demo:batches", "--badcases", "1", "--badcases-path", target,
        cwd=repo_root,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    assert target.is_file() and target.with_suffix(".report.json").is_file()


def test_a_torchscript_file_is_named_as_such_not_called_corrupt(run_main, tmp_path):
    """`qlint quantize` writes TorchScript; given back to lint (even with --trust-pickle) or as
    weights, it was 'not a readable PyTorch file (truncated or corrupt?)' with torch's riddle cut
    mid-word."""
    torch.jit.script(torch.nn.Linear(4, 2)).save(str(tmp_path / "scripted.pt"))
    (tmp_path / "m.py").write_text("import torch.nn as nn\n\ndef build():\n    return nn.Linear(4, 2)\n")
    for args in (
        ("scripted.pt", "--input-shape", "1,4"),
        ("scripted.pt", "--trust-pickle", "--input-shape", "1,4"),
        ("m:build", "--weights", "scripted.pt", "--input-shape", "1,4"),
    ):
        result = run_main(*args, cwd=tmp_path)
        _check_one_line_error(result, "scripted.pt is a TorchScript archive (torch.jit.save)", "package.module:factory")
        assert "corrupt" not in result.stderr


def test_a_long_quoted_error_is_cut_at_a_word_and_says_so():
    from qlint.errors import first_line

    error = RuntimeError("word " * 100 + "\nsecond line")
    quoted = first_line(error, limit=60)
    assert len(quoted) <= 60 and quoted.endswith("word…") and quoted.startswith("RuntimeError: word")
    assert first_line(RuntimeError("short\nmore")) == "RuntimeError: short"
    assert first_line(KeyError()) == "KeyError"


def test_example_inputs_that_do_not_fit_a_pt2_are_a_usage_error(run_main, tmp_path):
    """A .pt2 given another model's --example-inputs was accepted: exit 0 with --no-trial, and a
    QL105 'float run fails' error finding (exit 1) with the trial."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    program = torch.export.export(model, (torch.randn(3, 4),))
    torch.export.save(program, str(tmp_path / "m.pt2"))
    torch.save((torch.randn(3, 4), torch.randn(3, 4)), tmp_path / "two.pt")
    torch.save(torch.randn(3, 7), tmp_path / "wide.pt")
    for inputs, needle in (("two.pt", "takes 1 input(s) (input), got 2"), ("wide.pt", "do not fit the model")):
        for trial in ((), ("--no-trial",)):
            result = run_main("m.pt2", "--example-inputs", inputs, *trial, cwd=tmp_path)
            _check_one_line_error(result, "the example inputs do not fit the model", needle)
    fits = run_main("m.pt2", "--no-trial", cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr


_COMPARE_MODELS = """
import copy
import torch
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_fx

def float_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()

def quantized_model():
    prepared = prepare_fx(copy.deepcopy(float_model()), get_default_qconfig_mapping("x86"), (torch.randn(2, 8),))
    prepared(torch.randn(2, 8))
    return prepared
"""


@pytest.mark.parametrize(
    "data, needles",
    [
        ("[]", ("no batches", "nothing to compare")),
        ("[torch.full((2, 8), float('nan'))]", ("batch 0", "NaN or Inf")),
        ("[torch.randn(2, 8), torch.full((2, 8), float('inf'))]", ("batch 1", "NaN or Inf")),
    ],
    ids=["empty", "nan", "inf-in-second-batch"],
)
def test_compare_data_with_nothing_to_measure_is_one_error_not_a_clean_report(
    run_main, tmp_path, request, data, needles
):
    """Empty data printed a table of n/a and exited 0 (a CI job with an empty loader passed as
    clean); an all-NaN batch exited 1 with QL301 findings measured against NaN outputs."""
    module = f"pair_{request.node.callspec.id.replace('-', '_')}"  # one per case: imports are cached
    (tmp_path / f"{module}.py").write_text(_COMPARE_MODELS + f"\n\ndef batches():\n    return {data}\n")
    result = run_main(
        "compare", f"{module}:float_model", f"{module}:quantized_model", "--calibration", f"{module}:batches"
    )
    _check_one_line_error(result, *needles)


@pytest.mark.parametrize(
    "content, needle",
    [('{"backend": "x86",\n', "not valid JSON"), ('{"type": "qlint.QuantPlan", "backend": "tpu"}', "bad plan at")],
    ids=["broken-json", "bad-field"],
)
def test_a_plan_file_that_does_not_read_is_named(run_main, tmp_path, content, needle):
    """`qlint plan check broken.json` said "plan is not valid JSON: ..." naming no file (a missing
    file was named); with several plans in a script the user could not tell which."""
    (tmp_path / "broken.json").write_text(content)
    _check_one_line_error(run_main("plan", "check", "broken.json", cwd=tmp_path), "broken.json", needle)
