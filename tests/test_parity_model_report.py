"""Parity of QL201/QL202/QL203 statistics and verdicts with torch's ModelReport detectors.

The same prepared model, the same QConfigMapping and the same batches go through
torch's ModelReport (private API, fine in tests: it is the reference) and through
qlint's calibration runner. Verdicts must agree with torch's, except where qlint
deliberately differs (documented in the rule docs):

* QL202 recommends equalization *outside* [t, 1/t], torch's code inside it, so per
  channel qlint's verdict is the complement of torch's (channels with a zero range
  excepted), and the module verdict is computed from that complement;
* QL203 uses |p| for a negative average ratio where torch keeps 1/p (negative).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import get_default_qat_qconfig_mapping, get_default_qconfig_mapping
from torch.ao.quantization.fx._model_report.detector import (
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
)
from torch.ao.quantization.fx._model_report.model_report import ModelReport
from torch.ao.quantization.quantize_fx import prepare_fx, prepare_qat_fx

from qlint.linter.calibration import collect_statistics
from qlint.linter.engine import analyse, instantiate_rules
from qlint.linter.registry import Registry
from qlint.rules import ql201_dynamic_static, ql202_input_weight_equalization, ql203_activation_outlier
from qlint.stats.selection import PERCENTILE_SAMPLE, is_exact


def _dynamic_static(rules, statistics, node):
    return ql201_dynamic_static.measure(statistics, node, rules["QL201"].options.tolerance)


def _equalization(rules, statistics, graph, node):
    options = rules["QL202"].options
    return ql202_input_weight_equalization.measure(
        statistics, graph, node, options.ratio_threshold, options.channel_fraction
    )


def _outliers(rules, statistics, node):
    options = rules["QL203"].options
    return ql203_activation_outlier.measure(
        statistics, node, options.ratio_threshold, options.fraction_batches_used_threshold
    )


RTOL = 1e-4
THRESHOLD = 0.5


# ------------------------------------------------------------------------ models
class NestedSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), nn.Conv2d(8, 8, 3))
        self.head = nn.Sequential(nn.Sequential(nn.Linear(8 * 4 * 4, 32), nn.ReLU()), nn.Linear(32, 10))

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class FunctionalOps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(12, 16)
        self.out = nn.Linear(32, 6)

    def forward(self, x):
        a = F.relu(self.fc1(x))
        b = torch.tanh(self.fc2(x)) * 2.0
        return self.out(torch.cat([a, b], dim=1))


class QatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.fc2 = nn.Linear(24, 8)

    def forward(self, x):
        return self.fc2(torch.sigmoid(self.fc1(x)))


class LstmLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 12, batch_first=True)
        self.fc = nn.Linear(12, 4)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


class BnCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        return self.fc(x.mean((2, 3)))


class TwoInputAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(10, 16)
        self.fb = nn.Linear(10, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, a, b):
        return self.fc(self.fa(a) + self.fb(b))


def _batches(shapes, count, seed, drift, spike_channel=None, channel_scale=None):
    """Gaussian batches; ``drift`` scales whole batches (non-stationary data), a spike
    channel gets rare large values, ``channel_scale`` widens some input channels."""
    generator = torch.Generator().manual_seed(seed)
    scales = [1.0, 6.0, 0.3, 2.0, 12.0, 0.8, 1.5, 4.0][:count] if drift else [1.0] * count
    batches = []
    for k in range(count):
        tensors = []
        for shape in shapes:
            x = torch.randn(shape, generator=generator) * scales[k]
            if channel_scale is not None:
                view = (1, -1) + (1,) * (len(shape) - 2)
                x = x * torch.tensor(channel_scale).view(view)
            if spike_channel is not None:
                channel = x.select(1, spike_channel)
                mask = torch.rand(channel.shape, generator=generator) < 0.01
                mask.view(-1)[0] = True
                channel[mask] = 30.0 * scales[k]
            tensors.append(x)
        batches.append(tuple(tensors))
    return batches


CASES = {
    "nested-sequential": (NestedSequential, [(4, 3, 8, 8)], dict(drift=True, spike_channel=1), False),
    "functional-ops": (FunctionalOps, [(16, 12)], dict(drift=False, channel_scale=[20.0] * 4 + [1.0] * 8), False),
    "qat": (QatNet, [(16, 12)], dict(drift=True, spike_channel=3), True),
    "lstm-linear": (LstmLinear, [(4, 5, 6)], dict(drift=True), False),
    "bn-cnn": (BnCnn, [(2, 3, 8, 8)], dict(drift=False, spike_channel=2, channel_scale=[1.0, 40.0, 1.0]), False),
    "two-input-add": (TwoInputAdd, [(8, 10), (8, 10)], dict(drift=True, spike_channel=0), False),
}


def _prepared(name):
    cls, shapes, data, qat = CASES[name]
    torch.manual_seed(0)
    model = cls()
    example = tuple(torch.randn(s) for s in shapes)
    if qat:
        prepared = prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("x86"), example)
    else:
        prepared = prepare_fx(model.eval(), get_default_qconfig_mapping("x86"), example)
    prepared.eval()
    return prepared, example, _batches(shapes, 6, seed=len(name), **data)


def _torch_report(prepared, detector, batches):
    model = copy.deepcopy(prepared)
    report = ModelReport(model, {detector})
    observed = report.prepare_detailed_calibration()
    observed.eval()
    with torch.no_grad():
        for batch in batches:
            observed(*batch)
    return report.generate_model_report(remove_inserted_observers=False)[detector.get_detector_name()][1]


def _qlint(prepared, example, batches, **calibration_options):
    # No example inputs: qlint's shape propagation would run them through the copy and move
    # the QAT fake-quant observers before calibration starts (see the report to the lead).
    analysis = analyse(copy.deepcopy(prepared), None, "x86")
    rules = instantiate_rules(
        Registry.default(include_plugins=False).select(["QL201", "QL202", "QL203"], None),
        {"QL202": {"ratio_threshold": THRESHOLD}},
    )
    statistics, _ = collect_statistics(analysis, rules, batches, {"quiet": True, **calibration_options})
    return analysis.graph, {r.code: r for r in rules}, statistics


def _node_for(graph, fqn):
    """The qlint node of torch's module fqn (torch names the inner module of a fused pair)."""
    while fqn:
        sites = graph.call_sites(fqn)
        if sites:
            return sites[0]
        fqn = fqn.rpartition(".")[0]
    return None


def _close(a, b):
    return math.isclose(float(a), float(b), rel_tol=RTOL, abs_tol=1e-7)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    prepared, example, batches = _prepared(request.param)
    graph, rules, statistics = _qlint(prepared, example, batches)
    return request.param, prepared, batches, graph, rules, statistics


def test_dynamic_static_parity(case):
    name, prepared, batches, graph, rules, statistics = case
    torch_info = _torch_report(prepared, DynamicStaticDetector(tolerance=0.5), batches)
    compared = 0
    for fqn, info in torch_info.items():
        node = _node_for(graph, fqn)
        if node is None or node.kind != "linear":
            continue  # qlint checks linear layers only (no backend quantizes conv dynamically)
        ours = _dynamic_static(rules, statistics, node)
        assert ours is not None, f"{name}: no QL201 statistics for {fqn}"
        assert ours.dynamic_recommended == bool(info[DynamicStaticDetector.DEFAULT_DYNAMIC_REC_KEY]), fqn
        assert _close(ours.input_comp_stat, info[DynamicStaticDetector.PRE_OBS_COMP_STAT_KEY]), fqn
        assert _close(ours.output_comp_stat, info[DynamicStaticDetector.POST_OBS_COMP_STAT_KEY]), fqn
        compared += 1
    assert compared >= 1, f"{name}: no linear layer compared"


def test_input_weight_equalization_parity(case):
    name, prepared, batches, graph, rules, statistics = case
    torch_info = _torch_report(prepared, InputWeightEqualizationDetector(THRESHOLD), batches)
    compared = 0
    for fqn, info in torch_info.items():
        node = _node_for(graph, fqn)
        assert node is not None, fqn
        ours = _equalization(rules, statistics, graph, node)
        assert ours is not None, f"{name}: no QL202 result for {fqn}"
        torch_metrics = info[InputWeightEqualizationDetector.COMP_METRIC_KEY].tolist()
        torch_recommended = info[InputWeightEqualizationDetector.RECOMMENDED_KEY]
        assert len(ours.comp_metrics) == len(torch_metrics)
        expected = []
        for metric, torch_flag, our_metric in zip(torch_metrics, torch_recommended, ours.comp_metrics):
            if math.isfinite(metric) and metric > 0:
                assert _close(our_metric, metric), (fqn, our_metric, metric)
                expected.append(not torch_flag)  # documented band inversion
            else:
                expected.append(False)  # zero range: never recommended by qlint
        assert ours.channels_recommended == expected, fqn
        module_verdict = (
            sum(expected) / len(expected)
            >= InputWeightEqualizationDetector.DEFAULT_RECOMMEND_INPUT_WEIGHT_CHANNEL_RATIO
        )
        assert ours.equalization_recommended == module_verdict, fqn
        compared += 1
    assert compared >= 1, f"{name}: torch reported no equalization layer"


def test_outlier_parity(case):
    name, prepared, batches, graph, rules, statistics = case
    torch_info = _torch_report(prepared, OutlierDetector(), batches)
    compared = 0
    for fqn, info in torch_info.items():
        node = _node_for(graph, fqn)
        if node is None or node.module != fqn or node.kind not in ("linear", "conv2d"):
            continue  # QL203 reports conv/linear layers; torch observes every leaf module
        ours = _outliers(rules, statistics, node)
        assert ours is not None, fqn
        torch_outlier = [
            bool(o and s)
            for o, s in zip(info[OutlierDetector.OUTLIER_KEY], info[OutlierDetector.IS_SUFFICIENT_BATCHES_KEY])
        ]
        assert ours.outlier.tolist() == torch_outlier, (fqn, ours.metric, info[OutlierDetector.COMP_METRIC_KEY])
        used = info[OutlierDetector.NUM_BATCHES_KEY].tolist()
        for channel, torch_metric in enumerate(info[OutlierDetector.COMP_METRIC_KEY].tolist()):
            our_metric = float(ours.metric[channel])
            if used[channel] == 0:
                assert math.isnan(our_metric)
            elif torch_metric > 1e30:  # a zero reference quantile: float32 max in torch, inf in qlint
                assert our_metric == math.inf
            elif torch_metric < 0:  # torch keeps 1/p for negative p; qlint uses |p| (documented)
                assert _close(our_metric, max(abs(torch_metric), 1 / abs(torch_metric)))
            else:
                assert _close(our_metric, torch_metric), (fqn, channel, our_metric, torch_metric)
        assert _close(ours.stats.channel_max.max(), info[OutlierDetector.MAX_VALS_KEY].max())
        compared += 1
    if name != "qat":  # QAT linears have a weight_fake_quant child, which torch's OutlierDetector skips
        assert compared >= 1, f"{name}: no layer compared"


def test_parity_cases_exercise_both_verdicts():
    """The batches above are not degenerate: across the models qlint sees both verdicts of each rule."""
    seen = {"dynamic": set(), "equalize": set(), "outlier": set()}
    for name in sorted(CASES):
        prepared, example, batches = _prepared(name)
        graph, rules, statistics = _qlint(prepared, example, batches)
        for node in graph.ops():
            ds = _dynamic_static(rules, statistics, node) if node.kind == "linear" else None
            if ds:
                seen["dynamic"].add(ds.dynamic_recommended)
            if node.kind in ("linear", "conv2d"):
                eq = _equalization(rules, statistics, graph, node)
                if eq:
                    seen["equalize"].add(eq.equalization_recommended)
                out = _outliers(rules, statistics, node)
                if out:
                    seen["outlier"].add(bool(out.outlier.any()))
    assert all(v == {True, False} for v in seen.values()), seen


class WideConv(nn.Module):
    """48 input channels: more than qlint selects the reference quantile of on every batch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(48, 8, 1)

    def forward(self, x):
        return self.conv(x)


def test_outlier_verdicts_agree_where_the_reference_is_selected_on_a_subset_of_batches():
    """With percentile_every=4 a point of more than 32 channels selects its reference on one
    batch in four (qlint.stats.selection): its metric is a mean over fewer batches than
    torch's, and its verdicts, on channels with rare spikes and on plain ones, are still torch's."""
    torch.manual_seed(0)
    prepared = prepare_fx(WideConv().eval(), get_default_qconfig_mapping("x86"), (torch.randn(4, 48, 8, 8),)).eval()
    batches = []
    for spiked in (3, 17, 40):
        batches += _batches([(4, 48, 8, 8)], 4, seed=spiked, drift=True, spike_channel=spiked)
    graph, rules, statistics = _qlint(prepared, None, batches, percentile_every=4)
    node = _node_for(graph, "conv")
    ours = _outliers(rules, statistics, node)
    assert ours is not None
    assert 0 < int(ours.stats.reference_batches) < int(ours.stats.batches) == len(batches)
    info = _torch_report(prepared, OutlierDetector(), batches)["conv"]
    torch_outlier = [
        bool(o and s)
        for o, s in zip(info[OutlierDetector.OUTLIER_KEY], info[OutlierDetector.IS_SUFFICIENT_BATCHES_KEY])
    ]
    assert sum(torch_outlier) >= 1 and not all(torch_outlier)  # both verdicts occur
    assert ours.outlier.tolist() == torch_outlier


class LargeConv(nn.Module):
    """A 1x1 conv whose input batches, (8, 16, 32, 32), hold 131072 values."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        return self.conv(x)


LARGE_SHAPE = (8, 16, 32, 32)
# Channels whose max / p97.5 ratio is planted well above torch's 3.5 (by spikes of different
# height and density, or a heavy tail); every other channel stays near 1-2.6.
PLANTED_OUTLIERS = (8, 9, 10, 11, 12, 13)


def _heavy_tailed_batches(count, seed):
    """Drifting batches of ``LARGE_SHAPE``: Gaussian channels of several scales, offsets and
    shapes (uniform, ReLU, 5-sigma spikes: ratios <= 2.7) beside channels with 10, 25 and
    80-sigma spikes, a Student-t(3) and a Cauchy tail, and spikes in every other batch only
    (ratios >= 5 in torch's exact statistic)."""
    generator = torch.Generator().manual_seed(seed)
    n, _, h, w = LARGE_SHAPE
    plane = (n, h, w)

    def randn(*shape):
        return torch.randn(shape, generator=generator)

    def spike(channel, height, density):
        mask = torch.rand(plane, generator=generator) < density
        mask.view(-1)[0] = True  # at least one per batch
        sign = torch.where(torch.rand(plane, generator=generator) < 0.5, -1.0, 1.0)
        channel[mask] = (height * sign)[mask]

    batches = []
    for k, scale in enumerate([1.0, 6.0, 0.3, 2.0, 12.0, 0.8][:count]):
        x = randn(*LARGE_SHAPE)
        x[:, 1] *= 4.0
        x[:, 2] *= 0.2
        x[:, 3] += 2.0
        x[:, 4] = torch.rand(plane, generator=generator) * 2 - 1
        x[:, 5].clamp_(min=0)
        x[:, 14] *= 3.0
        spike(x[:, 6], 5.0, 0.002)  # spiky, but not enough for an outlier
        spike(x[:, 8], 10.0, 0.002)
        spike(x[:, 9], 25.0, 0.0005)
        spike(x[:, 10], 80.0, 0.0)  # one value per batch
        x[:, 11] = x[:, 11] / (randn(3, *plane).square().sum(0) / 3).sqrt()  # Student-t, 3 dof
        x[:, 12] = x[:, 12] / randn(*plane).abs()  # Cauchy
        if k % 2 == 0:
            spike(x[:, 13], 30.0, 0.001)
        batches.append((x * scale,))
    return batches


def test_outlier_verdicts_agree_where_the_reference_is_estimated_from_a_sample():
    """Batches of 131072 values at a point, above EXACT_VALUES: qlint estimates each channel's
    reference quantile from PERCENTILE_SAMPLE sampled values (qlint.stats.selection) where torch
    selects it exactly from 8192. The planted outliers and plain channels keep their verdicts."""
    n, channels, h, w = LARGE_SHAPE
    assert not is_exact(n * h * w, channels, PERCENTILE_SAMPLE)
    torch.manual_seed(0)
    prepared = prepare_fx(LargeConv().eval(), get_default_qconfig_mapping("x86"), (torch.randn(LARGE_SHAPE),)).eval()
    batches = _heavy_tailed_batches(6, seed=14)
    graph, rules, statistics = _qlint(prepared, None, batches)
    ours = _outliers(rules, statistics, _node_for(graph, "conv"))
    assert ours is not None
    detector = OutlierDetector()
    assert rules["QL203"].options.ratio_threshold == detector.ratio_threshold
    assert rules["QL203"].options.reference_percentile == detector.reference_percentile
    info = _torch_report(prepared, detector, batches)["conv"]
    torch_metric = info[OutlierDetector.COMP_METRIC_KEY].tolist()
    torch_outlier = [
        bool(o and s)
        for o, s in zip(info[OutlierDetector.OUTLIER_KEY], info[OutlierDetector.IS_SUFFICIENT_BATCHES_KEY])
    ]
    # The data is as planted, with margins around the threshold the sample's error stays within.
    assert [c for c, o in enumerate(torch_outlier) if o] == list(PLANTED_OUTLIERS), torch_metric
    assert all(m > 1.4 * detector.ratio_threshold or m < 0.8 * detector.ratio_threshold for m in torch_metric)
    # The sampled estimate is not torch's exact element (the exact path would match it to RTOL).
    assert not all(_close(a, b) for a, b in zip(ours.metric.tolist(), torch_metric))
    assert ours.outlier.tolist() == torch_outlier, (ours.metric.tolist(), torch_metric)
