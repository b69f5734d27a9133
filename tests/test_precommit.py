"""The pre-commit hooks, run by the real pre-commit in a temporary git repository.

The test installs this checkout's ``qlint-system`` hook definition as a ``repo: local``
hook: that works on a clean CI clone whatever HEAD holds, and ``language: system`` uses
the current environment's torch instead of installing GBs into an isolated one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


class WithFindings(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.conv(x)
        return self.relu(self.bn(y)) + y  # fan-out keeps conv-bn-relu unfused (QL101)


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


ROOT = Path(__file__).resolve().parent.parent


def _hooks(repo_root: Path = ROOT) -> dict[str, dict]:
    return {hook["id"]: hook for hook in yaml.safe_load((repo_root / ".pre-commit-hooks.yaml").read_text())}


def test_hooks_file_declares_both_hooks(repo_root):
    hooks = _hooks(repo_root)
    assert set(hooks) == {"qlint", "qlint-system"}
    assert hooks["qlint"]["language"] == "python" and hooks["qlint-system"]["language"] == "system"
    for hook in hooks.values():
        assert hook["require_serial"] is True
        assert hook["files"] == r"\.(pt2|pt|pth)$"
        assert hook["minimum_pre_commit_version"] == "3.2.0"
        assert "qlint" in hook["entry"]
    assert hooks["qlint"]["entry"] == hooks["qlint-system"]["entry"]


@pytest.fixture(scope="module")
def model_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("precommit-repo")
    (repo / "models").mkdir()
    torch.export.save(
        torch.export.export(WithFindings().eval(), (torch.randn(1, 3, 8, 8),)), repo / "models" / "bad.pt2"
    )
    torch.export.save(torch.export.export(Clean().eval(), (torch.randn(2, 8),)), repo / "models" / "clean.pt2")
    hook = dict(_hooks()["qlint-system"])
    config = {"repos": [{"repo": "local", "hooks": [hook]}]}
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (repo / "README.md").write_text("not a model\n")
    env = _env(tmp_path_factory.mktemp("pre-commit-home"))
    for args in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=repo, check=True, env=env)
    return repo, env


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PRE_COMMIT_HOME"] = str(home)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)  # the hook must work from the installed qlint alone
    env["NO_COLOR"] = "1"
    return env


def _run(repo: Path, env, pyproject: str, *args: str) -> subprocess.CompletedProcess:
    (repo / "pyproject.toml").write_text(pyproject)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


BASE = '[tool.qlint]\nfail-on = "warning"\n'


def test_fails_on_model_with_findings_passes_on_clean(model_repo):
    repo, env = model_repo
    bad = _run(repo, env, BASE, "qlint-system", "--files", "models/bad.pt2")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "QL101" in bad.stdout and "Failed" in bad.stdout
    assert "models/bad.pt2: warning QL101 unfused-pattern" in bad.stdout and "┃" not in bad.stdout  # --quiet
    clean = _run(repo, env, BASE, "qlint-system", "--files", "models/clean.pt2")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "Passed" in clean.stdout


def test_all_files_lints_every_model_in_one_call(model_repo):
    repo, env = model_repo
    result = _run(repo, env, BASE, "--all-files")
    assert result.returncode == 1, result.stdout + result.stderr
    # both models were linted: the findings of one and the clean summary of the other
    assert "bad.pt2" in result.stdout and "clean.pt2" in result.stdout
    assert "QL101" in result.stdout
    # the clean model's trial (pt2e) reports its output SQNR as info: no warning, no error
    assert re.search(r"clean\.pt2: Found \d+ findings?: 0 errors, 0 warnings", result.stdout), result.stdout
    assert "README" not in result.stdout  # files: only model files reach the hook


def test_hook_reads_tool_qlint_and_per_file_settings(model_repo):
    repo, env = model_repo
    ignored = _run(repo, env, BASE + 'ignore = ["QL101"]\n', "--all-files")
    assert ignored.returncode == 0, ignored.stdout + ignored.stderr
    per_file = BASE + '\n[[tool.qlint.files]]\npath = "models/clean.pt2"\nbackend = "no-such-backend"\n'
    result = _run(repo, env, per_file, "qlint-system", "--files", "models/clean.pt2")
    assert result.returncode == 1, result.stdout + result.stderr  # exit 2 from qlint fails the hook
    assert "no-such-backend" in result.stdout


def test_hook_finds_the_config_of_a_nested_project(model_repo):
    """pre-commit runs in the repository root; proj/pyproject.toml still governs proj/models/."""
    repo, env = model_repo
    nested = repo / "proj"
    (nested / "models").mkdir(parents=True, exist_ok=True)
    (nested / "models" / "bad.pt2").write_bytes((repo / "models" / "bad.pt2").read_bytes())
    (nested / "pyproject.toml").write_text(BASE + 'ignore = ["QL101"]\n')
    try:
        # BASE at the root does not ignore QL101 (test_fails_on_model_with_findings...): proj's does.
        nested_run = _run(repo, env, BASE, "qlint-system", "--files", "proj/models/bad.pt2")
        assert nested_run.returncode == 0, nested_run.stdout + nested_run.stderr
    finally:
        shutil.rmtree(nested)


def test_hook_refuses_repository_code_unless_args_trust_it(model_repo):
    repo, env = model_repo
    (repo / "repo_mapping.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('PWNED').write_text('ran')\n"
        "from torch.ao.quantization import get_default_qconfig_mapping\n"
        "def mapping():\n    return get_default_qconfig_mapping('x86')\n"
    )
    marker = repo / "PWNED"
    hostile = BASE + 'qconfig-mapping = "repo_mapping:mapping"\n'
    config = repo / ".pre-commit-config.yaml"
    original = config.read_text()
    try:
        refused = _run(repo, env, hostile, "qlint-system", "--files", "models/clean.pt2")
        assert refused.returncode == 1, refused.stdout + refused.stderr  # qlint exited 2
        assert "--trust-config" in refused.stdout and not marker.exists()
        trusting = yaml.safe_load(original)
        trusting["repos"][0]["hooks"][0]["args"] = ["--trust-config"]
        config.write_text(yaml.safe_dump(trusting, sort_keys=False))
        allowed = _run(repo, env, hostile, "qlint-system", "--files", "models/clean.pt2")
        assert marker.exists(), allowed.stdout + allowed.stderr
        assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    finally:
        config.write_text(original)
        for path in (repo / "repo_mapping.py", marker):
            path.unlink(missing_ok=True)
