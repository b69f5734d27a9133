"""Activation observer choices per module for the pt2e flow: a quantizer that wraps torchao's
X86InductorQuantizer and changes the observers of chosen modules' activations.

X86InductorQuantizer picks its observers itself (a histogram search for activations); its
per-module settings only switch quantization on, off or to dynamic. A lint fix that clips an
activation (QL203's percentile observer) or uses another observer kind has to change the
annotation itself: after X86InductorQuantizer annotated the graph, every per-tensor
activation spec of a chosen module's ops (their input edges and outputs, and the observed
output of an op feeding them, such as a max-pool), and of the edges its output feeds into
other ops, gets the chosen observer. dtype, range and scheme stay the
quantizer's: pt2e expresses the observer choice, the number format is X86InductorQuantizer's.

Needs torchao (the extra ``qlint[pt2e]``): import this module only after
:func:`qlint.measure.pt2e_trial.import_torchao` succeeded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver
from torchao.quantization.pt2e import observer as pt2e_observer
from torchao.quantization.pt2e.quantizer import (
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
    get_module_name_filter,
)

from qlint.stats.band import PercentileBand

_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
_ANNOTATION = "quantization_annotation"  # the node.meta key pt2e quantizers annotate under
_MAX_SHARED_HOPS = 32  # shared specs form chains (max-pool → its input); a cycle would be a quantizer bug


class Pt2ePercentileObserver(PercentileBand, pt2e_observer.MinMaxObserver):
    """The pt2e twin of :class:`qlint.linter.mapping.PercentileObserver`: a MinMaxObserver whose
    range is the widest [100-p, p] percentile band of any batch, so rare spikes saturate."""


_NUMBER_FORMAT = ("dtype", "qscheme", "quant_min", "quant_max")


def observer_choice(observer: nn.Module, planned: nn.Module, base: QuantizationSpec) -> QuantizationSpec | None:
    """``base`` (the quantizer's activation spec) observed as the torch.ao ``observer`` observes:
    percentile band, histogram search, min/max or moving-average min/max with its parameters.

    None when ``observer`` quantizes to another number format than ``planned`` (the activation
    observer it replaces), or is of another kind (fixed qparams, placeholder, per-channel,
    dynamic): the number format stays the quantizer's, so such a choice is not expressed."""
    if any(getattr(observer, name, None) != getattr(planned, name, None) for name in _NUMBER_FORMAT):
        return None
    if getattr(observer, "is_dynamic", False) or getattr(observer, "qscheme", None) not in _PER_TENSOR:
        return None
    eps = float(getattr(observer, "eps", torch.finfo(torch.float32).eps))
    percentile = getattr(observer, "percentile", None)
    if isinstance(observer, MinMaxObserver) and isinstance(percentile, float):
        constructor = Pt2ePercentileObserver.with_args(percentile=percentile, eps=eps)
    elif isinstance(observer, MovingAverageMinMaxObserver):
        constructor = pt2e_observer.MovingAverageMinMaxObserver.with_args(
            averaging_constant=observer.averaging_constant, eps=eps
        )
    elif type(observer) is MinMaxObserver:
        constructor = pt2e_observer.MinMaxObserver.with_args(eps=eps)
    elif isinstance(observer, HistogramObserver):
        constructor = pt2e_observer.HistogramObserver.with_args(bins=observer.bins, eps=eps)
    else:
        return None
    return dataclasses.replace(base, observer_or_fake_quant_ctr=constructor)


def _replaceable(spec: Any) -> bool:
    """An activation's own per-tensor static spec (not a weight's, not shared with another edge)."""
    return isinstance(spec, QuantizationSpec) and not spec.is_dynamic and spec.qscheme in _PER_TENSOR


def _choose_shared_root(source: fx.Node, chosen: QuantizationSpec) -> None:
    """Give ``chosen`` to the spec that the observed output of ``source`` shares (itself, or the
    edge or output its SharedQuantizationSpec points to, followed to the end)."""
    annotation = source.meta.get(_ANNOTATION)
    if annotation is None:
        return
    owner: tuple[Any, fx.Node | None] = (annotation, None)  # (annotation, input node; None: its output)
    spec = annotation.output_qspec
    for _ in range(_MAX_SHARED_HOPS):
        if not isinstance(spec, SharedQuantizationSpec):
            break
        target = spec.edge_or_node
        if isinstance(target, tuple):  # an edge (arg, user): the user's spec for that input
            arg, user = target
            found = user.meta.get(_ANNOTATION)
            owner, spec = (found, arg), found.input_qspec_map.get(arg) if found is not None else None
        else:
            found = target.meta.get(_ANNOTATION)
            owner, spec = (found, None), found.output_qspec if found is not None else None
        if found is None:
            return
    if not _replaceable(spec):
        return
    annotation, arg = owner
    if arg is None:
        annotation.output_qspec = chosen
    else:
        annotation.input_qspec_map[arg] = chosen


class ActivationObservers(Quantizer):
    """``base`` with the observers of ``choices`` (module fqn → spec) in place of its own."""

    def __init__(self, base: Quantizer, choices: Mapping[str, QuantizationSpec]) -> None:
        super().__init__()
        self.base = base
        # innermost modules first: a node in several chosen modules gets the nearest one's choice
        ordered = sorted(choices.items(), key=lambda item: item[0].count("."), reverse=True)
        self._filters = [(get_module_name_filter(fqn), spec) for fqn, spec in ordered]

    def _choice(self, node: fx.Node) -> QuantizationSpec | None:
        return next((spec for in_module, spec in self._filters if in_module(node)), None)

    def transform_for_annotation(self, model: fx.GraphModule) -> fx.GraphModule:
        return self.base.transform_for_annotation(model)

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        model = self.base.annotate(model)
        for node in model.graph.nodes:
            annotation = node.meta.get(_ANNOTATION)
            if annotation is None:
                continue
            own = self._choice(node)
            for source, spec in list(annotation.input_qspec_map.items()):
                # the consumer's choice, else the producer's: its output is what this edge quantizes
                chosen = own if own is not None else self._choice(source)
                if chosen is None or source.op == "get_attr" or not _replaceable(spec):
                    continue
                annotation.input_qspec_map[source] = chosen
                # prepare_pt2e shares one observer among the edges and the output of one tensor
                # when their number formats agree (it does not compare observers): the observer
                # of a producer's observed output, followed through shared specs (a max-pool
                # shares its input's), is the one the edge gets, so it is the one to change
                _choose_shared_root(source, chosen)
            if own is not None and _replaceable(annotation.output_qspec):
                annotation.output_qspec = own
        return model

    def validate(self, model: fx.GraphModule) -> None:
        self.base.validate(model)
