"""torch's warnings about choices qlint made, not the user: kept out of the user's process.

prepare_fx and convert_fx (torch.ao, "deprecated" in favour of torchao's pt2e) and the default
observers (reduce_range "will be deprecated") warn every time qlint quantizes a trial copy. The
user's model did not ask for them, and under ``-W error`` (pytest's ``filterwarnings = error``)
they would fail the call. Every other warning, such as one from the user's own forward,
passes through."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

_QLINTS_CHOICES = (
    (UserWarning, "Please use quant_min and quant_max"),  # an observer made with reduce_range
    (DeprecationWarning, "torch.ao.quantization is deprecated"),  # prepare_fx / convert_fx
)


@contextlib.contextmanager
def quiet_about_qlints_choices() -> Iterator[None]:
    with warnings.catch_warnings():
        for category, message in _QLINTS_CHOICES:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
