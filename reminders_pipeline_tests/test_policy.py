"""The send-time policy table from docs/guide.md, one row per case."""

import pytest

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.policy import decide, quiet_end
from reminders_pipeline.domain.times import Instant

T = 1_789_000_000  # an event start
LIVE = Settings(enabled=True, max_lateness_seconds=1800)
DRY = Settings(enabled=False, max_lateness_seconds=1800)


def row(rule: str, send_after: int, start: int = T, end: int = T + 1800, **device: object) -> dict:
    return {
        "rule": rule,
        "send_after": Instant.from_unix(send_after),
        "event_at": Instant.from_unix(start),
        "expires_at": Instant.from_unix(end),
        **device,
    }


DAY = 86400
D = 1_789_084_800  # 2026-09-10T00:00Z: an all-day event's local midnight (UTC device)
QUIET = {"tz_name": "UTC", "quiet_hours": "22:00-07:00"}


@pytest.mark.parametrize(
    "case, r, now, settings, expected",
    [
        ("on time", row("lead:3600", T - 3600), T - 3600, LIVE, "send"),
        ("late but within the cap", row("lead:3600", T - 3600), T - 3600 + 1800, LIVE, "send"),
        ("past the lateness cap", row("lead:7200", T - 7200), T - 7200 + 1801, LIVE, "too_late"),
        ("event started", row("lead:600", T - 600), T, LIVE, "event_started"),
        ("event started, even in a dry run", row("lead:600", T - 600), T + 5, DRY, "event_started"),
        ("event over beats started", row("lead:600", T - 600), T + 1800, LIVE, "event_expired"),
        ("lead 0 at start is deliverable", row("lead:0", T), T + 60, LIVE, "send"),
        ("lead 0 at start, event over", row("lead:0", T, end=T + 30), T + 60, LIVE, "event_expired"),
        ("lead 0 at start, too late", row("lead:0", T, end=T + 7200), T + 1801, LIVE, "too_late"),
        ("lead:0@expiry is deliverable", row("lead:0@expiry", T + 1800), T + 1800 + 300, LIVE, "send"),
        ("lead:0@expiry too late", row("lead:0@expiry", T + 1800), T + 1800 + 1801, LIVE, "too_late"),
        ("expiry rule with lead, before the end", row("lead:300@expiry", T + 1500), T + 1600, LIVE, "send"),
        ("expiry rule with lead, after the end", row("lead:300@expiry", T + 1500), T + 1800, LIVE, "event_expired"),
        ("expiry rule ignores the start", row("lead:300@expiry", T + 1500), T + 1500, LIVE, "send"),
        ("one-second item, lead 0", row("lead:0", T, end=T + 1), T, LIVE, "send"),
        ("one-second item, a second later", row("lead:0", T, end=T + 1), T + 1, LIVE, "event_expired"),
        ("disabled: would have sent", row("lead:3600", T - 3600), T - 3500, DRY, "disabled"),
        ("disabled: too late still reported", row("lead:7200", T - 7200), T - 7200 + 1801, DRY, "too_late"),
        # All-day rules: bounded by the end of the last day and lateness, never event_started.
        (
            "day:0@09:00 after the day began",
            row("day:0@09:00", D + 9 * 3600, D, D + DAY),
            D + 9 * 3600 + 60,
            LIVE,
            "send",
        ),
        ("day:1@18:00 the evening before", row("day:1@18:00", D - 6 * 3600, D, D + DAY), D - 6 * 3600, LIVE, "send"),
        ("day rule too late", row("day:0@09:00", D + 9 * 3600, D, D + DAY), D + 9 * 3600 + 1801, LIVE, "too_late"),
        ("day rule after the last day", row("day:0@23:50", D + DAY - 600, D, D + DAY), D + DAY, LIVE, "event_expired"),
        ("day rule, dry run", row("day:0@09:00", D + 9 * 3600, D, D + DAY), D + 9 * 3600, DRY, "disabled"),
        # Quiet hours (22:00-07:00 UTC): what the build could not hold is settled, ``!`` breaks through.
        (
            "inside quiet hours",
            row("lead:0", D + 23 * 3600, D + 23 * 3600, D + DAY, **QUIET),
            D + 23 * 3600,
            LIVE,
            "quiet_hours",
        ),
        (
            "quiet hours, dry run too",
            row("lead:0", D + 23 * 3600, D + 23 * 3600, D + DAY, **QUIET),
            D + 23 * 3600,
            DRY,
            "quiet_hours",
        ),
        (
            "break-through rule",
            row("lead:0!", D + 23 * 3600, D + 23 * 3600, D + DAY, **QUIET),
            D + 23 * 3600,
            LIVE,
            "send",
        ),
        (
            "held to the window's end",
            row("lead:3600", D + 7 * 3600, D + 9 * 3600, D + DAY, **QUIET),
            D + 7 * 3600,
            LIVE,
            "send",
        ),
        (
            "quiet hours in the zone",
            row("lead:0", D + 20 * 3600, D + 20 * 3600, D + DAY, tz_name="Europe/Berlin", quiet_hours="22:00-07:00"),
            D + 20 * 3600,
            LIVE,
            "quiet_hours",
        ),
        ("too late beats quiet hours", row("lead:0", D, D, D + DAY, **QUIET), D + 1801, LIVE, "too_late"),
        # Claimed late inside quiet hours: held to their end while the event is still ahead then.
        (
            "claimed late inside quiet hours",
            row("lead:3600", D + 22 * 3600 - 120, D + DAY + 9 * 3600, D + DAY + 10 * 3600, **QUIET),
            D + 22 * 3600 + 180,
            LIVE,
            "held",
        ),
        (
            "held, then sent at the window's end",
            row(
                "lead:3600",
                D + 22 * 3600 - 120,
                D + DAY + 9 * 3600,
                D + DAY + 10 * 3600,
                not_before=Instant.from_unix(D + DAY + 7 * 3600),
                held_until=Instant.from_unix(D + DAY + 7 * 3600),
                outcome_detail="quiet_hours",
                **QUIET,
            ),
            D + DAY + 7 * 3600 + 60,
            LIVE,
            "send",
        ),
        (
            "held, then a retry: still counted from the hold's end",
            row(
                "lead:3600",
                D + 22 * 3600 - 120,
                D + DAY + 9 * 3600,
                D + DAY + 10 * 3600,
                not_before=Instant.from_unix(D + DAY + 7 * 3600 + 3),
                held_until=Instant.from_unix(D + DAY + 7 * 3600),
                outcome_detail="InternalServerError",
                **QUIET,
            ),
            D + DAY + 7 * 3600 + 60,
            LIVE,
            "send",
        ),
        (
            "a retry's backoff does not move lateness",
            row("lead:3600", T - 3600, not_before=Instant.from_unix(T - 3000), outcome_detail="ServiceUnavailable"),
            T - 3600 + 1801,
            LIVE,
            "too_late",
        ),
    ],
)
def test_policy_table(case, r, now, settings, expected):
    assert decide(r, Instant.from_unix(now), settings) == expected, case


def test_enabled_only_when_exactly_true():
    for value, enabled in [("true", True), ("TRUE", False), ("1", False), ("yes", False), ("", False)]:
        assert Settings.from_env({"REMINDERS_ENABLED": value}).enabled is enabled


def test_a_hold_in_the_second_pass_of_the_fold_never_moves_a_send_earlier():
    """Berlin, quiet 22:00-02:30, a reminder due 02:15 CET (01:15Z, after the clocks went back at
    01:00Z) for an event at 04:00 CET: held to 02:30 CET (01:30Z), not to 02:30 CEST (00:30Z)."""
    from reminders_pipeline.domain.policy import held_send_after
    from reminders_pipeline.domain.rules import parse_rule
    from reminders_pipeline.domain.zones import Zone, parse_quiet_hours

    due, start = Instant.from_unix(1792891800 - 900), Instant.from_unix(1792897200)  # 01:15Z, 03:00Z
    held = held_send_after(due, parse_rule("lead:6300"), start, parse_quiet_hours("22:00-02:30"), Zone("Europe/Berlin"))
    assert held == Instant.from_unix(1792891800) == due + 900  # 2026-10-25T01:30Z


def test_quiet_end_is_the_window_end_only_while_the_event_is_still_ahead():
    late = row("lead:3600", D + 22 * 3600 - 120, D + DAY + 9 * 3600, D + DAY + 10 * 3600, **QUIET)
    assert quiet_end(late, Instant.from_unix(D + 22 * 3600 + 180)) == Instant.from_unix(D + DAY + 7 * 3600)
    assert quiet_end(late, Instant.from_unix(D + 21 * 3600)) is None  # not inside quiet hours
    soon = row("lead:0", D + 23 * 3600, D + 23 * 3600, D + DAY, **QUIET)
    assert quiet_end(soon, Instant.from_unix(D + 23 * 3600)) is None  # the event begins before 07:00
    assert quiet_end({**late, "rule": "lead:3600!"}, Instant.from_unix(D + 22 * 3600 + 180)) is None
    at_end = row("lead:3600", D + 22 * 3600, D + DAY + 7 * 3600, D + DAY + 8 * 3600, **QUIET)
    assert quiet_end(at_end, Instant.from_unix(D + 23 * 3600)) is None  # it would go as its event begins
    by_end = row("lead:600@expiry", D + 23 * 3600, D + 20 * 3600, D + DAY + 9 * 3600, **QUIET)
    assert quiet_end(by_end, Instant.from_unix(D + 23 * 3600)) == Instant.from_unix(D + DAY + 7 * 3600)


def test_quiet_end_reads_the_window_in_the_devices_zone():
    """23:00 in New York is 03:00Z: inside the window there, which ends at 07:00 New York time (11:00Z)."""
    ny = {"tz_name": "America/New_York", "quiet_hours": "22:00-07:00"}
    late = row("lead:3600", D + DAY + 3 * 3600, D + DAY + 14 * 3600, D + DAY + 15 * 3600, **ny)
    assert quiet_end(late, Instant.from_unix(D + DAY + 3 * 3600)) == Instant.from_unix(D + DAY + 11 * 3600)


def test_a_calendar_let_through_quiet_hours_sends_inside_them():
    """``calendar_breakthrough``: the device lets this calendar through its quiet hours (``!`` per calendar)."""
    late = row("lead:3600", D + 23 * 3600, D + DAY + 9 * 3600, D + DAY + 10 * 3600, **QUIET)
    now = Instant.from_unix(D + 23 * 3600)
    assert decide({**late, "calendar_breakthrough": True}, now, LIVE) == "send"
    assert decide({**late, "calendar_breakthrough": False}, now, LIVE) == "held"
