"""A .pt2 exported with a static batch size is calibrated on batches of another size (issue 17.2)."""

import json

import pytest
import torch
import torch.nn as nn

from qlint.core.exported_batch import exported_inputs, fit_calibration
from qlint.errors import LoadError


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _TwoInputs(nn.Module):
    def forward(self, x, y):
        return x * 2 + y


def _export(model, *example, **dynamic):
    return torch.export.export(model.eval(), example, dynamic_shapes=dynamic.get("shapes"))


def _rows(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_exported_inputs_read_the_fixed_shapes():
    program = _export(_Net(), torch.randn(1, 4))
    (only,) = exported_inputs(program)
    assert (only.name, only.dims) == ("x", (1, 4))
    dynamic = _export(_Net(), torch.randn(2, 4), shapes={"x": {0: torch.export.Dim("batch")}})
    assert exported_inputs(dynamic)[0].dims == (None, 4)


def test_rechunks_a_list_and_keeps_every_row_in_order():
    program = _export(_Net(), torch.randn(4, 4))
    batches = [_rows(0, 8, 4), _rows(1, 8, 4), _rows(2, 5, 4)]
    fitted, notice = fit_calibration(batches, program)
    chunks = list(fitted)
    assert len(chunks) == len(fitted) == 5
    assert all(chunk.shape == (4, 4) for chunk in chunks)
    assert torch.equal(torch.cat(chunks), torch.cat(batches)[:20])
    assert "re-chunked into 5 batches of 4" in notice and "last 1 samples were left out" in notice
    assert "dynamic_shapes" in notice
    assert list(fitted) and len(list(fitted)) == 5  # re-iterable, like the list it came from


def test_rechunks_a_stream_of_tuples():
    program = _export(_TwoInputs(), torch.randn(2, 3), torch.randn(2, 3))
    xs, ys = _rows(0, 9, 3), _rows(1, 9, 3)
    stream = ((xs[i : i + 3], ys[i : i + 3]) for i in range(0, 9, 3))
    fitted, notice = fit_calibration(stream, program)
    chunks = list(fitted)
    assert [tuple(t.shape) for chunk in chunks for t in chunk] == [(2, 3)] * 8
    assert torch.equal(torch.cat([c[0] for c in chunks]), xs[:8])
    assert torch.equal(torch.cat([c[1] for c in chunks]), ys[:8])
    assert "batches of 3 samples are re-chunked into batches of 2" in notice


def test_fitting_batches_are_passed_through_untouched():
    program = _export(_Net(), torch.randn(2, 4))
    batches = [_rows(0, 2, 4), _rows(1, 2, 4)]
    fitted, notice = fit_calibration(batches, program)
    assert fitted is batches and notice is None


def test_other_fixed_dimension_is_one_clear_error():
    program = _export(_Net(), torch.randn(1, 4))
    with pytest.raises(LoadError, match=r"fixed dimension 1 of input 'x' to 4, the batch has 5.*dynamic_shapes"):
        fit_calibration([_rows(0, 1, 5)], program)


def test_too_few_samples_for_one_batch():
    program = _export(_Net(), torch.randn(8, 4))
    with pytest.raises(LoadError, match="3 samples, fewer than the batch size"):
        fit_calibration([_rows(0, 3, 4)], program)
    stream, _ = fit_calibration(iter([_rows(0, 2, 4), _rows(1, 3, 4)]), program)
    with pytest.raises(LoadError, match="5 samples, fewer than the batch size"):
        list(stream)


@pytest.fixture(scope="module")
def static_archive(tmp_path_factory):
    folder = tmp_path_factory.mktemp("static")
    path = folder / "batch1.pt2"
    torch.manual_seed(0)
    torch.export.save(_export(_Net(), torch.randn(1, 4)), str(path))
    return path


def test_cli_calibrates_a_batch_one_export_on_batches_of_eight(run_cli, static_archive, tmp_path):
    data = tmp_path / "calibration.pt"
    torch.save([_rows(i, 8, 4) for i in range(3)], data)
    result = run_cli(static_archive, "--calibration", data, "--format", "json", "--select", "QL2")
    assert result.returncode in (0, 1), result.stderr
    assert "Guard failed" not in result.stderr
    notices = [n["message"] for n in json.loads(result.stdout)["notices"]]
    assert any("re-chunked into 24 batches of 1" in n for n in notices), notices


def test_cli_names_the_fixed_dimension(run_cli, static_archive, tmp_path):
    data = tmp_path / "wide.pt"
    torch.save([_rows(0, 1, 5)], data)
    result = run_cli(static_archive, "--calibration", data, "-q")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "dimension 1 of input 'x' to 4" in lines[0] and "dynamic_shapes" in lines[0]
