"""Float and quantized side by side: what lint's trial, verify and compare all measure with.

``matching`` pairs float layers with their quantized counterparts, ``capture`` runs both
models batch by batch (propagated, shadow and isolated error), ``metrics`` streams SQNR
and its companions, ``quantizers`` and ``weights`` simulate a layer's quantization.
Nothing is imported here, so ``import qlint.measure`` stays cheap.
"""
