"""QL101's fixed saturating ranges for chains that end in a clip the backend does not fuse: where
the data reaches the clip, the range's qparams, and the trials that measure each range group."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import torch
import torch.nn as nn
from torch.ao.quantization import QConfig
from torch.ao.quantization.observer import FixedQParamsObserver

from qlint.core.batches import call_model
from qlint.core.graph import OpNode
from qlint.core.sqnr import BatchPowers
from qlint.linter.context import LintContext
from qlint.linter.findings import Impact
from qlint.linter.suggestions import Provenance, Rewrite, Suggestions, backend_defaults
from qlint.measure.rewrite import apply_rewrites
from qlint.measure.trial import ActivationError


def chain_end_activation(ctx: LintContext, chain: list[OpNode]) -> ActivationError | None:
    """The trial's rounding error where the chain hands its value to the clamp. Fusion renames
    it: a conv → BN pair folds into one module named after the conv, so the last chain node the
    trial observed is the one that stands for the chain's end."""
    if ctx.trial is None:
        return None
    return next((found for node in reversed(chain) if (found := ctx.trial.activation(node.name)) is not None), None)


def saturating_ranges(
    ctx: LintContext, clamps: list[tuple[list[OpNode], tuple[str, ...], OpNode]]
) -> list[tuple[tuple[float, float] | None, bool]]:
    """Per chain, the fixed range [0, clip] whose int8 saturation computes its clamp exactly, from
    one float pass over the trial's calibration batches (the example inputs without one), and
    whether the conv's input needs an op of its own to be quantized.

    The range is None where the values never reach the clip: a fixed range would only waste
    levels there. FX quantizes a conv's input with the conv's own qconfig when no quantized op
    produced it (a model input, or an op the backend leaves float such as a pad); such a conv
    gets the observe_input rewrite, so that the fixed range is its output's alone."""
    if ctx.trial_bench is not None:
        batches = list(ctx.trial_bench.calibration)
    else:
        batches = [tuple(ctx.example_inputs)] if ctx.example_inputs else []
    if ctx.model_factory is None or not batches:
        return [(None, False)] * len(clamps)
    model = ctx.model_factory().eval()
    highest: dict[str, float] = {}

    def watch(fqn: str) -> None:
        def record(_module: nn.Module, args: tuple[Any, ...], _output: Any) -> None:
            highest[fqn] = max(highest.get(fqn, float("-inf")), float(args[0].max()))

        model.get_submodule(fqn).register_forward_hook(record)

    own_input: list[bool] = []
    for chain, _, clamp in clamps:
        watch(str(clamp.module))
        producers = ctx.graph.producers(chain[0].name)
        own_input.append(not (producers and producers[0].op != "input" and ctx.backend.supports(producers[0].kind)))
    with torch.no_grad():
        for batch in batches:  # a tensor, a tuple of arguments or a mapping of keyword arguments
            call_model(model, batch)
    ranges: list[tuple[tuple[float, float] | None, bool]] = []
    for (_, _, clamp), observe in zip(clamps, own_input, strict=True):
        high = 6.0
        if clamp.kind == "hardtanh":
            high = float(getattr(model.get_submodule(str(clamp.module)), "max_val", 6.0))
        reached = highest.get(str(clamp.module), 0.0) >= high
        ranges.append(((0.0, round(high, 4)), observe) if reached else (None, False))
    return ranges


@dataclasses.dataclass(frozen=True)
class _Fixed:
    scale: float
    zero_point: int
    quant_min: int
    quant_max: int

    def qconfig(self, weight: Any) -> QConfig:
        observer = FixedQParamsObserver.with_args(
            scale=self.scale,
            zero_point=self.zero_point,
            dtype=torch.quint8,
            quant_min=self.quant_min,
            quant_max=self.quant_max,
        )
        return QConfig(activation=observer, weight=weight)


def fixed_activation(ctx: LintContext, clip: tuple[float, float]) -> _Fixed:
    """quint8 qparams for ``clip`` at the levels of the plan's activations on this backend (7
    bits where x86 reduces them): a fixed range feeds the next conv like any activation, so it
    has no more levels than they have (``Suggestions.with_fixed_ranges_at_activation_bits``
    moves it with them when verify gives them 8)."""
    quant_min, quant_max = backend_defaults(ctx.backend.name)[0].quant_range()
    scale = (clip[1] - clip[0]) / (quant_max - quant_min)
    return _Fixed(scale=scale, zero_point=quant_min + round(-clip[0] / scale), quant_min=quant_min, quant_max=quant_max)


class RangeMeter:
    """Measures each group of fixed ranges as the gain of adding it to all the other groups.

    The groups work together (a wide stem output ruins what the later ranges save), so each
    finding's impact is measured with every other group applied: one trial for all groups and one
    for each group left out. Functional chains are measured after the fold rewrite, so that the
    gain is the ranges' own and not the fold's."""

    def __init__(
        self,
        ctx: LintContext,
        groups: list[tuple[_Fixed, list[str]]],
        functional: list[list[OpNode]],
        observed: list[str],
    ):
        self.ctx, self.groups = ctx, groups
        self.bench = ctx.trial_bench
        if self.bench is not None and (functional or observed):
            example, original = ctx.example_inputs or (), self.bench.model_factory
            provenance = [Provenance(rule="QL101")]
            asked = (
                Suggestions(rewrites=[Rewrite(kind="observe_input", modules=observed, provenance=provenance)])
                if observed
                else None
            )
            kinds = ["fold_bn_into_functional_conv"] * bool(functional) + ["observe_input"] * bool(observed)

            @functools.cache
            def rewritten_once() -> nn.Module:  # rewriting checks float outputs: once, not per trial
                return apply_rewrites(original(), asked, example, kinds=kinds)[0]

            self.bench = self.bench.variant(lambda: copy.deepcopy(rewritten_once()))
        self.functional, self.rewritten = bool(functional), bool(functional or observed)
        self._all: BatchPowers | None = None

    def _powers(self, groups: list[tuple[_Fixed, list[str]]]) -> BatchPowers | None:
        """The output's per-batch powers with ``groups`` fixed; None when no trial can tell."""
        mapping = self.ctx.qconfig_mapping
        if self.bench is None or mapping is None or self.ctx.trial is None or self.ctx.trial.output_powers is None:
            return None
        if not groups and not self.rewritten:
            return self.ctx.trial.output_powers  # the lint trial already measured the intended mapping
        mapping = copy.deepcopy(mapping)
        weight = mapping.global_qconfig.weight if mapping.global_qconfig is not None else None
        for fixed, targets in groups:
            for fqn in targets:
                mapping.set_module_name(fqn, fixed.qconfig(weight))
        return self.bench.output_powers(mapping)

    def impact(self, targets: list[str]) -> Impact | None:
        if self._all is None:
            self._all = self._powers(self.groups)
        others = [g for g in self.groups if g[1] != targets]
        base = self._powers(others)
        if base is None or self._all is None:
            return None
        detail = "fixed saturating range on every listed conv in one trial"
        if others:
            detail += f", with the {len(others)} other fixed-range group(s) applied in both"
        if self.functional:
            detail += ", both models with the functional conv → BN folds applied"
        if self.rewritten and not self.functional:
            detail += ", both models with the convs' inputs given ops of their own"
        return Impact.between(base, self._all, "rule-trial", detail)
