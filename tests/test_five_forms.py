"""The same network written five ways gets the same findings."""

import collections

import pytest
import torch

import qlint
from qlint.cli.main import main
from tests import models

RULES = ["QL101", "QL103", "QL104"]


def _signature(report):
    """What must agree across forms: rule, finding kind and reasons, independent of naming."""
    return collections.Counter(
        (f.rule, str(f.data.get("kind")), tuple(f.data.get("reasons", ()))) for f in report.findings
    )


def _lint(model, x):
    # The five forms must give the same rule verdicts; the trial's measured impacts depend on
    # each form's example data, so it is off here (tests/test_impact.py covers it).
    return qlint.lint(
        model, (x,), qconfig_mapping=models.per_tensor_mapping(), select=RULES, trial_options={"enabled": False}
    )


@pytest.fixture(scope="module")
def image():
    return torch.randn(2, 3, 16, 16)


@pytest.fixture(scope="module")
def reference(image):
    return _lint(models.gated_nested_train(), image)


def test_reference_has_findings_of_each_rule(reference):
    assert {f.rule for f in reference.findings} == set(RULES)
    # conv-bn-relu twice, with BN in training mode
    assert sum(1 for f in reference.findings if f.rule == "QL101") == 2


def test_sequential_form(reference, image):
    model = models._init(models.GatedSequential()).train()
    assert _signature(_lint(model, image)) == _signature(reference)


def test_functional_form(reference, image):
    model = models._init(models.GatedFunctional()).train()
    assert _signature(_lint(model, image)) == _signature(reference)


def test_exported_pt2_form(reference, image, tmp_path, capsys):
    program = torch.export.export(models.gated_nested_train(), (image,), strict=False)
    path = tmp_path / "gated.pt2"
    torch.export.save(program, str(path))
    code = main(
        [
            str(path),
            "--no-trial",
            "--format",
            "json",
            "--select",
            ",".join(RULES),
            "--qconfig-mapping",
            "tests.models:per_tensor_mapping",
        ]
    )
    report = qlint.Report.model_validate_json(capsys.readouterr().out)
    assert code == 1
    assert report.frontend.startswith("torch.export")
    assert _signature(report) == _signature(reference)
    assert sorted(f.target for f in report.findings) == sorted(f.target for f in reference.findings)


def test_factory_form(reference, capsys, monkeypatch, repo_root):
    monkeypatch.chdir(repo_root)
    code = main(
        [
            "tests.models:gated_nested_train",
            "--no-trial",
            "--input-shape",
            "2,3,16,16",
            "--format",
            "json",
            "--select",
            ",".join(RULES),
            "--qconfig-mapping",
            "tests.models:per_tensor_mapping",
        ]
    )
    report = qlint.Report.model_validate_json(capsys.readouterr().out)
    assert code == 1
    assert _signature(report) == _signature(reference)
    assert sorted(f.target for f in report.findings) == sorted(f.target for f in reference.findings)
