"""Signal-to-quantization-noise ratio, the one definition every layer reports.

SQNR over any number of tensor pairs is ``10*log10(sum ||x||^2 / sum ||x - y||^2)``: the
total signal power over the total noise power, summed in float64. For a single pair
this is ``torch.ao.ns.fx.utils.compute_sqnr`` (``20*log10(||x|| / ||x - y||)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from qlint.core.nested import float_tensors

# An error-free pair has infinite SQNR. Reports must hold finite JSON floats, so the
# value is clamped to this cap; float32 round-off alone sits far below it.
SQNR_CAP_DB = 200.0


def sqnr_db_from_powers(signal_power: float, noise_power: float) -> float | None:
    """10*log10(signal/noise), clamped to +-SQNR_CAP_DB so it stays finite; None for a
    non-finite power (NaN or Inf values: the SQNR is undefined, never the cap)."""
    if not (math.isfinite(signal_power) and math.isfinite(noise_power)):
        return None
    if noise_power <= 0.0:
        return SQNR_CAP_DB
    if signal_power <= 0.0:
        return -SQNR_CAP_DB
    value = 10.0 * math.log10(signal_power / noise_power)
    return max(-SQNR_CAP_DB, min(SQNR_CAP_DB, value))


def sqnr_text(value: float | None, digits: int = 1) -> str:
    """An SQNR for a sentence: ``"12.3 dB"``, or at the cap what the cap stands for (no error at
    all, or no signal to compare with), never the cap itself as if measured; "n/a" for none."""
    if value is None:
        return "n/a"
    if value >= SQNR_CAP_DB:
        return "exact (no error)"
    if value <= -SQNR_CAP_DB:
        return "undefined (the float output is all zeros)"
    return f"{value:.{digits}f} dB"


def noise_power_ratio(sqnr_db: float) -> float:
    """The inverse of sqnr_db_from_powers: noise power over signal power."""
    return 10.0 ** (-sqnr_db / 10.0)


# An error whose removal would leave less than 1 % of the output noise is credited 20 dB at most:
# past that, the other errors decide and the prediction means nothing.
MAX_PREDICTED_GAIN_DB = 20.0


def predicted_gain_db(output_db: float, removed_db: Sequence[float]) -> float:
    """Output SQNR gained if the errors of these SQNRs were gone from an output of ``output_db``:
    each error's relative noise power is taken to reach the output unchanged (at most
    ``MAX_PREDICTED_GAIN_DB``)."""
    at_output = noise_power_ratio(output_db)
    removed = sum(noise_power_ratio(db) for db in removed_db)
    remaining = max(at_output - removed, at_output * noise_power_ratio(MAX_PREDICTED_GAIN_DB))
    return 10 * math.log10(at_output / remaining)


@dataclasses.dataclass
class SqnrSums:
    """Signal and noise power of a stream of (reference, approximation) values."""

    signal_power: float = 0.0
    noise_power: float = 0.0
    pairs: int = 0

    def add(self, reference: Any, approximation: Any) -> None:
        """Fold in every floating-point tensor of two values of the same structure.

        Quantized tensors count by the float values they stand for; integer tensors
        are not signal. Raises ValueError when the two values do not pair up.
        """
        references, approximations = float_tensors(reference), float_tensors(approximation)
        if len(references) != len(approximations):
            raise ValueError(f"the values hold {len(references)} and {len(approximations)} floating-point tensors")
        for x, y in zip(references, approximations):
            if x.numel() != y.numel():
                raise ValueError(f"cannot compare tensors of {x.numel()} and {y.numel()} elements")
            x64, y64 = x.double(), y.double().reshape(x.shape)
            self.signal_power += float((x64 * x64).sum())
            self.noise_power += float(((x64 - y64) ** 2).sum())
            self.pairs += 1

    def sqnr_db(self) -> float | None:
        """The SQNR of everything added; None before any pair, and when a value was NaN or
        infinite (the SQNR is then undefined)."""
        if self.pairs == 0:
            return None
        return sqnr_db_from_powers(self.signal_power, self.noise_power)


@dataclasses.dataclass(frozen=True)
class BatchPowers:
    """Signal and noise power of each evaluation batch, in order: the output SQNR, and
    whether a change of it rests on one batch."""

    batches: tuple[tuple[float, float], ...]
    # per floating-point tensor of the output, over every batch: a model's outputs pool by power,
    # so a large auxiliary output (a recurrent state) can outweigh the one that matters
    tensors: tuple[tuple[float, float], ...] = ()

    def tensor_sqnr_db(self) -> list[float | None]:
        """The SQNR of each floating-point output tensor, in output order."""
        return [sqnr_db_from_powers(signal, noise) for signal, noise in self.tensors]

    def sqnr_db(self, leave_out: int | None = None) -> float | None:
        """The SQNR over every batch, or every batch but ``leave_out``; None without a batch."""
        kept = [powers for index, powers in enumerate(self.batches) if index != leave_out]
        if not kept:
            return None
        return sqnr_db_from_powers(sum(signal for signal, _ in kept), sum(noise for _, noise in kept))


def steady_gain_db(base: BatchPowers, fixed: BatchPowers) -> float | None:
    """The SQNR gained from ``base`` to ``fixed`` with the batch that contributes most to the
    gain left out: the smallest gain over the evaluation data minus any one batch.

    A gain that one batch carries (a clip that happens to suit one batch's spikes) is noise
    that held-out data does not repeat. None with fewer than two batches, or when an SQNR is
    undefined."""
    if len(base.batches) != len(fixed.batches) or len(base.batches) < 2:
        return None
    gains = []
    for index in range(len(base.batches)):
        before, after = base.sqnr_db(leave_out=index), fixed.sqnr_db(leave_out=index)
        if before is None or after is None:
            return None
        gains.append(after - before)
    return min(gains)


def sqnr_db(reference: Any, approximation: Any) -> float | None:
    """SQNR (dB) of ``approximation`` against ``reference``: tensors or nested outputs alike.

    None when there is no floating-point tensor to compare."""
    sums = SqnrSums()
    sums.add(reference, approximation)
    return sums.sqnr_db()


__all__ = [
    "SQNR_CAP_DB",
    "BatchPowers",
    "SqnrSums",
    "noise_power_ratio",
    "sqnr_db",
    "sqnr_db_from_powers",
    "sqnr_text",
    "steady_gain_db",
]
