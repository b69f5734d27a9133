"""The text `qlint rule QL301` and `qlint rule QL302` print."""

# `qlint rule QL301` / `QL302`: these are `qlint compare` diagnostics, not lint rules (they need
# a quantized model to compare with), so they are documented here rather than in the registry.
DIAGNOSTIC_DOCS = {
    "QL301": """# QL301 low-sqnr-layer

A `qlint compare` diagnostic (not a lint rule: it needs the float model and its quantized version).

## What it does
Flags a layer whose measured SQNR, float vs quantized, is below `--sqnr-threshold`
(default 20 dB; an error under 10 dB). It names the cause it measured: the weights
(weight SQNR under 25 dB), clipping (an RMSE over several times the rounding baseline)
or the activation range. A layer whose own (shadow) error is a small share of the error at
its output only passes on inherited error and is not blamed.

## Why is this bad?
At 20 dB the error has 10% of the signal's amplitude, where accuracy losses usually show.

## References
- docs/numeric-suite.md
""",
    "QL302": """# QL302 error-onset

A `qlint compare` diagnostic (not a lint rule: it needs the float model and its quantized version).

## What it does
Names the layer where the error starts: a layer whose propagated SQNR drops by more than 6 dB
from its input to below `--sqnr-threshold`; where the SQNR crosses the threshold in smaller
steps, the layer with the largest such drop on the way down from threshold + 6 dB. Its own
shadow SQNR tells whether the error is made there or passed through and amplified. Noise powers
add: `1/SQNR_out = g/SQNR_in + 1/SQNR_local`. A BatchNorm that amplifies the int8 output of an
unfused conv before it gets the fold of the BN into that conv as its fix, not keep-float.

## Why is this bad?
Fixing the layer where the error starts recovers the layers after it too.

## References
- docs/numeric-suite.md
""",
}
