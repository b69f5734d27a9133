"""A float model and an int8 version with one badly quantized layer, for ``qlint compare``.

    qlint compare examples.compare_demo:float_model examples.compare_demo:quantized_model \
        --calibration examples.compare_demo:batches --sensitivity --html out/compare.html
"""

from __future__ import annotations

import torch

from qlint.numeric.examples import SmallConvNet, bad_layer_qconfig_mapping, image_batches, quantize_fx_ptq

BAD_LAYER = "block2.conv"


def float_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return SmallConvNet().eval()


def batches() -> list[torch.Tensor]:
    return image_batches(8, batch_size=8, size=16, seed=1)


def quantized_model() -> torch.nn.Module:
    """FX PTQ with the x86 default mapping, except BAD_LAYER's weights get 4 levels."""
    _, converted = quantize_fx_ptq(float_model(), batches()[:4], bad_layer_qconfig_mapping(BAD_LAYER))
    return converted
