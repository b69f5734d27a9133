import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples/ and tests/models are importable

warnings.filterwarnings("ignore", category=UserWarning)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n auto` runs one worker per core: each gets one intra-op thread, and so do the CLI
    # processes it starts. Two threads per worker on shared cores made the suite 1.5x slower.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _natural_table_width(monkeypatch):
    """Tables keep their natural width unless a test sets COLUMNS: a terminal's COLUMNS (or
    pytest-xdist's workers, which set it to 80) would otherwise wrap the headers tests read."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def run_cli(tmp_path):
    """Run the real console script in a subprocess, from ``cwd`` (default: a temp dir)."""
    import subprocess

    def run(*args, cwd=None, env=None):
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-m", "qlint", *map(str, args)],
            cwd=cwd or tmp_path,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    return run


@pytest.fixture
def run_main(capsys, monkeypatch, tmp_path):
    """The CLI's ``main()`` in this process, from ``cwd`` (default: a temp dir); returns a
    CompletedProcess like run_cli. Saves the interpreter start-up (torch import) of a
    subprocess; use run_cli where the process itself matters (stdout closed, plugins)."""
    import subprocess

    from qlint.cli.main import main

    def run(*args, cwd=None, env=None):
        monkeypatch.chdir(cwd or tmp_path)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        status = main([str(a) for a in args])
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), status, captured.out, captured.err)

    return run


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Small tensors on shared cores: one intra-op thread avoids oversubscription stalls (10x here)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
