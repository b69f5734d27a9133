"""A setting in [tool.qlint] that cannot mean anything: one line that names the pyproject.toml
and the key, exit 2 (a bad input-shape said 'bad --input-shape', as if it were a flag)."""

import pytest
import torch

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


WRONG_TYPES = [
    ('trial = "yes"', "[tool.qlint] trial:", "valid boolean"),
    ("trial = 1", "[tool.qlint] trial:", "valid boolean"),
    ('num-batches = "8"', "[tool.qlint] num-batches:", "valid integer"),
    ("max-fix-trials = true", "[tool.qlint] max-fix-trials:", "valid integer"),
    ("min-impact-db = inf", "[tool.qlint] min-impact-db:", "finite"),
    ("select = []", "[tool.qlint] select: selects no rule", "leave select out"),
    # as --no-trial with --fix-trials is
    ("trial = false\nmax-fix-trials = 3", "[tool.qlint]: max-fix-trials tunes the trial", "trial = false skips"),
    # an unknown key in pydantic's words was "Extra inputs are not permitted"
    ("bogus = 1", "[tool.qlint] bogus:", "unknown option"),
    (
        '[[tool.qlint.files]]\npath = "m.py"\ninput-shape = ["1,4"]\nexample-inputs = "e.pt"',
        "[[tool.qlint.files]] path = 'm.py': input-shape and example-inputs both give the example inputs",
        "keep one",
    ),
]


@pytest.mark.parametrize("setting, where, problem", WRONG_TYPES)
def test_a_setting_of_the_wrong_type_or_meaning_is_refused_not_coerced(run_main, project, setting, where, problem):
    """trial = "yes" read as True (and "no" too: pydantic's lax mode coerces strings and 0/1)."""
    pyproject = project / "pyproject.toml"
    pyproject.write_text(f"[tool.qlint]\n{setting}\n")
    line = _one_line_error(run_main("m:build", "--input-shape", "1,4", "--no-trial", cwd=project))
    assert f"{pyproject} {where}" in line and problem in line, line


@pytest.mark.parametrize(
    "table",
    [
        "[tool.qlint]\n",
        "[tool.qlint]\ntrial = false\nselect = ['QL1']\n",
        "[tool.qlint]\nmin-impact-db = 1\n[tool.qlint.rules.QL104]\nmin_channel_spread = 2\n",
    ],
)
def test_an_empty_table_and_well_typed_settings_are_accepted(run_main, project, table):
    (project / "pyproject.toml").write_text(table)
    result = run_main("m:build", "--input-shape", "1,4", "-q", cwd=project)
    assert result.returncode == 0, result.stderr


def test_flags_that_contradict_each_other_or_mean_nothing_are_usage_errors(run_main, project):
    """--input-shape with --example-inputs used the file, --num-batches without data did
    nothing, --select '' ran every rule: each was accepted in silence."""
    import torch

    torch.save(torch.randn(1, 4), project / "e.pt")
    torch.save([torch.randn(2, 4) for _ in range(2)], project / "c.pt")
    shape = ("--input-shape", "1,4")
    cases = [
        ((*shape, "--example-inputs", "e.pt"), "--input-shape and --example-inputs both give the example inputs"),
        ((*shape, "--num-batches", "3"), "--num-batches 3 applies to calibration data, and this run has none"),
        ((*shape, "--percentile-every", "2"), "--percentile-every 2 applies to calibration data"),
        ((*shape, "--select", ""), "--select names no rule"),
        ((*shape, "--select", " , "), "--select names no rule"),
        ((*shape, "--no-trial", "--min-impact", "1"), "--min-impact tunes the trial, which --no-trial skips"),
        ((*shape, "--no-trial", "--fix-trials", "2"), "--fix-trials tunes the trial, which --no-trial skips"),
        (
            ("fix", "m:build", *shape, "--example-inputs", "e.pt", "-o", "fixed.pt2"),
            "--input-shape and --example-inputs both give the example inputs",
        ),
    ]
    for args, message in cases:
        command = args if args[0] == "fix" else ("m:build", *args)
        line = _one_line_error(run_main(*command, cwd=project))
        assert message in line, (args, line)
    # with calibration data, from the flag, --random-calibration or [tool.qlint], --num-batches means something
    for data in (("--calibration", "c.pt"), ("--random-calibration", "2")):
        result = run_main("m:build", *shape, "--num-batches", "1", *data, "--no-trial", "-q", cwd=project)
        assert result.returncode in (0, 1), result.stderr
    (project / "pyproject.toml").write_text('[tool.qlint]\ncalibration = "c.pt"\n')
    result = run_main("m:build", *shape, "--num-batches", "1", "--no-trial", "-q", cwd=project)
    assert result.returncode in (0, 1), result.stderr


@pytest.mark.parametrize("command", ["verify", "quantize"])
@pytest.mark.parametrize("flag", [("--input-shape", "1,4"), ("--example-inputs", "e.pt")])
def test_verify_and_quantize_refuse_example_inputs_they_would_not_use(run_main, project, command, flag):
    """They run the model on the calibration batches; the flags were accepted and ignored."""
    torch.save([torch.randn(2, 4) for _ in range(2)], project / "c.pt")
    torch.save(torch.randn(1, 4), project / "e.pt")
    output = ("-o", "int8.pt") if command == "quantize" else ()
    result = run_main(command, "m:build", *flag, "--calibration", "c.pt", "--eval-data", "c.pt", *output, cwd=project)
    line = _one_line_error(result)
    assert f"unrecognized arguments: {flag[0]}" in line and f"qlint {command} --help" in line, line
    assert not (project / "int8.pt").exists()


@pytest.mark.parametrize(
    "option, problem",
    [
        ('report_constant_channels = "off"', "report_constant_channels: Input should be a valid boolean"),
        ('ratio_threshold = "3.5"', "ratio_threshold: Input should be a valid number"),
        ("ratio_threshold = true", "ratio_threshold: Input should be a valid number"),
    ],
)
def test_rule_options_are_strict_as_every_setting_and_name_the_pyproject(run_main, project, option, problem):
    """ "off" read as False and "3.5" as 3.5 in [tool.qlint.rules.X], and true as 1 (then refused as
    "greater than 1", naming no file)."""
    pyproject = project / "pyproject.toml"
    pyproject.write_text(f"[tool.qlint.rules.QL203]\n{option}\n")
    line = _one_line_error(run_main("m:build", "--input-shape", "1,4", "--no-trial", cwd=project))
    assert f"{pyproject}: [tool.qlint.rules.QL203]: {problem}" in line, line
