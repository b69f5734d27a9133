"""What `qlint fix` writes is usable as written. `--emit-qconfig` is a prepare_fx mapping, and
prepare_fx quantizes nothing in an exported (aten) graph: fix paired with a .pt2 output (or run on
a .pt2) wrote a mapping that left the model float (silero_vad: 127.9 dB output SQNR, i.e. float,
against 18.18 dB on the .pt), so fix refuses that pair. Without example inputs fix takes the first
calibration batch, as lint, verify and quantize do (a two-input model has no --input-shape form)."""

import copy
import runpy

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MODEL_SOURCE = """
import torch
import torch.nn as nn


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)
        self.proj = nn.Linear(6, 4)

    def forward(self, x, y):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3))) + self.proj(y)


def build():
    torch.manual_seed(0)
    return TwoInputs().eval()
"""


@pytest.fixture
def two_input_files(tmp_path):
    """netmod.py:build (a two-input model) and cal.pt, a list of (x, y) batches; returns (folder, spec)."""
    (tmp_path / "netmod.py").write_text(MODEL_SOURCE)
    generator = torch.Generator().manual_seed(1)
    calibration = [
        (torch.randn(2, 3, 8, 8, generator=generator), torch.randn(2, 6, generator=generator)) for _ in range(3)
    ]
    torch.save(calibration, tmp_path / "cal.pt")
    return tmp_path, f"{tmp_path}/netmod.py:build"


def _quantized_ops(model: nn.Module, mapping, calibration) -> int:
    """How many quantize_per_tensor calls prepare_fx/convert_fx of ``model`` with ``mapping`` put in."""
    prepared = prepare_fx(copy.deepcopy(model), mapping, calibration[0])
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    converted = convert_fx(prepared)
    return sum("quantize_per_tensor" in str(node.target) for node in converted.graph.nodes)


def test_fix_refuses_a_prepare_fx_mapping_beside_a_pt2_output(run_main, two_input_files):
    folder, spec = two_input_files
    calibration = torch.load(folder / "cal.pt")
    model = runpy.run_path(str(folder / "netmod.py"))["build"]()
    mapping = torch.ao.quantization.get_default_qconfig_mapping("x86")
    # why the pair is refused: the mapping quantizes the module, and nothing in its exported graph
    exported = torch.export.export(model, calibration[0]).module()
    assert _quantized_ops(model, mapping, calibration) > 0 and _quantized_ops(exported, mapping, calibration) == 0

    args = ["fix", spec, "--calibration", "cal.pt", "--emit-qconfig", "q.py"]
    refused = run_main(*args, "-o", "fixed.pt2", cwd=folder)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "--output FIXED.pt" in refused.stderr and "qlint quantize" in refused.stderr
    assert not (folder / "fixed.pt2").exists() and not (folder / "q.py").exists()

    kept = run_main(*args, "-o", "fixed.pt", cwd=folder)  # the pair that works
    assert kept.returncode == 0, kept.stderr
    fixed = torch.load(folder / "fixed.pt", weights_only=False)
    emitted = runpy.run_path(str(folder / "q.py"))["build_qconfig_mapping"]()
    assert _quantized_ops(fixed, emitted, calibration) > 0


def test_fix_refuses_a_prepare_fx_mapping_for_an_exported_model(run_main, two_input_files):
    folder, _ = two_input_files
    calibration = torch.load(folder / "cal.pt")
    model = runpy.run_path(str(folder / "netmod.py"))["build"]()
    torch.export.save(torch.export.export(model, calibration[0]), str(folder / "net.pt2"))
    refused = run_main("fix", "net.pt2", "--emit-qconfig", "q.py", "-o", "fixed.pt", cwd=folder)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "pt2e" in refused.stderr
    assert not (folder / "fixed.pt").exists() and not (folder / "q.py").exists()


def test_fix_takes_the_first_calibration_batch_as_its_example(run_main, two_input_files):
    folder, spec = two_input_files
    calibration = torch.load(folder / "cal.pt")
    result = run_main("fix", spec, "--calibration", "cal.pt", "-o", "fixed.pt2", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "example inputs: the first calibration batch" in result.stderr
    program = torch.export.load(str(folder / "fixed.pt2"))
    args, _ = program.example_inputs
    assert [tuple(a.shape) for a in args] == [tuple(t.shape) for t in calibration[0]]
    model = runpy.run_path(str(folder / "netmod.py"))["build"]()
    with torch.no_grad():
        assert torch.allclose(program.module()(*calibration[1]), model(*calibration[1]), atol=1e-5)
    # keyword batches cannot trace a model positionally: one line, exit 2
    torch.save([{"x": x, "y": y} for x, y in calibration], folder / "kw.pt")
    keywords = run_main("fix", spec, "--calibration", "kw.pt", "-o", "kw.pt2", cwd=folder)
    assert keywords.returncode == 2 and "--example-inputs" in keywords.stderr, keywords.stderr
    assert len(keywords.stderr.strip().splitlines()) == 1
