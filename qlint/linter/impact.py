"""The measured cost of each warning and error: what fixing it gains in output SQNR.

For every warning and error, in order of their layer's local error, while the budget
of single fix trials (``max_fix_trials``) lasts:

1. the finding's fix is a qconfig change (observer, dtype, scheme, keep float,
   dynamic): the model is quantized again with the intended mapping plus that change,
   and the impact is the output SQNR gained (``fix-trial``);
2. the fix changes the float model without changing its function (a fusion, BN
   folding, a reshape, equalization): a rewritten copy is quantized with the intended
   mapping plus the fix's own qconfig changes, where it has some (``fix-trial``);
3. otherwise the target is kept float instead, and the impact is what quantizing it
   costs, the most any fix of it can recover (``keep-float-trial``).

Past that budget, the remaining findings are measured in groups, by adaptive group
testing: the fixes of one rule's findings are applied together in one trial; a group
that gains less than ``min_impact_db`` settles all its members (each one's share is at
most the group's, when the fixes do not interact), and a group that gains more is split
in halves and measured again, while a second budget of ``max_fix_trials`` group trials
lasts (``group-trial``). A few findings that matter among many cost about
``k·log2(n)`` trials instead of ``n``.

Only a fix no trial can express (a functional op with no fix) gets an estimate from
the layer's own (shadow) error and the output error (``local-error``).

A finding whose impact is below ``min_impact_db`` becomes info: it is real, but fixing
it would not move the int8 model. So does one whose gain reaches the threshold only with
the evaluation batch that gains most (``Impact.steady_db``, the smallest leave-one-out gain):
held-out data does not repeat one batch's luck. A finding whose rule measured its gain
itself (``rule-trial``, built with ``Impact.between``) is judged the same way.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch.fx as fx
from torch.ao.quantization import QConfigMapping

from qlint.core.batches import as_call
from qlint.core.sqnr import BatchPowers, predicted_gain_db
from qlint.errors import QlintError, first_line
from qlint.linter.findings import Finding, Impact, ImpactBasis, Severity
from qlint.linter.fixes import SetQConfig
from qlint.linter.mapping import restore_type_default, with_decisions
from qlint.linter.suggestions_from_fixes import collect_suggestions
from qlint.linter.trial_stage import TrialOptions
from qlint.measure.equalization import apply_equalization
from qlint.measure.pt2e_trial import TORCH_LAYER_CLASSES, missed_torch_layer, quantizer_leaves_float
from qlint.measure.rewrite import apply_requested_rewrites, fanout_follows_original
from qlint.measure.trial import TrialResult
from qlint.measure.trial_bench import TrialBench

Family = Literal["qconfig", "rewrite", "keep-float"]
_FAMILY_DETAIL: dict[Family, str] = {
    "qconfig": "the fix applied in a trial",
    "rewrite": "the fix's float-preserving rewrite (and its qconfig changes) applied in a trial",
    "keep-float": "the target kept float in a trial (the most a fix of it recovers)",
}


def fix_mapping(base: QConfigMapping, findings: Sequence[Finding], backend: str) -> QConfigMapping | None:
    """``base`` with the findings' qconfig changes; None when a fix is not a qconfig change.

    A fix by op type that asks for the backend default's qconfig (QL103's fixed qparams for a
    functional sigmoid) restores that default for every spelling of the op. A plan needs no
    entry for it: its mapping starts from that default."""
    by_type = [f.suggestion for f in findings if isinstance(f.suggestion, SetQConfig) and f.suggestion.by_op_type()]
    suggested = [(f.suggestion, f.provenance()) for f in findings if f.suggestion and f.suggestion not in by_type]
    if not suggested and not by_type:
        return None
    if suggested:
        suggestions = collect_suggestions(backend, None, suggested)
        if suggestions.rewrites or suggestions.equalization or suggestions.notes:
            return None
        if not (suggestions.modules or suggestions.float_functions):
            return None
        mapping = with_decisions(copy.deepcopy(base), suggestions)
    else:
        mapping = copy.deepcopy(base)
    for fix in by_type:
        default_source = fix.source is not None and fix.source.startswith("get_default_qconfig_mapping")
        if not default_source or fix.object_type is None or not restore_type_default(mapping, backend, fix.object_type):
            return None
    return mapping


def local_error_estimate(result: TrialResult, target: str, aliases: Sequence[str] = ()) -> Impact | None:
    """Output SQNR gained if ``target``'s own error vanished, assuming relative noise carries
    through the rest of the model unchanged: 10*log10(N_out / (N_out - N_layer)).

    ``aliases``: the trial's names for the same layer (a module whose forward traces to
    F.conv2d is measured as that node)."""
    layers = [found for found in (result.layer(name) for name in (target, *aliases)) if found is not None]
    if result.output_sqnr_db is None or not layers:
        return None
    own = next((layer for layer in layers if layer.shadow_db is not None), None)
    # A functional op has no shadow run (no module to re-run); its propagated SQNR includes the
    # error it inherits, so the estimate is then an upper bound, and says so.
    layer = own or next((layer for layer in layers if layer.propagated_db is not None), None)
    if layer is None:
        return None
    layer_db = layer.shadow_db if own is not None else layer.propagated_db
    if layer_db is None:
        return None
    db = predicted_gain_db(result.output_sqnr_db, [layer_db])
    detail = (
        f"the layer's own error is {layer_db:.1f} dB SQNR (shadow)"
        if own is not None
        else f"the error at the layer's output is {layer_db:.1f} dB SQNR (propagated: an upper bound)"
    )
    return Impact(db=round(db, 3), basis="local-error", base_sqnr_db=round(result.output_sqnr_db, 3), detail=detail)


class ImpactMeter:
    """Measures findings against one trial bench: at most ``max_fix_trials`` single trials, then
    as many group trials again. Identical fixes share one trial."""

    def __init__(
        self,
        bench: TrialBench,
        result: TrialResult,
        base_mapping: QConfigMapping,
        modules: frozenset[str],
        options: TrialOptions,
        aliases: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.bench, self.result, self.base, self.modules = bench, result, base_mapping, modules
        self.options = options
        self.aliases = aliases or {}  # module fqn -> the graph nodes it computes
        self.trials = 0  # every fix trial run, single and group
        self._measured: dict[str, BatchPowers | None] = {}
        self._failures: dict[str, str] = {}  # trial key -> the step that failed and its error's first line

    def exhausted(self) -> bool:
        """The single-trial budget is spent: further findings are measured in groups."""
        return self.trials >= self.options.max_fix_trials

    def _groups_exhausted(self) -> bool:
        return self.trials >= 2 * self.options.max_fix_trials

    def families(self, finding: Finding) -> tuple[Family, ...]:
        """How the finding's fix can be applied in a trial, in order of preference: its qconfig
        change, its float-preserving rewrite, or (the bound) its target kept float."""
        found: list[Family] = []
        if fix_mapping(self.base, [finding], self.bench.backend) is not None:
            found.append("qconfig")
        elif finding.suggestion is not None:
            suggestions = collect_suggestions(self.bench.backend, None, [(finding.suggestion, finding.provenance())])
            if suggestions.rewrites or suggestions.equalization:
                found.append("rewrite")
        if finding.target in self.modules:
            found.append("keep-float")
        return tuple(found)

    def _trial(self, findings: Sequence[Finding], family: Family) -> BatchPowers | None:
        """The output, per evaluation batch, with the fixes of ``findings`` applied at once, in one
        trial (cached); None when they cannot be applied (no trial spent), the trial fails or its
        SQNR is undefined."""
        key = _trial_key(findings, family)
        if key in self._measured:
            return self._measured[key]
        bench = self.bench
        if family == "keep-float" and all(self._already_float(finding.target) for finding in findings):
            return self.result.output_powers  # the same model as the trial: no trial needed
        if family == "qconfig":
            mapping = fix_mapping(self.base, findings, bench.backend)
        elif family == "keep-float":
            mapping = copy.deepcopy(self.base)
            for finding in findings:
                mapping.set_module_name(finding.target, None)
        else:
            # The rewrites, and with them the fixes' qconfig changes (a fix may ask for both).
            suggested = [(f.suggestion, f.provenance()) for f in findings if f.suggestion is not None]
            suggestions = collect_suggestions(bench.backend, None, suggested)
            rewritten = self._rewritten_model(suggestions)
            if rewritten is not None:  # the rewritten copy is compared with its own float outputs
                mapping = fanout_follows_original(with_decisions(copy.deepcopy(self.base), suggestions), rewritten)
                bench = bench.variant(lambda: copy.deepcopy(rewritten))
            else:
                mapping = None
        if mapping is None:
            self._measured[key] = None
            return None
        self.trials += 1
        result = bench.run(mapping, measure_layers=False)
        self._record_failure(key, result)
        powers = result.output_powers
        self._measured[key] = powers if powers is not None and powers.sqnr_db() is not None else None
        return self._measured[key]

    def _record_failure(self, key: str, result: TrialResult) -> None:
        # A failure the bench worked around (a .view on a quantized tensor: reshape) still
        # measured the fix: only a trial that measured nothing failed.
        if result.failure is not None and result.output_powers is None:
            self._failures[key] = f"the trial's {result.failure.stage} fails ({first_line(result.failure.error, 200)})"

    def _trial_failed(self, findings: Sequence[Finding], family: Family) -> bool:
        return _trial_key(findings, family) in self._failures

    def fix_failure(self, finding: Finding) -> str | None:
        """How the trial quantization with ``finding``'s own fix (its qconfig change or its rewrite)
        failed, if one ran and measured nothing."""
        return self._failures.get(_trial_key([finding], "qconfig")) or self._failures.get(
            _trial_key([finding], "rewrite")
        )

    def _already_float(self, target: str) -> bool:
        return any(layer.target == target for layer in self.result.float_layers)

    def stays_float(self, target: str) -> Impact | None:
        """0 dB (``stays-float``) where the trial's flow leaves ``target`` float whatever its settings
        (pt2e: a conv1d, a recurrent op, a conv2d/linear the quantizer does not match); no trial runs."""
        base = self.result.output_sqnr_db
        if self.result.converter != "convert_pt2e" or base is None:
            return None
        layer = next((f for f in self.result.float_layers if f.target == target and quantizer_leaves_float(f)), None)
        if layer is None:
            return None
        detail = f"{target} stays float after {self.result.converter} whatever the quantizer's settings"
        if missed_torch_layer(layer):
            torch_class = TORCH_LAYER_CLASSES[layer.kind].rsplit(".", 1)[-1]
            detail += f" until it is a torch.nn.{torch_class} of its own, called once (QL106's fix)"
        return Impact.measured(
            base, base, "stays-float", detail + ": no fix of its quantization changes the int8 model"
        )

    def impact(self, finding: Finding) -> Impact | None:
        """The finding's fix measured alone; None past the single-trial budget, or when no trial
        expresses it (the caller decides)."""
        base = self.result.output_sqnr_db
        if base is None:
            return None
        stays_float = self.stays_float(finding.target)
        if stays_float is not None:
            return stays_float
        if self._already_float(finding.target):
            quantizing = self._fix_of_float_layer(finding)
            if quantizing is not None:
                return quantizing
            detail = f"{finding.target} already runs in float in the trial: keeping it float changes nothing"
            return Impact.measured(base, base, "already-float", detail)
        for family in self.families(finding):
            if self.exhausted():
                return None
            fixed = self._trial([finding], family)
            if fixed is not None:
                return self._single_impact(fixed, family, finding.target)
        return None

    def _fix_of_float_layer(self, finding: Finding) -> Impact | None:
        """A new qconfig for a layer the trial left float, though not on purpose (QL103's supported
        dtype), measured in a trial: kind coverage when it makes ops run in int8, else its output-SQNR
        gain. None for other fixes (an observer change is about a quantized layer's error, which a
        float layer does not have) or when no trial applies it: ``already-float`` then says 0 dB."""
        if not isinstance(finding.suggestion, SetQConfig) or self.exhausted():
            return None
        on_purpose = any(f.target == finding.target and f.reason == "kept-float" for f in self.result.float_layers)
        mapping = fix_mapping(self.base, [finding], self.bench.backend)
        if on_purpose or mapping is None:
            return None
        self.trials += 1
        fixed = self.bench.run(mapping, measure_layers=False)
        self._record_failure(_trial_key([finding], "qconfig"), fixed)
        gained = fixed.int8_ops - self.result.int8_ops
        if gained > 0:
            detail = f"the fix applied in a trial: {gained} more op(s) run in int8"
            return Impact.between(
                self.result.output_powers,
                fixed.output_powers,
                "fix-trial",
                detail,
                kind="coverage",
                int8_ops_gained=gained,
            )
        return Impact.between(self.result.output_powers, fixed.output_powers, "fix-trial", _FAMILY_DETAIL["qconfig"])

    def _gain(self, fixed: BatchPowers, basis: ImpactBasis, detail: str) -> Impact:
        """The gain from the trial as intended to ``fixed``, and that gain without its best batch."""
        impact = Impact.between(self.result.output_powers, fixed, basis, detail)
        if impact is None:
            raise ValueError("an impact needs the trial's and the fix's output SQNR")  # callers check both
        return impact

    def _single_impact(self, fixed: BatchPowers, family: Family, target: str) -> Impact:
        if family == "keep-float":
            detail = f"{target} kept float in a trial: the most a fix of it recovers"
            return self._gain(fixed, "keep-float-trial", detail)
        return self._gain(fixed, "fix-trial", _FAMILY_DETAIL[family])

    def grouped(self, pending: Sequence[tuple[int, Finding]]) -> dict[int, Impact]:
        """Impacts of the findings past the single-trial budget, by adaptive group testing
        within each rule and way of applying the fix (the module docstring)."""
        groups: dict[tuple[str, tuple[Family, ...]], list[tuple[int, Finding]]] = {}
        for index, finding in pending:
            families = self.families(finding)
            if families:
                groups.setdefault((finding.rule, families), []).append((index, finding))
        impacts: dict[int, Impact] = {}
        for (_rule, families), members in groups.items():
            impacts.update(self._bisect(members, families))
        return impacts

    def _bisect(self, members: Sequence[tuple[int, Finding]], families: tuple[Family, ...]) -> dict[int, Impact]:
        base = self.result.output_sqnr_db
        findings = [finding for _, finding in members]
        measured = None
        for family in families:  # as for one finding: the next way when one cannot be applied
            if base is None or self._groups_exhausted():
                return {}
            fixed = self._trial(findings, family)
            if fixed is not None:
                measured = (family, fixed)
                break
            if len(members) > 1 and self._trial_failed(findings, family):
                # one fix that torch cannot build fails the whole group: find it, measure the rest
                half = len(members) // 2
                return {**self._bisect(members[:half], families), **self._bisect(members[half:], families)}
        if base is None or measured is None:
            return {}
        family, fixed = measured
        if len(members) == 1:
            return {members[0][0]: self._single_impact(fixed, family, findings[0].target)}
        group = self._group_impact(fixed, len(members), family)
        if group.ranked_db() < self.options.min_impact_db or self._groups_exhausted():
            return {index: group for index, _ in members}
        half = len(members) // 2
        settled = self._bisect(members[:half], families)
        settled.update(self._bisect(members[half:], families))
        # where the budget ran out inside this group, its unsettled members keep the group's gain
        return {index: settled.get(index, group) for index, _ in members}

    def _group_impact(self, fixed: BatchPowers, size: int, family: Family) -> Impact:
        return self._gain(
            fixed,
            "group-trial",
            f"{_FAMILY_DETAIL[family]}, together with the fixes of {size - 1} other finding(s) of this rule; "
            "this finding's own share is at most this",
        )

    def _rewritten_model(self, suggestions: Any) -> Any:
        """The model with the suggested rewrites and equalization applied; None when none applied."""
        model = self.bench.model_factory()
        calibration = self.bench.calibration
        applied_any = False
        try:
            if suggestions.rewrites:
                example = as_call(calibration[0])[0]
                model, applied = apply_requested_rewrites(model, suggestions, example)
                applied_any |= any(record.applied for record in applied)
            if suggestions.equalization and isinstance(model, fx.GraphModule):
                modules = [pair.module for pair in suggestions.equalization]
                dynamic = suggestions.dynamic_equalized_modules()
                model, applied = apply_equalization(model, modules, calibration, dynamic=dynamic)
                applied_any |= any(record.applied for record in applied)
        except QlintError:
            return None
        return model if applied_any else None

    def estimate(self, target: str) -> Impact | None:
        if self._already_float(target):
            return None  # a float layer adds no error of its own; its output carries upstream error
        return local_error_estimate(self.result, target, self.aliases.get(target, ()))

    def combined(self, findings: Sequence[Finding]) -> float | None:
        """Output SQNR with every given finding's fix applied at once, in one trial: the qconfig
        changes, on the model rewritten as the fixes ask where one asks for a rewrite. Fixes that
        only a keep-float bound measures are left out."""
        ways = [(finding, self.families(finding)) for finding in findings]
        applicable = [finding for finding, families in ways if "qconfig" in families or "rewrite" in families]
        if any("rewrite" in families for _, families in ways):
            fixed = self._trial(applicable, "rewrite")
            if fixed is not None:
                return fixed.sqnr_db()
            # no rewrite applied to this model: the qconfig changes alone
            applicable = [finding for finding, families in ways if "qconfig" in families]
        fixed = self._trial(applicable, "qconfig") if applicable else None
        return fixed.sqnr_db() if fixed is not None else None


def _trial_key(findings: Sequence[Finding], family: Family) -> str:
    """One trial's identity: the way its fixes were applied and the fixes themselves."""
    return family + ":" + "|".join(_fix_key(f) for f in findings)


def _fix_key(finding: Finding) -> str:
    """What identifies a finding's fix in a trial: its suggestion, and the target it keeps float."""
    return finding.target + "=" + (finding.suggestion.model_dump_json() if finding.suggestion else "")


def _order_key(meter: ImpactMeter, finding: Finding) -> tuple[int, float]:
    estimate = meter.estimate(finding.target)
    return (-finding.severity.rank, -(estimate.ranked_db() if estimate else 0.0))


def demotion_note(impact: Impact, threshold: float) -> str | None:
    """What a warning's message gains when its measured impact makes it info; None when it stays."""
    if impact.fixed_sqnr_db is not None and impact.fixed_sqnr_db == impact.base_sqnr_db:
        # e.g. an observer set on a module that stays float: the int8 model is the same
        return (
            f" Measured ({impact.basis}): the fix leaves the int8 model's output exactly as it was, "
            "so it does not apply here; this is info."
        )
    if impact.ranked_db() < 0:
        return (
            f" Measured impact {impact.db:+.2f} dB ({impact.basis}): the fix makes the output worse, so this is info."
        )
    if impact.ranked_db() < threshold:
        return f" Measured impact {impact.db:+.2f} dB ({impact.basis}) is below the {threshold:g} dB threshold, so this is info."
    if impact.rests_on_one_batch(threshold):
        return (
            f" Measured impact {impact.db:+.2f} dB ({impact.basis}) rests on one evaluation batch: "
            f"without it the fix gains {impact.steady_db:+.2f} dB, below the {threshold:g} dB threshold, "
            "so this is info."
        )
    return None


def with_impacts(findings: Sequence[Finding], meter: ImpactMeter) -> tuple[list[Finding], float | None]:
    """Findings with their impact measured, below-threshold ones made info, sorted by impact;
    and the output SQNR with every kept warning's fix (None when no trial can apply any of them)."""
    threshold = meter.options.min_impact_db
    measured: dict[int, Finding] = {}
    pending: list[tuple[int, Finding]] = []
    for index, finding in sorted(enumerate(findings), key=lambda pair: _order_key(meter, pair[1])):
        if finding.impact is not None:
            measured[index] = finding
            continue
        if finding.severity is Severity.INFO:
            # an info finding's fix is not measured, but one that cannot change the int8 model
            # says so, and stays out of the plan
            impact = meter.stays_float(finding.target) if finding.suggestion is not None else None
            measured[index] = finding.model_copy(update={"impact": impact}) if impact else finding
            continue
        impact = meter.impact(finding)
        if impact is None and meter.families(finding) and meter.fix_failure(finding) is None:
            pending.append((index, finding))  # measured in groups; a fix that failed alone would fail them
            continue
        measured[index] = finding.model_copy(update={"impact": impact or meter.estimate(finding.target)})
    grouped = meter.grouped(pending)
    for index, finding in pending:
        impact = grouped.get(index) or meter.estimate(finding.target)
        measured[index] = finding.model_copy(update={"impact": impact})
    result = []
    for index in range(len(findings)):
        finding = measured[index]
        failure = meter.fix_failure(finding) if finding.suggestion is not None else None
        if failure is not None:
            # torch cannot build or run the model this fix asks for: a plan must not carry it
            why = f" Measured: with this fix {failure}, so no fix is suggested here."
            finding = finding.model_copy(update={"suggestion": None, "message": finding.message + why})
        impact = finding.impact
        if finding.severity is not Severity.INFO and impact is not None and impact.kind == "sqnr-gain":
            note = demotion_note(impact, threshold)
            if note is not None:
                finding = finding.model_copy(update={"severity": Severity.INFO, "message": finding.message + note})
        elif (
            impact is not None and impact.kind == "diagnosis" and impact.ranked_db() < threshold and finding.suggestion
        ):
            # the best single fix the diagnosis measured does not recover the output (its message
            # says so): a plan entry that changes nothing worth having
            finding = finding.model_copy(update={"suggestion": None})
        result.append(finding)
    kept = [f for f in result if f.recovers_output_sqnr()]
    fixed = meter.combined(kept) if kept else None
    result.sort(key=lambda f: (-f.severity.rank, _impact_rank(f)))
    return result, fixed


def _impact_rank(finding: Finding) -> float:
    """Largest impact first; float fallbacks (coverage) lead their severity, unmeasured ones close it."""
    if finding.impact is None:
        return math.inf
    if finding.impact.kind != "sqnr-gain":
        return -math.inf
    return -finding.impact.ranked_db()
