"""Verify a QuantPlan by quantizing twice and measuring: backend default vs the plan.

``verify(model, plan, calibration, eval_data)`` runs prepare_fx → calibrate → convert_fx
once with ``get_default_qconfig_mapping(backend)`` and once with the plan (its
float-preserving rewrites, ``to_qconfig_mapping()`` and equalization), then evaluates
both against the float model on the held-out ``eval_data``:

* output SQNR (dB, over all eval batches) and, with ``eval_fn``, the user's metric;
* per-layer activation SQNR, matched by module fqn (forward hooks on the prepared
  float-with-observers model vs the converted model, so fused modules compare like
  with like);
* int8 coverage of conv+linear ops, counted on the converted graph (quantized
  conv/linear modules and quantized functional calls over all conv/linear ops);
* model size (bytes of the serialized state_dict).

Then it prunes: every plan decision (module decision, equalization pair, applied
rewrite) is dropped when removing it does not lower SQNR (greedy, one pass). Then a
scheme search flips each Linear static <-> dynamic and keeps the flips that raise SQNR
(``search_schemes``; qlint/advice/verify_search.py). When ``target_sqnr`` is given and not met,
the most sensitive conv/linear layers (measured by the SQNR gained when each alone is
kept float) are kept float, as few as reach the target (at most ``max_float_fraction``
of the conv+linear layers); dynamic layers are candidates too.

Decisions are selected on ``eval_data`` (the batches the numbers are reported on);
pass separate held-out data to a second ``verify`` call for an unbiased estimate.
"""

from __future__ import annotations

import copy
import io
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from pydantic import BaseModel, ConfigDict, Field

from qlint.errors import ConfigError, QlintError
from qlint.numeric.metrics import sqnr_db_from_powers
from qlint.advice.plan import Provenance, QuantPlan, Rewrite, default_plan
from qlint.advice.rewrite import AppliedRewrite, apply_equalization, apply_rewrites, rewrite_key

SQNR_TOLERANCE_DB = 1e-3  # "does not lower SQNR": a removal that costs less than this is noise


class VerifyError(QlintError):
    """The model could not be quantized or evaluated under a plan."""


# ------------------------------------------------------------------------------ report
class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class RunResult(_Model):
    """One quantized model, measured against the float model on the eval batches."""

    label: str
    sqnr_db: float
    int8_layers: int = Field(description="conv+linear ops that run in int8 after convert_fx")
    total_layers: int = Field(description="all conv+linear ops in the converted graph")
    int8_fraction: float
    size_bytes: int
    metric: Optional[float] = None
    float_modules: list[str] = Field(default_factory=list, description="conv/linear modules left float")


class LayerComparison(_Model):
    fqn: str
    kind: str
    default_sqnr_db: Optional[float] = None
    plan_sqnr_db: Optional[float] = None
    default_int8: Optional[bool] = None
    plan_int8: Optional[bool] = None


class DecisionOutcome(_Model):
    kind: str  # module | equalization | rewrite | plan | scheme | keep_float
    target: str
    kept: bool
    sqnr_with_db: Optional[float] = None
    sqnr_without_db: Optional[float] = None
    detail: str = ""


class VerifyReport(_Model):
    """Default mapping vs verified plan, side by side. JSON round-trips via model_dump_json."""

    type: str = "qlint.VerifyReport"
    backend: str
    model: Optional[str] = None
    eval_batches: int
    calibration_batches: int
    target_sqnr_db: Optional[float] = None
    target_met: Optional[bool] = None
    float_metric: Optional[float] = None
    default: RunResult
    requested: RunResult = Field(description="the plan as given (after its rewrites), before pruning")
    plan: RunResult = Field(description="the verified plan")
    layers: list[LayerComparison] = Field(default_factory=list)
    decisions: list[DecisionOutcome] = Field(default_factory=list)
    rewrites: list[AppliedRewrite] = Field(default_factory=list)
    kept_float: list[str] = Field(default_factory=list)
    float_layer_fraction: float = 0.0
    verified_plan: QuantPlan
    notes: list[str] = Field(default_factory=list)

    @property
    def sqnr_gain_db(self) -> float:
        return self.plan.sqnr_db - self.default.sqnr_db


# ------------------------------------------------------------------------------ helpers
def _as_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    raise VerifyError(f"a batch is a {type(batch).__name__}; expected a tensor, a tuple of tensors or a dict")


def _batches(data: Any, what: str) -> list[Any]:
    if data is None:
        raise ConfigError(f"verify needs {what} batches")
    if isinstance(data, (torch.Tensor, dict)):
        data = [data]
    batches = list(data)
    if not batches:
        raise ConfigError(f"verify got no {what} batches")
    return batches


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    while isinstance(value, (tuple, list)):
        if not value:
            return None
        value = value[0]
    if isinstance(value, dict):
        value = next(iter(value.values()), None)
        return _first_tensor(value)
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_quantized:
        value = value.dequantize()
    return value.detach().float() if value.is_floating_point() else None


def _flat_outputs(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(value, torch.Tensor):
        t = value.dequantize() if value.is_quantized else value
        if t.is_floating_point():
            out.append(t.detach().float())
    elif isinstance(value, (tuple, list)):
        for v in value:
            out += _flat_outputs(v)
    elif isinstance(value, dict):
        for v in value.values():
            out += _flat_outputs(v)
    return out


def _run(model: nn.Module, batch: Any) -> Any:
    args, kwargs = _as_args(batch)
    with torch.no_grad():
        return model(*args, **kwargs)


def state_dict_bytes(model: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


_CONV_LINEAR_FUNCTIONS = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                          "conv_transpose3d", "linear"}


def _function_name(target: Any) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return name.split(".")[-1]


def _is_quantized_module(module: nn.Module) -> bool:
    path = type(module).__module__
    return path.startswith("torch.ao.nn.quantized") or path.startswith("torch.ao.nn.intrinsic.quantized")


def _conv_linear_kind(module: nn.Module) -> Optional[str]:
    """'conv' / 'linear' for a float or quantized conv/linear module (fused ones included)."""
    name = type(module).__name__.lower()
    if "conv" in name:
        return "conv"
    if "linear" in name and "bilinear" not in name:
        return "linear"
    return None


def conv_linear_coverage(converted: fx.GraphModule) -> tuple[int, int, list[str]]:
    """(int8 conv/linear ops, all conv/linear ops, float conv/linear names) in a converted graph."""
    int8 = total = 0
    float_names: list[str] = []
    for node in converted.graph.nodes:
        if node.op == "call_module":
            module = converted.get_submodule(str(node.target))
            if _conv_linear_kind(module) is None:
                continue
            total += 1
            if _is_quantized_module(module):
                int8 += 1
            else:
                float_names.append(str(node.target))
        elif node.op == "call_function":
            name = _function_name(node.target)
            base = name.replace("_relu", "").replace(".default", "")
            if base in _CONV_LINEAR_FUNCTIONS or base.rstrip("_prepack") in _CONV_LINEAR_FUNCTIONS:
                if "prepack" in name or "unpack" in name:
                    continue
                total += 1
                qualified = str(getattr(node.target, "__module__", "")) + str(node.target)
                if "quantized" in qualified:
                    int8 += 1
                else:
                    float_names.append(node.name)
    return int8, total, float_names


class _Quantized:
    def __init__(self, prepared: fx.GraphModule, converted: fx.GraphModule) -> None:
        self.prepared, self.converted = prepared, converted


def _default_equalization_mapping(plan: QuantPlan, equalization_qconfig: Any):
    if not plan.equalization or equalization_qconfig is None:
        return None
    return plan.to_equalization_mapping(equalization_qconfig)


def _backend_config(backend: str):
    from torch.ao.quantization import backend_config as bc
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config

    return {"x86": get_x86_backend_config, "fbgemm": bc.get_fbgemm_backend_config,
            "qnnpack": bc.get_qnnpack_backend_config, "onednn": bc.get_onednn_backend_config}[backend]()


class _Session:
    """Shared state of one verify call: float model, data, and a cache of measured plans."""

    def __init__(self, model: nn.Module, calibration: list[Any], eval_data: list[Any], backend: str,
                 equalization_qconfig: Any, eval_fn: Optional[Callable[[nn.Module, Any], float]]) -> None:
        self.model = copy.deepcopy(model).eval()
        self.calibration, self.eval_data = calibration, eval_data
        self.backend, self.equalization_qconfig, self.eval_fn = backend, equalization_qconfig, eval_fn
        self.example = _as_args(calibration[0])[0]
        self.reference = [_flat_outputs(_run(self.model, b)) for b in eval_data]
        self.cache: dict[str, tuple[float, int]] = {}
        try:
            self.traced = fx.symbolic_trace(copy.deepcopy(self.model))
        except Exception as error:  # user forward may not be symbolically traceable
            raise VerifyError(f"cannot trace the model with torch.fx: {type(error).__name__}: {error}") from error

    # --- quantize -------------------------------------------------------------------
    def rewritten(self, plan: QuantPlan, skip: Sequence[str] = ()) -> tuple[fx.GraphModule, list[AppliedRewrite]]:
        gm, applied = apply_rewrites(self.traced, plan, self.example, skip=skip)
        if plan.equalization and self.equalization_qconfig is None:
            gm, equalized = apply_equalization(gm, [p.module for p in plan.equalization], self.calibration)
            applied = applied + equalized
        return gm, applied

    def quantize(self, gm: nn.Module, plan: Optional[QuantPlan]) -> _Quantized:
        from torch.ao.quantization import get_default_qconfig_mapping
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        mapping = plan.to_qconfig_mapping() if plan is not None else get_default_qconfig_mapping(self.backend)
        for name, module in gm.named_modules():  # a fan-out copy follows its original's decision
            origin = getattr(module, "qlint_fanout_of", None)
            if origin in mapping.module_name_qconfigs:
                mapping.set_module_name(name, mapping.module_name_qconfigs[origin])
        eq = _default_equalization_mapping(plan, self.equalization_qconfig) if plan is not None else None
        try:
            kwargs = {"_equalization_config": eq} if eq is not None else {}
            prepared = prepare_fx(copy.deepcopy(gm).eval(), mapping, self.example,
                                  backend_config=_backend_config(self.backend), **kwargs)
            for batch in self.calibration:
                _run(prepared, batch)
            converted = convert_fx(copy.deepcopy(prepared), backend_config=_backend_config(self.backend))
        except QlintError:
            raise
        except Exception as error:  # torch raises many kinds for unsupported graphs
            raise VerifyError(f"quantizing failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}") \
                from error
        return _Quantized(prepared, converted)

    # --- measure ----------------------------------------------------------------------
    def output_sqnr(self, converted: nn.Module) -> float:
        signal = noise = 0.0
        for batch, reference in zip(self.eval_data, self.reference):
            try:
                outputs = _flat_outputs(_run(converted, batch))
            except Exception as error:  # convert_fx graphs can fail at run time (e.g. view)
                raise VerifyError(f"the quantized model failed to run: {type(error).__name__}: "
                                  f"{str(error).splitlines()[0][:200]}") from error
            for a, b in zip(reference, outputs):
                a64, b64 = a.double(), b.double().reshape(a.shape)
                signal += float((a64 * a64).sum())
                noise += float(((a64 - b64) ** 2).sum())
        return sqnr_db_from_powers(signal, noise)

    def measure(self, label: str, gm: nn.Module, plan: Optional[QuantPlan]) -> tuple[RunResult, _Quantized]:
        q = self.quantize(gm, plan)
        sqnr = self.output_sqnr(q.converted)
        int8, total, floats = conv_linear_coverage(q.converted)
        metric = float(self.eval_fn(q.converted, self.eval_data)) if self.eval_fn is not None else None
        result = RunResult(label=label, sqnr_db=round(sqnr, 4), int8_layers=int8, total_layers=total,
                           int8_fraction=round(int8 / total, 4) if total else 1.0,
                           size_bytes=state_dict_bytes(q.converted), metric=metric, float_modules=floats)
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

    def layer_sqnr(self, q: _Quantized, fqns: Iterable[str]) -> dict[str, float]:
        """Activation SQNR per module fqn: prepared (float + observers) vs converted outputs."""
        sums: dict[str, list[float]] = {}
        captured: dict[tuple[str, str], Optional[torch.Tensor]] = {}
        handles = []
        for side, model in (("float", q.prepared), ("quant", q.converted)):
            for fqn in fqns:
                try:
                    module = model.get_submodule(fqn)
                except AttributeError:
                    continue

                def hook(_m, _i, output, key=(side, fqn)):
                    value = _first_tensor(output)
                    # A copy: in-place ops downstream (ReLU6(inplace=True)) change the output tensor itself.
                    captured[key] = None if value is None else value.clone()

                handles.append(module.register_forward_hook(hook))
        try:
            for batch in self.eval_data:
                captured.clear()
                _run(q.prepared, batch)
                _run(q.converted, batch)
                for fqn in fqns:
                    a, b = captured.get(("float", fqn)), captured.get(("quant", fqn))
                    if a is None or b is None or a.shape != b.shape:
                        continue
                    entry = sums.setdefault(fqn, [0.0, 0.0])
                    entry[0] += float((a.double() ** 2).sum())
                    entry[1] += float(((a.double() - b.double()) ** 2).sum())
        finally:
            for h in handles:
                h.remove()
        return {fqn: round(sqnr_db_from_powers(s, n), 4) for fqn, (s, n) in sums.items()}


def _conv_linear_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if name and isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))]


def _functional_owners(gm: fx.GraphModule) -> list[str]:
    """Modules owning the weight of a functional conv/linear call (a traced-through conv subclass)."""
    owners: list[str] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and _function_name(node.target) in _CONV_LINEAR_FUNCTIONS:
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if isinstance(weight, fx.Node) and weight.op == "get_attr":
                owner = str(weight.target).rpartition(".")[0]
                if owner and owner not in owners:
                    owners.append(owner)
    return owners


def _without_module(plan: QuantPlan, fqn: str) -> QuantPlan:
    return plan.model_copy(update={"modules": [d for d in plan.modules if d.fqn != fqn]})


def _without_pair(plan: QuantPlan, module: str) -> QuantPlan:
    return plan.model_copy(update={"equalization": [p for p in plan.equalization if p.module != module]})


# --------------------------------------------------------------------------------- API
def verify(model: nn.Module, plan: Optional[QuantPlan], calibration: Any, eval_data: Any, *,
           backend: Optional[str] = None, target_sqnr: Optional[float] = None,
           eval_fn: Optional[Callable[[nn.Module, Any], float]] = None,
           equalization_qconfig: Any = None, prune: bool = True,
           max_float_fraction: float = 1.0, max_sensitivity_trials: int = 12,
           search_schemes: bool = True, max_scheme_trials: int = 24,
           model_name: Optional[str] = None) -> VerifyReport:
    """Quantize ``model`` with the backend default and with ``plan``; measure, prune, search, fall back.

    ``calibration`` and ``eval_data`` are iterables of batches (a tensor, a tuple of
    positional tensors, or a dict of keyword tensors). ``eval_fn(quantized_model,
    eval_data) -> float`` adds the user's metric (also computed for the float model).
    The plan's equalization pairs are realized by :func:`qlint.advice.rewrite.apply_equalization`
    (a float-preserving cross-layer rescale using calibration ranges); pass torch's
    ``equalization_qconfig`` to use prepare_fx's ``_equalization_config`` instead.
    ``search_schemes`` tries each Linear static <-> dynamic after pruning (at most
    ``max_scheme_trials`` trial quantizations; with ``prune=False`` the plan's own decisions
    are not flipped). ``max_float_fraction`` caps how many conv/linear layers the
    target-SQNR fallback may keep float.
    """
    if not isinstance(model, nn.Module):
        raise VerifyError(f"expected an nn.Module, got {type(model).__name__}")
    plan = plan if plan is not None else default_plan(backend or "x86")
    backend = backend or plan.backend
    if backend != plan.backend:
        plan = plan.model_copy(update={"backend": backend})
    notes: list[str] = []
    session = _Session(model, _batches(calibration, "calibration"), _batches(eval_data, "eval"), backend,
                       equalization_qconfig, eval_fn)
    float_metric = float(eval_fn(session.model, session.eval_data)) if eval_fn is not None else None

    default, default_q = session.measure("default", session.traced, None)
    rewritten, applied = session.rewritten(plan)
    requested, _ = session.measure("plan as given", rewritten, plan)

    # --- greedy pruning ---------------------------------------------------------------
    outcomes: list[DecisionOutcome] = []
    skip: list[str] = []
    current = plan
    best = session.plan_sqnr(current)
    if prune:
        for decision in list(plan.modules):
            trial = _without_module(current, decision.fqn)
            without = session.plan_sqnr(trial, skip)
            drop = without >= best - SQNR_TOLERANCE_DB
            outcomes.append(DecisionOutcome(kind="module", target=decision.fqn, kept=not drop,
                                            sqnr_with_db=round(best, 4), sqnr_without_db=round(without, 4),
                                            detail=decision.describe()))
            if drop:
                current, best = trial, max(best, without)
        for pair in list(plan.equalization):
            trial = _without_pair(current, pair.module)
            without = session.plan_sqnr(trial, skip)
            drop = without >= best - SQNR_TOLERANCE_DB
            outcomes.append(DecisionOutcome(kind="equalization", target=pair.module, kept=not drop,
                                            sqnr_with_db=round(best, 4), sqnr_without_db=round(without, 4)))
            if drop:
                current, best = trial, max(best, without)
        for record in applied:
            if not record.applied or record.kind == "equalize":
                continue
            key = rewrite_key(record.kind, record.nodes)
            without = session.plan_sqnr(current, skip + [key])
            drop = without >= best - SQNR_TOLERANCE_DB
            outcomes.append(DecisionOutcome(kind="rewrite", target=key, kept=not drop,
                                            sqnr_with_db=round(best, 4), sqnr_without_db=round(without, 4),
                                            detail=", ".join(record.modules)))
            if drop:
                skip.append(key)
                best = max(best, without)
        # Every kept decision helps given the others, yet decisions interact: together they
        # can still lose to the backend default. Then none of them is worth keeping.
        skip_all = sorted({rewrite_key(a.kind, a.nodes) for a in applied if a.applied} | set(skip))
        fresh = default_plan(backend).model_copy(update={"model": plan.model})
        fresh_sqnr = session.plan_sqnr(fresh, skip_all)
        if best < fresh_sqnr - SQNR_TOLERANCE_DB:
            outcomes.append(DecisionOutcome(kind="plan", target="every remaining decision", kept=False,
                                            sqnr_with_db=round(best, 4), sqnr_without_db=round(fresh_sqnr, 4),
                                            detail="together they lose to the backend default"))
            notes.append(f"the pruned plan ({best:.2f} dB) lost to the backend default ({fresh_sqnr:.2f} dB): "
                         "verify continued from the default")
            current, skip, best = fresh, skip_all, fresh_sqnr

    # --- scheme search, then target-SQNR fallback (qlint/advice/verify_search.py) --------------
    from qlint.advice.verify_search import float_fallback, scheme_search

    if search_schemes:
        frozen = [] if prune else [d.fqn for d in plan.modules]  # --no-prune: plan decisions stay as given
        current, best, tried = scheme_search(session, current, best, skip, max_trials=max_scheme_trials,
                                             frozen=frozen)
        outcomes += tried
    kept_float: list[str] = []
    target_met: Optional[bool] = None
    if target_sqnr is not None:
        current, best, kept_float, tried, note = float_fallback(
            session, current, best, skip, target_sqnr=target_sqnr, max_float_fraction=max_float_fraction,
            max_trials=max_sensitivity_trials, total_layers=default.total_layers)
        outcomes += tried
        target_met = best >= target_sqnr
        notes += [note] if note else []

    final_gm, final_applied = session.rewritten(current, skip)
    final_rewrites = [r for r in current.rewrites]
    verified_plan = current.model_copy(update={"rewrites": final_rewrites})
    plan_result, plan_q = session.measure("verified plan", final_gm, verified_plan)
    kept_keys = {rewrite_key(a.kind, a.nodes) for a in final_applied if a.applied}
    rewrites_report = [a if (rewrite_key(a.kind, a.nodes) in kept_keys or not a.applied)
                       else a.model_copy(update={"applied": False, "reason": "pruned: did not raise SQNR"})
                       for a in applied]
    verified_plan = _record_rewrites(verified_plan, rewrites_report)

    fqns = _conv_linear_modules(session.traced)
    default_layers = session.layer_sqnr(default_q, fqns)
    plan_layers = session.layer_sqnr(plan_q, fqns)
    default_float, plan_float = set(default.float_modules), set(plan_result.float_modules)
    layers = [LayerComparison(fqn=f, kind=type(session.traced.get_submodule(f)).__name__,
                              default_sqnr_db=default_layers.get(f), plan_sqnr_db=plan_layers.get(f),
                              default_int8=f not in default_float, plan_int8=f not in plan_float)
              for f in fqns]
    float_fraction = 1.0 - plan_result.int8_fraction
    return VerifyReport(
        backend=backend, model=model_name or plan.model or type(model).__name__,
        eval_batches=len(session.eval_data), calibration_batches=len(session.calibration),
        target_sqnr_db=target_sqnr, target_met=target_met, float_metric=float_metric,
        default=default, requested=requested, plan=plan_result, layers=layers, decisions=outcomes,
        rewrites=rewrites_report, kept_float=kept_float, float_layer_fraction=round(float_fraction, 4),
        verified_plan=verified_plan, notes=notes)


def _record_rewrites(plan: QuantPlan, applied: Sequence[AppliedRewrite]) -> QuantPlan:
    """Add applied rewrites that the plan did not list, so the verified plan names every change."""
    rewrites = list(plan.rewrites)
    for a in applied:
        if a.applied and not a.requested_by_plan:
            rewrites.append(Rewrite(kind=a.kind, modules=list(a.modules), params={"nodes": list(a.nodes)},  # type: ignore[arg-type]
                                    provenance=[Provenance(source="measurement", metric="float relative error",
                                                           value=a.max_relative_error or 0.0,
                                                           detail="detected by qlint.advice.rewrite")]))
    return plan.model_copy(update={"rewrites": rewrites})


__all__ = ["VerifyReport", "RunResult", "LayerComparison", "DecisionOutcome", "VerifyError", "verify",
           "conv_linear_coverage", "state_dict_bytes"]
