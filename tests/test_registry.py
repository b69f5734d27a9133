"""Built-in and third-party rules load through one registry (entry-point group qlint.rules)."""

import subprocess
import sys
import textwrap

import pydantic
import pytest

from qlint.errors import ConfigError
from qlint.linter.registry import Registry
from qlint.linter.rule import validate_rule_class
from tests.conftest import ROOT


def test_builtin_rules_are_valid_and_unique():
    rules = Registry.default(include_plugins=False).all()
    codes = [r.code for r in rules]
    assert codes == sorted(set(codes))
    for rule in rules:
        assert validate_rule_class(rule) == [], rule.code
        assert rule.__module__.startswith("qlint.rules.")


def test_fixed_codes_and_names():
    registry = Registry.default(include_plugins=False)
    expected = {"QL101": "unfused-pattern", "QL102": "shared-module"}
    for code, name in expected.items():
        assert registry.get(code).name == name
        assert registry.get(name).code == code


def test_select_and_ignore_by_prefix_and_name():
    registry = Registry.default(include_plugins=False)
    chosen = [r.code for r in registry.select(["QL1"], ["shared-module"])]
    assert "QL101" in chosen and "QL102" not in chosen
    with pytest.raises(ConfigError):
        registry.select(["QL999"])


def test_options_are_frozen_and_forbid_unknown_keys():
    rule = Registry.default(include_plugins=False).get("QL101")
    options = rule.Options()
    with pytest.raises(pydantic.ValidationError):
        rule.Options(no_such_option=True)
    with pytest.raises(pydantic.ValidationError):
        options.include_add_relu = False


def _make_plugin(tmp_path, name, body):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    dist = tmp_path / f"{name}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[qlint.rules]\n{name} = {name}\n")


PLUGIN = '''
import torch
from qlint.linter.rule import Rule, Need, RuleOptions
from qlint.linter.findings import Severity

class TooManyLinears(Rule):
    """Flags models with more than a few linear layers.

    ## What it does
    Counts linear layers.
    ## Why is this bad?
    A demo.
    ## Example
    Many linears.
    ## Use instead
    Fewer.
    ## Options
    - `limit`: the most linear layers allowed.
    ## References
    - none
    """
    code = "XQ001"
    name = "too-many-linears"
    summary = "Too many linear layers."
    severity = Severity.INFO

    class Options(RuleOptions):
        limit: int = 0

    def check(self, ctx):
        layers = ctx.graph.by_kind("linear")
        if len(layers) > self.options.limit:
            yield self.finding(layers[0].display, f"{len(layers)} linear layers", data={"kind": "count"})
'''


def _run(tmp_path, code):
    """Python in ``tmp_path`` with ``tmp_path/site`` on PYTHONPATH, where the test plugins are installed."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )


def _site(tmp_path):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    return site


def test_third_party_rule_loads_and_runs(tmp_path):
    _make_plugin(_site(tmp_path), "qlint_demo_plugin", PLUGIN)
    result = _run(
        tmp_path,
        "import torch, qlint\n"
        "r = qlint.lint(torch.nn.Sequential(torch.nn.Linear(2, 2)), (torch.randn(1, 2),), select=['XQ001'])\n"
        "print([f.rule for f in r.findings])",
    )
    assert result.returncode == 0, result.stderr
    assert "['XQ001']" in result.stdout


def test_broken_plugin_names_its_package(tmp_path):
    _make_plugin(_site(tmp_path), "qlint_broken_plugin", "raise ImportError('missing dependency foo')\n")
    result = _run(
        tmp_path,
        "from qlint.linter.registry import Registry\n"
        "from qlint.errors import RuleLoadError\n"
        "try:\n    Registry.default()\nexcept RuleLoadError as e:\n    print('ERR', e)\n",
    )
    assert result.returncode == 0, result.stderr
    assert "ERR" in result.stdout and "qlint_broken_plugin" in result.stdout
    assert "missing dependency foo" in result.stdout


def test_plugin_declared_in_the_working_directory_is_not_loaded(tmp_path, run_cli):
    """A cloned repository ships a fake evil-0.1.dist-info: `python -m qlint` puts the working
    directory on sys.path, so importlib.metadata sees it; qlint must not import its plugin."""
    marker = tmp_path / "PWNED"
    _make_plugin(tmp_path, "qlint_evil_plugin", f"open({str(marker)!r}, 'w').write('ran')\n")
    rules = run_cli("rules", "--format", "json", cwd=tmp_path)
    assert rules.returncode == 0, rules.stderr
    assert not marker.exists()
    lint = run_cli(
        "examples.badnet:build",
        "--input-shape",
        "1,3,32,32",
        "--no-trial",
        "--select",
        "QL102",
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert lint.returncode in (0, 1), lint.stderr
    assert not marker.exists()
    # The same plugin installed where the user points PYTHONPATH is loaded (the test can fail).
    _make_plugin(_site(tmp_path), "qlint_site_plugin", f"open({str(marker)!r}, 'w').write('ran')\n")
    run_cli("rules", cwd=tmp_path, env={"PYTHONPATH": f"{ROOT}:{tmp_path / 'site'}"})
    assert marker.exists()


def test_the_api_refuses_what_it_cannot_mean_in_one_readable_line():
    """QA in a notebook: options for a rule that does not exist were ignored (the CLI refuses
    them), select="QL101" was read one character at a time ("unknown rule selector 'L'"),
    num_batches=0 blamed the data for being empty, and option errors quoted pydantic's tags."""
    import torch

    import qlint

    model = torch.nn.Sequential(torch.nn.Linear(4, 2)).eval()
    example = (torch.randn(2, 4),)
    assert {c.code for c in Registry.default().select("QL101")} == {"QL101"}
    assert {c.code for c in Registry.default().select("QL101, QL203")} == {"QL101", "QL203"}
    report = qlint.lint(model, example, select="QL101", trial_options={"enabled": False})
    assert {rule.code for rule in report.rules} <= {"QL101"}
    with pytest.raises(ConfigError, match="unknown rule 'QL999'"):
        qlint.lint(model, example, options={"QL999": {"a": 1}})
    with pytest.raises(ConfigError, match="num_batches must be at least 1"):
        qlint.lint(model, example, calibration=[torch.randn(2, 4)], calibration_options={"num_batches": 0})
    for call, expected in (
        (dict(trial_options={"bogus": 1}), "bad trial options: bogus: unknown option"),
        (
            dict(options={"QL203": {"ratio_treshold": 1}}),
            "bad options for QL203 (activation-outlier): ratio_treshold: unknown option",
        ),
        # any spelling that names the rule reaches it (it was accepted, then ignored)
        (
            dict(options={"ql203": {"ratio_treshold": 1}}),
            "bad options for QL203 (activation-outlier): ratio_treshold: unknown option",
        ),
        (
            dict(options={"QL203": {}, "activation-outlier": {}}),
            "options for QL203 are given twice (as 'activation-outlier' and another name)",
        ),
    ):
        with pytest.raises(ConfigError) as raised:
            qlint.lint(model, example, **call)
        assert str(raised.value) == expected and "type=" not in str(raised.value)
