"""Ledger throughput: upsert rows/s and claim+settle rows/s, on SQLite and PostgreSQL.

Each figure is printed beside a raw-SQL baseline measured in the same run on the same database
(DBAPI ``executemany`` / one batched UPDATE, no SQLAlchemy, no policy), because absolute times on
shared machines drift. Usage: ``.venv/bin/python bench/bench_ledger.py [--rows N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger import queue as ledger_queue
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.build import queue_rows
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import send_batch

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
T0 = 1_789_000_000
NOW = Instant.from_unix(T0)


def as_stored(value: object) -> object:
    """A value for the bare DBAPI (the raw baselines): an instant as its stored text."""
    return value.stored if isinstance(value, Instant) else value


def rows_for(n: int, devices: int = 1000, title: str = "Standup", lead: int = 3600) -> list[dict]:
    """``n`` rows whose send_after fall within T0 .. T0+2h."""
    out = []
    for i in range(n):
        start = T0 + lead + i % 7200
        out.append(
            {
                "device_id": f"d{i % devices}",
                "source_id": 1,
                "item_id": f"1:item-{i}",
                "rule": f"lead:{lead}",
                "send_after": Instant.from_unix(start - lead),
                "event_at": Instant.from_unix(start),
                "expires_at": Instant.from_unix(start + 1800),
                "title": title,
                "body": None,
            }
        )
    return out


def fresh(kind: str) -> tuple[Database, callable]:
    if kind == "sqlite":
        path = Path(tempfile.mkdtemp()) / "bench.sqlite3"
        db = Database(f"sqlite:///{path}")
        migrate.upgrade(db)
        return db, lambda: db.dispose()
    name = f"bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    db = Database(PG_SERVER.rsplit("/", 1)[0] + f"/{name}")
    migrate.upgrade(db)

    def drop() -> None:
        db.dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()

    return db, drop


def subscribe_every_device(conn: Any, now: Instant) -> None:
    """Source 1, to which every device subscribes: the calendar of the rows the benches queue
    directly, as a build would have it (a row of a calendar its device dropped is voided at its
    claim)."""
    conn.execute(text("DELETE FROM device_sources"))
    conn.execute(text("DELETE FROM sources"))
    conn.execute(
        text("INSERT INTO sources (id, url, created_at) VALUES (1, 'https://bench.example/a.json', :now)"),
        {"now": now.stored},
    )
    conn.execute(text("INSERT INTO device_sources (device_id, source_id) SELECT id, 1 FROM devices"))


def reset(db: Database) -> None:
    with db.write() as conn:
        conn.execute(text("DELETE FROM notification_queue"))


def bench_upsert(db: Database, n: int, batch: int = 1000) -> float:
    data = rows_for(n)
    t = time.perf_counter()
    for i in range(0, n, batch):
        with db.write() as conn:
            queue_rows(conn, data[i : i + batch], NOW)
    return n / (time.perf_counter() - t)


RAW_UPSERT = (
    "INSERT INTO notification_queue (device_id, source_id, item_id, rule, send_after, event_at, expires_at, title, body, "
    "status, created_at, updated_at) VALUES ({p}) ON CONFLICT (device_id, item_id, rule) DO UPDATE SET "
    "send_after = excluded.send_after, updated_at = excluded.updated_at "
    "WHERE notification_queue.status = 'pending' AND notification_queue.send_after <> excluded.send_after"
)


def bench_raw_upsert(db: Database, n: int, batch: int = 1000) -> float:
    data = rows_for(n)
    cols = ["device_id", "source_id", "item_id", "rule", "send_after", "event_at", "expires_at", "title", "body"]
    sqlite = db.dialect == "sqlite"
    sql = RAW_UPSERT.format(p=", ".join(["?" if sqlite else "%s"] * 12))
    tuples = [tuple(as_stored(r[c]) for c in cols) + ("pending", NOW.stored, NOW.stored) for r in data]
    raw = db.engine.raw_connection()
    try:
        cur = raw.cursor()
        t = time.perf_counter()
        for i in range(0, n, batch):
            if sqlite:
                cur.execute("BEGIN IMMEDIATE")
            cur.executemany(sql, tuples[i : i + batch])
            raw.commit() if not sqlite else cur.execute("COMMIT")
        return n / (time.perf_counter() - t)
    finally:
        raw.close()


def bench_raw_upsert_json(db: Database, n: int, batch: int = 1000) -> float:
    """The strongest raw baseline: the ledger's own one-statement JSON upsert, sent through the bare DBAPI."""
    data = rows_for(n)
    cols = ledger.UPSERT_COLUMNS
    sqlite = db.dialect == "sqlite"
    sql = ledger_queue._UPSERT.format(
        rows=ledger_queue._UPSERT_ROWS_SOURCE[db.dialect], distinct=ledger_queue._NULL_SAFE_DIFFERENT[db.dialect]
    )
    if not sqlite:  # psycopg's named style; sqlite3 takes :name as it is
        sql = sql.replace(":rows", "%(rows)s").replace(":now", "%(now)s")
    raw = db.engine.raw_connection()
    try:
        cur = raw.cursor()
        t = time.perf_counter()
        for i in range(0, n, batch):
            doc = json.dumps(
                [{c: as_stored(r.get(c)) for c in cols} for r in data[i : i + batch]], separators=(",", ":")
            )
            if sqlite:
                cur.execute("BEGIN IMMEDIATE")
                cur.execute(sql, {"rows": doc, "now": NOW.stored}).fetchall()
                cur.execute("COMMIT")
            else:
                cur.execute(sql, {"rows": doc, "now": NOW.stored})
                cur.fetchall()
                raw.commit()
        return n / (time.perf_counter() - t)
    finally:
        raw.close()


def load_due(db: Database, n: int) -> list[int]:
    reset(db)
    with db.write() as conn:
        queue_rows(conn, rows_for(n, lead=86400), NOW)
        conn.execute(text("DELETE FROM devices"))
        conn.execute(
            text(
                "INSERT INTO devices (id, target, chunk, created_at, updated_at) "
                "SELECT DISTINCT device_id, :tok, 0, :now, :now FROM notification_queue"
            ),
            {"tok": "ab" * 32, "now": NOW.stored},
        )
        subscribe_every_device(conn, NOW)
    with db.read() as conn:
        return ledger.due_ids(conn, Instant.from_unix(T0 + 7200 + 10))


def bench_claim_settle(db: Database, n: int, batch: int = 100) -> float:
    """Claim and settle as the drain does: slice k's settlement shares a transaction with slice k+1's claim."""
    ids = load_due(db, n)
    now = Instant.from_unix(T0 + 7200 + 10)
    unsettled: list[dict] = []
    t = time.perf_counter()
    for i in range(0, len(ids), batch):
        with db.write() as conn:
            ledger.settle(conn, unsettled, "bench", now)
            claimed = ledger.claim(conn, ids[i : i + batch], now, "bench")
        unsettled = [{"id": r["id"], "outcome": "sent", "sent_at": now, "apns_id": "x"} for r in claimed]
    with db.write() as conn:
        ledger.settle(conn, unsettled, "bench", now)
    return len(ids) / (time.perf_counter() - t)


def bench_drain(db: Database, n: int) -> float:
    """The drain core end to end with an in-memory sender: claim, policy, compose, settle."""
    ids = load_due(db, n)
    settings = Settings(database_url=db.url, enabled=True, max_lateness_seconds=10**9)
    sender = RecordingSender()
    t = time.perf_counter()
    send_batch(db, settings, ids, sender.factory(), now=Instant.from_unix(T0 + 7200 + 10))
    assert len(sender.sent) == len(ids)
    return len(ids) / (time.perf_counter() - t)


def bench_raw_claim_settle(db: Database, n: int, batch: int = 100) -> float:
    ids = load_due(db, n)
    now = Instant.from_unix(T0 + 7200 + 10).stored  # the bare DBAPI takes the stored text
    sqlite = db.dialect == "sqlite"
    raw = db.engine.raw_connection()
    try:
        cur = raw.cursor()
        t = time.perf_counter()
        for i in range(0, len(ids), batch):
            part = ids[i : i + batch]
            for status_from, status_to in (("pending", "claimed"), ("claimed", "settled")):
                extra = ", outcome = 'sent'" if status_to == "settled" else ""
                if sqlite:
                    cur.execute("BEGIN IMMEDIATE")
                    marks = ",".join("?" * len(part))
                    cur.execute(
                        f"UPDATE notification_queue SET status = '{status_to}', claimed_at = ?{extra} "
                        f"WHERE id IN ({marks}) AND status = '{status_from}' RETURNING id",
                        [now, *part],
                    ).fetchall()
                    cur.execute("COMMIT")
                else:
                    cur.execute(
                        f"UPDATE notification_queue SET status = '{status_to}', claimed_at = %s{extra} "
                        f"WHERE id = ANY(%s) AND status = '{status_from}' RETURNING id",
                        (now, part),
                    )
                    cur.fetchall()
                    raw.commit()
        return len(ids) / (time.perf_counter() - t)
    finally:
        raw.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {__import__('os').cpu_count()} cores".strip(),
        "rows": args.rows,
    }
    for kind in ("sqlite", "postgresql"):
        db, close = fresh(kind)
        try:
            r = {}
            r["upsert_raw_executemany_rows_per_s"] = bench_raw_upsert(db, args.rows)
            reset(db)
            r["upsert_raw_one_statement_rows_per_s"] = bench_raw_upsert_json(db, args.rows)
            reset(db)
            r["upsert_rows_per_s"] = bench_upsert(db, args.rows)
            r["upsert_unchanged_rows_per_s"] = bench_upsert(db, args.rows)  # same feed again: writes nothing
            r["claim_settle_raw_rows_per_s"] = bench_raw_claim_settle(db, args.rows)
            r["claim_settle_rows_per_s"] = bench_claim_settle(db, args.rows)
            r["drain_core_rows_per_s"] = bench_drain(db, args.rows)
            results[kind] = {k: round(v) for k, v in r.items()}
        finally:
            close()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
