"""QL102 shared-module."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from pydantic import Field

from qlint.core.graph import ModelGraph, ModuleInfo
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Impact, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions

# Modules with no learned state whose reuse matters only where observers are per module.
_STATELESS_KINDS = frozenset(
    {
        "relu",
        "relu6",
        "identity",
        "dropout",
        "flatten",
        "max_pool",
        "avg_pool",
        "adaptive_avg_pool",
        "hardtanh",
        "leaky_relu",
    }
)
# Modules that live inside others and are called by their parent, not by the graph.
_INTERNAL_KINDS = frozenset({"observer"})
# Call sites named in a message; a module reused thousands of times would make it unreadable.
_LISTED_SITES = 10


class SharedModule(Rule):
    """Flags modules called at more than one call site, and modules never called.

    ## What it does
    Counts how often each module instance is called in the traced forward pass. A module
    called at several call sites is reported with its call count and the call sites; a
    module that is never called is reported as unused.

    ## Why is this bad?
    Quantization attaches observers and quantization parameters to a module. A module
    reused for different tensors (one `nn.ReLU` for two branches, one `nn.Linear` applied
    to queries and keys) gets one observer, and so one scale and zero point, for tensors
    with different ranges: the smaller tensor loses resolution and the larger one clips.
    In eager mode this is always true; in FX, weighted modules still share one converted
    module whose output qparams serve every call. Module-name qconfigs written for an unused
    module silently do nothing, and its parameters stay in the nn.Module, in an exported
    program's state_dict and in an eager-mode quantized model (FX conversion leaves it out).

    ## Example
    ```python
    def forward(self, x):
        a = self.act(self.conv1(x))
        return self.act(self.conv2(a))   # self.act used twice
    ```

    ## Use instead
    ```python
    def forward(self, x):
        a = self.act1(self.conv1(x))
        return self.act2(self.conv2(a))  # one module per call site
    ```

    ## Options
    - `report_unused`: report modules that are never called.
    - `report_stateless`: report reused stateless modules (ReLU, Dropout, pooling) too.

    ## References
    - https://pytorch.org/docs/stable/quantization.html#model-preparation-for-eager-mode-static-quantization
      ("do not reuse modules")
    """

    code = "QL102"
    name = "shared-module"
    summary = "A module is called at several call sites (one set of qparams) or never called."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH})

    class Options(RuleOptions):
        report_unused: bool = Field(True, description="Report modules that are never called.")
        report_stateless: bool = Field(True, description="Report reused stateless modules too.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        graph = ctx.graph
        yield from self._shared(ctx, graph)
        if self.options.report_unused:
            yield from self._unused(graph)

    def _shared(self, ctx: LintContext, graph: ModelGraph) -> Iterable[Finding]:
        calls: dict[str, list] = {}
        for node in graph.ops():
            if node.module is not None:
                calls.setdefault(node.module, []).append(node)
        for fqn, sites in calls.items():
            if len(sites) < 2:
                continue
            kind = sites[0].kind
            stateless = kind in _STATELESS_KINDS
            if stateless and not self.options.report_stateless:
                continue
            severity = Severity.INFO if stateless and not ctx.eager_flow else self.severity
            where = [f"{s.name} (in {s.scope or 'the top-level forward'})" for s in sites[:_LISTED_SITES]]
            if len(sites) > _LISTED_SITES:  # data["call_sites"] keeps them all; the message stays readable
                where.append(f"and {len(sites) - _LISTED_SITES} more")
            impact = (
                "one observer serves every call"
                if ctx.eager_flow or not stateless
                else "eager-mode flows would give every call one observer"
            )
            message = (
                f"module '{fqn}' ({kind}) is called {len(sites)} times: {', '.join(where)}. "
                f"Quantized, {impact}, so tensors with different ranges share one scale and "
                "zero point. Fix: give each call site its own module instance."
            )
            yield self.finding(
                fqn,
                message,
                severity=severity,
                data={
                    "kind": "multiple-calls",
                    "node": sites[0].name,
                    "calls": len(sites),
                    "call_sites": [s.name for s in sites],
                    "op_kind": kind,
                },
                suggestion={"action": "split_module", "module": fqn, "copies": len(sites)},
            )

    def _unused(self, graph: ModelGraph) -> Iterable[Finding]:
        used = _UsedModules(graph)
        for fqn, info in graph.modules.items():
            if not _candidate(info) or used.covers(fqn):
                continue
            message = (
                f"module '{fqn}' ({info.kind}) is never called in forward: qconfigs set for it by name have no "
                "effect. "
                + (
                    "Its parameters stay in the nn.Module, in an exported program's state_dict and in an "
                    "eager-mode quantized model (FX conversion leaves it out). "
                    if info.has_parameters
                    else ""
                )
                + "Fix: remove it, or call it where it was meant to be used (a forgotten "
                "QuantStub/DeQuantStub leaves tensors float)."
            )
            yield self.finding(
                fqn,
                message,
                severity=self.severity if info.has_parameters or info.kind.endswith("stub") else Severity.INFO,
                impact=_NOT_EXECUTED,
                data={
                    "kind": "never-called",
                    "node": None,
                    "module_type": info.type_name,
                    "has_parameters": info.has_parameters,
                },
                suggestion={"action": "remove_module", "module": fqn},
            )


# A module that never runs cannot change the int8 model's output: its impact is 0 dB by
# construction, so with a trial the finding is info (dead weight, not an accuracy problem).
_NOT_EXECUTED = Impact(db=0.0, basis="not-executed", detail="the module never runs in forward")


def _candidate(info: ModuleInfo) -> bool:
    if info.kind in _INTERNAL_KINDS:
        return False
    return info.is_leaf or info.has_parameters


class _UsedModules:
    """Which modules the traced forward uses, answered per module in time linear in its depth.

    A module is used when an op names it, or anything inside it, as the called module,
    the enclosing scope, the weight or the bias; or when it sits inside a module that is
    itself called as a leaf (weight_fake_quant inside a QAT conv, the parts of a fused
    ConvReLU2d run inside their parent). Every dotted prefix of every reference goes into
    one set up front, so the check is a set lookup per ancestor, never a scan of all
    references (which made this rule quadratic in the number of modules)."""

    def __init__(self, graph: ModelGraph) -> None:
        self._called: set[str] = set()  # modules called as leaves
        self._covered: set[str] = set()  # every referenced name and each of its dotted prefixes
        for node in graph.ops():
            if node.module:
                self._called.add(node.module)
            for ref in (node.module, node.scope, node.weight, node.bias):
                path = ref
                while path and path not in self._covered:
                    self._covered.add(path)
                    path = path.rpartition(".")[0]

    def covers(self, fqn: str) -> bool:
        if fqn in self._covered:
            return True
        parent = fqn.rpartition(".")[0]
        while parent:
            if parent in self._called:
                return True
            parent = parent.rpartition(".")[0]
        return False


# --- examples --------------------------------------------------------------------------


class _SharedRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv2(self.act(self.conv1(x))))


class _SharedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, q, k):
        return torch.matmul(self.proj(q), self.proj(k).transpose(-1, -2))


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.old_head = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


class _Distinct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = nn.ReLU()

    def forward(self, x):
        return self.act2(self.conv2(self.act1(self.conv1(x))))


class _FusedEager(nn.Module):
    """After fuse_modules, BN and ReLU are Identity placeholders that the fused conv replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.relu = nn.ReLU()
        torch.ao.quantization.fuse_modules(self.eval(), [["conv", "relu"]], inplace=True)

    def forward(self, x):
        return self.relu(self.conv(x))


def _image():
    return (torch.randn(2, 3, 16, 16),)


def _tokens():
    return (torch.randn(2, 5, 16), torch.randn(2, 5, 16))


VALID = (
    Example("one module per call site", lambda: _Distinct().eval(), _image),
    Example("fused conv-relu with its Identity placeholder", lambda: _FusedEager().eval(), _image),
)
INVALID = (
    Example("one ReLU reused after two convs", lambda: _SharedRelu().eval(), _image, flagged=("act",)),
    Example("one projection applied to queries and keys", lambda: _SharedLinear().eval(), _tokens, flagged=("proj",)),
    Example(
        "a head left over from an earlier version",
        lambda: _Unused().eval(),
        lambda: (torch.randn(2, 16),),
        flagged=("old_head",),
    ),
)
