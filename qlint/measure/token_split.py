"""Split a Linear's leading token off: a float-exact rewrite for a token that dwarfs the others.

In BERT-style encoders the first token ([CLS]) can carry activations 10-100x larger than
every other token. A Linear's input is quantized with one range per tensor (per call when
dynamic), so that one token sets the step for all the others. Because a Linear acts on the
last dimension only, it can run on the two parts separately and the outputs be joined::

    linear(x) = cat([linear(x.narrow(1, 0, 1)), linear(x.narrow(1, 1, T - 1))], dim=1)

The first part runs on a copy of the Linear (``<fqn>_qlint_token0``) that shares its weight
and bias, so that a dynamic Linear quantizes each part over its own range (under a static
mapping both parts share one observer: the rewrite is valid there, and gains nothing). The copy follows the original's
qconfig (``qlint_fanout_of``, as the fan-out copies do), and so do the ops the split adds
(:func:`split_ops_follow_linear`): the rewrite changes no decision.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import QConfigMapping

from qlint.core.intent import CallDescription, QConfigResolver
from qlint.errors import QlintError

KIND = "split_leading_token"
SUFFIX = "_qlint_token0"


def copy_name(fqn: str) -> str:
    return fqn.replace(".", "_") + SUFFIX


def _shared_copy(linear: nn.Linear, origin: str) -> nn.Linear:
    twin = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    twin.weight = linear.weight  # the same Parameter: no second copy of the weights in float
    twin.bias = linear.bias
    twin.qlint_fanout_of = origin  # type: ignore[assignment]  # read by fanout_follows_original
    return twin


def split_leading_token(gm: fx.GraphModule, fqn: str) -> None:
    """Apply the rewrite to the one call of Linear ``fqn`` in ``gm``, in place (recompile after)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == fqn]
    module = gm.get_submodule(fqn) if calls else None
    if len(calls) != 1 or not isinstance(module, nn.Linear):
        raise QlintError(f"{KIND}: {fqn} is not a Linear called once")
    node = calls[0]
    if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
        raise QlintError(f"{KIND}: {fqn} is not called on one tensor")
    source = node.args[0]
    name = copy_name(fqn)
    gm.add_submodule(name, _shared_copy(module, fqn))
    graph = gm.graph
    with graph.inserting_before(node):
        # torch.narrow, not x[:, :1]: prepare_fx treats narrow as sharing its input's observer,
        # so a quantized input stays valid (a getitem is read as a float op, and convert_fx
        # then quantizes its already quantized output a second time).
        lead = graph.call_function(torch.narrow, (source, 1, 0, 1))
        tokens = graph.call_method("size", (source, 1))
        rest = graph.call_function(torch.narrow, (source, 1, 1, graph.call_function(operator.sub, (tokens, 1))))
        lead_out = graph.call_module(name, (lead,))
    node.args = (rest,)
    users = list(node.users)
    with graph.inserting_after(node):
        joined = graph.call_function(torch.cat, ([lead_out, node],), {"dim": 1})
    for user in users:
        user.replace_input_with(node, joined)


def split_ops_follow_linear(mapping: QConfigMapping, gm: fx.GraphModule) -> None:
    """Give the two ``torch.narrow`` calls and the ``torch.cat`` of each split in ``gm`` the
    qconfig its Linear has in ``mapping`` (in place; ``mapping`` is for ``gm``), so that the
    split changes no decision.

    Those ops are functions called by the root module, so prepare_fx would give them the
    global qconfig, not the Linear's. A dynamic Linear's input was then quantized statically
    first, one range for every token again, and its output re-quantized by the cat: on
    MiniLM, six split dynamic Linears in an otherwise static plan measured 3.5 dB against
    7.6 dB unsplit (9.2 dB with their ops float, as a dynamic Linear's input and output are).
    A static Linear's input was observed with the global observer instead of the one its
    own qconfig names. Each op gets its qconfig by its index among the root's calls of its
    function, as prepare_fx counts them."""
    resolver = QConfigResolver(mapping)
    order: dict[fx.Node, tuple[Callable[..., Any], int]] = {}
    counts: dict[Callable[..., Any], int] = {}
    for node in gm.graph.nodes:
        for function in (torch.narrow, torch.cat):
            if node.op == "call_function" and node.target is function:
                order[node] = (function, counts.get(function, 0))
                counts[function] = order[node][1] + 1
    for node in gm.graph.nodes:
        parts = _split_parts(gm, node)
        if parts is None:
            continue
        fqn, added = parts
        linear = gm.get_submodule(fqn)
        qconfig, _ = resolver.resolve(CallDescription(True, (type(linear),), fqn, None))
        if qconfig is not None and bool(getattr(qconfig.activation(), "is_dynamic", False)):
            qconfig = None
        for op in added:
            if op in order:
                function, index = order[op]
                mapping.set_module_name_object_type_order("", function, index, qconfig)


def _split_parts(gm: fx.GraphModule, node: fx.Node) -> tuple[str, list[fx.Node]] | None:
    """For the call of a split's first-token copy: the Linear's fqn and the ops the split
    added around it (both narrows, the cat); None for any other node."""
    if node.op != "call_module" or not str(node.target).endswith(SUFFIX):
        return None
    fqn = getattr(gm.get_submodule(str(node.target)), "qlint_fanout_of", None)
    joins = [user for user in node.users if user.op == "call_function" and user.target is torch.cat]
    if not isinstance(fqn, str) or len(joins) != 1 or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    (join,) = joins
    parts = join.args[0] if join.args else None
    rest_call = parts[1] if isinstance(parts, (list, tuple)) and len(parts) == 2 else None
    rest = rest_call.args[0] if isinstance(rest_call, fx.Node) and rest_call.args else None
    added = [node.args[0], join] + ([rest] if isinstance(rest, fx.Node) else [])
    return fqn, added
