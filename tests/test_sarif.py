"""--format sarif: valid SARIF 2.1.0 (official schema), with rules, locations and notifications."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from qlint.linter.docs import rule_info, rule_markdown
from qlint.linter.findings import Finding, Notice, Report, RuleInfo, Severity, SkippedRule
from qlint.linter.registry import Registry
from qlint.render.extra import EXTRA_FORMATS
from qlint.render.sarif import render_sarif, repository_url

SCHEMA_PATH = Path(__file__).with_name("sarif-schema-2.1.0.json")
BADNET = (
    "examples.badnet:build",
    "--input-shape",
    "1,3,32,32",
    "--no-trial",
    "--qconfig-mapping",
    "examples.badnet:qconfig_mapping",
)


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA_PATH.read_text())
    assert schema["$schema"].startswith("http://json-schema.org/draft-04/")
    return jsonschema.Draft4Validator(schema)


def _report(model: str = "models/net.pt2") -> Report:
    return Report(
        qlint_version="0.1.0",
        torch_version="2.x",
        model=model,
        backend="x86",
        frontend="torch.export (.pt2)",
        findings=[
            Finding(
                rule="QL101",
                name="unfused-pattern",
                severity=Severity.ERROR,
                target="features.0",
                message="conv → bn stays unfused",
                data={"kind": "conv2d-batch_norm", "node": "features_0"},
            ),
            Finding(
                rule="QL103",
                name="qconfig",
                severity=Severity.WARNING,
                target="sigmoid",
                message="sigmoid observed",
                data={"kind": "fixed-qparams-observer", "node": "sigmoid"},
            ),
            Finding(
                rule="QL102",
                name="shared-module",
                severity=Severity.INFO,
                target="act",
                message="called twice",
                data={"kind": "multiple-calls", "node": "act"},
            ),
        ],
        skipped=[SkippedRule(rule="QL102", name="shared-module", reason="no example inputs")],
        notices=[Notice(level=Severity.WARNING, message="calibrating on RANDOM batches")],
        rules=[rule_info(cls) for cls in Registry.default().all()],
    )


def test_sarif_is_valid_against_official_schema(validator):
    document = json.loads(render_sarif(_report()))
    errors = sorted(validator.iter_errors(document), key=lambda e: e.path)
    assert not errors, [e.message for e in errors[:5]]
    assert document["version"] == "2.1.0"


def test_schema_validation_can_fail(validator):
    document = json.loads(render_sarif(_report()))
    document["runs"][0]["results"][0]["level"] = "fatal"  # not a SARIF level
    assert not validator.is_valid(document)


def test_driver_lists_the_rules_of_the_run_with_their_documentation():
    driver = json.loads(render_sarif(_report()))["runs"][0]["tool"]["driver"]
    registered = Registry.default().all()
    assert [r["id"] for r in driver["rules"]] == [c.code for c in registered]
    for entry, cls in zip(driver["rules"], registered):
        assert entry["help"]["markdown"] == rule_markdown(cls)
        assert "## Why is this bad?" in entry["help"]["markdown"]
        # no invented URL: a link only when the installed package declares its repository
        assert ("helpUri" in entry) == (repository_url() is not None)
        assert entry["fullDescription"]["text"] == cls.summary
        assert entry["name"] == cls.name


def test_rule_documentation_comes_from_the_report_not_the_registry(validator):
    # A report read back from JSON describes its rules itself, registered here or not.
    unregistered = RuleInfo(
        code="XQ901",
        name="elsewhere",
        summary="A rule this process never loaded.",
        severity=Severity.WARNING,
        requires=["graph"],
        documentation="# XQ901 elsewhere\n\n## Why is this bad?\n\nIt is.\n",
    )
    report = _report().model_copy(update={"rules": [unregistered]})
    document = json.loads(render_sarif(Report.model_validate_json(report.model_dump_json())))
    validator.validate(document)
    rules = document["runs"][0]["tool"]["driver"]["rules"]
    assert rules[0]["id"] == "XQ901" and rules[0]["help"]["markdown"] == unregistered.documentation
    assert rules[0]["defaultConfiguration"]["level"] == "warning"
    # the findings' rules that the report does not describe are still listed, without help
    assert [r["id"] for r in rules[1:]] == ["QL101", "QL103", "QL102"]
    assert all("help" not in r for r in rules[1:])


def test_results_levels_locations_and_fingerprints():
    report = _report()
    run = json.loads(render_sarif(report))["runs"][0]
    results = run["results"]
    assert [r["ruleId"] for r in results] == ["QL101", "QL103", "QL102"]
    assert [r["level"] for r in results] == ["error", "warning", "note"]
    for result, finding in zip(results, report.findings):
        assert result["message"]["text"] == finding.message
        assert result["partialFingerprints"]["qlintFingerprint/v1"] == finding.fingerprint()
        location = result["locations"][0]
        assert location["logicalLocations"][0]["fullyQualifiedName"] == finding.target
        assert location["physicalLocation"]["artifactLocation"]["uri"] == "models/net.pt2"
        assert run["tool"]["driver"]["rules"][result["ruleIndex"]]["id"] == finding.rule
    kinds = [r["locations"][0]["logicalLocations"][0]["kind"] for r in results]
    assert kinds == ["module", "function", "module"]


def test_skipped_rules_and_notices_become_notifications():
    notes = json.loads(render_sarif(_report()))["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    skipped = [n for n in notes if n["descriptor"]["id"] == "qlint/skipped-rule"]
    assert len(skipped) == 1 and skipped[0]["associatedRule"]["id"] == "QL102"
    assert "no example inputs" in skipped[0]["message"]["text"]
    notices = [n for n in notes if n["descriptor"]["id"] == "qlint/notice"]
    assert notices[0]["level"] == "warning" and "RANDOM" in notices[0]["message"]["text"]


def test_factory_model_has_no_physical_location(validator):
    document = json.loads(render_sarif(_report(model="examples.badnet:build")))
    validator.validate(document)
    for result in document["runs"][0]["results"]:
        assert "physicalLocation" not in result["locations"][0]
    assert "artifacts" not in document["runs"][0]


def test_extra_formats_registry():
    assert set(EXTRA_FORMATS) == {"sarif", "github"}
    assert EXTRA_FORMATS["sarif"] is render_sarif


def test_cli_sarif_on_badnet(run_cli, repo_root, validator):
    result = run_cli(*BADNET, "--format", "sarif", cwd=repo_root)
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    validator.validate(document)
    ids = {r["ruleId"] for r in document["runs"][0]["results"]}
    assert {"QL101", "QL102"} <= ids
    described = {r["id"]: r for r in document["runs"][0]["tool"]["driver"]["rules"]}
    assert set(described) == {cls.code for cls in Registry.default().all()}  # every rule of the run
    assert all("## Why is this bad?" in r["help"]["markdown"] for r in described.values())
