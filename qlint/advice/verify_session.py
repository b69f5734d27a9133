"""The measuring bench of one verify call: quantize a model under a plan, run it, measure it.

A :class:`Session` holds the float model (a private copy), its calibration and eval
batches and the float outputs on them, and caches every plan it has measured, so the
pruning and search steps of :func:`qlint.advice.verify.verify` never quantize the same
plan twice.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import get_default_qconfig_mapping

from qlint.advice.plan import QuantPlan
from qlint.advice.verify_report import RunResult
from qlint.core.batches import as_call, batches_of, call_model
from qlint.core.nested import first_float, float_tensors
from qlint.core.ops import (
    CONV_OR_LINEAR_KINDS,
    TRANSPOSED_CONV_KINDS,
    function_kind,
    function_op,
    is_aten_graph,
    module_kind,
    quantized_form,
)
from qlint.core.sqnr import SQNR_CAP_DB, SqnrSums
from qlint.core.trace import symbolic_graph
from qlint.errors import ConfigError, QlintError, TraceError
from qlint.measure.rewrite import AppliedRewrite, apply_equalization, apply_rewrites, fanout_follows_original
from qlint.measure.trial import TrialStepError, quantize_fx

SQNR_TOLERANCE_DB = 1e-3  # "does not lower SQNR": a change that costs less than this is noise

# The ops int8 coverage counts: every convolution and linear layer.
_COVERED_KINDS = CONV_OR_LINEAR_KINDS | TRANSPOSED_CONV_KINDS


class VerifyError(QlintError):
    """The model could not be quantized or evaluated under a plan."""


def batch_list(data: Any, what: str) -> list[Any]:
    """Every batch of ``data``, read once; verify runs them many times."""
    if data is None:
        raise ConfigError(f"verify needs {what} batches")
    batches = list(batches_of(data, f"{what} data"))
    if not batches:
        raise ConfigError(f"verify got no {what} batches")
    return batches


def state_dict_bytes(model: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def conv_linear_coverage(converted: fx.GraphModule) -> tuple[int, int, list[str]]:
    """(int8 conv/linear ops, all conv/linear ops, float conv/linear names) in a converted graph."""
    int8 = total = 0
    float_names: list[str] = []
    for node in converted.graph.nodes:
        if node.op == "call_module":
            module = converted.get_submodule(str(node.target))
            if module_kind(module) not in _COVERED_KINDS:
                continue
            total += 1
            if quantized_form(module) is not None:
                int8 += 1
            else:
                float_names.append(str(node.target))
        elif node.op == "call_function":
            op = function_op(node.target)
            if op.kind not in _COVERED_KINDS:
                continue  # weight packing (quantized::linear_prepack) has a kind of its own
            total += 1
            if op.quantized:
                int8 += 1
            else:
                float_names.append(node.name)
    return int8, total, float_names


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
class Quantized:
    prepared: fx.GraphModule  # float model with observers, calibrated
    converted: fx.GraphModule


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


class Session:
    """Shared state of one verify call: float model, data, and a cache of measured plans."""

    def __init__(
        self,
        model: nn.Module,
        calibration: list[Any],
        eval_data: list[Any],
        backend: str,
        equalization_qconfig: Any,
        eval_fn: Callable[[nn.Module, Any], float] | None,
    ) -> None:
        self.model = copy.deepcopy(model).eval()
        self.calibration, self.eval_data = calibration, eval_data
        self.backend, self.equalization_qconfig, self.eval_fn = backend, equalization_qconfig, eval_fn
        self.example = as_call(calibration[0], what="calibration batch 0")[0]
        self.reference = [float_tensors(self.run(self.model, batch)) for batch in eval_data]
        self.cache: dict[str, tuple[float, int]] = {}
        if is_aten_graph(self.model):
            # prepare_fx on aten ops quantizes nothing, and "0/0 int8, 200 dB" would be a lie
            raise VerifyError(
                "verify quantizes nn.Modules with prepare_fx/convert_fx, and this model is an exported "
                "(aten) graph such as a .pt2 holds; verify the nn.Module instead (module:factory with --weights)"
            )
        try:
            self.traced = symbolic_graph(copy.deepcopy(self.model))
        except TraceError as error:
            raise VerifyError(f"cannot trace the model with torch.fx: {error}") from error

    @staticmethod
    def run(model: nn.Module, batch: Any) -> Any:
        with torch.no_grad():
            return call_model(model, batch)

    # --- quantize -------------------------------------------------------------------
    def rewritten(self, plan: QuantPlan, skip: Sequence[str] = ()) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
        gm, applied = apply_rewrites(self.traced, plan, self.example, skip=skip)
        if plan.equalization and self.equalization_qconfig is None:
            gm, equalized = apply_equalization(gm, [p.module for p in plan.equalization], self.calibration)
            applied = applied + equalized
        return gm, applied

    def quantize(self, gm: nn.Module, plan: QuantPlan | None) -> Quantized:
        mapping = plan.to_qconfig_mapping() if plan is not None else get_default_qconfig_mapping(self.backend)
        mapping = fanout_follows_original(mapping, gm)
        kwargs: dict[str, Any] = {}
        if plan is not None and plan.equalization and self.equalization_qconfig is not None:
            kwargs["_equalization_config"] = plan.to_equalization_mapping(self.equalization_qconfig)
        try:
            converted, prepared = quantize_fx(
                copy.deepcopy(gm), mapping, self.backend, self.calibration, prepare_kwargs=kwargs, keep_prepared=True
            )
        except TrialStepError as step:  # torch raises many kinds for unsupported graphs
            raise VerifyError(f"quantizing failed: {_first_line(step.failure.error)}") from step.failure.error
        if prepared is None:
            raise VerifyError("quantizing failed: no prepared model was kept")
        return Quantized(prepared, converted)

    # --- measure ----------------------------------------------------------------------
    def output_sqnr(self, converted: nn.Module) -> float:
        sums = SqnrSums()
        for batch, reference in zip(self.eval_data, self.reference):
            try:
                outputs = self.run(converted, batch)
            except Exception as error:  # convert_fx graphs can fail at run time (e.g. view)
                raise VerifyError(f"the quantized model failed to run: {_first_line(error)}") from error
            try:
                sums.add(reference, outputs)
            except ValueError as error:
                raise VerifyError(f"the quantized model's outputs do not match the float model's: {error}") from error
        value = sums.sqnr_db()
        return SQNR_CAP_DB if value is None else value

    def measure(self, label: str, gm: nn.Module, plan: QuantPlan | None) -> tuple[RunResult, Quantized]:
        q = self.quantize(gm, plan)
        sqnr = self.output_sqnr(q.converted)
        int8, total, floats = conv_linear_coverage(q.converted)
        metric = float(self.eval_fn(q.converted, self.eval_data)) if self.eval_fn is not None else None
        result = RunResult(
            label=label,
            sqnr_db=round(sqnr, 4),
            int8_layers=int8,
            total_layers=total,
            int8_fraction=round(int8 / total, 4) if total else 1.0,
            size_bytes=state_dict_bytes(q.converted),
            metric=metric,
            float_modules=floats,
        )
        return result, q

    def plan_point(self, plan: QuantPlan, skip_rewrites: Sequence[str] = ()) -> tuple[float, int]:
        """(output SQNR, int8 conv+linear ops) of a plan, cached."""
        key = plan.model_dump_json() + "|" + ",".join(sorted(skip_rewrites))
        if key not in self.cache:
            gm, _ = self.rewritten(plan, skip_rewrites)
            converted = self.quantize(gm, plan).converted
            self.cache[key] = (self.output_sqnr(converted), conv_linear_coverage(converted)[0])
        return self.cache[key]

    def plan_sqnr(self, plan: QuantPlan, skip_rewrites: Sequence[str] = ()) -> float:
        return self.plan_point(plan, skip_rewrites)[0]

    def layer_sqnr(self, q: Quantized, fqns: Iterable[str]) -> dict[str, float]:
        """Activation SQNR per module fqn: prepared (float + observers) vs converted outputs."""
        fqns = list(fqns)
        sums: dict[str, SqnrSums] = {}
        captured: dict[tuple[str, str], torch.Tensor | None] = {}
        handles = []
        for side, model in (("float", q.prepared), ("quant", q.converted)):
            for fqn in fqns:
                try:
                    module = model.get_submodule(fqn)
                except AttributeError:
                    continue

                def hook(_m, _i, output, key=(side, fqn)):
                    value = first_float(output)
                    # A copy: in-place ops downstream (ReLU6(inplace=True)) change the output tensor itself.
                    captured[key] = None if value is None else value.clone()

                handles.append(module.register_forward_hook(hook))
        try:
            for batch in self.eval_data:
                captured.clear()
                self.run(q.prepared, batch)
                self.run(q.converted, batch)
                for fqn in fqns:
                    a, b = captured.get(("float", fqn)), captured.get(("quant", fqn))
                    if a is None or b is None or a.shape != b.shape:
                        continue
                    sums.setdefault(fqn, SqnrSums()).add(a, b)
        finally:
            for h in handles:
                h.remove()
        return {fqn: round(s.sqnr_db() or 0.0, 4) for fqn, s in sums.items()}
