"""QL205 leading-token-outlier."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from pydantic import Field
from torch.ao.quantization import QConfigMapping, default_dynamic_qconfig, get_default_qconfig_mapping

from qlint.core.batches import call_model
from qlint.core.intent import CallDescription, QConfigResolver
from qlint.linter.activation import activation_bits, measured_input, physical_bits
from qlint.linter.context import LintContext
from qlint.linter.findings import Finding, Impact, LayerRow, Severity
from qlint.linter.fixes import SplitLeadingToken
from qlint.linter.mapping import qconfig_mapping
from qlint.linter.rule import Example, Need, Rule, RuleOptions
from qlint.linter.suggestions import ModuleDecision, Provenance, Suggestions
from qlint.measure.rewrite import fanout_follows_original
from qlint.measure.token_split import split_leading_token


class LeadingTokenOutlier(Rule):
    """Flags Linear layers whose input's first token dwarfs every other token, where running
    that token on its own copy of the layer gives the others their range back.

    ## What it does
    Runs the float model on the calibration data and, for every quantized Linear called on
    a `(batch, tokens, features)` input, compares the largest magnitude of the first token
    (`x[:, 0]`) with that of all the other tokens. It fires when the ratio reaches
    `min_ratio`; the other tokens then lose `log2(ratio)` of their bits, never more than the
    input has: those QL203 counts for the same backend (the level count the trial measured,
    else the qconfig's; 7 for x86's `reduce_range`). All the flagged Linears form one
    finding, whose fix is measured as a whole.

    ## Why is this bad?
    BERT-style encoders put very large activations on the first token ([CLS]): in
    all-MiniLM-L6-v2 it reaches 100x the other tokens in the first layers. A Linear's input
    gets one quantization range per tensor (per call, when dynamic), so the first token sets
    the step and the other tokens keep a few levels. A Linear acts on the last dimension
    only, so the first token can run on a copy of the layer that shares its weights, each
    part with its own range, and the outputs be joined: exact in float. The split pays
    where each call gets its own range, as a dynamic Linear does; under a static mapping
    both parts read one observer (a slice shares its input's), so it gains little there.
    So the split is suggested for dynamic Linears only: a plan applies it where it runs the
    Linear dynamic (`qlint verify`'s scheme search makes Linears dynamic where that gains).
    The finding's impact is what it gains under the mapping you lint with; its message also
    gives the gain with every Linear dynamic and the rest float (torch's `quantize_dynamic`
    recipe), the regime verify tries.

    ## Example
    ```python
    hidden = encoder_layer(hidden)      # hidden[:, 0] is 100x larger than hidden[:, 1:]
    out = self.dense(hidden)            # one range for every token
    ```

    ## Use instead
    The suggested `split_leading_token` rewrite (applied by `qlint verify`, `plan.quantize()`
    and `qlint quantize` to the Linears the plan runs dynamic), or the same by hand:
    ```python
    out = torch.cat([self.dense_token0(hidden[:, :1]), self.dense(hidden[:, 1:])], dim=1)
    ```

    ## Options
    - `min_ratio`: first-token magnitude over the other tokens' at which a Linear is flagged.

    ## References
    - Bondarenko et al., "Understanding and Overcoming the Challenges of Efficient Transformer Quantization" (2021)
    - Sun et al., "Massive Activations in Large Language Models" (2024)
    """

    code = "QL205"
    name = "leading-token-outlier"
    summary = "A Linear's first input token is far larger than the others, so one range starves them."
    severity = Severity.WARNING
    requires = frozenset({Need.GRAPH, Need.QCONFIG, Need.STATISTICS, Need.MODEL})

    class Options(RuleOptions):
        min_ratio: float = Field(
            2.0, gt=1, description="First-token magnitude over the others' that flags a Linear (2: one bit)."
        )

    options: Options  # this rule's own Options, so the type checker knows its fields

    def check(self, ctx: LintContext) -> Iterable[Finding | LayerRow]:
        model = ctx.traced_model()
        if model is None:
            return
        linears = [
            fqn
            for fqn in _called_once(model)
            if any(node.is_quantized for node in ctx.graph.call_sites(fqn))
            and isinstance(model.get_submodule(fqn), nn.Linear)
        ]
        flagged: list[dict[str, Any]] = []
        for fqn, (lead, rest) in measure(model, linears, ctx.data_batches()).items():
            ratio = lead / rest if rest > 0 else math.inf
            hit = ratio >= self.options.min_ratio
            if hit:
                flagged.append({"target": fqn, "first_token": lead, "other_tokens": rest, "ratio": ratio})
            yield LayerRow(
                name=fqn,
                kind="linear",
                rule=self.code,
                statistic="first token / other tokens (max |x|)",
                value=ratio,
                verdict="flagged" if hit else "ok",
            )
        if flagged:
            yield self._finding(ctx, flagged)

    def _finding(self, ctx: LintContext, flagged: list[dict[str, Any]]) -> Finding:
        worst = max(flagged, key=lambda layer: layer["ratio"])
        # the bits of the worst layer's input, counted as QL203 counts them for that input
        dtype_bits = min(
            activation_bits(node, measured_input(ctx, node), ctx.graph.exported, ctx.backend.name)
            for node in ctx.graph.call_sites(worst["target"])
        )
        bits = physical_bits(math.log2(worst["ratio"]), dtype_bits)
        message = (
            f"the first token of the input of {len(flagged)} Linear layer(s) is far larger than the others: "
            f"worst {worst['target']!r}, {worst['first_token']:.4g} against {worst['other_tokens']:.4g} "
            f"({worst['ratio']:.1f}x). One quantization range for every token costs the others "
            f"{bits:.1f} of their {dtype_bits} bits. Run the first token on a weight-sharing copy of each layer, "
            "exact in float: the split_leading_token rewrite."
        )
        targets = [layer["target"] for layer in flagged]
        measured = _measure_split(ctx, targets)
        data: dict[str, Any] = {
            "kind": "leading-token-outlier",
            "layers": flagged,
            "bits_lost": bits,
            "dtype_bits": dtype_bits,
        }
        if measured.dynamic is not None:
            data["dynamic_recipe"] = measured.dynamic
        # for dynamic Linears only: a static Linear's parts read one observer (no gain), and that
        # observer, shared with its input, also sees the first token alone
        fix = SplitLeadingToken(modules=targets, only_dynamic=True) if measured.offer else None
        return self.finding(worst["target"], message + measured.said, data=data, suggestion=fix, impact=measured.impact)


@dataclasses.dataclass(frozen=True)
class _SplitMeasured:
    """What the split was measured to do. ``impact``: under the intended mapping, where the
    split applies to the Linears that mapping runs dynamic (a plan's split applies where the
    plan does); ``dynamic``: the output SQNR without and with the split of every flagged Linear
    under torch's quantize_dynamic recipe (information: the regime verify's scheme search
    tries); ``offer``: whether the split gains in either, or nothing measured it."""

    impact: Impact | None
    said: str
    dynamic: dict[str, float] | None = None
    offer: bool = True


def _measure_split(ctx: LintContext, targets: Sequence[str]) -> _SplitMeasured:
    """The split measured under the intended mapping (the finding's impact) and, where the
    backend has dynamic Linears and that mapping does not already run them all dynamic, with
    every Linear dynamic and the rest float; a sentence gives both. Nothing without a trial.

    Only the first is the impact, what a plan that keeps the intended mapping gets. On MiniLM
    the split gained +3.4 dB with every Linear dynamic and nothing under static x86; taken
    as its impact, it went into a static plan as "+3.4 dB", where its shared observer cost
    QL203's clipping observer on the same Linear its gain (3.5 dB for the plan, 5.6 without)."""
    bench, intended, trial = ctx.trial_bench, ctx.qconfig_mapping, ctx.trial
    if bench is None or intended is None or trial is None or trial.output_sqnr_db is None:
        return _SplitMeasured(None, "")
    model = bench.model_factory()  # the model the trial quantized
    if not isinstance(model, fx.GraphModule):
        return _SplitMeasured(None, "")
    dynamic = _runs_dynamic(intended, model, targets)
    if dynamic:
        split_dynamic = _split(model, dynamic)
        fixed = bench.variant(lambda: copy.deepcopy(split_dynamic)).output_powers(
            fanout_follows_original(intended, split_dynamic)
        )
        impact = Impact.between(trial.output_powers, fixed, "rule-trial", "the split applied in a trial")
        fixed_db = fixed.sqnr_db() if fixed is not None else None
        said = f" Measured: output SQNR {trial.output_sqnr_db:.2f} → " + (
            "a failed conversion" if fixed_db is None else f"{fixed_db:.2f} dB"
        )
        if len(dynamic) == len(targets):
            said += " with the split under the intended mapping"
        else:
            said += f" with the split of the {len(dynamic)} of them the intended mapping runs dynamic"
    else:
        how = "the split applies only to Linears the plan runs dynamic, and the intended mapping runs these static"
        impact = Impact.between(trial.output_powers, trial.output_powers, "rule-trial", how)
        said = (
            " The intended mapping runs these Linears static, where both parts would read one observer: "
            "the split gains nothing there, so a plan applies it only where it runs them dynamic"
        )
    gains = impact is not None and impact.ranked_db() > 0
    if not ctx.backend.has_dynamic_int8("linear") or len(dynamic) == len(targets):
        return _SplitMeasured(impact, said + ".", offer=gains or impact is None)
    linears = [str(n.target) for n in model.graph.nodes if n.op == "call_module" and _is_linear(model, n)]
    recipe = _dynamic_recipe(ctx.backend.name, list(dict.fromkeys(linears)))
    split_all = _split(model, targets)
    recipe_gain = Impact.between(
        bench.output_powers(recipe),
        bench.variant(lambda: copy.deepcopy(split_all)).output_powers(fanout_follows_original(recipe, split_all)),
        "rule-trial",
        "the split with every Linear dynamic and the rest float",
    )
    if recipe_gain is None or recipe_gain.base_sqnr_db is None or recipe_gain.fixed_sqnr_db is None:
        return _SplitMeasured(impact, said + ".", offer=gains)
    said += (
        f"; {recipe_gain.base_sqnr_db:.2f} → {recipe_gain.fixed_sqnr_db:.2f} dB with every Linear dynamic and "
        "the rest float (torch's quantize_dynamic recipe, which qlint verify's scheme search tries)."
    )
    # gained on every leave-one-out set of evaluation batches, not on one batch's luck
    steady = min(recipe_gain.ranked_db(), math.inf if recipe_gain.steady_db is None else recipe_gain.steady_db)
    recipe_numbers = {"base_sqnr_db": recipe_gain.base_sqnr_db, "split_sqnr_db": recipe_gain.fixed_sqnr_db}
    if not (gains or steady > 0):
        said += " The split gains in neither, so no fix is suggested."
    return _SplitMeasured(impact, said, recipe_numbers, offer=gains or steady > 0)


def _split(model: fx.GraphModule, targets: Sequence[str]) -> fx.GraphModule:
    """A copy of ``model`` with ``targets`` split."""
    split_model = copy.deepcopy(model)
    for fqn in targets:
        split_leading_token(split_model, fqn)
    split_model.recompile()
    return split_model


def _runs_dynamic(mapping: QConfigMapping, model: fx.GraphModule, targets: Sequence[str]) -> list[str]:
    """The Linears of ``targets`` that ``mapping`` runs dynamic."""
    resolver = QConfigResolver(mapping)
    dynamic = []
    for fqn in targets:
        qconfig, _ = resolver.resolve(CallDescription(True, (type(model.get_submodule(fqn)),), fqn, None))
        if qconfig is not None and getattr(qconfig.activation(), "is_dynamic", False):
            dynamic.append(fqn)
    return dynamic


def _is_linear(model: fx.GraphModule, node: fx.Node) -> bool:
    return isinstance(model.get_submodule(str(node.target)), nn.Linear)


def _dynamic_recipe(backend: str, linears: Sequence[str]) -> QConfigMapping:
    """torch's quantize_dynamic recipe as a mapping: every Linear dynamic int8, everything else float."""
    measured = Provenance(source="measurement", detail="QL205 dynamic-recipe trial")
    decisions = [ModuleDecision(fqn=fqn, mode="dynamic", provenance=[measured]) for fqn in linears]
    return qconfig_mapping(Suggestions(backend=backend, modules=decisions, float_by_default=True))


def _called_once(model: fx.GraphModule) -> list[str]:
    counts: dict[str, int] = {}
    for node in model.graph.nodes:
        if node.op == "call_module":
            counts[str(node.target)] = counts.get(str(node.target), 0) + 1
    return [fqn for fqn, count in counts.items() if count == 1]


def measure(model: nn.Module, linears: Sequence[str], batches: Sequence[Any]) -> dict[str, tuple[float, float]]:
    """Per Linear called on 3-D inputs: (max |x[:, 0]|, max |x[:, 1:]|) over ``batches``,
    two running numbers per layer."""
    found: dict[str, tuple[float, float]] = {}

    def watch(fqn: str) -> Any:
        def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] < 2:
                return
            lead, rest = float(x[:, 0].abs().max()), float(x[:, 1:].abs().max())
            before = found.get(fqn, (0.0, 0.0))
            found[fqn] = (max(before[0], lead), max(before[1], rest))

        return model.get_submodule(fqn).register_forward_pre_hook(record)

    handles = [watch(fqn) for fqn in linears]
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                call_model(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return found


class _TokenMixer(nn.Module):
    """Two Linears on (batch, tokens, features), with a LayerNorm between them."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 16)
        with torch.no_grad():
            for layer in (self.up, self.down):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator) * 0.2)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.norm(self.up(x))))


def _tokens(lead_scale: float):
    def batches(count: int = 4) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(1)
        out = []
        for _ in range(count):
            x = torch.randn(4, 12, 16, generator=generator)
            x[:, 0] *= lead_scale
            out.append(x)
        return out

    return batches


def _dynamic() -> QConfigMapping:
    return QConfigMapping().set_object_type(nn.Linear, default_dynamic_qconfig)


def _static() -> QConfigMapping:
    return get_default_qconfig_mapping("x86")


VALID = (
    Example("tokens of one scale", _TokenMixer, lambda: (_tokens(1.0)(1)[0],), _dynamic, calibration=_tokens(1.0)),
    Example(
        "a 2-D input has no tokens to compare",
        lambda: nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)),
        lambda: (torch.randn(8, 16),),
        _static,
        calibration=lambda: [torch.randn(8, 16) * (10.0 if i == 0 else 1.0) for i in range(4)],
    ),
)
INVALID = (
    Example(
        "the first token 50x the others, Linears dynamic",
        _TokenMixer,
        lambda: (_tokens(50.0)(1)[0],),
        _dynamic,
        calibration=_tokens(50.0),
        flagged=("up",),
    ),
    Example(
        "the first token 50x the others, static x86",
        _TokenMixer,
        lambda: (_tokens(50.0)(1)[0],),
        _static,
        calibration=_tokens(50.0),
        flagged=("up",),
    ),
)
