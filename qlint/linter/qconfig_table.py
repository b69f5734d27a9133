"""The resolved quantization intent of every graph node, as torch's check_qat_model prints it."""

from __future__ import annotations

from qlint.core.graph import ModelGraph
from qlint.linter.findings import QConfigRow


def qconfig_rows(graph: ModelGraph) -> list[QConfigRow]:
    rows = []
    for node in graph.ops():
        qc = node.qconfig
        act = qc.activation if qc else None
        weight = qc.weight if qc else None
        inputs = [
            p.qconfig.activation.dtype
            for p in graph.producers(node.name)
            if p.qconfig is not None and p.qconfig.activation is not None
        ]
        rows.append(
            QConfigRow(
                node=node.name,
                target=node.display,
                kind=node.kind,
                quantized=node.is_quantized,
                input_dtype=inputs[0] if inputs else ("torch.float32" if graph.producers(node.name) else None),
                output_dtype=act.dtype if act else "torch.float32",
                weight_dtype=weight.dtype if weight and node.weight else None,
                activation_observer=act.observer if act else None,
                weight_observer=weight.observer if weight and node.weight else None,
                weight_qscheme=weight.qscheme if weight and node.weight else None,
                ch_axis=weight.ch_axis if weight and node.weight else None,
            )
        )
    return rows
