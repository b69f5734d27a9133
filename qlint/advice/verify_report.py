"""What :func:`qlint.advice.verify.verify` reports: default mapping vs verified plan, measured."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from qlint.advice.plan import QuantPlan
from qlint.measure.rewrite import AppliedRewrite


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class RunResult(_Model):
    """One quantized model, measured against the float model on the eval batches."""

    label: str
    sqnr_db: float | None = Field(description="output SQNR on the eval batches; None when quantizing failed")
    int8_layers: int = Field(description="conv/linear/recurrent/attention ops that run in int8 after convert_fx")
    total_layers: int = Field(
        description="all conv/linear/recurrent/attention ops (a tracer leaf: each layer inside it)"
    )
    int8_fraction: float
    size_bytes: int
    metric: float | None = None
    float_modules: list[str] = Field(default_factory=list, description="conv/linear modules left float")
    failure: str | None = Field(default=None, description="why prepare/calibrate/convert or the run failed")


class LayerComparison(_Model):
    fqn: str
    kind: str
    default_sqnr_db: float | None = None
    plan_sqnr_db: float | None = None
    default_int8: bool | None = None
    plan_int8: bool | None = None


SQNR_TOLERANCE_DB = 1e-3  # "does not lower SQNR": a change that costs less than this is noise


class DecisionOutcome(_Model):
    # module | equalization | rewrite | group | plan | bias_correction | activation_bits | scheme | keep_float
    kind: str
    target: str
    kept: bool
    sqnr_with_db: float | None = None
    sqnr_without_db: float | None = None
    detail: str = ""
    bar_db: float = Field(
        default=SQNR_TOLERANCE_DB, description="how much 'with' had to beat 'without' for the decision to be kept"
    )

    def why(self) -> str:
        """Its measured gain, and for a dropped decision why that gain was not enough."""
        if self.sqnr_with_db is None or self.sqnr_without_db is None:
            return "not measured"
        gain = self.sqnr_with_db - self.sqnr_without_db
        if self.kept:
            return f"{gain:+.2f} dB"
        if gain <= 0:
            return f"{gain:+.2f} dB: it gains nothing"
        if gain <= self.bar_db:
            return f"{gain:+.2f} dB: under the {self.bar_db:g} dB it must gain"
        return f"{gain:+.2f} dB, but not on its second check (below)"  # 8-bit activations: the swapped folds


class VerifyReport(_Model):
    """Default mapping vs verified plan, side by side. JSON round-trips via model_dump_json."""

    type: str = "qlint.VerifyReport"
    backend: str
    model: str | None = None
    eval_batches: int = Field(description="batches the reported numbers come from; they decide nothing")
    calibration_batches: int
    selection_batches: int = Field(default=0, description="batches pruning and the searches compared plans on")
    selected_on: str = Field(default="", description="which batches selected the decisions, in words")
    trials: int = Field(default=0, description="trial quantizations spent choosing decisions")
    max_trials: int = Field(default=0, description="the trial budget")
    target_sqnr_db: float | None = None
    target_met: bool | None = None
    float_metric: float | None = None
    default: RunResult
    requested: RunResult = Field(description="the plan as given (after its rewrites), before pruning")
    plan: RunResult = Field(description="the verified plan")
    layers: list[LayerComparison] = Field(default_factory=list)
    decisions: list[DecisionOutcome] = Field(default_factory=list)
    rewrites: list[AppliedRewrite] = Field(default_factory=list)
    left_out_rewrites: list[AppliedRewrite] = Field(
        default_factory=list,
        description="rewrites the plan lists that could not be applied to this model (no place in its graph, "
        "or the float outputs changed): the verified plan leaves them out",
    )
    kept_float: list[str] = Field(default_factory=list)
    float_layer_fraction: float = 0.0
    verified_plan: QuantPlan
    notes: list[str] = Field(default_factory=list)

    @property
    def sqnr_gain_db(self) -> float | None:
        """The verified plan's SQNR over the default's; None when either failed."""
        if self.plan.sqnr_db is None or self.default.sqnr_db is None:
            return None
        return self.plan.sqnr_db - self.default.sqnr_db
