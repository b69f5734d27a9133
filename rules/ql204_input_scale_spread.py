"""QL204 input-scale-spread."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from pydantic import Field
from torch.ao.quantization import get_default_qconfig_mapping

from qlint.core.batches import as_call
from qlint.linter.activation import activation_bits, measured_input, physical_bits
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, LayerRow, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions
from qlint.measure.normalize import Candidate, find_normalizable_inputs


class InputScaleSpread(Rule):
    """Flags a model input whose scale differs so much between samples that one int8 scale
    leaves the typical sample a few levels, where a float-exact normalization removes it.

    ## What it does
    Follows each model input forward through the ops that scale with it (a bias-free conv or
    linear, pads, slices, `relu`, `sqrt(a**2 + b**2)`: `f(c·x) = c·f(x)` for `c > 0`) up to
    the first conv/linear layers with a bias. Where every path ends at such layers, it
    measures each calibration sample's largest magnitude and compares the median sample with
    the loudest: the median sample uses `log2(max / median)` bits fewer than the activation
    has, never more than its bits: those QL203 counts for the same backend (the level count
    the trial measured, else the qconfig's; 7 for x86's `reduce_range`, 8 for qnnpack).
    It fires when that ratio reaches `min_spread`.

    ## Why is this bad?
    Static quantization gives each tensor one scale, set by the loudest calibration samples.
    Raw audio, sensor readings or unnormalized images whose loudness varies 100x leave the
    quiet samples a few of the 256 levels in every quantized op of the front end, and their
    outputs lose most of their precision. Because the front end scales with the input, it
    can run on the input divided by each sample's own maximum `s`, and the first biased
    layer's output is restored exactly: `conv(front(x)) = s·(conv(front(x/s)) − b) + b`. The
    quantized ops then see every sample at full scale; the division and the restoring
    arithmetic stay float.

    ## Example
    ```python
    # raw waveforms of very different loudness into a bias-free STFT conv
    spectrum = stft_conv(x)            # bias=False
    magnitude = torch.sqrt(spectrum[:, :k] ** 2 + spectrum[:, k:] ** 2)
    y = conv1(magnitude)               # the first layer with a bias
    ```

    ## Use instead
    The suggested `normalize_input` rewrite (applied by `qlint verify`, `plan.quantize()` and
    `qlint quantize`), or the same by hand:
    ```python
    s = x.abs().flatten(1).amax(dim=1).clamp_min(1e-30)        # kept float
    magnitude = front_end(x / s[:, None])
    y = s[:, None, None] * (conv1(magnitude) - b) + b           # kept float
    ```

    ## Options
    - `min_spread`: the ratio of the loudest sample's maximum to the median sample's at which the rule fires.

    ## References
    - Nagel et al., "A White Paper on Neural Network Quantization" (2021), section 2: range setting
    - https://pytorch.org/docs/stable/quantization.html
    """

    code = "QL204"
    name = "input-scale-spread"
    summary = "A model input's scale varies so much per sample that one int8 scale starves most samples."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG, Need.STATISTICS, Need.MODEL})

    class Options(RuleOptions):
        min_spread: float = Field(4.0, gt=1, description="max / median per-sample magnitude at which the rule fires.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding | LayerRow]:
        model = ctx.traced_model()
        if model is None:
            return
        batches = ctx.data_batches()
        placeholders = [str(n.target) for n in model.graph.nodes if n.op == "placeholder"]
        for candidate in find_normalizable_inputs(model):
            quantized = [node for node in _layer_nodes(ctx, candidate) if node.is_quantized]
            if not quantized:
                continue
            spread = measure(batches, placeholders.index(candidate.placeholder), candidate.placeholder)
            if spread is None:
                continue
            # The quantized ops up to the ending layers have the bits of their input observers; the
            # fewest of them is what the median sample can lose at most.
            bits = min(
                activation_bits(node, measured_input(ctx, node), ctx.graph.exported, ctx.backend.name)
                for node in quantized
            )
            flagged = spread.ratio >= self.options.min_spread
            if flagged:
                yield self._finding(candidate, spread, bits)
            yield LayerRow(
                name=candidate.placeholder,
                kind="input",
                rule=self.code,
                statistic="max / median sample magnitude",
                value=spread.ratio,
                verdict=f"median sample loses {spread.bits_lost(bits):.1f} of {bits} bits"
                + (" (flagged)" if flagged else ""),
            )

    def _finding(self, candidate: Candidate, spread: SampleSpread, bits: int) -> Finding:
        layers = ", ".join(candidate.layers)
        message = (
            f"the samples of input {candidate.placeholder!r} differ in scale: the loudest reaches "
            f"{spread.largest:.4g}, the median {spread.median:.4g} and the quietest {spread.smallest:.4g} "
            f"({spread.samples} calibration samples"
            + (f", {spread.silent} silent ones left out" if spread.silent else "")
            + "). One int8 scale costs the median sample "
            f"{spread.bits_lost(bits):.1f} of its {bits} bits in every quantized op up to {layers}. "
            f"Divide the input by each sample's maximum and restore {layers}'s output (exact in float): "
            "the normalize_input rewrite."
        )
        return self.finding(
            candidate.placeholder,
            message,
            data={
                "kind": "input-scale-spread",
                "input": candidate.placeholder,
                "ends": candidate.layers,
                "samples": spread.samples,
                "largest": spread.largest,
                "median": spread.median,
                "smallest": spread.smallest,
                "silent_samples": spread.silent,
                "ratio": spread.ratio,
                "bits_lost": spread.bits_lost(bits),
                "dtype_bits": bits,
            },
            suggestion={"action": "normalize_input", "input": candidate.placeholder, "modules": candidate.layers},
        )


def _layer_nodes(ctx: LintContext, candidate: Candidate) -> list[Any]:
    return [node for fqn in candidate.layers for node in ctx.graph.call_sites(fqn)]


@dataclasses.dataclass(frozen=True)
class SampleSpread:
    samples: int  # samples that are not silent
    largest: float
    median: float
    smallest: float
    silent: int  # all-zero samples, left out

    @property
    def ratio(self) -> float:
        return self.largest / self.median  # measure() leaves silent samples out: the median is > 0

    def bits_lost(self, bits: int) -> float:
        """Levels the median sample does not reach, in bits: never more than the ``bits`` the
        activation has."""
        return physical_bits(math.log2(self.ratio), bits)


def measure(batches: Sequence[Any], position: int, name: str) -> SampleSpread | None:
    """Each sample's largest magnitude of one input over ``batches`` (one number per sample:
    the input itself is never kept). Silent samples (all zeros) lose nothing to any scale and
    are left out of the spread. None where there is no spread to measure: fewer than two
    samples that are not silent, or a sample holding NaN or Inf (it has no scale; QL203
    reports non-finite values)."""
    magnitudes: list[float] = []
    for batch in batches:
        args, kwargs = as_call(batch)
        value = args[position] if position < len(args) else kwargs.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or not value.is_floating_point():
            return None
        magnitudes += value.detach().abs().flatten(1).amax(dim=1).tolist()
    if not all(math.isfinite(magnitude) for magnitude in magnitudes):
        return None
    audible = [magnitude for magnitude in magnitudes if magnitude > 0]
    if len(audible) < 2:
        return None
    return SampleSpread(
        len(audible), max(audible), statistics.median(audible), min(audible), len(magnitudes) - len(audible)
    )


class _SpectrumFrontEnd(nn.Module):
    """A bias-free STFT-like conv, magnitude, then a biased conv: an audio model's front end."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.stft = nn.Conv1d(1, 16, kernel_size=16, stride=8, bias=False)
        self.conv = nn.Conv1d(8, 8, kernel_size=3, padding=1)
        self.head = nn.Conv1d(8, 1, kernel_size=1)
        with torch.no_grad():
            for layer in (self.stft, self.conv, self.head):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.3)
                if layer.bias is not None:
                    layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = self.stft(x.unsqueeze(1))
        magnitude = torch.sqrt(spectrum[:, :8] ** 2 + spectrum[:, 8:] ** 2)
        return self.head(torch.relu(self.conv(magnitude)))


class _SquashedFrontEnd(_SpectrumFrontEnd):
    """The same layers with a tanh first: nothing before the biased conv scales with the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.tanh(x))


def _image_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3))


def _images(count: int = 6) -> list[torch.Tensor]:
    """Unnormalized images whose exposure varies 1000x from one to the next."""
    generator = torch.Generator().manual_seed(2)
    return [
        torch.rand(4, 3, 12, 12, generator=generator) * 10.0 ** (-3 * torch.rand(4, 1, 1, 1, generator=generator))
        for _ in range(count)
    ]


def _waveforms(loudness_decades: float):
    def batches(count: int = 6) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        out = []
        for _ in range(count):
            gain = 10.0 ** (torch.rand(8, 1, generator=generator) * loudness_decades - loudness_decades)
            out.append(torch.randn(8, 256, generator=generator) * gain)
        return out

    return batches


def _example_input() -> tuple[torch.Tensor, ...]:
    return (_waveforms(3.0)(1)[0],)


def _mapping():
    return get_default_qconfig_mapping("x86")


VALID = (
    Example("waveforms of one loudness", _SpectrumFrontEnd, _example_input, _mapping, calibration=_waveforms(0.1)),
    Example(
        "a tanh before the first biased layer: no float-exact normalization exists",
        _SquashedFrontEnd,
        _example_input,
        _mapping,
        calibration=_waveforms(3.0),
    ),
)
INVALID = (
    Example(
        "waveforms whose loudness spans three decades",
        _SpectrumFrontEnd,
        _example_input,
        _mapping,
        calibration=_waveforms(3.0),
        flagged=("x",),
    ),
    Example(
        "unnormalized images whose exposure spans three decades",
        _image_net,
        lambda: (_images(1)[0],),
        _mapping,
        calibration=_images,
        flagged=("input",),
    ),
)
