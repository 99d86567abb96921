"""A feed changed in one item: the build that re-plans only that item against one that plans the
whole feed again, in the same run on the same data.

300 devices share one JSON source of 300 items, one every 15 minutes (96 within the 24 h
horizon). After the first build one item is retitled, and the next build is timed: once as the
build runs (``devices_items_replanned``) and once, on a fresh database, with the item re-plan
turned off, so every device plans in full. Bound: the item re-plan takes at most half the full
plan's time. Usage: ``.venv/bin/python bench/bench_replan.py [--backend sqlite|postgresql|both]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from bench_build import register  # noqa: E402
from bench_ledger import fresh  # noqa: E402

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings  # noqa: E402
from reminders_pipeline.domain.times import Instant  # noqa: E402
from reminders_pipeline.planning import build as build_mod  # noqa: E402

T0 = 1_789_000_000
DEVICES = 300
ITEMS = 300
BOUND = 0.5  # the item re-plan's seconds over the full plan's


def feed(edited: bool) -> bytes:
    items = [
        {
            "id": f"e{k}",
            "title": f"Edited {k}" if edited and k == 40 else f"Event {k}",
            "startsAt": T0 + 1800 + k * 900,
            "expiresAt": T0 + 3600 + k * 900,
        }
        for k in range(ITEMS)
    ]
    return json.dumps({"items": items}).encode()


class Source:
    """One JSON feed over HTTP, no validators: a changed body is told by its hash."""

    def __init__(self) -> None:
        self.body = feed(edited=False)
        source = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(source.body)))
                self.end_headers()
                self.wfile.write(source.body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/feed.json"


def edited_tick(kind: str, by_item: bool) -> dict[str, Any]:
    source = Source()
    db, close = fresh(kind)
    real = build_mod._replan
    if not by_item:
        build_mod._replan = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        settings = Settings(database_url=db.url, source_allow_networks=LOOPBACK_NETWORKS)
        register(db, settings, {f"dev-{n}": [source.url] for n in range(DEVICES)})
        first = build_mod.build(db, settings, now=Instant.from_unix(T0))
        source.body = feed(edited=True)
        started = time.perf_counter()
        tick = build_mod.build(db, settings, now=Instant.from_unix(T0 + 900))
        seconds = time.perf_counter() - started
        return {
            "rows_first_build": first.rows_inserted,
            "seconds": round(seconds, 3),
            "devices_per_s": round(DEVICES / seconds),
            "devices_items_replanned": tick.devices_items_replanned,
            "rows_updated": tick.rows_updated,
        }
    finally:
        build_mod._replan = real  # type: ignore[assignment]
        close()
        source.server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="both")
    args = ap.parse_args()
    kinds = ("sqlite", "postgresql") if args.backend == "both" else (args.backend,)
    out: dict[str, Any] = {"devices": DEVICES, "items": ITEMS, "bound": BOUND}
    for kind in kinds:
        items, full = edited_tick(kind, by_item=True), edited_tick(kind, by_item=False)
        ratio = items["seconds"] / full["seconds"]
        out[kind] = {"by_item": items, "full": full, "ratio": round(ratio, 2), "met": ratio <= BOUND}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
