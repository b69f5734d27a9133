"""qlint's layers, read from the source: every import of every module, lazy ones included.

errors < core < stats < measure < linter < render < numeric < advice < cli. A module imports
only from its own layer or lower ones, the modules import each other without cycles,
and the built-in rules (``rules/``, installed as ``qlint.rules``) import only errors,
core, stats, measure, linter and each other. ``import qlint`` loads the lint layers only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx

import qlint
import qlint.rules

PACKAGE = Path(qlint.__file__).resolve().parent
RULES = Path(qlint.rules.__file__).resolve().parent
LAYERS = ("errors", "core", "stats", "measure", "linter", "render", "numeric", "advice", "cli")
BASE_MODULES = ("qlint.errors", "qlint.version")  # the bottom layer: no qlint imports at all
FACADE = ("qlint", "qlint.__main__")  # the public entry points: they may import any layer
RULE_LAYERS = ("errors", "core", "stats", "measure", "linter")
# The registry imports every built-in rule module by name (importlib) when it loads rules.
REGISTRY = "qlint.linter.registry"


def _module_files() -> dict[str, Path]:
    files = {}
    for root, prefix in ((PACKAGE, "qlint"), (RULES, "qlint.rules")):
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    return files


MODULES = _module_files()


def _bound_names(package: str) -> set[str]:
    """The names a package's ``__init__`` binds outside functions and classes."""
    names: set[str] = set()
    statements = list(ast.parse(MODULES[package].read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
        else:  # if / try / with blocks bind names too
            for field in ("body", "orelse", "finalbody", "handlers"):
                statements.extend(getattr(node, field, []))
    return names


def _target(base: str, name: str) -> str:
    """What ``from base import name`` imports: a submodule, or the package that binds ``name``.

    A name that is neither bound by the package nor one of its modules imports nothing of qlint's."""
    if f"{base}.{name}" in MODULES or base not in MODULES:
        return f"{base}.{name}"
    if MODULES[base].name != "__init__.py" or name in _bound_names(base):
        return base
    return ""


def _imports(module: str, path: Path) -> set[str]:
    """Every qlint module that ``module`` imports anywhere in its source (functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [_target(base, alias.name) for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("qlint"):
                found.add(name)
    found.discard(module)
    return found


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    for module, path in MODULES.items():
        graph.add_node(module)
        for target in _imports(module, path):
            graph.add_edge(module, target)
    for module in MODULES:
        if module.startswith("qlint.rules."):
            graph.add_edge(REGISTRY, module)
    return graph


GRAPH = _graph()


def _layer(module: str) -> str:
    if module in FACADE:
        return "facade"
    if module in BASE_MODULES:
        return "errors"
    if module.startswith("qlint.rules"):
        return "rules"
    return module.split(".")[1]


def _allowed(source: str, target: str) -> bool:
    if source in FACADE:
        return target not in FACADE
    if target in FACADE:
        return False
    if source in BASE_MODULES:
        return False
    layer, target_layer = _layer(source), _layer(target)
    if layer == "rules":
        return target_layer in RULE_LAYERS + ("rules",)
    if target_layer == "rules":
        return source == REGISTRY or LAYERS.index(layer) > LAYERS.index("linter")
    return LAYERS.index(target_layer) <= LAYERS.index(layer)


def test_every_module_is_in_a_layer():
    for module in MODULES:
        if module in FACADE + BASE_MODULES:
            continue
        assert _layer(module) in LAYERS + ("rules",), f"{module} is outside the layers {LAYERS}"


def test_imports_point_down_the_layers():
    wrong = sorted(
        f"{source} ({_layer(source)}) imports {target} ({_layer(target)})"
        for source, target in GRAPH.edges
        if not _allowed(source, target)
    )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    tangled = [sorted(group) for group in nx.strongly_connected_components(GRAPH) if len(group) > 1]
    cycles = [[source for source, _ in nx.find_cycle(GRAPH.subgraph(group))] for group in tangled]
    shown = [" -> ".join(cycle + cycle[:1]) for cycle in cycles]
    assert not tangled, "modules importing each other:\n" + "\n".join(shown)


def test_the_checks_see_imports_inside_functions():
    # A lazy import is still an import: the graph must hold the one the CLI makes to run lint.
    assert ("qlint.cli.main", "qlint.cli.lint") in GRAPH.edges
    assert ("qlint.linter.engine", "qlint.linter.calibration") in GRAPH.edges
    assert not _allowed("qlint.core.load", "qlint.linter.calibration")
    assert not _allowed("qlint.rules.ql101_unfused_pattern", "qlint.advice.plan")
    assert _allowed("qlint.rules.ql101_unfused_pattern", "qlint.linter.findings")


def test_import_qlint_is_light():
    heavy = ("qlint.advice", "qlint.numeric", "qlint.cli")
    code = (
        "import sys, qlint\n"
        f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))\n"
        "qlint.verify\n"
        "print('qlint.advice.verify' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, verify_loaded = result.stdout.splitlines()
    assert loaded == "[]", f"import qlint loaded {loaded}"
    assert verify_loaded == "True"  # and the higher layers still load when used
