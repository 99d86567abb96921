"""Sources at scale: iCalendar, conditional GET, bounds, failure isolation and alerts."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import icalendar
import recurring_ical_events

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import LOOPBACK_NETWORKS
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.sources.egress import parse_networks
from reminders_pipeline.sources.reader import SourceReader, SourceState
from reminders_pipeline.sources.urls import shown_url

from .calendars import ALL_DAY, CANCELLED, FLOATING, UTC_EVENT, WEEKLY, calendar
from .http_sources import Route
from .support import device, rows

NOW = Instant.from_stored("2026-10-18T12:00:00.000Z")
NOW_S = int(NOW.unix)
DAYS = 86400
LOOPBACK = parse_networks(LOOPBACK_NETWORKS)  # the feed server's address


def queued(db) -> dict[tuple[str, str], dict]:
    return {(r["item_id"].split(":", 1)[1], r["rule"]): r for r in rows(db) if r["status"] == "pending"}


def expected_send_afters(ics: str, lead: int, until: int, offset: int = 0) -> list[tuple[str, str]]:
    """What recurring_ical_events itself says, independently of the project's mapping. All-day
    items get the default all-day rule (``day:0@09:00``), timed items the lead."""
    cal = icalendar.Calendar.from_ical(ics)
    lo, hi = datetime.fromtimestamp(NOW_S, UTC), datetime.fromtimestamp(until, UTC)
    out = []
    for ev in recurring_ical_events.of(cal).between(lo, hi):
        if str(ev.get("STATUS", "")).upper() == "CANCELLED":
            continue
        start = ev["DTSTART"].dt
        if not isinstance(start, datetime):
            day = int(datetime(start.year, start.month, start.day, tzinfo=UTC).timestamp()) - offset
            if day + DAYS > NOW_S:
                out.append((str(ev["SUMMARY"]), Instant.from_unix(day + 9 * 3600)))
            continue
        if start.tzinfo:
            s = int(start.timestamp())
        else:
            naive = start if isinstance(start, datetime) else datetime(start.year, start.month, start.day)
            s = int(naive.replace(tzinfo=UTC).timestamp()) - offset
        if s > NOW_S and s - lead <= NOW_S + 40 * DAYS:
            out.append((str(ev["SUMMARY"]), Instant.from_unix(s - lead)))
    return sorted(out)


def test_calendar_occurrences_match_recurring_ical_events(db, settings, feeds):
    ics = calendar(WEEKLY, ALL_DAY, CANCELLED, UTC_EVENT)
    url = feeds.calendar("/cal.ics", ics)
    settings = settings.with_(horizon_seconds=40 * DAYS)
    device(db, settings, sources=[url], lead=900)
    summary = build(db, settings, now=NOW)
    assert summary.sources_failed == []
    got = sorted((r["title"], r["send_after"]) for r in queued(db).values())
    assert got == expected_send_afters(ics, 900, NOW_S + 40 * DAYS + 900)
    titles = [t for t, _ in got]
    assert titles.count("Weekly sync") == 3  # 19 Oct, 26 Oct, 23 Nov: 9 Nov deleted, 16 Nov cancelled
    assert "Called off" not in titles and "Weekly sync (moved)" in titles


def test_dst_is_honoured_through_vtimezone(db, settings, feeds):
    url = feeds.calendar("/cal.ics", calendar(WEEKLY))
    device(db, settings.with_(horizon_seconds=40 * DAYS), sources=[url], lead=600)
    build(db, settings.with_(horizon_seconds=40 * DAYS), now=NOW)
    by_start = sorted(r["event_at"] for r in queued(db).values())
    # 09:00 in Berlin is 07:00Z in summer time and 08:00Z after the 25 October change.
    assert by_start[:2] == [
        Instant.from_stored("2026-10-19T07:00:00.000Z"),
        Instant.from_stored("2026-10-26T08:00:00.000Z"),
    ]


def test_occurrence_ids_are_stable_so_a_move_updates_and_a_delete_voids(db, settings, feeds):
    settings = settings.with_(horizon_seconds=40 * DAYS)
    single = """BEGIN:VEVENT
UID:w@x
DTSTART:20261020T090000Z
DURATION:PT30M
RRULE:FREQ=WEEKLY;COUNT=3
SUMMARY:Standup
END:VEVENT"""
    url = feeds.calendar("/cal.ics", calendar(single))
    device(db, settings, sources=[url], lead=600)
    build(db, settings, now=NOW)
    before = queued(db)
    assert len(before) == 3
    moved = (
        single
        + """
BEGIN:VEVENT
UID:w@x
RECURRENCE-ID:20261027T090000Z
DTSTART:20261027T100000Z
DURATION:PT30M
SUMMARY:Standup (late)
END:VEVENT"""
    )
    feeds.calendar("/cal.ics", calendar(moved.replace("COUNT=3", "COUNT=3\nEXDATE:20261103T090000Z")))
    summary = build(db, settings, now=Instant.from_unix(NOW_S + 60))
    after = queued(db)
    key = ("w@x/20261027T090000Z", "lead:600")
    assert after[key]["id"] == before[key]["id"] and after[key]["send_after"] == Instant.from_stored(
        "2026-10-27T09:50:00.000Z"
    )
    assert summary.rows_updated == 1 and summary.rows_voided == {"left_feed": 1}
    assert ("w@x/20261103T090000Z", "lead:600") not in after


def test_floating_and_all_day_use_the_device_offset(db, settings, feeds):
    settings = settings.with_(horizon_seconds=40 * DAYS)
    url = feeds.calendar("/cal.ics", calendar(FLOATING, ALL_DAY))
    device(db, settings, "east", sources=[url], lead=3600)
    device(db, settings, "utc", sources=[url], lead=3600)
    with db.write() as conn:
        ledger.store_tz_offset(conn, "east", 2 * 3600)
    build(db, settings, now=NOW)
    got = {(r["device_id"], r["title"]): r["event_at"] for r in rows(db)}
    assert got[("east", "Dinner")] == Instant.from_stored("2026-10-28T16:00:00.000Z")  # 18:00 at UTC+2
    assert got[("utc", "Dinner")] == Instant.from_stored("2026-10-28T18:00:00.000Z")  # unknown offset: read as UTC
    assert got[("east", "Holiday")] == Instant.from_stored("2026-10-26T22:00:00.000Z")  # local midnight
    assert got[("utc", "Holiday")] == Instant.from_stored("2026-10-27T00:00:00.000Z")


def test_garbage_calendar_fails_the_source_only(db, settings, feeds):
    good = feeds.items("/good.json", [])
    bad = feeds.set("/bad.ics", Route(body=b"BEGIN:VCALENDAR\r\nthis is not\r\n", content_type="text/calendar"))
    device(db, settings, sources=[good, bad])
    summary = build(db, settings, now=NOW)
    assert [f["url"] for f in summary.sources_failed] == [shown_url(bad)]
    assert summary.sources_failed[0]["error"] == "not_icalendar"


def test_conditional_get_reuses_the_parsed_feed_on_304(db, settings, feeds):
    items = [{"id": "e", "title": "E", "startsAt": NOW_S + 7200, "expiresAt": NOW_S + 9000}]
    url = feeds.items("/a.json", items, etag='"v1"')
    device(db, settings, sources=[url])
    first = build(db, settings, now=NOW)
    second = build(db, settings, now=Instant.from_unix(NOW_S + 60))
    assert (first.sources_not_modified, second.sources_not_modified) == (0, 1)
    assert feeds.request_headers["/a.json"][1].get("If-None-Match") == '"v1"'
    assert feeds.not_modified["/a.json"] == 1
    assert second.rows_voided == {} and [r["status"] for r in rows(db)] == ["pending"]
    feeds.items("/a.json", [], etag='"v2"')  # changed: a full read, the item leaves
    third = build(db, settings, now=Instant.from_unix(NOW_S + 120))
    assert third.sources_not_modified == 0 and third.rows_voided == {"left_feed": 1}


def test_calendar_304_is_reused_only_while_its_expansion_covers_the_window(feeds):
    url = feeds.calendar("/cal.ics", calendar(UTC_EVENT), etag='"c1"')
    reader = SourceReader(timeout=5, allow_networks=LOOPBACK)
    first = reader.read_all({1: url}, (NOW, NOW + DAYS))[1]
    assert first.ok and first.cache_until == Instant.from_unix(NOW_S + 2 * DAYS)
    state = SourceState(url, first.etag, None, first.feed.to_json(), first.cache_until, first.content_hash)
    assert reader.read_all({1: state}, (NOW, NOW + DAYS))[1].not_modified
    beyond = reader.read_all({1: state}, (NOW, NOW + 3 * DAYS))[1]
    assert beyond.ok and not beyond.not_modified  # the cache ends too early: read in full


def test_gzip_and_a_single_redirect_are_followed_but_not_a_chain(feeds):
    feeds.items("/z.json", [{"id": "e", "title": "E", "startsAt": NOW_S + 60, "expiresAt": NOW_S + 120}], gzip=True)
    feeds.redirect("/moved.json", "/z.json")
    for i in range(5):
        feeds.redirect(f"/loop{i}.json", f"/loop{i + 1}.json")
    reader = SourceReader(timeout=5, allow_networks=LOOPBACK)
    reads = reader.read_all({1: feeds.url("/z.json"), 2: feeds.url("/moved.json"), 3: feeds.url("/loop0.json")})
    assert len(reads[1].feed.items) == 1 and len(reads[2].feed.items) == 1
    assert not reads[3].ok and reads[3].error == "too_many_redirects"


def test_reads_are_bounded_per_host(feeds):
    for i in range(8):
        feeds.set(f"/s{i}.json", Route(delay=0.2))
    reader = SourceReader(timeout=5, concurrency=32, per_host=2, allow_networks=LOOPBACK)
    reads = reader.read_all({i: feeds.url(f"/s{i}.json") for i in range(8)})
    assert all(r.ok for r in reads.values())
    assert feeds.max_in_flight == 2


def test_a_slow_host_waits_for_its_own_slots_not_the_shared_ones(feeds):
    """A source waiting for its host's slot must not hold one of the overall slots meanwhile: six
    slow reads on one host (one at a time) would otherwise fill every slot and keep another host's
    source waiting behind them. Each slow read takes 1.5 s: the fast read has that long to arrive
    before the slow host's second read (scheduling noise on a loaded 2-core runner; it was 0.5 s)."""
    from .http_sources import FeedServer

    fast = FeedServer()
    fast.start()
    try:
        for i in range(6):
            feeds.set(f"/slow{i}.json", Route(delay=1.5))
        fast.set("/fast.json", Route())
        reader = SourceReader(timeout=10, concurrency=3, per_host=1, allow_networks=LOOPBACK)
        sources = {i: feeds.url(f"/slow{i}.json") for i in range(6)} | {6: fast.url("/fast.json")}
        reads = reader.read_all(sources)
        assert all(r.ok for r in reads.values())
        slow_arrivals = sorted(t for i in range(6) for t in feeds.arrivals[f"/slow{i}.json"])
        assert fast.arrivals["/fast.json"][0] < slow_arrivals[1]  # before the slow host's second read began
    finally:
        fast.stop()


def test_body_cap_fails_the_source(feeds):
    feeds.items(
        "/big.json",
        [{"id": str(i), "title": "x" * 100, "startsAt": NOW_S + 60, "expiresAt": NOW_S + 120} for i in range(100)],
    )
    read = SourceReader(timeout=5, max_bytes=2000, allow_networks=LOOPBACK).read_all({1: feeds.url("/big.json")})[1]
    assert not read.ok and read.error == "too_large"


def test_a_source_failing_longer_than_the_limit_alerts_once_per_streak(db, settings, feeds):
    hook = feeds.url("/hook")
    settings = settings.with_(alert_webhook_url=hook, source_alert_after_seconds=1800)
    url = feeds.fail("/down.json", 503)
    device(db, settings, sources=[url])
    for minutes in (0, 15, 30, 45, 60):
        build(db, settings, now=Instant.from_unix(NOW_S + minutes * 60))
    assert len(feeds.posts["/hook"]) == 1
    assert shown_url(url) in feeds.posts["/hook"][0]["text"] and "Source failing" in feeds.posts["/hook"][0]["text"]
    with db.read() as conn:
        (src,) = ledger.list_sources(conn)
    assert src["consecutive_failures"] == 5 and src["failing_since"] == NOW
    feeds.items("/down.json", [])
    build(db, settings, now=Instant.from_unix(NOW_S + 75 * 60))  # recovers: the streak ends
    feeds.fail("/down.json", 503)
    for minutes in (90, 105, 120, 135):
        build(db, settings, now=Instant.from_unix(NOW_S + minutes * 60))
    assert len(feeds.posts["/hook"]) == 2


def test_source_state_is_visible(db, settings, feeds):
    ok = feeds.items(
        "/ok.json", [{"id": "a", "title": "A", "startsAt": NOW_S + 60, "expiresAt": NOW_S + 120}, {"id": "bad"}]
    )
    device(db, settings, sources=[ok])
    build(db, settings, now=NOW)
    with db.read() as conn:
        (src,) = ledger.list_sources(conn)
    assert (src["last_item_count"], src["last_rejected_count"], src["subscribers"]) == (1, 1, 1)
    # Kept without validators too: the widget feed serves it while the read is recent (no 304 reuse).
    assert [i[0] for i in json.loads(src["feed_cache"])["items"]] == ["a"]


def test_a_read_cache_shares_reads_across_builds_of_one_run(db, settings, feeds):
    url = feeds.items("/shared.json", [{"id": "e", "title": "E", "startsAt": NOW_S + 7200, "expiresAt": NOW_S + 9000}])
    for i in range(12):
        device(db, settings, f"d{i}", sources=[url])
    with db.read() as conn:
        chunks = sorted({d.chunk for d in ledger.list_devices(conn)})
    assert len(chunks) > 1
    cache: dict = {}
    summaries = [build(db, settings, chunks=[c], now=NOW, read_cache=cache) for c in chunks]
    assert feeds.hits["/shared.json"] == 1
    assert all(s.sources_read == 1 for s in summaries) and len(rows(db)) == 12


def test_httpcore_finds_sniffio_so_no_read_pays_for_a_failed_import():
    """httpcore asks sniffio which async library runs, per request and per connection. Without it
    installed, each ask is an import that fails after searching all of sys.path (about 0.1 ms,
    several per source read: a third of a 304 tick's CPU measured in bench_build)."""
    import importlib.util

    assert importlib.util.find_spec("sniffio") is not None


def test_a_304_leaves_its_connection_open_for_the_next_read(feeds, monkeypatch):
    """A 304 read to its (empty) end goes back to the pool: closing it unread would close the
    connection too, and every source of an unchanged tick would pay a new TCP handshake."""
    from reminders_pipeline.sources import egress

    connects: list[str] = []
    real = egress.GuardedBackend.connect_tcp

    async def counting(self, host, *args, **kwargs):
        connects.append(host)
        return await real(self, host, *args, **kwargs)

    monkeypatch.setattr(egress.GuardedBackend, "connect_tcp", counting)
    urls = {i: feeds.set(f"/{i}.json", Route(body=b'{"items": []}', etag='"v1"')) for i in range(40)}
    reader = SourceReader(concurrency=4, per_host=4, allow_networks=parse_networks(LOOPBACK_NETWORKS))
    first = reader.read_all({i: SourceState(u) for i, u in urls.items()})
    assert len(connects) <= 4
    connects.clear()
    states = {
        i: SourceState(u, etag='"v1"', feed_cache=first[i].feed.to_json(), content_hash=first[i].content_hash)
        for i, u in urls.items()
    }
    again = reader.read_all(states)
    assert all(r.not_modified for r in again.values()) and sum(feeds.not_modified.values()) == 40
    assert len(connects) <= 4


def test_a_cookie_one_source_sets_goes_with_no_other_read(feeds):
    """One client reads every source of a build. A session cookie that one subscriber's feed set
    (behind its tokenised URL, or on a redirect) must not go with another subscriber's read on
    the same host, nor with the redirect's next hop."""
    feeds.set("/alice-token.json", Route(headers={"Set-Cookie": "session=alice; Path=/"}))
    feeds.set("/bob-token.json", Route(delay=0.2))
    feeds.set("/login", Route(302, b"", headers={"Location": "/after-login.json", "Set-Cookie": "login=1; Path=/"}))
    feeds.set("/after-login.json", Route(delay=0.2))
    reader = SourceReader(timeout=5, concurrency=1, allow_networks=LOOPBACK)
    reads = reader.read_all(
        {1: feeds.url("/alice-token.json"), 2: feeds.url("/bob-token.json"), 3: feeds.url("/login")}
    )
    assert all(r.ok for r in reads.values()), reads
    assert feeds.hits["/alice-token.json"] == feeds.hits["/bob-token.json"] == feeds.hits["/after-login.json"] == 1
    sent = [h for path in ("/bob-token.json", "/after-login.json") for h in feeds.request_headers[path]]
    assert sent and not any("Cookie" in h or "cookie" in h for h in sent), sent


def test_a_parse_cached_by_an_earlier_parser_is_read_again_not_reused():
    from reminders_pipeline.sources.reader import PARSE_VERSION, content_hash, parsed_under

    current = content_hash(b"body", 2000, "ics")
    assert parsed_under(current, 2000) and not parsed_under(current, 100)
    earlier = current.replace(f"p={PARSE_VERSION}/", f"p={PARSE_VERSION - 1}/")
    assert (
        not parsed_under(earlier, 2000) and not parsed_under("cap=2000/ics/abc", 2000) and not parsed_under(None, 2000)
    )
