"""The engine and its transactions: the single owner of connections to the ledger database.

SQLite allows one writer at a time, and a deferred transaction that reads and then writes gets
``SQLITE_BUSY`` at once whatever the busy timeout says; so every write transaction begins with
``BEGIN IMMEDIATE`` (pysqlite's own transaction handling is switched off, as the SQLAlchemy docs
recommend, and we emit ``BEGIN`` ourselves). Reads begin deferred so WAL readers never wait.

``synchronous=FULL``: with WAL, ``NORMAL`` can lose the last commits on power loss, and a lost
claim commit would let a sent row be sent again. At-most-once is worth the fsync; batching keeps
throughput well above what a drain needs (see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import AsyncIterator, Iterator

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_BUSY_TIMEOUT_MS = 30_000
LISTEN_RETRY_SECONDS = (0.5, 1, 2, 5, 10)

log = logging.getLogger(__name__)


def make_engine(url: str, **kwargs: object) -> Engine:
    """An engine configured for the ledger (SQLite pragmas and BEGIN IMMEDIATE, or psycopg 3)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(url, **kwargs)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):  # type: ignore[no-untyped-def]
        dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_connection.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


class Database:
    """Owns the engine. ``write()`` and ``read()`` are the only ways in."""

    def __init__(self, url: str, **engine_kwargs: object) -> None:
        self.url = url
        self.engine = make_engine(url, **engine_kwargs)
        self.dialect = self.engine.dialect.name

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
        task = asyncio.ensure_future(_listen(self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False), channel, heard))
        try:
            yield heard
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _listen(conninfo: str, channel: str, heard: asyncio.Event) -> None:
    import psycopg

    failures = 0
    while True:
        try:
            async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as conn:
                await conn.execute(f'LISTEN "{channel}"')
                failures = 0
                heard.set()
                async for _ in conn.notifies():
                    heard.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the poll backstop covers the gap; keep trying
            log.warning("LISTEN %s lost (%s); polling until it reconnects", channel, type(exc).__name__)
        heard.set()
        await asyncio.sleep(LISTEN_RETRY_SECONDS[min(failures, len(LISTEN_RETRY_SECONDS) - 1)])
        failures += 1
