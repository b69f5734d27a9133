"""lint never modifies the user's model: parameters, buffers, mode, hooks and outputs."""

import pytest
import torch

import qlint
from examples.badnet import build, qconfig_mapping
from tests import models


def _snapshot(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        {name: m.training for name, m in model.named_modules()},
        {
            name: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for name, m in model.named_modules()
        },
    )


@pytest.mark.parametrize(
    "factory,train", [(build, False), (models.gated_nested_train, True), (models.residual_functional, False)]
)
def test_lint_leaves_model_untouched(factory, train):
    model = factory()
    model.train(train)
    x = torch.randn(2, 3, 32, 32) if factory is build else torch.randn(2, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        before_out = model(x)
    model.train(train)
    state, modes, hooks = _snapshot(model)
    param_ids = {k: id(v) for k, v in model.named_parameters()}

    calibration = [torch.randn_like(x) * (k + 1) for k in range(3)]
    report = qlint.lint(
        model, (x,), calibration=calibration, qconfig_mapping=qconfig_mapping() if factory is build else None
    )
    assert not [s for s in report.skipped if s.rule.startswith("QL2")]  # data rules really ran
    assert report.findings  # it really analysed the model

    new_state, new_modes, new_hooks = _snapshot(model)
    assert new_state.keys() == state.keys()
    for key in state:
        assert torch.equal(new_state[key], state[key]), key
    assert new_modes == modes
    assert new_hooks == hooks
    assert {k: id(v) for k, v in model.named_parameters()} == param_ids
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), before_out)
