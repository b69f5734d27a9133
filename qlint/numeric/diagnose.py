"""Findings from per-layer numeric rows: QL301 low-sqnr-layer and QL302 error-onset.

Noise powers add: if the error a layer inherits and the error it adds are
independent, ``1/SQNR_out = g/SQNR_in + 1/SQNR_local`` in linear units, where
``g`` is how much the layer amplifies incoming noise relative to signal.  The
shadow run measures ``SQNR_local`` directly, which is what lets QL302 say
whether an error jump is made at a layer or only passed through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from qlint.core.sqnr import SQNR_CAP_DB, noise_power_ratio, sqnr_db_from_powers
from qlint.linter.findings import CompareRow, Finding, Severity
from qlint.linter.fixes import Fuse, KeepFloat, KeepFloatFunction
from qlint.linter.registry import COMPARE_DIAGNOSTICS
from qlint.measure.metrics import UNIFORM_ROUNDING_RMSE_OVER_SCALE
from qlint.numeric.display import EXACT, call_of, describe_sqnr, sqnr_word
from qlint.numeric.input_quantization import input_quantization_explains, input_quantization_text
from qlint.numeric.unfused_norm import UnfusedNorm, unfused_norm_text

# Healthy int8 layers measure 30-45 dB locally; 20 dB means the error has 10% of
# the signal's amplitude, which is where accuracy losses usually become visible.
DEFAULT_SQNR_THRESHOLD_DB = 20.0
# 8-bit weights reach 35-45 dB (per-channel) and rarely fall under 30 dB even per-tensor.
DEFAULT_WEIGHT_SQNR_THRESHOLD_DB = 25.0
# A jump of 6 dB quadruples the noise power: more than accumulation across one layer.
DEFAULT_ONSET_JUMP_DB = 6.0
# Below this the layer is badly broken rather than merely noisy.
_ERROR_SQNR_DB = 10.0
# RMSE this many times the pure-rounding baseline means values are being clipped.
_CLIPPING_FACTOR = 3.0
# A layer whose own (shadow) error is under this share of the error at its output mostly
# passes on inherited error; QL301 does not blame it for its activations.
_MIN_LOCAL_SHARE = 0.1

# Rounding to a grid that holds 0 (every int8 scheme), clipped or not, never moves a weight
# further than 0 is from it: quantized weights have SQNR >= 0 dB against the weights they were
# made from. Below (with a margin for float sums), they were made from other weights.
_NOT_A_QUANTIZATION_DB = -0.5
# Quantizing rounds each weight to the nearest point of the layer's grid: a tie, or a quantizer
# range one narrower than the dtype's, moves it by one step at most. More than this share of the
# integer weights further away, and they were made from other weights (an equalized layer: ~50 %).
_OFF_GRID_LIMIT = 0.05

# Finding kinds that say the quantized model was made from another float model.
OTHER_MODEL_KINDS = frozenset({"other-weights", "other-inputs"})

LOW_SQNR = ("QL301", COMPARE_DIAGNOSTICS["QL301"])
ERROR_ONSET = ("QL302", COMPARE_DIAGNOSTICS["QL302"])


def inherited_sqnr(row: CompareRow, propagated: dict[str, float]) -> tuple[float, list[str]]:
    """Worst propagated SQNR among the layers feeding ``row`` (exact inputs: the cap)."""
    upstream = [name for name in row.extra.get("predecessors", []) if name in propagated]
    return min((propagated[name] for name in upstream), default=SQNR_CAP_DB), upstream


def local_sqnr(row: CompareRow, inherited: float = SQNR_CAP_DB) -> tuple[float | None, str]:
    """The SQNR of the error the layer adds itself.

    Measured by the shadow run when there is one.  Otherwise it is estimated by
    subtracting the inherited noise power from the propagated one (unit gain
    assumed), so that a layer that merely passes on upstream error is not blamed.
    """
    if row.sqnr_shadow is not None:
        return row.sqnr_shadow, "shadow"
    if row.sqnr_propagated is None:
        return None, "none"
    if inherited >= SQNR_CAP_DB:
        return row.sqnr_propagated, "propagated"
    added = noise_power_ratio(row.sqnr_propagated) - noise_power_ratio(inherited)
    return sqnr_db_from_powers(1.0, max(added, 0.0)), "estimated"


def _share_text(share: float) -> str:
    """A share as a percentage that never rounds a small nonzero share to "0%" (read as none)."""
    if 0.0 < share < 0.01:
        return "<1%"
    if 0.99 < share < 1.0:
        return ">99%"
    return f"{share:.0%}"


def _keep_float_suggestion(row: CompareRow, reason: str) -> KeepFloat | KeepFloatFunction | None:
    """Keep the layer float: ``mapping.set_module_name(fqn, None)`` for a module, and for a
    functional op ``set_object_type(function, None)`` (every call of that function: a mapping
    cannot name one call). None for a functional op with no public function path (a tensor
    method): the message says what to do, and a plan has no way to."""
    if not row.functional:
        return KeepFloat(module=row.module or row.name, reason=reason)
    if row.function is None:
        return None
    return KeepFloatFunction(node=row.name, function=row.function)


def _described(row: CompareRow) -> str:
    """The row's name and kind, and which call of its module it measures (a shared module)."""
    calls = call_of(row)
    return f"{row.name} ({row.kind}{'; ' + calls if calls else ''})"


def _float_target(row: CompareRow) -> str:
    """What a fix keeps float: the module of a row measuring one call of it, else the row."""
    return row.module if row.module is not None and row.calls > 1 else row.name


def _shared_note(row: CompareRow) -> str:
    """For a module the model calls several times: a fix for it changes every call, not only
    the one this row measures."""
    if row.module is None or row.calls <= 1:
        return ""
    return (
        f" {row.module} is one module the model calls {row.calls} times: keeping it float or changing its qconfig "
        "changes every call (compare the rows of its other calls)."
    )


def _cause_and_fix(row: CompareRow, weight_low: bool, activation_low: bool) -> tuple[str, str, str]:
    """(why, fix, cause) from the evidence in the row."""
    if weight_low:
        return (
            f"its weights lose most of their precision when quantized (weight SQNR "
            f"{row.weight_sqnr:.1f} dB, where 8-bit weights usually reach 35-45 dB), so the observer or "
            f"bit width chosen for this layer's weights is wrong",
            "quantize its weights to 8 bits per channel (PerChannelMinMaxObserver, qint8, "
            "per_channel_symmetric), or keep the layer in float",
            "weight",
        )
    summary = (row.extra.get("shadow") or row.extra.get("propagated") or {}) if activation_low else {}
    ratio = summary.get("rmse_over_scale")
    float_max, float_min = summary.get("float_max"), summary.get("float_min")
    if ratio is not None and ratio > _CLIPPING_FACTOR * UNIFORM_ROUNDING_RMSE_OVER_SCALE:
        return (
            f"its output error is {ratio:.1f} quantization steps RMS against {UNIFORM_ROUNDING_RMSE_OVER_SCALE:.2f} "
            f"for pure rounding, which means values fall outside the calibrated range and are clipped "
            f"(float range [{float_min:.3g}, {float_max:.3g}])",
            "calibrate on data that covers the real input range (or use a HistogramObserver / wider range), "
            "or keep the layer in float",
            "clipping",
        )
    scale = summary.get("scale")
    if scale is not None and float_min is not None and float_max is not None and scale > float_max - float_min:
        # A step wider than every value's spread: no outlier sets it, the output's qparams do not
        # fit this op (a multiply by a large constant, a fixed-qparams op fed other values).
        low, high = summary.get("quantized_min"), summary.get("quantized_max")
        collapsed = f"; the int8 output spans [{low:.3g}, {high:.3g}]" if low is not None and high is not None else ""
        return (
            f"its int8 output step ({scale:.3g}) is wider than the whole float range "
            f"[{float_min:.3g}, {float_max:.3g}]{collapsed}: its output qparams do not fit its values at all",
            "keep the op in float, or give its output qparams that cover its float range",
            "range",
        )
    return (
        "its quantization step is coarse next to typical values: the range is set by a few large values "
        f"(float range [{float_min:.3g}, {float_max:.3g}]) while most values are small"
        if float_min is not None
        else "its quantized output differs markedly from the float one",
        "reduce outliers (cross-layer equalization, clamping the activation) or use per-channel / wider "
        "quantization, or keep the layer in float",
        "range",
    )


def low_sqnr_findings(
    rows: list[CompareRow],
    sqnr_threshold: float,
    weight_sqnr_threshold: float,
    onset_jump_db: float = DEFAULT_ONSET_JUMP_DB,
) -> list[Finding]:
    findings = []
    propagated = {row.name: row.sqnr_propagated for row in rows if row.sqnr_propagated is not None}
    for row in rows:
        if _other_weights(row):
            findings.append(_other_weights_finding(row))
            continue
        inherited = inherited_sqnr(row, propagated)[0]
        local, source = local_sqnr(row, inherited)
        activation_low = local is not None and local < sqnr_threshold
        if source == "estimated" and activation_low and row.sqnr_propagated is not None:
            # Without a shadow run the unit-gain estimate is rough (a ReLU changes signal and
            # noise power differently); blame the layer only if SQNR visibly drops at it.
            activation_low = inherited - row.sqnr_propagated >= onset_jump_db
        if source == "shadow" and activation_low and local is not None and row.sqnr_propagated is not None:
            # The shadow run feeds the layer the input it really gets.  Where that input is already
            # far off (an upstream layer is broken), the layer's own error is measured on values it
            # was never calibrated for, and is a small part of the error it passes on: the upstream
            # onset is the finding, and this layer is judged again once that is fixed.
            share = noise_power_ratio(local) / noise_power_ratio(row.sqnr_propagated)
            activation_low = share >= _MIN_LOCAL_SHARE
        weight_low = row.weight_sqnr is not None and row.weight_sqnr < weight_sqnr_threshold
        if not (activation_low or weight_low):
            continue
        why, fix, cause = _cause_and_fix(row, weight_low, activation_low)
        measured = []
        if local is not None:
            measured.append(f"{source} activation SQNR {local:.1f} dB")
        if row.sqnr_propagated is not None and source != "propagated":
            measured.append(f"propagated {row.sqnr_propagated:.1f} dB")
        if row.weight_sqnr is not None:
            measured.append(f"weight SQNR {row.weight_sqnr:.1f} dB")
        worst = min(
            value
            for value in (local if activation_low else None, row.weight_sqnr if weight_low else None)
            if value is not None
        )
        severity = Severity.ERROR if worst < _ERROR_SQNR_DB else Severity.WARNING
        message = (
            f"{_described(row)} quantizes poorly: {', '.join(measured)}; "
            f"thresholds are {sqnr_threshold:.0f} dB (activations) and {weight_sqnr_threshold:.0f} dB (weights). "
            f"Why: {why}. Fix: {fix}.{_shared_note(row)}"
        )
        findings.append(
            Finding(
                rule=LOW_SQNR[0],
                name=LOW_SQNR[1],
                severity=severity,
                target=row.name,
                message=message,
                data={
                    "kind": cause,
                    "module": row.module,  # the fqn a fix names: a call row (act_1) is no module
                    "local_sqnr_db": local,
                    "local_source": source,
                    "sqnr_propagated_db": row.sqnr_propagated,
                    "weight_sqnr_db": row.weight_sqnr,
                    "threshold_db": sqnr_threshold,
                    "weight_threshold_db": weight_sqnr_threshold,
                },
                suggestion=_keep_float_suggestion(row, cause),
            )
        )
    return findings


def _other_weights(row: CompareRow) -> bool:
    below_zero = row.weight_sqnr is not None and row.weight_sqnr < _NOT_A_QUANTIZATION_DB
    return below_zero or (row.weight_off_grid is not None and row.weight_off_grid > _OFF_GRID_LIMIT)


def _other_weights_finding(row: CompareRow) -> Finding:
    evidence = []
    if row.weight_sqnr is not None and row.weight_sqnr < _NOT_A_QUANTIZATION_DB:
        evidence.append(
            f"weight SQNR {row.weight_sqnr:.1f} dB; rounding to a grid that holds 0, clipped or not, never moves a "
            "weight further than 0 is from it, so it cannot fall below 0 dB"
        )
    if row.weight_off_grid is not None and row.weight_off_grid > _OFF_GRID_LIMIT:
        evidence.append(
            f"{row.weight_off_grid:.0%} of its integer weights are more than one step from the float weights "
            "rounded on the layer's own scales, where quantizing moves none by more than one"
        )
    message = (
        f"{_described(row)}: its quantized weights are not a quantization of this float model's "
        f"weights ({'; and '.join(evidence)}). The quantized model "
        "was built from another float model, such as one a rewrite changed (cross-layer equalization, "
        "normalize_input, BN folding): compare it against that model. Here the numbers of this layer "
        "and those after it measure the difference between the two float models, not quantization."
    )
    return Finding(
        rule=LOW_SQNR[0],
        name=LOW_SQNR[1],
        severity=Severity.ERROR,
        target=row.name,
        message=message,
        data={"kind": "other-weights", "weight_sqnr_db": row.weight_sqnr, "weight_off_grid": row.weight_off_grid},
    )


def _onset_rows(rows: list[CompareRow], sqnr_threshold: float, onset_jump_db: float) -> dict[str, str | None]:
    """The onset rows by name, each with the row where the SQNR goes below the threshold when
    that is a later row (None: at the onset itself).

    A row is an onset when its propagated SQNR is below the threshold and at least
    ``onset_jump_db`` below what it inherited. The SQNR can also cross the threshold in a small
    step right after a large drop that stopped just above it (efficientnet_lite0: ``_bn0`` 29.1
    -> 20.2 dB, then ``_swish`` 17.1): from such a crossing the worst-input chain is followed
    back while it stays under threshold + ``onset_jump_db``, and the row with the largest drop
    on it is the onset, when that drop is at least ``onset_jump_db``."""
    propagated = {row.name: row.sqnr_propagated for row in rows if row.sqnr_propagated is not None}
    by_name = {row.name: row for row in rows}
    onsets: dict[str, str | None] = {}
    for row in rows:
        if row.sqnr_propagated is None or row.sqnr_propagated >= sqnr_threshold or _other_weights(row):
            continue  # a layer with other weights is QL301's other-weights finding
        inherited, upstream = inherited_sqnr(row, propagated)
        if inherited - row.sqnr_propagated >= onset_jump_db:
            onsets[row.name] = None
        elif inherited >= sqnr_threshold and upstream:
            drops: list[tuple[float, str]] = []
            current: CompareRow | None = row
            while current is not None and current.sqnr_propagated is not None and current.name not in onsets:
                if current is not row and current.sqnr_propagated >= sqnr_threshold + onset_jump_db:
                    break
                before, feeding = inherited_sqnr(current, propagated)
                drops.append((before - current.sqnr_propagated, current.name))
                worst = min(feeding, key=lambda name: propagated[name], default=None)
                current = by_name.get(worst) if worst is not None else None
            jump, name = max(drops)
            if jump >= onset_jump_db and not _other_weights(by_name[name]):
                onsets.setdefault(name, row.name)
    return onsets


def error_onset_findings(
    rows: list[CompareRow],
    sqnr_threshold: float,
    onset_jump_db: float,
    unfused_norms: Sequence[UnfusedNorm] = (),
) -> list[Finding]:
    """Layers, in forward order, where propagated SQNR falls below threshold by a jump
    (:func:`_onset_rows`).

    The inherited SQNR of a layer is the worst propagated SQNR among the layers
    feeding it (model inputs are exact); the shadow SQNR tells made-here from
    amplified-here. ``unfused_norms``: the BNs that read an unfused conv's int8 output
    (:mod:`qlint.numeric.unfused_norm`), whose fix is the fold.
    """
    propagated = {row.name: row.sqnr_propagated for row in rows if row.sqnr_propagated is not None}
    by_name = {row.name: row for row in rows}
    onsets = _onset_rows(rows, sqnr_threshold, onset_jump_db)
    findings = []
    for position, row in enumerate(rows):
        if row.name not in onsets or row.sqnr_propagated is None:
            continue
        crossing = onsets[row.name]
        inherited, upstream = inherited_sqnr(row, propagated)
        jump = inherited - row.sqnr_propagated
        pair = _unfused_norm_of(row, upstream, unfused_norms)
        noise_out = noise_power_ratio(row.sqnr_propagated)
        noise_in = noise_power_ratio(inherited)
        if row.sqnr_shadow is not None:
            local_share = min(1.0, noise_power_ratio(row.sqnr_shadow) / noise_out)
            local_text = f"its local (shadow) SQNR is {row.sqnr_shadow:.1f} dB"
        else:
            local_share = max(0.0, min(1.0, (noise_out - noise_in) / noise_out))
            local_text = "no shadow run was made, so the local part is estimated from the jump"
        inherited_text = (
            f"{describe_sqnr(inherited)} at its inputs ({', '.join(upstream)})" if upstream else "exact model inputs"
        )
        if pair is not None:  # before "local": keeping a BN that reads int8 float keeps both roundings
            producer = next(name for name in upstream if pair.reads([name]))
            producer_inputs = list(by_name[producer].extra.get("predecessors", [])) if producer in by_name else []
            why, fix = unfused_norm_text(pair, local_text, _share_text(local_share), producer, producer_inputs)
            kind = "unfused-norm"
        elif local_share >= 0.5:
            why = (
                f"{local_text}, so about {_share_text(local_share)} of the error here is added by this layer itself; "
                f"layers after it mostly inherit it"
            )
            fix = (
                f"fix {row.name} first (see QL301 for the cause: weights, clipping or range), "
                f"or keep {'it' if _float_target(row) == row.name else _float_target(row)} in float; re-run compare "
                "to find the next onset"
            )
            kind = "local"
        elif not upstream and (input_quantization := input_quantization_explains(row)) is not None:
            # Its inputs are the model's, and the quantized model feeds it exactly the float
            # model's inputs put on its own input grid: the loss is that input quantization.
            why, fix = input_quantization_text(local_text, _share_text(local_share), input_quantization)
            kind = "input-quantization"
        elif not upstream:
            # Exact inputs, little error of its own, and yet its output is far off: the quantized
            # model does not feed it the model's inputs. There is no noise here to amplify.
            why = (
                f"{local_text}, so only about {_share_text(local_share)} of the error is its own, and its inputs are the "
                "model's: the quantized model feeds it other values than the float model does, as one built "
                "from another float model would (a rewrite before this layer, such as normalize_input)"
            )
            fix = "compare against the float model the quantized model was built from"
            kind = "other-inputs"
        elif between := row.extra.get("between"):
            # Ops no row measures run between its inputs' layers and it (silero's sqrt, which the
            # quantized model runs in float): the drop may be theirs, and keeping this layer
            # float does not remove an error it receives.
            why = (
                f"{local_text}, so only about {_share_text(local_share)} of the error is added by the layer itself; "
                f"the rest is made or amplified on the way from {', '.join(upstream)}: by {', '.join(between)} "
                f"(no row measures {'it' if len(between) == 1 else 'them'}) or by this layer"
            )
            fix = (
                f"improve the precision of its inputs ({', '.join(upstream)}); quantizing {row.name} alone is not "
                "the problem"
            )
            kind = "amplified"
        else:
            why = (
                f"{local_text}, so only about {_share_text(local_share)} of the error is added here: the layer "
                f"amplifies noise it receives"
            )
            fix = (
                f"improve the precision of its inputs ({', '.join(upstream)}) or keep "
                f"{_float_target(row)} in float; quantizing it alone is not the problem"
            )
            kind = "amplified"
        below = (
            f"below the {sqnr_threshold:.0f} dB threshold"
            if crossing is None
            else f"the largest drop on the way below the {sqnr_threshold:.0f} dB threshold, which it crosses at "
            f"{crossing} ({describe_sqnr(propagated[crossing])})"
        )
        message = (
            f"Error starts at {_described(row)}: propagated SQNR falls from {inherited_text} to "
            f"{row.sqnr_propagated:.1f} dB here, {below}"
            + ("" if sqnr_word(inherited) == EXACT else f" (a {jump:.1f} dB drop)")
            + ". "
            f"Why: {why}. Fix: {fix}.{_shared_note(row)}"
        )
        findings.append(
            Finding(
                rule=ERROR_ONSET[0],
                name=ERROR_ONSET[1],
                severity=Severity.WARNING,
                target=row.name,
                message=message,
                data={
                    "kind": kind,
                    "module": row.module,
                    "forward_index": position,
                    "inherited_sqnr_db": inherited,
                    "sqnr_propagated_db": row.sqnr_propagated,
                    "sqnr_shadow_db": row.sqnr_shadow,
                    "jump_db": jump,
                    "local_share": local_share,
                    "upstream": upstream,
                    "crosses_threshold_at": crossing,
                },
                suggestion=_onset_suggestion(row, kind, pair, by_name),
            )
        )
    return findings


def _unfused_norm_of(row: CompareRow, upstream: list[str], pairs: Sequence[UnfusedNorm]) -> UnfusedNorm | None:
    """The unfused conv -> BN pair whose BN ``row`` measures, reading its producer's row."""
    if row.kind != "batch_norm" or row.module is None:
        return None
    return next((pair for pair in pairs if pair.norm == row.module and pair.reads(upstream)), None)


def _onset_suggestion(
    row: CompareRow, kind: str, pair: UnfusedNorm | None, by_name: dict[str, CompareRow]
) -> KeepFloat | KeepFloatFunction | Fuse | None:
    """Keep float for an error made here; the fold for a BN amplifying its unfused conv."""
    if kind == "local":
        return _keep_float_suggestion(row, "error-onset")
    if kind == "unfused-norm" and pair is not None:
        producer = by_name.get(pair.producer_node) or by_name.get(pair.producer)
        return pair.suggestion(producer.kind if producer is not None and producer.kind else "conv")
    return None


def diagnose(
    rows: list[CompareRow],
    *,
    sqnr_threshold: float = DEFAULT_SQNR_THRESHOLD_DB,
    weight_sqnr_threshold: float = DEFAULT_WEIGHT_SQNR_THRESHOLD_DB,
    onset_jump_db: float = DEFAULT_ONSET_JUMP_DB,
    unfused_norms: Sequence[UnfusedNorm] = (),
) -> list[Finding]:
    return low_sqnr_findings(rows, sqnr_threshold, weight_sqnr_threshold, onset_jump_db) + error_onset_findings(
        rows, sqnr_threshold, onset_jump_db, unfused_norms
    )
