"""A ``/metrics`` scrape against a queue of a million rows, on SQLite and PostgreSQL.

The queue is seeded the way a busy ledger looks (all times relative to the scrape's ``now``):

- settled history spread over the 7-day retention before the window (sent, voided, failed, ...),
- ``--window-rows`` rows settled over the last 900 s, 95 % sent with a lateness of 0-900 s: the
  sends a scrape must count and bucket. Scrapes are timed with ``REMINDERS_METRICS_WINDOW_SECONDS``
  at 60 s and at 900 s (a fifteenth of those rows, and all of them, of which a scrape reads the latest 2,000),
- pending rows over the next 24 hours, a due backlog of 500 rows, 100 claims in flight,
- 25,000 devices and two dispatcher heartbeats.

PostgreSQL's table is vacuumed and analysed after loading (autovacuum's steady state; straight
after a bulk load the first scrapes race autovacuum). Each scrape (``Metrics.render()``: every
query of the ledger collector plus the exposition) is timed beside three raw-DBAPI baselines
measured in the same run on the same database: ``SELECT 1`` (the round-trip floor), the window's
settled count alone (an index-only range count: the least any windowed read can cost), and the
whole-table ``GROUP BY status, outcome`` a scrape ran before. Usage:

    .venv/bin/python bench/bench_metrics.py [--rows 1000000] [--window-rows 50000] [--scrapes 30] [--only sqlite|postgresql]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_ledger import fresh  # noqa: E402  one way to make a throwaway ledger for every benchmark

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.http.metrics import Metrics
from reminders_pipeline.ledger.db import Database

T0 = 1_789_000_000  # the scrape's now
NOW = Instant.from_unix(T0)
WINDOW = 900
DEVICES = 25_000
DUE, CLAIMED = 500, 100
COLUMNS = (
    "device_id",
    "source_id",
    "item_id",
    "rule",
    "send_after",
    "event_at",
    "expires_at",
    "title",
    "body",
    "status",
    "outcome",
    "outcome_detail",
    "payload",
    "apns_id",
    "claimed_by",
    "claimed_at",
    "settled_at",
    "sent_at",
    "created_at",
    "updated_at",
)
HISTORY_OUTCOMES = (
    [("sent", None)] * 85
    + [("voided", "left_feed")] * 10
    + [("failed", "BadDeviceToken")] * 3
    + [
        ("too_late", None),
        ("event_started", None),
    ]
)


def _row(
    i: int, status: str, send_after: int, outcome=None, detail=None, settled=None, sent=None, claimed=None
) -> tuple:
    def iso(seconds: int) -> str:
        return Instant.from_unix(seconds).stored

    return (
        f"d{i % DEVICES}",
        1,
        f"1:item-{i}",
        "lead:3600",
        iso(send_after),
        iso(send_after + 3600),
        iso(send_after + 5400),
        "Standup",
        None,
        status,
        outcome,
        detail,
        None,
        None,
        "bench" if claimed else None,
        iso(claimed) if claimed else None,
        iso(settled) if settled else None,
        iso(sent) if sent else None,
        iso(send_after - 86400),
        iso(settled or claimed or send_after - 86400),
    )


def rows(total: int, window_rows: int, seed: int = 12) -> Iterator[tuple]:
    """The seeded queue, generated lazily (a million tuples at once would not fit comfortably)."""
    rnd = random.Random(seed)
    pending = total // 8
    history = total - window_rows - pending - DUE - CLAIMED
    i = 0
    for _ in range(history):
        settled = T0 - WINDOW - 1 - rnd.randrange(7 * 86400 - WINDOW)
        outcome, detail = rnd.choice(HISTORY_OUTCOMES)
        late = rnd.randrange(900)
        yield _row(i, "settled", settled - late, outcome, detail, settled, settled if outcome == "sent" else None)
        i += 1
    for _ in range(window_rows):
        settled = T0 - rnd.randrange(WINDOW)
        outcome, detail = ("sent", None) if rnd.random() < 0.95 else ("failed", "Unregistered")
        late = rnd.randrange(900)
        yield _row(i, "settled", settled - late, outcome, detail, settled, settled if outcome == "sent" else None)
        i += 1
    for _ in range(pending):
        yield _row(i, "pending", T0 + 1 + rnd.randrange(86400))
        i += 1
    for _ in range(DUE):
        yield _row(i, "pending", T0 - rnd.randrange(600))
        i += 1
    for _ in range(CLAIMED):
        yield _row(i, "claimed", T0 - 30, claimed=T0 - 5)
        i += 1


def chunks(it: Iterator[tuple], size: int = 50_000) -> Iterator[list[tuple]]:
    batch: list[tuple] = []
    for r in it:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def seed(db: Database, total: int, window_rows: int) -> None:
    devices = [
        (f"d{i}", "ab" * 32, i % 16, Instant.from_unix(T0 - 600 - i % 600).stored, Instant.from_unix(T0 - 86400).stored)
        for i in range(DEVICES)
    ]
    beats = [
        ("disp-a", Instant.from_unix(T0 - 3600).stored, Instant.from_unix(T0 - 3).stored),
        ("disp-b", Instant.from_unix(T0 - 3600).stored, Instant.from_unix(T0 - 4).stored),
    ]
    raw = db.engine.raw_connection()
    try:
        cur = raw.cursor()
        if db.dialect == "postgresql":
            with cur.copy(f"COPY notification_queue ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                for r in rows(total, window_rows):
                    copy.write_row(r)
            marks = "%s"
        else:
            cur.execute("BEGIN")
            insert = f"INSERT INTO notification_queue ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
            for batch in chunks(rows(total, window_rows)):
                cur.executemany(insert, batch)
            marks = "?"
        cur.executemany(
            "INSERT INTO devices (id, target, chunk, reminders_built_at, created_at, updated_at) "
            f"VALUES ({marks}, {marks}, {marks}, {marks}, {marks}, {marks})",
            [(d, t, c, b, a, a) for d, t, c, b, a in devices],
        )
        cur.executemany(
            f"INSERT INTO dispatchers (name, started_at, beat_at) VALUES ({marks}, {marks}, {marks})", beats
        )
        if db.dialect != "postgresql":
            cur.execute("COMMIT")
        else:
            raw.commit()
        if db.dialect == "postgresql":
            raw.driver_connection.autocommit = True
            raw.driver_connection.execute("VACUUM ANALYZE")
            raw.driver_connection.autocommit = False
        else:
            cur.execute("ANALYZE")
    finally:
        raw.close()


def timed(fn: Callable[[], object], n: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    ms = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - started) * 1000)
    ms.sort()
    return {
        "median_ms": round(statistics.median(ms), 2),
        "p95_ms": round(ms[int(0.95 * (len(ms) - 1))], 2),
        "max_ms": round(ms[-1], 2),
    }


def raw_query(db: Database, sql: str, params: tuple = ()) -> Callable[[], object]:
    """A DBAPI query on one held connection: no SQLAlchemy, no pool, no exposition."""
    raw = db.engine.raw_connection()
    sql = sql.replace("?", "%s") if db.dialect == "postgresql" else sql

    def run() -> object:
        cur = raw.cursor()
        cur.execute(sql, params)
        out = cur.fetchall()
        cur.close()
        if db.dialect == "postgresql":
            raw.commit()
        return out

    return run


def bench(kind: str, total: int, window_rows: int, scrapes: int) -> dict:
    db, drop = fresh(kind)
    try:
        started = time.perf_counter()
        seed(db, total, window_rows)
        seeded = time.perf_counter() - started
        out: dict = {"rows": total, "rows_settled_last_900s": window_rows, "seed_seconds": round(seeded, 1)}
        out["raw_select_1"] = timed(raw_query(db, "SELECT 1"), scrapes)
        for window in (60, WINDOW):  # 60 s: REMINDERS_METRICS_WINDOW_SECONDS' least
            metrics = Metrics(db, Settings(database_url=db.url, metrics_window_seconds=window), clock=lambda: NOW)
            body = metrics.render().decode()
            assert 'reminders_window_settled_rows{detail="",outcome="sent"}' in body, body[:2000]
            since = Instant.from_unix(T0 - window)
            out[f"window_{window}s"] = {
                "scrape": timed(metrics.render, scrapes),
                "raw_window_count": timed(
                    raw_query(
                        db,
                        "SELECT count(*) FROM notification_queue WHERE status = 'settled' AND settled_at > ? AND settled_at <= ?",
                        (since.stored, NOW.stored),
                    ),
                    scrapes,
                ),
            }
        out["raw_whole_table_group_by"] = timed(
            raw_query(db, "SELECT status, outcome, count(*) FROM notification_queue GROUP BY status, outcome"),
            max(5, scrapes // 5),
        )
        return out
    finally:
        drop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--window-rows", type=int, default=50_000)
    ap.add_argument("--scrapes", type=int, default=30)
    ap.add_argument("--only", choices=["sqlite", "postgresql"])
    args = ap.parse_args()
    kinds = [args.only] if args.only else ["sqlite", "postgresql"]
    print(json.dumps({k: bench(k, args.rows, args.window_rows, args.scrapes) for k in kinds}, indent=2))


if __name__ == "__main__":
    main()
