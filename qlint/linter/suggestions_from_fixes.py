"""Reading a report's fixes into typed suggestions: :func:`collect_suggestions`.

Each finding's fix (a :data:`qlint.linter.fixes.Fix`) with its :class:`Provenance` goes into
a builder that merges, module by module, what the fixes ask (observer kind, dtype, range,
mode, keep float), equalization pairs, rewrites and functions kept float, on top of the
backend's defaults; what a plan cannot express becomes a note. The fix union is matched
exhaustively, so a new action fails the type checker until it is read here. The decisions
themselves are :mod:`qlint.linter.suggestions`'s models.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from qlint.core.function_paths import resolve_function
from qlint.linter.fixes import (
    BLOCKED_BY_FUNCTIONAL_OP,
    Equalize,
    Fix,
    Fuse,
    KeepFloat,
    KeepFloatFunction,
    NormalizeInput,
    QuantizeDynamicAfterConvert,
    RemoveModule,
    ReplaceActivation,
    SetActivationObserver,
    SetQConfig,
    SetWeightObserver,
    SplitLeadingToken,
    SplitModule,
    UnifyQConfig,
    ViewToReshape,
)
from qlint.linter.suggestions import (
    ONLY_DYNAMIC,
    EqualizationPair,
    FloatFunction,
    ModuleDecision,
    Provenance,
    Rewrite,
    RewriteKind,
    Suggestions,
    WeightSpec,
    backend_defaults,
)

_OBSERVER_KINDS = {
    "MinMaxObserver": "minmax",
    "PerChannelMinMaxObserver": "minmax",
    "MovingAverageMinMaxObserver": "moving_average",
    "MovingAveragePerChannelMinMaxObserver": "moving_average",
    "HistogramObserver": "histogram",
    "FixedQParamsObserver": "fixed",
    "PercentileObserver": "percentile",
}


def _observer_kind(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    return _OBSERVER_KINDS.get(name.rsplit(".", 1)[-1])


def _dtype(name: Any, allowed: Iterable[str]) -> str | None:
    if not isinstance(name, str):
        return None
    short = name.rsplit(".", 1)[-1]
    short = {"qint16": "int16", "quint16": "int16"}.get(short, short)
    return short if short in allowed else None


class _Builder:
    """Collects per-module changes from many suggestions, then freezes them."""

    def __init__(self, backend: str, model: str | None) -> None:
        self.backend, self.model = backend, model
        self.activation, self.weight = backend_defaults(backend)
        self.modules: dict[str, dict[str, Any]] = {}
        self.equalization: dict[str, dict[str, Any]] = {}
        self.rewrites: list[Rewrite] = []
        self.float_functions: dict[str, list[Provenance]] = {}
        self.notes: list[str] = []

    def module(self, fqn: str, source: Provenance) -> dict[str, Any]:
        entry = self.modules.setdefault(fqn, {"fqn": fqn, "activation": {}, "weight": {}, "provenance": []})
        if source not in entry["provenance"]:
            entry["provenance"].append(source)
        return entry

    def note(self, source: Provenance, text: str) -> None:
        self.notes.append(f"{source.describe()}: {text}")

    def _governing(self, fqn: str) -> dict[str, Any] | None:
        """The entry that decides module ``fqn``: its own, else its nearest ancestor's."""
        name = fqn
        while name not in self.modules:
            if "." not in name:
                return None
            name = name.rpartition(".")[0]
        return self.modules[name]

    def _splits_without_observer_conflicts(self) -> list[Rewrite]:
        """The rewrites, each token split without the Linears that a decision observes statically
        with an observer of their own. The split's parts read the Linear's input through
        ``torch.narrow``, whose observer is shared with its input and so also sees the first
        token alone: the observer chosen for the whole input (QL203's percentile) then measures
        something else. On MiniLM the two together measured 3.5 dB, the observer alone 5.6 dB.
        A static Linear's split gains nothing on its own (one range for both parts), so the
        observer is what stays."""
        kept: list[Rewrite] = []
        for rewrite in self.rewrites:
            if rewrite.kind != "split_leading_token" or rewrite.only_dynamic():  # that one leaves static Linears
                kept.append(rewrite)
                continue
            modules = []
            for fqn in rewrite.modules:
                entry = self._governing(fqn)
                static = entry is not None and entry.get("quantize", True) and entry.get("mode", "static") == "static"
                if entry is None or not (static and entry["activation"]):
                    modules.append(fqn)
                    continue
                why = "; ".join(p.describe() for p in entry["provenance"])
                self.notes.append(
                    f"{'; '.join(p.describe() for p in rewrite.provenance)}: {fqn} not split, as its static "
                    f"activation observer ({why}) would then also observe the first token alone"
                )
            if modules:
                kept.append(rewrite.model_copy(update={"modules": modules}))
        return kept

    def build(self) -> Suggestions:
        decisions = []
        for fqn, entry in self.modules.items():
            activation = self.activation.changed(**entry["activation"]) if entry["activation"] else None
            weight = self.weight.model_copy(update=entry["weight"]) if entry["weight"] else None
            if weight is not None:
                weight = WeightSpec(**weight.model_dump())  # re-validate
            decisions.append(
                ModuleDecision(
                    fqn=fqn,
                    quantize=entry.get("quantize", True),
                    mode=entry.get("mode", "static"),
                    activation=activation,
                    weight=weight,
                    provenance=entry["provenance"],
                )
            )
        pairs = [EqualizationPair(**e) for e in self.equalization.values()]
        rewrites = self._splits_without_observer_conflicts()  # before the notes: it adds to them
        return Suggestions(
            backend=self.backend,
            model=self.model,
            activation=self.activation,
            weight=self.weight,
            modules=decisions,
            equalization=pairs,
            rewrites=rewrites,
            float_functions=[FloatFunction(function=f, provenance=p) for f, p in self.float_functions.items()],
            notes=self.notes,
        )


def _apply_set_qconfig(b: _Builder, source: Provenance, fix: SetQConfig) -> None:
    if fix.by_op_type():
        # a functional op: set_module_name would name nothing (an aten node name does nothing)
        b.note(
            source,
            f"give {fix.object_type} its own qconfig by op type: mapping.set_object_type(...)"
            + (
                f" with {fix.activation} scale={fix.scale:g} zero_point={fix.zero_point}"
                if fix.scale is not None
                else ""
            ),
        )
        return
    if fix.fold_functional:
        _rewrite(b, source, "fold_bn_into_functional_conv", list(fix.fold_functional), {})
    if fix.observe_inputs:
        _rewrite(b, source, "observe_input", list(fix.observe_inputs), {})
    for fqn in fix.target_modules(str(source.target)):
        entry = b.module(fqn, source)
        if fix.mode is not None:
            entry["mode"] = fix.mode
        kind = _observer_kind(fix.activation) or _observer_kind(fix.observer)
        act = entry["activation"]
        if kind == "fixed" and fix.scale is not None and fix.zero_point is not None:
            act.update(
                observer="fixed", scale=fix.scale, zero_point=fix.zero_point, symmetric=False, reduce_range=False
            )
            dtype = _dtype(fix.dtype, ("quint8", "qint8"))
            if dtype:
                act["dtype"] = dtype
            if fix.quant_min is not None and fix.quant_max is not None:
                act.update(quant_min=fix.quant_min, quant_max=fix.quant_max)
            continue
        if kind is not None and kind != "fixed":
            act["observer"] = kind
        dtype = _dtype(fix.activation_dtype, ("quint8", "qint8", "int16"))
        if dtype:
            act["dtype"] = dtype
        if fix.quant_min is not None and fix.quant_max is not None:
            act.update(quant_min=fix.quant_min, quant_max=fix.quant_max)
        if fix.like is not None:
            entry["quantize"] = True


def _apply_set_weight(b: _Builder, source: Provenance, fix: SetWeightObserver) -> None:
    for fqn in fix.target_modules(str(source.target)):
        w = b.module(fqn, source)["weight"]
        observer = fix.observer or ""
        if fix.qscheme is not None:
            w["per_channel"] = "per_channel" in fix.qscheme
            w["symmetric"] = "symmetric" in fix.qscheme
        elif "PerChannel" in observer:
            w["per_channel"] = True
        if "MovingAverage" in observer:
            w["observer"] = "moving_average"
        dtype = _dtype(fix.dtype, ("qint8", "int16"))
        if dtype:
            w["dtype"] = dtype
        if fix.ch_axis is not None:
            w["ch_axis"] = fix.ch_axis
        if fix.quant_min is not None and fix.quant_max is not None:
            w.update(quant_min=fix.quant_min, quant_max=fix.quant_max)


def _apply_set_activation(b: _Builder, source: Provenance, fix: SetActivationObserver | UnifyQConfig) -> None:
    observer = fix.observer if isinstance(fix, SetActivationObserver) else fix.activation
    for fqn in fix.target_modules(str(source.target)):
        act = b.module(fqn, source)["activation"]
        kind = _observer_kind(observer)
        if kind is not None and kind != "fixed":
            act["observer"] = kind
        if isinstance(fix, SetActivationObserver):
            if fix.reduce_range is not None:
                act["reduce_range"] = fix.reduce_range
            if fix.percentile is not None:
                act.update(observer="percentile", percentile=fix.percentile)


def _rewrite(b: _Builder, source: Provenance, kind: RewriteKind, modules: list[str], params: dict[str, Any]) -> None:
    b.rewrites.append(Rewrite(kind=kind, modules=modules, params=params, provenance=[source]))


def _apply(b: _Builder, fix: Fix, source: Provenance) -> None:
    """One fix into the builder; every action is matched, so a new one fails the type checker."""
    target = str(source.target)
    match fix:
        case Fuse():
            functional = BLOCKED_BY_FUNCTIONAL_OP in fix.blockers and "batch_norm" in fix.pattern
            _rewrite(
                b,
                source,
                "fold_bn_into_functional_conv" if functional else "fuse",
                list(fix.modules),
                {"pattern": list(fix.pattern), "blockers": list(fix.blockers)},
            )
        case SplitModule():
            _rewrite(b, source, "split_module", [fix.module], {"copies": fix.copies})
        case RemoveModule():
            # a change to the model's source, not a rewrite: tracing already leaves an unused
            # module out of the graph the plan quantizes
            b.note(
                source, f"remove {fix.module} from the model (it is never called; the FX model already leaves it out)"
            )
        case ViewToReshape():
            _rewrite(b, source, "view_to_reshape", [fix.node], {"node": fix.node})
        case NormalizeInput():
            _rewrite(b, source, "normalize_input", list(fix.modules), {"input": fix.input})
        case SplitLeadingToken():
            _rewrite(
                b, source, "split_leading_token", list(fix.modules), {ONLY_DYNAMIC: True} if fix.only_dynamic else {}
            )
        case SetQConfig():
            _apply_set_qconfig(b, source, fix)
        case SetWeightObserver():
            _apply_set_weight(b, source, fix)
        case SetActivationObserver() | UnifyQConfig():
            _apply_set_activation(b, source, fix)
        case Equalize():
            entry = b.equalization.setdefault(
                fix.module, {"module": fix.module, "previous": fix.previous, "provenance": []}
            )
            entry["provenance"].append(source)
        case KeepFloat():
            for fqn in fix.target_modules(target):
                b.module(fqn, source)["quantize"] = False
        case KeepFloatFunction():
            for function in (fix.function, *fix.with_functions):
                try:
                    resolve_function(function)
                except ValueError:
                    b.note(source, f"keep {function} float: mapping.set_object_type({function}, None)")
                else:
                    sources = b.float_functions.setdefault(function, [])
                    if source not in sources:
                        sources.append(source)
        case ReplaceActivation():
            b.note(source, f"replace {', '.join(fix.modules)} with nn.ReLU (a change to the float model)")
        case QuantizeDynamicAfterConvert():
            b.note(source, f"after convert_fx, quantize_dynamic({fix.module}, {{{', '.join(fix.types)}}})")
        case _:
            _unmatched(fix)


def _unmatched(fix: NoReturn) -> NoReturn:
    """Reached only if a fix type has no case above: the type checker flags the call."""
    raise TypeError(f"no plan mapping for {type(fix).__name__}")


def collect_suggestions(backend: str, model: str | None, suggested: Iterable[tuple[Fix, Provenance]]) -> Suggestions:
    """Backend defaults plus each (fix, where it came from), in order."""
    builder = _Builder(backend, model)
    for fix, source in suggested:
        _apply(builder, fix, source)
    return builder.build()
