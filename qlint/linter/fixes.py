"""What a finding asks the user to change: a typed union, one model per action.

A rule may build a fix as a model or as a plain dict with an ``"action"`` key; the
``Finding`` validates it into the model of that action, and an unknown action or field is
an error. :func:`qlint.linter.suggestions_from_fixes.collect_suggestions` matches the union
exhaustively, so a new action without a plan mapping fails the type checker and the tests.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter


class _Fix(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    def applies_only_when_dynamic(self) -> bool:
        """Whether the fix changes a Linear only where the plan runs it dynamic: under the
        mapping its finding was linted with it may change nothing, and still be the plan's to
        carry for when a Linear becomes dynamic (verify's scheme search)."""
        return False

    def target_modules(self, default: str) -> list[str]:
        """The modules (fqns) the fix is for; ``default`` (the finding's target) when it names none."""
        names = list(getattr(self, "targets", None) or getattr(self, "modules", None) or [])
        for single in ("module", "target"):
            value = getattr(self, single, None)
            if not names and isinstance(value, str) and value:
                names = [value]
        return names or [default]


class SetQConfig(_Fix):
    """A qconfig for the targets: a dtype, a quant range, fixed qparams, dynamic mode, or a
    neighbour's qconfig (``like``)."""

    action: Literal["set_qconfig"] = "set_qconfig"
    targets: list[str] = Field(default_factory=list)
    target: str | None = None
    module: str | None = None
    node: str | None = None
    scope: list[str] = Field(default_factory=list, description="Where the current qconfig comes from.")
    mode: Literal["static", "dynamic"] | None = None
    observer: str | None = None  # the activation observer class name
    activation: str | None = None  # the same, as QL103 names it for fixed qparams and neighbours
    activation_dtype: str | None = None
    dtype: str | None = None
    scale: float | None = None
    zero_point: int | None = None
    quant_min: int | None = None
    quant_max: int | None = None
    object_type: str | None = None
    like: str | None = None  # the node whose qconfig the targets should share
    alternative: str | None = None
    qconfig: str | None = None  # a torch qconfig by dotted name, e.g. default_dynamic_qconfig
    # targets whose input nothing quantized produces (a model input, a float pad): each needs an op
    # of its own to quantize that input (the observe_input rewrite), else FX uses this qconfig for it
    observe_inputs: list[str] = Field(default_factory=list)
    # targets that are functional convs (F.conv2d on a module's weight) followed by a BN: the
    # fold_bn_into_functional_conv rewrite first makes each a conv module, else no qconfig by
    # module name reaches it
    fold_functional: list[str] = Field(default_factory=list)
    source: str | None = Field(
        default=None,
        validation_alias=AliasChoices("source", "from"),
        description="Where the expected qconfig comes from.",
    )

    def by_op_type(self) -> bool:
        """For an op no module computes (a function, a method): only ``mapping.set_object_type``
        reaches it, and a module-name decision would name nothing."""
        return self.object_type is not None and not (self.targets or self.module or self.target)


class SetWeightObserver(_Fix):
    action: Literal["set_weight_observer"] = "set_weight_observer"
    targets: list[str] = Field(default_factory=list)
    target: str | None = None
    node: str | None = None
    scope: list[str] = Field(default_factory=list)
    observer: str | None = None
    qscheme: str | None = None
    dtype: str | None = None
    ch_axis: int | None = None
    quant_min: int | None = None
    quant_max: int | None = None


class SetActivationObserver(_Fix):
    action: Literal["set_activation_observer"] = "set_activation_observer"
    targets: list[str] = Field(default_factory=list)
    observer: str | None = None
    reduce_range: bool | None = None
    percentile: float | None = Field(default=None, gt=50, le=100)


class UnifyQConfig(_Fix):
    """The inputs of a cat share one observer: give them the same activation qconfig."""

    action: Literal["unify_qconfig"] = "unify_qconfig"
    target: str
    cat: str
    nodes: list[str]
    activation: str | None = None
    first_input: str | None = None

    def target_modules(self, default: str) -> list[str]:
        return list(self.nodes) or [default]


class KeepFloat(_Fix):
    action: Literal["keep_float"] = "keep_float"
    module: str | None = None
    targets: list[str] = Field(default_factory=list)
    node: str | None = None
    function: str | None = None
    reason: str | None = None


class KeepFloatFunction(_Fix):
    """A functional op kept float by its function (``mapping.set_object_type(fn, None)``)."""

    action: Literal["keep_float_function"] = "keep_float_function"
    node: str
    function: str
    # more functions kept float with it: the fix was measured with all of them float at once
    with_functions: list[str] = Field(default_factory=list)


# Why a fusable chain stays unfused, as Fuse.blockers names it (QL101 has more reasons): a plan
# folds a BN blocked by a functional conv with the fold_bn_into_functional_conv rewrite, any
# other Fuse with fuse.
BLOCKED_BY_FANOUT = "fan-out"
BLOCKED_BY_FUNCTIONAL_OP = "functional-op"


class Fuse(_Fix):
    action: Literal["fuse"] = "fuse"
    modules: list[str] = Field(min_length=1)
    pattern: list[str]
    blockers: list[str] = Field(default_factory=list)


class SplitModule(_Fix):
    action: Literal["split_module"] = "split_module"
    module: str
    copies: int = Field(ge=2)


class RemoveModule(_Fix):
    action: Literal["remove_module"] = "remove_module"
    module: str


class ViewToReshape(_Fix):
    action: Literal["view_to_reshape"] = "view_to_reshape"
    node: str


class NormalizeInput(_Fix):
    """Divide a model input by each sample's largest magnitude and restore ``modules``' outputs
    (:mod:`qlint.measure.normalize`): exact in float."""

    action: Literal["normalize_input"] = "normalize_input"
    input: str
    modules: list[str] = Field(min_length=1)


class SplitLeadingToken(_Fix):
    """Run each Linear's first token on a weight-sharing copy (:mod:`qlint.measure.token_split`);
    with ``only_dynamic``, only where the plan runs the Linear dynamic: a static Linear's two
    parts read one observer, so there the split gains nothing."""

    action: Literal["split_leading_token"] = "split_leading_token"
    modules: list[str] = Field(min_length=1)
    only_dynamic: bool = False

    def applies_only_when_dynamic(self) -> bool:
        return self.only_dynamic


class Equalize(_Fix):
    action: Literal["equalize"] = "equalize"
    module: str
    node: str | None = None
    previous: str | None = None


class ReplaceActivation(_Fix):
    """Replace clipping activations by one the backend fuses (changes the float model)."""

    action: Literal["replace_activation"] = "replace_activation"
    modules: list[str] = Field(min_length=1)
    replacement: Literal["relu"] = Field(default="relu", validation_alias=AliasChoices("replacement", "with"))


class QuantizeDynamicAfterConvert(_Fix):
    """``quantize_dynamic`` of a tracer leaf's layers after convert_fx (prepare_fx cannot see them)."""

    action: Literal["quantize_dynamic_after_convert"] = "quantize_dynamic_after_convert"
    module: str
    types: list[str] = Field(default_factory=lambda: ["Linear"])


Fix = Annotated[
    SetQConfig
    | SetWeightObserver
    | SetActivationObserver
    | UnifyQConfig
    | KeepFloat
    | KeepFloatFunction
    | Fuse
    | SplitModule
    | RemoveModule
    | ViewToReshape
    | NormalizeInput
    | SplitLeadingToken
    | Equalize
    | ReplaceActivation
    | QuantizeDynamicAfterConvert,
    Field(discriminator="action"),
]


_ADAPTER: TypeAdapter[Fix] = TypeAdapter(Fix)


def as_fix(value: Fix | dict[str, Any]) -> Fix:
    """A fix from its model or its dict form (``{"action": ..., ...}``); raises on unknown fields."""
    if isinstance(value, dict):
        return _ADAPTER.validate_python(value)
    return value
