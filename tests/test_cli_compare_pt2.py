"""`qlint compare` with a .pt2 model: torch's exported module refuses eval(), which compare asks
of both models (it was an internal error, 'NotImplementedError: Calling eval() is not supported')."""

import re

import torch

MODELS = """
import torch, torch.nn as nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def train_mode():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 4)).train()


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=generator) for _ in range(3)]


def quantized():
    prepared = prepare_fx(build(), get_default_qconfig_mapping("x86"), (batches()[0],))
    for batch in batches():
        prepared(batch)
    return convert_fx(prepared)
"""


def _project(tmp_path):
    (tmp_path / "cmp_models.py").write_text(MODELS)
    import importlib.util

    spec = importlib.util.spec_from_file_location("cmp_models_for_export", tmp_path / "cmp_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    example = (torch.randn(4, 8),)
    torch.export.save(torch.export.export(module.build(), example), str(tmp_path / "float.pt2"))
    torch.export.save(torch.export.export(module.train_mode(), example), str(tmp_path / "train.pt2"))


def _output_sqnr(stdout):
    match = re.search(r"model output SQNR (\S+) dB", stdout)
    assert match, stdout
    return match.group(1)


def test_a_pt2_float_model_is_compared_and_says_which_layers_only_the_output_covers(run_main, tmp_path):
    _project(tmp_path)
    data = ("--calibration", "cmp_models:batches")
    from_pt2 = run_main("compare", "float.pt2", "cmp_models:quantized", *data, cwd=tmp_path)
    assert from_pt2.returncode == 0, from_pt2.stderr
    assert "internal error" not in from_pt2.stderr
    from_module = run_main("compare", "cmp_models:build", "cmp_models:quantized", *data, cwd=tmp_path)
    assert from_module.returncode == 0, from_module.stderr
    # the same float model, exported: the same output error
    assert _output_sqnr(from_pt2.stdout) == _output_sqnr(from_module.stdout)
    # its Linear layers are aten ops: the quantized Linear modules have no row, and the report says so
    warnings = " ".join(from_pt2.stdout.split()).split("warning: ")[1:]
    assert any("without a float counterpart (compared only through the model output): 0, 2" in w for w in warnings)
    assert any("float.pt2 is an exported program" in w for w in warnings), warnings
    assert "exported program" not in from_module.stdout and "without a float counterpart" not in from_module.stdout


def test_a_pt2_exported_in_training_mode_is_refused_in_one_line(run_main, tmp_path):
    _project(tmp_path)
    result = run_main(
        "compare", "train.pt2", "cmp_models:quantized", "--calibration", "cmp_models:batches", cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "train.pt2 was exported in training mode" in lines[0] and "model.eval()" in lines[0], lines[0]
    assert "aten.batch_norm" in lines[0] and "aten.dropout" in lines[0], lines[0]


def test_sensitivity_of_a_pt2_float_model_runs(run_main, tmp_path):
    """--sensitivity counts FLOPs on the float model after putting it in eval mode, which an
    exported module refuses: it was an internal error where the comparison alone ran."""
    _project(tmp_path)
    result = run_main(
        "compare",
        "float.pt2",
        "cmp_models:quantized",
        "--calibration",
        "cmp_models:batches",
        "--sensitivity",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "internal error" not in result.stderr
    assert _output_sqnr(result.stdout) == _output_sqnr(
        run_main(
            "compare", "float.pt2", "cmp_models:quantized", "--calibration", "cmp_models:batches", cwd=tmp_path
        ).stdout
    )
