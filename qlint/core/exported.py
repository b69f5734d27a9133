"""The module of an exported program (a ``.pt2``, ``ExportedProgram.module()``, convert_pt2e's
output): torch bakes its mode into the graph at export, and its ``eval()`` and ``train()`` raise.

Each batch norm and dropout op carries the mode as an argument (``training``/``train``). A
module exported in eval mode already runs as ``eval()`` asks; one exported in training mode
would update its batch norm statistics and drop activations at random on every batch."""

from __future__ import annotations

import torch
import torch.fx as fx

from qlint.errors import QlintError


class ExportedInTraining(QlintError):
    """An exported module whose graph runs in training mode, where inference is needed."""


def is_exported_module(module: object) -> bool:
    """The module of an exported program: torch gives it its own ``eval``/``train`` that raise."""
    return isinstance(module, fx.GraphModule) and "eval" in vars(module)


def training_mode_ops(module: fx.GraphModule) -> list[str]:
    """The ops of an exported graph that run in training mode (batch norm updating its
    statistics, dropout), by target name."""
    found = []
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        try:
            normalized = node.normalized_arguments(module, normalize_to_only_use_kwargs=True)
        except Exception:  # an op without a schema to normalize by: it has no mode argument either
            normalized = None
        if normalized is not None and any(normalized.kwargs.get(flag) is True for flag in ("training", "train")):
            found.append(str(node.target))
    return found


def put_in_eval(module: torch.nn.Module, name: str = "the model") -> None:
    """``module.eval()``; an exported module runs as it was exported, which must be eval mode.

    Raises :class:`ExportedInTraining` naming ``name`` for one exported in training mode."""
    if not isinstance(module, fx.GraphModule) or not is_exported_module(module):
        module.eval()
        return
    training = training_mode_ops(module)
    if training:
        shown = ", ".join(dict.fromkeys(training))
        raise ExportedInTraining(
            f"{name} was exported in training mode ({shown} with training=True): it is needed as it "
            "runs in inference; export it after model.eval()"
        )
