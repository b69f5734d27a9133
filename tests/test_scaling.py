"""qlint's own work grows linearly with the model: counted line by line, never timed.

Every line qlint (qlint/ and the built-in rules) executes is counted per function, for a
model of n blocks and one of 4n blocks. Linear work makes a function's count grow about 4x;
anything that compares all pairs of layers grows about 16x. Wall-clock time is not asserted
(bench/scaling.py prints the ratios); these counts are exact and the same on every machine.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import CodeType

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization import QConfigMapping, default_qconfig

import qlint
import qlint.rules
from qlint.render.json import render_json
from qlint.render.sarif import render_sarif
from qlint.render.text import render_text

OURS = tuple(str(Path(module.__file__).parent) for module in (qlint, qlint.rules))
SMALL, GROWTH = 6, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.spare = nn.Linear(width, width)  # never called: one QL102 finding per block

    def forward(self, x):
        return self.act(self.fc(x))


class Stack(nn.Module):
    """Nested blocks (module paths two deep), an unused module in each, one ReLU shared by all."""

    def __init__(self, blocks: int, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(blocks)))
        self.shared = nn.ReLU()

    def forward(self, x):
        for block in self.blocks:
            x = self.shared(block(x))
        return torch.sigmoid(x)


def _lines_per_function(run: Callable[[], object]) -> Counter[CodeType]:
    """Calls plus executed lines of every qlint function while ``run`` runs."""
    counts: Counter[CodeType] = Counter()

    def on_line(frame, event, _arg):
        if event == "line":
            counts[frame.f_code] += 1
        return on_line

    def on_call(frame, _event, _arg):
        if frame.f_code.co_filename.startswith(OURS):
            counts[frame.f_code] += 1
            return on_line
        return None  # torch's own code is not counted (and not slowed down by line events)

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        run()
    finally:
        sys.settrace(previous)
    return counts


def _superlinear(small: Counter[CodeType], large: Counter[CodeType]) -> list[str]:
    """Functions whose count grew well past GROWTH times: quadratic work shows as ~GROWTH²."""
    grown = []
    for code, count in large.items():
        before = small.get(code, 0)
        if count > 1.5 * GROWTH * before + 200:
            grown.append(f"{Path(code.co_filename).name}:{code.co_firstlineno} {code.co_name}: {before} -> {count}")
    return grown


def _lint_and_render(blocks: int, **lint_options) -> Callable[[], object]:
    model = Stack(blocks).eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def run():
        report = qlint.lint(model, (x,), **lint_options)
        render_text(report), render_json(report), render_sarif(report)
        return report

    return run


def _small_and_large(**lint_options) -> tuple[Counter[CodeType], Counter[CodeType]]:
    _lint_and_render(1, **lint_options)()  # first use imports modules and fills caches: not counted
    return (
        _lines_per_function(_lint_and_render(SMALL, **lint_options)),
        _lines_per_function(_lint_and_render(SMALL * GROWTH, **lint_options)),
    )


def test_the_model_exercises_the_rules():
    """The counted runs must walk every path they guard: findings per block and a shared module."""
    report = _lint_and_render(SMALL, ignore=["QL105"], trial_options={"enabled": False})()
    unused = [f for f in report.by_rule("QL102") if f.data["kind"] == "never-called"]
    shared = [f for f in report.by_rule("QL102") if f.data["kind"] == "multiple-calls"]
    assert sorted(f.target for f in unused) == [f"blocks.{i}.spare" for i in range(SMALL)]
    assert [(f.target, f.data["calls"]) for f in shared] == [("shared", SMALL)]
    assert len(shared[0].data["call_sites"]) == SMALL
    assert len(report.qconfig_table) >= 3 * SMALL


def test_static_lint_and_rendering_do_linear_work():
    small, large = _small_and_large(ignore=["QL105"], trial_options={"enabled": False})
    assert sum(large.values()) > 2 * sum(small.values())  # the counter sees the work grow at all
    assert _superlinear(small, large) == []


def test_trial_quantization_does_linear_work_in_qlint():
    """QL105's own code around torch's prepare_fx/convert_fx (whose cost is torch's). MinMax
    observers: the default HistogramObserver's qparam search costs seconds per observer here."""
    mapping = QConfigMapping().set_global(default_qconfig)
    small, large = _small_and_large(select=["QL105"], qconfig_mapping=mapping)
    finding = _lint_and_render(SMALL, select=["QL105"], qconfig_mapping=mapping)().by_rule("QL105")
    assert [f.data["kind"] for f in finding] == ["conversion-ok"]  # the whole trial ran
    assert _superlinear(small, large) == []


def test_the_guard_catches_an_all_pairs_scan():
    """The same measure flags a function that compares every module with every other."""

    def all_pairs(blocks: int) -> Callable[[], object]:
        names = [name for name, _ in Stack(blocks).named_modules()]

        def run():
            return sum(1 for a in names for b in names if b.startswith(a + "."))

        return run

    small = _lines_per_function(all_pairs(SMALL))
    large = _lines_per_function(all_pairs(SMALL * GROWTH))
    assert _superlinear(small, large) == []  # it is not in qlint's files, so it is not counted
    # counted when it is: run it from a code object whose file name is qlint's
    source = compile(
        "def scan(names):\n    return sum(1 for a in names for b in names if b.startswith(a + '.'))\n",
        str(Path(OURS[0]) / "scan.py"),
        "exec",
    )
    namespace: dict = {}
    exec(source, namespace)
    names_small = [n for n, _ in Stack(SMALL).named_modules()]
    names_large = [n for n, _ in Stack(SMALL * GROWTH).named_modules()]
    small = _lines_per_function(lambda: namespace["scan"](names_small))
    large = _lines_per_function(lambda: namespace["scan"](names_large))
    assert _superlinear(small, large)


def test_ql102_names_at_most_ten_call_sites_in_its_message():
    report = qlint.lint(Stack(24).eval(), (torch.randn(4, 8),), select=["QL102"])
    (shared,) = [f for f in report.by_rule("QL102") if f.data["kind"] == "multiple-calls"]
    assert shared.data["calls"] == 24 and len(shared.data["call_sites"]) == 24
    named = [site for site in shared.data["call_sites"] if f"{site} (in " in shared.message]
    assert named == shared.data["call_sites"][:10] and "and 14 more" in shared.message


@pytest.mark.parametrize("blocks", [SMALL, SMALL * GROWTH])
def test_ql102_used_modules_index_matches_a_full_scan(blocks):
    """The prefix index answers 'is this module used?' exactly as comparing every reference would."""
    from qlint.linter.engine import analyse
    from qlint.rules.ql102_shared_module import _UsedModules

    model = Stack(blocks).eval()
    graph = analyse(model, (torch.randn(4, 8),), "x86").graph
    used = _UsedModules(graph)
    references = {ref for node in graph.ops() for ref in (node.module, node.scope, node.weight, node.bias) if ref}
    for fqn in graph.modules:
        direct = any(ref == fqn or ref.startswith(fqn + ".") for ref in references)
        inside_leaf = any(parent == node.module for node in graph.ops() for parent in _ancestors(fqn))
        assert used.covers(fqn) == (direct or inside_leaf), fqn


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_every_rule_run_is_timed_and_a_slow_one_says_how_to_skip_it(monkeypatch):
    """With the threshold at zero every rule counts as slow: each gets its notice, none is left out."""
    import qlint.linter.engine as engine

    monkeypatch.setattr(engine, "SLOW_RULE_SECONDS", 0.0)
    mapping = QConfigMapping().set_global(default_qconfig)
    report = qlint.lint(
        Stack(2).eval(), (torch.randn(4, 8),), select=["QL102", "QL105", "QL201"], qconfig_mapping=mapping
    )
    assert [t.stage for t in report.timings if t.stage.startswith("rule ")] == ["rule QL102", "rule QL105"]
    assert [s.rule for s in report.skipped] == ["QL201"]  # skipped rules do not run, so are not timed
    slow = [n.message for n in report.notices if " took " in n.message]
    assert len(slow) == 2
    assert slow[1].startswith("QL105 (conversion-check) took ") and "--ignore QL105" in slow[1]
