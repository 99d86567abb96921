"""Where a queue row's bytes go on PostgreSQL: the table, its TOAST, each index, and each column.

Fills a fresh database (the current schema, all migrations) with ``--rows`` queue rows shaped like
the steady state the seed implies: one in ``--pending-every`` rows pending (the next day's
reminders), the rest settled ``sent`` with the payload the drain stores (a week of retention), ids
and texts as the build writes them. Then ``VACUUM ANALYZE`` and measures ``pg_relation_size`` per
relation and ``avg(pg_column_size(...))`` per column. A measurement only: nothing is changed.

    .venv/bin/python bench/bench_row_cost.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ledger import fresh  # noqa: E402
from sqlalchemy import text  # noqa: E402

from reminders_pipeline.schema import notification_queue  # noqa: E402

# Rows made in SQL from generate_series: one statement instead of a million round trips. The texts
# have the lengths the build writes: "<source id>:<item id>" item ids, ISO-8601 times, a payload
# as `drain._stored_payload` serialises it.
FILL = """
INSERT INTO notification_queue (device_id, source_id, item_id, rule, send_after, event_at, expires_at, title, body,
    status, outcome, payload, apns_id, claimed_by, claimed_at, settled_at, sent_at, created_at, updated_at, attempts)
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
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE
      '{"payload":{"aps":{"alert":{"title":"Weekly planning with the product team","body":"In 60 minutes"},'
      || '"sound":"default","interruption-level":"time-sensitive","thread-id":"reminders"},"item":"event-' || g::text
      || '"},"collapse_id":"' || md5(g::text) || '","expiration"\\:1789032600}' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE upper(md5(g::text || 'apns')) END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE 'b9a7c0d2-7c43-4f0a-9d0e-3c7f1f0a2b11:batch_003' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE '2026-09-10T08:30:01.250Z' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE '2026-09-10T08:30:01.480Z' END,
    CASE WHEN g % :pending_every = 0 THEN NULL ELSE '2026-09-10T08:30:01.460Z' END,
    '2026-09-09T08:30:00.000Z', '2026-09-10T08:30:01.480Z', 0
FROM generate_series(1, :rows) AS g
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--pending-every", type=int, default=8)
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
            raw.close()
        with db.read() as conn:
            rows = conn.execute(text("SELECT count(*) FROM notification_queue")).scalar()
            heap = conn.execute(text("SELECT pg_relation_size('notification_queue')")).scalar()
            total = conn.execute(text("SELECT pg_total_relation_size('notification_queue')")).scalar()
            toast = conn.execute(text(
                "SELECT coalesce(pg_total_relation_size(reltoastrelid), 0) FROM pg_class WHERE relname = 'notification_queue'"
            )).scalar()
            indexes = dict(conn.execute(text(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) FROM pg_index "
                "WHERE indrelid = 'notification_queue'::regclass ORDER BY 2 DESC"
            )).all())
            columns = {}
            for c in notification_queue.c:
                columns[c.name] = float(conn.execute(text(f'SELECT avg(pg_column_size("{c.name}")) FROM notification_queue')).scalar() or 0)
        print(json.dumps({
            "rows": rows, "pending_share": round(1 / args.pending_every, 3), "fill_seconds": round(fill_seconds, 1),
            "bytes_per_row": {
                "table_with_indexes_and_toast": round(total / rows, 1),
                "heap": round(heap / rows, 1),
                "toast": round(toast / rows, 1),
                **{f"index {name}": round(size / rows, 1) for name, size in indexes.items()},
            },
            "avg_column_bytes": {k: round(v, 1) for k, v in sorted(columns.items(), key=lambda kv: -kv[1])},
            "avg_column_bytes_sum": round(sum(columns.values()), 1),
        }, indent=2))
    finally:
        close()


if __name__ == "__main__":
    main()
