"""Plan entries a user's flow can apply: every module decision names a module of the model (never
an aten node name of a .pt2) and changes the qconfig prepare_fx assigns to that module's ops."""

import copy

import pytest
import torch

import qlint
from qlint.advice.plan import plan_from_report
from qlint.core.trace import symbolic_graph
from qlint.linter.mapping import qconfig_mapping
from tests.test_fixes_change_something import _assignment


def _report(exported: bool):
    from examples.badnet import build, calibration_batches
    from examples.badnet import qconfig_mapping as mapping

    model = build()
    batches = list(calibration_batches())
    if exported:
        program = torch.export.export(model, (batches[0],))
        return model, qlint.lint(
            program.module(),
            (batches[0],),
            exported_program=program,
            calibration=batches,
            qconfig_mapping=mapping(),
            calibration_options={"quiet": True},
            trial_options={"enabled": False},
        )
    return model, qlint.lint(
        model,
        (batches[0],),
        calibration=batches,
        qconfig_mapping=mapping(),
        calibration_options={"quiet": True},
        trial_options={"enabled": False},
    )


@pytest.mark.parametrize("exported", [False, True], ids=["fx", "pt2"])
def test_every_plan_entry_names_a_module_and_changes_its_qconfig(exported):
    model, report = _report(exported)
    plan = plan_from_report(report)
    modules = {name for name, _ in model.named_modules() if name}
    assert plan.modules, "the README example's plan has module decisions"
    assert [d.fqn for d in plan.modules if d.fqn not in modules] == []  # no aten node names
    traced = symbolic_graph(copy.deepcopy(model))
    example = (torch.randn(1, 3, 32, 32),)
    globals_only = qconfig_mapping(plan.model_copy(update={"modules": []}))
    before = _assignment(traced, globals_only, example, plan.backend)
    for decision in plan.modules:
        one = plan.model_copy(update={"modules": [decision]})
        after = _assignment(traced, qconfig_mapping(one), example, plan.backend)
        prefix = decision.fqn.replace(".", "_")
        changed = [name for name in before if name.startswith(prefix) and before[name] != after.get(name)]
        assert changed, f"{decision.fqn}: {decision.describe()} changes nothing prepare_fx assigns"
