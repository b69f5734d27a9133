"""The calibration runner, its inputs, its robustness, the QL202 band and the CLI."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qlint
import qlint.linter.engine
import qlint.linter.registry
from qlint.core.load import load_calibration, random_calibration
from qlint.errors import EmptyCalibrationError, LoadError, QlintError
from qlint.linter.calibration import CalibrationStatistics

DATA_RULES = ["QL201", "QL202", "QL203"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


def _net():
    torch.manual_seed(0)
    return Net().eval()


def _images(count=4, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 3, 8, 8, generator=generator) for _ in range(count)]


def _lint(model, calibration, **kwargs):
    return qlint.lint(
        model,
        (torch.randn(2, 3, 8, 8),),
        calibration=calibration,
        select=DATA_RULES,
        calibration_options={"quiet": True},
        **kwargs,
    )


def _assert_ran_cleanly(report):
    assert not report.skipped, report.skipped
    assert not [n for n in report.notices if "crash" in n.message], report.notices
    assert {row.rule for row in report.layers} >= {"QL202", "QL203"}


# ------------------------------------------------------------------ the runner
def test_statistics_object_and_user_model_untouched():
    model = _net()
    before = copy.deepcopy(model.state_dict())
    modules_before = [name for name, _ in model.named_modules()]
    analysis = qlint.linter.engine.analyse(model, (torch.randn(2, 3, 8, 8),), "x86")
    rules = qlint.linter.engine.instantiate_rules(
        qlint.linter.registry.Registry.default(include_plugins=False).select(DATA_RULES, None), {}
    )
    from qlint.linter.calibration import collect_statistics

    stats, _ = collect_statistics(analysis, rules, _images(5), {"quiet": True})
    assert isinstance(stats, CalibrationStatistics)
    assert stats.batches == 5
    conv_in = stats.get("conv", "input", 0)
    assert conv_in is not None and conv_in.num_channels == 3 and int(conv_in.batches) == 5
    everything = torch.cat(_images(5))
    assert torch.allclose(conv_in.channel_max.float(), everything.amax((0, 2, 3)))
    assert stats.get("conv", "output", 0) is None  # nobody asked for it
    assert stats.get("fc", "output", 0) is not None  # QL201 did
    # one observer per point even though QL202 and QL203 both observe conv's input
    assert len([p for p in stats.points if p.node == "conv"]) == 1
    with pytest.raises(TypeError):
        stats._stats["x"] = None  # read-only view
    # neither the user's model nor the analysis copy got observers
    assert [name for name, _ in model.named_modules()] == modules_before
    assert not any("qlint_stats" in n for n, _ in analysis.traced.graph_module.named_modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert not model.training


@pytest.mark.parametrize("form", ["tensor-list", "tuples", "dicts", "dataloader", "generator"])
def test_batch_forms_give_identical_statistics(form):
    images = _images(4)
    reference = _lint(_net(), images)
    if form == "tensor-list":
        data = images
    elif form == "tuples":
        data = [(x,) for x in images]
    elif form == "dicts":
        data = [{"x": x} for x in images]
    elif form == "dataloader":
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(images)), batch_size=2)
    else:
        data = (x for x in images)
    report = _lint(_net(), data)
    _assert_ran_cleanly(report)
    assert [(r.name, r.rule, r.value) for r in report.layers] == [(r.name, r.rule, r.value) for r in reference.layers]


def test_num_batches_limits_the_run():
    from qlint.linter.calibration import collect_statistics

    analysis = qlint.linter.engine.analyse(_net(), (torch.randn(2, 3, 8, 8),), "x86")
    rules = qlint.linter.engine.instantiate_rules(
        qlint.linter.registry.Registry.default(include_plugins=False).select(["QL203"], None), {}
    )
    stats, _ = collect_statistics(analysis, rules, _images(6), {"quiet": True, "num_batches": 2})
    assert stats.batches == 2
    assert int(stats.get("conv", "input", 0).batches) == 2


def test_percentile_every_thins_the_reference_of_wide_points_only():
    """calibration_options percentile_every=3: the 40-channel Linear input selects QL203's
    reference on batches 0 and 3 of 5; the 3-channel conv input on every batch."""
    from qlint.errors import ConfigError
    from qlint.linter.calibration import collect_statistics

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 40, 3)
            self.fc = nn.Linear(40, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).mean((2, 3)))

    torch.manual_seed(0)
    analysis = qlint.linter.engine.analyse(Wide().eval(), (torch.randn(2, 3, 8, 8),), "x86")
    rules = qlint.linter.engine.instantiate_rules(
        qlint.linter.registry.Registry.default(include_plugins=False).select(["QL203"], None), {}
    )
    thinned, _ = collect_statistics(analysis, rules, _images(5), {"quiet": True, "percentile_every": 3})
    assert int(thinned.get("fc", "input", 0).reference_batches) == 2
    assert int(thinned.get("conv", "input", 0).reference_batches) == 5
    every, _ = collect_statistics(analysis, rules, _images(5), {"quiet": True})
    assert int(every.get("fc", "input", 0).reference_batches) == 5
    with pytest.raises(ConfigError, match="percentile_every"):
        collect_statistics(analysis, rules, _images(5), {"quiet": True, "percentile_every": 0})


def test_empty_iterable_is_a_clear_error():
    with pytest.raises(EmptyCalibrationError, match="empty"):
        _lint(_net(), [])
    assert issubclass(EmptyCalibrationError, QlintError)


def test_bad_batch_is_a_qlint_error():
    with pytest.raises(QlintError, match="batch 0"):
        _lint(_net(), [torch.randn(2, 5, 8, 8)])
    with pytest.raises(QlintError, match="batch 0 is a str"):
        _lint(_net(), ["not a tensor"])


# -------------------------------------------------------------- robustness
def test_nan_and_inf_activations_are_errors_not_crashes():
    images = _images(4)
    images[1][0, 0, 2, 2] = float("nan")
    images[2][1, 2, 0, 0] = float("inf")
    report = _lint(_net(), images)
    _assert_ran_cleanly(report)
    errors = [f for f in report.findings if f.rule == "QL203" and f.data["kind"] == "non-finite"]
    assert errors and errors[0].severity == qlint.Severity.ERROR
    assert errors[0].data["nan_count"] >= 1 and errors[0].data["inf_count"] >= 1
    report.model_validate_json(report.model_dump_json())  # NaN/Inf never leak into JSON


def test_constant_channels_are_reported():
    images = _images(4)
    for x in images:
        x[:, 1] = 0.5
    report = _lint(_net(), images)
    _assert_ran_cleanly(report)
    constant = [f for f in report.findings if f.data.get("kind") == "constant-channels" and f.target == "conv"]
    assert constant and constant[0].data["constant_channels"] == [1]
    equalization = [r for r in report.layers if r.rule == "QL202" and r.name == "conv"]
    assert equalization  # a constant channel does not stop the other statistics
    report.model_validate_json(report.model_dump_json())


def test_every_constant_channel_has_its_value():
    """The finding listed every constant channel but the values of the first 32 only, so the two
    lists of its JSON could not be zipped."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 4)).eval()
    generator = torch.Generator().manual_seed(0)
    levels = torch.arange(35, dtype=torch.float32) / 7
    batches = [torch.cat([levels.expand(8, 35), torch.randn(8, 5, generator=generator)], 1) for _ in range(3)]
    report = qlint.lint(
        model, (batches[0],), calibration=batches, select=["QL203"], calibration_options={"quiet": True}
    )
    [constant] = [f for f in report.findings if f.data.get("kind") == "constant-channels"]
    assert constant.data["constant_channels"] == list(range(35))
    assert constant.data["values"] == pytest.approx(levels.tolist())


def test_all_constant_input_gives_a_report():
    report = _lint(_net(), [torch.ones(2, 3, 8, 8)] * 3)
    assert not report.skipped
    assert [f for f in report.findings if f.data.get("kind") == "constant-channels"]


@pytest.mark.parametrize("count,batch", [(1, 2), (3, 1), (1, 1)])
def test_single_batch_and_batch_size_one(count, batch):
    report = _lint(_net(), _images(count, batch))
    _assert_ran_cleanly(report)
    assert all(math.isfinite(r.value) for r in report.layers if r.value is not None)


def test_without_calibration_data_rules_are_skipped_with_reason():
    report = qlint.lint(_net(), (torch.randn(2, 3, 8, 8),), select=DATA_RULES)
    skipped = {s.rule: s.reason for s in report.skipped}
    assert set(skipped) == set(DATA_RULES)
    assert all("calibration" in reason for reason in skipped.values())
    assert report.layers == []


# ------------------------------------------------------------------ loading
def test_load_calibration_forms(tmp_path):
    images = _images(3)
    torch.save(images[0], tmp_path / "one.pt")
    torch.save(images, tmp_path / "list.pt")
    torch.save([(x, x) for x in images], tmp_path / "tuples.pt")
    assert len(load_calibration(tmp_path / "one.pt")) == 1
    assert all(torch.equal(a, b) for a, b in zip(load_calibration(tmp_path / "list.pt"), images))
    assert isinstance(load_calibration(tmp_path / "tuples.pt")[0], tuple)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, x in reversed(list(enumerate(images))):
        torch.save(x, folder / f"batch_{i:02d}.pt")
    loaded = load_calibration(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded, images))  # sorted by name


def test_a_tuple_of_tensors_in_a_calibration_file_is_one_batch_of_several_inputs(tmp_path):
    """QA (silero_vad, forward(x, state)): a folder of torch.save((x, state), f) files was read
    as two batches per file, x then state, and lint failed with 'got 1 input'."""
    images = _images(3)
    folder = tmp_path / "pairs"
    folder.mkdir()
    for i, x in enumerate(images):
        torch.save((x, x * 2), folder / f"{i:02d}.pt")
    loaded = load_calibration(folder)
    assert len(loaded) == 3 and all(isinstance(batch, tuple) and len(batch) == 2 for batch in loaded)
    assert torch.equal(loaded[1][1], images[1] * 2)
    torch.save(tuple([(x, x) for x in images]), tmp_path / "tuple_of_batches.pt")  # batches, as a list
    assert len(load_calibration(tmp_path / "tuple_of_batches.pt")) == 3


def test_load_calibration_errors(tmp_path):
    with pytest.raises(LoadError, match="not found"):
        load_calibration(tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(LoadError, match="garbage.pt is not a file torch.save wrote"):
        load_calibration(tmp_path / "garbage.pt")
    good = tmp_path / "good.pt"
    torch.save([torch.randn(2, 3)], good)
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:200])
    with pytest.raises(LoadError, match="cannot load"):
        load_calibration(tmp_path / "cut.pt")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(QlintError, match="no files"):
        load_calibration(empty)


def test_random_calibration_is_seeded_and_shaped():
    example = (torch.zeros(2, 3, 8, 8), torch.zeros(2, 5))
    first, second = random_calibration(example, 3), random_calibration(example, 3)
    assert len(first) == 3 and [t.shape for t in first[0]] == [t.shape for t in example]
    assert all(torch.equal(a, b) for x, y in zip(first, second) for a, b in zip(x, y))
    assert not torch.equal(first[0][0], first[1][0])


# ------------------------------------------------------- QL202 band direction
def _equalization_error(model, calibration, test, equalize: bool) -> float:
    from torch.ao.quantization.fx._equalize import default_equalization_qconfig

    equalization = QConfigMapping().set_module_name("fc1", default_equalization_qconfig) if equalize else None
    prepared = prepare_fx(
        copy.deepcopy(model), get_default_qconfig_mapping("x86"), (calibration[0],), _equalization_config=equalization
    )
    with torch.no_grad():
        for batch in calibration:
            prepared(batch)
    quantized = convert_fx(prepared)
    with torch.no_grad():
        expected, actual = model(test), quantized(test)
    return float((expected - actual).pow(2).mean() / expected.pow(2).mean())


class OneLinear(nn.Module):
    # A single layer: torch 2.x's global equalization of a fc1-relu-fc2 chain is itself
    # broken (relative error > 1 after convert_fx), so the experiment equalizes one layer.
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc1(x)


def _channel_data(scales, count, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 16, generator=generator) * scales for _ in range(count)]


def test_ql202_band_follows_what_equalization_does():
    """Equalization lowers the int8 error exactly where s_c is far from 1 (outside the band)."""
    from torch.ao.quantization.fx._model_report.detector import InputWeightEqualizationDetector

    torch.manual_seed(0)
    model = OneLinear().eval()
    unbalanced = torch.logspace(0, 2, 16)  # input channel ranges from 1 to 100
    balanced = torch.ones(16)
    results = {}
    for label, scales in (("unbalanced", unbalanced), ("balanced", balanced)):
        calibration, test = _channel_data(scales, 8, 0), _channel_data(scales, 1, 1)[0]
        error_plain = _equalization_error(model, calibration, test, equalize=False)
        error_equalized = _equalization_error(model, calibration, test, equalize=True)
        report = qlint.lint(
            model, (calibration[0],), calibration=calibration, select=["QL202"], calibration_options={"quiet": True}
        )
        finding = [f for f in report.findings if f.target == "fc1"]
        metrics = [m for m in (finding[0].data["comp_metrics"] if finding else [])]
        row = [r for r in report.layers if r.name == "fc1"][0]
        results[label] = (error_plain, error_equalized, bool(finding), row.value, metrics)
    plain, equalized, flagged, fraction, metrics = results["unbalanced"]
    assert equalized < 0.7 * plain, results  # equalization measurably helps here ...
    assert flagged and fraction >= 0.4  # ... and qlint recommends it
    # torch's code band (recommend inside [t, 1/t]) would not: most channels are outside it
    t = 0.5
    inside = [t <= m <= 1 / t for m in metrics]
    assert sum(inside) / len(inside) < InputWeightEqualizationDetector.DEFAULT_RECOMMEND_INPUT_WEIGHT_CHANNEL_RATIO
    plain_b, equalized_b, flagged_b, fraction_b, _ = results["balanced"]
    assert not flagged_b and fraction_b < 0.4  # balanced ranges: qlint stays quiet ...
    assert equalized_b > 0.7 * plain_b  # ... and equalization would not have helped much


# ------------------------------------------------------------------- CLI
def badnet_calibration(count: int = 8, batch: int = 4) -> list[torch.Tensor]:
    from examples.badnet import calibration_batches

    return calibration_batches(count, batch)


def test_cli_readme_example_reports_all_data_rules(run_cli, tmp_path):
    path = tmp_path / "calibration.pt"
    torch.save(badnet_calibration(), path)
    result = run_cli(
        "examples.badnet:build",
        "--input-shape",
        "1,3,32,32",
        "--no-trial",
        "--qconfig-mapping",
        "examples.badnet:qconfig_mapping",
        "--calibration",
        path,
        "--format",
        "json",
        "--quiet",
    )
    assert result.returncode == 1, result.stderr
    report = qlint.Report.model_validate_json(result.stdout)
    rules = {f.rule for f in report.findings}
    assert {"QL201", "QL202", "QL203"} <= rules, rules
    assert {r.rule for r in report.layers} >= {"QL201", "QL202", "QL203"}


def test_cli_calibration_from_a_factory(run_cli, repo_root):
    result = run_cli(
        "examples.badnet:build",
        "--input-shape",
        "1,3,32,32",
        "--no-trial",
        "--calibration",
        "examples.badnet:calibration_batches",
        "--select",
        "QL2",
        "--format",
        "json",
        "--quiet",
        cwd=repo_root,
    )
    assert result.returncode == 1, result.stderr
    report = qlint.Report.model_validate_json(result.stdout)
    assert {"QL201", "QL202", "QL203"} <= {f.rule for f in report.findings}


def test_cli_empty_calibration_dir_exits_2(run_cli, tmp_path):
    empty = tmp_path / "EMPTY_DIR"
    empty.mkdir()
    result = run_cli("examples.badnet:build", "--input-shape", "1,3,32,32", "--calibration", empty)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "EMPTY_DIR" in lines[0], result.stderr


def test_cli_empty_calibration_file_exits_2(run_cli, tmp_path):
    path = tmp_path / "empty.pt"
    torch.save([], path)
    result = run_cli("examples.badnet:build", "--input-shape", "1,3,32,32", "--no-trial", "--calibration", path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "empty" in lines[0], result.stderr


def test_preserved_state_restores_modes_and_buffers():
    from qlint.core.preserve import preserved_state

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with preserved_state(model):
        model(torch.randn(2, 3, 8, 8) * 5 + 3)  # updates BN running statistics
        changed = not torch.equal(model[1].running_mean, before["1.running_mean"])
        model.eval()
    assert changed  # the forward really did change state inside the block
    assert model.training and model[1].training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_switched_off_statistics_leave_the_rest_identical():
    from qlint.stats import StatsObserver

    generator = torch.Generator().manual_seed(5)
    batches = [torch.randn(4, 6, 9, 9, generator=generator) * (k + 1) for k in range(3)]
    full, lean = StatsObserver(1), StatsObserver(1, percentile=False, histogram=False)
    for batch in batches:
        full(batch)
        lean(batch)
    for name in ("channel_min", "channel_max", "count", "nan_count"):
        assert torch.equal(getattr(full.stats, name), getattr(lean.stats, name)), name
    # Sums are float32 partial sums over blocks whose length depends on whether the
    # percentile is computed (its block maxima need short blocks): equal to rounding.
    for name in ("sum", "sum_of_squares"):
        torch.testing.assert_close(getattr(full.stats, name), getattr(lean.stats, name), rtol=1e-6, atol=1e-9)
    assert torch.equal(full.stats.average_batch_range(), lean.stats.average_batch_range())
    assert int(full.stats.percentile_batches_tracked().sum()) > 0
    assert int(lean.stats.percentile_batches_tracked().sum()) == 0
    assert int(lean.stats.zero_denominator_batches.sum()) == 0
    assert int(full.stats.histogram.sum()) == 4 * 6 * 9 * 9 * 3 and int(lean.stats.histogram.sum()) == 0


def test_point_needs_are_the_union_of_the_rules_asking():
    from qlint.linter.calibration import resolve_point_needs
    from qlint.linter.engine import analyse
    from qlint.linter.registry import Registry

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    analysis = analyse(model, (torch.randn(2, 8),), "x86")
    registry = Registry.default(include_plugins=False)
    only_ranges = resolve_point_needs(analysis.graph, [registry.get("QL201")()])
    assert only_ranges and not any(n.percentile or n.histogram or n.moments for n in only_ranges.values())
    combined = resolve_point_needs(analysis.graph, [registry.get(c)() for c in ("QL201", "QL202", "QL203")])
    inputs = {point: need for point, need in combined.items() if point.side == "input"}
    assert inputs and all(need.percentile for need in inputs.values())
    outputs = {point: need for point, need in combined.items() if point.side == "output"}
    assert outputs and not any(need.percentile for need in outputs.values())
    # No built-in rule reads the moments, so no observer the engine inserts computes them.
    assert not any(need.moments for need in combined.values())
