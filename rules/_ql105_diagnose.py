"""QL105's diagnosis of a failed trial step: the cause, why it fails, the fix and its suggestion."""

from __future__ import annotations

import re
from typing import Any

from qlint.linter.context import LintContext
from qlint.measure.pt2e_trial import refuses_repeated_call
from qlint.measure.trial import STAGE_CONVERT, STAGE_FLOAT, STAGE_PREPARE

CAUSE_VIEW = "view-non-contiguous"
CAUSE_NO_KERNEL = "no-quantized-kernel"
CAUSE_QCONFIG = "unsupported-qconfig"
CAUSE_CONTROL_FLOW = "control-flow"
CAUSE_DTYPE = "dtype-mismatch"
CAUSE_FUNCTIONAL_CONV_ARGUMENTS = "functional-conv-arguments"
CAUSE_FLOAT = "fails-in-float"
CAUSE_REPEATED_CALL = "module-called-twice"
CAUSE_UNKNOWN = "unknown"


def diagnose(
    ctx: LintContext, stage: str, error: BaseException, text: str, where: dict[str, Any]
) -> tuple[str, str, str, dict[str, Any] | None]:
    lowered = text.lower()
    node = where.get("node")
    module = where.get("module")
    if stage == STAGE_FLOAT:
        return (
            CAUSE_FLOAT,
            "the float model itself fails on the example inputs, so nothing can be quantized.",
            "fix the model or pass example inputs of the right shape and dtype.",
            None,
        )
    if refuses_repeated_call(stage, error):
        return (
            CAUSE_REPEATED_CALL,
            "a module called more than once: the pt2e quantizer takes the ops of all its calls as one "
            "partition, and its conv/linear patterns refuse a partition with several outputs.",
            "give each call a module of its own before torch.export (a copy of the module, same weights; "
            "the float model stays the same).",
            None,
        )
    if "view size is not compatible" in lowered or (where.get("target") == "view" and "stride" in lowered):
        return (
            CAUSE_VIEW,
            "`.view` on a quantized tensor that is not contiguous: quantized conv kernels return "
            "channels-last (NHWC) tensors, so a `.view` that works in float fails after convert_fx.",
            f"replace `.view(...)` (node {node!r}) with `.reshape(...)` or `torch.flatten(x, 1)` "
            "(or call `.contiguous()` first).",
            {"action": "view_to_reshape", "node": node or ctx.model_name},
        )
    if (
        "quantizedcpu" in lowered
        or "could not run 'quantized::" in lowered
        or ("not implemented" in lowered and "quantized" in lowered)
        or isinstance(error, NotImplementedError)
    ):
        op = where.get("target") or "this op"
        keep = f"mapping.set_module_name({module!r}, None)" if module else f"mapping.set_object_type({op}, None)"
        return (
            CAUSE_NO_KERNEL,
            f"{op} has no quantized kernel on {ctx.backend.name} (QuantizedCPU), yet receives a quantized "
            "tensor after convert_fx.",
            f"keep it in float: {keep} (convert_fx then dequantizes before it), or use a variant of the "
            "op that has a quantized kernel (e.g. bilinear/nearest instead of bicubic interpolation).",
            {"action": "keep_float", "module": module, "node": node, "function": op}
            if module
            else {"action": "keep_float_function", "node": node, "function": op},
        )
    if (
        "per channel" in lowered
        or "per-channel" in lowered
        or "qconfig" in lowered
        or (stage in (STAGE_PREPARE, STAGE_CONVERT) and module and isinstance(error, (AssertionError, ValueError)))
    ):
        return (
            CAUSE_QCONFIG,
            f"the qconfig for {module or node} asks for something its quantized module does not "
            "support" + (" (per-channel weights on a transposed convolution)." if "per channel" in lowered else "."),
            f"give {module or node} a supported qconfig (e.g. per-tensor weights: "
            "MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)) or keep "
            f"it float with mapping.set_module_name({(module or node)!r}, None).",
            {
                "action": "set_weight_observer",
                "targets": [module or node],
                "observer": "MinMaxObserver",
                "qscheme": "torch.per_tensor_symmetric",
                "dtype": "torch.qint8",
            }
            if "per channel" in lowered
            else {"action": "keep_float", "module": module or node},
        )
    if (
        "control flow" in lowered
        or "symbolically traced" in lowered
        or "proxy" in lowered
        or "data-dependent" in lowered
        or "guard" in lowered
    ):
        return (
            CAUSE_CONTROL_FLOW,
            "data- or shape-dependent Python (an `if`/loop or a Python call on a tensor's value or shape) "
            "that prepare_fx's tracer cannot turn into graph ops.",
            "move the branch out of forward, make it depend only on constructor arguments, or keep that "
            "submodule untraced with PrepareCustomConfig().set_non_traceable_module_names([...]) or wrap the "
            "helper with torch.fx.wrap.",
            None,
        )
    prepacked = re.search(r"quantized::(conv[123]d)_prepack\(\)", text)
    if prepacked and ("missing value for argument" in lowered or "list[int]" in lowered):
        return _functional_conv_arguments(ctx, prepacked.group(1), node)
    if "dtype" in lowered or "quint8" in lowered or "qint8" in lowered or "expected" in lowered:
        return (
            CAUSE_DTYPE,
            "two connected ops disagree on the tensor's dtype (a quantized tensor reaches an op expecting "
            "float, or the other way round), usually from an unsupported dtype in the qconfig.",
            f"use the backend's default qconfig for {module or node or 'this op'} or keep it float.",
            {"action": "keep_float", "module": module} if module else None,
        )
    return (
        CAUSE_UNKNOWN,
        "not one of the known conversion failures; see the error text.",
        f"keep {module or node or 'the failing op'} in float to confirm it is the culprit.",
        {"action": "keep_float", "module": module} if module else None,
    )


def _functional_conv_arguments(
    ctx: LintContext, op: str, node: str | None
) -> tuple[str, str, str, dict[str, Any] | None]:
    """A functional conv whose stride, padding or dilation is an int or left out: the quantized
    conv's prepack op takes them only as lists, and convert_fx passes the call's as written."""
    first = next((n.name for n in ctx.graph.ops() if n.op == "function" and n.kind == op), None)
    return (
        CAUSE_FUNCTIONAL_CONV_ARGUMENTS,
        f"a functional {op} (F.{op} in a forward) is called with its stride, padding or dilation as an "
        f"int or left at its default: convert_fx passes the call's arguments to quantized::{op}_prepack as "
        "written, and that op takes each of them only as a list.",
        f"pass them as tuples (F.{op}(x, weight, bias, stride=(1, 1), padding=(0, 0), dilation=(1, 1), "
        f"groups=1): the same float result), or keep functional {op}s float: "
        f"mapping.set_object_type(torch.{op}, None).",
        {"action": "keep_float_function", "node": first or node, "function": f"torch.{op}"} if first or node else None,
    )


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else repr(error)
    if len(line) > 160 and ". " in line:  # keep the first sentence of torch's long dispatcher errors
        line = line.split(". ", 1)[0]
    return line.rstrip(".")[:300]
