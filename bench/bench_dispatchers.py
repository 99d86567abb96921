"""Do several dispatchers share one burst? ``reminders dispatch`` processes against one database.

    .venv/bin/python bench/bench_dispatchers.py [--rows 5000] [--latency 0.04] [--concurrency 10] [--rounds 1]

Latency-bound on purpose, so that two cores can show what a second dispatcher adds: the mock APNs
(its own process) answers each request ``--latency`` seconds late, and each dispatcher keeps
``REMINDERS_APNS_CONCURRENCY=--concurrency`` sends in flight, so one dispatcher can make at most
concurrency / latency sends a second. ``--rows`` rows share one ``send_after`` a few seconds ahead;
one dispatcher, then two, are already running when it comes. Sends/s = rows / (last ``sent_at`` −
``send_after``). Every row must be sent exactly once: all settled ``sent`` and the mock answered
exactly ``--rows`` requests. Bar: two dispatchers ≥ 1.7× one, on each database.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_apns_raw import MockHandle  # noqa: E402
from bench_ledger import fresh  # noqa: E402
from bench_timeliness import load, queue, settled_of, start_dispatchers, stop_dispatchers  # noqa: E402

from reminders_pipeline.config.settings import Settings  # noqa: E402
from reminders_pipeline.ledger.db import Database  # noqa: E402

BAR = 1.7
LEAD_SECONDS = 6.0  # the burst's send_after, this far after the dispatchers start


def one_burst(db: Database, settings: Settings, mock: MockHandle, n: int, dispatchers: int) -> dict[str, Any]:
    at = time.time() + LEAD_SECONDS
    load(db, [at] * n)
    mock.reset()
    procs = start_dispatchers(settings.with_(enabled=True, dispatch_poll_seconds=2.0), dispatchers)
    try:
        deadline = at + 60 + n / 10
        while time.time() < deadline and not settled_of(db, None, n):
            time.sleep(0.5)
    finally:
        summaries = stop_dispatchers(procs)
    rows = queue(db)
    outcomes = Counter(str(r["outcome"]) for r in rows)
    sent = [r["sent_at"].unix for r in rows if r["outcome"] == "sent"]
    requests = mock.stats()["requests"]
    last = max(sent) - at if sent else None
    return {
        "dispatchers": dispatchers,
        "rows": n,
        "outcomes": dict(outcomes),
        "apns_requests": requests,
        "exactly_once": outcomes == Counter({"sent": n}) and requests == n,
        "sent_per_dispatcher": [s.get("outcomes", {}).get("sent", 0) for s in summaries],
        "last_sent_after_seconds": round(last, 3) if last is not None else None,
        "sends_per_s": round(n / last, 1) if last else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--latency", type=float, default=0.04)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    mock = MockHandle(in_process=False)
    mock.delay(args.latency)
    result: dict[str, Any] = {"cpus": os.cpu_count(), "latency_s": args.latency, "concurrency": args.concurrency,
                              "ceiling_one_dispatcher_per_s": round(args.concurrency / args.latency, 1)}  # fmt: skip
    try:
        for kind in ("sqlite", "postgresql"):
            db, close = fresh(kind)
            settings = mock.settings(args.concurrency).with_(database_url=db.url)
            try:
                rounds = [{k: one_burst(db, settings, mock, args.rows, k) for k in (1, 2)} for _ in range(args.rounds)]
            finally:
                close()
            ratios = sorted((r[2]["sends_per_s"] or 0) / r[1]["sends_per_s"] for r in rounds if r[1]["sends_per_s"])
            median = ratios[len(ratios) // 2] if ratios else None
            exact = all(r[k]["exactly_once"] for r in rounds for k in (1, 2))
            result[kind] = {
                "rounds": rounds,
                "two_over_one": [round(x, 2) for x in ratios],
                "bar": f">= {BAR}x, every row exactly once",
                "met": bool(median and median >= BAR and exact),
            }
    finally:
        mock.close()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
