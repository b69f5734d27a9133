"""Per-layer activation SQNR of a quantized model against its float-with-observers twin, by
module fqn: what verify's per-layer table shows."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from qlint.core.nested import first_float
from qlint.core.sqnr import SqnrSums


def compare_layer_outputs(
    reference_model: nn.Module,
    quantized_model: nn.Module,
    fqns: Sequence[str],
    batches: Sequence[Any],
    run: Callable[[nn.Module, Any], Any],
    scales: Mapping[str, tuple[torch.Tensor, int]],
) -> dict[str, float]:
    """Activation SQNR per module fqn: ``reference_model``'s outputs vs ``quantized_model``'s.

    The reference pass keeps a copy of each layer's output (in-place ops downstream, such as
    ReLU6(inplace=True), change the output tensor itself); the quantized pass compares each
    output the moment it is made and drops the copy, so at most one batch's outputs are held.
    A layer in ``scales`` (equalization multiplied its output channels: the factor per channel
    and the channel dim) is compared with both outputs divided back, as the original model
    computes it, where a channel scaled x1e4 to be dropped weighs what the next layer gives it.
    A layer whose outputs hold NaN or Inf has no SQNR and no entry."""
    sums: dict[str, SqnrSums] = {}
    captured: dict[str, torch.Tensor] = {}

    def unscaled(value: torch.Tensor, fqn: str) -> torch.Tensor:
        if fqn not in scales:
            return value
        scale, dim = scales[fqn]
        shape = [1] * value.dim()
        shape[dim] = -1
        value = value.dequantize() if value.is_quantized else value
        return value.double() / scale.reshape(shape)

    def keep(_m: nn.Module, _i: Any, output: Any, fqn: str) -> None:
        value = first_float(output)
        if value is not None:
            captured[fqn] = unscaled(value.clone(), fqn)

    def compare(_m: nn.Module, _i: Any, output: Any, fqn: str) -> None:
        reference, value = captured.pop(fqn, None), first_float(output)
        if reference is not None and value is not None and reference.shape == value.shape:
            sums.setdefault(fqn, SqnrSums()).add(reference, unscaled(value, fqn))

    handles = []
    for model, hook in ((reference_model, keep), (quantized_model, compare)):
        for fqn in fqns:
            try:
                module = model.get_submodule(fqn)
            except AttributeError:
                continue
            handles.append(module.register_forward_hook(functools.partial(hook, fqn=fqn)))
    try:
        for batch in batches:
            captured.clear()
            run(reference_model, batch)
            run(quantized_model, batch)
    finally:
        captured.clear()
        for h in handles:
            h.remove()
    # A layer whose SQNR is undefined (NaN or Inf in an output) gets no entry: the table then
    # shows no number for it rather than a measured-looking 0 dB.
    measured = {fqn: s.sqnr_db() for fqn, s in sums.items()}
    return {fqn: round(value, 4) for fqn, value in measured.items() if value is not None}
