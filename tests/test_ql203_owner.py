"""QL203's clipping observer goes on the op whose qconfig makes the observer of the layer's input.

On silero_vad QL203 told the user to "give lstm_cell a clipping activation observer" for the
input of final_conv (lstm_cell -> getitem -> F.relu -> unsqueeze -> final_conv). lstm_cell has
no static int8 kernel and stays float, so no observer of its own exists: prepare_fx makes that
observer from F.relu's qconfig, and the fix trial measured the suggestion as changing nothing.
For conv1 (input from a ``sqrt``, which prepare_fx leaves float) it said keep the layer float,
though conv1's own qconfig makes that observer. Each case here is checked against prepare_fx
itself: a marked observer set on the suggested target must be the one at the layer's input.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization import MinMaxObserver, QConfig, get_default_qconfig_mapping
from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
from torch.ao.quantization.quantize_fx import prepare_fx

import qlint

MARK = 77  # a quant_max no default observer has


class _SamePadConv1d(nn.Conv1d):
    """A conv subclass whose forward pads and calls F.conv1d on its own weight (as EfficientNet's
    Conv2dStaticSamePadding): FX traces through it to a functional conv inside the module."""

    def forward(self, x):
        return F.conv1d(F.pad(x, (1, 1)), self.weight, self.bias, self.stride, (0,), self.dilation, self.groups)


class _Chain(nn.Module):
    """x -> (producer) -> (ops between) -> conv; channel 3 of conv's input has rare spikes."""

    def __init__(self, producer: str, between: str) -> None:
        super().__init__()
        self.producer, self.between = producer, between
        self.first = nn.Conv1d(8, 8, 1)
        self.padded = _SamePadConv1d(8, 8, 3)
        self.gelu = nn.GELU()  # no static int8 kernel in x86's backend config: stays float
        self.relu = nn.ReLU()
        self.conv = nn.Conv1d(8, 4, 1)

    def forward(self, x):
        if self.producer == "sqrt":
            y = torch.sqrt(x.abs())
        elif self.producer == "conv":
            y = self.first(x)
        elif self.producer == "gelu":
            y = self.gelu(x)
        elif self.producer == "samepad":
            y = self.padded(x)
        else:
            y = x
        if self.between == "module_relu":
            y = self.relu(y)
        elif self.between == "functional_relu":
            y = F.relu(y)
        return self.conv(y)


def _batches(producer: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        x = torch.rand(16, 8, 32, generator=generator) + 1.0
        if producer == "sqrt":
            x = x**2
        batches.append(x)
    return batches


def _marked() -> QConfig:
    default = get_default_qconfig_mapping("x86").global_qconfig
    return QConfig(activation=MinMaxObserver.with_args(quant_min=0, quant_max=MARK), weight=default.weight)


def _input_observer_is_marked(model: nn.Module, example: tuple, target: str) -> bool:
    """prepare_fx (x86) with a marked observer on module ``target``: is it the observer of conv's input?"""
    mapping = get_default_qconfig_mapping("x86").set_module_name(target, _marked())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(model, mapping, example, backend_config=get_x86_backend_config())  # as lint's trial
    conv = next(node for node in prepared.graph.nodes if node.target == "conv")
    observer = conv.args[0]
    return observer.op == "call_module" and getattr(prepared.get_submodule(observer.target), "quant_max", None) == MARK


def _spiky_model_finding(producer: str, between: str):
    torch.manual_seed(0)
    model = _Chain(producer, between).eval()
    if producer == "conv":
        # conv's output channel 3 spikes: a large bias on a rare input value is enough
        with torch.no_grad():
            model.first.weight.zero_()
            model.first.weight[:, :, 0] = torch.eye(8)
    if producer == "samepad":
        with torch.no_grad():
            model.padded.weight.zero_()
            model.padded.weight[:, :, 1] = torch.eye(8)
    batches = _batches(producer)
    for batch in batches:
        batch[0, 3, 0] = 400.0
    report = qlint.lint(model, (batches[0],), calibration=batches, select=["QL203"], trial_options={"enabled": False})
    outliers = [f for f in report.findings if f.data.get("kind") == "outlier" and f.target == "conv"]
    return model, batches, outliers


@pytest.mark.parametrize(
    ("producer", "between", "owner"),
    [
        ("sqrt", "none", "conv"),  # sqrt stays float: conv's qconfig observes its input
        ("sqrt", "module_relu", "relu"),  # the ReLU after a float op quantizes its own input
        ("gelu", "module_relu", "relu"),  # the module producing it stays float: the ReLU's, not the GELU's
        ("gelu", "none", "conv"),
        ("conv", "module_relu", "first"),  # a quantized producer's output observer, shared by the ReLU
        ("input", "none", "conv"),  # a graph input: the layer's own
        ("samepad", "none", "padded"),  # a functional conv on its module's weight: that module's by name
    ],
)
def test_clipping_observer_goes_where_prepare_fx_makes_the_input_observer(producer, between, owner):
    model, batches, outliers = _spiky_model_finding(producer, between)
    assert [f.target for f in outliers] == ["conv"]
    suggestion = outliers[0].suggestion
    assert suggestion is not None and suggestion.action == "set_activation_observer"
    assert suggestion.targets == [owner]
    assert outliers[0].data["fix_target"] == owner
    assert _input_observer_is_marked(model, (batches[0],), owner)


def test_a_functional_conv_inside_its_module_gets_the_fix_and_the_ops_sharing_the_qconfig_are_named():
    """EfficientNet's same-padding convs: QL203 said 'a functional op with no qconfig of its own'
    and suggested keeping the layer float, though the conv module's qconfig reaches it by name."""
    model, batches, outliers = _spiky_model_finding("samepad", "none")
    [finding] = outliers
    assert "no qconfig of its own" not in finding.message
    assert "padded (its functional conv1d gets its qconfig by name, and so do the other ops of its forward: pad)" in (
        finding.message
    )


def test_an_observer_made_by_a_functional_op_is_named_and_the_layer_is_kept_float():
    model, batches, outliers = _spiky_model_finding("sqrt", "functional_relu")
    assert [f.target for f in outliers] == ["conv"]
    assert outliers[0].suggestion is not None and outliers[0].suggestion.action == "keep_float"
    assert "made by relu (relu), a functional op" in outliers[0].message
    # neither the layer's qconfig nor anything upstream makes it: F.relu's does
    assert not _input_observer_is_marked(model, (batches[0],), "conv")


class _Attention(nn.Module):
    """A GELU (no static int8 kernel under x86) feeding q, k and v: each observes its own input."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.GELU()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.act(x)
        return self.q(h) + self.k(h) + self.v(h)


def test_layers_reading_one_tensor_share_one_finding_whose_fix_reaches_each_layers_observer():
    """On MiniLM QL203 reported each attention block's q, k and v input three times."""
    torch.manual_seed(0)
    model = _Attention().eval()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 16, 8, generator=generator) for _ in range(8)]
    for batch in batches:
        batch[0, 0, 3] = 400.0  # a rare spike in channel 3
    report = qlint.lint(model, (batches[0],), calibration=batches, select=["QL203"], trial_options={"enabled": False})
    outliers = [f for f in report.findings if f.data.get("kind") == "outlier"]
    assert len(outliers) == 1
    assert outliers[0].data["read_by"] == ["q", "k", "v"] and "of q, k and v (one tensor" in outliers[0].message
    suggestion = outliers[0].suggestion
    assert suggestion is not None and suggestion.targets == ["q", "k", "v"] == outliers[0].data["fix_targets"]
    assert [row.name for row in report.layers if row.rule == "QL203"] == ["q", "k", "v"]  # rows stay per layer
    for layer in suggestion.targets:
        mapping = get_default_qconfig_mapping("x86").set_module_name(layer, _marked())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare_fx(model, mapping, (batches[0],), backend_config=get_x86_backend_config())
        observer = next(node for node in prepared.graph.nodes if node.target == layer).args[0]
        assert getattr(prepared.get_submodule(observer.target), "quant_max", None) == MARK


class _Latents(nn.Module):
    """proj reads a parameter (no producer node), next reads proj's output: two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.rand(16, 8) + 1.0)
        self.proj = nn.Linear(8, 8)
        self.next = nn.Linear(8, 4)

    def forward(self, x):
        return self.next(self.proj(self.latents)) + x


def test_layers_reading_different_tensors_are_not_grouped():
    """The review found proj and next merged into one finding (proj read no node, and the key
    for it was its own name, which is next's producer's): next's own outlier channel vanished."""
    torch.manual_seed(0)
    model = _Latents().eval()
    with torch.no_grad():
        model.latents[0, 5] = 400.0  # proj's input: a spike in channel 5
    generator = torch.Generator().manual_seed(0)
    batches = [torch.rand(16, 4, generator=generator) for _ in range(8)]
    report = qlint.lint(model, (batches[0],), calibration=batches, select=["QL203"], trial_options={"enabled": False})
    outliers = {f.target: f for f in report.findings if f.data.get("kind") == "outlier"}
    assert set(outliers) == {"proj", "next"}, [f.message for f in outliers.values()]
    assert outliers["proj"].data["outlier_channels"] == [5]
    assert outliers["next"].data["outlier_channels"] != [5]  # its own channels, not proj's
