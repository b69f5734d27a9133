"""Running a model without leaving a trace: training flags and buffers restored afterwards."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def preserved_state(module: nn.Module) -> Iterator[None]:
    """Every training flag and buffer (BN statistics, observer state) is restored on exit,
    bit for bit, however the block ends. Parameters are never written by qlint's forward
    passes (they run under no_grad), so they need no copy."""
    modes = {name: sub.training for name, sub in module.named_modules(remove_duplicate=False)}
    buffers = {name: buffer.detach().clone()
               for name, buffer in module.named_buffers(remove_duplicate=False)}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers(remove_duplicate=False):
                saved = buffers.get(name)
                if saved is not None and saved.shape == buffer.shape:
                    buffer.copy_(saved)
        for name, sub in module.named_modules(remove_duplicate=False):
            if name in modes:
                sub.training = modes[name]
