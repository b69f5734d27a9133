"""What compare tells a user whose model stays broken: the commands that measure fixes.

compare runs QUANT as given and re-quantizes nothing. It finds where the error starts and
offers fixes (QL301/QL302), but it does not measure what any of them gains on the model
output. On EfficientNet-Lite0 (default x86 PTQ, held-out) the output is at 0.2 dB and the BN
folds its onsets suggest gain nothing measurable (docs/numeric-suite.md), while ``qlint MODEL
--calibration DATA --emit-plan`` then ``qlint verify`` reach about 21 dB. So when the model output is below
compare's threshold, the report says its fixes are unmeasured and names those commands.
The text, JSON and HTML reports show the same :class:`NextStep`; they decide nothing.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from qlint.linter.findings import Finding
from qlint.numeric.diagnose import OTHER_MODEL_KINDS
from qlint.numeric.display import describe_sqnr

# What the commands call the data when compare was not told where its batches came from.
DATA_PLACEHOLDER = "DATA"
HELD_OUT_PLACEHOLDER = "HELD_OUT"


class NextStep(BaseModel):
    """The model output is below compare's SQNR threshold and compare measured no fix for it:
    the commands that measure fixes on the model output."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    output_sqnr_db: float = Field(description="The model output's SQNR that compare measured, dB.")
    threshold_db: float = Field(description="compare's SQNR threshold (--sqnr-threshold), dB.")
    fixes_offered: int = Field(description="How many of compare's findings offer a fix; none of them is measured.")
    reason: str = Field(description="Why compare cannot tell whether its fixes restore the model.")
    commands: list[str] = Field(description="What to run instead, in order.")
    explanation: str = Field(description="What the commands do and which data each needs.")


def next_step(
    output_sqnr_db: float | None,
    sqnr_threshold: float,
    findings: Sequence[Finding],
    model: str,
    data: str | None = None,
    *,
    trust_pickle: bool = False,
) -> NextStep | None:
    """The next step when the model output is below ``sqnr_threshold``; None when it is not,
    when the outputs did not pair up (no output SQNR), or when QUANT was made from another
    float model (then the fix is comparing against that model, which the findings say).

    ``model`` and ``data``: the FLOAT and DATA specs compare was run with, which the commands
    repeat (lint and verify read the same forms); ``data`` None writes a placeholder.
    ``trust_pickle``: compare was told to trust the model files, so each command is too (it loads
    the same file, and would refuse it otherwise)."""
    if output_sqnr_db is None or output_sqnr_db >= sqnr_threshold:
        return None
    if any(finding.data.get("kind") in OTHER_MODEL_KINDS for finding in findings):
        return None
    fixes = sum(1 for finding in findings if finding.suggestion is not None)
    below = f"the model output SQNR is {describe_sqnr(output_sqnr_db)}, below the {sqnr_threshold:g} dB threshold"
    if fixes:
        reason = (
            f"{below}. compare runs QUANT as given and re-quantizes nothing: its {fixes} "
            f"fix{'es' if fixes != 1 else ''} (QL301/QL302) {'are' if fixes != 1 else 'is'} not measured on the "
            "model output, so it cannot tell whether any of them restores it"
        )
    else:
        reason = f"{below}, and compare offers no fix: no QL301/QL302 finding names a layer to change"
    calibration = shlex.quote(data) if data else DATA_PLACEHOLDER
    spec = shlex.quote(model)  # a path with spaces is one argument when the line is pasted
    if trust_pickle:
        spec += " --trust-pickle"
    commands = [
        f"qlint {spec} --calibration {calibration} --emit-plan plan.json",
        f"qlint verify {spec} --plan plan.json --calibration {calibration} --eval-data {HELD_OUT_PLACEHOLDER} "
        "--emit-plan verified.json",
        f"qlint quantize {spec} --plan verified.json --calibration {calibration} --output {_int8_file(model)}",
    ]
    explanation = (
        "The first command measures each fix in a trial quantization and writes the plan. verify quantizes "
        "with the backend default and with the plan, keeps what gains, and reports both output SQNRs on "
        f"{HELD_OUT_PLACEHOLDER}: batches that neither command calibrates on. quantize builds the int8 model "
        f"verify measured. {calibration} is the data compare ran on; if it is held-out data, calibrate on "
        "other batches (a .pt file or folder of batches, or module:function)."
    )
    return NextStep(
        output_sqnr_db=output_sqnr_db,
        threshold_db=sqnr_threshold,
        fixes_offered=fixes,
        reason=reason,
        commands=commands,
        explanation=explanation,
    )


def _int8_file(model: str) -> str:
    """quantize writes an exported program's int8 model as .pt2, any other as TorchScript .pt."""
    return "model_int8.pt2" if model.endswith(".pt2") else "model_int8.pt"
