"""Reading sources: each distinct source once per build, concurrently, failures isolated.

A failed read is a value (``SourceRead.error``), never an exception into the build: the build
must go on for the other sources and devices, and must not void anything the failed source owns.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Iterable, Mapping

import httpx

from .feed import FeedError, ParsedFeed, parse_json_feed


@dataclass(frozen=True)
class SourceRead:
    source_id: int
    url: str
    feed: ParsedFeed | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.feed is not None


class SourceReader:
    """Reads JSON sources over HTTP with bounded concurrency, timeouts and a body size cap."""

    def __init__(self, timeout: float = 10.0, max_bytes: int = 5_000_000, concurrency: int = 32) -> None:
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.concurrency = concurrency

    def read_all(self, sources: Mapping[int, str]) -> dict[int, SourceRead]:
        """``{source_id: url}`` -> ``{source_id: SourceRead}``; blocking wrapper for sync callers."""
        return asyncio.run(self.read_all_async(sources))

    async def read_all_async(self, sources: Mapping[int, str]) -> dict[int, SourceRead]:
        if not sources:
            return {}
        limit = asyncio.Semaphore(self.concurrency)
        timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 5.0))
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=True, max_redirects=3) as client:

            async def one(source_id: int, url: str) -> SourceRead:
                async with limit:
                    return await self._read(client, source_id, url)

            reads = await asyncio.gather(*(one(i, u) for i, u in sources.items()))
        return {r.source_id: r for r in reads}

    async def _read(self, client: httpx.AsyncClient, source_id: int, url: str) -> SourceRead:
        try:
            async with client.stream("GET", url, headers={"Accept": "application/json"}) as resp:
                if resp.status_code != 200:
                    return SourceRead(source_id, url, error=f"http {resp.status_code}")
                body = bytearray()
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > self.max_bytes:
                        return SourceRead(source_id, url, error=f"body larger than {self.max_bytes} bytes")
            return SourceRead(source_id, url, feed=parse_json_feed(bytes(body)))
        except FeedError as exc:
            return SourceRead(source_id, url, error=f"malformed feed: {exc}")
        except httpx.TimeoutException:
            return SourceRead(source_id, url, error="timeout")
        except (httpx.HTTPError, OSError) as exc:
            return SourceRead(source_id, url, error=f"{type(exc).__name__}: {exc}"[:500])


def distinct_sources(subscriptions: Mapping[str, Iterable[int]]) -> set[int]:
    return {s for subs in subscriptions.values() for s in subs}
