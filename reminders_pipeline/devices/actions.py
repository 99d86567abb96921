"""Snooze and Done: what a person does with a sent alert (the app's ``REMINDER`` category).

Each alert carries its row's id and an action token (``domain.action_tokens``): an HMAC of the device,
the row and the instant of the event the alert shows, keyed by the device's credential hash, with
that instant after a dot. The app posts the action back with the device's credential and the token,
so a row id alone acts on nothing, and Done knows which occurrence the person saw even after a
build re-armed the row for a moved event; the token is never recorded, though whoever holds the
credential can compute it. A new credential (``credential rotate``) ends the tokens of alerts sent
before it. A token without the instant (alerts sent before tokens carried it) names the event as
the row has it now.

Snooze queues one new row, ``snooze:N`` (the item's N-th snooze on this device, at most
``MAX_SNOOZES``), of the item as its calendar was last read (that one item of the cached parse;
a sent row keeps it as sent; one since cancelled or declined, or of a calendar the device dropped,
is refused; an agenda's lists its day as the device's calendars were last read), sent at the
time asked with the same guards as any reminder (claimed once, quiet hours, never after the
item's end). From then on the build plans it like a rule's row
(``plan.want_snoozes``). A repeated Snooze of one alert makes no second row: the row it made is
the answer (``uq_queue_snoozed_from``). Done settles the occurrence's other pending reminders on
the device ``acknowledged`` (repeats, snoozes, later leads): those of the instant the person saw,
not those a build has since moved to another time by the re-arm threshold (another appointment);
one already claimed is on its way and goes. Done on an alert of a row re-armed since is answered
(it settles what is left of that instant); Snooze of one is refused ``event_moved``: the re-armed
row's own alert is the one to snooze. Both refuse a late or foreign action and change nothing.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from reminders_pipeline import ledger
from reminders_pipeline.domain.action_tokens import action_token, shown_by
from reminders_pipeline.domain.calendar_settings import CalendarSettings
from reminders_pipeline.domain.items import Item, ParsedFeed, address_digest, series_key
from reminders_pipeline.domain.rules import MAX_SNOOZES, Rule
from reminders_pipeline.domain.times import MAX_UNIX, Instant
from reminders_pipeline.domain.zones import zone_of
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.plan import plan_device
from reminders_pipeline.sources.reader import SourceRead

MAX_SNOOZE_SECONDS = 7 * 86400
_ATTEMPTS = 3  # a concurrent snooze of another alert of the item may take the next rule name first


class ActionError(Exception):
    """An action refused: ``status`` is the HTTP status, ``code`` the error's name."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


@dataclass(frozen=True)
class Snoozed:
    row_id: int  # the snoozed alert's row
    snooze_id: int
    rule: str
    send_after: Instant
    created: bool  # False: a repeated request, answered with the row the first one made

    def as_dict(self) -> dict[str, Any]:
        return {
            "row_id": self.row_id,
            "snooze": {"id": self.snooze_id, "rule": self.rule, "send_after": self.send_after.whole_seconds},
            "created": self.created,
        }


def _acted_on(conn: Any, device_id: str, row_id: int, token: str | None, now: Instant) -> dict[str, Any]:
    """The row an alert names, with ``shown``, the event's instant the alert showed; or
    ``ActionError``: 404 for a row of no alert of this device, 401 for a wrong token, 409 for a row
    that sent nothing or an item already over. ``token`` None: an operator's action (the CLI),
    which needs none and means the row as it stands. A row may have sent its alert without being
    settled ``sent`` (``ledger.acted_on``'s ``may_have_gone``): its settlement is not written yet
    (the provider's answer is slower than the phone) or never will be (its claimer died after the
    send). An alert of an instant the row no longer holds was sent before a build re-armed the
    row (a sent row's event changes only so): it is answered whatever the re-armed row's state."""
    row = ledger.acted_on(conn, row_id)
    if row is None or row["device_id"] != device_id or not row["registered"]:
        raise ActionError(404, "no_reminder", f"device {device_id!r} has no reminder {row_id}")
    shown = None if token is None else shown_by(token)
    if token is not None:
        expected = action_token(row["credential_hash"] or "", device_id, row_id, shown)
        if not row["credential_hash"] or not hmac.compare_digest(token.encode(), expected.encode()):
            raise ActionError(401, "wrong_action_token", "the action token is not this reminder's")
    if shown is None:
        shown = row["event_at"]
    if row["outcome"] != "sent" and not row["may_have_gone"] and shown == row["event_at"]:
        raise ActionError(409, "not_sent", f"reminder {row_id} sent no alert: nothing to act on")
    if now >= row["expires_at"]:
        raise ActionError(409, "event_ended", f"the event of reminder {row_id} is over")
    return {**row, "shown": shown}


def _as_last_read(conn: Any, row: dict[str, Any], now: Instant) -> dict[str, Any]:
    """The row's item as its calendar was last read (that one item of ``sources.feed_cache``), fixed
    in the device's zone: a sent row keeps the item as it was sent, and the item may since have
    moved a little (too little to be sent again), been retitled, cancelled or declined.
    ``ActionError`` (409) for an item no longer to remind of, or of a calendar the device has
    dropped. An agenda is its day as last read (``_agenda_as_last_read``)."""
    if row["source_id"] is None:
        return _agenda_as_last_read(conn, row, now)
    if not row["subscribed"]:
        raise ActionError(409, "unsubscribed", "the device no longer subscribes to this reminder's calendar")
    own_id = str(row["item_id"]).split(":", 1)[1]
    cached = ledger.item_as_read(conn, row["source_id"], own_id)
    raw = None if cached is None else Item.from_json(cached)
    attendees = frozenset(address_digest(a) for a in (row["attendees"] or "").split())
    if raw is None and not row["calendar_muted"] and _held(conn, row, own_id):
        return _as_sent(row)
    if raw is None or row["calendar_muted"] or raw.declined_by(attendees):
        raise ActionError(409, "event_changed", "the event is no longer in its calendar (cancelled, declined or muted)")
    item = raw.for_local(zone_of(row))
    if now >= item.expires:
        raise ActionError(409, "event_ended", f"the event of reminder {row['id']} is over")
    return {"event_at": item.starts, "expires_at": item.expires, "title": item.title, "body": item.body}


def _agenda_as_last_read(conn: Any, row: dict[str, Any], now: Instant) -> dict[str, Any]:
    """An agenda's day as the device's calendars were last read (each one's cached parse) and as
    the device is set now, worded as a build would: a snooze of it lists what the day holds now,
    and one of a day left with no event is refused (409), as a snooze of a cancelled event is.
    While one of those calendars has never been read whole, the day is as the agenda was sent: a
    build too leaves agendas as they are then. Reads every cached parse of the device's
    calendars, which only an agenda's snooze needs."""
    found = ledger.select_build_devices(conn, device_ids=[row["device_id"]])
    if not found:
        return _as_sent(row)
    device, device_id = found[0], row["device_id"]
    own = ledger.calendar_settings(conn, [device_id])[device_id]
    device["calendars"] = {sid: CalendarSettings.of_columns(c) for sid, c in sorted(own.items())}
    subscribed = ledger.subscriptions(conn, [device_id])[device_id]
    reads = {
        sid: SourceRead(sid, source["url"], feed=feed)
        for sid, source in ledger.sources_by_id(conn, subscribed).items()
        if (feed := _cached_feed(source["feed_cache"])) is not None
    }
    plan = plan_device(device, subscribed, reads, now, 0, after=now)
    if plan.agenda_of is None:  # no agenda rule now, or a calendar with no read: as sent
        return _as_sent(row)
    day = plan.agenda_of(row["item_id"])
    if day is None:
        raise ActionError(409, "event_changed", "the agenda's day holds no event now (cancelled, declined or muted)")
    return {**_as_sent(row), "title": day["title"], "body": day["body"]}


def _cached_feed(cached: str | None) -> ParsedFeed | None:
    """A calendar's cached parse, or None for one never read (or unreadable, as a widget's feed
    takes it: read again by the next build)."""
    try:
        return None if cached is None else ParsedFeed.from_json(cached)
    except (ValueError, KeyError, TypeError):
        return None


def _held(conn: Any, row: dict[str, Any], own_id: str) -> bool:
    """Whether the last read lacks the item only as the build keeps its rows as they were (a
    series dropped alone, an item the cap cut): the event may still be in its calendar."""
    return ledger.held_as_read(conn, row["source_id"], own_id, series_key(own_id), row["event_at"].whole_seconds)


def _as_sent(row: dict[str, Any]) -> dict[str, Any]:
    """The item as its row has it (``_acted_on`` refused it if over): an agenda, or an event the
    last read kept as it was."""
    return {k: row[k] for k in ("event_at", "expires_at", "title", "body")}


def snooze(
    db: Database,
    device_id: str,
    row_id: int,
    token: str | None,
    *,
    seconds: int | None = None,
    until: Instant | None = None,
    now: Instant | None = None,
) -> Snoozed:
    """Queue the alert again ``seconds`` from now, or at ``until``; one row however often asked."""
    now = now or Instant.now()
    with db.read() as conn:  # refused without taking the write lock
        origin = _acted_on(conn, device_id, row_id, token, now)
        if origin["shown"] != origin["event_at"]:
            raise ActionError(409, "event_moved", "the event moved since this alert: snooze its newer alert")
        at = _snooze_time(now, seconds, until)
        item = _as_last_read(conn, origin, now)
    with db.write() as conn:
        for _ in range(_ATTEMPTS):
            made = ledger.snooze_of(conn, row_id)
            if made is not None:
                return Snoozed(row_id, made["id"], made["rule"], made["send_after"], created=False)
            if at >= item["expires_at"]:
                raise ActionError(422, "invalid", "that is after the event's end", field=_field(seconds))
            count = ledger.count_snoozes(conn, device_id, origin["item_id"])
            if count >= MAX_SNOOZES:
                raise ActionError(409, "snooze_limit", f"this reminder was snoozed {MAX_SNOOZES} times already")
            rule = Rule(0, "expiry", snooze=count + 1).name
            snooze_id = ledger.insert_snooze(conn, row_id, rule, at, item, now)
            if snooze_id is not None:
                return Snoozed(row_id, snooze_id, rule, at, created=True)
    raise ActionError(409, "busy", "other snoozes of this event were being made: try again")


def _snooze_time(now: Instant, seconds: int | None, until: Instant | None) -> Instant:
    """When the snooze asked for goes, or ``ActionError`` (422) for a time that cannot be one."""
    if (seconds is None) == (until is None):
        raise ActionError(422, "invalid", "give seconds or until, not both", field="seconds")
    if seconds is not None and not 0 < seconds <= MAX_SNOOZE_SECONDS:
        raise ActionError(422, "invalid", f"seconds must be 1 to {MAX_SNOOZE_SECONDS}", field="seconds")
    at = now + seconds if seconds is not None else until
    assert at is not None
    if at <= now:
        raise ActionError(422, "invalid", "until must be in the future", field="until")
    return at


def _field(seconds: int | None) -> str:
    return "seconds" if seconds is not None else "until"


def done(
    db: Database, device_id: str, row_id: int, token: str | None, *, same_within: int, now: Instant | None = None
) -> int:
    """Settle the occurrence's other pending reminders on this device ``acknowledged``; how many.

    Only those whose event is less than ``same_within`` seconds
    (``REMINDERS_REARM_THRESHOLD_SECONDS``) from the one the alert showed, as a build tells a small
    move from a re-arm: a build that moved the event further, before or during this call, made
    another appointment of it, whose reminders stay. The statement checks it itself, so a build
    committing between the read here and the write cannot widen it."""
    now = now or Instant.now()
    with db.read() as conn:  # refused without taking the write lock
        origin = _acted_on(conn, device_id, row_id, token, now)
    seen: Instant = origin["shown"]
    near = same_within * 1000  # kept within the instants there are: a token may name 1970 or 9999
    window = (Instant(max(0, seen.ms - near)), Instant(min(MAX_UNIX * 1000, seen.ms + near)))
    with db.write() as conn:
        return ledger.acknowledge(conn, device_id, origin["item_id"], window, now)
