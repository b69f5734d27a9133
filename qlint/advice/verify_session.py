"""The measuring bench of one verify call: quantize a model under a plan, run it, measure it.

A :class:`Session` holds the float model (a private copy), three sets of batches and the
float outputs on two of them:

* **calibration** batches calibrate every quantized model;
* **selection** batches (by default the last calibration batches) choose between plans:
  pruning and the searches compare output SQNR on them;
* **eval** batches are what the report's numbers come from. They never decide anything,
  so the verified plan's SQNR on them is an unbiased estimate.

Every plan goes through :func:`qlint.advice.apply.quantize_with_plan` (its two halves, the
rewritten graph cached while the rewrites stay the same), the path
``QuantPlan.quantize`` gives users. Each plan is quantized once: its measurement is cached,
and only numbers are kept, so memory does not grow with the number of trials. Trials
beyond the budget are refused (:meth:`Session.can_try`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from qlint.advice.apply import Quantized, QuantizeError, quantize_rewritten, rewritten
from qlint.advice.layer_outputs import compare_layer_outputs
from qlint.advice.plan import QuantPlan
from qlint.advice.verify_report import RunResult
from qlint.core.batches import as_call, batches_of, call_model
from qlint.core.nested import float_tensors, floats_are_finite
from qlint.core.ops import (
    CONV_OR_LINEAR_KINDS,
    TRANSPOSED_CONV_KINDS,
    function_kind,
    is_aten_graph,
    module_kind,
)
from qlint.core.sqnr import SQNR_CAP_DB, SqnrSums
from qlint.core.trace import symbolic_graph
from qlint.errors import ConfigError, QlintError, TraceError, first_line
from qlint.measure.calibrated import CalibratedQParams
from qlint.measure.fallback import weighted_coverage
from qlint.measure.rewrite import AppliedRewrite
from qlint.measure.trial import copy_sharing_parameters

FAILED = -math.inf  # the selection SQNR of a plan that cannot be quantized or run

# The ops int8 coverage counts: every convolution and linear layer.
_COVERED_KINDS = CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS


class VerifyError(QlintError):
    """The model cannot be verified (an exported graph, untraceable, no data)."""


def batch_list(data: Any, what: str) -> list[Any]:
    """Every batch of ``data``, read once (verify and qlint quantize run them more than once)."""
    if data is None:
        raise ConfigError(f"{what} batches are needed")
    batches = list(batches_of(data, f"{what} data"))
    if not batches:
        raise ConfigError(f"the {what} data holds no batches")
    return batches


def state_dict_bytes(model: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def conv_linear_modules(model: nn.Module) -> list[str]:
    """Every conv and linear module of ``model``, by fqn."""
    return [name for name, module in model.named_modules() if name and module_kind(module) in CONV_OR_LINEAR_KINDS]


def functional_owners(gm: fx.GraphModule) -> list[str]:
    """Modules owning the weight of a functional conv/linear call (a traced-through conv subclass)."""
    owners: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and function_kind(node.target) in _COVERED_KINDS:
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if isinstance(weight, fx.Node) and weight.op == "get_attr":
                owner = str(weight.target).rpartition(".")[0]
                if owner and owner not in owners:
                    owners.append(owner)
    return owners


@dataclasses.dataclass(frozen=True)
class Measured:
    """One plan, quantized and run: its selection SQNR (what decisions compare), and what the
    report shows (measured on the eval batches, when ``evaluated``); per-layer SQNR when it
    was asked for. A trial is not evaluated: its ``result`` holds the int8 coverage only."""

    selection_sqnr: float  # FAILED when the plan cannot be quantized or run
    result: RunResult
    layers: dict[str, float] | None = None
    evaluated: bool = True


def plan_key(plan: QuantPlan) -> str:
    """Two plans with the same key quantize the same way (provenance does not count)."""
    without_provenance = {"__all__": {"provenance"}}
    return plan.model_dump_json(
        exclude={
            "modules": without_provenance,
            "equalization": without_provenance,
            "rewrites": without_provenance,
            "bias_correction": {"provenance"},
            "model": True,
            "notes": True,
        }
    )


def _release_models() -> None:
    """Free the models of the trial that just ended. A GraphModule and its graph refer to each
    other, so a quantized model (weights, observers, packed params) outlives its last use until
    Python's cycle collector runs; collecting after each trial keeps verify's memory flat
    instead of growing with every trial (EfficientNet-Lite0: peak 1392 -> 974 MB over 10 trials)."""
    gc.collect()


# Progress callback: (what the trial is, trials done, trial budget).
Progress = Callable[[str, int, int], None]


class Session:
    """Shared state of one verify call: float model, data, and every measured plan."""

    def __init__(
        self,
        model: nn.Module,
        calibration: list[Any],
        selection: list[Any],
        eval_data: list[Any],
        *,
        equalization_qconfig: Any = None,
        eval_fn: Callable[[nn.Module, Any], float] | None = None,
        max_trials: int = 6,
        progress: Progress | None = None,
    ) -> None:
        self.model = self._float_copy(model)
        self.calibration, self.selection, self.eval_data = calibration, selection, eval_data
        # 8-bit activations, a change to every observer's range, are judged on trials calibrated
        # on the calibration batches that do not select (fitted_trial); with no batch to spare,
        # on them all.
        held_back = [batch for batch in calibration if not any(batch is chosen for chosen in selection)]
        self.fit = held_back if held_back and len(held_back) < len(calibration) else calibration
        self.equalization_qconfig, self.eval_fn = equalization_qconfig, eval_fn
        self.max_trials, self.progress = max_trials, progress
        self.trials = 0
        self.example = as_call(calibration[0], what="calibration batch 0")[0]
        self._references(calibration[:1], "calibration data")  # what the data must fit: said up front
        self._selection_reference = self._references(selection, "selection data")
        self._eval_reference = self._references(eval_data, "eval data")
        self._measured: dict[str, Measured] = {}
        self._fitted: dict[str, float] = {}
        self._fit_reference: list[Any] | None = None  # float outputs on ``fit``, for swapped folds
        self._last_rewritten: tuple[str, fx.GraphModule, list[AppliedRewrite]] | None = None
        # Activation qparams calibrated so far, per float graph (its rewrites) and batch list:
        # a later plan's observers of the same tensors with the same settings reuse them.
        self._calibrated: dict[tuple[str, tuple[int, ...]], CalibratedQParams] = {}
        self.traced = self._graph()

    def _references(self, batches: list[Any], what: str) -> list[list[torch.Tensor]]:
        """The float model's outputs on ``batches``. Data that does not run, or holds NaN or Inf
        (every SQNR would be measured against it), is the user's to fix: one line naming it."""
        outputs = []
        for number, batch in enumerate(batches):
            if not floats_are_finite(batch):
                raise VerifyError(f"{what} batch {number} holds NaN or Inf values")
            try:
                outputs.append(float_tensors(self.run(self.model, batch)))
            except Exception as error:  # the user's model on the user's data
                raise VerifyError(
                    f"{what} batch {number} does not run through the model: {first_line(error)}"
                ) from error
        return outputs

    @staticmethod
    def _float_copy(model: nn.Module) -> nn.Module:
        """The private float model, in eval mode."""
        copied = copy.deepcopy(model).eval()
        if is_aten_graph(copied):
            # prepare_fx on aten ops quantizes nothing, and "0/0 int8, 200 dB" would be a lie
            raise VerifyError(
                "prepare_fx quantizes nn.Modules, and this model is an exported (aten) graph such as a "
                ".pt2 holds: verify it with the pt2e flow (qlint.advice.verify_pt2e)"
            )
        return copied

    def _graph(self) -> fx.GraphModule:
        """The fx graph the plans' rewrites and the searches read."""
        try:
            # shares the private copy's modules: nothing verify runs writes them (rewrites copy first)
            return symbolic_graph(self.model)
        except TraceError as error:
            raise VerifyError(f"cannot trace the model with torch.fx: {error}") from error

    def coverage(self, converted: fx.GraphModule) -> tuple[int, int, list[str]]:
        """(int8 weighted ops, all of them, the float ones' names) of a quantized model, counted as
        lint's trial counts them (conv, linear, recurrent and attention layers)."""
        return weighted_coverage(converted)

    @staticmethod
    def run(model: nn.Module, batch: Any) -> Any:
        with torch.no_grad():
            return call_model(model, batch)

    # --- quantize -------------------------------------------------------------------
    def quantize(
        self, plan: QuantPlan, *, keep_prepared: bool = False, calibration: list[Any] | None = None
    ) -> Quantized:
        """``plan`` applied to the traced model exactly as ``QuantPlan.quantize`` applies it, calibrated
        on ``calibration`` (default: every calibration batch)."""
        kwargs: dict[str, Any] = {}
        if plan.equalization and self.equalization_qconfig is not None:
            kwargs["_equalization_config"] = plan.to_equalization_mapping(self.equalization_qconfig)
            plan = plan.model_copy(update={"equalization": []})  # torch equalizes instead of the rescale
        gm, applied = self._rewritten(plan)
        batches = self.calibration if calibration is None else calibration
        calibrated = None
        if not kwargs:  # torch's equalization scales activations while it calibrates: nothing to reuse
            graph_key = plan.model_dump_json(include={"rewrites", "equalization"}) + repr(plan.token_split_linears())
            calibrated = self._calibrated.setdefault((graph_key, tuple(map(id, batches))), CalibratedQParams())
        return quantize_rewritten(
            copy_sharing_parameters(gm),
            plan,
            batches,
            applied,
            keep_prepared=keep_prepared,
            prepare_kwargs=kwargs,
            calibrated=calibrated,
        )

    def _rewritten(self, plan: QuantPlan) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
        """The traced model with the plan's rewrites and equalization, reused while they stay the same.

        Each rewrite is checked against the float outputs (a copy and a forward pass per
        candidate), so redoing it for every trial would cost more than the trial's
        calibration on a model with many BN folds. The scheme search and the fallback change
        only module decisions, so one cached graph serves them all, except where a decision
        makes an equalized layer dynamic (its rescale differs) or a Linear whose split waits
        for it dynamic (the split then applies); one is kept at a time.
        A plan with neither quantizes the traced model itself (a copy of its modules)."""
        if not plan.rewrites and not plan.equalization:
            return self.traced, []
        key = plan.model_dump_json(include={"rewrites", "equalization"})
        key += repr((plan.dynamic_equalized_modules(), plan.token_split_linears()))
        if self._last_rewritten is None or self._last_rewritten[0] != key:
            self._last_rewritten = (key, *rewritten(self.traced, plan, self.calibration))
        return self._last_rewritten[1], self._last_rewritten[2]

    def equalizations(self, plan: QuantPlan) -> list[AppliedRewrite]:
        """The plan's equalization pairs as its quantization applied them (none when torch's
        ``_equalization_config`` equalizes instead)."""
        if self.equalization_qconfig is not None:
            return []
        return [applied for applied in self._rewritten(plan)[1] if applied.kind == "equalize"]

    # --- measure ----------------------------------------------------------------------
    def _output_sqnr(self, converted: nn.Module, batches: list[Any], references: list[Any]) -> float:
        sums = SqnrSums()
        for batch, reference in zip(batches, references):
            try:
                # GraphModule prints the generated code's traceback to stderr before raising;
                # the failure is reported as one line instead.
                with contextlib.redirect_stderr(io.StringIO()):
                    outputs = self.run(converted, batch)
            except Exception as error:  # convert_fx graphs can fail at run time (e.g. view)
                raise QuantizeError(f"the quantized model failed to run: {first_line(error)}") from error
            try:
                sums.add(reference, outputs)
            except ValueError as error:
                raise QuantizeError(f"the quantized model's outputs do not match the float model's: {error}") from error
        value = sums.sqnr_db()
        return SQNR_CAP_DB if value is None else value

    def measure(self, label: str, plan: QuantPlan, *, layers: Sequence[str] = (), evaluate: bool = True) -> Measured:
        try:
            return self._measure(label, plan, layers=layers, evaluate=evaluate)
        finally:
            _release_models()  # the quantized model is out of scope here

    def _measure(self, label: str, plan: QuantPlan, *, layers: Sequence[str] = (), evaluate: bool = True) -> Measured:
        """``plan`` quantized, run on the selection and eval batches, and measured (cached).

        With ``layers``, the per-layer activation SQNR of those modules on the eval batches
        too. ``evaluate=False`` measures what decisions need (selection SQNR, int8 coverage)
        and skips the eval batches, the size and ``eval_fn``. A cached measurement that lacks
        what is asked for is taken again. Not a trial: the caller decides what is measured
        outside the budget."""
        key = plan_key(plan)
        cached = self._measured.get(key)
        if cached is not None and (cached.evaluated or not evaluate) and (not layers or cached.layers is not None):
            return cached
        if self.progress is not None:
            self.progress(label, self.trials, self.max_trials)
        try:
            q = self.quantize(plan, keep_prepared=bool(layers))
            selection = self._output_sqnr(q.converted, self.selection, self._selection_reference)
            sqnr = self._output_sqnr(q.converted, self.eval_data, self._eval_reference) if evaluate else None
        except QuantizeError as error:
            failed = RunResult(
                label=label,
                sqnr_db=None,
                int8_layers=0,
                total_layers=0,
                int8_fraction=0.0,
                size_bytes=0,
                failure=str(error),
            )
            measured = Measured(FAILED, failed, {} if layers else None)
            self._measured[key] = measured
            return measured
        int8, total, floats = self.coverage(q.converted)
        metric = float(self.eval_fn(q.converted, self.eval_data)) if self.eval_fn is not None and evaluate else None
        result = RunResult(
            label=label,
            sqnr_db=None if sqnr is None else round(sqnr, 4),
            int8_layers=int8,
            total_layers=total,
            int8_fraction=round(int8 / total, 4) if total else 1.0,
            size_bytes=state_dict_bytes(q.converted) if evaluate else 0,
            metric=metric,
            float_modules=floats,
        )
        per_layer = self.layer_sqnr(q, layers, self.eval_data, self._output_scales(plan)) if layers else None
        measured = Measured(selection, result, per_layer, evaluated=evaluate)
        self._measured[key] = measured
        return measured

    def can_try(self, until: int | None = None) -> bool:
        """Whether the trial budget allows one more trial (and, with ``until``, a step's share of
        it: the trial count at which that step stops)."""
        return self.trials < (self.max_trials if until is None else min(until, self.max_trials))

    def left(self, until: int | None = None) -> int:
        """Trials the budget still allows (with ``until``, within a step's share)."""
        return max(0, (self.max_trials if until is None else min(until, self.max_trials)) - self.trials)

    @property
    def judged_in_sample(self) -> bool:
        """Whether :meth:`fitted_trial` judges on batches it also calibrated on: the default
        selection (the last 4 calibration batches) of 4 or fewer batches leaves none to hold apart."""
        return self.fit is self.calibration and any(s is c for s in self.selection for c in self.calibration)

    def share(self, trials: int) -> int:
        """The trial count at which a step given ``trials`` more trials stops (within the budget)."""
        return min(self.trials + max(0, trials), self.max_trials)

    def known(self, plan: QuantPlan) -> bool:
        return plan_key(plan) in self._measured

    def fitted_trial(self, label: str, plan: QuantPlan, *, swapped: bool = False) -> float:
        """The SQNR of ``plan`` calibrated on ``fit`` (the calibration batches that do not select) and
        run on the selection batches, or, ``swapped``, calibrated on the selection batches and run
        on ``fit``: two folds of held-apart data. One trial of the budget unless measured before;
        a plain trial when there is no batch to spare."""
        if self.fit is self.calibration:
            return self.trial(label, plan).selection_sqnr
        key = ("swapped:" if swapped else "fit:") + plan_key(plan)
        if key not in self._fitted:
            self.trials += 1
            if self.progress is not None:
                self.progress(label, self.trials, self.max_trials)
            if swapped and self._fit_reference is None:
                self._fit_reference = [float_tensors(self.run(self.model, batch)) for batch in self.fit]
            calibration, judged = (self.selection, self.fit) if swapped else (self.fit, self.selection)
            references = self._fit_reference if swapped else self._selection_reference
            try:
                self._fitted[key] = self._sqnr_when_calibrated(plan, calibration, judged, references or [])
            except QuantizeError:
                self._fitted[key] = FAILED
            finally:
                _release_models()  # the quantized model is out of scope here
        return self._fitted[key]

    def _sqnr_when_calibrated(
        self, plan: QuantPlan, calibration: list[Any], batches: list[Any], references: list[Any]
    ) -> float:
        q = self.quantize(plan, calibration=calibration)
        return self._output_sqnr(q.converted, batches, references)

    def trial(self, label: str, plan: QuantPlan) -> Measured:
        """A plan measured to decide something (on the selection batches only): one trial of the
        budget, unless measured before."""
        if not self.known(plan):
            self.trials += 1
        return self.measure(label, plan, evaluate=False)

    def _output_scales(self, plan: QuantPlan) -> dict[str, tuple[torch.Tensor, int]]:
        """Per layer whose output channels the plan's equalization rescaled (qlint's rescale):
        each channel's factor and the channel dim of its output."""
        scales: dict[str, tuple[torch.Tensor, int]] = {}
        equalized = self.equalizations(plan)
        if not equalized:
            return scales
        rewritten = self._rewritten(plan)[0]  # a rewrite may have made the layer: look there
        for rewrite in equalized:
            if rewrite.applied and rewrite.output_scale is not None:
                previous = rewrite.modules[0]
                layer = rewritten.get_submodule(previous)
                dim = -1 if isinstance(layer, (nn.Linear, nn.LayerNorm)) else 1
                scale = (torch.tensor(rewrite.output_scale, dtype=torch.float64), dim)
                scales[previous] = scale
                fused_into = _layer_fused_with_norm(rewritten, previous)
                if fused_into is not None:
                    scales[fused_into] = scale
        return scales

    def layer_sqnr(
        self,
        q: Quantized,
        fqns: Iterable[str],
        batches: list[Any],
        output_scales: Mapping[str, tuple[torch.Tensor, int]] | None = None,
    ) -> dict[str, float]:
        """Activation SQNR per module fqn: prepared (float + observers) vs converted outputs.

        The float pass keeps a copy of each layer's output (in-place ops downstream, such as
        ReLU6(inplace=True), change the output tensor itself); the quantized pass compares each
        output the moment it is made and drops the float copy, so at most one batch's float
        outputs are held. A layer in ``output_scales`` (equalization multiplied its output
        channels) is compared with both outputs divided back: as the original model computes it,
        where a channel scaled x1e4 to be dropped weighs what the next layer gives it."""
        if q.prepared is None:
            raise QlintError("per-layer SQNR needs the prepared model")
        return compare_layer_outputs(q.prepared, q.converted, list(fqns), batches, self.run, output_scales or {})

    def own_errors(self, plan: QuantPlan, fqns: Sequence[str]) -> dict[str, float]:
        """Each of ``fqns``' own error under ``plan``: its shadow SQNR (torch NS's definition: the
        float layer, from the prepared model, run on the dequantized input the quantized layer
        really gets) on the selection batches. Each layer's pair is compared the moment it is
        made, so nothing is held across layers. One quantization, counted as a trial; empty
        when the plan cannot be quantized."""
        self.trials += 1  # a quantization like any trial's
        if self.progress is not None:
            self.progress("per-layer sensitivity", self.trials, self.max_trials)
        try:
            q = self.quantize(plan, keep_prepared=True)
        except QuantizeError:
            return {}
        if q.prepared is None:
            return {}
        sums: dict[str, SqnrSums] = {}

        def compare(_m: nn.Module, args: tuple[Any, ...], output: Any, fqn: str, reference: nn.Module) -> None:
            x = args[0] if len(args) == 1 else None
            if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
                return
            expected = reference(x.dequantize() if x.is_quantized else x)
            got = output.dequantize() if output.is_quantized else output
            if isinstance(expected, torch.Tensor) and expected.shape == got.shape:
                sums.setdefault(fqn, SqnrSums()).add(expected, got)

        handles = []
        for fqn in fqns:
            try:
                layer, reference = q.converted.get_submodule(fqn), q.prepared.get_submodule(fqn)
            except AttributeError:
                continue
            hook = functools.partial(compare, fqn=fqn, reference=reference)
            handles.append(layer.register_forward_hook(hook))
        try:
            for batch in self.selection:
                self.run(q.converted, batch)
        except Exception:  # noqa: BLE001  # a converted model that fails to run has no ranking
            return {}
        finally:
            for h in handles:
                h.remove()
            del q
            _release_models()
        return {fqn: value for fqn, s in sums.items() if (value := s.sqnr_db()) is not None}

    def sensitivity_order(self, plan: QuantPlan, fqns: Sequence[str]) -> list[str]:
        """``fqns`` from the lowest own (shadow) SQNR under ``plan`` up; unmeasured ones last."""
        own = self.own_errors(plan, fqns)
        return sorted(fqns, key=lambda f: own.get(f, SQNR_CAP_DB))


def _layer_fused_with_norm(gm: fx.GraphModule, fqn: str) -> str | None:
    """The conv or Linear whose only consumer is the BatchNorm ``fqn``: prepare_fx fuses the
    norm into it, so that layer's output (the row verify shows) is the norm's, rescaled with it."""
    if not isinstance(gm.get_submodule(fqn), (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return None
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == fqn and node.args and isinstance(node.args[0], fx.Node):
            producer = node.args[0]
            if producer.op == "call_module" and len(producer.users) == 1:
                if isinstance(gm.get_submodule(str(producer.target)), (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                    return str(producer.target)
    return None
