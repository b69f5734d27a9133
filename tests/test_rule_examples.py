"""Every rule's VALID examples lint clean and its INVALID examples are flagged (Fixit style)."""

import pytest

import qlint
from qlint.linter.registry import Registry

RULES = Registry.default(include_plugins=False).all()
CASES = []
for rule in RULES:
    valid, invalid = rule.examples()
    CASES += [pytest.param(rule, ex, True, id=f"{rule.code}-valid-{i}") for i, ex in enumerate(valid)]
    CASES += [pytest.param(rule, ex, False, id=f"{rule.code}-invalid-{i}") for i, ex in enumerate(invalid)]


def _lint(rule, example):
    mapping = example.qconfig_mapping() if example.qconfig_mapping else None
    calibration = example.calibration() if example.calibration else None
    return qlint.lint(
        example.build(),
        example.inputs(),
        calibration=calibration,
        backend=example.backend,
        qconfig_mapping=mapping,
        select=[rule.code],
        options={rule.code: dict(example.options)} if example.options else None,
    )


@pytest.mark.parametrize("rule", RULES, ids=[r.code for r in RULES])
def test_every_rule_has_enough_examples(rule):
    valid, invalid = rule.examples()
    assert len(valid) >= 2, f"{rule.code} needs at least 2 VALID examples"
    assert len(invalid) >= 2, f"{rule.code} needs at least 2 INVALID examples"


@pytest.mark.parametrize("rule,example,is_valid", CASES)
def test_rule_example(rule, example, is_valid):
    report = _lint(rule, example)
    assert not [s for s in report.skipped if s.rule == rule.code], report.skipped
    findings = [f for f in report.findings if f.rule == rule.code]
    if is_valid:
        assert findings == [], f"{example.description}: unexpected {[f.message for f in findings]}"
    else:
        assert findings, f"{example.description}: expected a {rule.code} finding"
        # a finding about several layers lists them in data["layers"] (QL104)
        targets = {f.target for f in findings} | {
            layer["target"] for f in findings for layer in f.data.get("layers", [])
        }
        for expected in example.flagged:
            assert expected in targets, f"{example.description}: {expected} not in {targets}"
        for finding in findings:
            assert finding.name == rule.name
            assert finding.message and finding.target
