"""Export a QuantPlan to a pt2e quantizer (torchao), for the torch.export quantization flow.

Needs the optional extra ``qlint[pt2e]`` (torchao). The x86 family of backends maps to
torchao's X86InductorQuantizer, in its own number format (uint8 activations over 0..255,
int8 per-channel weights), as the pt2e trial quantizes; per-module decisions become
module-name configs: keep-float → None, dynamic → a dynamic config. A decision that changes
a module's activation observer (kind and parameters, e.g. QL203's clipping percentile
observer) re-annotates that module's activations (:mod:`qlint.measure.pt2e_quantizer`).
Weight decisions (per-tensor weights) and other number formats have no pt2e equivalent
here and are not exported.
"""

from __future__ import annotations

import warnings
from typing import Any

from qlint.core.function_paths import resolve_function
from qlint.errors import ConfigError
from qlint.linter.mapping import activation_recipe, rewrite_float_modules
from qlint.linter.suggestions import Suggestions
from qlint.measure.pt2e_trial import PT2E_BACKENDS, QUANTIZER_MODULE, import_torchao


def _quantizer_module(plan: Suggestions) -> Any:
    try:
        quantizer_module = import_torchao(QUANTIZER_MODULE)
    except ImportError as error:
        raise ConfigError("pt2e export needs torchao: pip install 'qlint[pt2e]'") from error
    if plan.backend not in PT2E_BACKENDS:
        raise ConfigError(
            f"pt2e export supports the {', '.join(PT2E_BACKENDS)} backends; for "
            f"{plan.backend} use ExecuTorch's XNNPACKQuantizer with the plan's decisions"
        )
    return quantizer_module


def _config(quantizer_module: Any, dynamic: bool = False) -> Any:
    return quantizer_module.get_default_x86_inductor_quantization_config(is_dynamic=dynamic)


def _describe_spec(spec: Any) -> str:
    """A torchao QuantizationSpec in words: its observer class (built as prepare_pt2e builds it),
    dtype, integer range and scheme."""
    observer = type(spec.observer_or_fake_quant_ctr()).__name__
    scheme = str(spec.qscheme).removeprefix("torch.")
    scheme = scheme.replace("per_tensor_", "per-tensor ").replace("per_channel_", "per-channel ")
    text = f"{observer} {str(spec.dtype).removeprefix('torch.')} {spec.quant_min}..{spec.quant_max} {scheme}"
    return text + (f" ch_axis={spec.ch_axis}" if spec.ch_axis not in (None, 0) else "")


def pt2e_global_specs(plan: Suggestions) -> tuple[str, str]:
    """(activation, weight): the number format :func:`to_pt2e_quantizer` quantizes to, read from
    torchao's default X86InductorQuantizer config. The plan's global specs do not apply there:
    they are prepare_fx's. Raises ConfigError when torchao or the backend cannot give them."""
    config = _config(_quantizer_module(plan))
    return _describe_spec(config.input_activation), _describe_spec(config.weight)


def _activation_choices(plan: Suggestions, quantizer_module: Any) -> dict[str, Any | None]:
    """Per static module decision with an activation of its own: its ObserverChoice, or None
    where pt2e cannot express it (another number format or observer kind)."""
    from qlint.measure.pt2e_quantizer import observer_choice  # needs torchao, imported by the caller

    planned = activation_recipe(plan.activation, plan.backend).factory()()
    base = _config(quantizer_module).input_activation
    choices: dict[str, Any | None] = {}
    for decision in plan.modules:
        if decision.quantize and decision.mode == "static" and decision.activation not in (None, plan.activation):
            observer = activation_recipe(decision.activation, plan.backend).factory()()
            choices[decision.fqn] = observer_choice(decision.fqn, observer, planned, base)
    return choices


def pt2e_gaps(plan: Suggestions) -> list[tuple[str, str]]:
    """(module fqn, why) for each module decision :func:`to_pt2e_quantizer` cannot express."""
    return _gaps(plan, _activation_choices(plan, _quantizer_module(plan)))


def _gaps(plan: Suggestions, choices: dict[str, Any | None]) -> list[tuple[str, str]]:
    gaps = [
        (fqn, "an activation number format or observer the pt2e quantizer does not express")
        for fqn, choice in choices.items()
        if choice is None
    ]
    gaps += [
        (d.fqn, "a weight decision: X86InductorQuantizer quantizes weights its own way (int8, per channel)")
        for d in plan.modules
        if d.quantize and d.weight is not None and d.weight != plan.weight
    ]
    static = not plan.float_by_default or any(d.quantize and d.mode == "static" for d in plan.modules)
    if static:
        gaps += [
            (d.fqn, "a dynamic decision beside static quantization: X86InductorQuantizer does not mix them")
            for d in plan.modules
            if d.quantize and d.mode == "dynamic"
        ]
    return gaps


def to_pt2e_quantizer(plan: Suggestions) -> Any:
    """The plan as a pt2e quantizer; decisions it cannot express (:func:`pt2e_gaps`) are left out."""
    from qlint.measure.pt2e_quantizer import ActivationObservers  # needs torchao, imported below

    quantizer_module = _quantizer_module(plan)
    by_module = _activation_choices(plan, quantizer_module)
    gaps = _gaps(plan, by_module)
    if gaps:
        left_out = "; ".join(f"{fqn}: {why}" for fqn, why in gaps)
        warnings.warn(f"the pt2e quantizer leaves out {len(gaps)} plan decision(s): {left_out}", stacklevel=2)
    choices = [choice for choice in by_module.values() if choice is not None]
    quantizer = quantizer_module.X86InductorQuantizer()
    if not plan.float_by_default:
        quantizer.set_global(_config(quantizer_module))
    for decision in plan.modules:
        if not decision.quantize:
            quantizer.set_module_name_qconfig(decision.fqn, None)
        elif decision.mode == "dynamic":
            if not any(fqn == decision.fqn for fqn, _ in gaps):
                quantizer.set_module_name_qconfig(decision.fqn, _config(quantizer_module, dynamic=True))
        elif plan.float_by_default:
            quantizer.set_module_name_qconfig(decision.fqn, _config(quantizer_module))
    for helper in rewrite_float_modules(plan):
        quantizer.set_module_name_qconfig(helper, None)
    for kept in plan.float_functions:
        quantizer.set_function_type_qconfig(resolve_function(kept.function), None)
    return ActivationObservers(quantizer, choices) if choices else quantizer
