"""QL203's clip value, bits and fix stay physical (QA on MiniLM and EfficientNet-Lite0).

On MiniLM's GELU outputs QL203 said a band "ends near 177.3" of a tensor whose maximum is
24.61: ``clip_value`` recovered each channel's quantile as max / |average ratio|, and torch's
average of max / quantile mixes batches whose quantile is negative, or whose maximum and
quantile are both negative (ratio below 1), so the average can lie near 0 and its inverse
without bound. The same flipped average (torch makes p < 1 into 1/p to flag the channel)
was read as the bulk fraction of a channel that is all negative: "keeps 1/3.1e+06 of the int8
range". On EfficientNet a channel of mostly zeros alone suggested a clipping observer
"ending near 0" that no trial measured, and it went into the plan.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.ao.quantization import get_default_qconfig_mapping

import qlint
from qlint.advice.plan import plan_from_report
from qlint.linter.findings import Finding, Report
from qlint.rules._ql203_measure import clip_value
from qlint.stats import summarize_batch

Q = 0.975  # QL203's default reference percentile
SPIKE = 3.0  # channel 1's spike: the same in every batch, so its quantile estimate is a mean of quantiles


def _batches(count: int = 8) -> list[torch.Tensor]:
    """(64, 8) batches. Channel 0: one batch with a positive bulk, the others all negative with a
    maximum just below 0 (ratio ~2e-4: the average falls below 1, an outlier once flipped).
    Channel 1: a positive bulk with one spike per batch (a true outlier). The rest: plain."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for index in range(count):
        x = torch.rand(64, 8, generator=generator) + 1.0
        if index == 0:
            x[:, 0] = torch.rand(64, generator=generator) + 0.5
        else:
            x[:, 0] = -(torch.rand(64, generator=generator) * 0.5 + 0.5)
            x[0, 0] = -1e-4
        x[:, 1] = torch.rand(64, generator=generator) * 0.2 + 0.2
        x[5, 1] = SPIKE
        batches.append(x)
    return batches


def _stats(batches):
    stats = None
    for batch in batches:
        summary = summarize_batch(batch, -1, Q, percentile_sample=None)
        stats = summary if stats is None else stats.merge(summary)
    return stats


def test_clip_value_lies_between_zero_and_the_flagged_channels_maximum():
    batches = _batches()
    stats = _stats(batches)
    ratios = stats.average_percentile_ratio()
    assert 0 < float(ratios[0]) < 1  # the average that the old inversion blew up
    assert float(ratios[1]) > 3.5
    clip = clip_value(stats, [0, 1])
    assert math.isfinite(clip)
    assert 0.0 <= clip <= float(stats.channel_max[[0, 1]].max())
    # channel 1's estimate, SPIKE / mean(SPIKE / quantile), is a mean of its batch quantiles,
    # taken here as torch takes them ("lower" interpolation, as the statistics do)
    quantiles = [float(torch.quantile(batch[:, 1], Q, interpolation="lower")) for batch in batches]
    assert min(quantiles) <= clip <= max(quantiles)


def test_clip_value_of_channels_at_or_below_zero_is_zero():
    generator = torch.Generator().manual_seed(1)
    batches = [-torch.rand(32, 4, generator=generator) - 0.1 for _ in range(3)]  # every value < 0
    assert clip_value(_stats(batches), [0, 1, 2, 3]) == 0.0


def _linear() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 4)).eval()


def _outlier_finding(batches: list[torch.Tensor]) -> tuple[Report, Finding]:
    """QL203 alone on the linear model, calibrated on ``batches`` (no trial), and its one outlier finding."""
    report = qlint.lint(
        _linear(),
        (batches[0],),
        calibration=batches,
        qconfig_mapping=get_default_qconfig_mapping("x86"),
        select=["QL203"],
        trial_options={"enabled": False},
    )
    (finding,) = [f for f in report.by_rule("QL203") if f.data["kind"] == "outlier"]
    return report, finding


def test_ql203_reports_no_clip_value_above_the_observed_maximum():
    batches = _batches()
    _, finding = _outlier_finding(batches)
    assert {0, 1} <= set(finding.data["outlier_channels"])
    clip = finding.data["clip_value"]
    assert isinstance(clip, float) and 0.0 <= clip <= max(finding.data["channel_max"])


def _mostly_zero_batches(count: int = 6) -> list[torch.Tensor]:
    """Channel 0: zeros with rare spikes; the others spread over the same range, [0, 5]."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(count):
        x = torch.rand(64, 8, generator=generator) * 5.0
        x[:, 0] = 0.0
        x[3, 0] = 4.0
        batches.append(x)
    return batches


def test_only_mostly_zero_outlier_channels_suggest_no_fix_and_add_nothing_to_the_plan():
    batches = _mostly_zero_batches()
    report, finding = _outlier_finding(batches)
    assert finding.data["mostly_zero_channels"] == finding.data["outlier_channels"] == [0]
    assert finding.severity.value == "info"
    assert finding.suggestion is None and "PercentileObserver" not in finding.message
    assert plan_from_report(report).modules == []


def test_the_statistics_behind_the_mostly_zero_finding_are_what_the_test_means():
    """The finding above is about a channel whose quantile is 0 under a non-zero maximum, and
    the others lose nothing: checked on the statistics themselves, so the test cannot pass for
    another reason."""
    stats = _stats(_mostly_zero_batches())
    assert math.isinf(float(stats.average_percentile_ratio()[0]))
    full = float(stats.channel_max.max() - stats.channel_min.min())
    without = float(stats.channel_max[1:].max() - stats.channel_min[1:].min())
    assert math.log2(full / without) < 0.1


def _negative_channel_batches(count: int = 6) -> list[torch.Tensor]:
    """Channel 0 all negative, in [-1, -0.5] but for a maximum just below 0 (torch's ratio
    ~2e-4, flipped to ~5000: flagged); the others in [1, 2]."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(count):
        x = torch.rand(64, 8, generator=generator) + 1.0
        x[:, 0] = -(torch.rand(64, generator=generator) * 0.5 + 0.5)
        x[0, 0] = -1e-4
        batches.append(x)
    return batches


def test_a_flipped_ratio_is_not_read_as_the_bulk_fraction_of_a_negative_channel():
    batches = _negative_channel_batches()
    stats = _stats(batches)
    assert 0 < float(stats.average_percentile_ratio()[0]) < 1 / 3.5  # flagged once torch flips it
    _, finding = _outlier_finding(batches)
    assert finding.data["outlier_channels"] == [0]
    # the channel spans a third of the tensor's range: it cannot lose more than log2(3) bits to it
    full = float(stats.channel_max.max() - stats.channel_min.min())
    span = float(stats.channel_max[0] - stats.channel_min[0])
    lost = finding.data["outlier_channel_bits_lost"]
    assert not isinstance(lost, float) or lost <= math.log2(full / span)


def test_a_bulk_below_one_int8_step_is_said_to_lose_every_bit():
    """MiniLM: 'keeps 1/7.48e+04 of the int8 range (about 7.0 of 7 bits lost)', a fraction of
    the range below one step of its grid."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        x = torch.rand(64, 8, generator=generator) + 1.0
        x[:, 1] = torch.rand(64, generator=generator) * 1e-3 + 1e-3  # bulk ~1e-3
        x[0, 1] = 100.0  # one spike per batch: max / quantile ~5e4
        batches.append(x)
    _, finding = _outlier_finding(batches)
    assert 1 in finding.data["outlier_channels"]
    bits = finding.data["dtype_bits"]
    assert finding.data["outlier_channel_bits_lost"] == bits
    assert "falls within one int8 step" in finding.message and f"all {bits} bits lost" in finding.message
    assert "keeps 1/" not in finding.message
