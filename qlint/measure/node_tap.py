"""Running a traced model node by node, and naming the model that raised.

:class:`NodeTap` reads (and may replace) chosen node outputs and runs chosen submodule calls
differently without touching the modules; :func:`blamed_on` turns what the user's model raises
on their data into one line that says which model it was. :mod:`qlint.measure.capture` runs
the float model and its quantized counterpart with both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from qlint.errors import ModelRunError, QlintError


class NodeTap(torch.fx.Interpreter):
    """Runs a GraphModule node by node, reporting selected node outputs.

    A callback may return a replacement for the node's value (see
    ``PairedRunner._keep_float_output``).  ``module_overrides`` replace the call
    of a submodule (by fqn): used to run prepared models with frozen fake-quant
    instead of their observers, and PTQ layers with fake-quantized weights,
    without touching the modules.
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule,
        callbacks: dict[str, Callable[[Any], Any]],
        module_overrides: dict[str, Callable[..., Any]] | None = None,
    ):
        super().__init__(graph_module, garbage_collect_values=True)
        self.callbacks = callbacks
        self.module_overrides = module_overrides or {}
        self.placeholders = [node.target for node in graph_module.graph.nodes if node.op == "placeholder"]

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        override = self.module_overrides.get(str(target))
        if override is not None:
            return override(args, kwargs)
        return super().call_module(target, args, kwargs)

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        callback = self.callbacks.get(node.name)
        if callback is not None:
            replacement = callback(result)
            if replacement is not None:
                return replacement
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            positional = list(args) + [kwargs[name] for name in self.placeholders[len(args) :] if name in kwargs]
            return self.run(*positional)
        return self.run(*args)


@contextlib.contextmanager
def blamed_on(which: str) -> Iterator[None]:
    """A model that raises on the user's data is the user's problem to see in one line, not
    an internal error (torch's message usually names the fix, e.g. .view -> .reshape)."""
    try:
        yield
    except QlintError:
        raise
    except Exception as error:  # whatever the model's own code raises
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ModelRunError(f"{which} raised {type(error).__name__} on the data: {first}") from error
