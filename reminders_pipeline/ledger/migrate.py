"""Apply the packaged Alembic migrations (``reminders db upgrade``), and refuse a database behind them.

Every shell (CLI, HTTP, Dagster) calls ``require_head`` before it touches the ledger: a database
at another revision fails with one line naming both revisions, instead of a traceback from the
first query that meets a missing column. The answer is cached on the ``Database`` once it is
current, so the check costs one query per engine, not per request.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.schema import CreateIndex

from reminders_pipeline.config.log_throttle import first_line
from reminders_pipeline.ledger.db import TRANSIENT_ERRORS, Database
from reminders_pipeline.ledger.migrations import readers
from reminders_pipeline.ledger.schema import metadata

MIGRATIONS = Path(__file__).parent / "migrations"

log = logging.getLogger(__name__)


class SchemaNotCurrent(RuntimeError):
    """The database is not at this release's migration head; the message is the one line to show."""


def _config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


LOCK_TIMEOUT_SECONDS = 0.2  # how long one attempt waits for a table lock: what claims queued behind it wait at most
LOCK_ATTEMPTS = 30
LOCK_BACKOFF_MAX_SECONDS = 10.0
FINISH_WAIT_SECONDS = 60.0  # how long a validation or index build waits for older transactions (blocking no claim)
LOCK_NOT_AVAILABLE = "55P03"
QUERY_CANCELED = "57014"  # a statement_timeout set on the role or database
# SQLite: how long a migration waits for the ledger's write lock. Builds, claims and settlements
# hold it for milliseconds at a time; what holds it longer is a stuck transaction or another
# upgrade copying a large table (0017: about 4 s per 200,000 rows).
SQLITE_LOCK_WAIT_SECONDS = 120.0


class MigrationBlocked(RuntimeError):
    """A step could not finish (its locks not taken in time, or old rows breaking a new CHECK); the
    migrations before it are committed, and the next run starts from it."""


def upgrade(
    db: Database, revision: str = "head", *, lock_timeout: float = LOCK_TIMEOUT_SECONDS, attempts: int = LOCK_ATTEMPTS
) -> None:
    """Apply the migrations up to ``revision``, each in its own transaction.

    On PostgreSQL each attempt at a migration waits at most ``lock_timeout`` for a table lock
    (``SET LOCAL lock_timeout``): its ALTER waits behind any open transaction on its table, and
    every claim and build would queue behind the ALTER for as long. An attempt that times out rolls
    back whole and is retried after a backoff (0.5 s doubling, at most ``LOCK_BACKOFF_MAX_SECONDS``),
    so claims run between attempts; after ``attempts`` it raises ``MigrationBlocked``. After each
    migration commits, ``_finish`` does on PostgreSQL what must not run under its exclusive lock.

    On SQLite each migration begins by taking the write lock (``BEGIN IMMEDIATE``, as every write
    does): begun deferred, its first write after its first read fails at once while another
    process writes. It waits for the lock at most ``SQLITE_LOCK_WAIT_SECONDS``, logging once per
    upgrade that it waits, then raises ``MigrationBlocked``."""
    if db.sqlite_file is not None:  # the one command that creates the ledger; every other refuses a missing one
        db.sqlite_file.parent.mkdir(parents=True, exist_ok=True)
    waiting = _said_once()
    with _one_upgrade_at_a_time(db):
        _finish(db)  # first what an earlier run left undone: the next migration may read through it
        current = current_revision(db)
        for step in reversed(list(_scripts().iterate_revisions(revision, current or "base"))):
            _apply(db, step.revision, current, lock_timeout, attempts, waiting)
            current = step.revision
            _finish(db)
        readers.record(db, _scripts(), current)
    db.at_head = False  # checked again on next use


UPGRADE_LOCK = 7_406_352_011  # pg_advisory_lock key: one `reminders db upgrade` at a time
UPGRADE_LOCK_POLL_SECONDS = 0.5


@contextmanager
def _one_upgrade_at_a_time(db: Database) -> Iterator[None]:
    """PostgreSQL: a second upgrade waits for the first; run side by side, one would add a column
    the other already added, or drop the index the other is building. The lock is a session
    advisory lock, taken by polling: a waiting ``pg_advisory_lock`` is a running statement, whose
    snapshot the first upgrade's ``CREATE INDEX CONCURRENTLY`` would wait for in turn."""
    if db.dialect != "postgresql":
        yield
        return
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while not conn.exec_driver_sql(f"SELECT pg_try_advisory_lock({UPGRADE_LOCK})").scalar():
            time.sleep(UPGRADE_LOCK_POLL_SECONDS)
        try:
            yield
        finally:
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({UPGRADE_LOCK})")


def _said_once() -> Callable[[], None]:
    """What an upgrade calls each time it finds SQLite's write lock held: it logs the first time only."""
    said = False

    def waiting() -> None:
        nonlocal said
        if not said:
            log.warning(
                "waiting for the SQLite write lock held by another process (at most %.0f s)", SQLITE_LOCK_WAIT_SECONDS
            )
            said = True

    return waiting


def _apply(
    db: Database, step: str, current: str | None, lock_timeout: float, attempts: int, waiting: Callable[[], None]
) -> None:
    for attempt in range(1, attempts + 1):
        try:
            with _migrating(db, lock_timeout, waiting) as conn:
                command.upgrade(_config(conn), step)
            return
        except OperationalError as exc:
            if _sqlite_busy(exc):
                raise MigrationBlocked(
                    f"the SQLite write lock stayed held by another process for {SQLITE_LOCK_WAIT_SECONDS:.0f} s "
                    f"(a transaction left open, or another upgrade copying a large table); the database stays at revision "
                    f"{current or 'none'}, run the upgrade again once it ends"
                ) from None
            if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            if attempt == attempts:
                raise MigrationBlocked(
                    f"could not take a table lock within {lock_timeout}s in {attempts} attempts: a long-running transaction "
                    f"holds one (see pg_stat_activity); the database stays at revision {current or 'none'}, "
                    "run the upgrade again once it ends"
                ) from None
            time.sleep(min(0.5 * 2 ** (attempt - 1), LOCK_BACKOFF_MAX_SECONDS))


def _sqlite_busy(exc: OperationalError) -> bool:
    """SQLite's write lock not taken in time (``SQLITE_BUSY``, any extended code)."""
    orig = exc.orig
    return isinstance(orig, sqlite3.OperationalError) and orig.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY


def _finish(db: Database) -> None:
    """PostgreSQL only: validate the CHECKs the migrations added ``NOT VALID`` and build, ``CONCURRENTLY``,
    every index of the schema whose columns exist but which is missing or left invalid by an
    interrupted build. Both take SHARE UPDATE EXCLUSIVE, which no read, claim or build waits for;
    each runs outside any transaction and waits at most ``FINISH_WAIT_SECONDS`` for older ones."""
    if db.dialect != "postgresql":
        return
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"SET lock_timeout = '{int(FINISH_WAIT_SECONDS * 1000)}ms'")
        try:
            for statement in [*_validations(conn), *_index_builds(conn)]:
                conn.exec_driver_sql(statement)
        except OperationalError as exc:
            orig = exc.orig
            if orig is None or getattr(orig, "sqlstate", None) not in (LOCK_NOT_AVAILABLE, QUERY_CANCELED):
                raise
            raise MigrationBlocked(
                f"gave up on {statement.split(' (')[0]} ({first_line(orig)}): it waits for older transactions "
                f"(at most {FINISH_WAIT_SECONDS:.0f}s, see pg_stat_activity); claims were not held up; run the upgrade again to finish it"
            ) from None
        except IntegrityError as exc:
            raise MigrationBlocked(
                f"{statement}: rows written before the upgrade break it ({str(exc.orig).splitlines()[0]}); every new write is checked; "
                "correct those rows and run the upgrade again"
            ) from None
        finally:
            conn.exec_driver_sql("RESET lock_timeout")


# Where the ledger's tables are: the schema the search path finds the queue in.
LEDGER_SCHEMA = "(SELECT relnamespace FROM pg_class WHERE oid = to_regclass('notification_queue'))"


def _validations(conn: Connection) -> list[str]:
    rows = conn.exec_driver_sql(
        "SELECT c.conrelid::regclass::text, quote_ident(c.conname) FROM pg_constraint c "
        f"WHERE NOT c.convalidated AND c.connamespace = {LEDGER_SCHEMA} ORDER BY 1, 2"
    ).all()
    return [f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}" for table, name in rows]


def _index_builds(conn: Connection) -> list[str]:
    """``DROP``/``CREATE INDEX CONCURRENTLY`` for each schema index missing or invalid in the database."""
    columns = set(
        conn.exec_driver_sql(
            f"SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = {LEDGER_SCHEMA}::regnamespace::text"
        ).all()
    )
    valid: dict[str, bool] = dict(
        conn.exec_driver_sql(
            "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            f"WHERE c.relnamespace = {LEDGER_SCHEMA}"
        ).all()
    )
    statements = []
    for table in metadata.sorted_tables:
        for index in sorted(table.indexes, key=lambda i: str(i.name)):
            name = str(index.name)  # every index of the schema is named
            if valid.get(name) or any((table.name, c.name) not in columns for c in index.columns):
                continue
            if name in valid:
                statements.append(f"DROP INDEX CONCURRENTLY {name}")
            create = str(CreateIndex(index).compile(dialect=conn.dialect))
            statements.append(create.replace("INDEX ", "INDEX CONCURRENTLY ", 1))
    return statements


@contextmanager
def _migrating(
    db: Database, lock_timeout: float | None = None, waiting: Callable[[], None] | None = None
) -> Iterator[Connection]:
    """A migration's transaction. On SQLite it begins with the write lock (waiting for it at most
    ``SQLITE_LOCK_WAIT_SECONDS``, calling ``waiting`` when it finds it held), and foreign keys are
    off while it runs: SQLite alters a table by copying and dropping it, and with foreign keys on
    the drop would cascade (0002's rebuild of ``sources`` deleted every ``device_sources`` row).
    They are checked afterwards."""
    with db.engine.connect() as conn:
        sqlite = db.dialect == "sqlite"
        if sqlite:
            conn = conn.execution_options(
                sqlite_begin="IMMEDIATE",
                sqlite_lock_timeout_ms=int(SQLITE_LOCK_WAIT_SECONDS * 1000),
                sqlite_on_busy=waiting,
            )
        # The pragma works only outside a transaction: on pysqlite's own connection, SQLAlchemy does
        # not begin one first.
        raw: sqlite3.Connection | None = conn.connection.driver_connection if sqlite else None
        if raw is not None:
            raw.execute("PRAGMA foreign_keys=OFF")
        try:
            with conn.begin():
                if lock_timeout is not None and not sqlite:
                    conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(lock_timeout * 1000)}ms'")
                yield conn
                if sqlite and conn.exec_driver_sql("PRAGMA foreign_key_check").first() is not None:
                    raise RuntimeError("the migration left rows that break a foreign key; rolled back")
        finally:
            if raw is not None:
                raw.execute("PRAGMA foreign_keys=ON")


def current_revision(db: Database) -> str | None:
    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def oldest_reader(revision: str) -> str:
    """The oldest head that may run against a schema at ``revision`` (``migrations.readers``)."""
    return readers.oldest_reader(_scripts(), revision)


def head_revision() -> str | None:
    return _scripts().get_current_head()


def schema_problem(current: str | None, head: str | None, oldest_head: str | None = None) -> str | None:
    """The one line for a database at ``current`` when this release needs ``head``; None when they
    match, or when a newer release migrated it only additively since a head of this release's own
    (``oldest_head``, its ``schema_readers``)."""
    if current == head:
        return None
    ours = {s.revision for s in _scripts().walk_revisions()}
    known = current is None or current in ours
    if not known and oldest_head in ours:
        return None
    advice = "run reminders db upgrade" if known else "it was migrated by a newer release: upgrade this package"
    return f"database at revision {current or 'none'}, this release needs {head}: {advice}"


def require_head(db: Database) -> None:
    """Raise ``SchemaNotCurrent`` unless the database is at the head; only the first success is cached,
    so a server started before the upgrade recovers as soon as it is applied."""
    if db.at_head:
        return
    if db.sqlite_file is not None and not db.sqlite_file.exists():  # connecting would create it
        raise SchemaNotCurrent(f"no ledger at {db.sqlite_file}: run reminders db upgrade")
    current, head = current_revision(db), head_revision()
    oldest = readers.oldest_head(db) if current != head else None
    problem = schema_problem(current, head, oldest)
    if problem:
        raise SchemaNotCurrent(problem)
    if current != head:
        log.warning(
            "the ledger is at revision %s, from a newer release that may run with %s on: running", current, oldest
        )
    db.at_head = True


WAITED_FOR: tuple[type[Exception], ...] = (SchemaNotCurrent, *TRANSIENT_ERRORS)


async def wait_for_head(
    db: Database, give_up_at: float, pause: Callable[[float], Awaitable[object]] = asyncio.sleep, every: float = 2.0
) -> None:
    """``require_head`` until it passes: a long-lived process that starts while the ledger is
    away (a restart, a failover) or not at this release's head (an upgrade under way, or a newer
    release's done) waits for it, saying so once, instead of failing into its supervisor's
    growing backoff. Raises the last refusal once ``time.monotonic()`` reaches ``give_up_at``;
    ``pause`` returns early (True) when the caller is told to stop, which ends the wait the same way."""
    said = None
    while True:
        try:
            require_head(db)
            if said is not None:
                log.warning("the ledger is ready (%s before); starting", said)
            return
        except WAITED_FOR as exc:
            if time.monotonic() + every >= give_up_at:
                raise
            if said is None:
                said = first_line(exc)
                log.warning("waiting for the ledger: %s (trying every %ss)", said, every)
        if await pause(every) is True:
            raise SchemaNotCurrent(f"stopped while waiting for the ledger: {said}")


def downgrade(db: Database, revision: str) -> None:
    """Back to ``revision`` (tests of a migration's data path; operators use ``alembic`` directly)."""
    with _migrating(db, waiting=_said_once()) as conn:
        command.downgrade(_config(conn), revision)
