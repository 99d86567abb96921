"""The package's layout rules, checked on its source: every SQL statement lives under ``ledger/``, the
layout in docs/development.md names every folder, and no module is over 400 lines. Which part may
import which is import-linter's contract (``[tool.importlinter]``, run by ``.ci/run``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import reminders_pipeline

PACKAGE = Path(reminders_pipeline.__file__).parent

STATEMENT_BUILDERS = {"select", "insert", "update", "delete", "text", "func", "literal_column"}
SQL_TEXT = re.compile(r"\b(SELECT\b.+\bFROM|INSERT\s+INTO|UPDATE\b.+\bSET|DELETE\s+FROM)\b", re.S)


def _outside_ledger() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "ledger"]


def _sql_written_in(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            builders = {a.name for a in node.names} & STATEMENT_BUILDERS
            if builders:
                found.append(f"{name}:{node.lineno} imports {sorted(builders)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL_TEXT.search(node.value):
            found.append(f"{name}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_sql_is_written_only_under_ledger():
    offenders = [hit for p in _outside_ledger() for hit in _sql_written_in(p.read_text(), str(p.relative_to(PACKAGE)))]
    assert offenders == []


def test_the_rule_catches_a_statement_built_or_written_outside_ledger():
    source = 'from sqlalchemy import select, Connection\nQ = """SELECT id\n FROM notification_queue"""\n'
    assert _sql_written_in(source, "x.py") == [
        "x.py:1 imports ['select']",
        "x.py:2: 'SELECT id\\n FROM notification_queue'",
    ]


def _readme_layout() -> str:
    readme = (PACKAGE.parent / "docs" / "development.md").read_text()
    block = readme.split("## Layout", 1)[1]
    return block.split("```", 2)[1]


def test_the_layout_names_every_folder_of_the_package():
    named = set(re.findall(r"\b(\w+)/", _readme_layout()))
    folders = [p.name for p in sorted(PACKAGE.iterdir()) if (p / "__init__.py").exists()]
    assert [f for f in folders if f not in named] == [], "docs/development.md Layout does not name them"


def test_every_path_the_readme_layout_names_exists():
    root = PACKAGE.parent
    top = [line.split("  ")[0].split() for line in _readme_layout().splitlines() if line and not line.startswith(" ")]
    missing = [name for names in top for name in names if not (root / name).exists()]
    assert missing == []


MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines():
    """A module that needs more holds more than one job: split it (migrations excepted, each one step)."""
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if "migrations" not in p.relative_to(PACKAGE).parts
        and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
