"""Dependencies point down: the SQL layer (``ledger/``) imports nothing of the package but the
tables, the database and the time format, so what a rule or a payload means is decided above it."""

from __future__ import annotations

import ast
from pathlib import Path

import reminders_pipeline

PACKAGE = Path(reminders_pipeline.__file__).parent
LEDGER_MAY_IMPORT = ("reminders_pipeline.schema", "reminders_pipeline.db", "reminders_pipeline.times")


def _imported(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``reminders_pipeline`` module in ``source``, whose own
    package is ``package``; relative imports resolved, ``from .. import x`` read as module ``x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == "reminders_pipeline":
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return [(line, m) for line, m in found if m == "reminders_pipeline" or m.startswith("reminders_pipeline.")]


def _allowed_in_ledger(module: str) -> bool:
    return (
        module == "reminders_pipeline.ledger"
        or module.startswith("reminders_pipeline.ledger.")
        or any(module == m or module.startswith(m + ".") for m in LEDGER_MAY_IMPORT)
    )


def _offenders(source: str, name: str, package: str = "reminders_pipeline.ledger") -> list[str]:
    return [f"{name}:{line} imports {m}" for line, m in _imported(source, package) if not _allowed_in_ledger(m)]


def test_the_ledger_imports_only_schema_db_times_and_itself():
    modules = sorted((PACKAGE / "ledger").rglob("*.py"))
    assert modules
    offenders = [
        hit
        for p in modules
        for hit in _offenders(
            p.read_text(),
            str(p.relative_to(PACKAGE)),
            ".".join(("reminders_pipeline", *p.parent.relative_to(PACKAGE).parts)),
        )
    ]
    assert offenders == []


def test_the_rule_catches_every_spelling_of_an_import_from_above():
    source = (
        "from ..notification import sent_payload\n"
        "from .. import rules, times\n"
        "import reminders_pipeline.policy\n"
        "from reminders_pipeline.zones import zone\n"
        "from ..schema import notification_queue\n"
        "from ._common import batches\n"
        "from . import queue\n"
        "from reminders_pipeline.ledger.claims import claim\n"
        "def f():\n"
        "    from ..build import build\n"
    )
    assert _offenders(source, "x.py") == [
        "x.py:1 imports reminders_pipeline.notification",
        "x.py:2 imports reminders_pipeline.rules",
        "x.py:3 imports reminders_pipeline.policy",
        "x.py:4 imports reminders_pipeline.zones",
        "x.py:10 imports reminders_pipeline.build",
    ]


PROVIDER_MODULES = ("reminders_pipeline.apns", "reminders_pipeline.webpush", "reminders_pipeline.fcm")


def test_what_composes_and_settles_an_alert_imports_no_provider():
    """Each provider states its own payload limit; the shared core reads it through
    ``sender.payload_limit``, so composing and settling depend on no provider's module."""
    for name in ("notification.py", "settlement.py", "phrases.py", "policy.py"):
        imported = [m for _, m in _imported((PACKAGE / name).read_text(), "reminders_pipeline")]
        assert not [m for m in imported if m in PROVIDER_MODULES], name
