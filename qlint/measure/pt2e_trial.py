"""The trial quantization of an exported (aten) graph, such as a ``.pt2`` holds: torch's pt2e flow.

prepare_fx quantizes torch-level graphs of nn.Modules; an exported program is an aten
graph, and the flow its users run is pt2e: ``prepare_pt2e`` with a quantizer,
calibration, ``convert_pt2e``. For the x86 backends the quantizer is torchao's
``X86InductorQuantizer`` (the optional extra ``qlint[pt2e]``). The converted graph holds
quantize/dequantize pairs around the float ops (torch's reference representation):
running it gives the int8 model's numerics.

The intent is a QConfigMapping, as for the FX trial, translated into the quantizer by
:func:`quantizer_for`: the global qconfig becomes the quantizer's static config; a None
qconfig by module name, module type or function leaves those ops float; a dynamic
qconfig on a Linear becomes the quantizer's dynamic config. A module-name entry that
changes only the activation observer (a clipping percentile, min/max or histogram observer)
re-annotates that module's activations (:mod:`qlint.measure.pt2e_quantizer`). Any other
change (a weight observer, a dtype, a scheme, a type-wide observer) has no pt2e equivalent
here, and such a trial is not run.

What the trial records (:class:`~qlint.measure.trial.TrialResult`, as the FX trial):

- the output SQNR on the evaluation batches;
- per conv/linear op its propagated SQNR, and per int8 one its shadow SQNR; per quantized
  activation the SQNR under the qparams it got (:mod:`qlint.measure.pt2e_errors`);
- the weighted ops left float, and why.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.qconfig import qconfig_equals

from qlint.core.batches import call_model
from qlint.measure.fallback import RECURRENT_KINDS, FallbackReason, FloatLayer, asks_float
from qlint.measure.pt2e_errors import measure_errors, runs_int8, weighted_ops
from qlint.measure.trial import (
    STAGE_CALIBRATE,
    STAGE_FLOAT,
    STAGE_RUN,
    LayerError,
    TrialFailure,
    TrialResult,
    TrialStepError,
)
from qlint.measure.trial_bench import TrialBench

STAGE_PREPARE_PT2E, STAGE_CONVERT_PT2E = "prepare_pt2e", "convert_pt2e"
# X86InductorQuantizer's activations: uint8 over 0..255, the number format quantizer_for and
# the plan's pt2e export keep for every activation
PT2E_ACTIVATION_LEVELS = 256
PT2E_BACKENDS = ("x86", "fbgemm", "onednn")
QUANTIZER_MODULE = "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer"
FLOW_MODULE = "torchao.quantization.pt2e.quantize_pt2e"
# torchao's first import logs warnings about its optional CUDA kernels, and torch's pytree
# one about the enums torchao registers: noise in a CPU lint run
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def import_torchao(module: str) -> Any:
    """Import a torchao module without its import-time warnings (the loggers' levels are restored)
    and without the warning filters its import installs process-wide."""
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        for logger, level in zip(loggers, levels):
            stack.callback(logger.setLevel, level)
            logger.setLevel(logging.ERROR)
        return importlib.import_module(module)


def pt2e_blocker(backend: str) -> str | None:
    """Why the pt2e trial cannot run for this backend here; None when it can."""
    if backend not in PT2E_BACKENDS:
        return (
            f"the model is an exported (aten) graph, quantized with the pt2e flow, and qlint's pt2e "
            f"trial supports the {', '.join(PT2E_BACKENDS)} backends (X86InductorQuantizer), not {backend}"
        )
    try:
        import_torchao(QUANTIZER_MODULE)
    except ImportError:
        return "the model is an exported (aten) graph; its pt2e trial needs torchao: pip install 'qlint[pt2e]'"
    return None


def _is_dynamic(qconfig: Any) -> bool:
    activation = qconfig.activation()
    return bool(getattr(activation, "is_dynamic", False))


def quantizer_for(mapping: QConfigMapping, intended: QConfigMapping, layer_kinds: Mapping[str, str]) -> Any | None:
    """An X86InductorQuantizer that quantizes as ``mapping`` asks; None when ``mapping`` differs
    from ``intended`` in a way pt2e cannot express.

    ``layer_kinds``: module fqn → layer kind, for the module-name entries (a dynamic config
    applies to Linear layers only)."""
    quantizer_module = import_torchao(QUANTIZER_MODULE)
    quantizer = quantizer_module.X86InductorQuantizer()

    def config(dynamic: bool = False) -> Any:
        return quantizer_module.get_default_x86_inductor_quantization_config(is_dynamic=dynamic)

    choices: list[Any] = []  # ObserverChoice (qlint.measure.pt2e_quantizer, imported with torchao)
    dynamic = static = False  # module-name entries of either kind

    def _observer_choice(fqn: str, qconfig: Any, reference: Any) -> Any | None:
        """The quantizer's activation spec observed as ``qconfig`` asks; None unless only the
        activation observer differs from ``reference``."""
        from qlint.measure.pt2e_quantizer import observer_choice  # needs torchao, imported above

        if reference is None or not _same_observer(qconfig.weight(), reference.weight()):
            return None
        return observer_choice(fqn, qconfig.activation(), reference.activation(), config().input_activation)

    default = mapping.global_qconfig
    if (default is None) != (intended.global_qconfig is None) or (
        default is not None and not qconfig_equals(default, intended.global_qconfig)
    ):
        return None  # the quantizer's global config is its own: a changed global has no equivalent
    if default is not None:
        if _is_dynamic(default):
            return None
        quantizer.set_global(config())
    for fqn, qconfig in mapping.module_name_qconfigs.items():
        if qconfig is None:
            quantizer.set_module_name_qconfig(fqn, None)
        elif _is_dynamic(qconfig):
            # X86InductorQuantizer quantizes only Linear layers dynamically, and skips (with a
            # warning) a dynamic config beside static ones: the trial would measure the default
            if layer_kinds.get(fqn) != "linear" or default is not None:
                return None
            dynamic = True
            quantizer.set_module_name_qconfig(fqn, config(dynamic=True))
        elif default is not None and qconfig_equals(qconfig, default):
            continue
        elif fqn in intended.module_name_qconfigs and qconfig_equals(qconfig, intended.module_name_qconfigs[fqn]):
            static = True
            quantizer.set_module_name_qconfig(fqn, config())
        else:
            choice = _observer_choice(fqn, qconfig, intended.module_name_qconfigs.get(fqn) or intended.global_qconfig)
            if choice is None:
                return None  # a dtype, weight or observer of its own that pt2e cannot express
            if default is None:  # float by default: this module is quantized (as the plan export does)
                static = True
                quantizer.set_module_name_qconfig(fqn, config())
            choices.append(choice)
    if dynamic and static:
        return None  # see above: X86InductorQuantizer does not mix dynamic and static configs
    planned_types = intended.object_type_qconfigs
    for kind, qconfig in mapping.object_type_qconfigs.items():
        if qconfig is None and isinstance(kind, type) and issubclass(kind, nn.Module):
            quantizer.set_module_type_qconfig(kind, None)
        elif qconfig is None and callable(kind):
            quantizer.set_function_type_qconfig(kind, None)
        elif qconfig is None or kind not in planned_types or not qconfig_equals(qconfig, planned_types[kind]):
            return None  # a method left float, or a type-wide change of observer: no pt2e equivalent
    if mapping.module_name_regex_qconfigs or mapping.module_name_object_type_order_qconfigs:
        return None
    if choices:
        from qlint.measure.pt2e_quantizer import ActivationObservers

        return ActivationObservers(quantizer, choices)
    return quantizer


def _same_observer(first: Any, second: Any) -> bool:
    """Two observer instances that quantize alike (same class, number format and axis)."""
    fields = ("dtype", "qscheme", "quant_min", "quant_max", "ch_axis")
    return type(first) is type(second) and all(getattr(first, f, None) == getattr(second, f, None) for f in fields)


def pt2e_float_layers(converted: fx.GraphModule, mapping: QConfigMapping | None) -> tuple[list[FloatLayer], int, int]:
    """The weighted ops ``converted`` runs in float with their reasons, the int8 ones, and all of them.

    An op runs in int8 when its input and its weight both come through a dequantize."""
    nodes = {node.name: node for node in converted.graph.nodes}
    fallbacks, int8 = [], 0
    ops = weighted_ops(converted)
    for op in ops:
        if runs_int8(nodes[op.node]):
            int8 += 1
            continue
        reason: FallbackReason
        if asks_float(mapping, op.target):
            reason = "kept-float"
        elif op.kind in RECURRENT_KINDS:
            reason = "recurrent"
        else:
            reason = "not-annotated"
        fallbacks.append(FloatLayer(op.target, op.kind, reason, called_by=op.called_by))
    return fallbacks, int8, len(ops)


# X86InductorQuantizer finds these ops by the class of the module calling them, compared by
# name with torch's own (torch.fx's source partitions read nn_module_stack, which holds names)
TORCH_LAYER_CLASSES = {"conv2d": "torch.nn.modules.conv.Conv2d", "linear": "torch.nn.modules.linear.Linear"}


def missed_by_class(layer: FloatLayer) -> bool:
    """A conv2d/linear op pt2e left unannotated because the module calling it is not torch's own
    Conv2d/Linear class (a custom subclass, or a module whose forward calls F.conv2d/F.linear)."""
    return (
        layer.reason == "not-annotated"
        and layer.kind in TORCH_LAYER_CLASSES
        and layer.called_by is not None
        and layer.called_by != TORCH_LAYER_CLASSES[layer.kind]
    )


def refuses_repeated_call(stage: str, error: BaseException) -> bool:
    """prepare_pt2e's error for a module called more than once: the ops of all its calls form one
    partition, and the quantizer's conv/linear patterns refuse one with several outputs."""
    return stage == STAGE_PREPARE_PT2E and "more than one output node" in str(error)


def missed_torch_layer(layer: FloatLayer) -> bool:
    """A conv2d/linear op pt2e left unannotated: a fix exists (the layer as torch's own module
    class, one module per call; :func:`as_torch_layers`), whatever the reason was."""
    return layer.reason == "not-annotated" and layer.kind in TORCH_LAYER_CLASSES


def quantizer_leaves_float(layer: FloatLayer) -> bool:
    """An op the pt2e quantizer leaves float whatever its settings: a recurrent op, an op kind
    X86InductorQuantizer never annotates (conv1d, conv3d, ...), or a conv2d/linear it does not
    match (:func:`missed_torch_layer`: only rewriting the model changes that one)."""
    return layer.reason in ("recurrent", "not-annotated")


def repeated_calls(model: nn.Module) -> list[str]:
    """Module paths an exported graph calls more than once (torch.export keys their later calls
    ``name@1``, ``name@2``): X86InductorQuantizer's fusion patterns refuse such a module, whose
    ops form one partition with several outputs."""
    found: list[str] = []
    for node in model.graph.nodes if isinstance(model, fx.GraphModule) else ():
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            key, (path, _type) = list(stack.items())[-1]
            if "@" in str(key) and path not in found:
                found.append(str(path))
    return found


def as_torch_layers(model: nn.Module, targets: frozenset[str]) -> nn.Module:
    """``model`` (an exported graph, changed in place) as it would be with the layers named
    ``targets`` torch's own Conv2d/Linear modules, and one module per call of every module it
    calls twice: the float graph is the same; only what the pt2e quantizer can match changes.

    A target that is a module (it computes only that layer) has every op of its forward
    recorded as torch's class; a target named by its node (a module computing several layers)
    gets a module path of its own for that op."""
    if not isinstance(model, fx.GraphModule):
        return model
    layers = [op for op in weighted_ops(model) if op.target in targets and op.kind in TORCH_LAYER_CLASSES]
    scopes = {op.target: TORCH_LAYER_CLASSES[op.kind] for op in layers if op.target != op.node}
    own = {op.node: TORCH_LAYER_CLASSES[op.kind] for op in layers if op.target == op.node}
    for node in model.graph.nodes:
        stack = dict(node.meta.get("nn_module_stack") or {})
        if not stack and node.name in own:  # an op of the model's own forward
            stack = {node.name: ("", "")}
        if not stack:
            continue
        key = list(stack)[-1]
        path, type_name = stack[key]
        if path in scopes:  # every op of the module's own forward, as torch's layer holds
            type_name = scopes[path]
        if node.name in own:
            path, type_name = f"{path}.{node.name}" if path else node.name, own[node.name]
        if "@" in str(key):  # a later call of a module: a module of its own
            path = f"{path}@{str(key).rpartition('@')[2]}"
        stack[key] = (path, type_name)
        node.meta["nn_module_stack"] = stack
    return model


def quantize_pt2e(
    model: nn.Module, quantizer: Any, calibration: Sequence[Any], keep_prepared: bool = False
) -> tuple[fx.GraphModule, fx.GraphModule | None]:
    """prepare_pt2e → run ``calibration`` → convert_pt2e on ``model`` itself (pass a copy), as a
    .pt2 user quantizes. Returns (converted, prepared): prepared only with ``keep_prepared``, a
    copy taken before convert_pt2e consumes it: prepare_pt2e folds batch norms into the convs
    before them, so that copy (its observers pass values through) is the float graph the
    converted one compares with. Raises :class:`TrialStepError`."""
    flow = import_torchao(FLOW_MODULE)
    try:
        prepared = flow.prepare_pt2e(model, quantizer)
    except Exception as error:  # torch raises many kinds for graphs it cannot annotate
        raise TrialStepError(STAGE_PREPARE_PT2E, error, model) from error
    try:
        with torch.no_grad():
            for batch in calibration:
                call_model(prepared, batch)
    except Exception as error:
        raise TrialStepError(STAGE_CALIBRATE, error, prepared) from error
    kept = copy.deepcopy(prepared) if keep_prepared else None
    try:
        return flow.convert_pt2e(prepared), kept
    except Exception as error:
        raise TrialStepError(STAGE_CONVERT_PT2E, error, prepared) from error


class Pt2eBench(TrialBench):
    """A :class:`TrialBench` whose trials run the pt2e flow on an exported (aten) graph.

    ``intended``: the mapping the lint run quantizes with; fix trials may differ from it only
    in ways :func:`quantizer_for` can express."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        backend: str,
        calibration: Sequence[Any],
        evaluation: Sequence[Any],
        calibrated_on: str,
        evaluated_on: str,
        intended: QConfigMapping,
    ) -> None:
        super().__init__(model_factory, backend, calibration, evaluation, calibrated_on, evaluated_on)
        self.intended = intended
        self._layer_kinds: dict[str, str] | None = None

    def variant(self, model_factory: Callable[[], nn.Module]) -> Pt2eBench:
        return Pt2eBench(
            model_factory,
            self.backend,
            self.calibration,
            self.evaluation,
            self.calibrated_on,
            self.evaluated_on,
            self.intended,
        )

    @staticmethod
    def _in_eval(model: nn.Module) -> nn.Module:
        return model  # an exported module refuses .eval(): it runs in the mode it was exported in

    def layer_kinds(self) -> dict[str, str]:
        if self._layer_kinds is None:
            model = self.model_factory()
            self._layer_kinds = (
                {op.target: op.kind for op in weighted_ops(model)} if isinstance(model, fx.GraphModule) else {}
            )
        return self._layer_kinds

    def _workaround(self, failure: TrialFailure) -> str | None:
        """prepare_pt2e refuses a module called more than once: the same graph with one module per
        call (identical in float) is what it can quantize."""
        # the reference representation keeps float layouts: no channels-last views to reshape
        if not refuses_repeated_call(failure.stage, failure.error):
            return None
        model = self.model_factory()
        reused = repeated_calls(model)
        if not reused:
            return None
        self._rewritten = as_torch_layers(model, frozenset())
        return f"measured with each call of {', '.join(reused)} given a module of its own (identical in float)"

    def _run(self, mapping: QConfigMapping, measure_layers: bool) -> TrialResult:
        base = TrialResult(self.backend, self.calibrated_on, self.evaluated_on, converter=STAGE_CONVERT_PT2E)
        quantizer = quantizer_for(mapping, self.intended, self.layer_kinds())
        if quantizer is None:
            error = ValueError("the mapping asks for a change the pt2e quantizer cannot express")
            return dataclasses.replace(base, failure=TrialFailure(STAGE_PREPARE_PT2E, error, None))
        try:
            reference = self.reference()
        except Exception as error:  # the float model itself fails: QL105 reports it
            return dataclasses.replace(base, failure=TrialFailure(STAGE_FLOAT, error, self.model_factory()))
        try:
            converted, folded = quantize_pt2e(self._model(), quantizer, self.calibration, measure_layers)
        except TrialStepError as step:
            return dataclasses.replace(base, failure=step.failure)
        try:
            with torch.no_grad():
                powers = self._output_powers(converted, reference)
        except Exception as error:
            return dataclasses.replace(base, failure=TrialFailure(STAGE_RUN, error, converted))
        fallbacks, int8, total = pt2e_float_layers(converted, mapping)
        base = base.with_output(powers, fallbacks, int8, total)
        if folded is None:
            return base
        errors = measure_errors(folded, converted, self.evaluation)
        layers = tuple(
            LayerError(found.op.target, found.op.kind, found.shadow_db, found.propagated_db) for found in errors.layers
        )
        return dataclasses.replace(base, layers=layers, activations=errors.activations, model=converted)
