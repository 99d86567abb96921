"""Where a queue row's bytes go on PostgreSQL: the table, its TOAST, each index, and each column;
which index each of the ledger's queue statements uses; how many queue updates are HOT.

Fills a fresh database (the current schema, all migrations) with ``--rows`` queue rows shaped like
the steady state the design implies: one in ``--pending-every`` rows pending (the next day's
reminders), the rest settled ``sent`` recording their alert as the drain does (``sent_body``; the
whole payload only where the row cannot re-render it, none at default settings), ids and texts as
the build and APNs write them. Then ``VACUUM ANALYZE`` and measures ``pg_relation_size`` per
relation and ``avg(pg_column_size(...))`` per column (over the rows where it is not NULL).

``--plans``: runs each ledger statement that reads or writes the queue (due ids, claim, settle,
return to pending, abandoned sweep, prune, the build's upsert and voids, the metrics reads) on the
filled table inside a transaction that is rolled back, capturing the SQL it sends, and prints
``EXPLAIN (COSTS OFF)`` of each. ``--hot-rows N``: on a second fresh database, N rows through the
real build upsert, drain (claim and settle) and a title-only re-upsert, with the table's
``n_tup_upd``/``n_tup_hot_upd`` after each phase.

    .venv/bin/python bench/bench_row_cost.py [--rows 1000000] [--plans] [--hot-rows 20000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_ledger import fresh, rows_for  # noqa: E402
from sqlalchemy import Connection, event, text  # noqa: E402

from reminders_pipeline import ledger  # noqa: E402
from reminders_pipeline.config.settings import Settings  # noqa: E402
from reminders_pipeline.domain.notification import sent_payload  # noqa: E402
from reminders_pipeline.domain.rules import expiry_anchored  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402
from reminders_pipeline.ledger.schema import IsoTime, notification_queue  # noqa: E402
from reminders_pipeline.planning.build import queue_rows
from reminders_pipeline.providers.base import RecordingSender  # noqa: E402
from reminders_pipeline.sending.drain import send_batch  # noqa: E402

# Rows made in SQL from generate_series: one statement instead of a million round trips. The texts
# have the lengths the build writes: "<source id>:<item id>" item ids, ISO-8601 times, the alert
# body a lead rule's payload carries, an apns-id as APNs sends it (a UUID), a Dagster claimer.
FILL = """
INSERT INTO notification_queue (device_id, source_id, item_id, rule, send_after, event_at, expires_at, title, body,
    status, outcome, sent_body, apns_id, claimed_by, claimed_at, settled_at, sent_at, created_at, updated_at, attempts)
SELECT
    'device-' || lpad((g / 34)::text, 7, '0'),
    (g / 34) % 50000,
    ((g / 34) % 50000)::text || '\\:event-' || g::text || '@calendar.example.com',
    'lead:3600',
    '2026-09-10T08:30:00.000Z', '2026-09-10T09:30:00.000Z', '2026-09-10T10:00:00.000Z',
    'Weekly planning with the product team',
    NULL,
    CASE WHEN g % :pending_every = 0 THEN 'pending' ELSE 'settled' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE 'sent' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE 'Starts at 09:30' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE upper(md5(g::text || 'apns')::uuid::text) END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE 'b9a7c0d2-7c43-4f0a-9d0e-3c7f1f0a2b11:batch_003' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE '2026-09-10T08:30:01.250Z' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE '2026-09-10T08:30:01.480Z' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE '2026-09-10T08:30:01.460Z' END,
    '2026-09-09T08:30:00.000Z', '2026-09-10T08:30:01.480Z', 0
FROM generate_series(1, :rows) AS g
"""


PENDING_AT = "2026-09-10T08:30:00.000Z"  # the fill's pending send_after: every pending row is due from here


def captured(
    db: Database, work: Callable[[Connection], Any], setup: Callable[[Connection], Any] | None = None
) -> list[tuple[str, Any]]:
    """The statements ``work`` sends (``(sql, parameters)``), run after ``setup`` (not captured) in
    a transaction that is rolled back."""
    seen: list[tuple[str, Any]] = []

    def listen(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if not executemany and not statement.lstrip().upper().startswith(("EXPLAIN", "SELECT PG_NOTIFY")):
            seen.append((statement, parameters))

    with db.engine.connect() as conn:
        trans = conn.begin()
        if setup is not None:
            setup(conn)
        event.listen(db.engine, "before_cursor_execute", listen)
        try:
            work(conn)
        finally:
            event.remove(db.engine, "before_cursor_execute", listen)
            trans.rollback()
    return seen


def plans(db: Database) -> dict[str, list[str]]:
    """``EXPLAIN (COSTS OFF)`` of every queue statement the ledger sends, as it sends them."""
    with db.read() as conn:
        sample = [
            dict(r)
            for r in conn.execute(
                text(
                    "SELECT id, device_id, source_id, item_id, rule, send_after, event_at, expires_at, title, body "
                    "FROM notification_queue WHERE status = 'pending' ORDER BY id LIMIT 100"
                ).columns(send_after=IsoTime, event_at=IsoTime, expires_at=IsoTime)
            ).mappings()
        ]
        settled = [
            dict(r)
            for r in conn.execute(
                text(
                    "SELECT device_id, source_id, item_id, rule, event_at, expires_at, title, body "
                    "FROM notification_queue WHERE status = 'settled' ORDER BY id LIMIT 100"
                ).columns(event_at=IsoTime, expires_at=IsoTime)
            ).mappings()
        ]
    ids = [r["id"] for r in sample]
    now = Instant.from_stored("2026-09-10T08:31:00.000Z")
    moved = [{**r, "send_after": Instant.from_stored("2026-09-10T08:35:00.000Z")} for r in sample]
    work: dict[str, Callable[[Connection], Any]] = {
        "due ids (drain find_due)": lambda c: ledger.due_ids(c, now),
        "next due (dispatcher)": lambda c: ledger.next_send_after(c, Instant.from_stored(PENDING_AT)),
        "claim": lambda c: ledger.claim(c, ids, now, "bench"),
        "settle": lambda c: ledger.settle(
            c, [{"id": i, "outcome": "sent", "sent_body": "Starts at 09:30"} for i in ids], "bench", now
        ),
        "return to pending": lambda c: ledger.return_to_pending(
            c, [{"id": i, "outcome_detail": "x"} for i in ids], "bench", now
        ),
        "abandoned sweep": lambda c: ledger.fail_abandoned(c, Instant.from_stored("2026-09-10T08:20:00.000Z"), now),
        "prune": lambda c: ledger.prune_settled(
            c,
            Instant.from_stored("2026-09-11T00:00:00.000Z"),
            1000,
            ended_before=Instant.from_stored("2026-09-11T00:00:00.000Z"),
        ),
        "build: existing rows": lambda c: ledger.existing_rows(c, sorted({r["device_id"] for r in sample})),
        "build: upsert of pending rows": lambda c: queue_rows(c, moved, now),
        "build: upsert re-arming settled rows (history copy, render, re-arm, upsert)": lambda c: ledger.upsert_rows(
            c,
            [{**r, "send_after": Instant.from_stored("2026-09-10T09:30:00.000Z")} for r in settled],
            now,
            by_expiry=expiry_anchored,
            payload_of=sent_payload,
        ),
        "build: void rows": lambda c: ledger.void_rows(c, ids, "gone", now),
        "device removed: void its pending rows": lambda c: ledger.void_pending_of_device(
            c, sample[0]["device_id"], "gone", now
        ),
        "metrics: latest settled": lambda c: ledger.latest_settled(
            c, Instant.from_stored("2026-09-10T08:00:00.000Z"), now, 1000
        ),
        "metrics: queue gauges": lambda c: ledger.queue_gauges(c, now, now),
    }
    claimed_first = {"settle", "return to pending"}
    out: dict[str, list[str]] = {}
    for name, fn in work.items():
        statements = captured(db, fn, (lambda c: ledger.claim(c, ids, now, "bench")) if name in claimed_first else None)
        with db.engine.connect() as conn:
            trans = conn.begin()
            try:
                for n, (sql, params) in enumerate(statements):
                    if "notification_queue" not in sql:
                        continue
                    key = name if len(statements) == 1 else f"{name} #{n + 1}"
                    out[key] = [r[0] for r in conn.exec_driver_sql("EXPLAIN (COSTS OFF) " + sql, params)]
            finally:
                trans.rollback()
    return out


def hot_updates(n: int, fillfactor: int) -> dict[str, dict[str, int]]:
    """``n`` rows through the real upsert, claim and settle, and a title-only re-upsert: how many
    of each phase's updates PostgreSQL made HOT (no new index entries), at this fillfactor."""
    db, close = fresh("postgresql")
    out: dict[str, dict[str, int]] = {}
    try:
        with db.write() as conn:
            conn.execute(text(f"ALTER TABLE notification_queue SET (fillfactor = {int(fillfactor)})"))

        def counters() -> tuple[int, int]:
            with db.read() as conn:
                conn.execute(text("SELECT pg_stat_force_next_flush()"))
            with db.read() as conn:
                return conn.execute(
                    text(
                        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'notification_queue'"
                    )
                ).one()

        def phase(name: str, fn: Callable[[], Any]) -> None:
            before = counters()
            fn()
            after = counters()
            out[name] = {"updates": after[0] - before[0], "hot": after[1] - before[1]}

        rows = rows_for(n)
        t0 = "2026-09-10T00:00:00.000Z"
        with db.write() as conn:
            queue_rows(conn, rows, t0)
        with db.write() as conn:
            ids = ledger.due_ids(conn, "2026-09-10T23:00:00.000Z")
        settings = Settings(database_url="", enabled=True)
        phase(
            "claim and settle (drain)",
            lambda: send_batch(
                db, settings, ids, RecordingSender().factory(), now=Instant.from_stored("2026-09-10T23:00:00.000Z")
            ),
        )
        with db.write() as conn:
            queue_rows(conn, rows_for(n, lead=7200), t0)  # the same items, a second rule: pending rows

        def retitle() -> None:
            with db.write() as conn:
                queue_rows(conn, rows_for(n, lead=7200, title="Standup, renamed"), t0)

        phase("pending row re-titled (build upsert)", retitle)
    finally:
        close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--pending-every", type=int, default=8)
    ap.add_argument("--plans", action="store_true", help="EXPLAIN each ledger statement on the queue")
    ap.add_argument("--hot-rows", type=int, default=0, help="rows for the HOT-update count (0: skip)")
    args = ap.parse_args()
    db, close = fresh("postgresql")
    try:
        t = time.perf_counter()
        with db.write() as conn:
            conn.execute(text(FILL), {"rows": args.rows, "pending_every": args.pending_every})
        fill_seconds = time.perf_counter() - t
        raw = db.engine.raw_connection()  # VACUUM cannot run inside a transaction
        try:
            raw.driver_connection.autocommit = True
            raw.driver_connection.execute("VACUUM ANALYZE notification_queue")
        finally:
            raw.driver_connection.autocommit = False  # back to the pool: later transactions must roll back
            raw.close()
        with db.read() as conn:
            rows = conn.execute(text("SELECT count(*) FROM notification_queue")).scalar()
            heap = conn.execute(text("SELECT pg_relation_size('notification_queue')")).scalar()
            total = conn.execute(text("SELECT pg_total_relation_size('notification_queue')")).scalar()
            toast = conn.execute(
                text(
                    "SELECT coalesce(pg_total_relation_size(reltoastrelid), 0) FROM pg_class WHERE relname = 'notification_queue'"
                )
            ).scalar()
            indexes = dict(
                conn.execute(
                    text(
                        "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
                        "WHERE indrelid = 'notification_queue'::regclass ORDER BY 2 DESC"
                    )
                ).all()
            )
            columns = {}
            for c in notification_queue.c:
                columns[c.name] = float(
                    conn.execute(text(f'SELECT avg(pg_column_size("{c.name}")) FROM notification_queue')).scalar() or 0
                )
            fillfactor = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'notification_queue'")
            ).scalar()
        explained = plans(db) if args.plans else None
        print(
            json.dumps(
                {
                    "rows": rows,
                    "reloptions": fillfactor,
                    "pending_share": round(1 / args.pending_every, 3),
                    "fill_seconds": round(fill_seconds, 1),
                    "bytes_per_row": {
                        "table_with_indexes_and_toast": round(total / rows, 1),
                        "heap": round(heap / rows, 1),
                        "toast": round(toast / rows, 1),
                        **{f"index {name}": round(size / rows, 1) for name, size in indexes.items()},
                    },
                    "avg_column_bytes": {k: round(v, 1) for k, v in sorted(columns.items(), key=lambda kv: -kv[1])},
                    "avg_column_bytes_sum": round(sum(columns.values()), 1),
                    **({"plans": explained} if explained is not None else {}),
                    **(
                        {"hot_updates": {f"fillfactor {ff}": hot_updates(args.hot_rows, ff) for ff in (85, 100)}}
                        if args.hot_rows
                        else {}
                    ),
                },
                indent=2,
            )
        )
    finally:
        close()


if __name__ == "__main__":
    main()
