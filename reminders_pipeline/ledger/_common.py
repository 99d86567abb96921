"""What every ledger module shares: the status literals the partial indexes are defined on,
batching under SQLite's parameter limit, and the dialect's INSERT with ON CONFLICT and date
functions."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    TIMESTAMP,
    BigInteger,
    BindParameter,
    ColumnClause,
    ColumnElement,
    Connection,
    TextClause,
    bindparam,
    cast,
    extract,
    func,
    literal_column,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite

from reminders_pipeline.domain.times import Instant, as_json
from reminders_pipeline.ledger.schema import IsoTime

# Literal, not bound: the partial indexes are defined on these exact predicates.
PENDING: ColumnClause[str] = literal_column("'pending'")
CLAIMED: ColumnClause[str] = literal_column("'claimed'")
SETTLED: ColumnClause[str] = literal_column("'settled'")

# Sized under SQLite's 32,766 bound-parameter limit with room for the other parameters.
IN_LIST_MAX = 10_000


def batches(seq: Sequence[Any], size: int = IN_LIST_MAX) -> Iterable[Sequence[Any]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


def now_param() -> BindParameter[Instant]:
    """``:now``, bound as a stored time (``IsoTime``) wherever a statement writes or compares it."""
    return bindparam("now", type_=IsoTime())


def rows_text(sql: str, **times: Any) -> TextClause:
    """A textual statement whose ``:now`` binds an ``Instant``; ``times`` name the RETURNING
    columns read back as instants (``IsoTime``)."""
    stmt = text(sql).bindparams(now_param())
    return stmt.columns(**times) if times else stmt  # type: ignore[return-value]


def rows_json(rows: Iterable[Any]) -> str:
    """A batch of rows as one JSON parameter (``json_to_recordset``/``json_each`` unpack it), each
    instant as its stored text."""
    return json.dumps(list(rows), separators=(",", ":"), default=as_json)


def insert_on_conflict(conn: Connection):  # type: ignore[no-untyped-def]
    """SQLAlchemy's generic insert() has no ON CONFLICT; each dialect's own insert() has one."""
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def unix_of(conn: Connection, column: Any) -> ColumnElement[int]:
    """Whole Unix seconds of a stored ISO-8601 UTC time, read by the database's own date functions
    (for a comparison that varies per row, which a bound ISO cutoff cannot express)."""
    if conn.dialect.name == "postgresql":
        return cast(func.floor(extract("epoch", cast(column, TIMESTAMP(timezone=True)))), BigInteger)
    return cast(func.strftime("%s", column), BigInteger)


# The voids an item's return undoes: a build brings such a row back with its item (``plan``).
REVIVABLE_VOIDS = frozenset({"left_feed", "empty_day"})
