"""Scale figures for docs/scaling.md, on PostgreSQL:

- parallel chunk builds: devices/s with 1, 2 and 4 concurrent build processes (as the run queue
  runs chunk builds side by side), each process building its share of the 16 chunks;
- the peak quarter hour: a drain of ``--due`` rows (default 50,000) through the real sender to the
  mock APNs, against the 15-minute cadence.

    .venv/bin/python bench/bench_scale.py [--devices 20000] [--due 50000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_apns_raw import MockHandle  # noqa: E402
from bench_build import register, start_server  # noqa: E402
from bench_drain import full_drain  # noqa: E402
from bench_ledger import fresh  # noqa: E402
from sqlalchemy import text  # noqa: E402

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402
from reminders_pipeline.planning.build import build  # noqa: E402


def _worker(url: str, chunks: list[int], now: str, out: mp.Queue) -> None:
    db = Database(url)
    summary = build(db, Settings(database_url=url, source_allow_networks=LOOPBACK_NETWORKS), chunks=chunks, now=now)
    out.put(summary.devices_built)
    db.dispose()


def parallel_builds(url: str, workers: int, now: str) -> float:
    chunks = list(range(16))
    shares = [chunks[i::workers] for i in range(workers)]
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_worker, args=(url, share, now, out)) for share in shares]
    started = time.perf_counter()
    for p in procs:
        p.start()
    built = sum(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return built / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=20_000)
    ap.add_argument("--due", type=int, default=50_000)
    args = ap.parse_args()
    t0 = Instant.now().whole_seconds
    proc, base = start_server(250, 250, t0)
    results: dict = {"machine": "x86_64, 2 cores", "date": Instant.now().stored[:10], "devices": args.devices}
    try:
        rng = random.Random(11)
        urls = [f"{base}/j/{n}.json" for n in range(250)] + [f"{base}/c/{n}.ics" for n in range(250)]
        subs = {f"dev-{i}": rng.sample(urls, 3) for i in range(args.devices)}
        db, close = fresh("postgresql")
        try:
            register(db, Settings(database_url=db.url), subs)
            for workers in (1, 2, 4):
                with db.write() as conn:  # every run starts from an empty queue and never-built devices
                    conn.execute(text("DELETE FROM notification_queue"))
                    conn.execute(text("UPDATE devices SET reminders_built_at = NULL"))
                    conn.execute(text("UPDATE sources SET etag = NULL, feed_cache = NULL, cache_until = NULL"))
                results[f"build_devices_per_s_{workers}_processes"] = round(
                    parallel_builds(db.url, workers, Instant.from_unix(t0))
                )
            with db.read() as conn:
                results["queue_rows_after_build"] = conn.execute(
                    text("SELECT count(*) FROM notification_queue")
                ).scalar()
                results["queue_table_bytes"] = conn.execute(
                    text("SELECT pg_total_relation_size('notification_queue')")
                ).scalar()
        finally:
            close()
    finally:
        proc.kill()
    mock = MockHandle(in_process=False)
    try:
        drained = full_drain(mock, "postgresql", args.due, 200)
    finally:
        mock.close()
    results["peak_quarter_hour_drain"] = {
        "rows": args.due,
        **drained,
        "share_of_15_min_cadence": round(drained["seconds"] / 900, 3),
    }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
