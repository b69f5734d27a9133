"""The user's own code is imported from the working directory, behind installed packages, and only
while it is resolved (issues 13.2 and 17.3); files that are not regular files are refused (13.6).

These run the CLI the way its console script does: a launcher outside the project, so Python
itself puts no working directory on sys.path (``python -m`` would, before qlint runs at all).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qlint.core.load import build_from_factory, load_batches, load_model, resolve_object
from qlint.errors import LoadError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOSTILE = textwrap.dedent("""
    import os
    open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "SHADOWED-" + __name__), "w").close()
    raise ImportError("a project file shadowed an installed package")
""")


def _qlint(project, *args, timeout=300):
    launcher = project.parent / "bin" / "qlint_launcher.py"
    launcher.parent.mkdir(exist_ok=True)
    launcher.write_text("import sys\nfrom qlint.cli.main import main\nsys.exit(main())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, str(launcher), *map(str, args)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def project(tmp_path):
    """A project folder with the user's model code and look-alikes of installed packages."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "mymodels.py").write_text(
        textwrap.dedent("""
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return self.fc(x).relu()

        def build():
            return Net()
    """)
    )
    for name in ("rich", "torch", "networkx", "pydantic"):
        (folder / f"{name}.py").write_text(HOSTILE)
    return folder


def test_factory_spec_does_not_let_project_files_shadow_packages(project):
    result = _qlint(
        project, "mymodels:build", "--input-shape", "1,4", "--format", "text", "--show-qconfig", "--select", "QL101"
    )
    assert result.returncode in (0, 1), result.stderr
    assert not list(project.glob("SHADOWED-*")), "a project file was imported instead of an installed package"
    assert "fc" in result.stdout and "┏" in result.stdout  # rendered by the real rich


def test_trusted_pickle_resolves_classes_from_the_working_directory(project):
    save = (
        f"import sys, torch; sys.path.append({str(project)!r}); import mymodels; "
        f"torch.save(mymodels.Net(), {str(project / 'whole.pt')!r})"
    )
    subprocess.run([sys.executable, "-c", save], cwd=project.parent, check=True)
    with pytest.raises(LoadError, match="--trust-pickle"):
        load_model(str(project / "whole.pt"))
    trusted = _qlint(
        project, "whole.pt", "--trust-pickle", "--input-shape", "1,4", "--format", "json", "--select", "QL101"
    )
    assert trusted.returncode in (0, 1), trusted.stderr
    assert '"model": "whole.pt"' in trusted.stdout
    assert not list(project.glob("SHADOWED-*"))


def test_sys_path_is_left_as_it_was(project, monkeypatch):
    (project / "probe.py").write_text(
        textwrap.dedent("""
        import os, sys
        import torch.nn as nn
        SEEN = {}

        def build():
            SEEN["position"], SEEN["length"] = sys.path.index(os.getcwd()), len(sys.path)
            return nn.Linear(2, 2)
    """)
    )
    monkeypatch.chdir(project)
    for name in ("probe", "mymodels"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    before = list(sys.path)
    assert isinstance(build_from_factory("probe:build"), torch.nn.Linear)
    seen = sys.modules["probe"].SEEN
    assert seen["position"] == seen["length"] - 1, "the working directory must come after installed packages"
    assert resolve_object("mymodels:Net").__name__ == "Net"
    assert sys.path == before


def test_fifo_is_refused_not_waited_on(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = tmp_path / "batches.pt"
    os.mkfifo(fifo)
    for load in (lambda: load_model(str(fifo)), lambda: load_batches(str(fifo))):
        with pytest.raises(LoadError, match="not a regular file"):
            load()


def test_fifo_calibration_through_the_cli(tmp_path, repo_root):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    fifo = tmp_path / "batches.pt"
    os.mkfifo(fifo)
    project = tmp_path / "project"
    project.mkdir()
    result = _qlint(
        project, "tests.models:gated_nested_train", "--input-shape", "2,3,16,16", "--calibration", fifo, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "not a regular file" in result.stderr and str(fifo) in result.stderr
