"""The engine and its transactions: the single owner of connections to the ledger database.

SQLite allows one writer at a time, and a deferred transaction that reads and then writes gets
``SQLITE_BUSY`` at once whatever the busy timeout says; so every write transaction begins with
``BEGIN IMMEDIATE`` (pysqlite's own transaction handling is switched off, as the SQLAlchemy docs
recommend, and we emit ``BEGIN`` ourselves). Reads begin deferred so WAL readers never wait.

``synchronous=FULL``: with WAL, ``NORMAL`` can lose the last commits on power loss, and a lost
claim commit would let a sent row be sent again. At-most-once is worth the fsync; batching keeps
throughput well above what a drain needs (see docs/benchmarks.md).

One engine per process (``shared``): an engine is a connection pool, and a pool made per Dagster
op or sensor tick opens and closes connections on every evaluation. Its size is
``REMINDERS_DB_POOL_SIZE`` (plus as many again as overflow); on PostgreSQL every statement runs
under ``REMINDERS_DB_STATEMENT_TIMEOUT_MS``, so a stuck statement fails instead of holding a
connection (and its locks) for ever.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InterfaceError, InternalError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from reminders_pipeline.config.log_throttle import QuietFailures
from reminders_pipeline.domain.times import Instant

# The errors of a database that is away for now, not of a statement that is wrong: the server
# gone or restarting (operational), the connection closed under us (interface), no pooled
# connection in time (pool timeout: connects hanging in a partition), a server that turned
# read-only after a failover (internal: SQLSTATE 25006). A send path keeps what it must write
# through them and writes it again; anything else is a bug and is raised.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (OperationalError, InterfaceError, InternalError, PoolTimeout)

if TYPE_CHECKING:
    from reminders_pipeline.config.settings import Settings

T = TypeVar("T")
P = ParamSpec("P")

SQLITE_BUSY_TIMEOUT_MS = 30_000
WRITE_LOCK_POLL_SECONDS = 0.001
LISTEN_RETRY_SECONDS = (0.5, 1, 2, 5, 10)

log = logging.getLogger(__name__)


def make_engine(url: str, *, pool_size: int | None = None, statement_timeout_ms: int = 0, **kwargs: object) -> Engine:
    """An engine configured for the ledger (SQLite pragmas and BEGIN IMMEDIATE, or psycopg 3).

    ``pool_size``: connections kept open, as many again allowed as overflow (None: SQLAlchemy's
    default). ``statement_timeout_ms``: PostgreSQL only, 0 for none; sent as a connection option,
    so it holds for every statement without a round trip of its own.
    """
    parsed = make_url(url)
    in_memory = parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:")
    if pool_size is not None and not in_memory:  # an in-memory SQLite pool is one connection per thread
        kwargs.setdefault("pool_size", pool_size)
        kwargs.setdefault("max_overflow", pool_size)
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        if statement_timeout_ms:
            kwargs.setdefault("connect_args", {"options": f"-c statement_timeout={statement_timeout_ms}"})
        return create_engine(url, **kwargs)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        options = conn.get_execution_options()
        mode = options.get("sqlite_begin", "DEFERRED")
        if mode == "IMMEDIATE":
            take_write_lock(
                conn.connection.dbapi_connection,  # type: ignore[arg-type]
                options.get("sqlite_lock_timeout_ms"),
                options.get("sqlite_on_busy"),
            )
        else:
            conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


def take_write_lock(
    dbapi_connection: sqlite3.Connection, timeout_ms: int | None = None, on_busy: Callable[[], None] | None = None
) -> None:
    """``BEGIN IMMEDIATE``, trying again every ``WRITE_LOCK_POLL_SECONDS`` for ``timeout_ms`` (the
    ledger's busy timeout unless given); ``on_busy`` is called once if the first try finds the
    lock held. Both can be given to a write as the execution options ``sqlite_lock_timeout_ms``
    and ``sqlite_on_busy``.

    SQLite's own busy handler backs off to one try per 100 ms, so a waiter meets a writer that
    commits and begins again a few milliseconds later (a build's next transaction) only by luck,
    and can wait seconds behind transactions of tens of milliseconds. Trying every millisecond, it
    takes the lock in one of the first gaps (waiters race for it; none is served in order).

    Giving up raises SQLAlchemy's ``OperationalError`` around SQLite's own, as a busy statement
    would: SQLAlchemy runs the ``begin`` event outside its error wrapping, and the callers that
    keep settlements through an outage or answer 503 catch SQLAlchemy's type. The connection's
    busy timeout is as it was afterwards.
    """
    timeout_ms = SQLITE_BUSY_TIMEOUT_MS if timeout_ms is None else timeout_ms
    deadline = time.monotonic() + timeout_ms / 1000
    (previous,) = dbapi_connection.execute("PRAGMA busy_timeout").fetchone()
    dbapi_connection.execute("PRAGMA busy_timeout=0")
    try:
        while True:
            try:
                dbapi_connection.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() >= deadline:
                    raise OperationalError("BEGIN IMMEDIATE", None, exc) from exc
            if on_busy is not None:
                on_busy()
                on_busy = None
            time.sleep(WRITE_LOCK_POLL_SECONDS)
    finally:
        dbapi_connection.execute(f"PRAGMA busy_timeout={int(previous)}")


class Database:
    """Owns the engine. ``write()`` and ``read()`` are the only ways in."""

    def __init__(
        self, url: str, *, pool_size: int | None = None, statement_timeout_ms: int = 0, **engine_kwargs: object
    ) -> None:
        self.url = url
        self.engine = make_engine(url, pool_size=pool_size, statement_timeout_ms=statement_timeout_ms, **engine_kwargs)
        self.dialect = self.engine.dialect.name
        self.at_head = False  # set by migrate.require_head once the schema is known current

    @property
    def sqlite_file(self) -> Path | None:
        """The file of a file-backed SQLite ledger; None for PostgreSQL or an in-memory SQLite."""
        parsed = make_url(self.url)
        if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
            return None
        return Path(parsed.database)

    @classmethod
    def for_settings(cls, settings: Settings) -> Database:
        """A new engine sized and bounded by the settings (``shared`` is the one to use per process)."""
        return cls(
            settings.database_url,
            pool_size=settings.db_pool_size,
            statement_timeout_ms=settings.db_statement_timeout_ms,
        )

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A transaction that may write; on SQLite it takes the write lock up front."""
        with self.engine.connect() as conn:
            if self.dialect == "sqlite":
                conn = conn.execution_options(sqlite_begin="IMMEDIATE")
            with conn.begin():
                yield conn

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            with conn.begin():
                yield conn

    def dispose(self) -> None:
        self.engine.dispose()

    @asynccontextmanager
    async def notifications(self, channel: str) -> AsyncIterator[asyncio.Event | None]:
        """An event set on every PostgreSQL ``NOTIFY channel`` (None on SQLite, which has none).

        One dedicated autocommit connection, outside the pool, reconnecting with backoff when it
        drops. Notifications sent while it was away are lost, so the event is also set on every
        (re)connect: a listener re-reads what it waits for instead of trusting it heard everything.
        """
        if self.dialect != "postgresql":
            yield None
            return
        heard = asyncio.Event()
        task = asyncio.ensure_future(
            _listen(self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False), channel, heard)
        )
        try:
            yield heard
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _listen(conninfo: str, channel: str, heard: asyncio.Event) -> None:
    import psycopg

    failures = 0
    lost = QuietFailures(log, f"LISTEN {channel} (polling meanwhile)")
    while True:
        try:
            # TCP keepalives: a half-open connection (a peer gone without a FIN) fails within about a
            # minute instead of waiting for notifications forever.
            async with await psycopg.AsyncConnection.connect(
                conninfo, autocommit=True, keepalives=1, keepalives_idle=30, keepalives_interval=10, keepalives_count=3
            ) as conn:
                await conn.execute(f'LISTEN "{channel}"')
                failures = 0
                lost.succeeded(Instant.now())
                heard.set()
                async for _ in conn.notifies():
                    heard.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the poll backstop covers the gap; keep trying
            lost.failed(exc, Instant.now())
        heard.set()
        await asyncio.sleep(LISTEN_RETRY_SECONDS[min(failures, len(LISTEN_RETRY_SECONDS) - 1)])
        failures += 1


_shared: dict[tuple[int, str, int, int], Database] = {}
_shared_lock = threading.Lock()


def shared(settings: Settings) -> Database:
    """This process's ``Database`` for these settings, made on first use and kept until exit.

    Keyed by process id too: a forked child must not reuse its parent's pooled connections.
    """
    key = (os.getpid(), settings.database_url, settings.db_pool_size, settings.db_statement_timeout_ms)
    with _shared_lock:
        db = _shared.get(key)
        if db is None:
            db = _shared[key] = Database.for_settings(settings)
        return db


@atexit.register
def dispose_shared() -> None:
    """Close this process's shared engines (at exit; tests call it between tests)."""
    with _shared_lock:
        mine = [key for key in _shared if key[0] == os.getpid()]
        for key in mine:
            _shared.pop(key).dispose()


async def waiting_off_the_loop(db: Database, transaction: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a transaction in a worker thread, where its waits cannot stall the sends on the wire.

    Every statement may wait: SQLite's write lock held by another process (a build, another
    drainer) for seconds, PostgreSQL's row locks taken to settle (``ledger.lock_rows``, the device
    locks of dead tokens) held by a build until it commits, a full pool, a slow network. On the
    event loop, any such wait would stop every APNs answer from being read, and sends that were
    delivered would be recorded ``timeout``. The claim itself skips rows held elsewhere (SKIP
    LOCKED) and takes them on a later pass. The thread hop costs well under a millisecond per slice.
    """
    if db.dialect == "sqlite" and db.engine.url.database in (
        None,
        "",
        ":memory:",
    ):  # in memory: one connection per thread
        return transaction(*args, **kwargs)
    return await asyncio.to_thread(transaction, *args, **kwargs)
