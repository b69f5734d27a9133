"""What a match of a float model's layers with its quantized counterpart's records.

:func:`qlint.measure.matching.match_layers` returns a :class:`MatchResult`: the kind of
counterpart (:class:`CounterpartKind`), one :class:`LayerMatch` per paired layer with the
:class:`Site` its value is read at on each side (a module's call or an FX node) and what
the quantized side fused in, and what stayed unpaired. The paired runs (capture), the
numeric suite and the weight measurements read these records without matching anything.

A module the model calls more than once (one ``nn.ReLU6`` after every conv) is one layer per
call when matched ``per_call``: each call's :class:`Site` says which call it is, and the layer
is named by the float FX node of that call (``act``, ``act_1``), with the module still its
``float_entry``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.fx

MODULE_SITE = "module"
NODE_SITE = "node"


class CounterpartKind(str, enum.Enum):
    FLOAT = "float"
    PREPARED = "prepared"
    CONVERTED_FX = "converted-fx"
    CONVERTED_PT2E = "converted-pt2e"  # convert_pt2e's aten graph: quantize/dequantize ops around float ops
    DYNAMIC = "dynamic"
    EAGER_CONVERTED = "eager-converted"


@dataclass(frozen=True)
class Site:
    """Where a value is read: a module's call (hooks) or an FX node (interpreter).

    ``call``: for a module the model calls several times, which of its calls in one forward
    pass (0 for the first, in the order they run); None reads every call."""

    kind: str
    name: str
    call: int | None = None


@dataclass(frozen=True)
class ConsumerClamp:
    """The clamp that is the only consumer of a layer's float output (a ReLU6 after a conv the
    backend does not fuse with it): ``node`` is its float FX node, [low, high] its range."""

    node: str
    low: float
    high: float


@dataclass
class LayerMatch:
    name: str  # float module fqn, or float node name for functional ops
    kind: str
    float_entry: Site
    float_exit: Site
    quant_site: Site
    quant_class: str
    matched_by: str
    float_exit_relu: bool = False  # the quantized op fuses a ReLU the float side applies functionally
    absorbed: list[str] = field(default_factory=list)
    # Float modules run after float_entry, in order, to reach float_exit (BN, ReLU fused on the quantized side).
    float_chain: list[str] = field(default_factory=list)
    folded_batch_norm: str | None = None  # float BN fqn folded into the quantized weight
    quant_input_quantizer: str | None = None  # observer/fake-quant fqn feeding the layer
    quant_output_quantizer: str | None = None  # observer/fake-quant fqn after the layer
    # pt2e: the dequantize node of the layer's output quantize/dequantize pair; the quantized value
    # is read there (what the int8 model passes on), with the pair's step (qlint.measure.pt2e_outputs)
    quant_exit: str | None = None
    quant_output_scale: float | None = None
    predecessors: list[str] = field(default_factory=list)
    # Float ops between the predecessors and this layer that no layer measures (a sqrt that the
    # quantized model runs in float): a drop measured here may be made there.
    between: list[str] = field(default_factory=list)
    # How many times the float model calls the module (its FX call sites; 1 when not traced).
    # More than 1 with float_entry.call None: this layer pools every call.
    calls: int = 1
    # The clamp that alone consumes the float output; where the layer's int8 grid lies inside
    # its range, the float side is read after it (qlint.measure.consumer_clamp).
    consumer_clamp: ConsumerClamp | None = None

    @property
    def is_module(self) -> bool:
        return self.float_entry.kind == MODULE_SITE and self.quant_site.kind == MODULE_SITE

    @property
    def module(self) -> str | None:
        """The float module this layer measures (a call of it, for a shared module); None for a
        functional op. A qconfig or keep-float fix names this, and applies to every call."""
        return self.float_entry.name if self.float_entry.kind == MODULE_SITE else None


@dataclass
class MatchResult:
    layers: list[LayerMatch]
    counterpart: CounterpartKind
    unmatched_float: list[str]
    unmatched_quantized: list[str]
    float_graph: torch.fx.GraphModule | None
    quant_graph: torch.fx.GraphModule | None
    notes: list[str]

    def by_name(self) -> dict[str, LayerMatch]:
        return {layer.name: layer for layer in self.layers}
