"""What `reminders db upgrade` costs the claims running beside it, on PostgreSQL with a full queue.

A queue of ``--rows`` rows (a tenth pending) at revision 0005, then ``migrate.upgrade`` to head
while a claimer updates one random pending row at a time, as a claim does (ROW EXCLUSIVE on the
queue and a row lock). Printed: the claimer's latency before the upgrade (its normal time, same
run, same database) and during it, the upgrade's duration, and what the scans the upgrade makes
outside its exclusive locks took (validating every CHECK, building the partial index), which is
how long claims waited behind them when they ran under the lock.

The bar: no claim during the upgrade waits longer than the upgrade's lock timeout
(0.2 s, how long one of its ALTERs may queue claims behind it) plus the slowest claim before it.

    .venv/bin/python bench/bench_migration.py [--rows N] [--json]

Run it with another checkout first on ``PYTHONPATH`` for an A/B against an older release.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
import uuid

from sqlalchemy import create_engine, text

from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

FILL = """
INSERT INTO notification_queue (device_id, source_id, item_id, rule, send_after, event_at, expires_at, title,
  status, outcome, created_at, updated_at)
SELECT 'd' || (g % 100000), NULL, '1:item-' || g, 'lead:3600', t, t, t, 'Standup',
  CASE WHEN g % 10 = 0 THEN 'pending' ELSE 'settled' END, CASE WHEN g % 10 = 0 THEN NULL ELSE 'sent' END, t, t
FROM generate_series(1, :n) AS g,
  LATERAL (SELECT to_char(timestamp '2026-12-01' + g * interval '1 second', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS t) AS s
"""


def claimer(db: Database, pending: list[int], stop: threading.Event, waits: list[float]) -> None:
    """One claim-shaped write at a time, with 10 ms between, each timed."""
    while not stop.is_set():
        started = time.perf_counter()
        with db.engine.begin() as conn:
            conn.execute(
                text("UPDATE notification_queue SET updated_at = updated_at WHERE id = :id"),
                {"id": random.choice(pending)},
            )
        waits.append(time.perf_counter() - started)
        time.sleep(0.01)


def timed_claims(db: Database, pending: list[int], during) -> tuple[list[float], float]:  # type: ignore[no-untyped-def]
    waits: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=claimer, args=(db, pending, stop, waits))
    thread.start()
    started = time.perf_counter()
    try:
        during()
    finally:
        took = time.perf_counter() - started
        stop.set()
        thread.join()
    return waits, took


def scans(db: Database) -> dict[str, float]:
    """The scans the head schema needs, timed alone (after the upgrade, on the same rows)."""
    out = {}
    with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        names = (
            conn.execute(
                text(
                    "SELECT conname FROM pg_constraint WHERE conrelid = 'notification_queue'::regclass AND contype = 'c'"
                )
            )
            .scalars()
            .all()
        )
        for name in ("ck_queue_outcome", "ck_item_at_iso", "ck_not_before_iso", "ck_held_until_iso"):
            if name in names:
                conn.execute(text(f"ALTER TABLE notification_queue DROP CONSTRAINT {name}"))
        started = time.perf_counter()
        conn.execute(
            text(
                "ALTER TABLE notification_queue ADD CONSTRAINT ck_bench CHECK (outcome IS NULL OR outcome IN ('sent', 'failed'))"
            )
        )
        out["one_check_scan_s"] = time.perf_counter() - started
        conn.execute(text("DROP INDEX IF EXISTS ix_queue_not_before"))
        started = time.perf_counter()
        conn.execute(
            text(
                "CREATE INDEX ix_bench ON notification_queue (not_before) WHERE status = 'pending' AND not_before IS NOT NULL"
            )
        )
        out["index_build_s"] = time.perf_counter() - started
    return out


def summary(waits: list[float]) -> dict[str, float]:
    return {"claims": len(waits), "p50_ms": statistics.median(waits) * 1000, "max_ms": max(waits) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    name = f"bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_SERVER, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    db = Database(PG_SERVER.rsplit("/", 1)[0] + f"/{name}")
    try:
        migrate.upgrade(db, "0005")
        with db.engine.begin() as conn:
            conn.execute(text(FILL), {"n": args.rows})
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE notification_queue"))
            pending = conn.execute(text("SELECT id FROM notification_queue WHERE status = 'pending'")).scalars().all()
        before, _ = timed_claims(db, pending, lambda: time.sleep(5))
        during, took = timed_claims(db, pending, lambda: migrate.upgrade(db))
        bound_ms = migrate.LOCK_TIMEOUT_SECONDS * 1000 + max(before) * 1000
        result = {
            "rows": args.rows,
            "claims_before": summary(before),
            "claims_during_upgrade": summary(during),
            "upgrade_s": took,
            "bound_ms": bound_ms,
            "met": max(during) * 1000 <= bound_ms,
            **scans(db),
        }
    finally:
        db.dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        admin.dispose()
    if args.json:
        print(json.dumps(result))
        return
    b, d = result["claims_before"], result["claims_during_upgrade"]
    print(f"{args.rows:,} queue rows; upgrade 0005 -> head took {took:.2f} s")
    print(f"claims before: {b['claims']} p50 {b['p50_ms']:.1f} ms, max {b['max_ms']:.1f} ms")
    print(f"claims during: {d['claims']} p50 {d['p50_ms']:.1f} ms, max {d['max_ms']:.1f} ms (bound {bound_ms:.0f} ms)")
    print(
        f"one CHECK's scan {result['one_check_scan_s']:.2f} s, the partial index's build {result['index_build_s']:.2f} s"
    )
    print("met" if result["met"] else "MISSED")


if __name__ == "__main__":
    main()
