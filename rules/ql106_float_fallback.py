"""QL106 float-fallback: conv, linear, recurrent and attention ops the int8 model runs in float."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import quantize_dynamic

from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Impact, Severity
from qlint.linter.impact import fix_mapping
from qlint.linter.rule import Example, Need, Rule, RuleOptions, seeded
from qlint.measure.fallback import FloatLayer
from qlint.measure.pt2e_trial import (
    as_torch_layers,
    missed_by_class,
    missed_torch_layer,
    quantizer_leaves_float,
    repeated_calls,
)
from qlint.measure.trial import TrialResult

_WHY = {
    "tracer-leaf": (
        "torch.fx treats this torch module as one opaque call (a tracer leaf), so prepare_fx "
        "never sees the layers inside it, and no qconfig reaches them"
    ),
    "recurrent": (
        "torch has no static int8 kernel for recurrent layers; FX quantizes them only with a "
        "dynamic qconfig (weights int8, activations quantized on the fly)"
    ),
    "functional": (
        "it is a functional call (F.linear / F.conv*d) whose weight is not a module parameter "
        "pattern the backend config quantizes"
    ),
    "no-static-kernel": "the backend config has no static int8 pattern for it with this qconfig",
    "not-annotated": (
        "the pt2e quantizer (X86InductorQuantizer) has no annotation for this op, so prepare_pt2e puts "
        "no observer around it"
    ),
}


def _pt2e_no_fix(count: int) -> str:
    them = "them" if count > 1 else "it"
    return (
        f" No quantizer setting of the pt2e flow quantizes {them} (X86InductorQuantizer quantizes conv2d and "
        f"linear ops, and only linear ones dynamically): to quantize {them}, lint and quantize the nn.Module "
        f"with prepare_fx, or keep {them} float on purpose."
    )


class FloatFallback(Rule):
    """Lists every conv, linear, LSTM, GRU and attention op that stays float after the trial
    convert_fx, says why, and gives the fix with its measured SQNR.

    ## What it does
    Reads the converted model of lint's trial quantization and finds the weighted ops
    (conv, linear, LSTM/GRU/RNN, multi-head attention) that still run in float, for one
    of these reasons:
    - **tracer leaf**: torch.fx does not step into torch's own modules, so an
      `nn.TransformerEncoder` or `nn.MultiheadAttention` is one opaque call and the
      Linear layers inside it are never quantized;
    - **recurrent**: `nn.LSTM`/`nn.GRU` have no static int8 kernel and need a dynamic qconfig;
    - **functional**: `F.linear`/`F.conv2d` with a weight the backend config cannot quantize;
    - **no static kernel** for the op with this qconfig;
    - **not annotated** (exported graphs, quantized with the pt2e flow): torchao's
      X86InductorQuantizer puts no observer around the op. It quantizes conv2d and linear
      ops it finds by the class of the module calling them, compared by name with
      `torch.nn.Conv2d`/`torch.nn.Linear` (torch.export records class names), and by fusion
      patterns of those. A conv1d or a recurrent op stays float whatever the quantizer's
      settings: the ops of one kind left float for one such reason are one finding that
      lists them and says so (impact "float, no fix here": the trial's int8 model runs them
      in float, and no quantizer setting changes that). Convs and linears called by a module of another
      class (a custom `nn.Conv2d` subclass such as EfficientNet's
      `Conv2dStaticSamePadding`) are reported together in one finding, with the fix: make
      them torch's own modules before export, and give each call of a module called twice
      (a shared `nn.ReLU6`) a module of its own, since X86InductorQuantizer's fusion
      patterns refuse those. That fix is measured on the same float graph with those ops
      recorded as torch's layers: the int8 coverage and output SQNR it gives.

    Layers the mapping itself keeps float (a `None` qconfig) are intended and not reported.
    For recurrent layers the fix is a dynamic-quantization entry in the mapping; for a
    tracer leaf, dynamic quantization of the Linear layers inside it after convert_fx
    (`torch.ao.quantization.quantize_dynamic`). Each fix is applied in a trial and its
    output SQNR measured; the finding's impact is of kind `coverage`: the SQNR the fix
    costs (int8 is never more accurate than float) and the int8 ops it gains. The
    finding also gives the model's int8 coverage: int8 weighted ops out of all of them.
    A fallback with no fix is a warning all the same: keeping an op float that already is
    changes nothing, so that measure would call it info, and a model whose every conv stays
    float would read as having no problem.

    ## Why is this bad?
    convert_fx leaves these ops in float silently: the model converts, runs, and is
    neither smaller nor faster where it matters. In a transformer classifier the
    encoder holds nearly every weight, yet only the embedding and head become int8.

    ## Example
    ```python
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(16, 32, batch_first=True)
            self.head = nn.Linear(32, 5)
        def forward(self, x):
            y, _ = self.lstm(x)
            return self.head(y[:, -1])
    prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), (x,))  # lstm stays float
    ```

    ## Use instead
    ```python
    mapping = get_default_qconfig_mapping("x86").set_module_name("lstm", default_dynamic_qconfig)
    # a tracer leaf (TransformerEncoder): quantize its Linear layers dynamically after convert
    converted.encoder = quantize_dynamic(converted.encoder, {nn.Linear}, dtype=torch.qint8)
    torch.backends.mha.set_fastpath_enabled(False)  # its fused fast path expects float weights
    ```

    ## Options
    - `report_kept_float`: also report layers the mapping keeps float on purpose, as info
      (default false).

    ## References
    - https://pytorch.org/docs/stable/quantization.html#dynamic-quantization
    - torch.ao.quantization.quantize_dynamic; torch.ao.quantization.default_dynamic_qconfig
    - torch.fx.Tracer.is_leaf_module
    """

    code = "QL106"
    name = "float-fallback"
    summary = "A conv, linear, recurrent or attention op stays float after convert_fx."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.TRIAL})

    class Options(RuleOptions):
        report_kept_float: bool = False

    options: Options

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        trial = ctx.trial
        if trial is None or not trial.measured:
            return
        coverage = f"{trial.int8_ops}/{trial.weighted_ops}"
        pt2e = trial.converter == "convert_pt2e"
        missed = [layer for layer in trial.float_layers if pt2e and missed_torch_layer(layer)]
        if missed:
            yield self._missed_torch_layers(ctx, trial, missed, coverage)
        unfixable: dict[tuple[str, str], list[FloatLayer]] = {}
        for layer in trial.float_layers:
            if layer in missed:
                continue
            if pt2e and quantizer_leaves_float(layer):  # and no rewrite fixes it (missed: above)
                unfixable.setdefault((layer.reason, layer.kind), []).append(layer)
                continue
            if layer.reason == "kept-float":
                if self.options.report_kept_float:
                    yield self.finding(
                        layer.target,
                        f"{layer.target} ({layer.kind}) is kept float by the "
                        f"qconfig mapping. int8 coverage {coverage}.",
                        severity=Severity.INFO,
                        data=_data(layer, trial),
                    )
                continue
            yield self._fallback(ctx, trial, layer, coverage)
        for layers in unfixable.values():
            yield self._unfixable_in_pt2e(trial, layers, coverage)

    def _unfixable_in_pt2e(self, trial: TrialResult, layers: list[FloatLayer], coverage: str) -> Finding:
        """One finding for the ops of one kind that the pt2e flow leaves float for one reason no
        quantizer setting changes (the same text once per op would be a wall of repeats)."""
        targets = [layer.target for layer in layers]
        listed = _listed(targets, 8)
        kind = layers[0].kind.removeprefix("module:")
        what = f"{len(layers)} {kind} ops stay" if len(layers) > 1 else f"A {kind} op stays"
        message = (
            f"{what} float after convert_pt2e ({listed}): {_WHY[layers[0].reason]}. "
            f"int8 coverage of the model's conv/linear/recurrent/attention ops: {coverage}.{_pt2e_no_fix(len(layers))}"
        )
        data = {**_data(layers[0], trial), "layers": targets}
        return self.finding(targets[0], message, data=data, impact=_float_as_measured(trial))

    def _fallback(self, ctx: LintContext, trial: TrialResult, layer: FloatLayer, coverage: str) -> Finding:
        what = f"{layer.target} ({layer.kind.removeprefix('module:')}"
        what += f", {len(layer.inner)} weighted layers inside)" if layer.inner else ")"
        message = (
            f"{what} stays float after {trial.converter}: {_WHY[layer.reason]}. int8 coverage of the model's "
            f"conv/linear/recurrent/attention ops: {coverage}."
        )
        suggestion: dict[str, Any] | None = None
        impact = None
        if layer.reason == "recurrent":
            suggestion = {"action": "set_qconfig", "targets": [layer.target], "mode": "dynamic"}
            fixed = _dynamic_entry_sqnr(ctx, suggestion, self.finding(layer.target, "", suggestion=suggestion))
            message += (
                f" Fix: quantize it dynamically: mapping.set_module_name({layer.target!r}, default_dynamic_qconfig)."
            )
            impact = _coverage_impact(trial, fixed, 1, "dynamic qconfig entry in the mapping")
        elif layer.reason == "tracer-leaf" and layer.inner:
            suggestion = {"action": "quantize_dynamic_after_convert", "module": layer.target, "types": ["Linear"]}
            fixed = _dynamic_leaf_sqnr(ctx, trial, layer.target)
            linears = _linear_count(ctx, trial, layer.target)
            message += (
                f" Fix: after convert_fx, quantize the Linear layers inside it dynamically: "
                f"converted.{layer.target} = torch.ao.quantization.quantize_dynamic("
                f"converted.{layer.target}, {{nn.Linear}}, dtype=torch.qint8), and run it with "
                "torch.backends.mha.set_fastpath_enabled(False) (the fused fast path expects float "
                "Linear weights)."
            )
            impact = _coverage_impact(trial, fixed, linears, "quantize_dynamic of the leaf after convert_fx")
        elif layer.reason == "no-static-kernel":
            message += (
                " The qconfig it gets is the cause (an activation or weight dtype the backend has no static "
                "kernel for; QL103 names it): give it the backend default qconfig, or keep it float on "
                "purpose with a None qconfig."
            )
        else:
            message += (
                " No qconfig change quantizes it: rewrite it as an nn.Linear/nn.Conv module call, "
                "or keep it float on purpose with a None qconfig."
            )
        if impact is not None and impact.fixed_sqnr_db is not None:
            message += f" Measured: output SQNR {impact.base_sqnr_db:.1f} → {impact.fixed_sqnr_db:.1f} dB with the fix."
        if suggestion is None and layer.reason != "no-static-kernel":
            impact = _float_as_measured(trial)  # no setting quantizes it: measured as it runs
        return self.finding(layer.target, message, data=_data(layer, trial), suggestion=suggestion, impact=impact)

    def _missed_torch_layers(
        self, ctx: LintContext, trial: TrialResult, layers: list[FloatLayer], coverage: str
    ) -> Finding:
        """One finding for the conv2d/linear ops pt2e left float (the module calling them is not
        torch's own class, or is called more than once), measured with those ops seen as torch
        layers, one module per call."""
        classes = sorted({layer.called_by or "" for layer in layers})
        foreign = sorted({layer.called_by or "" for layer in layers if missed_by_class(layer)})
        targets = [layer.target for layer in layers]
        listed = _listed(targets, 8)
        what = f"{len(layers)} conv2d/linear ops stay" if len(layers) > 1 else "A conv2d/linear op stays"
        message = f"{what} float after convert_pt2e ({listed}). int8 coverage of the model's conv/linear/recurrent/attention ops: {coverage}."
        fixes = []
        if foreign:
            message += (
                " X86InductorQuantizer finds conv2d and linear ops by the class of the module calling them, "
                "compared by name with torch.nn.Conv2d / torch.nn.Linear (torch.export records class names in "
                f"nn_module_stack), and these are called by {', '.join(foreign)}."
            )
            fixes.append(
                "make these layers torch.nn.Conv2d / torch.nn.Linear modules before torch.export (what their "
                "forward does besides, such as padding first, in a module of its own: an nn.ZeroPad2d, then an "
                "nn.Conv2d with the same weights; the float model stays the same)"
            )
        impact = None
        bench = ctx.trial_bench
        reused = repeated_calls(bench.model_factory()) if bench is not None else []
        if reused:
            shown = _listed(reused, 4)
            fixes.append(
                f"give each call of a module called more than once ({shown}) a module of its own: "
                "X86InductorQuantizer's fusion patterns refuse a module whose calls form one partition"
            )
        if not fixes:
            fixes.append("call each through a torch.nn.Conv2d / torch.nn.Linear module of its own")
        message += " Fix: " + ", and ".join(fixes) + "; or lint and quantize the nn.Module with prepare_fx."
        if bench is not None and ctx.qconfig_mapping is not None and trial.output_sqnr_db is not None:
            wanted = frozenset(targets)
            variant = bench.variant(lambda: as_torch_layers(bench.model_factory(), wanted))
            fixed = variant.run(ctx.qconfig_mapping, measure_layers=False)
            if fixed.output_sqnr_db is not None:
                gained = fixed.int8_ops - trial.int8_ops
                impact = _coverage_impact(
                    trial, fixed.output_sqnr_db, gained, "the layers as torch.nn modules, one per call"
                )
                message += (
                    f" Measured with that fix (the same float graph): int8 coverage {fixed.int8_ops}/"
                    f"{fixed.weighted_ops}, output SQNR {trial.output_sqnr_db:.1f} → {fixed.output_sqnr_db:.1f} dB."
                )
        data = {
            "kind": "not-annotated-class",
            "op": layers[0].kind,
            "layers": targets,
            "called_by": classes,
            "repeated_calls": reused,
            "int8_ops": trial.int8_ops,
            "weighted_ops": trial.weighted_ops,
        }
        return self.finding(targets[0], message, data=data, impact=impact)


def _listed(names: list[str], most: int) -> str:
    """The first ``most`` names, and how many there are in all when some are left out."""
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


def _data(layer: FloatLayer, trial: TrialResult) -> dict[str, Any]:
    return {
        "kind": layer.reason,
        "op": layer.kind,
        "inner": list(layer.inner),
        "int8_ops": trial.int8_ops,
        "weighted_ops": trial.weighted_ops,
    }


def _coverage_impact(trial: TrialResult, fixed: float | None, gained: int, how: str) -> Impact | None:
    if fixed is None or trial.output_sqnr_db is None:
        return None
    return Impact.measured(trial.output_sqnr_db, fixed, "rule-trial", how, kind="coverage", int8_ops_gained=gained)


def _float_as_measured(trial: TrialResult) -> Impact | None:
    """A fallback no setting fixes, as the trial measured it: an int8 model that runs the op in
    float (``stays-float``, kind coverage, no op gained). Without it the impact meter would
    measure keeping the op float, 0 dB for an op already float, and make it info: a model whose
    every conv stays float would read as having no problem."""
    if trial.output_sqnr_db is None:
        return None
    how = "no setting of the flow quantizes it: the trial's int8 model runs this op in float"
    return Impact.measured(trial.output_sqnr_db, trial.output_sqnr_db, "stays-float", how, kind="coverage")


def _dynamic_entry_sqnr(ctx: LintContext, suggestion: dict[str, Any], finding: Finding) -> float | None:
    if ctx.trial_bench is None or ctx.qconfig_mapping is None:
        return None
    mapping = fix_mapping(ctx.qconfig_mapping, [finding], ctx.backend.name)
    return None if mapping is None else ctx.trial_bench.output_sqnr(mapping)


def _dynamic_leaf_sqnr(ctx: LintContext, trial: TrialResult, target: str) -> float | None:
    if ctx.trial_bench is None or trial.model is None:
        return None
    model = copy.deepcopy(trial.model)
    parent_name, _, child = target.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, quantize_dynamic(getattr(parent, child), {nn.Linear}, dtype=torch.qint8))
    # The fused fast path of nn.TransformerEncoderLayer reads `linear1.weight` as a tensor; a
    # dynamic quantized Linear has a weight() method instead, so the fast path must be off.
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        return ctx.trial_bench.sqnr_of(model)
    except (AttributeError, RuntimeError, TypeError):  # a leaf whose forward rejects dynamic Linear layers
        return None
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def _linear_count(ctx: LintContext, trial: TrialResult, target: str) -> int:
    if trial.model is None:
        return 0
    leaf = trial.model.get_submodule(target)
    # quantize_dynamic swaps exact nn.Linear only (not attention's out_proj subclass).
    return sum(1 for module in leaf.modules() if type(module) is nn.Linear)


# --- examples -----------------------------------------------------------------------------------


class _LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.head(y[:, -1])


class _GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        y, _ = self.gru(x)
        return self.head(y[:, -1])


class _TransformerClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _sequence():
    return (torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(1)),)


def _keep_lstm_float():
    from torch.ao.quantization import get_default_qconfig_mapping

    return get_default_qconfig_mapping("x86").set_module_name("lstm", None)


VALID = (
    Example("an MLP: every linear becomes int8", seeded(_Mlp), _sequence),
    Example("an LSTM the mapping keeps float on purpose", seeded(_LSTMClassifier), _sequence, _keep_lstm_float),
)
INVALID = (
    Example(
        "nn.LSTM stays float after convert_fx (needs a dynamic qconfig)",
        seeded(_LSTMClassifier),
        _sequence,
        flagged=("lstm",),
    ),
    Example("nn.GRU stays float after convert_fx", seeded(_GRUClassifier), _sequence, flagged=("gru",)),
    Example(
        "nn.TransformerEncoder is a tracer leaf: its Linear layers stay float",
        seeded(_TransformerClassifier),
        _sequence,
        flagged=("encoder",),
    ),
)
