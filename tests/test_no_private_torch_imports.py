"""Product code must not import private torch modules (any path segment starting with '_')."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _private_torch_imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [
                f"{node.module}.{alias.name}"
                for alias in node.names
                if alias.name[:1] == "_" and alias.name[:2] != "__"
            ]
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and any(p.startswith("_") for p in parts[1:]):
                yield node.lineno, name
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("torch."):
                    if any(p.startswith("_") for p in arg.value.split(".")[1:]):
                        yield node.lineno, arg.value


def test_scanner_detects_private_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from torch.ao.quantization.fx._model_report import detector\nimport torch._dynamo\n")
    assert [name for _, name in _private_torch_imports(sample)] == [
        "torch.ao.quantization.fx._model_report",
        "torch._dynamo",
    ]


def test_product_code_has_no_private_torch_imports():
    offenders = []
    for folder in ("qlint", "rules"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            offenders += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in _private_torch_imports(path)]
    assert offenders == []
