"""The package's layout rules, checked on its source: every SQL statement lives under ``ledger/``, and a
module over 350 lines says in its docstring why its one job needs them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import reminders_pipeline

PACKAGE = Path(reminders_pipeline.__file__).parent

# Outside ledger/: the table definitions (DDL, CHECK constraints), the database owner's connection
# settings (PRAGMAs, BEGIN, LISTEN) and Alembic's migrations.
NOT_LEDGER_BUT_ALLOWED = {"schema.py", "db.py", "migrate.py"}
STATEMENT_BUILDERS = {"select", "insert", "update", "delete", "text", "func", "literal_column"}
SQL_TEXT = re.compile(r"\b(SELECT\b.+\bFROM|INSERT\s+INTO|UPDATE\b.+\bSET|DELETE\s+FROM)\b", re.S)


def _outside_ledger() -> list[Path]:
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in ("ledger", "migrations") and p.name not in NOT_LEDGER_BUT_ALLOWED
    ]


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


def test_the_readme_layout_names_every_module_of_the_package():
    layout = _readme_layout()
    named = set(re.findall(r"[\w/]+\.py|[\w]+/", layout))
    missing = [
        str(p.relative_to(PACKAGE))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "__init__.py"
        and "migrations" not in p.parts
        and p.name not in named
        and f"{p.parent.name}/{p.name}" not in named
    ]
    assert missing == [], f"docs/development.md Layout does not name: {missing}"


def test_every_path_the_readme_layout_names_exists():
    root = PACKAGE.parent
    top = [line.split("  ")[0].split() for line in _readme_layout().splitlines() if line and not line.startswith(" ")]
    missing = [name for names in top for name in names if not (root / name).exists()]
    assert missing == []


MAX_MODULE_LINES = 350
LONG_MODULE_MARKER = "Longer than 350 lines because"


def _unexplained_length(source: str, name: str) -> list[str]:
    """A module over ``MAX_MODULE_LINES`` whose docstring does not say why its one job needs them."""
    lines = len(source.splitlines())
    if lines <= MAX_MODULE_LINES or LONG_MODULE_MARKER in (ast.get_docstring(ast.parse(source)) or ""):
        return []
    return [f"{name}: {lines} lines, and no {LONG_MODULE_MARKER!r} in its docstring"]


def test_a_module_over_350_lines_says_in_its_docstring_why_its_one_job_needs_them():
    offenders = [
        hit
        for p in sorted(PACKAGE.rglob("*.py"))
        if "migrations" not in p.relative_to(PACKAGE).parts
        for hit in _unexplained_length(p.read_text(), str(p.relative_to(PACKAGE)))
    ]
    assert offenders == []


def test_the_length_rule_catches_a_long_module_and_accepts_one_that_says_why():
    body = "x = 1\n" * MAX_MODULE_LINES
    assert _unexplained_length('"""Short."""\n' + body, "x.py") == [
        f"x.py: {MAX_MODULE_LINES + 1} lines, and no {LONG_MODULE_MARKER!r} in its docstring"
    ]
    assert _unexplained_length(f'"""Long.\n\n{LONG_MODULE_MARKER} it must be."""\n' + body, "x.py") == []
    assert _unexplained_length('"""Short."""\n' + body[: -len("x = 1\n")], "x.py") == []
