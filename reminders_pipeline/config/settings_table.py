"""The configuration table of docs/operations.md, generated from the settings' declarations
(``python -m reminders_pipeline.config.settings_table`` prints it); a test keeps the two the same."""

from __future__ import annotations

from pydantic import BeforeValidator
from pydantic.fields import FieldInfo

from reminders_pipeline.config.renamed import RENAMED
from reminders_pipeline.config.setting_types import SECONDS
from reminders_pipeline.config.settings import Settings, env_name


def markdown_table() -> str:
    """The configuration table of docs/operations.md: a test keeps the two the same."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    old_names = {new: old for old, new in RENAMED.items()}
    for field, info in Settings.model_fields.items():
        name = env_name(field)
        renamed = (
            f" (named `{old_names[name]}` before: still read, with a deprecation line)" if name in old_names else ""
        )
        lines.append(f"| `{name}` | {_default_text(info)} | {info.description}{renamed} |")
    return "\n".join(lines) + "\n"


def _default_text(info: FieldInfo) -> str:
    default = info.get_default(call_default_factory=True)
    minimum = next((rule.ge for rule in info.metadata if getattr(rule, "ge", None) is not None), None)
    parse = next((rule.func for rule in info.metadata if isinstance(rule, BeforeValidator)), None)
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, str):
        choices = getattr(info.annotation, "__args__", ())
        return f"`{default}`" + (f" (or {', '.join(f'`{c}`' for c in choices if c != default)})" if choices else "")
    if default == ():
        return "empty"
    fractions = parse is SECONDS
    text = f"{default:g}" if isinstance(default, float) else str(default)
    if minimum is not None:
        text += f" (min {minimum:g}, fractions allowed)" if fractions else f" (min {minimum:g})"
    return text


if __name__ == "__main__":
    print(markdown_table(), end="")
