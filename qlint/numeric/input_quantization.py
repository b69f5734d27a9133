"""QL302's input-quantization cause: a layer fed the model's inputs loses precision to the
quantized model's own quantization of those inputs, not to anything the layer does."""

from __future__ import annotations

from qlint.core.sqnr import SQNR_CAP_DB
from qlint.linter.findings import CompareRow, InputQuantization
from qlint.numeric.display import describe_sqnr

# A model-input layer's float input, put on the quantized model's input grid, is what the quantized
# layer gets when the two agree this much better than the input quantization's own SQNR (what is
# left of the inputs' difference is under 1 % of that quantization's noise power): the quantized
# model's inputs differ from the float model's by its own input quantization, not by a rewrite.
_INPUT_GRID_MATCH_MARGIN_DB = 20.0


def input_quantization_explains(row: CompareRow) -> InputQuantization | None:
    """The row's input quantization when it is the whole difference between the inputs the two
    models feed the layer (see ``_INPUT_GRID_MATCH_MARGIN_DB``); else None."""
    measured = row.input_quantization
    if measured is None or measured.sqnr is None or measured.match_sqnr is None:
        return None
    if measured.sqnr >= SQNR_CAP_DB:
        return None  # the input is on the grid already: its quantization costs nothing
    explains = measured.match_sqnr >= min(SQNR_CAP_DB, measured.sqnr + _INPUT_GRID_MATCH_MARGIN_DB)
    return measured if explains else None


def input_quantization_text(local_text: str, share: str, measured: InputQuantization) -> tuple[str, str]:
    """(why, fix) of an onset whose inputs lose their precision to the quantized model's own
    input quantization."""
    grid = f"[{measured.low:.3g}, {measured.high:.3g}] with step {measured.step:.3g}"
    data = f"[{measured.data_min:.3g}, {measured.data_max:.3g}]"
    if measured.clipped > 0:
        lost = (
            f"{measured.clipped:.1%} of the input values (range {data}) fall outside it and are clipped, and this "
            f"input quantization alone costs {describe_sqnr(measured.sqnr or 0.0)} at the input"
        )
        fix = (
            f"calibrate on data that covers the inputs' range ({data}; the calibrated input range is "
            f"[{measured.low:.3g}, {measured.high:.3g}]), or clamp/normalize the inputs into the calibrated range "
            "before the model"
        )
    else:
        lost = (
            f"no input value (range {data}) falls outside it, but the step is coarse for these inputs: this input "
            f"quantization alone costs {describe_sqnr(measured.sqnr or 0.0)} at the input"
        )
        fix = (
            f"calibrate on data whose range matches the inputs' ({data}), or normalize the inputs so that they "
            "use the whole input grid"
        )
    why = (
        f"{local_text}, so only about {share} of the error is its own; its inputs are the model's, and "
        f"the quantized model quantizes the model input to {grid}: {lost}. The float input put on that grid is "
        f"what the quantized layer gets (agreement {describe_sqnr(measured.match_sqnr or 0.0)}), so the "
        "quantized model is built from this float model and the loss is its own input quantization"
    )
    return why, fix
