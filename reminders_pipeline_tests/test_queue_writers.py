"""Every queue row is made, moved, voided or settled by the plan's statements or the claim and
settle statements, never beside them: this reads the package's source and finds every statement
that writes ``notification_queue``, and each must be one of those the table below names.

A snooze is a row of its item as the plan reads it (``ledger.queue.insert_snooze``), a Done a
settlement (``ledger.claims.acknowledge``), and pruning removes only settled rows. A new writer
fails here until it is one of these, or this table says why it joins them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import reminders_pipeline

PACKAGE = Path(reminders_pipeline.__file__).parent
SQL_WRITE = re.compile(r"\b(UPDATE|INSERT\s+INTO|DELETE\s+FROM)\s+notification_queue\b", re.IGNORECASE)
TABLE = "notification_queue"

# (module, function or module-level statement) -> whose path it is.
WRITERS = {
    # The plan: rows made, brought in line, re-armed, voided, and a person's snooze.
    ("ledger/queue.py", "_UPSERT"): "plan",
    ("ledger/queue.py", "_REARM"): "plan",
    ("ledger/queue.py", "_REALIGN"): "plan",
    ("ledger/queue.py", "insert_snooze"): "plan",
    ("ledger/queue.py", "end_holds"): "plan",
    ("ledger/voids.py", "void_rows"): "plan",
    ("ledger/voids.py", "void_pending_of_device"): "plan",
    ("ledger/voids.py", "void_pending_of_urls"): "plan",
    # The claim and its settlements.
    ("ledger/claims.py", "fail_abandoned"): "settle",
    ("ledger/claims.py", "_claim_statement"): "claim",
    ("ledger/claims.py", "_SETTLE"): "settle",
    ("ledger/claims.py", "_RETURN_TO_PENDING"): "settle",
    ("ledger/claims.py", "refund_attempts"): "settle",
    ("ledger/claims.py", "acknowledge"): "settle",
    # Retention: settled rows only, past their keep.
    ("ledger/retention.py", "prune_settled"): "prune",
}


def writers_in(source: str) -> set[str]:
    """The functions (or module-level names, for SQL text) of one module that write the queue."""
    tree = ast.parse(source)
    aliases = {TABLE} | {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names if a.name == TABLE
    }
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if names and _writes(node, aliases):
                found.update(names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _writes(node, aliases):
            found.add(node.name)
    return found


def _writes(node: ast.AST, aliases: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and SQL_WRITE.search(n.value):
            return True
        if not isinstance(n, ast.Call):
            continue
        func = n.func
        if isinstance(func, ast.Attribute) and func.attr in ("update", "insert", "delete"):
            if isinstance(func.value, ast.Name) and func.value.id in aliases:
                return True  # q.update()
        if any(isinstance(a, ast.Name) and a.id in aliases for a in n.args):
            if isinstance(func, ast.Name) and func.id in ("update", "insert", "delete"):
                return True  # update(q)
            if isinstance(func, ast.Call):
                return True  # insert_on_conflict(conn)(q)
    return False


def package_writers() -> set[tuple[str, str]]:
    out = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("ledger/migrations/"):
            continue  # a migration rewrites the table once, under the schema's lock
        out.update((rel, name) for name in writers_in(path.read_text(encoding="utf-8")))
    return out


def test_only_the_plan_and_the_claim_and_settle_statements_write_queue_rows():
    assert package_writers() == set(WRITERS)


def test_the_finder_sees_each_way_of_writing_the_queue():
    """The check above can fail: each spelling of a write is found, and a read is not."""
    module = """
from ..schema import notification_queue as q
from sqlalchemy import select, update
RAW = "UPDATE notification_queue SET status = 'settled'"
def by_core(conn): conn.execute(update(q).values(status="settled"))
def by_table(conn): conn.execute(q.delete())
def by_upsert(conn): conn.execute(insert_on_conflict(conn)(q).values(id=1))
def reads(conn): return conn.execute(select(q.c.id)).all()
"""
    assert writers_in(module) == {"RAW", "by_core", "by_table", "by_upsert"}
