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

from typing import Any

from qlint.core.ops import resolve_function
from qlint.errors import ConfigError
from qlint.linter.mapping import activation_recipe, rewrite_float_modules
from qlint.linter.suggestions import Suggestions
from qlint.measure.pt2e_trial import PT2E_BACKENDS, QUANTIZER_MODULE, import_torchao


def to_pt2e_quantizer(plan: Suggestions) -> Any:
    try:
        quantizer_module = import_torchao(QUANTIZER_MODULE)
    except ImportError as error:
        raise ConfigError("pt2e export needs torchao: pip install 'qlint[pt2e]'") from error
    if plan.backend not in PT2E_BACKENDS:
        raise ConfigError(
            f"pt2e export supports the {', '.join(PT2E_BACKENDS)} backends; for "
            f"{plan.backend} use ExecuTorch's XNNPACKQuantizer with the plan's decisions"
        )

    from qlint.measure.pt2e_quantizer import ActivationObservers, observer_choice  # needs torchao, imported above

    def config(dynamic: bool = False):
        return quantizer_module.get_default_x86_inductor_quantization_config(is_dynamic=dynamic)

    planned = activation_recipe(plan.activation, plan.backend).factory()()
    choices = {}
    quantizer = quantizer_module.X86InductorQuantizer()
    if not plan.float_by_default:
        quantizer.set_global(config())
    for decision in plan.modules:
        if not decision.quantize:
            quantizer.set_module_name_qconfig(decision.fqn, None)
        elif decision.mode == "dynamic":
            quantizer.set_module_name_qconfig(decision.fqn, config(dynamic=True))
        else:
            if plan.float_by_default:
                quantizer.set_module_name_qconfig(decision.fqn, config())
            if decision.activation is not None and decision.activation != plan.activation:
                observer = activation_recipe(decision.activation, plan.backend).factory()()
                choice = observer_choice(observer, planned, config().input_activation)
                if choice is not None:
                    choices[decision.fqn] = choice
    for helper in rewrite_float_modules(plan):
        quantizer.set_module_name_qconfig(helper, None)
    for kept in plan.float_functions:
        quantizer.set_function_type_qconfig(resolve_function(kept.function), None)
    return ActivationObservers(quantizer, choices) if choices else quantizer
