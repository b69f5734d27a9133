"""The lint pipeline: load → trace → ModelGraph → rules → Report."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.ao.quantization import QConfigMapping

from qlint.core.backends import BACKENDS, backend_info
from qlint.core.batches import first_batch_as_example
from qlint.core.graph import ModelGraph, OpNode
from qlint.core.graph_builder import GraphBuilder
from qlint.core.intent import (
    CallDescription,
    NodeQConfig,
    NodeQConfigCache,
    QConfigResolver,
    default_mapping,
    describe_observer,
    load_mapping_object,
)
from qlint.core.ops import module_kind
from qlint.core.preserve import preserved_state
from qlint.core.trace import Traced, initialized_copy, is_lazy_model, propagate_shapes, trace
from qlint.errors import ConfigError, QlintError, TraceError, validation_problems
from qlint.linter.context import INTENT_DEFAULT, INTENT_EAGER, INTENT_MAPPING, INTENT_PREPARED, LintContext
from qlint.linter.docs import rule_info
from qlint.linter.findings import Finding, LayerRow, Notice, Report, Severity, SkippedRule, Timing
from qlint.linter.impact import ImpactMeter, with_impacts
from qlint.linter.qconfig_table import qconfig_rows
from qlint.linter.registry import Registry
from qlint.linter.rule import Need, Rule
from qlint.linter.trial_stage import TrialOptions, summary, trial_bench, trial_blocker
from qlint.version import __version__


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What every later stage shares: the traced GraphModule, its graph and the intent."""

    graph: ModelGraph
    traced: Traced | None  # None when only the eager-hooks fallback could see the model
    intent: str
    qconfig_mapping: QConfigMapping | None
    notices: tuple[Notice, ...]
    model: nn.Module | None = None  # the user's model, borrowed (a lazy one: an initialized copy)


def analyse(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    backend: str,
    qconfig_mapping: Any = None,
    exported_program: Any = None,
) -> Analysis:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(model, nn.Module):
        raise QlintError(f"expected an nn.Module, got {type(model).__name__}")
    # The model is borrowed, not copied: copying would double the memory of a large model.
    # Every step that runs forward (tracing, shape propagation, the eager fallback,
    # calibration) runs under preserved_state, which gives the model back as it was.
    working, notices = model, []
    if is_lazy_model(model):  # initializing the user's lazy modules would change them
        working = initialized_copy(model, example_inputs)
        notices.append(
            Notice(
                message="the model has lazy modules: qlint analysed a copy initialized by one "
                "forward pass on the example inputs; the model itself stays uninitialized"
            )
        )
    try:
        traced = trace(working, example_inputs, exported_program)
    except TraceError as error:
        if not example_inputs or exported_program is not None:
            raise
        return _eager_fallback(working, example_inputs, backend, qconfig_mapping, error)
    notices += [Notice(message=n) for n in traced.notes]
    shape_note = propagate_shapes(traced, example_inputs)
    if shape_note:
        notices.append(Notice(message=shape_note))
    intent, mapping, resolve = _intent(working, traced, backend, qconfig_mapping)
    graph = GraphBuilder(traced, working, resolve).build()
    return Analysis(graph, traced, intent, mapping, tuple(notices), working)


def _eager_fallback(
    working: nn.Module, example_inputs: Sequence[Any], backend: str, user_mapping: Any, error: TraceError
) -> Analysis:
    """Neither tracer could read the model: build the graph from one hooked eager run."""
    from qlint.core.eager_fallback import eager_analysis

    if user_mapping is not None:
        intent, mapping, resolve = _intent(working, None, backend, user_mapping)
    elif any(getattr(m, "qconfig", None) is not None for m in working.modules()):
        intent, mapping, resolve = INTENT_EAGER, None, _eager_resolver(working)
    else:
        mapping = default_mapping(backend)
        intent, resolve = INTENT_DEFAULT, _mapping_resolver(mapping)
    with preserved_state(working):  # its hooks, BN statistics and attributes come back before the rules run
        graph, notes = eager_analysis(working, example_inputs, resolve, copy_model=False)
    notices = [
        Notice(
            level=Severity.WARNING,
            message=f"{error}; analysed with eager forward hooks "
            "instead: only leaf modules and the branch taken on the example inputs are seen",
        )
    ]
    notices += [Notice(level=Severity.WARNING, message=note) for note in notes]
    return Analysis(graph, None, intent, mapping, tuple(notices), working)


def _intent(model: nn.Module, traced: Traced | None, backend: str, user_mapping: Any):
    if user_mapping is not None:
        try:
            mapping = load_mapping_object(user_mapping, backend)
        except (TypeError, ValueError) as error:
            raise ConfigError(f"bad qconfig mapping: {error}") from error
        return INTENT_MAPPING, mapping, _mapping_resolver(mapping)
    if traced is not None and _has_observer_nodes(traced.graph_module):
        return INTENT_PREPARED, None, _prepared_resolver(traced.graph_module)
    if any(getattr(m, "qconfig", None) is not None for m in model.modules()):
        return INTENT_EAGER, None, _eager_resolver(model)
    mapping = default_mapping(backend)
    return INTENT_DEFAULT, mapping, _mapping_resolver(mapping)


def _mapping_resolver(mapping: QConfigMapping):
    resolver = QConfigResolver(mapping)
    described = NodeQConfigCache()

    def resolve(call: CallDescription, _node: fx.Node, _info: OpNode) -> NodeQConfig | None:
        qconfig, source = resolver.resolve(call)
        return described.get(qconfig, source)

    return resolve


def _has_observer_nodes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_module":
            try:
                if module_kind(gm.get_submodule(str(node.target))) == "observer":
                    return True
            except AttributeError:
                continue
    return False


def _prepared_resolver(gm: fx.GraphModule):
    def resolve(call: CallDescription, _node: fx.Node, info: OpNode) -> NodeQConfig | None:
        weight = None
        if info.module is not None:
            module = gm.get_submodule(info.module)
            weight_observer = getattr(module, "weight_fake_quant", None)
            qconfig = getattr(module, "qconfig", None)
            if weight_observer is not None:
                weight = describe_observer(weight_observer)
            elif qconfig is not None and info.weight is not None:
                weight = describe_observer(qconfig.weight)
        activation = info.observed_output.activation if info.observed_output else None
        if activation is None and weight is None:
            return None
        return NodeQConfig(activation=activation, weight=weight, source="prepared")

    return resolve


def _eager_resolver(model: nn.Module):
    def qconfig_of(path: str):
        """Nearest module that sets ``qconfig``; an explicit None wins, as in torch's propagation."""
        while True:
            try:
                module = model.get_submodule(path)
            except AttributeError:
                module = None
            if module is not None and hasattr(module, "qconfig"):
                return module.qconfig
            if not path:
                return None
            path = path.rpartition(".")[0]

    described = NodeQConfigCache()

    def resolve(call: CallDescription, _node: fx.Node, _info: OpNode) -> NodeQConfig | None:
        return described.get(qconfig_of(call.module_path), "module .qconfig")

    return resolve


SLOW_RULE_SECONDS = 10.0  # a rule that takes longer gets a notice saying how long, and how to skip it


def run_rules(ctx: LintContext, rules: Iterable[Rule], *, has_statistics: bool):
    """Run every rule whose needs are met: (findings, per-layer rows, skipped rules, notices,
    one timing per rule run).

    ``check`` yields findings and, for data rules, one ``LayerRow`` per layer measured."""
    findings: list[Finding] = []
    rows: list[LayerRow] = []
    skipped, notices, timings = [], [], []
    for rule in rules:
        missing = _missing_needs(rule, ctx, has_statistics)
        if missing:
            skipped.append(SkippedRule(rule=rule.code, name=rule.name, reason=missing))
            continue
        began = time.perf_counter()
        try:
            results = list(rule.check(ctx))
            unexpected = [type(r).__name__ for r in results if not isinstance(r, (Finding, LayerRow))]
            if unexpected:
                raise TypeError(f"check() yielded {unexpected[0]}; expected Finding or LayerRow")
        except QlintError:
            raise
        except Exception as error:  # one broken rule must not hide every other finding
            reason = f"rule crashed: {type(error).__name__}: {error}"
            skipped.append(SkippedRule(rule=rule.code, name=rule.name, reason=reason[:300], crashed=True))
            notices.append(Notice(level=Severity.ERROR, message=f"{rule.code} {reason}"[:400]))
            continue
        finally:
            seconds = time.perf_counter() - began
            timings.append(Timing(stage=f"rule {rule.code}", seconds=seconds))
            if seconds >= SLOW_RULE_SECONDS:
                notices.append(
                    Notice(
                        message=(
                            f"{rule.code} ({rule.name}) took {seconds:.1f} s; to skip it, pass --ignore {rule.code} "
                            f"or add it to `ignore` under [tool.qlint]"
                        )
                    )
                )
        findings.extend(r for r in results if isinstance(r, Finding))
        rows.extend(r for r in results if isinstance(r, LayerRow))
    findings.sort(
        key=lambda f: (
            -f.severity.rank,
            f.rule,
            ctx.graph.position(f.data["node"])
            if isinstance(f.data.get("node"), str) and f.data["node"] in ctx.graph
            else 0,
            f.target,
        )
    )
    order = {node.display: i for i, node in reversed(list(enumerate(ctx.graph.nodes())))}
    rows.sort(key=lambda r: (order.get(r.name, len(order)), r.rule or ""))
    return findings, rows, skipped, notices, timings


def _nodes_of_modules(graph: ModelGraph) -> dict[str, list[str]]:
    """Module fqn -> the graph nodes it computes: called as a module, or, traced through
    (a conv subclass calling F.conv2d), the nodes that read its weight."""
    nodes: dict[str, list[str]] = {}
    for node in graph.nodes():
        owners = {node.module} if node.module else set()
        if node.weight:
            owners.add(node.weight.rpartition(".")[0])
        for owner in owners:
            if owner and owner != node.name:
                nodes.setdefault(owner, []).append(node.name)
    return nodes


def _num_batches(calibration_options: Any) -> int | None:
    """``--num-batches``: the trial reads no more calibration batches than the statistics."""
    if calibration_options is None:
        return None
    from qlint.linter.calibration.collect import CalibrationOptions

    return CalibrationOptions.of(calibration_options).num_batches


def _copier(graph_module: fx.GraphModule):
    import copy

    return lambda: copy.deepcopy(graph_module)


def _missing_needs(rule: Rule, ctx: LintContext, has_statistics: bool) -> str | None:
    if Need.EXAMPLE_INPUTS in rule.requires and not ctx.example_inputs:
        return "no example inputs (pass --input-shape or --example-inputs)"
    if Need.MODEL in rule.requires and ctx.model_factory is None:
        return "no runnable model"
    if Need.TRIAL in rule.requires and ctx.trial is None:
        return ctx.trial_skipped or "no trial quantization was run"
    if Need.STATISTICS in rule.requires and not has_statistics:
        return (
            "no calibration data: pass --calibration FILE_OR_DIR or module:function "
            "(or --random-calibration N to run on random data)"
        )
    return None


def instantiate_rules(classes: Iterable[type[Rule]], options: Mapping[str, Mapping[str, Any]]) -> list[Rule]:
    rules = []
    for cls in classes:
        raw = options.get(cls.code) or options.get(cls.name) or {}
        try:
            rules.append(cls(cls.Options(**raw)))
        except Exception as error:  # pydantic ValidationError: unknown or bad option
            raise ConfigError(f"bad options for {cls.code} ({cls.name}): {validation_problems(error)}") from error
    return rules


def _options_by_code(options: Mapping[str, Mapping[str, Any]], registry: Registry) -> dict[str, Mapping[str, Any]]:
    """Rule options keyed by rule code, whatever spelling named the rule ('ql203', the rule's
    name); options for a rule that does not exist, or given twice, are an error (as in
    [tool.qlint.rules]), never silently ignored."""
    by_code: dict[str, Mapping[str, Any]] = {}
    for key, value in options.items():
        code = registry.get(str(key)).code
        if code in by_code:
            raise ConfigError(f"options for {code} are given twice (as {key!r} and another name)")
        by_code[code] = value
    return by_code


def lint(
    model: nn.Module | torch.export.ExportedProgram,
    example_inputs: Sequence[Any] | None = None,
    calibration: Any = None,
    backend: str = "x86",
    qconfig_mapping: Any = None,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    model_name: str | None = None,
    exported_program: Any = None,
    registry: Registry | None = None,
    calibration_options: Any = None,
    trial_options: Any = None,
) -> Report:
    """Lint ``model`` (an ``nn.Module``, or a ``torch.export.ExportedProgram``: linted as
    ``qlint model.pt2`` lints it, with the pt2e trial) for quantization problems; the model
    itself is never modified.

    With example inputs, a trial quantization (prepare_fx, calibration, convert_fx on a
    private copy; prepare_pt2e and convert_pt2e for an exported graph) measures what torch
    builds, and each warning's impact in dB of output SQNR; ``trial_options`` (a :class:`~qlint.linter.trial_stage.TrialOptions` or a dict
    of its fields: ``enabled``, ``batches``, ``min_impact_db``, ``max_fix_trials``) tunes it.
    Without example inputs, the first calibration batch serves as them (unless the calibration
    data is a one-shot iterator, or its batches are keyword inputs), and a notice says so."""
    start = time.perf_counter()
    if example_inputs is not None and not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    example = tuple(example_inputs) if example_inputs is not None else None
    registry = registry or Registry.default()
    rules = instantiate_rules(registry.select(select, ignore), _options_by_code(options or {}, registry))
    trial = TrialOptions.of(trial_options)
    if isinstance(model, torch.export.ExportedProgram):
        # what `qlint model.pt2` lints: the program's module, its graph for the pt2e trial, and
        # its own example inputs where none are given
        if exported_program is not None and exported_program is not model:
            raise QlintError("got an ExportedProgram as the model and another as exported_program: pass one")
        model, exported_program = model.module(), model
        if example is None and exported_program.example_inputs is not None:
            args, kwargs = exported_program.example_inputs
            if kwargs:
                raise QlintError("the ExportedProgram has keyword example inputs; pass example_inputs positionally")
            example = tuple(args)
    if not isinstance(model, nn.Module):
        raise QlintError(f"expected an nn.Module or a torch.export.ExportedProgram, got {type(model).__name__}")
    example_note = None
    if example is None and calibration is not None:
        example = first_batch_as_example(calibration)
        if example is not None:
            example_note = "example inputs: the first calibration batch (pass example inputs to choose others)"
    # Each stage that runs forward (tracing, shapes, eager fallback, calibration) opens a
    # guard that also watches parameters; this one gives back everything else at the end.
    with preserved_state(model, watch_parameters=False):
        return _lint(
            model,
            example,
            calibration,
            backend,
            qconfig_mapping,
            rules,
            model_name,
            exported_program,
            calibration_options,
            trial,
            start,
            example_note,
        )


def _lint(
    model: nn.Module,
    example,
    calibration,
    backend,
    qconfig_mapping,
    rules,
    model_name,
    exported_program,
    calibration_options,
    trial_options: TrialOptions,
    start,
    example_note: str | None,
) -> Report:
    timings: list[Timing] = []
    analysis = analyse(model, example, backend, qconfig_mapping, exported_program)
    timings.append(Timing(stage="trace", seconds=time.perf_counter() - start))
    notices = list(analysis.notices)
    if example_note is not None:
        notices.append(Notice(message=example_note))
    statistics = None
    if calibration is not None and any(Need.STATISTICS in r.requires for r in rules):
        from qlint.linter.calibration import collect_statistics

        stage = time.perf_counter()
        statistics, calibration_notices = collect_statistics(analysis, rules, calibration, calibration_options)
        notices.extend(calibration_notices)
        timings.append(Timing(stage="calibrate", seconds=time.perf_counter() - stage))
    bench, trial = None, None
    blocker = trial_blocker(analysis, example, trial_options, backend)
    if blocker is None and analysis.qconfig_mapping is not None and example is not None:
        stage = time.perf_counter()
        bench = trial_bench(analysis, example, calibration, backend, trial_options, _num_batches(calibration_options))
        trial = bench.run(analysis.qconfig_mapping)
        timings.append(Timing(stage="trial", seconds=time.perf_counter() - stage))
        if trial.evidence_note is not None:
            notices.append(Notice(level=Severity.WARNING, message=trial.evidence_note))
    ctx = LintContext(
        graph=analysis.graph,
        backend=backend_info(backend),
        intent=analysis.intent,
        qconfig_mapping=analysis.qconfig_mapping,
        example_inputs=example,
        statistics=statistics,
        model_name=model_name or type(model).__name__,
        model_factory=_copier(analysis.traced.graph_module) if analysis.traced else None,
        trial=trial,
        trial_bench=bench,
        trial_skipped=blocker or "",
    )
    stage = time.perf_counter()
    findings, layers, skipped, rule_notices, rule_timings = run_rules(ctx, rules, has_statistics=statistics is not None)
    notices.extend(rule_notices)
    timings.append(Timing(stage="rules", seconds=time.perf_counter() - stage))
    timings.extend(rule_timings)
    trial_summary = None
    if bench is not None and trial is not None:
        fixed = None
        meter = None
        if trial.measured and analysis.traced is not None and analysis.qconfig_mapping is not None:
            stage = time.perf_counter()
            modules = frozenset(name for name, _ in analysis.traced.graph_module.named_modules() if name)
            meter = ImpactMeter(
                bench, trial, analysis.qconfig_mapping, modules, trial_options, _nodes_of_modules(analysis.graph)
            )
            findings, fixed = with_impacts(findings, meter)
            timings.append(Timing(stage="impact", seconds=time.perf_counter() - stage))
        trial_summary = summary(bench, trial, fixed_sqnr_db=fixed, fix_trials=meter.trials if meter else 0)
    timings.append(Timing(stage="total", seconds=time.perf_counter() - start))
    report = Report(
        qlint_version=__version__,
        torch_version=torch.__version__,
        model=ctx.model_name,
        backend=backend,
        frontend=analysis.graph.frontend,
        findings=findings,
        skipped=skipped,
        notices=notices,
        timings=timings,
        layers=layers,
        qconfig_table=qconfig_rows(analysis.graph),
        rules=[rule_info(type(rule)) for rule in rules],
        trial=trial_summary,
    )
    # the fixes were measured on top of the user's mapping: report.qconfig_mapping() starts from it
    return report.linted_with(analysis.qconfig_mapping if analysis.intent == INTENT_MAPPING else None)
