"""Local time for devices: IANA zones DST exact (RFC 5545 gap and fold), offsets, quiet hours,
and all-day rules; every expected instant is written out by hand or computed with zoneinfo."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from reminders_pipeline.domain.items import Item
from reminders_pipeline.domain.notification import compose
from reminders_pipeline.domain.rules import RuleError, device_rules, parse_rule
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import Zone, ZoneError, parse_quiet_hours, zone_info, zone_of

UTC = UTC


def wall(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> int:
    """Wall seconds: a local wall time read as if it were UTC."""
    return int(datetime(y, mo, d, h, mi, tzinfo=UTC).timestamp())


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> int:
    return wall(y, mo, d, h, mi)


def instant(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> Instant:
    return Instant.from_unix(utc(y, mo, d, h, mi))


@pytest.mark.parametrize(
    "tz, local, expected",
    [
        ("Europe/Berlin", (2026, 3, 29, 1, 30), (2026, 3, 29, 0, 30)),  # CET, before the change
        ("Europe/Berlin", (2026, 3, 29, 2, 30), (2026, 3, 29, 1, 30)),  # in the gap: offset before it (RFC 5545)
        ("Europe/Berlin", (2026, 3, 29, 3, 30), (2026, 3, 29, 1, 30)),  # CEST
        ("Europe/Berlin", (2026, 10, 25, 2, 30), (2026, 10, 25, 0, 30)),  # ambiguous: the first (CEST)
        ("America/New_York", (2026, 3, 8, 2, 30), (2026, 3, 8, 7, 30)),  # gap: EST offset
        ("America/New_York", (2026, 11, 1, 1, 30), (2026, 11, 1, 5, 30)),  # fold: EDT
        ("Australia/Lord_Howe", (2026, 10, 4, 2, 15), (2026, 10, 3, 15, 45)),  # 30-minute gap, +10:30 before it
        ("Australia/Lord_Howe", (2026, 4, 5, 1, 45), (2026, 4, 4, 14, 45)),  # 30-minute fold: +11 first
        ("Pacific/Chatham", (2026, 9, 27, 3, 0), (2026, 9, 26, 14, 15)),  # gap 02:45-03:45, +12:45 before it
        ("Asia/Kolkata", (2026, 6, 1, 9, 0), (2026, 6, 1, 3, 30)),
    ],
)
def test_wall_times_resolve_dst_exact(tz, local, expected):
    assert Zone(tz).to_unix(wall(*local)) == utc(*expected)


def test_offset_only_and_unknown_keep_todays_behaviour():
    assert Zone(None, -4 * 3600).to_unix(wall(2026, 6, 1, 9)) == utc(2026, 6, 1, 13)
    assert Zone(None, None).to_unix(wall(2026, 6, 1, 9)) == utc(2026, 6, 1, 9)
    assert Zone("Europe/Berlin", -4 * 3600).to_unix(wall(2026, 6, 1, 9)) == utc(2026, 6, 1, 7)  # the zone wins


@pytest.mark.parametrize("name", ["Mars/Olympus", "Europe/Berlin/x/y", "../etc/passwd", "", "x" * 65, "Europe/ Berlin"])
def test_unknown_zones_are_refused(name):
    with pytest.raises(ZoneError):
        zone_info(name)


def test_clock_text_follows_the_zone_across_dst():
    # 12:30Z is 14:30 in Berlin in summer and 13:30 in winter; the offset form cannot know that.
    assert Zone.of("Europe/Berlin", 3600).clock(instant(2026, 7, 1, 12, 30)) == "14:30"
    assert Zone.of("Europe/Berlin", 7200).clock(instant(2026, 12, 1, 12, 30)) == "13:30"
    assert Zone.of(None, 7200).clock(instant(2026, 12, 1, 12, 30)) == "14:30"
    assert Zone.of(None, None).clock(instant(2026, 12, 1, 12, 30)) == "12:30 UTC"
    row = {
        "id": 1,
        "device_id": "d",
        "target": "ab" * 32,
        "item_id": "1:x",
        "title": "Dentist",
        "body": None,
        "rule": "lead:600",
        "event_at": Instant.from_unix(utc(2026, 10, 26, 13, 30)),
        "expires_at": Instant.from_unix(utc(2026, 10, 26, 14)),
        "last_tz_offset_seconds": 7200,
        "tz_name": "Europe/Berlin",
    }
    sent = row["event_at"] - 600
    assert compose(row, now=sent).payload["aps"]["alert"]["body"] == "Starts at 14:30"  # CET after 25 October


@pytest.mark.parametrize(
    "rule, sent, body",
    [
        ("day:0@09:00", "2026-10-27T08:00:00.000Z", "Today"),
        ("day:1@18:00", "2026-10-26T17:00:00.000Z", "Tomorrow"),
        ("day:7@09:00", "2026-10-20T07:00:00.000Z", "In 7 days"),
    ],
)
def test_all_day_alert_names_the_day(rule, sent, body):
    row = {
        "id": 1,
        "device_id": "d",
        "target": "ab" * 32,
        "item_id": "1:x",
        "title": "Birthday",
        "body": None,
        "rule": rule,
        "event_at": Instant.from_stored("2026-10-26T23:00:00.000Z"),
        "expires_at": Instant.from_stored("2026-10-27T23:00:00.000Z"),
        "tz_name": "Europe/Berlin",
    }
    note = compose(row, now=Instant.from_stored(sent))
    assert note.payload["aps"]["alert"]["body"] == body
    assert note.expiration == int(datetime(2026, 10, 27, 23, tzinfo=UTC).timestamp())  # the end of the day


@pytest.mark.parametrize(
    "text, name, days, at, breakthrough",
    [
        ("day:0@09:00", "day:0@09:00", 0, 540, False),
        ("day:1@18:30", "day:1@18:30", 1, 1110, False),
        ("day:007@00:00!", "day:7@00:00!", 7, 0, True),
        ("lead:0!", "lead:0!", 0, 0, True),
        ("lead:600@expiry!", "lead:600@expiry!", 0, 0, True),
    ],
)
def test_day_and_breakthrough_rules_parse(text, name, days, at, breakthrough):
    rule = parse_rule(text)
    assert (rule.name, rule.days, rule.at_minutes, rule.breakthrough) == (name, days, at, breakthrough)
    assert parse_rule(rule.name) == rule


@pytest.mark.parametrize(
    "text",
    ["day:0", "day:0@9:00", "day:0@24:00", "day:0@12:60", "day:-1@09:00", "day:400@09:00", "day:x@09:00", "lead:0!!"],
)
def test_bad_day_rules_say_why(text):
    with pytest.raises(RuleError):
        parse_rule(text)


def test_device_rules_keep_lead_and_day_rules_apart():
    rules = device_rules(600, ["lead:0@expiry"], ["day:1@18:00", "day:0@09:00"])
    assert [r.name for r in rules if r.all_day] == ["day:0@09:00", "day:1@18:00"]
    assert [r.name for r in rules if not r.all_day] == ["lead:0@expiry", "lead:600"]


def test_day_rule_send_time_is_a_local_time_on_a_local_day_dst_exact():
    item = Item("x", "Holiday", None, wall(2026, 3, 29), wall(2026, 3, 30), floating=True, all_day=True)
    berlin = Zone("Europe/Berlin")
    before = parse_rule("day:1@18:00")
    assert berlin.to_unix(before.day_wall(item.starts_at)) == utc(2026, 3, 28, 17)  # CET the evening before
    assert berlin.to_unix(parse_rule("day:0@09:00").day_wall(item.starts_at)) == utc(2026, 3, 29, 7)  # CEST on the day
    fixed = item.for_local(berlin)
    assert (fixed.starts_at, fixed.expires_at) == (utc(2026, 3, 28, 23), utc(2026, 3, 29, 22))  # a 23-hour day


def test_duration_days_are_nominal_and_hours_exact_for_floating_times():
    # 23:00 floating + PT4H across Berlin's spring change is 4 real hours; + P1D is the same wall time next day.
    exact = Item("x", "t", None, wall(2026, 3, 28, 23), wall(2026, 3, 29, 3), floating=True, tail_seconds=4 * 3600)
    fixed = exact.for_local(Zone("Europe/Berlin"))
    assert fixed.expires_at - fixed.starts_at == 4 * 3600
    nominal = Item("y", "t", None, wall(2026, 3, 28, 23), wall(2026, 3, 29, 23), floating=True)
    fixed = nominal.for_local(Zone("Europe/Berlin"))
    assert fixed.expires_at - fixed.starts_at == 23 * 3600


@pytest.mark.parametrize(
    "window, local, inside",
    [
        ("22:00-07:00", (2026, 6, 1, 23, 0), True),
        ("22:00-07:00", (2026, 6, 1, 6, 59), True),
        ("22:00-07:00", (2026, 6, 1, 7, 0), False),
        ("22:00-07:00", (2026, 6, 1, 21, 59), False),
        ("12:00-13:00", (2026, 6, 1, 12, 30), True),
        ("12:00-13:00", (2026, 6, 1, 13, 30), False),
    ],
)
def test_quiet_hours_contain_local_times(window, local, inside):
    berlin = Zone("Europe/Berlin")
    when = Instant.from_unix(berlin.to_unix(wall(*local)))
    assert parse_quiet_hours(window).contains(when, berlin) is inside


def test_quiet_hours_end_is_local_and_dst_exact():
    berlin = Zone("Europe/Berlin")
    quiet = parse_quiet_hours("22:00-07:00")
    # The night of the spring change: 23:00 CET -> 07:00 CEST is 05:00Z.
    assert quiet.end_after(instant(2026, 3, 28, 22), berlin) == instant(2026, 3, 29, 5)
    assert quiet.end_after(instant(2026, 3, 29, 2), berlin) == instant(2026, 3, 29, 5)


@pytest.mark.parametrize("text", ["22:00", "22:00-22:00", "25:00-07:00", "22:00-07:60", "10pm-7am"])
def test_bad_quiet_hours_are_refused(text):
    with pytest.raises(ZoneError):
        parse_quiet_hours(text)


def test_a_stored_zone_the_database_no_longer_knows_falls_back_to_the_offset():
    assert zone_of({"tz_name": "Gone/Zone", "last_tz_offset_seconds": 3600}) == Zone(None, 3600)
    assert zone_of({"tz_name": "Europe/Berlin", "last_tz_offset_seconds": 3600}) == Zone("Europe/Berlin", 3600)


def test_json_feeds_are_capped_too_and_the_cut_counted():
    import json

    from reminders_pipeline.domain.items import parse_json_feed

    items = [
        {"id": f"e{i}", "title": "t", "startsAt": 1_789_000_000 + i, "expiresAt": 1_789_000_100 + i} for i in range(5)
    ]
    feed = parse_json_feed(json.dumps({"items": items}).encode(), max_items=3)
    assert [i.id for i in feed.items] == ["e0", "e1", "e2"] and feed.rejected == {"over_item_cap": 2}


# The two DST nights of 2026 in two zones: (zone, quiet hours, a time inside them in the second pass
# of the fold or just before the gap, the instant quiet hours are over).
DST_NIGHTS = [
    # Berlin falls back at 01:00Z (03:00 CEST -> 02:00 CET): 02:15 CET is 01:15Z; 02:30 CET is 01:30Z.
    ("Europe/Berlin", "22:00-02:30", instant(2026, 10, 25, 1, 15), instant(2026, 10, 25, 1, 30)),
    # New York falls back at 06:00Z (02:00 EDT -> 01:00 EST): 01:15 EST is 06:15Z; 01:30 EST is 06:30Z.
    ("America/New_York", "22:00-01:30", instant(2026, 11, 1, 6, 15), instant(2026, 11, 1, 6, 30)),
    # Berlin springs forward at 01:00Z (02:00 CET -> 03:00 CEST): 02:30 never happens, quiet hours
    # are over when the clock jumps past it, at 01:00Z (03:00 CEST), not 01:30Z (03:30 CEST).
    ("Europe/Berlin", "22:00-02:30", instant(2026, 3, 29, 0, 45), instant(2026, 3, 29, 1, 0)),
    # New York springs forward at 07:00Z (02:00 EST -> 03:00 EDT).
    ("America/New_York", "22:00-02:30", instant(2026, 3, 8, 6, 45), instant(2026, 3, 8, 7, 0)),
]


@pytest.mark.parametrize(
    "tz, window, inside, over", DST_NIGHTS, ids=["berlin-fold", "new-york-fold", "berlin-gap", "new-york-gap"]
)
def test_quiet_hours_end_on_both_dst_nights_is_when_the_clock_leaves_them(tz, window, inside, over):
    zone, quiet = Zone(tz), parse_quiet_hours(window)
    assert quiet.contains(inside, zone)
    assert quiet.end_after(inside, zone) == over
    assert quiet.contains(over - 1, zone) and not quiet.contains(over, zone)


@pytest.mark.parametrize(
    "tz, when, inside",
    [
        ("Europe/Berlin", instant(2026, 10, 25, 0, 15), True),  # 02:15 CEST, first pass
        ("Europe/Berlin", instant(2026, 10, 25, 0, 45), False),  # 02:45 CEST: past 02:30 in the first pass
        ("Europe/Berlin", instant(2026, 10, 25, 1, 15), True),  # 02:15 CET, second pass: the clock reads 02:15 again
        ("Europe/Berlin", instant(2026, 10, 25, 1, 45), False),  # 02:45 CET
        ("America/New_York", instant(2026, 11, 1, 5, 15), True),  # 01:15 EDT
        ("America/New_York", instant(2026, 11, 1, 5, 45), False),  # 01:45 EDT
        ("America/New_York", instant(2026, 11, 1, 6, 15), True),  # 01:15 EST
    ],
)
def test_quiet_hours_contain_what_the_clock_reads_in_the_fold(tz, when, inside):
    window = "22:00-02:30" if tz == "Europe/Berlin" else "22:00-01:30"
    assert parse_quiet_hours(window).contains(when, Zone(tz)) is inside


@pytest.mark.parametrize("tz", ["Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize("window", ["22:00-02:30", "22:00-01:30", "01:00-03:00", "02:15-02:45", "23:00-07:00"])
@pytest.mark.parametrize(
    "night", [(2026, 3, 7), (2026, 3, 28), (2026, 10, 24), (2026, 10, 31)], ids=lambda d: f"{d[1]:02d}-{d[2]:02d}"
)
def test_a_hold_ends_exactly_when_quiet_hours_do_never_earlier(tz, window, night):
    """Every 5 minutes across both DST nights: a time inside quiet hours ends them later, at the
    first instant outside them, and every sampled instant in between is inside."""
    zone, quiet = Zone(tz), parse_quiet_hours(window)
    start = utc(*night, 18)
    for t in (Instant.from_unix(s) for s in range(start, start + 16 * 3600, 300)):
        if not quiet.contains(t, zone):
            continue
        end = quiet.end_after(t, zone)
        assert end > t, (t, end)
        assert not quiet.contains(end, zone) and quiet.contains(end - 1, zone), (t, end)
        steps = range(t.whole_seconds, end.whole_seconds, 60)
        assert all(quiet.contains(Instant.from_unix(s), zone) for s in steps), (t, end)
