"""The core layer: load a model, trace it, and hold it as a graph of normalized ops.

Also the one runtime every higher layer shares: batches as call arguments, nested
outputs, state guards, SQNR, backend configurations and op kinds.
"""
