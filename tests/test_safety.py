"""Unpickling never runs a file's code unless the user passes --trust-pickle."""

import torch
import torch.nn as nn


class _CreatesFile:
    """Unpickling this calls open(path, 'w'): the file appears if the pickle is executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _write_malicious(path, marker):
    torch.save({"model": nn.Linear(2, 2), "payload": _CreatesFile(str(marker))}, path)


def test_refused_without_trust_flag(run_cli, tmp_path):
    model_path = tmp_path / "evil.pt"
    marker = tmp_path / "pwned.txt"
    _write_malicious(model_path, marker)
    assert not marker.exists()
    result = run_cli(model_path)
    assert result.returncode == 2
    assert "--trust-pickle" in result.stderr
    assert "Traceback" not in result.stderr
    assert not marker.exists(), "unpickling ran code from the file"


def test_python_api_refuses_too(tmp_path):
    from qlint.core.load import load_model
    from qlint.errors import LoadError

    model_path = tmp_path / "evil.pt"
    marker = tmp_path / "pwned.txt"
    _write_malicious(model_path, marker)
    try:
        load_model(str(model_path))
    except LoadError as error:
        assert "trust" in str(error)
    else:
        raise AssertionError("a pickled payload was loaded without trust")
    assert not marker.exists()


def test_full_module_loads_with_trust_flag(run_cli, tmp_path, repo_root):
    # A whole pickled module (not malicious) is linted only when trusted.
    import sys

    sys.path.insert(0, str(repo_root))
    from examples.badnet import build

    path = tmp_path / "full.pt"
    torch.save(build(), path)
    refused = run_cli(path, "--input-shape", "1,3,32,32", "--no-trial", cwd=repo_root)
    assert refused.returncode == 2 and "--trust-pickle" in refused.stderr
    accepted = run_cli(
        path, "--trust-pickle", "--input-shape", "1,3,32,32", "--no-trial", "--format", "json", cwd=repo_root
    )
    assert accepted.returncode == 1, accepted.stderr
    assert '"QL102"' in accepted.stdout
