"""How late the exact-time dispatcher sends, against the mock APNs, on SQLite and PostgreSQL.

    .venv/bin/python bench/bench_timeliness.py [--spread-rows 2000] [--spread-seconds 300] [--burst-rows 20000] [--idle-seconds 60]

- spread: rows whose send_after fall at random over the next ``--spread-seconds``; the dispatcher
  (real clock, real APNs client, the mock in its own process) sends them. Lateness = sent_at −
  send_after (APNs' answer, per row); "early" counts rows claimed or sent before their send_after.
  Beside it, the cron drain's lateness for the same send_afters when it runs only at its ticks
  (:05/:20/:35/:50, no scheduler slack): the baseline the dispatcher replaces.
- burst: ``--burst-rows`` rows sharing one send_after a few seconds ahead; when the last one is
  sent, beside the bound ``1 s + rows / (the full drain's rate measured in the same run)``.
- idle: the dispatcher's own CPU time (its thread) over ``--idle-seconds`` with nothing to send.
- sweep: the exact-time path while builds write. 2,000 devices on 20 shared JSON sources (two
  rules, three days ahead: about 96,000 rows); a loop of builds, each after every item moved by a
  minute, so each sweep rewrites every row; beside it ``reminders dispatch`` (its own process) sends
  ``--sweep-rows`` ``lead:0`` reminders of another device due over ``--sweep-seconds``. Bar: their
  lateness p99 <= 1 s and max <= 3 s, on each database (one after the other: each has the machine).
The first three run both databases side by side (threads), so the machine's drift hits both alike.
``--cases`` picks some of idle, spread, burst, sweep (default all); ``--databases`` some of sqlite,
postgresql (default both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_apns_raw import MockHandle  # noqa: E402
from bench_build import register, start_server  # noqa: E402
from bench_ledger import fresh, subscribe_every_device  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings, env_name  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402
from reminders_pipeline.ledger.schema import devices, notification_queue  # noqa: E402
from reminders_pipeline.planning.build import build, queue_rows  # noqa: E402
from reminders_pipeline.providers.apns import apns_sender_factory  # noqa: E402
from reminders_pipeline.providers.routing import default_sender_factory  # noqa: E402
from reminders_pipeline.sending.dispatch import Dispatcher  # noqa: E402
from reminders_pipeline.sending.drain import drain  # noqa: E402

DRAIN_TICKS = (5, 20, 35, 50)  # minutes past the hour: the default REMINDERS_DRAIN_CRON
ROOT = Path(__file__).resolve().parent.parent
SWEEP_DEVICES, SWEEP_SOURCES = 2000, 20
SWEEP_P99_BAR, SWEEP_MAX_BAR = 1.0, 3.0


def load(db: Database, send_afters: list[float], devices_n: int = 500) -> None:
    now = Instant.from_unix(time.time())
    rows = [
        {
            "device_id": f"dev-{i % devices_n}", "source_id": 1, "item_id": f"1:item-{i}", "rule": "lead:600",
            "send_after": Instant.from_unix(sa), "event_at": Instant.from_unix(sa + 600), "expires_at": Instant.from_unix(sa + 2400),
            "title": f"Event {i}", "body": None,
        }
        for i, sa in enumerate(send_afters)
    ]  # fmt: skip
    with db.write() as conn:
        conn.execute(devices.delete())
        conn.execute(notification_queue.delete())
        conn.execute(
            devices.insert(),
            [
                {"id": f"dev-{d}", "target": f"{d + 1:064x}", "chunk": 0, "created_at": now, "updated_at": now}
                for d in range(devices_n)
            ],
        )
        for i in range(0, len(rows), 2000):
            queue_rows(conn, rows[i : i + 2000], now)
        subscribe_every_device(conn, now)


def queue(db: Database) -> list[dict[str, Any]]:
    with db.read() as conn:
        return [dict(r) for r in conn.execute(notification_queue.select()).mappings()]


def percentiles(values: list[float]) -> dict[str, float | None]:
    v = sorted(values)
    if not v:
        return {"p50": None, "p99": None, "max": None}
    return {
        "p50": round(v[len(v) // 2], 3),
        "p99": round(v[min(len(v) - 1, int(0.99 * len(v)))], 3),
        "max": round(v[-1], 3),
    }


class Running:
    """A dispatcher on the real clock in a thread of its own; reports its thread's CPU time."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db, self.settings = db, settings
        self.cpu_seconds = 0.0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        async def go() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            cpu = time.thread_time()
            await Dispatcher(self.db, self.settings, apns_sender_factory(self.settings)).run(stop=self._stop)
            self.cpu_seconds = time.thread_time() - cpu

        asyncio.run(go())

    def __enter__(self) -> Running:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(120)


def settled(db: Database, n: int) -> bool:
    with db.read() as conn:
        return conn.scalar(select(func.count()).where(notification_queue.c.outcome == "sent")) >= n


def wait_settled(db: Database, n: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while not settled(db, n):
        if time.time() > deadline:
            raise SystemExit(f"only part of {n} rows sent after {timeout}s")
        time.sleep(0.5)


def lateness_of(rows: list[dict[str, Any]]) -> tuple[list[float], int]:
    late = [r["sent_at"].unix - r["send_after"].unix for r in rows if r["outcome"] == "sent"]
    early = sum(
        1 for r in rows if r["claimed_at"] < r["send_after"] or (r["sent_at"] and r["sent_at"] < r["send_after"])
    )
    return late, early


def cron_lateness(send_afters: list[float]) -> list[float]:
    """When a cron-only drain (no scheduler slack) would send each row: at the first tick after it."""
    out = []
    for sa in send_afters:
        hour = sa - sa % 3600
        tick = min(t for t in (hour + m * 60 + k * 3600 for k in (0, 1) for m in DRAIN_TICKS) if t >= sa)
        out.append(tick - sa)
    return out


def spread(dbs: dict[str, Database], settings: dict[str, Settings], n: int, seconds: float) -> dict[str, Any]:
    start = time.time() + 5
    send_afters = [start + random.uniform(0, seconds) for _ in range(n)]
    out: dict[str, Any] = {}
    for db in dbs.values():
        load(db, send_afters)
    runners = {kind: Running(db, settings[kind]) for kind, db in dbs.items()}
    for r in runners.values():
        r.__enter__()
    try:
        for db in dbs.values():
            wait_settled(db, n, seconds + 120)
    finally:
        for r in runners.values():
            r.__exit__()
    for kind, db in dbs.items():
        late, early = lateness_of(queue(db))
        out[kind] = {"rows": n, "sent": len(late), "early": early, "lateness_seconds": percentiles(late)}
    out["cron_ticks_only"] = {"lateness_seconds": percentiles(cron_lateness(send_afters))}
    return out


def full_drain_rate(db: Database, settings: Settings, n: int) -> float:
    now = time.time()
    load(db, [now - 5 - i % 30 for i in range(n)])
    t = time.perf_counter()
    summary = drain(db, settings, default_sender_factory(settings))
    elapsed = time.perf_counter() - t
    assert summary.outcomes == {"sent": n}, summary.as_dict()
    return n / elapsed


def burst(db: Database, settings: Settings, n: int) -> dict[str, Any]:
    rate = full_drain_rate(db, settings, n)
    at = time.time() + 8
    load(db, [at] * n)
    with Running(db, settings):
        wait_settled(db, n, 300)
    late, early = lateness_of(queue(db))
    bound = 1 + n / rate
    return {"rows": n, "early": early, "last_sent_after_seconds": round(max(late), 3), "first_sent_after_seconds": round(min(late), 3),
            "full_drain_sends_per_s": round(rate, 1), "bound_seconds": round(bound, 3), "within_bound": max(late) <= bound}  # fmt: skip


def bursts(db: Database, settings: Settings, n: int, runs: int) -> dict[str, Any]:
    """``runs`` bursts in a row; the bar is met only if every one is within its bound."""
    each = [burst(db, settings, n) for _ in range(runs)]
    return {"runs": each, "met": all(r["within_bound"] and r["early"] == 0 for r in each)}


def idle(dbs: dict[str, Database], settings: dict[str, Settings], seconds: float) -> dict[str, Any]:
    for db in dbs.values():
        load(db, [])
    runners = {kind: Running(db, settings[kind]) for kind, db in dbs.items()}
    for r in runners.values():
        r.__enter__()
    time.sleep(seconds)
    for r in runners.values():
        r.__exit__()
    return {
        kind: {
            "seconds": seconds,
            "cpu_seconds": round(r.cpu_seconds, 3),
            "share_of_one_core": round(r.cpu_seconds / seconds, 4),
        }
        for kind, r in runners.items()
    }


def dispatcher_env(settings: Settings) -> dict[str, str]:
    """The parent's environment without its REMINDERS_ settings, plus what a dispatcher needs of these."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMINDERS_")}
    for name in ("database_url", "apns_key_file", "apns_key_id", "apns_team_id", "apns_topic", "apns_url",
                 "apns_ca_file", "apns_concurrency", "dispatch_poll_seconds"):  # fmt: skip
        env[env_name(name)] = str(getattr(settings, name))
    env[env_name("enabled")] = "true"
    return env


def start_dispatchers(settings: Settings, n: int = 1) -> list[subprocess.Popen[str]]:
    """``reminders dispatch`` processes, each printing its JSON summary when terminated."""
    env = dispatcher_env(settings)
    return [
        subprocess.Popen(
            [sys.executable, "-m", "reminders_pipeline.cli", "dispatch"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        for _ in range(n)
    ]


def stop_dispatchers(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    for p in procs:
        p.terminate()
    return [json.loads(p.communicate(timeout=120)[0] or "{}") for p in procs]


def _watched_rows(db: Database, start: float, n: int, seconds: float) -> None:
    """``n`` lead:0 reminders of a device no sweep builds, due over ``seconds`` from ``start``."""
    now = Instant.now()
    with db.write() as conn:
        conn.execute(devices.insert().values(id="watched", target="cd" * 32, chunk=0, created_at=now, updated_at=now))
        queue_rows(conn, [
            {"device_id": "watched", "source_id": None, "item_id": f"0:w{k}", "rule": "lead:0",
             "send_after": Instant.from_unix(start + k * seconds / n), "event_at": Instant.from_unix(start + k * seconds / n),
             "expires_at": Instant.from_unix(start + k * seconds / n + 1800), "title": f"Watched {k}", "body": None}
            for k in range(n)
        ], now)  # fmt: skip


class SweepLoop:
    """Builds the swept devices again and again, every item moved by a minute before each build."""

    def __init__(self, db: Database, settings: Settings, base: str, device_ids: list[str]) -> None:
        self.db, self.settings, self.base, self.device_ids = db, settings, base, device_ids
        self.sweeps: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        while not self._stop.is_set():
            httpx.get(f"{self.base}/_mode?change=1").raise_for_status()
            t = time.perf_counter()
            summary = build(self.db, self.settings, device_ids=self.device_ids)
            self.sweeps.append({"seconds": time.perf_counter() - t, "rows_updated": summary.rows_updated})

    def __enter__(self) -> SweepLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(300)


def sweep(kind: str, mock: MockHandle, n: int, seconds: float) -> dict[str, Any]:
    db, close = fresh(kind)
    t0 = int(time.time())
    server, base = start_server(SWEEP_SOURCES, 0, t0)
    try:
        settings = mock.settings(200).with_(
            database_url=db.url, enabled=True, dispatch_poll_seconds=2.0,
            source_allow_networks=LOOPBACK_NETWORKS, horizon_seconds=3 * 86400,
        )  # fmt: skip
        swept = [f"swept-{i}" for i in range(SWEEP_DEVICES)]
        register(db, settings, {d: [f"{base}/j/{i % SWEEP_SOURCES}.json"] for i, d in enumerate(swept)})
        with db.write() as conn:
            conn.execute(devices.update().values(extra_rules="lead:1800"))
        first = build(db, settings, device_ids=swept)
        start = time.time() + 15
        _watched_rows(db, start, n, seconds)
        procs = start_dispatchers(settings)
        try:
            with SweepLoop(db, settings, base, swept) as loop:
                deadline = start + seconds + 60
                while time.time() < deadline and not settled_of(db, "watched", n):
                    time.sleep(0.5)
        finally:
            stop_dispatchers(procs)
        rows = [r for r in queue(db) if r["device_id"] == "watched"]
    finally:
        server.kill()
        close()
    late, early = lateness_of(rows)
    during = [s for s in loop.sweeps]
    pct = percentiles(late)
    return {
        "rows_first_build": first.rows_inserted,
        "sweeps": len(during),
        "sweep_seconds_median": round(sorted(s["seconds"] for s in during)[len(during) // 2], 2) if during else None,
        "rows_rewritten_per_sweep_median": sorted(s["rows_updated"] for s in during)[len(during) // 2] if during else None,
        "watched": n, "sent": len(late), "early": early, "lateness_seconds": pct,
        "later_than_1s": sum(1 for x in late if x > 1.0),
        "bar": f"p99 <= {SWEEP_P99_BAR} s, max <= {SWEEP_MAX_BAR} s, all sent",
        "met": len(late) == n and early == 0 and pct["p99"] is not None
        and pct["p99"] <= SWEEP_P99_BAR and pct["max"] <= SWEEP_MAX_BAR,
    }  # fmt: skip


def settled_of(db: Database, device_id: str | None, n: int) -> bool:
    """At least ``n`` rows (of ``device_id``, or of any device) are settled."""
    q = notification_queue
    done = select(func.count()).where(q.c.status == "settled")
    if device_id is not None:
        done = done.where(q.c.device_id == device_id)
    with db.read() as conn:
        return conn.scalar(done) >= n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spread-rows", type=int, default=2000)
    parser.add_argument("--spread-seconds", type=float, default=300)
    parser.add_argument("--burst-rows", type=int, default=20000)
    parser.add_argument("--burst-runs", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--sweep-rows", type=int, default=150)
    parser.add_argument("--sweep-seconds", type=float, default=90)
    parser.add_argument("--cases", default="idle,spread,burst,sweep")
    parser.add_argument("--databases", default="sqlite,postgresql")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    mock = MockHandle(in_process=False)
    made = {kind: fresh(kind) for kind in args.databases.split(",")}
    dbs = {kind: db for kind, (db, _) in made.items()}
    settings = {
        kind: mock.settings(200).with_(database_url=db.url, enabled=True, dispatch_poll_seconds=2.0)
        for kind, db in dbs.items()
    }
    result: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(), "poll_seconds": 2.0}
    try:
        if "idle" in cases:
            result["idle"] = idle(dbs, settings, args.idle_seconds)
        if "spread" in cases:
            result["spread"] = spread(dbs, settings, args.spread_rows, args.spread_seconds)
        if "burst" in cases:
            result["burst"] = {
                kind: bursts(db, settings[kind], args.burst_rows, args.burst_runs) for kind, db in dbs.items()
            }
        if "sweep" in cases:
            result["sweep"] = {kind: sweep(kind, mock, args.sweep_rows, args.sweep_seconds) for kind in dbs}
    finally:
        for _, close in made.values():
            close()
        mock.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
