"""Reading sources: each distinct source once per build, concurrently, failures isolated.

A failed read is a value (``SourceRead.error``), never an exception into the build: the build goes
on for the other sources and devices, and does not void anything the failed source owns.

Reads are bounded overall and per host, with connect/read timeouts, a body cap, gzip and at most 3
redirects (httpx), never from https to http. Every connection, redirect hops included, opens
through ``egress.GuardedTransport``, which refuses internal addresses unless the deployment allows
their network. No cookie is kept, so none goes from one subscriber's read to another's. A
failed read is a short code and nothing the source sent: ``timeout``, ``http_404``,
``too_large``, ``address_refused``, ``not_json``, ``not_icalendar`` (see ``READ_ERRORS``).
A source's ETag/Last-Modified and its parsed feed are kept in the ledger; a
``304 Not Modified`` reuses the parsed feed without parsing. A URL answering ``text/calendar``
(or whose body starts ``BEGIN:VCALENDAR``, or a ``webcal://`` URL) is read as iCalendar.

Every bound of a read (size, time, redirects, hosts) is enforced in the one loop that streams the
body; the decoder it streams through is ``decoding.py``, its error codes ``read_errors.py``, and
how a URL is shown and fetched ``urls.py``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import http.cookiejar
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import httpx

from reminders_pipeline.domain.items import FeedError, ParsedFeed, parse_json_feed
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.sources.decoding import ReadFailed, StackedDecoder
from reminders_pipeline.sources.egress import GuardedTransport, Network
from reminders_pipeline.sources.ics import SERIES_SECONDS, parse_ics_feed
from reminders_pipeline.sources.read_errors import MAX_REDIRECTS, read_error_code
from reminders_pipeline.sources.urls import fetch_url, is_calendar

ICS_CACHE_SLACK_SECONDS = 86400  # expand a calendar a day past what this build needs, so 304s can reuse it
PARSE_GRACE_SECONDS = 1.0
# Not the loop's default executor: ``asyncio.run`` waits for that one at exit, which would make a
# parse past its bound hold up the whole build. A parse left behind finishes here, unread.
_PARSERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reminders-parse")

Window = tuple[Instant, Instant]  # (start, end) of the occurrences a read must yield
Windows = Window | Mapping[int, Window] | None


@dataclass(frozen=True)
class SourceState:
    """What the ledger remembers of a source between builds."""

    url: str
    etag: str | None = None
    last_modified: str | None = None
    feed_cache: str | None = None
    cache_until: Instant | None = None  # iCalendar caches cover occurrences up to here only
    content_hash: str | None = None  # of the body ``feed_cache`` was parsed from, and how (``content_hash``)


@dataclass(frozen=True)
class ItemChanges:
    """How a feed read anew differs from the parse it replaces: a device whose last plan was made
    from that parse (``previous_hash`` in its ``plan_key.plan_key``) plans only these items again."""

    previous_hash: str
    item_ids: frozenset[str]  # the source's own ids (``ParsedFeed.changed_since``)


@dataclass(frozen=True)
class SourceRead:
    source_id: int
    url: str
    feed: ParsedFeed | None = None
    error: str | None = None
    not_modified: bool = False  # a 304, or a 200 with the body last parsed: the cached parse reused
    etag: str | None = None
    last_modified: str | None = None
    cache_until: Instant | None = None
    content_hash: str | None = None  # what the feed was parsed from (``content_hash``): equal, the same feed
    changes: ItemChanges | None = None  # a new body, compared with the cached parse it replaces

    @property
    def ok(self) -> bool:
        return self.feed is not None

    @property
    def whole(self) -> bool:
        """Read and parsed in full (``ParsedFeed.whole``)."""
        return self.feed is not None and self.feed.whole


# Bumped whenever a parse keeps more of an item (declines, travel times): a cached parse made by an
# earlier version is read and parsed again, not reused on a 304 or an identical body.
PARSE_VERSION = 3  # 3: a series with alarms is read on by its alarms' reach (``ics_items.alarm_reaches``)


def content_hash(body: bytes, max_items: int | None, kind: str = "cache") -> str:
    """What a parse is made of: the parser's version and the item cap it was parsed under
    (``p=V/cap=N/``, read back by ``parsed_under``, so a cached parse is not reused once either has
    changed), the format it was parsed as, and the body."""
    return f"p={PARSE_VERSION}/cap={max_items}/{kind}/{hashlib.sha256(body).hexdigest()}"


def parsed_under(digest: str | None, max_items: int | None) -> bool:
    """A cached parse whose ``content_hash`` says this parser made it under this item cap."""
    return digest is not None and digest.startswith(f"p={PARSE_VERSION}/cap={max_items}/")


def _as_cached(source_id: int, state: SourceState, cached: ParsedFeed, max_items: int | None) -> SourceRead:
    """The cached parse, for content the source says (304) or shows (the same body) is unchanged,
    with the validators stored beside it (``ledger.record_source_success`` keeps those as they are).
    A cache stored before content hashes were kept is identified by its own text."""
    return SourceRead(
        source_id,
        state.url,
        feed=cached,
        not_modified=True,
        etag=state.etag,
        last_modified=state.last_modified,
        cache_until=state.cache_until,
        content_hash=state.content_hash or content_hash((state.feed_cache or "").encode(), max_items),
    )


def _changes(feed: ParsedFeed, cached: ParsedFeed | None, cached_hash: str | None) -> ItemChanges | None:
    if cached is None or cached_hash is None:
        return None
    ids = feed.changed_since(cached)
    return None if ids is None else ItemChanges(cached_hash, ids)


class SourceReader:
    """Reads JSON and iCalendar sources over HTTP; see the module docstring for the bounds."""

    def __init__(
        self,
        timeout: float = 10.0,
        max_bytes: int = 5_000_000,
        concurrency: int = 32,
        per_host: int = 8,
        allow_networks: Sequence[Network] = (),
        max_items: int | None = None,
        parse_seconds: float = 10.0,
        series_seconds: float = SERIES_SECONDS,
    ) -> None:
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.concurrency = concurrency
        self.per_host = per_host
        self.allow_networks = tuple(allow_networks)  # internal networks this deployment may read from
        self.max_items = max_items  # per source per read: items kept (and calendar occurrences built)
        self.parse_seconds = parse_seconds  # per source: parsing runs in a thread and fails past this
        self.series_seconds = series_seconds  # per calendar series: CPU seconds before it is dropped

    def read_all(self, sources: Mapping[int, SourceState | str], window: Windows = None) -> dict[int, SourceRead]:
        """Blocking wrapper for sync callers (the build, the CLI)."""
        return asyncio.run(self.read_all_async(sources, window))

    async def read_all_async(
        self, sources: Mapping[int, SourceState | str], window: Windows = None
    ) -> dict[int, SourceRead]:
        """``window``: (start, end) of the occurrences the caller needs from calendars,
        one for every source or a mapping with one per source id (each source's own subscribers')."""
        if not sources:
            return {}
        states = {sid: s if isinstance(s, SourceState) else SourceState(s) for sid, s in sources.items()}
        limit = asyncio.Semaphore(self.concurrency)
        hosts: dict[str, asyncio.Semaphore] = defaultdict(lambda: asyncio.Semaphore(self.per_host))
        timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, 5.0))
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        transport = GuardedTransport(self.allow_networks, limits)
        # trust_env=False: no proxy from the environment, whose address the guard would check instead.
        async with httpx.AsyncClient(
            timeout=timeout, transport=transport, trust_env=False, cookies=_no_cookies()
        ) as client:

            async def one(source_id: int, state: SourceState) -> SourceRead:
                # Host slot first: a read waiting for its (slow) host holds none of the shared slots.
                async with hosts[urlsplit(fetch_url(state.url)).netloc], limit:
                    own = window.get(source_id) if isinstance(window, Mapping) else window
                    return await self._read(client, source_id, state, own)

            reads = await asyncio.gather(*(one(i, s) for i, s in states.items()))
        return {r.source_id: r for r in reads}

    def stored_reads(self, sources: Mapping[int, SourceState], window: Windows = None) -> dict[int, SourceRead]:
        """The stored parses of these sources as reads, made without reading, each where it serves
        ``window`` (``_usable_cache``): for a build whose own reads are older than the ones stored."""
        out: dict[int, SourceRead] = {}
        for source_id, state in sources.items():
            own = window.get(source_id) if isinstance(window, Mapping) else window
            cached = self._usable_cache(state, own, starting_late=True)
            if cached is not None:
                out[source_id] = _as_cached(source_id, state, cached, self.max_items)
        return out

    async def _read(
        self, client: httpx.AsyncClient, source_id: int, state: SourceState, window: Window | None
    ) -> SourceRead:
        url = state.url
        headers = {"Accept": "application/json, text/calendar;q=0.9", "Accept-Encoding": "gzip, deflate"}
        cached = self._usable_cache(state, window)
        if cached is not None:
            if state.etag:
                headers["If-None-Match"] = state.etag
            if state.last_modified:
                headers["If-Modified-Since"] = state.last_modified
        try:
            response = await self._get(client, fetch_url(url), headers)
            try:
                if response.status_code == 304 and cached is not None:
                    # Read to its end (a 304 has no body), or closing it would close the connection
                    # too, and every read of an unchanged feed would open a new one.
                    await self._body(response)
                    return _as_cached(source_id, state, cached, self.max_items)
                if response.status_code != 200:
                    return SourceRead(source_id, url, error=f"http_{response.status_code}")
                body = await self._body(response)
            finally:
                await response.aclose()
            content_type = response.headers.get("content-type", "")
            etag, last_modified = response.headers.get("etag"), response.headers.get("last-modified")
            calendar = is_calendar(url, content_type, body)
            digest = content_hash(body, self.max_items, "ics" if calendar else "json")
            if cached is not None and digest == state.content_hash:  # a server without validators
                return _as_cached(source_id, state, cached, self.max_items)
            start, end = (w.whole_seconds for w in window or _default_window())  # the feeds' wire: Unix seconds
            if calendar:
                until = end + ICS_CACHE_SLACK_SECONDS
                feed = usable(await self._parse(parse_ics_feed, body, start, until, max_items=self.max_items))
                covered: Instant | None = Instant.from_unix(until)
            else:
                feed = usable(await self._parse(parse_json_feed, body, self.max_items, start))
                covered = None
            feed.read_from = start
            return SourceRead(
                source_id,
                url,
                feed=feed,
                etag=etag,
                last_modified=last_modified,
                cache_until=covered,
                content_hash=digest,
                changes=_changes(feed, cached, state.content_hash),
            )
        except (FeedError, ReadFailed) as exc:
            return SourceRead(source_id, url, error=exc.code)
        except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as exc:  # never the exception's text
            return SourceRead(source_id, url, error=read_error_code(exc))

    async def _parse(self, parse: Callable[..., ParsedFeed], *args: Any, **kwargs: Any) -> ParsedFeed:
        """Parsing in a worker thread, so a huge body delays only its own source. The calendar
        parser checks the deadline at every occurrence; the outer bound catches a slow
        ``from_ical``, and then tells the thread to stop at its next occurrence."""
        cancel = threading.Event()
        if parse is parse_ics_feed:
            kwargs.update(
                deadline=time.monotonic() + self.parse_seconds, series_seconds=self.series_seconds, cancel=cancel
            )
        call = functools.partial(parse, *args, **kwargs)
        try:
            work = asyncio.get_running_loop().run_in_executor(_PARSERS, call)
            return await asyncio.wait_for(work, self.parse_seconds + PARSE_GRACE_SECONDS)
        except TimeoutError:
            raise FeedError("parse_timeout") from None
        finally:
            cancel.set()

    @staticmethod
    async def _get(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> httpx.Response:
        """The streamed answer after at most ``MAX_REDIRECTS`` redirects, none from https to http.

        Redirects are followed here rather than by httpx so each hop's scheme can be compared with
        the last; each hop's address is checked by the transport when it connects.
        """
        request = client.build_request("GET", url, headers=headers)
        for _ in range(MAX_REDIRECTS + 1):
            response = await client.send(request, stream=True)
            following = response.next_request
            if following is None:
                return response
            await response.aclose()
            if request.url.scheme == "https" and following.url.scheme != "https":
                raise ReadFailed("insecure_redirect")
            request = following
        raise ReadFailed("too_many_redirects")

    async def _body(self, response: httpx.Response) -> bytes:
        """The decoded body, read raw and decoded here: httpx decodes a chunk (and every stacked
        encoding) in one call, so a kilobyte of nested gzip would become a gigabyte before any cap
        could look at it. Here each layer yields at most ``DECODE_STEP`` bytes at a time and each
        layer's output counts against ``max_bytes``."""
        if response.is_stream_consumed:  # an answer built in memory (httpx.MockTransport): already decoded
            if len(response.content) > self.max_bytes:
                raise ReadFailed("too_large")
            return response.content
        decoder = StackedDecoder(response.headers.get_list("content-encoding", split_commas=True), self.max_bytes)
        body = bytearray()
        async for raw in response.aiter_raw():
            for part in decoder.decode(raw):
                body += part
        for part in decoder.flush():
            body += part
        return bytes(body)

    def _usable_cache(
        self, state: SourceState, window: Window | None, *, starting_late: bool = False
    ) -> ParsedFeed | None:
        """The cached feed, if it was parsed under today's item cap, covers what this read needs (a
        calendar cache ends somewhere, and starts where its read's window did, as does a capped
        feed's count: a build for an earlier ``now`` reads again), and the cap, if it cut, would
        still keep the same items. A JSON feed read whole serves any window. ``starting_late``: a
        cache that starts after the window does serves it too, holding what starts before
        (``ParsedFeed.held_before``), for a build that cannot read again."""
        if not state.feed_cache or not (state.etag or state.last_modified or state.content_hash):
            return None
        if not parsed_under(state.content_hash, self.max_items):
            return None
        if state.cache_until is not None and (window is None or state.cache_until < window[1]):
            return None
        try:
            cached = ParsedFeed.from_json(state.feed_cache)
        except (ValueError, KeyError, TypeError):
            return None
        now = (window[0] if window is not None else Instant.now()).whole_seconds
        starts_late = cached.read_from is None or cached.read_from > now
        if cached.cap_until is not None and now >= cached.cap_until:
            return None
        if starts_late and (state.cache_until is not None or cached.cap_until is not None or not cached.whole):
            # its calendar expansion, or the cap's count, began after this window does
            late = starting_late and cached.read_from is not None
            return replace(cached, held_before=cached.read_from) if late else None
        return cached


def usable(feed: ParsedFeed) -> ParsedFeed:
    """A feed with items but none valid is garbage (a unit or schema change at the source), not an
    empty feed: reading it as empty would void every reminder the source owns."""
    if not feed.items and feed.rejected:
        raise FeedError("every_item_rejected")  # the reasons are counted in the summary's items_rejected
    return feed


def _no_cookies() -> http.cookiejar.CookieJar:
    """A jar that keeps nothing. One client reads every source of a build: a cookie one
    subscriber's feed set (a session behind a tokenised URL) would otherwise go with the next
    read of another subscriber's feed on the same host. A jar, not ``httpx.Cookies``: the client
    copies the cookies of an ``httpx.Cookies`` into a jar of its own, without the policy."""
    return http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))


def _default_window() -> Window:
    now = Instant.now()
    return now, now + 86400


def distinct_sources(subscriptions: Mapping[str, Iterable[int]]) -> set[int]:
    return {s for subs in subscriptions.values() for s in subs}
