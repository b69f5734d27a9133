"""--baseline / --write-baseline: record findings, then report only new ones."""

from __future__ import annotations

import json

import pytest

from qlint.errors import ConfigError
from qlint.linter.baseline import filter_new, read_baseline, write_baseline
from qlint.linter.findings import Finding, Report, Severity

BADNET = ("examples.badnet:build", "--input-shape", "1,3,32,32", "--no-trial")
MAPPING = ("--qconfig-mapping", "examples.badnet:qconfig_mapping")


def _finding(target: str, kind: str = "k", message: str = "m") -> Finding:
    return Finding(
        rule="QL101",
        name="unfused-pattern",
        severity=Severity.WARNING,
        target=target,
        message=message,
        data={"kind": kind},
    )


def _report(*findings: Finding) -> Report:
    return Report(
        qlint_version="0.1.0", torch_version="2.x", model="m.pt2", backend="x86", frontend="fx", findings=list(findings)
    )


def test_write_then_filter_in_process(tmp_path):
    path = tmp_path / "sub" / "baseline.json"
    write_baseline(_report(_finding("a"), _finding("b")), path)
    data = json.loads(path.read_text())
    assert data["version"] == 2
    assert {e["target"] for e in data["models"]["m.pt2"]["fingerprints"].values()} == {"a", "b"}
    later = _report(_finding("a", message="reworded"), _finding("b", kind="other"), _finding("c"))
    filtered = filter_new(later, path)
    assert [(f.target, f.data["kind"]) for f in filtered.findings] == [("b", "other"), ("c", "k")]
    assert "1 known finding suppressed" in filtered.notices[-1].message
    assert "1 baseline entry no longer found" in filtered.notices[-1].message


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"version": 99, "fingerprints": {}}',
        '{"version": 1}',
        '{"version": 1, "fingerprints": [1]}',
        '{"version": 2}',
        '{"version": 2, "models": {"m.pt2": {}}}',
        '{"version": 2, "models": {"m.pt2": {"fingerprints": [""]}}}',
    ],
)
def test_corrupt_baseline_is_config_error(tmp_path, content):
    path = tmp_path / "b.json"
    path.write_text(content)
    with pytest.raises(ConfigError):
        read_baseline(path, "m.pt2")


def _model_report(model: str, *findings: Finding) -> Report:
    return _report(*findings).model_copy(update={"model": model})


def test_each_model_has_its_own_entry_and_recording_one_keeps_the_others(tmp_path):
    """A pre-commit hook lints several models into one baseline: each model overwrote the whole
    file (only the last model's findings stayed), and fingerprints had no model, so an entry
    for conv1 of one model hid the same finding in every other model (QA)."""
    path = tmp_path / "baseline.json"
    write_baseline(_model_report("a.pt2", _finding("conv1"), _finding("fc")), path)
    write_baseline(_model_report("b.pt2", _finding("head")), path)
    data = json.loads(path.read_text())
    assert sorted(data["models"]) == ["a.pt2", "b.pt2"]
    assert read_baseline(path, "a.pt2") == {_finding("conv1").fingerprint(), _finding("fc").fingerprint()}
    # the same problem at conv1 of model b is new there
    later = filter_new(_model_report("b.pt2", _finding("head"), _finding("conv1")), path)
    assert [f.target for f in later.findings] == ["conv1"]
    # a model the file does not know: every finding is new, and a warning (shown under -q) says why
    unknown = filter_new(_model_report("c.pt2", _finding("conv1")), path)
    assert [f.target for f in unknown.findings] == ["conv1"] and "no entry for c.pt2" in unknown.notices[-1].message
    assert unknown.notices[-1].level is Severity.WARNING
    # re-recording a replaces its own entry only
    write_baseline(_model_report("a.pt2", _finding("fc")), path)
    assert read_baseline(path, "a.pt2") == {_finding("fc").fingerprint()}
    assert read_baseline(path, "b.pt2") == {_finding("head").fingerprint()}


def test_a_version_1_file_applies_to_every_model_without_its_own_entry(tmp_path):
    """As it did before entries were keyed by model: a hook that passed keeps passing."""
    path = tmp_path / "old.json"
    fingerprint = _finding("conv1").fingerprint()
    path.write_text(json.dumps({"version": 1, "model": "a.pt2", "fingerprints": {fingerprint: {}}}))
    assert read_baseline(path, "a.pt2") == read_baseline(path, "b.pt2") == {fingerprint}
    write_baseline(_model_report("b.pt2", _finding("head")), path)  # upgraded; b now has its own entry
    assert json.loads(path.read_text())["version"] == 2
    assert read_baseline(path, "b.pt2") == {_finding("head").fingerprint()}
    assert read_baseline(path, "a.pt2") == {fingerprint}


def test_a_model_file_is_one_entry_however_the_command_line_spells_its_path(tmp_path, monkeypatch):
    """Keyed as typed, 'models/m.pt2' recorded in the project folder did not match
    './models/m.pt2', nor 'proj/models/m.pt2' from the repository root, as pre-commit runs."""
    project = tmp_path / "proj"
    (project / "models").mkdir(parents=True)
    (project / "models" / "m.pt2").write_bytes(b"")
    baseline = project / "qlint-baseline.json"
    monkeypatch.chdir(project)
    write_baseline(_model_report("models/m.pt2", _finding("conv1")), "qlint-baseline.json")
    assert list(json.loads(baseline.read_text())["models"]) == ["models/m.pt2"]
    for spelling, where in (("./models/m.pt2", project), ("proj/models/m.pt2", tmp_path)):
        monkeypatch.chdir(where)
        assert read_baseline(baseline.relative_to(where), spelling) == {_finding("conv1").fingerprint()}
        assert not filter_new(_model_report(spelling, _finding("conv1")), baseline.relative_to(where)).findings
    # a module:factory model is its spec
    write_baseline(_model_report("nets:conv", _finding("fc")), baseline)
    assert "nets:conv" in json.loads(baseline.read_text())["models"]


def _fingerprints(result) -> set[str]:
    return {Finding.model_validate(f).fingerprint() for f in json.loads(result.stdout)["findings"]}


def test_cli_round_trip(run_cli, repo_root, tmp_path):
    baseline = tmp_path / "qlint-baseline.json"
    # Baseline the model with the default mapping.
    before = run_cli(*BADNET, "--format", "json", cwd=repo_root)
    assert before.returncode == 1, before.stderr
    written = run_cli(*BADNET, "--baseline", baseline, "--write-baseline", "--format", "json", cwd=repo_root)
    assert written.returncode == 0, written.stderr  # writing the baseline accepts today's findings
    assert baseline.is_file() and "recorded" in written.stderr
    recorded = json.loads(baseline.read_text())["models"]
    assert list(recorded) == [BADNET[0]] and set(recorded[BADNET[0]]["fingerprints"]) == _fingerprints(before)

    again = run_cli(*BADNET, "--baseline", baseline, cwd=repo_root)
    assert again.returncode == 0, again.stdout + again.stderr

    # The hand-written mapping brings new findings (QL103 on sigmoid at least).
    changed = run_cli(*BADNET, *MAPPING, "--format", "json", cwd=repo_root)
    new = _fingerprints(changed) - _fingerprints(before)
    assert new, "the changed mapping should add a finding"
    filtered = run_cli(*BADNET, *MAPPING, "--baseline", baseline, "--format", "json", cwd=repo_root)
    assert filtered.returncode == 1, filtered.stderr
    assert _fingerprints(filtered) == new
    suppressed = len(json.loads(changed.stdout)["findings"]) - len(json.loads(filtered.stdout)["findings"])
    notices = [n["message"] for n in json.loads(filtered.stdout)["notices"]]
    assert any(f"{suppressed} known finding" in n for n in notices), notices


def test_cli_corrupt_baseline_exits_2(run_cli, repo_root, tmp_path):
    baseline = tmp_path / "broken.json"
    baseline.write_text('{"version": 1, "fingerprints": ')
    result = run_cli(*BADNET, "--baseline", baseline, cwd=repo_root)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qlint: error: baseline") and "not valid JSON" in lines[0]
