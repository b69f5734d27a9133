"""QL105's search for the failing node: where in the traceback, or by re-running the graph node by node."""

from __future__ import annotations

import traceback
from typing import Any

import torch.fx as fx
import torch.nn as nn

from qlint.core.preserve import cloned


class _Locator(fx.Interpreter):
    """Runs a GraphModule node by node and remembers the first node that raises."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.failed: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except Exception:
            if self.failed is None:
                self.failed = n
            raise


def _describe_node(gm: fx.GraphModule, node: fx.Node) -> dict[str, Any]:
    where: dict[str, Any] = {"node": node.name, "op": node.op, "target": _target_text(node.target)}
    if node.op == "call_module":
        where["module"] = str(node.target)
        try:
            where["module_type"] = type(gm.get_submodule(str(node.target))).__name__
        except AttributeError:
            pass
    stack = node.meta.get("nn_module_stack") if isinstance(node.meta, dict) else None
    if stack and "module" not in where:
        owner = list(stack.values())[-1]
        if isinstance(owner, tuple) and owner and owner[0]:
            where["module"] = str(owner[0])
    return where


def _target_text(target: Any) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or repr(target)
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module and not str(name).startswith(module) else str(name)


def locate_by_running(gm: Any, inputs: tuple[Any, ...]) -> tuple[dict[str, Any] | None, fx.Node | None]:
    if not isinstance(gm, fx.GraphModule):
        return None, None
    locator = _Locator(gm)
    try:
        locator.run(*cloned(inputs))
    except Exception:
        pass
    if locator.failed is None:
        return None, None
    return _describe_node(gm, locator.failed), locator.failed


def locate_in_traceback(error: BaseException, modules: dict[int, str]) -> dict[str, Any] | None:
    """The innermost traceback frame holding an fx Node or one of the model's modules."""
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, nn.Module) and id(value) in modules:
                return {"module": modules[id(value)], "module_type": type(value).__name__}
            if isinstance(value, fx.Node):
                where = {"node": value.name, "op": value.op, "target": _target_text(value.target)}
                if value.op == "call_module":
                    where["module"] = str(value.target)
                return where
    return None
