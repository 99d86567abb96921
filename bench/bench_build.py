"""Build throughput: devices/s and source reads/s, against a naive per-device reader, same run.

Shared case: 10,000 devices subscribing to 3 sources each, drawn from 500 shared sources (half
JSON, half iCalendar) served locally by ``bench/feed_server.py`` in another process. Own-source
case: 2,000 devices with one source each. Baseline: the naive build every peer starts with, each
device reading its own sources one by one (measured on a sample and reported per device).

Usage: ``.venv/bin/python bench/bench_build.py [--devices 10000] [--backend sqlite|postgresql|both]``
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_ledger import fresh  # noqa: E402

from reminders_pipeline import ledger  # noqa: E402
from reminders_pipeline.build import build  # noqa: E402
from reminders_pipeline.devices import chunk_of  # noqa: E402
from reminders_pipeline.settings import LOOPBACK_NETWORKS, Settings  # noqa: E402
from reminders_pipeline.times import iso_from_unix, now_utc, unix_from_iso  # noqa: E402

TOKEN = "ab" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(json_count: int, ics_count: int, t0: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "feed_server.py"), str(port), str(json_count), str(ics_count), str(t0)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout and proc.stdout.readline().strip() == b"ready"
    return proc, f"http://127.0.0.1:{port}"


def register(db, settings: Settings, subscriptions: dict[str, list[str]]) -> None:
    """Bulk registration through the ledger (put_device per device would measure registration, not build)."""
    now = now_utc()
    urls = sorted({u for us in subscriptions.values() for u in us})
    with db.write() as conn:
        for i in range(0, len(subscriptions), 2000):
            part = list(subscriptions)[i : i + 2000]
            for d in part:
                ledger.upsert_device(conn, {"id": d, "apns_token": TOKEN, "reminder_lead_seconds": 3600, "extra_rules": "", "chunk": chunk_of(d, 16)}, now)
        from reminders_pipeline.ledger import _insert  # noqa: PLC0415
        from reminders_pipeline.schema import device_sources, sources

        conn.execute(_insert(conn)(sources).on_conflict_do_nothing(), [{"url": u, "created_at": now} for u in urls])
        ids = dict(conn.execute(sources.select().with_only_columns(sources.c.url, sources.c.id)).all())
        conn.execute(device_sources.insert(), [{"device_id": d, "source_id": ids[u]} for d, us in subscriptions.items() for u in us])


def naive(subscriptions: dict[str, list[str]], sample: int) -> float:
    """Devices/s of the naive reader: each device fetches its own sources one after another."""
    devices = list(subscriptions)[:sample]
    t = time.perf_counter()
    with httpx.Client(timeout=10) as client:
        for d in devices:
            for url in subscriptions[d]:
                client.get(url).raise_for_status()
    return len(devices) / (time.perf_counter() - t)


def run_case(kind: str, subscriptions: dict[str, list[str]], t0: int) -> dict:
    db, close = fresh(kind)
    try:
        settings = Settings(database_url=db.url, source_allow_networks=LOOPBACK_NETWORKS)
        register(db, settings, subscriptions)
        now = iso_from_unix(t0)
        t = time.perf_counter()
        first = build(db, settings, now=now)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        second = build(db, settings, now=iso_from_unix(t0 + 900))  # the next tick: 304s, unchanged rows
        warm = time.perf_counter() - t
        n = len(subscriptions)
        return {
            "devices": n,
            "sources": first.sources_read,
            "rows_inserted": first.rows_inserted,
            "items_rejected": dict(first.items_rejected),
            "sources_failed": len(first.sources_failed),
            "first_build_devices_per_s": round(n / cold),
            "first_build_reads_per_s": round(first.sources_read / cold),
            "next_tick_devices_per_s": round(n / warm),
            "next_tick_not_modified": second.sources_not_modified,
            "next_tick_rows_written": second.rows_inserted + second.rows_updated,
        }
    finally:
        close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--own", type=int, default=2_000)
    ap.add_argument("--backend", choices=["sqlite", "postgresql", "both"], default="both")
    ap.add_argument("--naive-sample", type=int, default=300)
    args = ap.parse_args()
    t0 = int(unix_from_iso(now_utc()))
    proc, base = start_server(250 + args.own, 250, t0)
    try:
        rng = random.Random(7)
        shared_urls = [f"{base}/j/{n}.json" for n in range(250)] + [f"{base}/c/{n}.ics" for n in range(250)]
        shared = {f"dev-{i}": rng.sample(shared_urls, 3) for i in range(args.devices)}
        own = {f"own-{i}": [f"{base}/j/{250 + i}.json"] for i in range(args.own)}
        results: dict = {"machine": "x86_64, 2 cores", "date": now_utc()[:10]}
        results["naive_shared_devices_per_s"] = round(naive(shared, args.naive_sample))
        results["naive_own_devices_per_s"] = round(naive(own, args.naive_sample))
        backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
        for kind in backends:
            results[kind] = {"shared": run_case(kind, shared, t0), "own_sources": run_case(kind, own, t0)}
        print(json.dumps(results, indent=2))
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
