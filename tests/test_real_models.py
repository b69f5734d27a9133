"""On the real pretrained models of the shared kit (``../shared/real_models``, or the directory
in ``QLINT_REAL_MODELS``): every qconfig fix qlint suggests changes the qconfig prepare_fx
assigns to some node, as on the rules' INVALID examples (test_fixes_change_something.py).

CI never has the kit: these tests are skipped there (``bench/findings.py`` runs the full lint
on the same models). Lint runs without its trial here: the rules' own fixes are what is
checked, and a trial would cost minutes.
"""

import copy
import importlib.util
import os
import types
from pathlib import Path

import pytest
from torch.ao.quantization import get_default_qconfig_mapping

import qlint
from qlint.core.trace import symbolic_graph
from qlint.linter.impact import fix_mapping
from tests.test_fixes_change_something import _assignment

REAL_MODELS = ("efficientnet_lite0", "minilm_l6", "silero_vad", "digit_cnn")


def _kit() -> types.ModuleType:
    """The kit's ``models`` module, loaded from its file (sys.path is left alone)."""
    found = os.environ.get("QLINT_REAL_MODELS")
    directory = Path(found) if found else Path(__file__).resolve().parents[2] / "shared" / "real_models"
    source = directory / "models.py"
    if not source.is_file():
        pytest.skip(f"no real-model kit at {directory} (set QLINT_REAL_MODELS)")
    spec = importlib.util.spec_from_file_location("qlint_real_models_kit", source)
    if spec is None or spec.loader is None:
        pytest.skip(f"cannot load {source}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as error:  # the kit's packages are not installed (its install.sh)
        pytest.skip(f"the real-model kit is not installed: {error}")
    return module


@pytest.mark.parametrize("name", REAL_MODELS)
def test_every_qconfig_fix_on_a_real_model_changes_the_assignment(name):
    model, example, calibration = _kit().load(name)
    model.eval()
    inputs = tuple(example)
    mapping = get_default_qconfig_mapping("x86")
    report = qlint.lint(
        model, inputs, calibration=[tuple(batch) for batch in calibration], trial_options={"enabled": False}
    )
    fixes = [(f, fix_mapping(mapping, [f], "x86")) for f in report.findings]
    fixes = [(f, fixed) for f, fixed in fixes if fixed is not None]
    assert fixes, f"{name}: no finding with a qconfig fix"  # each of these models has some
    traced = symbolic_graph(copy.deepcopy(model))
    before = _assignment(traced, mapping, inputs, "x86")
    for finding, fixed in fixes:
        after = _assignment(traced, fixed, inputs, "x86")
        changed = [node for node in before if before[node] != after.get(node)]
        assert changed, f"{name}: {finding.rule} on {finding.target}: the fix {finding.suggestion} changes nothing"
