"""docs/rules/ is generated from the live registry; Options docs match Options models."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qlint.linter.registry import Registry, builtin_rule_classes

OPTION_LINE = re.compile(r"^\s*[-*]\s+`([A-Za-z_][A-Za-z0-9_]*)`\s*:")


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_rule_docs", ROOT / "scripts" / "gen_rule_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_builtin_rule_has_a_doc(gen):
    files = gen.expected_files()
    assert {f"{cls.code}.md" for cls in builtin_rule_classes()} | {"README.md"} == set(files)
    for cls in builtin_rule_classes():
        assert f"[{cls.code}]({cls.code}.md)" in files["README.md"]


def test_docs_are_not_stale(gen, repo_root):
    stale = gen.stale_files(repo_root / "docs" / "rules")
    assert not stale, f"run python scripts/gen_rule_docs.py; stale: {stale}"


def test_check_detects_stale_and_orphan_files(gen, tmp_path):
    assert gen.main(["--docs-dir", str(tmp_path)]) == 0
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    first = sorted(tmp_path.glob("QL*.md"))[0]
    first.write_text(first.read_text() + "\nhand edit\n")
    (tmp_path / "QL999.md").write_text("# removed rule\n")
    assert set(gen.stale_files(tmp_path)) == {first.name, "QL999.md"}
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    gen.main(["--docs-dir", str(tmp_path)])
    assert gen.stale_files(tmp_path) == [] and not (tmp_path / "QL999.md").exists()


def _documented_options(cls) -> list[str]:
    body = cls.doc_sections().get("Options", "")
    return [m.group(1) for line in body.splitlines() if (m := OPTION_LINE.match(line))]


@pytest.mark.parametrize("cls", Registry.default().all(), ids=lambda c: c.code)
def test_options_section_matches_options_model(cls):
    documented = _documented_options(cls)
    fields = set(cls.Options.model_fields)
    assert len(documented) == len(set(documented)), f"{cls.code}: an option is listed twice"
    assert set(documented) - fields == set(), f"{cls.code}: documented but not an Options field"
    assert fields - set(documented) == set(), f"{cls.code}: Options field not documented in '## Options'"


def test_option_parser_reads_bullets():
    class Fake:
        @staticmethod
        def doc_sections():
            return {"Options": "- `ratio_threshold`: how much\n- not an option\n* `per_channel`: flag"}

    assert _documented_options(Fake) == ["ratio_threshold", "per_channel"]


def test_rules_json_lists_every_rule(repo_root):
    result = subprocess.run(
        [sys.executable, "-m", "qlint", "rules", "--format", "json"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    registered = Registry.default().all()
    assert [r["code"] for r in listed] == [c.code for c in registered]
    for entry, cls in zip(listed, registered):
        assert entry["name"] == cls.name and entry["summary"] == cls.summary
        assert set(entry["options"]) == set(cls.Options.model_fields)


def test_every_rule_code_in_the_readme_has_documentation(repo_root, run_main):
    """The README's rule table lists QL301/QL302 (compare diagnostics): `qlint rule CODE` documents each."""
    import re

    codes = sorted(set(re.findall(r"^\| (QL\d{3}) \|", (repo_root / "README.md").read_text(), re.M)))
    assert {"QL101", "QL301", "QL302"} <= set(codes)
    for code in codes:
        result = run_main("rule", code)
        assert result.returncode == 0, (code, result.stderr)
        assert result.stdout.startswith(f"# {code} "), code
