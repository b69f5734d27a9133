"""The Python that --emit-qconfig and `qlint plan qconfig` write is data-safe.

Module names, the plan's model field and provenance text come from the model and from
plan files anyone can hand over. Each attack below puts code in one of them; the
generated file must parse to exactly the expected statements, hold every name as a
string literal, and, run in a fresh interpreter, build the mapping without running it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import torch
import torch.nn as nn

from tests.conftest import ROOT

ATTACK = "from os import system; system('touch PWNED')"
HOSTILE_NAMES = [
    f"x\n{ATTACK}",
    f"y\r{ATTACK}",
    f"z'''\"\"\"\\\n{ATTACK}\n#",
    "w\u2028\x00\x1b[31m",
]


def _hostile_plan() -> dict:
    provenance = [
        {"source": "user", "detail": f"reason\n{ATTACK}"},
        {"source": "finding", "rule": "QL104", "target": f"t\n{ATTACK}"},
    ]
    return {
        "type": "qlint.QuantPlan",
        "schema_version": 1,
        "backend": "x86",
        "model": f'm"""\n{ATTACK}\n"""',
        "modules": [
            {"fqn": name, "quantize": i % 2 == 0, "provenance": provenance} for i, name in enumerate(HOSTILE_NAMES)
        ],
        "equalization": [{"module": HOSTILE_NAMES[0], "previous": HOSTILE_NAMES[1], "provenance": provenance}],
        "rewrites": [{"kind": "fuse", "modules": HOSTILE_NAMES[:2], "provenance": provenance}],
        "notes": [f"note\n{ATTACK}"],
    }


EXPECTED_TOP_LEVEL = {"Expr", "Import", "ImportFrom", "FunctionDef", "Assign"}


def _check_structure(source: str) -> list[str]:
    """The statements a generated file may hold; returns the module names it configures."""
    tree = ast.parse(source)
    kinds = [type(node).__name__ for node in tree.body]
    assert set(kinds) <= EXPECTED_TOP_LEVEL, kinds
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)  # docstring
    assert kinds.count("Expr") == 1 and kinds.count("Assign") == 2, kinds  # qconfig_mapping, backend_config
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {alias.name for node in imports if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in imports if isinstance(node, ast.ImportFrom)}
    configs = {module for module in modules if module.startswith("torch.ao.quantization.backend_config.")}
    assert len(configs) == 1, modules
    assert modules - configs <= {
        "torch",
        "torch.ao.quantization",
        "torch.ao.quantization.observer",
        "torch.ao.quantization.quantize_fx",
        "qlint.advice.export",
    }
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert {f.name for f in functions} <= {
        "build_qconfig_mapping",
        "build_backend_config",
    }
    configured = []
    for function in functions:
        if function.name == "build_backend_config":  # one call of torch's getter for the backend
            (returned,) = [statement for statement in function.body if isinstance(statement, ast.Return)]
            call = returned.value
            assert isinstance(call, ast.Call) and not call.args and ast.unparse(call.func).startswith(tuple(configs))
            continue
        statements = list(function.body)
        for statement in statements:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # the function's docstring
            if isinstance(statement, ast.If):  # the decisions made for the rewritten model, only that
                assert ast.unparse(statement.test) == "rewritten" and not statement.orelse, ast.dump(statement)
                statements.extend(statement.body)
                continue
            assert isinstance(statement, (ast.Assign, ast.Expr, ast.Return, ast.ImportFrom)), ast.dump(statement)
            if isinstance(statement, ast.ImportFrom):
                assert statement.module == "torch.ao.quantization"
            if isinstance(statement, ast.Expr):
                call = statement.value
                assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute), ast.dump(statement)
                assert call.func.attr in ("set_global", "set_module_name"), call.func.attr
                if call.func.attr == "set_module_name":
                    assert isinstance(call.args[0], ast.Constant)
                    configured.append(call.args[0].value)
    return configured


def _run_generated(path, cwd) -> subprocess.CompletedProcess:
    # Every decision: a plan whose decisions come from findings that also rewrite sets them
    # for the rewritten model only (build_qconfig_mapping(rewritten=True)).
    code = (
        f"import inspect, runpy; ns = runpy.run_path({str(path)!r}); build = ns['build_qconfig_mapping']; "
        "every = build(rewritten=True) if 'rewritten' in inspect.signature(build).parameters else build(); "
        "print(sorted(every.module_name_qconfigs))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_plan_qconfig_from_a_hostile_plan(run_main, tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_hostile_plan()))
    result = run_main("plan", "qconfig", plan, "-o", tmp_path / "mapping.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    source = (tmp_path / "mapping.py").read_text(encoding="utf-8")
    assert sorted(_check_structure(source)) == sorted(HOSTILE_NAMES)
    # the equalization is qlint's rescale, which the mapping cannot carry: the docstring names its
    # module, as text, and the command that applies it
    docstring = " ".join((ast.get_docstring(ast.parse(source)) or "").split())  # as read, not as wrapped
    assert "qlint fix MODEL --plan PLAN --calibration DATA" in docstring and "input-weight equalization of" in docstring
    ran = _run_generated(tmp_path / "mapping.py", tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert not (tmp_path / "PWNED").exists()
    assert ran.stdout.strip() == repr(sorted(HOSTILE_NAMES))  # every name arrived intact, as data
    # `qlint plan show` prints the names literally: no line of it is the attack.
    shown = run_main("plan", "show", plan, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert ATTACK not in shown.stdout.splitlines() and "\x1b" not in shown.stdout
    assert "x\\nfrom os import system" in shown.stdout


HOSTILE_MODEL = '''
import torch.nn as nn

ATTACK = "from os import system; system('touch PWNED')"


class Hostile(nn.Module):
    """conv -> bn -> relu with a fan-out (QL101 finds it unfused); the names carry code."""

    def __init__(self):
        super().__init__()
        self.add_module("x\\n" + ATTACK, nn.Conv2d(3, 8, 3))
        self.add_module("b\\r" + ATTACK, nn.BatchNorm2d(8))
        self.add_module("r\\'\\'\\'", nn.ReLU())

    def forward(self, x):
        conv, bn, relu = self.children()
        y = conv(x)
        return relu(bn(y)) + y


def build():
    return Hostile().eval()
'''


def test_emit_qconfig_with_hostile_module_names(run_main, tmp_path):
    (tmp_path / "hostile_model.py").write_text(HOSTILE_MODEL)
    out = tmp_path / "qconfig.py"
    result = run_main(
        "hostile_model:build",
        "--input-shape",
        "1,3,8,8",
        "--no-trial",  # the rule's verdict decides the exit here, not the unseeded model's measured impact
        "--select",
        "QL101",
        "--emit-qconfig",
        out,
        "--emit-plan",
        tmp_path / "plan.json",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr  # QL101 found the unfused pattern
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert set(plan["rewrites"][0]["modules"]) >= {f"x\n{ATTACK}", f"b\r{ATTACK}"}
    source = out.read_text(encoding="utf-8")
    _check_structure(source)
    assert not any(line.strip().startswith(ATTACK) for line in source.splitlines())
    ran = _run_generated(out, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert not (tmp_path / "PWNED").exists()


def test_emit_qconfig_with_a_hostile_model_file_name(run_main, tmp_path):
    """The plan's model field is the model's path: a file name can hold quotes and newlines. (A
    pickled module: a .pt2's plan is for the pt2e flow, which has no QConfigMapping file.)"""
    name = f'm"""\n{ATTACK}\n""".pt'
    torch.save(nn.Sequential(nn.Linear(4, 4)).eval(), tmp_path / name)
    out = tmp_path / "qconfig.py"
    result = run_main(
        name, "--trust-pickle", "--input-shape", "1,4", "--select", "QL102", "--emit-qconfig", out, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    source = out.read_text(encoding="utf-8")
    _check_structure(source)
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring is not None and ATTACK in docstring  # the name is in the docstring, as text
    ran = _run_generated(out, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert not (tmp_path / "PWNED").exists()


def test_the_generated_file_builds_the_backend_config_qlint_measured_with(tmp_path):
    """prepare_fx without backend_config uses torch's native config, which fuses and quantizes
    other patterns than the backend's own config that qlint's trials use: the file gives both."""
    from qlint.advice.plan import default_plan

    for backend in ("x86", "qnnpack"):
        path = tmp_path / f"{backend}.py"
        path.write_text(default_plan(backend).to_python(), encoding="utf-8")
        code = f"import runpy; m = runpy.run_path({str(path)!r}); print(m['backend_config'].name)"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split()[-1] == backend


def test_a_report_gives_the_backend_config_its_trials_used():
    import qlint

    report = qlint.lint(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        (torch.randn(2, 4),),
        backend="qnnpack",
        trial_options={"enabled": False},
    )
    assert report.backend_config().name == "qnnpack"
