"""Activation qparams a trial already calibrated, reused by the next trials of the same float model.

A fix trial changes a few qconfigs of the model the lint trial quantized and calibrates on the
same batches. Post-training calibration runs the float model, so an observer of the same
tensor (the same producing node) with the same configuration sees the same values and ends
with the same scale and zero point. Calibrating it again repeats torch's most costly work
(HistogramObserver's ``histc`` per batch, and its qparam search at ``convert_fx``): on
EfficientNet-Lite0 more than half of a fix trial's time.

:class:`CalibratedQParams` records, from a calibrated prepared model, each per-tensor activation
observer's qparams by (producing node, observer configuration). In a freshly prepared model of
the same float graph, :meth:`CalibratedQParams.reuse` swaps every observer with a recorded match
for a ``FixedQParamsObserver`` holding those very qparams (the same tensors): calibration then
feeds only the observers the new mapping changed, and ``convert_fx`` reads the same numbers it
would have computed. Only a bench whose float model does not change may reuse them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization.observer import FixedQParamsObserver, ObserverBase, UniformQuantizationObserverBase

_PER_TENSOR = (torch.per_tensor_affine, torch.per_tensor_symmetric)
# Observer attributes that are settings (numbers, flags, dtypes), not calibrated state (buffers).
_SETTING_TYPES = (bool, int, float, str, torch.dtype, torch.qscheme, type(None))

ObserverKey = tuple[tuple[str, ...], str, tuple[tuple[str, Any], ...]]


def _observers(prepared: fx.GraphModule) -> list[tuple[ObserverKey, UniformQuantizationObserverBase]]:
    """The per-tensor activation observers of a prepared model, each with its key: the nodes
    producing what it observes (an observer module called at several nodes sees all their
    tensors), its class and its settings."""
    # Every name: torch registers one observer under several names where an op's output shares
    # its input's qparams, and named_modules() would list it under the first name only.
    modules = dict(prepared.named_modules(remove_duplicate=False))
    producers: dict[int, list[str]] = {}
    observers: dict[int, UniformQuantizationObserverBase] = {}
    for node in prepared.graph.nodes:
        if node.op != "call_module" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        observer = modules.get(str(node.target))
        if not isinstance(observer, UniformQuantizationObserverBase) or isinstance(observer, FixedQParamsObserver):
            continue
        if observer.qscheme not in _PER_TENSOR or getattr(observer, "is_dynamic", False):
            continue
        producers.setdefault(id(observer), []).append(_producer(node.args[0], modules).name)
        observers[id(observer)] = observer
    found: list[tuple[ObserverKey, UniformQuantizationObserverBase]] = []
    for identity, observer in observers.items():
        public = {name: value for name, value in vars(observer).items() if not name.startswith("_")}
        if not all(isinstance(value, _SETTING_TYPES) for value in public.values()):
            continue  # a setting qlint cannot compare (a list, a tensor attribute): never reused
        settings = tuple(sorted((name, value) for name, value in public.items() if name != "training"))
        found.append(((tuple(producers[identity]), type(observer).__qualname__, settings), observer))
    return found


def _producer(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node:
    """The node that computes the tensor ``node`` carries: an observer's node passes its input
    on, and observer nodes are numbered in insertion order, so their names differ between
    mappings while the original nodes' names do not."""
    while (
        node.op == "call_module"
        and isinstance(modules.get(str(node.target)), ObserverBase)
        and node.args
        and isinstance(node.args[0], fx.Node)
    ):
        node = node.args[0]
    return node


class CalibratedQParams:
    """Scale and zero point of the per-tensor activation observers one float model's trials calibrated.

    In a trial: :meth:`reuse` after prepare_fx (matched observers are not calibrated again),
    then after calibration :meth:`record` (the observers calibrated this time) and :meth:`reuse`
    again (convert_fx then reads the recorded qparams instead of searching them a second time)."""

    def __init__(self) -> None:
        self._qparams: dict[ObserverKey, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._qparams)

    def record(self, prepared: fx.GraphModule) -> None:
        """Add the qparams of the calibrated observers of ``prepared`` not recorded yet."""
        for key, observer in _observers(prepared):
            if key in self._qparams:
                continue
            scale, zero_point = observer.calculate_qparams()
            if scale.numel() == 1 and bool(torch.isfinite(scale).all()):
                self._qparams[key] = (scale.detach().clone(), zero_point.detach().clone())

    def reuse(self, prepared: fx.GraphModule) -> int:
        """Swap every observer of ``prepared`` whose qparams are recorded for a fixed observer of
        them; returns how many observers were swapped."""
        replaced: dict[int, FixedQParamsObserver] = {}
        for key, observer in _observers(prepared):
            recorded = self._qparams.get(key)
            if recorded is not None and id(observer) not in replaced:
                replaced[id(observer)] = _fixed(observer, *recorded)
        if replaced:
            # An observer module may be called at several nodes (torch shares one between an op's
            # input and output): every attribute that names it gets the same fixed observer.
            for name, module in list(prepared.named_modules(remove_duplicate=False)):
                fixed = replaced.get(id(module))
                if fixed is not None:
                    parent, _, attribute = name.rpartition(".")
                    setattr(prepared.get_submodule(parent) if parent else prepared, attribute, fixed)
        return len(replaced)


def _fixed(observer: Any, scale: torch.Tensor, zero_point: torch.Tensor) -> FixedQParamsObserver:
    fixed = FixedQParamsObserver(
        float(scale),
        int(zero_point),
        dtype=observer.dtype,
        qscheme=observer.qscheme,
        quant_min=observer.quant_min,
        quant_max=observer.quant_max,
    )
    # The very tensors the calibrated observer returned (dtype included), so convert_fx reads
    # exactly what it would have computed.
    fixed.scale, fixed.zero_point = scale.clone(), zero_point.clone()
    return fixed
