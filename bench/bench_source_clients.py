"""What the HTTP client alone costs a source read: 2,000 conditional GETs answered ``304`` by
``feed_server.py`` in another process, through each client the build could read with, beside the
sync client the naive per-device fetch uses (bench_build's baseline). Best of 3 per client.

    .venv/bin/python bench/bench_source_clients.py [--n 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpcore
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from bench_build import start_server  # noqa: E402

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS  # noqa: E402
from reminders_pipeline.sources.egress import GuardedTransport, parse_networks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    n = ap.parse_args().n
    proc, base = start_server(n, 0, int(time.time()))
    urls = [f"{base}/j/{i}.json" for i in range(n)]
    try:
        with httpx.Client() as client:
            etags = {u: client.get(u).headers["etag"] for u in urls}

        def sync_one_at_a_time() -> None:
            with httpx.Client() as c:
                for u in urls:
                    assert c.get(u, headers={"If-None-Match": etags[u]}).status_code == 304

        async def httpx_async(transport: httpx.AsyncBaseTransport | None, in_flight: int) -> None:
            slots = asyncio.Semaphore(in_flight)
            async with httpx.AsyncClient(transport=transport) as c:

                async def one(u: str) -> None:
                    async with slots:
                        assert (await c.get(u, headers={"If-None-Match": etags[u]})).status_code == 304

                await asyncio.gather(*(one(u) for u in urls))

        async def httpcore_pool(in_flight: int) -> None:
            slots = asyncio.Semaphore(in_flight)
            async with httpcore.AsyncConnectionPool(max_connections=in_flight) as pool:

                async def one(u: str) -> None:
                    async with slots:
                        assert (await pool.request("GET", u, headers={"If-None-Match": etags[u]})).status == 304

                await asyncio.gather(*(one(u) for u in urls))

        def guarded() -> GuardedTransport:  # as SourceReader makes it
            return GuardedTransport(parse_networks(LOOPBACK_NETWORKS), httpx.Limits(max_connections=32))

        clients: dict[str, Callable[[], object]] = {
            "sync httpx.Client, one at a time (the naive fetch)": sync_one_at_a_time,
            "httpx.AsyncClient, 8 in flight": lambda: asyncio.run(httpx_async(None, 8)),
            "httpx.AsyncClient on GuardedTransport, 8 in flight (the build)": lambda: asyncio.run(
                httpx_async(guarded(), 8)
            ),
            "httpcore.AsyncConnectionPool, 8 in flight": lambda: asyncio.run(httpcore_pool(8)),
            "httpx.AsyncClient, 1 in flight": lambda: asyncio.run(httpx_async(None, 1)),
        }
        rates = {}
        for name, run in clients.items():
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t)
            rates[name] = round(n / best)
        baseline = rates["sync httpx.Client, one at a time (the naive fetch)"]
        print(
            json.dumps(
                {
                    "reads": n,
                    "reads_per_s": rates,
                    "ratio_to_naive": {k: round(v / baseline, 2) for k, v in rates.items()},
                },
                indent=2,
            )
        )
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
