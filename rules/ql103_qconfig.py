"""QL103 qconfig: qconfigs that the backend rejects, ignores or pays extra for."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field
from torch.ao.quantization import (
    DeQuantStub,
    QConfig,
    QConfigMapping,
    QuantStub,
    get_default_qconfig,
    get_default_qconfig_mapping,
)
from torch.ao.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    PerChannelMinMaxObserver,
    default_per_channel_weight_observer,
)

from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Severity
from qlint.linter.rule import Example, Need, Rule, RuleOptions, seeded
from qlint.rules._ql103_backend_fit import backend_support_findings, fixed_qparams_findings, reduce_range_findings
from qlint.rules._ql103_between_ops import cat_input_findings, float_island_findings
from qlint.rules._ql103_checks import QConfigCheckState


class QConfigCheck(Rule):
    """Flags qconfigs that the backend rejects, silently ignores, or pays extra for.

    ## What it does
    Reads the qconfig every op resolves to (from your QConfigMapping, the backend default,
    eager `.qconfig` attributes, or the observers of a prepared model) and checks it
    against the backend:

    - **fixed-qparams ops** (sigmoid, tanh, hardsigmoid, `nn.Softmax`) given a calibrated
      observer instead of the `FixedQParamsObserver` the backend requires, or one with
      the wrong scale/zero point;
    - **backend support**: activation or weight dtypes the backend has no kernel for
      (qint8 activations on x86/fbgemm, quint8 weights), quant ranges it rejects (qnnpack's
      qint8 path needs weights in [-127, 127]), weight qschemes its kernels do not take
      (affine or float-qparams weights where the kernel wants symmetric ones), and
      `reduce_range` settings that risk overflow (off on x86/fbgemm) or waste a bit (on
      elsewhere);
    - **float islands**: ops left in float (qconfig `None`, or dynamic where a static kernel
      exists) between ops the backend really runs in int8. An op with a qconfig but no int8
      kernel (`pow`, `sqrt` on x86) runs in float anyway, so it is no quantized neighbour, and
      a dynamic recurrent layer (no static kernel) is as quantized as torch makes it. The fix
      names modules; for a function call, which no module-name entry reaches, the message
      says how to set its qconfig (by op type or by call) and no fix is suggested;
    - **cat inputs** observed with different qparams.

    Each finding carries the qconfig table (node, target, kind, input/output dtype,
    observer, ch_axis) of the nodes involved, as Horizon's `check_qat_model` prints it.

    ## Why is this bad?
    A qconfig the backend cannot run is not an error at `prepare_fx` time: the op is left
    in float, or its qconfig is ignored with a warning that is easy to miss, so the model
    you convert is not the model you configured. Fixed-qparams ops have a known output
    range ([0, 1] or [-1, 1]) and their kernels use scale 1/256 with zero point 0 (or
    2/256 with zero point 128); a calibrated observer wastes codes or clips and is
    rejected. In post-training quantization `prepare_fx` ignores such a qconfig and the
    converted op keeps its fixed qparams, so the int8 model is the same and the measured
    impact 0 dB (info); in QAT the fake-quant trains with a range the int8 kernel will not
    use. Every float island costs a dequantize before it and a quantize after it.
    `prepare_fx` makes all inputs of `cat` share the first input's observer, so inputs
    whose qconfigs disagree are quantized with someone else's scale: a sigmoid first
    forces [0, 1) on every other input and clips them.

    ## Example
    ```python
    mapping = QConfigMapping().set_global(get_default_qconfig("x86"))  # sigmoid gets a HistogramObserver
    mapping.set_module_name("head.act", None)                          # GELU between two quantized convs
    ```

    ## Use instead
    ```python
    mapping = get_default_qconfig_mapping("x86")  # FixedQParams qconfigs for sigmoid/tanh/softmax
    # quantize the op, or move the float op to the start or end of the model
    ```

    ## Options
    - `fixed_qparams`: check fixed-qparams ops (sigmoid, tanh, hardsigmoid, softmax).
    - `backend_support`: check dtypes, quant ranges and weight qschemes against the backend.
    - `reduce_range`: check `reduce_range` of the activations entering conv and linear layers.
    - `report_wasted_reduce_range`: also report (as info) `reduce_range=True` on backends that do not need it.
    - `float_islands`: report float ops between quantized ops.
    - `min_island_ops`: the number of computing (non-shape) ops an island needs to be reported.
    - `cat_inputs`: report `cat` inputs observed with different qparams.

    ## References
    - https://pytorch.org/docs/stable/quantization.html#backend-hardware-support
    - torch.ao.quantization.get_default_qconfig_mapping, torch.ao.quantization.backend_config
    - torch/ao/quantization/fx/prepare.py (`_maybe_make_input_output_share_observers`)
    - torch/ao/quantization/fx/utils.py ("QConfig must specify a FixedQParamsObserver ...")
    """

    code = "QL103"
    name = "qconfig"
    summary = "A qconfig does not fit the backend, leaves a float island, or splits cat's qparams."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG})

    class Options(RuleOptions):
        fixed_qparams: bool = Field(True, description="Check fixed-qparams ops.")
        backend_support: bool = Field(True, description="Check dtypes, ranges and qschemes.")
        reduce_range: bool = Field(True, description="Check reduce_range of conv/linear inputs.")
        report_wasted_reduce_range: bool = Field(True, description="Report unneeded reduce_range.")
        float_islands: bool = Field(True, description="Report float ops between quantized ops.")
        min_island_ops: int = Field(1, ge=1, description="Computing ops an island needs.")
        cat_inputs: bool = Field(True, description="Report cat inputs with different qparams.")

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding]:
        state = QConfigCheckState(ctx)
        if self.options.fixed_qparams and not state.eager:
            yield from fixed_qparams_findings(self, state)
        if self.options.backend_support:
            yield from backend_support_findings(self, state)
        if self.options.reduce_range:
            yield from reduce_range_findings(self, state, self.options.report_wasted_reduce_range)
        if self.options.float_islands:
            yield from float_island_findings(self, state, self.options.min_island_ops)
        if self.options.cat_inputs and not state.eager:
            yield from cat_input_findings(self, state)


# --- examples --------------------------------------------------------------------------


class _Head(nn.Module):
    """Conv stem, a two-branch cat, a sigmoid gate, a linear head and a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.left = nn.Conv2d(8, 8, 1)
        self.right = nn.Conv2d(8, 8, 3, padding=1)
        self.gate = nn.Sigmoid()
        self.fc = nn.Linear(16, 4)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        y = F.relu(self.stem(x))
        y = torch.cat([F.relu(self.left(y)), self.right(y)], 1)
        y = y * self.gate(y)
        return self.softmax(self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)))


class _GeluSandwich(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.GELU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.act(self.conv1(x)))


class _GatedCat(nn.Module):
    """cat([sigmoid(a), relu(b)]): the sigmoid branch comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv2d(3, 4, 1)
        self.sig = nn.Sigmoid()
        self.out = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.out(torch.cat([self.sig(self.a(x)), torch.relu(self.b(x))], 1))


class _EagerIsland(nn.Module):
    def __init__(self, island: bool) -> None:
        super().__init__()
        self.island = island
        self.quant = QuantStub()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.dequant1 = DeQuantStub()
        self.norm = nn.LayerNorm([8, 8, 8])
        self.quant2 = QuantStub()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.dequant = DeQuantStub()

    def forward(self, x):
        y = self.conv1(self.quant(x))
        if self.island:
            y = self.quant2(self.norm(self.dequant1(y)))
        y = self.dequant(self.conv2(y))
        return self.norm(y) if not self.island else y


def _head() -> nn.Module:
    return seeded(_Head)()


def _gelu_sandwich() -> nn.Module:
    return seeded(_GeluSandwich)()


def _gated_cat() -> nn.Module:
    return seeded(_GatedCat)()


def _eager(island: bool) -> nn.Module:
    model = seeded(_EagerIsland, island)()
    model.qconfig = get_default_qconfig("x86")
    return model


def _eager_clean() -> nn.Module:
    return _eager(False)


def _eager_island() -> nn.Module:
    return _eager(True)


def _image() -> tuple[torch.Tensor, ...]:
    return (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def _x86_default() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


def _qnnpack_default() -> QConfigMapping:
    return get_default_qconfig_mapping("qnnpack")


def _global_only() -> QConfigMapping:
    return QConfigMapping().set_global(get_default_qconfig("x86"))


def _qint8_activations() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.qint8, reduce_range=True),
        weight=default_per_channel_weight_observer,
    )
    return get_default_qconfig_mapping("x86").set_global(qconfig)


def _qnnpack_symmetric_full_range() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    return get_default_qconfig_mapping("qnnpack").set_global(qconfig)


def _x86_full_range() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=False), weight=default_per_channel_weight_observer
    )
    return get_default_qconfig_mapping("x86").set_global(qconfig)


def _onednn_affine_weights() -> QConfigMapping:
    qconfig = QConfig(
        activation=HistogramObserver.with_args(reduce_range=False),
        weight=PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_affine),
    )
    return get_default_qconfig_mapping("onednn").set_global(qconfig)


def _gelu_in_float() -> QConfigMapping:
    return get_default_qconfig_mapping("x86").set_module_name("act", None)


def _gelu_at_edge() -> QConfigMapping:
    return get_default_qconfig_mapping("x86").set_module_name("conv2", None).set_module_name("act", None)


VALID = (
    Example(
        "conv/cat/sigmoid/linear/softmax model under x86's default mapping", _head, _image, qconfig_mapping=_x86_default
    ),
    Example(
        "the same model under qnnpack's default mapping",
        _head,
        _image,
        qconfig_mapping=_qnnpack_default,
        backend="qnnpack",
    ),
    Example(
        "float ops at the end of the model are not an island", _gelu_sandwich, _image, qconfig_mapping=_gelu_at_edge
    ),
    Example("eager model whose float LayerNorm runs after the last DeQuantStub", _eager_clean, _image),
)
INVALID = (
    Example(
        "set_global(get_default_qconfig('x86')) gives the sigmoid a HistogramObserver",
        _head,
        _image,
        qconfig_mapping=_global_only,
        flagged=("gate", "softmax"),
    ),
    Example("qint8 activations on x86", _gelu_sandwich, _image, qconfig_mapping=_qint8_activations, flagged=("conv1",)),
    Example(
        "qnnpack qint8 activations with weights in [-128, 127]",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_qnnpack_symmetric_full_range,
        backend="qnnpack",
        flagged=("conv1",),
    ),
    Example(
        "reduce_range=False activations on x86",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_x86_full_range,
        flagged=("conv1",),
    ),
    Example(
        "per-channel affine weights on onednn",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_onednn_affine_weights,
        backend="onednn",
        flagged=("conv1",),
    ),
    Example(
        "GELU with qconfig None between two quantized convs",
        _gelu_sandwich,
        _image,
        qconfig_mapping=_gelu_in_float,
        flagged=("act",),
    ),
    Example(
        "cat of a sigmoid branch and a relu branch", _gated_cat, _image, qconfig_mapping=_x86_default, flagged=("cat",)
    ),
    Example("eager LayerNorm between DeQuantStub and QuantStub", _eager_island, _image, flagged=("norm",)),
)
