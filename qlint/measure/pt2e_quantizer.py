"""Activation observer choices per module for the pt2e flow: a quantizer that wraps torchao's
X86InductorQuantizer and changes the observers of chosen modules' activations.

X86InductorQuantizer picks its observers itself (a histogram search for activations); its
per-module settings only switch quantization on, off or to dynamic. A lint fix that clips an
activation (QL203's percentile observer) or uses another observer kind has to change the
annotation itself: after X86InductorQuantizer annotated the graph, every activation tensor a
chosen module's ops read gets the chosen observer. An observer belongs to a tensor, not to
one reader: prepare_pt2e shares one observer among a tensor's edges (and the observed output
they share, such as a max-pool's) whenever their number formats agree, so every reader of the
tensor gets it, as prepare_fx shares a producer's output observer. dtype, range and scheme
stay the quantizer's: pt2e expresses the observer choice, the number format is
X86InductorQuantizer's.

Needs torchao (the extra ``qlint[pt2e]``): import this module only after
:func:`qlint.measure.pt2e_trial.import_torchao` succeeded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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


@dataclasses.dataclass(frozen=True)
class ObserverChoice:
    """The observer of the activations one module's ops read."""

    module: str  # fqn, as nn_module_stack records it
    spec: QuantizationSpec


_NUMBER_FORMAT = ("dtype", "qscheme", "quant_min", "quant_max")


def observer_choice(
    module: str, observer: nn.Module, planned: nn.Module, base: QuantizationSpec
) -> ObserverChoice | None:
    """For ``module``: ``base`` (the quantizer's activation spec) observed as the torch.ao ``observer`` observes:
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
    return ObserverChoice(module, dataclasses.replace(base, observer_or_fake_quant_ctr=constructor))


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
    """``base`` with the observers of ``choices`` in place of its own."""

    def __init__(self, base: Quantizer, choices: Sequence[ObserverChoice]) -> None:
        super().__init__()
        self.base = base
        # innermost modules first: a node in several chosen modules gets the nearest one's choice
        ordered = sorted(choices, key=lambda choice: choice.module.count("."), reverse=True)
        self._filters = [(get_module_name_filter(choice.module), choice.spec) for choice in ordered]

    def _choice(self, node: fx.Node) -> QuantizationSpec | None:
        return next((spec for in_module, spec in self._filters if in_module(node)), None)

    def transform_for_annotation(self, model: fx.GraphModule) -> fx.GraphModule:
        return self.base.transform_for_annotation(model)

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        model = self.base.annotate(model)
        chosen: dict[fx.Node, QuantizationSpec] = {}  # producer → the observer of its output tensor
        for node in model.graph.nodes:
            annotation, own = node.meta.get(_ANNOTATION), self._choice(node)
            if annotation is None or own is None:
                continue
            for source, spec in annotation.input_qspec_map.items():
                if source.op != "get_attr" and _replaceable(spec):  # an activation, not a weight
                    chosen[source] = own
        for source, spec in chosen.items():
            # prepare_pt2e gives one tensor one observer when its edges' number formats agree (it
            # does not compare observers): every reader's edge, and the observed output the edges
            # share (a max-pool's, shared with its input), get the choice, or the first one found
            # would decide for all
            for reader in source.users:
                annotation = reader.meta.get(_ANNOTATION)
                if annotation is not None and _replaceable(annotation.input_qspec_map.get(source)):
                    annotation.input_qspec_map[source] = spec
            _choose_shared_root(source, spec)
        return model

    def validate(self, model: fx.GraphModule) -> None:
        self.base.validate(model)
