"""report.qconfig_mapping() starts from the mapping the model was linted with.

QA: linting digit_cnn with a per-tensor global mapping and one Linear kept float, the report's
mapping started again from the x86 default: the Linear the user kept float was quantized, and
the weights went per-channel, though every fix was measured on top of the user's mapping."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import QConfig, QConfigMapping, get_default_qconfig_mapping
from torch.ao.quantization.observer import HistogramObserver, MinMaxObserver
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

import qlint
from qlint.linter.findings import Report


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    with torch.no_grad():  # output channels far apart: per-tensor weights lose bits (QL104)
        model[2].weight.mul_(torch.logspace(-3, 0, 32)[:, None])
    return model


def _users_mapping() -> QConfigMapping:
    per_tensor = QConfig(
        activation=HistogramObserver.with_args(reduce_range=True),
        weight=MinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
    )
    return QConfigMapping().set_global(per_tensor).set_module_name("4", None)


def test_the_fixes_apply_on_top_of_the_users_mapping():
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(64, 16, generator=generator) for _ in range(8)]
    model = _model()
    options = {"enabled": False}  # no trial to judge the fix's gain: this test is about the mapping
    users = _users_mapping()
    report = qlint.lint(
        model, (data[0],), calibration=data, qconfig_mapping=users, select=["QL104"], trial_options=options
    )
    [finding] = report.by_rule("QL104")
    users.set_module_name("2", None)  # changed after the lint: the report keeps what it linted with
    with pytest.raises(TypeError):
        hash(report)  # a report holds lists
    assert finding.suggestion is not None
    mapping = report.qconfig_mapping()
    assert mapping.module_name_qconfigs["4"] is None  # the user's float layer stays float
    assert mapping.global_qconfig.weight.p.keywords["qscheme"] == torch.per_tensor_symmetric
    fixed = mapping.module_name_qconfigs["2"].weight.p.func.__name__
    assert fixed == "PerChannelMinMaxObserver"  # QL104's fix, on top
    prepared = prepare_fx(copy.deepcopy(model), mapping, (data[0],))
    with torch.no_grad():
        for batch in data[:4]:
            prepared(batch)
    converted = convert_fx(prepared)
    assert type(converted.get_submodule("4")) is nn.Linear  # still float
    assert converted.get_submodule("2").weight().qscheme() == torch.per_channel_affine
    # read back from JSON there is no mapping to start from: the backend default
    again = Report.model_validate_json(report.model_dump_json())
    default = get_default_qconfig_mapping("x86")
    assert "4" not in again.qconfig_mapping().module_name_qconfigs
    assert again.qconfig_mapping().global_qconfig.weight.p.func is default.global_qconfig.weight.p.func


def test_the_cli_says_the_emitted_plan_does_not_start_from_the_users_mapping(run_main, tmp_path):
    (tmp_path / "net.py").write_text(
        "import torch, torch.nn as nn\n"
        "from torch.ao.quantization import get_default_qconfig_mapping\n\n"
        "def build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()\n\n"
        "def mapping():\n    return get_default_qconfig_mapping('x86').set_module_name('2', None)\n"
    )
    result = run_main(
        "net:build", "--input-shape", "2,4", "--qconfig-mapping", "net:mapping", "--trust-config",
        "--no-trial", "--emit-plan", "plan.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    assert "the plan starts from the x86 default, not from --qconfig-mapping net:mapping" in result.stderr
    assert (tmp_path / "plan.json").is_file()
