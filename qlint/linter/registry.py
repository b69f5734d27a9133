"""One registry for built-in rules (package qlint.rules) and third-party rules.

Third-party packages register rule classes (or modules holding them) under the
entry-point group ``qlint.rules``; they load in sorted order of entry-point name,
after the built-ins, and an import failure names the package that failed.

Only installed distributions count: importlib.metadata finds ``*.dist-info`` folders on
every ``sys.path`` entry, the working directory included, so a cloned repository could
otherwise ship a fake ``evil.dist-info`` whose plugin runs when qlint starts. An entry
point is used only when its distribution lives in a site-packages folder or in a folder
the user put on ``PYTHONPATH``, and never in the working directory.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import site
import sysconfig
from collections.abc import Iterable
from importlib.metadata import Distribution, EntryPoint, entry_points
from pathlib import Path

from qlint.errors import ConfigError, RuleLoadError
from qlint.linter.rule import Rule, validate_rule_class

ENTRY_POINT_GROUP = "qlint.rules"


def _rules_in_module(module: object) -> list[type[Rule]]:
    found = []
    for _, value in inspect.getmembers(module, inspect.isclass):
        if issubclass(value, Rule) and value is not Rule and value.__module__ == getattr(module, "__name__", None):
            found.append(value)
    return found


def builtin_rule_classes() -> list[type[Rule]]:
    import qlint.rules as package

    classes: list[type[Rule]] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package.__name__}.{info.name}")
        except Exception as error:  # a broken rule file must not look like a crash elsewhere
            raise RuleLoadError(
                f"built-in rule module {info.name} failed to import: {type(error).__name__}: {error}"
            ) from error
        classes.extend(_rules_in_module(module))
    return classes


def _installation_folders() -> set[str]:
    """Folders that hold installed distributions: site-packages (system, venv, user) and
    the folders the user named in PYTHONPATH; never the working directory."""
    folders = {sysconfig.get_path(key) for key in ("purelib", "platlib")}
    folders.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    folders.add(site.getusersitepackages())
    folders.update(entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry)
    resolved = {os.path.realpath(folder) for folder in folders if folder}
    resolved.discard(os.path.realpath(os.getcwd()))
    return resolved


def _installed(dist: Distribution | None, folders: set[str]) -> bool:
    if dist is None:
        return False
    location = Path(str(dist.locate_file(""))).resolve()
    return str(location) in folders


def installed_entry_points() -> list[EntryPoint]:
    """The ``qlint.rules`` entry points of installed distributions, sorted by name."""
    folders = _installation_folders()
    chosen: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if _installed(ep.dist, folders):
            chosen.setdefault(ep.name, ep)  # the first on sys.path wins, as for imports
    return [chosen[name] for name in sorted(chosen)]


def plugin_rule_classes() -> list[type[Rule]]:
    classes: list[type[Rule]] = []
    for ep in installed_entry_points():
        package = ep.dist.name if ep.dist is not None else ep.value.split(":")[0]
        try:
            loaded = ep.load()
        except Exception as error:  # a broken plugin must not look like a qlint crash
            raise RuleLoadError(
                f"rule plugin {ep.name!r} from package {package!r} failed to import: {type(error).__name__}: {error}"
            ) from error
        candidates = [loaded] if inspect.isclass(loaded) else _rules_in_module(loaded)
        for cls in candidates:
            problems = validate_rule_class(cls)
            if problems or not issubclass(cls, Rule):
                raise RuleLoadError(f"rule plugin {ep.name!r} from package {package!r}: {'; '.join(problems)}")
            classes.append(cls)
    return classes


# qlint compare's diagnostics (qlint.numeric.diagnose): rule codes users may try to select in lint.
COMPARE_DIAGNOSTICS = {"QL301": "low-sqnr-layer", "QL302": "error-onset"}


class Registry:
    def __init__(self, classes: Iterable[type[Rule]]) -> None:
        self._by_code: dict[str, type[Rule]] = {}
        for cls in classes:
            problems = validate_rule_class(cls)
            if problems:
                raise RuleLoadError(f"rule {cls.__module__}.{cls.__name__}: {'; '.join(problems)}")
            if cls.code in self._by_code:
                other = self._by_code[cls.code]
                raise RuleLoadError(f"rule code {cls.code} is defined twice: {other.__module__} and {cls.__module__}")
            self._by_code[cls.code] = cls

    @classmethod
    def default(cls, include_plugins: bool = True) -> Registry:
        classes = builtin_rule_classes()
        if include_plugins:
            classes += plugin_rule_classes()
        return cls(classes)

    def all(self) -> list[type[Rule]]:
        return [self._by_code[c] for c in sorted(self._by_code)]

    def get(self, code_or_name: str) -> type[Rule]:
        wanted = code_or_name.strip()
        for cls in self._by_code.values():
            if cls.code.upper() == wanted.upper() or cls.name == wanted.lower():
                return cls
        raise ConfigError(f"unknown rule {code_or_name!r}; run 'qlint rules' to list them")

    def select(self, select: Iterable[str] | None = None, ignore: Iterable[str] | None = None) -> list[type[Rule]]:
        """Selectors are codes (QL101), prefixes (QL1, QL), names, or ALL."""
        chosen = self.all() if not select else self._match_all(select)
        dropped = {c.code for c in self._match_all(ignore or ())}
        return [c for c in chosen if c.code not in dropped]

    def _match_all(self, selectors: Iterable[str]) -> list[type[Rule]]:
        matched: dict[str, type[Rule]] = {}
        if isinstance(selectors, str):  # select="QL101" or "QL1,QL203": not one selector per character
            selectors = selectors.split(",")
        for raw in selectors:
            selector = raw.strip()
            if not selector:
                continue
            hits = [
                c
                for c in self.all()
                if selector.upper() == "ALL"
                or c.name == selector.lower()
                or c.code.upper().startswith(selector.upper())
            ]
            if not hits and selector.upper() in COMPARE_DIAGNOSTICS:
                raise ConfigError(
                    f"{selector.upper()} is a diagnostic of 'qlint compare' (it needs a quantized model to "
                    "compare with), not a lint rule: run 'qlint compare FLOAT QUANT --calibration DATA'"
                )
            if not hits:
                raise ConfigError(f"unknown rule selector {raw!r}; run 'qlint rules' to list them")
            for c in hits:
                matched[c.code] = c
        return [matched[c] for c in sorted(matched)]
