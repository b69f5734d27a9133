"""Review of a serialized exported program (the JSON in a ``.pt2``) before torch reads it.

torch's deserializer resolves operator names with ``getattr`` chains on ``torch`` (which
imports torch submodules on first touch), parses shape expressions with ``sympy.sympify``
(an ``eval``), rebuilds pytree specs (which may ``import_module`` a name from the archive)
and ``exec``s the program's guard code when the module is built. This module walks the JSON
and names the first string that would take one of those paths somewhere other than plain torch
ops and arithmetic. It never imports or evaluates anything from the archive.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

# Operator namespaces whose ops are computations on tensors (resolved from torch's C++ registry).
OP_NAMESPACES = frozenset({"aten", "prims", "quantized", "quantized_decomposed"})
# Higher-order ops that only run the program's own subgraphs. Left out on purpose: those that
# call native code, TorchScript objects, arbitrary Python callables or print.
HIGHER_ORDER_OPS = frozenset(
    {
        "associative_scan",
        "auto_functionalized",
        "auto_functionalized_v2",
        "cond",
        "flex_attention",
        "flex_attention_backward",
        "hints_wrapper",
        "invoke_subgraph",
        "map_impl",
        "out_dtype",
        "scan",
        "tag_activation_checkpoint",
        "while_loop",
        "while_loop_stack_output",
        "with_effects",
        "wrap",
        "wrap_with_autocast",
        "wrap_with_set_grad_enabled",
        "_export_tracepoint",
    }
)
# Symbolic-shape arithmetic torch serializes as module.name (its _SYM_OPS, plus getitem).
BUILTIN_TARGETS = frozenset(
    [
        f"_operator.{name}"
        for name in (
            "getitem",
            "add",
            "and_",
            "eq",
            "floordiv",
            "ge",
            "gt",
            "le",
            "lshift",
            "lt",
            "mod",
            "mul",
            "ne",
            "neg",
            "not_",
            "or_",
            "pos",
            "pow",
            "rshift",
            "sub",
            "truediv",
            "abs",
        )
    ]
    + ["math.trunc", "math.ceil", "math.floor"]
    + [
        f"torch.{name}"
        for name in (
            "sym_float",
            "sym_int",
            "sym_ite",
            "sym_max",
            "sym_min",
            "sym_not",
            "sym_sqrt",
            "_sym_sqrt",
            "sym_sum",
        )
    ]
)
_OP_PATTERN = re.compile(r"torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\.([A-Za-z_]\w*))?")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_NUMBER_TEXT = re.compile(r"[-+]?[0-9]*\.?[0-9]*(?:[eE][-+]?[0-9]+)?")

# sympy (and torch.utils._sympy) constructors the shape expressions are printed with.
SYMPY_FUNCTIONS = frozenset(
    {
        "Symbol",
        "Integer",
        "Float",
        "Rational",
        "Add",
        "Mul",
        "Pow",
        "Max",
        "Min",
        "Abs",
        "Mod",
        "Eq",
        "Ne",
        "Lt",
        "Le",
        "Gt",
        "Ge",
        "StrictLessThan",
        "StrictGreaterThan",
        "LessThan",
        "GreaterThan",
        "Equality",
        "Unequality",
        "And",
        "Or",
        "Not",
        "Piecewise",
        "ExprCondPair",
        "floor",
        "ceiling",
        "sqrt",
        "FloorDiv",
        "ModularIndexing",
        "Where",
        "PythonMod",
        "CleanDiv",
        "CeilToInt",
        "FloorToInt",
        "CeilDiv",
        "LShift",
        "RShift",
        "PowByNatural",
        "FloatPow",
        "FloatTrueDiv",
        "IntTrueDiv",
        "TrueDiv",
        "IsNonOverlappingAndDenseIndicator",
        "TruncToFloat",
        "TruncToInt",
        "RoundToInt",
        "RoundDecimal",
        "ToFloat",
        "Identity",
        "cast_symbool_to_symint_guardless",
        # Python builtins the guard printer uses; pure on numbers
        "max",
        "min",
        "abs",
        "int",
        "float",
        "round",
        "bool",
    }
)
_SYMPY_FUNCTION_PREFIXES = ("OpaqueUnaryFn_", "BitwiseFn_")
_SYMPY_KEYWORDS = frozenset(
    {
        "integer",
        "positive",
        "negative",
        "nonnegative",
        "nonpositive",
        "real",
        "finite",
        "infinite",
        "zero",
        "rational",
        "commutative",
        "extended_real",
        "precision",
        "evaluate",
    }
)
_GUARD_ATTRIBUTES = {
    "math": frozenset({"floor", "ceil", "trunc", "isnan", "isinf", "sqrt", "inf", "nan"}),
    "torch": frozenset({"sym_float", "sym_int", "sym_ite", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_sum"}),
}
_TENSOR_QUERIES = frozenset({"size", "stride", "storage_offset"})
_OPERATOR_NODES = (ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.expr_context)
_ARITHMETIC_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp)
_NODE_TARGET = "\0node target"  # not a JSON key torch writes: marks a graph node's operator
MAX_EXPRESSION_CHARS = 100_000
MAX_EXPONENT = 64  # sympy evaluates integer powers eagerly: 10**10**12 would never finish
MAX_INTEGER = 2**64


def review_program(document: Any) -> str | None:
    """Why the serialized program would run code or import modules it names; None when it is plain."""
    if not isinstance(document, dict):
        return "is not a serialized exported program"
    for guard in document.get("guards_code") or ():
        problem = expression_problem(guard, guard=True)
        if problem:
            return f"has guard code {_quote(guard)} that {problem}"
    for key, value in _walk(document):
        problem = _value_problem(key, value)
        if problem:
            return problem
    return None


def _walk(document: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) for every dict entry, depth first, without recursion (JSON may nest deeply)."""
    pending: list[Any] = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                yield key, value
                if isinstance(value, (dict, list)):
                    pending.append(value)
            if {"target", "inputs", "outputs"} <= item.keys():
                yield _NODE_TARGET, item["target"]
        elif isinstance(item, list):
            pending.extend(v for v in item if isinstance(v, (dict, list)))


def _value_problem(key: str, value: Any) -> str | None:
    if key in (_NODE_TARGET, "as_operator"):
        return target_problem(value)
    if key == "expr_str":
        problem = expression_problem(value, guard=False)
        return f"has shape expression {_quote(value)} that {problem}" if problem else None
    if key in ("in_spec", "out_spec") and isinstance(value, str):
        return treespec_problem(value)
    if key == "metadata" and isinstance(value, dict):
        return metadata_problem(value)
    return None


def target_problem(target: Any) -> str | None:
    if not isinstance(target, str):
        return f"has an operator that is not a name ({type(target).__name__})"
    if target in BUILTIN_TARGETS:
        return None
    match = _OP_PATTERN.fullmatch(target)
    if match:
        namespace, op, overload = match.groups()
        if namespace in OP_NAMESPACES:
            return None
        if namespace == "higher_order" and overload is None and op in HIGHER_ORDER_OPS:
            return None
    return (
        f"calls operator {_quote(target)}, which is not a plain torch op "
        "(resolving it could import modules or run code)"
    )


def metadata_problem(metadata: dict) -> str | None:
    """Module types in ``nn_module_stack`` stay text in torch and are only looked up among loaded
    modules by qlint (:func:`resolve_loaded_name`); source functions are resolved by torch."""
    source_fns = metadata.get("source_fn_stack")
    if isinstance(source_fns, str):
        for entry in source_fns.split(";"):
            problem = _source_function_problem(entry.rpartition(",")[2])
            if problem:
                return problem
    return None


def _source_function_problem(name: str) -> str | None:
    """torch resolves these like operators (getattr from torch, operator or math); other names stay text."""
    if name.startswith("torch.ops."):
        return target_problem(name)
    if name.startswith("torch") and lookup_imports(name):
        return (
            f"records source function {_quote(name)}, whose lookup would import a torch module "
            "(qlint does not import what an archive names)"
        )
    if name.startswith(("#", "_operator", "math")) and name not in BUILTIN_TARGETS:
        return f"records source function {_quote(name)}, which is not a plain torch op"
    return None


def lookup_imports(name: str) -> bool:
    """Whether torch's ``hasattr``/``getattr`` walk for a ``torch...`` name would reach a module's
    ``__getattr__`` (torch imports submodules lazily that way). The walk starts where torch's
    deserializer starts it: ``torch.nn`` for names that begin so, else ``torch``."""
    if name.startswith("torch.nn"):
        obj: Any = torch.nn
        attributes = name.split(".")[2:]
    else:
        obj, attributes = torch, name.split(".")[1:]
    for attribute in attributes:
        try:
            obj = inspect.getattr_static(obj, attribute)
        except AttributeError:
            # hasattr on a plain module or on a class imports nothing: torch keeps the text
            return isinstance(obj, types.ModuleType) and "__getattr__" in vars(obj)
    return False


def resolve_loaded_name(qualified_name: str) -> Any:
    """The object ``qualified_name`` names among modules already imported; None otherwise. Never imports."""
    parts = qualified_name.split(".")
    for cut in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj: Any = module
        for attr in parts[cut:]:
            try:
                obj = inspect.getattr_static(obj, attr)
            except AttributeError:
                return None
        return obj
    return None


def treespec_problem(text: str) -> str | None:
    """torch rebuilds a defaultdict spec by importing its factory's module, and any context
    holding an ``__enum__`` by importing the enum's module: only builtins may be named."""
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError):
        return f"has a pytree spec that is not valid JSON: {_quote(text)}"
    pending: list[Any] = [spec]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        if "__enum__" in item:
            return f"has a pytree spec naming enum {_quote(str(item.get('fqn')))} (torch would import its module)"
        factory = item.get("default_factory_module")
        if factory is not None and factory not in ("builtins", "collections"):
            return f"has a pytree spec naming factory module {_quote(str(factory))} (torch would import it)"
        for value in item.values():
            if isinstance(value, str) and value[:1] in "[{":
                try:
                    pending.append(json.loads(value))
                except (ValueError, RecursionError):
                    continue  # a plain string that starts like JSON: torch does not parse it either
            elif isinstance(value, (dict, list)):
                pending.append(value)
    return None


def expression_problem(text: Any, *, guard: bool) -> str | None:
    """Why ``text`` is more than arithmetic on shapes; None when it is only that.

    Shape expressions go through sympy's ``eval``; guard code is ``exec``'d by torch. Both
    must parse as a single Python expression of numbers, names, arithmetic and calls of
    known math functions: no attributes (except ``L['x'].size()`` style tensor queries and
    ``math.floor`` in guards), no subscripts beyond ``L['name'][i]``, no strings beyond names.
    """
    if not isinstance(text, str):
        return "is not text"
    if len(text) > MAX_EXPRESSION_CHARS:
        return "is too long"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "is not a single expression"
    try:
        for node in ast.walk(tree):
            problem = _node_problem(node, guard)
            if problem:
                return problem
    except RecursionError:
        return "nests too deeply"
    return None


def _node_problem(node: ast.AST, guard: bool) -> str | None:
    if isinstance(node, _OPERATOR_NODES) or isinstance(node, _ARITHMETIC_NODES):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            return _exponent_problem(node.right)
        return None
    if isinstance(node, ast.Constant):
        return _constant_problem(node.value)
    if isinstance(node, ast.Name):
        if node.id.startswith("__"):
            return f"uses the name {node.id!r}"
        return None
    if isinstance(node, ast.keyword):
        if guard or node.arg not in _SYMPY_KEYWORDS:
            return f"passes keyword {node.arg!r}"
        return None
    if isinstance(node, ast.Call):
        return _call_problem(node, guard)
    if guard and isinstance(node, ast.Attribute):
        return _attribute_problem(node)
    if guard and isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant) and (
            isinstance(key.value, int) or (isinstance(key.value, str) and _IDENTIFIER.fullmatch(key.value))
        ):
            return None
        return "indexes with something other than a name or a number"
    return f"contains Python syntax {type(node).__name__}"


def _constant_problem(value: Any) -> str | None:
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return None
    if isinstance(value, int):
        return None if abs(value) <= MAX_INTEGER else "has an integer too large for a shape"
    if isinstance(value, str) and (_IDENTIFIER.fullmatch(value) or _NUMBER_TEXT.fullmatch(value)):
        return None
    return f"holds the literal {value!r}"


def _exponent_problem(exponent: ast.AST) -> str | None:
    if isinstance(exponent, ast.Call) and exponent.args:
        exponent = exponent.args[0]  # Integer(n)
    if isinstance(exponent, ast.UnaryOp):
        exponent = exponent.operand
    if isinstance(exponent, ast.Constant) and isinstance(exponent.value, (int, str)):
        try:
            if abs(int(exponent.value)) > MAX_EXPONENT:
                return "raises to a power too large to evaluate"
        except ValueError:
            return None
    return None


def _call_problem(node: ast.Call, guard: bool) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        if func.id in SYMPY_FUNCTIONS or func.id.startswith(_SYMPY_FUNCTION_PREFIXES):
            if func.id in ("Pow", "PowByNatural", "FloatPow") and len(node.args) == 2:
                return _exponent_problem(node.args[1])
            return None
        return f"calls {func.id!r}"
    if guard and isinstance(func, ast.Attribute):
        if func.attr in _TENSOR_QUERIES and not node.args and not node.keywords:
            return None
        if isinstance(func.value, ast.Name) and func.attr in _GUARD_ATTRIBUTES.get(func.value.id, ()):
            return None
    return f"calls {ast.unparse(func)[:80]!r}"


def _attribute_problem(node: ast.Attribute) -> str | None:
    if node.attr in _TENSOR_QUERIES:
        return None
    if isinstance(node.value, ast.Name) and node.attr in _GUARD_ATTRIBUTES.get(node.value.id, ()):
        return None
    return f"reads attribute {node.attr!r}"


def _quote(text: str, limit: int = 80) -> str:
    shown = text if len(text) <= limit else text[:limit] + "..."
    return repr(shown)
