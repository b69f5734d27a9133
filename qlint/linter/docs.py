"""Rule documentation generated from each rule's docstring and Options model."""

from __future__ import annotations

from qlint.linter.findings import RuleInfo
from qlint.linter.rule import DOC_SECTIONS, Rule


def options_table(rule: type[Rule]) -> str:
    fields = rule.Options.model_fields
    if not fields:
        return "This rule has no options."
    lines = ["| Option | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for name, field in fields.items():
        annotation = getattr(field.annotation, "__name__", str(field.annotation))
        lines.append(f"| `{name}` | {annotation} | `{field.default!r}` | {field.description or ''} |")
    return "\n".join(lines)


def rule_markdown(rule: type[Rule]) -> str:
    sections = rule.doc_sections()
    needs = ", ".join(sorted(n.value for n in rule.requires))
    parts = [
        f"# {rule.code} {rule.name}",
        "",
        f"{rule.summary}",
        "",
        f"Default severity: **{rule.severity.value}**. Needs: {needs}.",
        "",
    ]
    for title in DOC_SECTIONS:
        body = sections.get(title, "").strip()
        parts += [f"## {title}", ""]
        if title == "Options":
            parts += [body, "", options_table(rule)] if body else [options_table(rule)]
        else:
            parts.append(body)
        parts.append("")
    parts.append(f"Configure in pyproject.toml under `[tool.qlint.rules.{rule.code}]`.")
    return "\n".join(parts).rstrip() + "\n"


def rule_info(rule: type[Rule]) -> RuleInfo:
    """What a report records about a rule of its run."""
    return RuleInfo(
        code=rule.code,
        name=rule.name,
        summary=rule.summary,
        severity=rule.severity,
        requires=sorted(n.value for n in rule.requires),
        documentation=rule_markdown(rule),
    )
