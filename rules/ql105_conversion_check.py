"""QL105 conversion-check: trial prepare_fx → calibrate → convert_fx → run, and say what breaks."""

from __future__ import annotations

import contextlib
import io
import traceback
import warnings
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.ao.quantization import QConfigMapping, get_default_qconfig, get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qlint.core.backends import backend_config
from qlint.core.preserve import cloned
from qlint.core.sqnr import sqnr_db
from qlint.linter.context import INTENT_PREPARED, LintContext
from qlint.linter.findings import Finding, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions

STAGE_FLOAT, STAGE_PREPARE, STAGE_CALIBRATE, STAGE_CONVERT, STAGE_RUN = (
    "float run", "prepare_fx", "calibration", "convert_fx", "quantized run")

CAUSE_VIEW = "view-non-contiguous"
CAUSE_NO_KERNEL = "no-quantized-kernel"
CAUSE_QCONFIG = "unsupported-qconfig"
CAUSE_CONTROL_FLOW = "control-flow"
CAUSE_DTYPE = "dtype-mismatch"
CAUSE_FLOAT = "fails-in-float"
CAUSE_UNKNOWN = "unknown"


class ConversionCheck(Rule):
    """Trial-quantizes a copy of the model (prepare_fx, one calibration step, convert_fx, one
    forward pass) and reports the first step that fails, naming the failing node and op.

    ## What it does
    On a private copy of the traced model it runs what a user would run: `prepare_fx` with
    the qconfig mapping being linted (the backend's default mapping when none was given)
    and the backend's BackendConfig, one calibration step on the example inputs,
    `convert_fx`, and the converted model on the example inputs, with
    `torch.backends.quantized.engine` set to the backend (and restored afterwards). When a
    step fails it finds the failing graph node (from the exception's traceback during
    prepare/convert, or by re-running the graph node by node with an `fx.Interpreter`),
    and classifies the cause: `.view` on a non-contiguous quantized tensor, an op with no
    quantized kernel for this backend, a qconfig the op's quantized module cannot take
    (e.g. per-channel weights on ConvTranspose), data- or shape-dependent Python control
    flow, or a dtype mismatch. When every step succeeds it reports, as info, the SQNR (dB)
    of the converted model's outputs against the float model's on the example inputs.

    The trial costs what torch's own pass costs (`bench/scaling.py`: within a few percent
    of `prepare_fx`, one calibration step, `convert_fx` and a forward pass), and that pass
    grows faster than the model: `prepare_fx` rebuilds its table of modules for every
    observed op, and the default HistogramObserver searches its qparams in a Python loop.
    A 2,000-layer MLP takes minutes. Each rule's time is in the report's timings, and a
    rule that takes more than 10 s gets a notice; `--ignore QL105` (or
    `ignore = ["QL105"]` under `[tool.qlint]`) turns the trial off.

    ## Why is this bad?
    Static analysis cannot see every way conversion breaks: a `.view` that is fine in float
    fails after convert because quantized conv kernels return channels-last (NHWC)
    tensors; ops such as bicubic interpolation have no QuantizedCPU kernel, and FX still
    hands them quantized tensors; some modules reject qconfigs only when they are
    converted. Each of these surfaces as a deep traceback in generated code, far from the
    line that must change. Finding it at lint time, with the node and the fix, saves the
    debugging round trip.

    ## Example
    ```python
    class Net(nn.Module):
        def forward(self, x):
            y = self.conv(x)
            return self.fc(y.view(y.size(0), -1))   # quantized conv output is NHWC
    ```

    ## Use instead
    ```python
    class Net(nn.Module):
        def forward(self, x):
            y = self.conv(x)
            return self.fc(torch.flatten(y, 1))      # or y.reshape(y.size(0), -1)
    # and for ops with no quantized kernel:
    mapping = get_default_qconfig_mapping("x86").set_module_name("upsample", None)
    ```

    ## Options
    - `report_success_sqnr`: when conversion succeeds, emit an info finding with the output
      SQNR in dB (default true).
    - `min_sqnr_db`: when set, a successful conversion whose output SQNR is below this is a
      warning instead of info.

    ## References
    - https://pytorch.org/docs/stable/quantization.html#common-errors
    - https://pytorch.org/docs/stable/fx.html#the-interpreter-pattern
    - torch.ao.quantization.quantize_fx.prepare_fx / convert_fx
    """

    code = "QL105"
    name = "conversion-check"
    summary = "A trial prepare_fx/convert_fx/run of the model fails (or: its output SQNR)."
    severity = Severity.ERROR
    requires = frozenset({Need.GRAPH, Need.QCONFIG, Need.MODEL, Need.EXAMPLE_INPUTS})

    class Options(RuleOptions):
        report_success_sqnr: bool = Field(True, description="Report the output SQNR when conversion works.")
        min_sqnr_db: Optional[float] = Field(None, description="Warn when the output SQNR is below this.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        if ctx.intent == INTENT_PREPARED or ctx.graph.frontend.startswith("torch.export"):
            return []  # an already-prepared model or an aten graph: prepare_fx does not apply
        with _quantized_engine(ctx.backend.name) as available, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not available:
                return []
            # GraphModule prints generated-code tracebacks to stderr when a run fails; we report instead.
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                return list(self._trial(ctx))

    def _trial(self, ctx: LintContext) -> Iterable[Finding]:
        if ctx.model_factory is None:
            raise ValueError("QL105 needs the model (Need.MODEL) to try prepare_fx/convert_fx")
        inputs = tuple(ctx.example_inputs or ())
        backend = ctx.backend.name
        mapping = ctx.qconfig_mapping if ctx.qconfig_mapping is not None else get_default_qconfig_mapping(backend)
        config = backend_config(backend)

        reference = ctx.model_factory().eval()
        try:
            float_out = reference(*cloned(inputs))  # each run gets its own copy: forward may write it
        except Exception as error:
            yield self._failure(ctx, STAGE_FLOAT, error, *_locate_by_running(reference, inputs))
            return

        model = ctx.model_factory().eval()
        modules = {id(m): name for name, m in model.named_modules() if name}
        try:
            prepared = prepare_fx(model, mapping, inputs, backend_config=config)
        except Exception as error:
            yield self._failure(ctx, STAGE_PREPARE, error, _locate_in_traceback(error, modules), None)
            return
        try:
            prepared(*cloned(inputs))
        except Exception as error:
            yield self._failure(ctx, STAGE_CALIBRATE, error, *_locate_by_running(prepared, inputs))
            return
        modules = {id(m): name for name, m in prepared.named_modules() if name}
        try:
            converted = convert_fx(prepared, backend_config=config)
        except Exception as error:
            yield self._failure(ctx, STAGE_CONVERT, error, _locate_in_traceback(error, modules), None)
            return
        try:
            quant_out = converted(*cloned(inputs))
        except Exception as error:
            yield self._failure(ctx, STAGE_RUN, error, *_locate_by_running(converted, inputs))
            return
        if not self.options.report_success_sqnr:
            return
        sqnr = output_sqnr(float_out, quant_out)
        low = self.options.min_sqnr_db is not None and sqnr is not None and sqnr < self.options.min_sqnr_db
        text = "n/a (no floating-point outputs)" if sqnr is None else f"{sqnr:.1f} dB"
        message = (f"prepare_fx, calibration, convert_fx and a quantized forward pass all succeed on the "
                   f"example inputs ({backend}); output SQNR of the converted model vs float: {text}.")
        if low:
            message += (f" That is below min_sqnr_db={self.options.min_sqnr_db:g}: run 'qlint compare' or the "
                        "data rules (QL2xx) with calibration data to find the layers that lose accuracy.")
        yield self.finding(
            ctx.model_name, message, severity=Severity.WARNING if low else Severity.INFO,
            data={"kind": "conversion-ok", "backend": backend,
                  "sqnr_db": None if sqnr is None else round(sqnr, 3)})

    def _failure(self, ctx: LintContext, stage: str, error: BaseException, where: Optional[dict[str, Any]],
                 failing_node: Optional[fx.Node]) -> Finding:
        where = dict(where or {})
        text = _first_line(error)
        cause, why, fix, suggestion = _diagnose(ctx, stage, error, text, where)
        if where.get("node"):
            place = f"node {where['node']!r} (op {where.get('op')} {where.get('target')})"
            if where.get("module") and where.get("module") != where.get("target"):
                place += f" in module {where['module']!r}"
        elif where.get("module"):
            place = f"module {where['module']!r} ({where.get('module_type')})"
        else:
            place = "an unidentified node"
        message = (f"{stage} fails at {place}: {type(error).__name__}: {text}. Likely cause: {why} "
                   f"Fix: {fix}")
        target = where.get("module") or where.get("node") or ctx.model_name
        data = {"kind": cause, "stage": stage, "error_type": type(error).__name__, "error": text[:500],
                **{k: v for k, v in where.items() if isinstance(v, (str, int, type(None)))}}
        if where.get("node") in ctx.graph:
            data["node"] = where["node"]
        return self.finding(str(target), message, data=data, suggestion=suggestion)


# --- locating the failing node ------------------------------------------------------------

class _Locator(fx.Interpreter):
    """Runs a GraphModule node by node and remembers the first node that raises."""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.failed: Optional[fx.Node] = None

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


def _locate_by_running(gm: Any, inputs: tuple[Any, ...]) -> tuple[Optional[dict[str, Any]], Optional[fx.Node]]:
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


def _locate_in_traceback(error: BaseException, modules: dict[int, str]) -> Optional[dict[str, Any]]:
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


# --- diagnosis ------------------------------------------------------------------------------

def _diagnose(ctx: LintContext, stage: str, error: BaseException, text: str,
              where: dict[str, Any]) -> tuple[str, str, str, Optional[dict[str, Any]]]:
    lowered = text.lower()
    node = where.get("node")
    module = where.get("module")
    if stage == STAGE_FLOAT:
        return (CAUSE_FLOAT, "the float model itself fails on the example inputs, so nothing can be "
                "quantized.", "fix the model or pass example inputs of the right shape and dtype.", None)
    if "view size is not compatible" in lowered or (where.get("target") == "view" and "stride" in lowered):
        return (CAUSE_VIEW,
                "`.view` on a quantized tensor that is not contiguous: quantized conv kernels return "
                "channels-last (NHWC) tensors, so a `.view` that works in float fails after convert_fx.",
                f"replace `.view(...)` (node {node!r}) with `.reshape(...)` or `torch.flatten(x, 1)` "
                "(or call `.contiguous()` first).",
                {"action": "rewrite", "kind": "view_to_reshape", "node": node or ctx.model_name})
    if ("quantizedcpu" in lowered or "could not run 'quantized::" in lowered
            or ("not implemented" in lowered and "quantized" in lowered)
            or isinstance(error, NotImplementedError)):
        op = where.get("target") or "this op"
        keep = (f"mapping.set_module_name({module!r}, None)" if module else
                f"mapping.set_object_type({op}, None)")
        return (CAUSE_NO_KERNEL,
                f"{op} has no quantized kernel on {ctx.backend.name} (QuantizedCPU), yet receives a quantized "
                "tensor after convert_fx.",
                f"keep it in float: {keep} (convert_fx then dequantizes before it), or use a variant of the "
                "op that has a quantized kernel (e.g. bilinear/nearest instead of bicubic interpolation).",
                {"action": "keep_float", "module": module, "node": node, "function": op}
                if module else {"action": "keep_float_function", "node": node, "function": op})
    if ("per channel" in lowered or "per-channel" in lowered or "qconfig" in lowered
            or (stage in (STAGE_PREPARE, STAGE_CONVERT) and module and isinstance(error, (AssertionError,
                                                                                       ValueError)))):
        return (CAUSE_QCONFIG,
                f"the qconfig for {module or node} asks for something its quantized module does not "
                "support" + (" (per-channel weights on a transposed convolution)." if "per channel" in lowered
                             else "."),
                f"give {module or node} a supported qconfig (e.g. per-tensor weights: "
                "MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)) or keep "
                f"it float with mapping.set_module_name({(module or node)!r}, None).",
                {"action": "set_weight_observer", "targets": [module or node], "observer": "MinMaxObserver",
                 "qscheme": "torch.per_tensor_symmetric", "dtype": "torch.qint8"}
                if "per channel" in lowered else {"action": "keep_float", "module": module or node})
    if ("control flow" in lowered or "symbolically traced" in lowered or "proxy" in lowered
            or "data-dependent" in lowered or "guard" in lowered):
        return (CAUSE_CONTROL_FLOW,
                "data- or shape-dependent Python (an `if`/loop or a Python call on a tensor's value or shape) "
                "that prepare_fx's tracer cannot turn into graph ops.",
                "move the branch out of forward, make it depend only on constructor arguments, or keep that "
                "submodule untraced with PrepareCustomConfig().set_non_traceable_module_names([...]) or wrap the "
                "helper with torch.fx.wrap.", None)
    if "dtype" in lowered or "quint8" in lowered or "qint8" in lowered or "expected" in lowered:
        return (CAUSE_DTYPE,
                "two connected ops disagree on the tensor's dtype (a quantized tensor reaches an op expecting "
                "float, or the other way round), usually from an unsupported dtype in the qconfig.",
                f"use the backend's default qconfig for {module or node or 'this op'} or keep it float.",
                {"action": "keep_float", "module": module} if module else None)
    return (CAUSE_UNKNOWN, "not one of the known conversion failures; see the error text.",
            f"keep {module or node or 'the failing op'} in float to confirm it is the culprit.",
            {"action": "keep_float", "module": module} if module else None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else repr(error)
    if len(line) > 160 and ". " in line:  # keep the first sentence of torch's long dispatcher errors
        line = line.split(". ", 1)[0]
    return line.rstrip(".")[:300]


# --- helpers ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _quantized_engine(backend: str):
    previous = torch.backends.quantized.engine
    if backend not in torch.backends.quantized.supported_engines:
        yield False
        return
    torch.backends.quantized.engine = backend
    try:
        yield True
    finally:
        torch.backends.quantized.engine = previous


def output_sqnr(float_out: Any, quant_out: Any) -> Optional[float]:
    """SQNR (dB, :mod:`qlint.core.sqnr`) over every floating-point output tensor; None when the
    outputs hold none, or when the quantized outputs do not pair up with the float ones."""
    try:
        return sqnr_db(float_out, quant_out)
    except ValueError:
        return None


# --- examples -----------------------------------------------------------------------------------

class _ConvFlatten(nn.Module):
    """Conv → BN → ReLU → flatten → linear: converts and runs (torch.flatten handles NHWC)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.relu(self.bn(self.conv(x))), 1))


class _ConvView(nn.Module):
    """The same network flattening with .view: fails after convert (quantized conv output is NHWC)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 4)

    def forward(self, x):
        y = self.conv(x)
        return self.fc(y.view(y.size(0), -1))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return torch.sigmoid(self.fc2(self.relu(self.fc1(x))))


class _Upsample(nn.Module):
    """Bicubic interpolation has no QuantizedCPU kernel."""

    def __init__(self, mode: str = "bicubic") -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.mode = mode

    def forward(self, x):
        return F.interpolate(self.conv(x), scale_factor=2.0, mode=self.mode)


class _Decoder(nn.Module):
    """A transposed convolution: rejects per-channel weights on x86."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)

    def forward(self, x):
        return self.up(torch.relu(self.conv(x)))


def _seeded(cls, *args):
    def build():
        torch.manual_seed(0)
        return cls(*args).eval()
    return build


def _image():
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


def _rows():
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),)


def _global_per_channel_x86() -> QConfigMapping:
    """One per-channel qconfig for everything, ConvTranspose2d included."""
    return QConfigMapping().set_global(get_default_qconfig("x86"))


_QUIET = {"report_success_sqnr": False}

VALID = (
    Example("conv-bn-relu with torch.flatten on x86", _seeded(_ConvFlatten), _image, options=_QUIET),
    Example("MLP with a sigmoid head on qnnpack", _seeded(_Mlp), _rows, backend="qnnpack", options=_QUIET),
    Example("bilinear upsampling (has a quantized kernel)", _seeded(_Upsample, "bilinear"), _image,
            options=_QUIET),
    Example("transposed conv with the backend's default mapping (per-tensor weights for it)",
            _seeded(_Decoder), _image, options=_QUIET),
)
INVALID = (
    Example(".view on a quantized conv output (channels-last)", _seeded(_ConvView), _image, flagged=("view",)),
    Example("bicubic interpolation has no quantized kernel", _seeded(_Upsample), _image,
            flagged=("interpolate",)),
    Example("per-channel weights on ConvTranspose2d", _seeded(_Decoder), _image, _global_per_channel_x86,
            flagged=("up",)),
)
