"""`qlint quantize` and `qlint fix` on a .pt2 (an exported, aten graph): quantize builds the pt2e
model verify measured and saves it as a .pt2; fix names every plan rewrite it cannot apply and
exits 1; the pt2e int8 model's size counts only the tensors its graph reads."""

import io
import json

import pytest
import torch
import torch.nn as nn

from qlint.advice.plan import Provenance, Rewrite, default_plan
from qlint.core.sqnr import SqnrSums


class _ViewNet(nn.Module):
    """torch's own Conv2d and Linear (X86InductorQuantizer annotates both), flattened with .view."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.fc = nn.Linear(16 * 6 * 6, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return self.head(torch.relu(self.fc(y.view(y.size(0), -1))))


@pytest.fixture
def pt2_files(tmp_path):
    """net.pt2 (batch dimension dynamic), its calibration and eval batches, a default plan, and a
    plan asking for the view → reshape rewrite; returns (folder, float module)."""
    torch.manual_seed(0)
    model = _ViewNet().eval()
    generator = torch.Generator().manual_seed(3)
    calibration = [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(4)]
    eval_data = [torch.randn(4, 3, 8, 8, generator=generator) for _ in range(2)]
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (calibration[0],), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "net.pt2"))
    torch.save(calibration, tmp_path / "cal.pt")
    torch.save(eval_data, tmp_path / "eval.pt")
    source = Provenance(source="user", detail="test")
    plan = default_plan("x86", model="net.pt2")
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    reshape = Rewrite(kind="view_to_reshape", modules=["view"], provenance=[source])
    (tmp_path / "rewrite_plan.json").write_text(plan.model_copy(update={"rewrites": [reshape]}).model_dump_json())
    return tmp_path, model


def _sqnr(reference: nn.Module, quantized, batches) -> float:
    sums = SqnrSums()
    with torch.no_grad():
        for batch in batches:
            sums.add(reference(batch), quantized(batch))
    value = sums.sqnr_db()
    assert value is not None
    return value


def test_quantize_saves_the_pt2e_model_verify_measured_as_a_pt2(run_main, pt2_files):
    folder, model = pt2_files
    data = ["--calibration", "cal.pt", "--eval-data", "eval.pt"]
    verified = run_main("verify", "net.pt2", "--plan", "plan.json", *data, "--format", "json", cwd=folder)
    assert verified.returncode == 0, verified.stderr
    measured = json.loads(verified.stdout)["plan"]
    assert measured["int8_layers"] == 3  # really quantized: the conv and both linears
    result = run_main("quantize", "net.pt2", "--plan", "plan.json", *data, "-o", "int8.pt2", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert f"output SQNR {measured['sqnr_db']:.2f} dB" in result.stdout and "int8 3/3" in result.stdout
    saved = torch.export.load(str(folder / "int8.pt2")).module()
    eval_data = torch.load(folder / "eval.pt")
    assert _sqnr(model, saved, eval_data) == pytest.approx(measured["sqnr_db"], abs=1e-3)
    assert "quantize_per_tensor" in saved.code  # the saved graph is the converted one, not the float one
    # the float .pt2 took any batch size up to 64: so does the int8 one
    wide = torch.randn(9, 3, 8, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert saved(wide).shape == (9, 4)


def test_quantize_of_a_pt2_refuses_a_torchscript_output_in_one_line(run_main, pt2_files):
    folder, _ = pt2_files
    args = ["quantize", "net.pt2", "--plan", "plan.json", "--calibration", "cal.pt", "-o", "int8.pt"]
    result = run_main(*args, cwd=folder)
    assert result.returncode == 2 and "pt2e" in result.stderr and ".pt2" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (folder / "int8.pt").exists()


def test_the_pt2e_int8_size_counts_only_what_the_graph_reads(run_main, pt2_files):
    """convert_pt2e keeps the float weights as attributes nothing reads: counted, the int8 model
    was larger than the float one."""
    folder, model = pt2_files
    args = ["verify", "net.pt2", "--calibration", "cal.pt", "--eval-data", "eval.pt", "--format", "json"]
    result = run_main(*args, cwd=folder)
    assert result.returncode == 0, result.stderr
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    float_bytes = buffer.getbuffer().nbytes
    size = json.loads(result.stdout)["plan"]["size_bytes"]
    # int8 weights are a quarter of the float ones; biases and qparams stay small here
    assert 0.2 * float_bytes < size < 0.4 * float_bytes, (size, float_bytes)


def test_fix_of_a_pt2_names_the_plan_rewrite_it_cannot_apply_and_exits_1(run_main, pt2_files):
    """An aten graph has no .view call_method for view → reshape: the rewrite was silently left
    out ("0 rewrite(s) applied", exit 0), so a CI step 'fix then quantize' passed."""
    folder, _ = pt2_files
    result = run_main("fix", "net.pt2", "--plan", "rewrite_plan.json", "-o", "fixed.pt2", cwd=folder)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "view_to_reshape view: refused (this exported (aten) graph has no place it applies to)" in result.stderr
    assert "1 of the plan's NOT applied" in result.stdout
    assert (folder / "fixed.pt2").exists()  # written all the same: the float model, unchanged
    plain = run_main("fix", "net.pt2", "--plan", "plan.json", "-o", "plain.pt2", cwd=folder)
    assert plain.returncode == 0 and "NOT applied" not in plain.stdout, plain.stdout + plain.stderr


def test_the_pt2e_int8_pt2_says_what_torch_export_load_needs(run_main, pt2_files):
    """In a fresh process torch.export.load of the pt2e int8 .pt2 failed (SerializeError: no op
    quantized_decomposed.dequantize_per_channel) while --help said torch.export.load reads it."""
    import subprocess
    import sys

    folder, _ = pt2_files
    result = run_main("quantize", "net.pt2", "--calibration", "cal.pt", "-o", "int8.pt2", cwd=folder)
    assert result.returncode == 0, result.stderr
    assert "torch.export.load reads it after `import torchao`" in result.stdout

    def load(prelude: str) -> subprocess.CompletedProcess:
        code = f"import torch\n{prelude}\ntorch.export.load({str(folder / 'int8.pt2')!r})"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    assert load("").returncode != 0  # the claim is needed: plain torch cannot read the file
    loaded = load("import torchao")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
