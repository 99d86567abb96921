"""Breaks the model test (test_model.py) found, each kept as a plain example."""

from __future__ import annotations

import pytest

from reminders_pipeline.planning import build
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import drain
from reminders_pipeline.sources.ics import parse_ics_feed

from .support import NOW, NOW_S, at, by_key, device, item, rows

CANCELLED_PAST = """BEGIN:VEVENT
UID:gone-{n}
DTSTAMP:20260101T000000Z
DTSTART:20260910T043000Z
DTEND:20260910T050000Z
SUMMARY:Cancelled {n}
STATUS:CANCELLED
END:VEVENT
"""

FUTURE = """BEGIN:VEVENT
UID:future-{n}
DTSTAMP:20260101T000000Z
DTSTART:20260910T1{n}0000Z
DTEND:20260910T1{n}3000Z
SUMMARY:Future {n}
END:VEVENT
"""


def calendar(cancelled: int, future: int) -> str:
    events = [CANCELLED_PAST.format(n=n) for n in range(cancelled)] + [FUTURE.format(n=n) for n in range(future)]
    return "BEGIN:VCALENDAR\nVERSION:2.0\nPRODID:-//t//EN\n" + "".join(events) + "END:VCALENDAR\n"


def test_cancelled_events_take_no_place_under_the_item_cap() -> None:
    """Two cancelled meetings from earlier this morning are not items: with a cap of two, the two
    meetings still ahead are the items kept (the model found the cap counting them)."""
    feed = parse_ics_feed(calendar(cancelled=2, future=2).encode(), NOW_S, NOW_S + 86400, max_items=2)
    assert sorted(i.id.split("/")[0] for i in feed.items) == ["future-0", "future-1"]
    assert "over_item_cap" not in feed.rejected


def test_cancelled_events_do_not_void_a_reminder_through_the_cap(db, settings, feeds) -> None:  # type: ignore[no-untyped-def]
    """Through the build: a calendar cancels a past meeting; the reminder of a meeting ahead,
    queued while the calendar was under the cap, is not voided ``left_feed``."""
    url = feeds.calendar("/cal.ics", calendar(cancelled=0, future=2))
    capped = settings.__class__(**{**settings.__dict__, "source_max_items": 2})
    device(db, capped, sources=[url])
    build.build(db, capped, now=NOW)
    feeds.calendar("/cal.ics", calendar(cancelled=1, future=2))
    build.build(db, capped, now=NOW)
    rows = by_key(db)
    assert {k[0].split("/")[0]: r["status"] for k, r in rows.items()} == {"future-0": "pending", "future-1": "pending"}


def test_an_agenda_whose_only_event_is_deleted_is_not_sent(db, settings, feeds) -> None:  # type: ignore[no-untyped-def]
    """An event a day and an hour ahead, past every lead rule's horizon, puts only the morning
    agenda of its day in the queue; the event is deleted before that morning. The agenda of a day
    with no event left is voided ``empty_day``, never sent: the model (REMINDERS_MODEL_SEED=2)
    found it sent, and so is it here, on both databases."""
    live = settings.with_(enabled=True)
    starts = 86400 + 3660  # 2026-09-11T09:01Z
    url = feeds.items("/items.json", [item("far", starts)])
    device(db, live, sources=[url], lead=0, rules=("agenda@02:30",))
    build.build(db, live, now=NOW)
    feeds.items("/items.json", [])
    morning = at(86400 - 8 * 3600 + 2 * 3600 + 1800)  # 2026-09-11T02:30Z
    build.build(db, live, now=morning)
    sender = RecordingSender()
    drain(db, live, lambda: sender, now=morning)
    agendas = [r for r in rows(db) if r["rule"] == "agenda"]
    assert agendas and all((r["status"], r["outcome"]) != ("settled", "sent") for r in agendas), agendas


def _series(rrule: str) -> str:
    return (
        "BEGIN:VCALENDAR\nVERSION:2.0\nPRODID:-//t//EN\nBEGIN:VEVENT\nUID:standup\nDTSTAMP:20260101T000000Z\n"
        f"DTSTART:20260910T083000Z\nDURATION:PT15M\nSUMMARY:Standup\nRRULE:{rrule}\nEND:VEVENT\n"
        "BEGIN:VEVENT\nUID:review\nDTSTAMP:20260101T000000Z\nDTSTART:20260910T160000Z\nDURATION:PT1H\n"
        "SUMMARY:Review\nEND:VEVENT\nEND:VCALENDAR\n"
    )


def test_a_snooze_of_a_series_the_build_dropped_as_a_flood_takes_the_event_as_sent(db, settings, feeds) -> None:  # type: ignore[no-untyped-def]
    """A daily standup's alert went; its calendar then serves the series as FREQ=SECONDLY, which
    the build drops alone (``runaway_series``) and keeps the series' rows as they were. The
    series may still be in the source, so a snooze of the sent alert is made from the row as sent,
    not refused ``event_changed`` (the model, at 2,000 examples: start, build,
    flood_series(on=True), cron_tick(15), snooze)."""
    from reminders_pipeline.devices import actions

    settings = settings.with_(enabled=True)
    url = feeds.calendar("/standup.ics", _series("FREQ=DAILY;COUNT=5"))
    device(db, settings, sources=[url])
    build.build(db, settings, now=NOW)
    sender = RecordingSender()
    drain(db, settings, lambda: sender, now=NOW)
    (sent,) = [r for r in rows(db) if r["outcome"] == "sent"]  # the standup's; the review is ahead
    feeds.calendar("/standup.ics", _series("FREQ=SECONDLY"))
    summary = build.build(db, settings, now=at(900))
    assert summary.items_rejected == {"runaway_series": 1}
    made = actions.snooze(db, sent["device_id"], sent["id"], None, seconds=60, now=at(900))
    assert made.created
    (snoozed,) = [r for r in rows(db) if r["id"] == made.snooze_id]
    assert (snoozed["title"], snoozed["event_at"]) == ("Standup", sent["event_at"])


def test_a_snooze_of_an_agenda_whose_day_emptied_is_not_sent(db, settings, feeds) -> None:  # type: ignore[no-untyped-def]
    """The 07:00 agenda went, listing the day's one event; the event is deleted and a build reads
    the day empty (the agenda, already sent, stays sent). Snoozed then, the agenda would repeat an
    event that is gone: the snooze is refused or voided, never sent. The model (CI's 200 examples,
    overlapping_builds(act='snooze') then send_next_due) found it made and sent, AGENDA_EMPTY_DAY."""
    from reminders_pipeline.devices import actions

    live = settings.with_(enabled=True)
    morning = 23 * 3600  # 2026-09-11T07:00Z
    url = feeds.items("/items.json", [item("standup", morning + 3 * 3600)])
    device(db, live, sources=[url], lead=0, rules=("agenda@07:00",))
    build.build(db, live, now=at(morning - 1800))
    sender = RecordingSender()
    drain(db, live, lambda: sender, now=at(morning + 1))
    (agenda,) = [r for r in rows(db) if r["rule"] == "agenda" and r["outcome"] == "sent"]
    feeds.items("/items.json", [])
    build.build(db, live, now=at(morning + 600))
    try:
        actions.snooze(db, agenda["device_id"], agenda["id"], None, seconds=600, now=at(morning + 660))
    except actions.ActionError:
        pass  # refused: as for a cancelled event
    build.build(db, live, now=at(morning + 1200))
    drain(db, live, lambda: sender, now=at(morning + 1320))
    snoozes = [r for r in rows(db) if r["rule"].startswith("snooze")]
    assert all(r["outcome"] != "sent" for r in snoozes), snoozes


@pytest.mark.parametrize("shift", [1200, 300])
def test_done_on_an_alert_from_before_a_rearm_leaves_the_new_times_reminders(db, settings, feeds, shift) -> None:  # type: ignore[no-untyped-def]
    """The hour's alert of a 09:30 meeting went; the meeting moves to 09:50, past the re-arm
    threshold, and the hour's reminder goes again for the new time. Done pressed on the first alert,
    still on screen, is about the 09:30 occurrence: it settles nothing of 09:50, whose 10-minute
    reminder stays pending; so too for a move of exactly the threshold (300 s), which re-arms. The
    model (act_around_change(action='done', change='rearm')) found it
    acknowledged, DONE_MISSED: the re-armed row keeps the first alert's id, so its Done reads the
    new time. The alert's action token names the instant it showed, and Done settles that one."""
    from reminders_pipeline.devices import actions

    live = settings.with_(enabled=True)
    url = feeds.items("/items.json", [item("standup", 5400)])  # 09:30Z
    device(db, live, sources=[url], lead=3600, rules=("lead:600",))
    build.build(db, live, now=NOW)
    sender = RecordingSender()
    drain(db, live, lambda: sender, now=at(1801))  # 08:30:01Z: the hour's alert
    (first,) = [r for r in rows(db) if r["outcome"] == "sent"]
    token = sender.sent[0].payload["reminder"]["token"]
    assert shift >= live.rearm_threshold_seconds == 300
    feeds.items("/items.json", [item("standup", 5400 + shift)])  # 09:50Z, or 09:35Z
    build.build(db, live, now=at(1900))
    drain(db, live, lambda: sender, now=at(1801 + shift))  # the hour's alert again, for the new time
    actions.done(db, first["device_id"], first["id"], token, same_within=live.rearm_threshold_seconds, now=at(3100))
    (ten,) = [r for r in rows(db) if r["rule"] == "lead:600"]
    assert (ten["status"], ten["outcome"]) == ("pending", None), ten


def test_done_on_an_alert_whose_row_waits_to_go_again_is_answered_and_settles_nothing_new(db, settings, feeds) -> None:  # type: ignore[no-untyped-def]
    """As above, but Done comes before the re-armed reminder's new send: the alert was shown, so
    Done is answered (nothing of the old time is left to settle), and the row still goes for 09:50."""
    from reminders_pipeline.devices import actions

    live = settings.with_(enabled=True)
    url = feeds.items("/items.json", [item("standup", 5400)])
    device(db, live, sources=[url], lead=3600, rules=("lead:600",))
    build.build(db, live, now=NOW)
    sender = RecordingSender()
    drain(db, live, lambda: sender, now=at(1801))
    (first,) = [r for r in rows(db) if r["outcome"] == "sent"]
    token = sender.sent[0].payload["reminder"]["token"]
    feeds.items("/items.json", [item("standup", 6600)])
    build.build(db, live, now=at(1900))
    with pytest.raises(actions.ActionError) as refused:  # the re-armed row's own alert is the one to snooze
        actions.snooze(db, first["device_id"], first["id"], token, seconds=60, now=at(1950))
    assert refused.value.code == "event_moved"
    settled = actions.done(
        db, first["device_id"], first["id"], token, same_within=live.rearm_threshold_seconds, now=at(1950)
    )
    assert settled == 0
    drain(db, live, lambda: sender, now=at(3001))
    again = {r["id"]: r for r in rows(db)}[first["id"]]
    assert (again["outcome"], again["event_at"]) == ("sent", at(6600)), again
