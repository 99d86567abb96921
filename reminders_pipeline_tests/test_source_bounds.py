"""Hostile sources stay bounded: decoded bytes, item cap order, calendar expansion, feed route reads."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

from reminders_pipeline.config.settings import LOOPBACK_NETWORKS
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.sources.egress import parse_networks
from reminders_pipeline.sources.reader import SourceReader

from .http_sources import Route, gzip_bomb

NOW = Instant.from_stored("2026-10-18T12:00:00.000Z")
NOW_S = int(NOW.unix)
LOOPBACK = parse_networks(LOOPBACK_NETWORKS)
FEED = json.dumps({"items": [{"id": "a", "title": "A", "startsAt": NOW_S + 600, "expiresAt": NOW_S + 900}]}).encode()


def _read(feeds, path: str, max_bytes: int = 5_000_000):
    return SourceReader(timeout=10, max_bytes=max_bytes, allow_networks=LOOPBACK).read_all(
        {1: feeds.url(path)}, (NOW, NOW + 86400)
    )[1]


def test_stacked_gzip_is_decoded_and_its_decoded_size_is_capped(feeds):
    feeds.set("/twice.json", Route(body=gzip.compress(gzip.compress(FEED)), headers={"Content-Encoding": "gzip, gzip"}))
    feeds.set("/bomb.json", Route(body=gzip_bomb(64), headers={"Content-Encoding": "gzip, gzip"}))
    assert [i.id for i in _read(feeds, "/twice.json").feed.items] == ["a"]
    bomb = _read(feeds, "/bomb.json", max_bytes=1_000_000)
    assert not bomb.ok and bomb.error == "too_large"


def test_unknown_or_too_deep_encodings_fail_with_their_own_code(feeds):
    feeds.set("/br.json", Route(body=FEED, headers={"Content-Encoding": "br"}))
    thrice = gzip.compress(gzip.compress(gzip.compress(FEED)))
    feeds.set("/thrice.json", Route(body=thrice, headers={"Content-Encoding": "gzip, gzip, gzip"}))
    feeds.set("/cut.json", Route(body=gzip.compress(FEED)[:-12], headers={"Content-Encoding": "gzip"}))
    assert _read(feeds, "/br.json").error == "unsupported_encoding"
    assert _read(feeds, "/thrice.json").error == "unsupported_encoding"
    assert _read(feeds, "/cut.json").error == "read_failed"  # a truncated body is not a shorter feed


PEAK_RSS = textwrap.dedent(
    """
    import resource, sys
    from reminders_pipeline.sources.egress import parse_networks
    from reminders_pipeline.sources.reader import SourceReader
    reader = SourceReader(timeout=60, allow_networks=parse_networks(["127.0.0.0/8"]))
    read = reader.read_all({1: sys.argv[1]})[1]
    print(read.error or "ok", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """
)


def _peak_rss_mib(url: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, url], capture_output=True, text=True, timeout=300, check=True)
    error, peak = out.stdout.split()
    return error, int(peak)


def test_a_kilobyte_that_inflates_to_a_gigabyte_costs_no_memory(feeds):
    """The issue's bar: a ~2.5 KB body stacking gzip twice that inflates to 1 GiB fails ``too_large``
    with peak RSS within 100 MB of reading a plain feed (measured: 146 MiB each; 2,090 MiB when httpx decoded)."""
    bomb = gzip_bomb(1024)
    assert len(bomb) < 4096
    feeds.set("/plain.json", Route(body=FEED))
    feeds.set("/gig.json", Route(body=bomb, headers={"Content-Encoding": "gzip, gzip"}))
    plain_error, plain_peak = _peak_rss_mib(feeds.url("/plain.json"))
    bomb_error, bomb_peak = _peak_rss_mib(feeds.url("/gig.json"))
    print(f"peak RSS: plain {plain_peak} MiB, gzip bomb {bomb_peak} MiB")
    assert (plain_error, bomb_error) == ("ok", "too_large")
    assert bomb_peak - plain_peak < 100


def test_the_item_cap_keeps_the_soonest_future_items_whatever_the_feed_order(db, settings, feeds):
    """Issue 19 item 4: past items first, then future ones latest first, cap 3. The cap keeps the
    three soonest future items; a row already queued for a later item stays pending (the cap says
    nothing about whether it left the feed)."""
    from reminders_pipeline.planning.build import build

    from .support import device, rows

    def item(name: str, offset: int) -> dict:
        return {"id": name, "title": name, "startsAt": NOW_S + offset, "expiresAt": NOW_S + offset + 600}

    past = [item(f"past{i}", -86400 - i * 3600) for i in range(5)]
    future = [item(f"f{i}", 7200 + i * 3600) for i in range(5)]
    url = feeds.items("/capped.json", past + future[::-1])
    device(db, settings, sources=[url])
    build(db, settings.with_(source_max_items=10), now=NOW)
    summary = build(db, settings.with_(source_max_items=3), now=NOW)
    pending = sorted(r["item_id"].split(":", 1)[1] for r in rows(db) if r["status"] == "pending")
    assert summary.items_rejected == {"over_item_cap": 2}
    assert pending == ["f0", "f1", "f2", "f3", "f4"] and summary.rows_voided == {}
    feed = SourceReader(allow_networks=LOOPBACK, max_items=3).read_all({1: url}, (NOW, NOW + 86400))[1].feed
    assert sorted(i.id for i in feed.items if not i.id.startswith("past")) == ["f0", "f1", "f2"]


def _calendar(*events: str) -> bytes:
    return ("BEGIN:VCALENDAR\r\nVERSION:2.0\r\nPRODID:-//test//EN\r\n" + "".join(events) + "END:VCALENDAR\r\n").encode()


def _event(uid: str, start: str, *lines: str) -> str:
    return (
        f"BEGIN:VEVENT\r\nUID:{uid}\r\nDTSTART:{start}\r\nSUMMARY:{uid}\r\n"
        + "".join(f"{line}\r\n" for line in lines)
        + "END:VEVENT\r\n"
    )


NEAR = "20261018T110000Z"  # an hour before NOW
SECONDLY = [_event(f"s{i}", NEAR, "DURATION:PT1S", "RRULE:FREQ=SECONDLY") for i in range(8)]
SECONDLY_SINCE_2020 = [_event(f"old{i}", "20200101T000000Z", "DURATION:PT1S", "RRULE:FREQ=SECONDLY") for i in range(8)]
MEETING = _event("meeting", "20261018T150000Z", "DTEND:20261018T160000Z")


def test_eight_secondly_series_cost_little_and_the_rest_of_the_build_is_built(db, settings, feeds):
    """Issue 19 item 8's bar: a calendar of 8 unbounded FREQ=SECONDLY series fails alone, with its
    reason counted, and the other devices of the same build are built. Each series is dropped at
    its 1,442nd occurrence (more than one a minute), before any is built. Measured on a loaded
    2-core runner: 1.2-1.5 s for this whole build (0.7 s for the 929-byte calendar alone); 11-13 s
    on 8648d3c. The bound is the issue's bar, 1.5 s above the measured figure. A second
    calendar whose 8 such series started in 2020 keeps its one real meeting."""
    import time

    from reminders_pipeline.devices.registration import DeviceSpec, put_device
    from reminders_pipeline.planning.build import build

    from .support import TOKEN, rows

    runaway = feeds.calendar("/secondly.ics", _calendar(*SECONDLY))
    mixed = feeds.calendar("/mixed.ics", _calendar(*SECONDLY_SINCE_2020, MEETING))
    plain = feeds.items("/plain.json", [{"id": "p", "title": "P", "startsAt": NOW_S + 7200, "expiresAt": NOW_S + 9000}])
    for name, url in (("runaway", runaway), ("mixed", mixed), ("plain", plain)):
        put_device(db, settings, DeviceSpec(name, TOKEN, 3600, (), (url,)), now=NOW)
    started = time.perf_counter()
    summary = build(db, settings, now=NOW)
    spent = time.perf_counter() - started
    print(f"build with 16 secondly series: {spent:.2f} s")
    assert spent < 3.0
    assert [f["error"] for f in summary.sources_failed] == ["every_item_rejected"]
    assert summary.items_rejected["runaway_series"] == 8  # the mixed calendar's (a failed read counts none)
    assert sorted((r["device_id"], r["item_id"].split(":", 1)[1]) for r in rows(db)) == [
        ("mixed", "meeting/20261018T150000Z"),
        ("plain", "p"),
    ]


def test_an_absurd_date_rejects_its_event_not_its_calendar(feeds):
    """DTEND in year 9999 overflowed recurring-ical-events and failed the calendar on every read."""
    absurd = _event("absurd", "20261018T140000Z", "DTEND:99991231T235959")
    url = feeds.calendar("/absurd.ics", _calendar(absurd, MEETING))
    read = SourceReader(allow_networks=LOOPBACK).read_all({1: url}, (NOW, NOW + 86400))[1]
    assert read.ok, read.error
    assert [i.id for i in read.feed.items] == ["meeting/20261018T150000Z"]
    assert read.feed.rejected == {"bad_recurrence": 1}


def test_an_abandoned_expansion_stops_at_its_next_occurrence():
    """The reader gives up waiting past its bound and sets ``cancel``: the thread stops too."""
    import threading
    import time

    from reminders_pipeline.domain.items import FeedError
    from reminders_pipeline.sources.ics import parse_ics_feed

    # COUNT is counted from DTSTART, so each of these walks from 1900: slow, one occurrence at a time.
    slow = _calendar(
        *(_event(f"d{i}", "19000101T090000Z", "DURATION:PT1H", "RRULE:FREQ=DAILY;COUNT=60000") for i in range(400))
    )
    cancel, outcome = threading.Event(), []

    def parse() -> None:
        try:
            parse_ics_feed(slow, NOW_S, NOW_S + 86400, max_items=2000, cancel=cancel)
            outcome.append("finished")
        except FeedError as exc:
            outcome.append(exc.code)

    worker = threading.Thread(target=parse)
    worker.start()
    time.sleep(0.5)
    cancel.set()
    stopped = time.monotonic()
    worker.join(timeout=30)
    print(f"stopped {time.monotonic() - stopped:.3f} s after cancel")
    assert outcome == ["parse_timeout"] and time.monotonic() - stopped < 2.0


NEVER = [
    "FREQ=SECONDLY;BYMONTH=2;BYMONTHDAY=30",
    "FREQ=MINUTELY;BYMONTH=2;BYMONTHDAY=31",
    "FREQ=SECONDLY;BYYEARDAY=366;BYMONTH=1",
    "FREQ=HOURLY;COUNT=5;BYMONTH=4;BYMONTHDAY=31",
]


def test_rules_that_never_match_cost_little_and_the_rest_of_the_build_is_built(db, settings, feeds):
    """A rule with no 30 February never returns from dateutil, so no per-occurrence check ran:
    ~12 s and the whole calendar failed ``parse_timeout`` on f9efcae. Now a calendar of 8 such
    series beside a meeting keeps the meeting, and a build with 8 unbounded secondly series too
    stays within the issue's 3 s bar (measured: well under 1 s for the never-matching calendar)."""
    import time

    from reminders_pipeline.devices.registration import DeviceSpec, put_device
    from reminders_pipeline.planning.build import build

    from .support import TOKEN, rows

    never = [_event(f"n{i}", NEAR, "DURATION:PT1M", f"RRULE:{NEVER[i % len(NEVER)]}") for i in range(8)]
    calendar = feeds.calendar("/never.ics", _calendar(*never, MEETING))
    runaway = feeds.calendar("/secondly.ics", _calendar(*SECONDLY))
    for name, url in (("never", calendar), ("runaway", runaway)):
        put_device(db, settings, DeviceSpec(name, TOKEN, 3600, (), (url,)), now=NOW)
    started = time.perf_counter()
    summary = build(db, settings, now=NOW)
    spent = time.perf_counter() - started
    print(f"build with 8 never-matching and 8 secondly series: {spent:.2f} s")
    assert spent < 3.0
    assert [f["error"] for f in summary.sources_failed] == ["every_item_rejected"]  # the secondly-only calendar
    assert [(r["device_id"], r["item_id"].split(":", 1)[1]) for r in rows(db)] == [
        ("never", "meeting/20261018T150000Z")
    ]


def test_a_dense_series_from_years_ago_is_read_in_full_on_its_own_instants():
    """A quarter-hourly check since 2020 was walked from its DTSTART and dropped ``runaway_series``
    on f9efcae. Now its walk starts just before the window: every quarter hour of the window is an
    item, each keyed by its original instant, and an EXDATE still removes its occurrence."""
    from reminders_pipeline.sources.ics import parse_ics_feed

    dense = _event(
        "dense", "20200101T000700Z", "DURATION:PT10M", "RRULE:FREQ=MINUTELY;INTERVAL=15", "EXDATE:20261018T130700Z"
    )
    feed = parse_ics_feed(_calendar(dense), NOW_S, NOW_S + 8 * 86400, max_items=2000)
    starts = sorted(i.starts_at for i in feed.items)
    assert feed.rejected == {}
    assert (
        len(starts) == 1 + 4 * (8 * 24 + 14) - 1
    )  # one under way at NOW, 8 days and the 14 h widening after it, less the EXDATE
    assert starts[0] == NOW_S - 8 * 60 and all(b - a in (900, 1800) for a, b in zip(starts, starts[1:]))
    assert "dense/20261018T130700Z" not in {i.id for i in feed.items} and "dense/20261018T132200Z" in {
        i.id for i in feed.items
    }


def _statuses(db) -> dict[str, tuple[str, str | None]]:
    from .support import rows

    return {r["item_id"].split(":", 1)[1]: (r["status"], r["outcome_detail"]) for r in rows(db)}


def test_rows_of_a_dropped_series_stay_while_a_deleted_event_is_voided(db, settings, feeds):
    """A series dropped ``runaway_series`` makes the feed partial for that series only: its queued
    rows stay pending (f9efcae voided them ``left_feed``), and an event deleted beside it is voided."""
    from reminders_pipeline.planning.build import build

    from .support import device

    gone = _event("gone", "20261018T160000Z", "DTEND:20261018T163000Z")
    url = feeds.calendar(
        "/series.ics", _calendar(_event("tick", NEAR, "DURATION:PT5M", "RRULE:FREQ=HOURLY;INTERVAL=2"), gone, MEETING)
    )
    device(db, settings, sources=[url])
    build(db, settings, now=NOW)
    ticks = {k for k in _statuses(db) if k.startswith("tick/")}
    assert ticks and "gone/20261018T160000Z" in _statuses(db)
    feeds.calendar("/series.ics", _calendar(_event("tick", NEAR, "DURATION:PT1S", "RRULE:FREQ=SECONDLY"), MEETING))
    summary = build(db, settings, now=NOW)
    assert summary.items_rejected == {"runaway_series": 1} and summary.rows_voided == {"left_feed": 1}
    assert _statuses(db)["gone/20261018T160000Z"] == ("settled", "left_feed")
    assert {_statuses(db)[k] for k in ticks} == {("pending", None)}


def _capped_build(db, settings, feeds, publish) -> None:
    """Cap 4: A, B, C, D queued; then D is deleted at the source while E and F arrive, five items:
    F is cut and its absence says nothing, but D is in no part of the feed (f9efcae kept it, being
    after where the cap cut, and sent it)."""
    from reminders_pipeline.planning.build import build

    from .support import device

    capped = settings.with_(source_max_items=4)
    url = publish({"A": 2, "B": 3, "C": 4, "D": 6})
    device(db, capped, sources=[url])
    build(db, capped, now=NOW)
    publish({"A": 2, "B": 3, "C": 4, "E": 4.5, "F": 5})
    summary = build(db, capped, now=NOW)
    assert summary.items_rejected == {"over_item_cap": 1} and summary.rows_voided == {"left_feed": 1}


def test_the_item_cap_keeps_only_what_it_cut_json(db, settings, feeds):
    def publish(hours: dict[str, float]) -> str:
        start = {name: NOW_S + int(h * 3600) for name, h in hours.items()}
        return feeds.items(
            "/cap.json", [{"id": n, "title": n, "startsAt": s, "expiresAt": s + 1800} for n, s in start.items()]
        )

    _capped_build(db, settings, feeds, publish)
    assert _statuses(db) == {k: ("pending", None) for k in "ABCE"} | {"D": ("settled", "left_feed")}


def test_the_item_cap_keeps_only_what_it_cut_icalendar(db, settings, feeds):
    from reminders_pipeline.domain.times import Instant

    def stamp(h: float) -> str:
        return Instant.from_unix(NOW_S + int(h * 3600)).stored.replace("-", "").replace(":", "").replace(".000", "")

    def publish(hours: dict[str, float]) -> str:
        return feeds.calendar("/cap.ics", _calendar(*(_event(n, stamp(h), "DURATION:PT30M") for n, h in hours.items())))

    _capped_build(db, settings, feeds, publish)
    assert {k.split("/")[0]: v for k, v in _statuses(db).items()} == {k: ("pending", None) for k in "ABCE"} | {
        "D": ("settled", "left_feed")
    }


def _raw_deflate(data: bytes) -> bytes:
    import zlib

    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def test_raw_deflate_and_gzip_with_trailing_nuls_read_as_httpx_reads_them(feeds):
    """f9efcae failed both ``read_failed`` where httpx returned the body: deflate sent without its
    zlib header, and a gzip body padded with NUL bytes after its member."""
    feeds.set("/raw.json", Route(body=_raw_deflate(FEED), headers={"Content-Encoding": "deflate"}))
    feeds.set("/padded.json", Route(body=gzip.compress(FEED) + b"\x00" * 4, headers={"Content-Encoding": "gzip"}))
    feeds.set(
        "/two.json", Route(body=gzip.compress(FEED[:9]) + gzip.compress(FEED[9:]), headers={"Content-Encoding": "gzip"})
    )
    for path in ("/raw.json", "/padded.json", "/two.json"):
        read = _read(feeds, path)
        assert read.ok and [i.id for i in read.feed.items] == ["a"], (path, read.error)


def test_the_decoders_cap_is_exact_whatever_the_chunks():
    """Byte by byte or whole, raw or zlib deflate, padded gzip: exactly the body's length decodes,
    one byte less fails ``too_large``."""
    import zlib

    import pytest

    from reminders_pipeline.sources.decoding import ReadFailed, StackedDecoder

    body = FEED * 50
    for coding, encoded in (
        ("deflate", _raw_deflate(body)),
        ("deflate", zlib.compress(body)),
        ("gzip", gzip.compress(body) + b"\x00\x1f"),
    ):
        for chunk in (1, 7, len(encoded)):
            decoder = StackedDecoder([coding], len(body))
            out = b"".join(b"".join(decoder.decode(encoded[i : i + chunk])) for i in range(0, len(encoded), chunk))
            assert out + b"".join(decoder.flush()) == body, (coding, chunk)
        with pytest.raises(ReadFailed, match="too_large"):
            b"".join(StackedDecoder([coding], len(body) - 1).decode(encoded))


def _later(seconds: int) -> Instant:
    from reminders_pipeline.domain.times import Instant

    return Instant.from_unix(NOW_S + seconds)


def test_an_unchanged_feed_over_the_cap_lets_a_cut_item_in_once_a_kept_one_is_over_json(db, settings, feeds):
    """Cap 2, items A (in 1 h), B (2 h), C (3 h), the feed never changing and answering 304. Once A
    is over, C is among the two soonest and gets its row: a cached cut is not reused at a later
    now (a033bef reused it, so C was never queued while the ETag held)."""
    from reminders_pipeline.planning.build import build

    from .support import device

    capped = settings.with_(source_max_items=2)
    items = [
        {"id": n, "title": n, "startsAt": NOW_S + h * 3600, "expiresAt": NOW_S + h * 3600 + 600}
        for n, h in (("A", 1), ("B", 2), ("C", 3))
    ]
    device(db, capped, sources=[feeds.items("/cap304.json", items, etag='"v1"')])
    build(db, capped, now=NOW)
    assert set(_statuses(db)) == {"A", "B"}
    build(db, capped, now=_later(3600 + 700))
    assert set(_statuses(db)) == {"A", "B", "C"}
    assert _statuses(db)["C"] == ("pending", None)


def test_an_unchanged_calendar_over_the_cap_lets_a_cut_occurrence_in_once_a_kept_one_is_over(db, settings, feeds):
    """The same through a calendar: cap 2, three events an hour apart, 304 on every read after the first."""
    from reminders_pipeline.planning.build import build

    from .support import device

    capped = settings.with_(source_max_items=2)
    body = _calendar(
        *(
            _event(n, _later(h * 3600).stored.replace("-", "").replace(":", "").replace(".000", ""), "DURATION:PT10M")
            for n, h in (("A", 1), ("B", 2), ("C", 3))
        )
    )
    url = feeds.calendar("/cap304.ics", body, etag='"v1"')
    device(db, capped, sources=[url])
    build(db, capped, now=NOW)
    assert {k.split("/")[0] for k in _statuses(db)} == {"A", "B"}
    build(db, capped, now=_later(3600 + 700))
    assert {k.split("/")[0] for k in _statuses(db)} == {"A", "B", "C"}
    assert feeds.not_modified["/cap304.ics"] == 0  # the second read could not be a 304


def test_a_series_dropped_as_a_flood_takes_no_place_under_the_cap(db, settings, feeds):
    """Cap 4: a FREQ=SECONDLY series starting in 30 minutes beside four real meetings. It is dropped
    ``runaway_series`` and the four meetings are queued; a033bef queued four of its seconds instead
    (each slice's walk stopped at the cap before the flood could be told) and cut the meetings."""
    from reminders_pipeline.planning.build import build

    from .support import device

    capped = settings.with_(source_max_items=4)
    stamp = lambda s: _later(s).stored.replace("-", "").replace(":", "").replace(".000", "")  # noqa: E731
    flood = _event("flood", stamp(1800), "DURATION:PT1S", "RRULE:FREQ=SECONDLY")
    meetings = [_event(f"m{i}", stamp(7200 + i * 3600), "DURATION:PT30M") for i in range(4)]
    device(db, capped, sources=[feeds.calendar("/flood.ics", _calendar(flood, *meetings))])
    summary = build(db, capped, now=NOW)
    assert summary.items_rejected == {"runaway_series": 1}
    assert {k.split("/")[0] for k in _statuses(db)} == {"m0", "m1", "m2", "m3"}


def test_a_series_dropped_after_its_first_slice_gives_its_places_back():
    """A series over its CPU share in a later slice, after its first occurrences were counted under
    the cap: the calendar is expanded again without it, so the cap keeps the other events."""
    import reminders_pipeline.sources.ics as ics

    stamp = lambda s: _later(s).stored.replace("-", "").replace(":", "").replace(".000", "")  # noqa: E731
    hourly = _event("hourly", stamp(600), "DURATION:PT5M", "RRULE:FREQ=HOURLY")
    meetings = [_event(f"m{i}", stamp(26 * 3600 + i * 600), "DURATION:PT5M") for i in range(3)]
    body = _calendar(hourly, *meetings)
    calls = {"n": 0}
    real = ics._expand

    def expand(series, start, end, meter):
        if str(series.uid) == "hourly" and start >= NOW_S + 86400 - ics.MAX_OFFSET_SECONDS:
            calls["n"] += 1
            return [], "runaway_series"
        return real(series, start, end, meter)

    ics._expand = expand
    try:
        feed = ics.parse_ics_feed(body, NOW_S, NOW_S + 3 * 86400, max_items=12)
    finally:
        ics._expand = real
    assert calls["n"] >= 1
    assert sorted(i.id.split("/")[0] for i in feed.items) == ["m0", "m1", "m2"]
    assert feed.rejected == {"runaway_series": 1} and "hourly" in feed.partial_series


def _dropped_after_the_first_day(uids: set[str], seen: dict[str, list[float]]):
    """An ``ics._expand`` that drops the series ``uids`` as runaway after their first day, and
    records what each other series had been charged when each expansion reached it first."""
    import reminders_pipeline.sources.ics as ics

    real = ics._expand

    def expand(series, start, end, meter):
        uid = str(series.uid)
        if uid in uids and start >= NOW_S + 86400 - ics.MAX_OFFSET_SECONDS:
            return [], "runaway_series"
        if start == NOW_S - ics.MAX_OFFSET_SECONDS:
            seen.setdefault(uid, []).append(meter.spent.get(id(series), 0.0))
        return real(series, start, end, meter)

    return expand


def test_replays_are_bounded_and_each_charges_a_series_afresh():
    """Six series dropped after their first day, each once it has taken places under the cap: the
    calendar is expanded again without them at most ``MAX_REPLAYS`` times (a033bef: once per
    series, without bound), the others are not charged again for the expansions thrown away, and
    every dropped series is still counted and its rows kept."""
    import reminders_pipeline.sources.ics as ics

    stamp = lambda s: _later(s).stored.replace("-", "").replace(":", "").replace(".000", "")  # noqa: E731
    floods = {f"h{i}" for i in range(6)}
    body = _calendar(
        *[_event(uid, stamp(600 + i), "DURATION:PT5M", "RRULE:FREQ=HOURLY") for i, uid in enumerate(sorted(floods))],
        _event("daily", stamp(900), "DURATION:PT5M", "RRULE:FREQ=DAILY"),
    )
    seen: dict[str, list[float]] = {}
    real = ics._expand
    ics._expand = _dropped_after_the_first_day(floods, seen)
    try:
        feed = ics.parse_ics_feed(body, NOW_S, NOW_S + 3 * 86400, max_items=200)
    finally:
        ics._expand = real
    assert len(seen["daily"]) == 1 + ics.MAX_REPLAYS
    assert seen["daily"] == [0.0] * len(seen["daily"])
    assert feed.rejected == {"runaway_series": 6} and floods <= feed.partial_series
    assert {i.id.split("/")[0] for i in feed.items} >= {"daily"}


def test_a_row_of_an_item_the_cap_cut_follows_the_item_when_it_moves(db, settings, feeds):
    """Cap 2: C's row was queued while the feed held two items; a third, sooner item cuts C, and
    then C moves an hour later. Its row is not voided (the cap says nothing of C leaving) and no
    new row is queued for it, but the one it has moves with it: sending at its old time would be
    an hour early, with the old start in the alert (a033bef kept it as it was)."""
    from reminders_pipeline.planning.build import build

    from .support import device

    capped = settings.with_(source_max_items=2)

    def item(name: str, hours: float) -> dict:
        start = NOW_S + int(hours * 3600)
        return {"id": name, "title": name, "startsAt": start, "expiresAt": start + 600}

    url = feeds.items("/cut-moves.json", [item("A", 2), item("C", 5)])
    device(db, capped, sources=[url])
    build(db, capped, now=NOW)
    feeds.items("/cut-moves.json", [item("A", 2), item("B", 3), item("C", 6)])
    summary = build(db, capped, now=NOW)
    assert summary.items_rejected == {"over_item_cap": 1}
    row = next(r for r in _rows(db) if r["item_id"].endswith(":C"))
    assert (row["status"], row["event_at"], row["send_after"]) == ("pending", _later(6 * 3600), _later(5 * 3600))


def test_a_row_of_an_all_day_event_the_cap_cut_follows_the_devices_zone(db, settings, feeds):
    """An all-day event's ``day:0@09:00`` row queued in UTC, then the event is cut by a sooner one
    and the device moves to New York: the row is re-timed to 09:00 there, not sent at 09:00 UTC,
    four hours before its rule's time."""
    from reminders_pipeline.devices.registration import DeviceSpec, put_device
    from reminders_pipeline.planning.build import build

    from .support import TOKEN

    capped = settings.with_(source_max_items=1)
    day = _event("holiday", "20261019", "DTEND;VALUE=DATE:20261020").replace(
        "DTSTART:20261019", "DTSTART;VALUE=DATE:20261019"
    )
    soon = _event("soon", _later(3600).stored.replace("-", "").replace(":", "").replace(".000", ""), "DURATION:PT30M")
    url = feeds.calendar("/cut-zone.ics", _calendar(day))
    spec = DeviceSpec("d", TOKEN, 3600, (), (url,), tz_name="UTC", all_day_rules=("day:0@09:00",))
    put_device(db, capped, spec, now=NOW)
    build(db, capped, now=NOW)
    assert [r["send_after"] for r in _rows(db)] == [Instant.from_stored("2026-10-19T09:00:00.000Z")]
    feeds.calendar("/cut-zone.ics", _calendar(day, soon))
    put_device(
        db,
        capped,
        DeviceSpec("d", TOKEN, 3600, (), (url,), tz_name="America/New_York", all_day_rules=("day:0@09:00",)),
        now=NOW,
    )
    build(db, capped, now=NOW)
    row = next(r for r in _rows(db) if "holiday" in r["item_id"])
    assert (row["status"], row["send_after"]) == ("pending", Instant.from_stored("2026-10-19T13:00:00.000Z"))


def _rows(db):
    from .support import rows

    return rows(db)


def test_a_json_feed_sets_aside_at_most_ten_caps_of_what_it_cut():
    """Cap 2, 50 future items: 2 kept, 48 counted and their ids kept, the 20 soonest of them set
    aside whole (what a calendar's cut builds at most), so a feed far over the cap costs bounded memory."""
    from reminders_pipeline.domain.items import parse_items

    raw = [
        {"id": f"i{n:02}", "title": "x", "startsAt": NOW_S + 60 * (n + 1), "expiresAt": NOW_S + 60 * (n + 2)}
        for n in range(50)
    ]
    feed = parse_items(raw[::-1], max_items=2, now=NOW_S)
    assert sorted(i.id for i in feed.items) == ["i00", "i01"]
    assert feed.rejected == {"over_item_cap": 48} and len(feed.cut_ids) == 48
    assert [i.id for i in feed.aside] == [f"i{n:02}" for n in range(2, 22)]
    assert feed.set_aside_item("i21") is not None and feed.set_aside_item("i22") is None


def test_a_floating_event_leaves_the_cap_when_the_expansion_stops_counting_it(db, settings, feeds):
    """Cap 2: a floating event that ended at 05:10 wall time still counts until 14 h later (the
    expansion is widened for every zone), so B is cut beside A. At 19:30Z it no longer counts:
    the unchanged calendar is read again instead of answering 304, and B is queued. (The long model
    run found this: the cut was kept until A ended, the next day.)"""
    from reminders_pipeline.planning.build import build

    from .support import device

    capped = settings.with_(source_max_items=2)
    body = _calendar(
        _event("early", "20261018T050000", "DURATION:PT10M"),
        _event("A", "20261019T100000Z", "DURATION:PT10M"),
        _event("B", "20261019T110000Z", "DURATION:PT10M"),
    )
    device(db, capped, sources=[feeds.calendar("/floating-cap.ics", body, etag='"v1"')])
    build(db, capped, now=NOW)
    assert {k.split("/")[0] for k in _statuses(db)} == {"A"}
    build(db, capped, now=Instant.from_stored("2026-10-18T19:30:00.000Z"))
    assert {k.split("/")[0] for k in _statuses(db)} == {"A", "B"}
