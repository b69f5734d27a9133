"""QL105 conversion-check: trial prepare_fx → calibrate → convert_fx → run, and say what breaks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.ao.quantization import QConfigMapping, get_default_qconfig

from qlint.core.function_paths import function_path
from qlint.core.sqnr import sqnr_text
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Impact, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions, seeded
from qlint.measure.trial import STAGE_CONVERT, STAGE_PREPARE, TrialFailure, TrialResult
from qlint.measure.trial_bench import quiet_trial
from qlint.rules._ql105_diagnose import diagnose, first_line
from qlint.rules._ql105_locate import locate_by_running, locate_in_traceback
from qlint.rules._ql105_onset import best_keep_float, candidates, describe, error_onset

DEFAULT_WARN_BELOW_DB = 20.0  # 10 % RMS error at the output: enough to move top-1 on many tasks
DEFAULT_ERROR_BELOW_DB = 10.0  # 32 % RMS error: the int8 model computes something else


class ConversionCheck(Rule):
    """Reads lint's trial quantization: the first step that fails, with the failing node and
    op, or an output SQNR too low to ship, with the layer where the error starts.

    ## What it does
    Lint's trial quantization (docs/architecture.md, "The trial") runs what a user would
    run on a private copy of the traced model: `prepare_fx` with the qconfig mapping being
    linted (the backend's default mapping when none was given) and the backend's
    BackendConfig, calibration (on the calibration data when given, else on the example
    inputs), `convert_fx`, and the converted model on the example inputs, with
    `torch.backends.quantized.engine` set to the backend (and restored afterwards).

    When a step fails this rule finds the failing graph node (from the exception's
    traceback during prepare/convert, or by re-running the graph node by node with an
    `fx.Interpreter`) and classifies the cause: `.view` on a non-contiguous quantized
    tensor, an op with no quantized kernel for this backend, a qconfig the op's quantized
    module cannot take (e.g. per-channel weights on ConvTranspose), data- or
    shape-dependent Python control flow, a functional conv whose stride, padding or dilation is
    an int (the quantized conv's prepack op takes only lists), a dtype mismatch, or (pt2e) a
    module called more than once.

    For an exported (aten) graph, such as a `.pt2` holds, the trial is the pt2e flow
    instead: `prepare_pt2e` with torchao's X86InductorQuantizer (x86 backends, the
    `qlint[pt2e]` extra), calibration, `convert_pt2e`; the layers then have propagated
    SQNRs only.

    When every step succeeds it reports the output SQNR (dB) of the converted model
    against the float model: info when it is at least `warn_below_db` (20 dB), a warning
    below that and an error below `error_below_db` (10 dB). When fewer than half of the
    conv/linear/recurrent/attention ops run in int8 the message says so: a high SQNR then
    only says the model stayed float (QL106 names each op left float). When none of them
    does (a `.pt2` of conv1d and LSTMCell layers, which X86InductorQuantizer does not
    annotate) it is a warning whatever the SQNR: the quantized model is the float model.
    When the trial fails but its workaround (`.view` as `.reshape`) runs, the impact is
    "fails → X dB": `db` is null (there is no SQNR to gain from) and `fixed_sqnr_db` is X.
    A low SQNR names the layer
    where the error starts: the first layer, in forward order, whose output SQNR
    (propagated) is below `warn_below_db`, or, when the error builds up gradually, the
    layer adding the most error itself (lowest shadow SQNR). Its fix keeps float the one
    that recovers the most in a trial: that layer, the quantized functional ops between it
    and the weighted module before it (up to three functions, each kept float by
    `set_object_type`, e.g. the `add` of `sqrt(a**2 + b**2)`), or that module, whose
    output range the layer's input inherits; and a functional layer (not a conv or linear)
    together with the quantized functional ops after it, up to the next weighted layers:
    an additive attention mask, `(1 - mask) * -10000`, loses its -10000s both in its own
    int8 range and in the add that applies it. Its impact is that trial's gain.

    The trial costs what torch's own pass costs (`bench/scaling.py`) plus one paired run
    for the per-layer numbers, and torch's pass grows faster than the model: `prepare_fx`
    rebuilds its table of modules for every observed op, and the default HistogramObserver
    searches its qparams in a Python loop. A 2,000-layer MLP takes minutes. The trial's
    time is in the report's timings; `--no-trial` (or `trial = false` under
    `[tool.qlint]`) turns it off, and this rule with it.

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
    - `warn_below_db`: a converted model whose output SQNR is below this is a warning
      (default 20 dB: a 10 % RMS error at the output).
    - `error_below_db`: below this it is an error (default 10 dB: a 32 % RMS error; the
      int8 model computes something else).

    ## References
    - https://pytorch.org/docs/stable/quantization.html#common-errors
    - https://pytorch.org/docs/stable/fx.html#the-interpreter-pattern
    - torch.ao.quantization.quantize_fx.prepare_fx / convert_fx
    """

    code = "QL105"
    name = "conversion-check"
    summary = "The trial prepare_fx/convert_fx/run of the model fails, or its output SQNR is low."
    severity = Severity.ERROR
    requires = frozenset({Need.GRAPH, Need.TRIAL})

    class Options(RuleOptions):
        report_success_sqnr: bool = Field(True, description="Report the output SQNR when conversion works.")
        warn_below_db: float = Field(
            DEFAULT_WARN_BELOW_DB, description=("A converted model whose output SQNR is below this (dB) is a warning.")
        )
        error_below_db: float = Field(
            DEFAULT_ERROR_BELOW_DB, description=("A converted model whose output SQNR is below this (dB) is an error.")
        )

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        trial = ctx.trial
        if trial is None:
            return []
        if trial.failure is not None:
            finding = self._located_failure(ctx, trial.failure)
            if trial.workaround is not None and trial.output_sqnr_db is not None:
                # the fix was applied in the trial itself: the int8 model runs, at this SQNR. That is
                # no gain (the intended model has no SQNR): db stays None, the SQNR is fixed_sqnr_db
                measured = round(trial.output_sqnr_db, 3)
                finding = finding.model_copy(
                    update={
                        "message": f"{finding.message} {trial.workaround[:1].upper()}{trial.workaround[1:]}, "
                        f"the int8 model runs at {sqnr_text(measured)} output SQNR.",
                        "impact": Impact(
                            db=None,
                            basis="rule-trial",
                            kind="diagnosis",
                            fixed_sqnr_db=measured,
                            detail=f"{trial.workaround}: from failing to running",
                        ),
                    }
                )
            return [finding]
        return list(self._output_error(ctx, trial))

    def _located_failure(self, ctx: LintContext, failure: TrialFailure) -> Finding:
        model = failure.model
        inputs = tuple(ctx.example_inputs or ())
        if failure.stage in (STAGE_PREPARE, STAGE_CONVERT):
            modules = {id(m): name for name, m in model.named_modules() if name} if model is not None else {}
            return self._failure(ctx, failure.stage, failure.error, locate_in_traceback(failure.error, modules), None)
        with quiet_trial():
            where, node = locate_by_running(model, inputs)
        return self._failure(ctx, failure.stage, failure.error, where, node)

    def _output_error(self, ctx: LintContext, trial: TrialResult) -> Iterable[Finding]:
        sqnr = trial.output_sqnr_db
        text = "n/a (no floating-point outputs)" if sqnr is None else sqnr_text(sqnr)
        where = f"calibrated on {trial.calibrated_on}, evaluated on {trial.evaluated_on}, {ctx.backend.name}"
        severity = Severity.INFO
        if sqnr is not None and sqnr < self.options.error_below_db:
            severity = Severity.ERROR
        elif sqnr is not None and sqnr < self.options.warn_below_db:
            severity = Severity.WARNING
        low = severity is not Severity.INFO
        # a high SQNR that only says the model stayed float: QL106 warns where a fix exists
        mostly_float = 2 * trial.int8_ops < trial.weighted_ops
        # nothing quantized (silero_vad as a .pt2: X86InductorQuantizer annotates neither its conv1d
        # nor its LSTMCell): the "int8 model" is the float model, which is worth a warning
        all_float = trial.weighted_ops > 0 and trial.int8_ops == 0
        if all_float and not low:
            severity = Severity.WARNING
        if severity is Severity.INFO and not self.options.report_success_sqnr:
            return
        steps = (
            "prepare_pt2e, calibration, convert_pt2e"
            if trial.converter == "convert_pt2e"
            else ("prepare_fx, calibration, convert_fx")
        )
        message = f"{steps} and a quantized forward pass all succeed ({where})"
        if all_float:
            message += (
                f", but none of the model's {trial.weighted_ops} conv/linear/recurrent/attention ops runs in "
                f"int8 after {trial.converter}: the quantized model computes them in float, so its output SQNR "
                f"vs float ({text}) says nothing about int8."
            )
        else:
            message += f"; output SQNR of the converted model vs float: {text}."
        if mostly_float:
            if not all_float:
                message += (
                    f" But only {trial.int8_ops} of the model's {trial.weighted_ops} conv/linear/recurrent/attention "
                    f"ops run in int8 after {trial.converter}: most of the quantized model is the float model."
                )
            message += " No single fix applies: QL106 lists each op left float, why, and its fix where one exists."
        data: dict[str, Any] = {
            "kind": "all-float"
            if all_float
            else "mostly-float"
            if mostly_float
            else ("conversion-ok" if severity is Severity.INFO else "low-output-sqnr"),
            "backend": ctx.backend.name,
            "sqnr_db": None if sqnr is None else round(sqnr, 3),
        }
        suggestion = None
        impact = None
        target = ctx.model_name
        if low:
            limit = self.options.error_below_db if severity is Severity.ERROR else self.options.warn_below_db
            onset = error_onset(trial, self.options.warn_below_db)
            message += f" That is below {limit:g} dB."
            if onset is not None:
                target = onset.name
                data.update(
                    onset=onset.name,
                    onset_shadow_db=_rounded(onset.shadow_db),
                    onset_propagated_db=_rounded(onset.propagated_db),
                )
                message += (
                    f" The error starts at {onset.name!r} ({onset.kind}): its own (shadow) SQNR is "
                    f"{_db(onset.shadow_db)} and the SQNR at its output {_db(onset.propagated_db)}."
                )
                best, impact = best_keep_float(ctx, trial, candidates(ctx, onset.name))
                if best is not None and impact is not None:
                    data["fix_target"] = best.node
                    if best.module:
                        suggestion = {"action": "keep_float", "module": best.node}
                        how = f"mapping.set_module_name({best.node!r}, None)"
                    else:
                        paths = [function_path(function) or str(function) for function in best.functions]
                        suggestion = {
                            "action": "keep_float_function",
                            "node": best.node,
                            "function": paths[0],
                            "with_functions": paths[1:],
                        }
                        how = "; ".join(f"mapping.set_object_type({path}, None)" for path in paths)
                    message += (
                        f" Keeping {describe(best)} float ({how}) measures {impact.fixed_sqnr_db:.1f} dB "
                        f"({impact.db:+.1f} dB)."
                    )
                    if impact.db < 0.5:
                        message += (
                            " No single layer kept float recovers it: the error is spread over "
                            "several layers or arrives with an input range that one scale cannot "
                            "cover; run 'qlint verify' for a measured plan, or 'qlint compare'."
                        )
        yield self.finding(target, message, severity=severity, data=data, suggestion=suggestion, impact=impact)

    def _failure(
        self,
        ctx: LintContext,
        stage: str,
        error: BaseException,
        where: dict[str, Any] | None,
        failing_node: fx.Node | None,
    ) -> Finding:
        where = dict(where or {})
        text = first_line(error)
        cause, why, fix, suggestion = diagnose(ctx, stage, error, text, where)
        if where.get("node"):
            place = f"node {where['node']!r} (op {where.get('op')} {where.get('target')})"
            if where.get("module") and where.get("module") != where.get("target"):
                place += f" in module {where['module']!r}"
        elif where.get("module"):
            place = f"module {where['module']!r} ({where.get('module_type')})"
        else:
            place = "an unidentified node"
        message = f"{stage} fails at {place}: {type(error).__name__}: {text}. Likely cause: {why} Fix: {fix}"
        target = where.get("module") or where.get("node") or ctx.model_name
        data = {
            "kind": cause,
            "stage": stage,
            "error_type": type(error).__name__,
            "error": text[:500],
            **{k: v for k, v in where.items() if isinstance(v, (str, int, type(None)))},
        }
        if where.get("node") in ctx.graph:
            data["node"] = where["node"]
        return self.finding(str(target), message, data=data, suggestion=suggestion)


# --- helpers ----------------------------------------------------------------------------------


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _db(value: float | None) -> str:
    return "n/a" if value is None else sqnr_text(value)


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


def _image():
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


def _rows():
    return (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),)


def _global_per_channel_x86() -> QConfigMapping:
    """One per-channel qconfig for everything, ConvTranspose2d included."""
    return QConfigMapping().set_global(get_default_qconfig("x86"))


_QUIET = {"report_success_sqnr": False}

VALID = (
    Example("conv-bn-relu with torch.flatten on x86", seeded(_ConvFlatten), _image, options=_QUIET),
    Example("MLP with a sigmoid head on qnnpack", seeded(_Mlp), _rows, backend="qnnpack", options=_QUIET),
    Example("bilinear upsampling (has a quantized kernel)", seeded(_Upsample, "bilinear"), _image, options=_QUIET),
)
INVALID = (
    Example(".view on a quantized conv output (channels-last)", seeded(_ConvView), _image, flagged=("view",)),
    Example("bicubic interpolation has no quantized kernel", seeded(_Upsample), _image, flagged=("interpolate",)),
    Example(
        "per-channel weights on ConvTranspose2d", seeded(_Decoder), _image, _global_per_channel_x86, flagged=("up",)
    ),
    # Measured, not assumed: x86's int8 ConvTranspose2d (per-tensor weights, the default
    # mapping) converts and runs, yet its output is noise (-0.3 dB); kept float, 34.6 dB.
    Example("transposed conv on x86 converts but destroys the output", seeded(_Decoder), _image, flagged=("up",)),
)
