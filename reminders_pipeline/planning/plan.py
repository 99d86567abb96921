"""What one device's queue should hold: the rows its feed and rules want, snoozes included. No
source read and no database access here: ``build.py`` reads the sources, and writes what this
decides. What becomes of the rows already queued is ``queued.py``; when a plan may be reused,
``plan_key.py`` (every device column read here must be in its ``PLANNED_FROM``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from reminders_pipeline import ledger
from reminders_pipeline.domain.calendar_settings import CalendarSettings, calendar_rules
from reminders_pipeline.domain.items import Item, ParsedFeed, address_digest
from reminders_pipeline.domain.policy import held_send_after
from reminders_pipeline.domain.rows import PlannedRow
from reminders_pipeline.domain.rules import (
    ALARM_REACH_SECONDS,
    DEFAULT_ALL_DAY_RULES,
    LEAVE,
    MAX_TRAVEL_SECONDS,
    Rule,
    agenda_rule,
    device_rules,
    is_snooze,
    known_rule,
    parse_rule,
)
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.zones import MAX_TZ_OFFSET_SECONDS, QuietHours, Zone, parse_quiet_hours, zone_of
from reminders_pipeline.planning.agenda import ITEM_PREFIX as AGENDA_ITEM
from reminders_pipeline.planning.agenda import agenda_come, agenda_day, agenda_days, agenda_item_id, agenda_row
from reminders_pipeline.sources.reader import SourceRead


@dataclass
class DevicePlan:
    """What one device's queue should hold, and what is known about its feed."""

    wanted: dict[tuple[str, str], PlannedRow]
    feed_items: dict[str, Item]  # namespaced id -> item, from sources read successfully
    ok_sources: set[int]
    subscribed: set[int]
    rules: dict[str, Rule]  # every rule in use: the device's, and the calendar alarms' it uses
    item_rules: dict[str, set[str]] = field(default_factory=dict)  # items whose alarms replace the device's rules
    uses_alarms: bool = False  # a rule outside the device's own may be a calendar alarm's
    # Rows of items whose anchor has passed, or that the item cap set aside: never queued anew,
    # only used to bring a pending row in line.
    realign: dict[tuple[str, str], PlannedRow] = field(default_factory=dict)
    feeds: dict[int, ParsedFeed] = field(default_factory=dict)  # per source read: what its absent items may be
    # Rows for an item the cap set aside (``ParsedFeed.aside``), made only for a pending row that
    # exists (``realigned``): a feed far over the cap costs its subscribers' builds nothing more.
    make_rows: Callable[[int, Item], Iterator[tuple[PlannedRow, bool]]] | None = field(default=None, repr=False)
    made: set[str] = field(default_factory=set, repr=False)  # set-aside items whose rows are made: once each
    attendees: frozenset[str] = frozenset()  # the device's addresses (``devices.attendees``)
    source_rules: dict[int, set[str]] = field(default_factory=dict)  # the rules each calendar's items take
    muted: set[int] = field(default_factory=set)  # calendars the device muted: no row, pending ones voided
    leaving: set[str] = field(default_factory=set)  # items with a travel time: a ``leave`` row
    declined: set[str] = field(default_factory=set)  # items one of them declined: no row, pending ones voided
    agenda: Rule | None = None  # the device's ``agenda@HH:MM``
    agenda_days: set[str] = field(default_factory=set)  # the days whose agenda this plan decided (item ids)
    agenda_come: set[str] = field(default_factory=set)  # the days whose agenda time has come (``agenda_come``)
    agenda_complete: bool = False  # every calendar was read: the plan decides the agenda
    # The agenda row of any day (its item id) from every calendar as read, or None for a day with
    # no event; set when the plan decides the agenda. A snooze of an agenda says what it says.
    agenda_of: Callable[[str], PlannedRow | None] | None = field(default=None, repr=False)

    def realigned(self, item_id: str, rule: str) -> PlannedRow | None:
        """The row that would bring a pending row of a begun or set-aside item in line, if any."""
        if (
            (item_id, rule) not in self.realign
            and item_id not in self.feed_items
            and self.make_rows is not None
            and item_id not in self.made
        ):
            self.made.add(item_id)
            source, own = item_id.split(":", 1)
            feed = self.feeds.get(int(source))
            raw = feed.set_aside_item(own) if feed is not None else None
            if raw is not None:
                for row, _ in self.make_rows(int(source), raw):
                    self.realign[(row["item_id"], row["rule"])] = row
        return self.realign.get((item_id, rule))


Replan = Mapping[int, frozenset[str]]  # items to plan in full despite an earlier plan: own ids by source


def namespaced(source_id: int, item_id: str) -> str:
    """Item ids are namespaced by source so two sources cannot collide."""
    return f"{source_id}:{item_id}"


def plan_device(
    device: dict[str, Any],
    subscribed: Iterable[int],
    reads: dict[int, SourceRead],
    now: Instant,
    horizon: int,
    after: Instant | None = None,
    replan: Replan | None = None,
) -> DevicePlan:
    """Resolve each item in the device's zone and apply its rules: lead rules to timed items,
    day rules to all-day items (or, for a device that uses them, the item's own calendar alarms),
    then hold for quiet hours (``policy.held_send_after``).

    ``after``: an earlier plan from the same inputs (``plan_key``) made every row due up to it.
    Only rows due later are made, and an item with none due between then and the horizon is not
    resolved; what the plan knows of the feed (``feed_items``) is then partial, so it decides no
    void but for ``replan``: items that changed since that plan (own ids by source), made in full."""
    own_rules = {r.name: r for r in rules_of(device)}
    use_alarms = bool(device.get("use_alarms"))
    zone = zone_of(device)
    quiet = parse_quiet_hours(device.get("quiet_hours"))
    calendars: Mapping[int, CalendarSettings] = device.get("calendars") or {}
    plan = DevicePlan({}, {}, set(), set(subscribed), dict(own_rules), uses_alarms=use_alarms)
    plan.attendees = frozenset(address_digest(a) for a in (device.get("attendees") or "").split())
    plan.rules[LEAVE_RULE.name] = LEAVE_RULE
    per_source: dict[int, _Calendar] = {}
    for source_id in plan.subscribed:
        calendar = calendars.get(source_id)
        if calendar is not None and calendar.muted:
            plan.muted.add(source_id)
            continue
        rules = calendar_rules(own_rules, calendar)
        plan.rules.update(rules)
        plan.source_rules[source_id] = {*rules, LEAVE_RULE.name}
        per_source[source_id] = _Calendar(
            rules,
            None if calendar is not None and calendar.breakthrough else quiet,
            (calendar.travel_seconds if calendar is not None else None) or 0,
        )
        read = reads.get(source_id)
        feed = read.feed if read is not None else None
        if feed is None:
            continue
        plan.ok_sources.add(source_id)
        plan.feeds[source_id] = feed
        again = replan.get(source_id, frozenset()) if replan else frozenset()
        until = (now + horizon).whole_seconds
        reach = {kind: _reach(r for r in (*rules.values(), LEAVE_RULE) if r.all_day == kind) for kind in (False, True)}
        for raw in feed.items:
            since = None if raw.id in again else after
            if since is not None:
                alarmed = use_alarms and bool(raw.alarms)
                if _left_to_other_steps(raw, since, until + 1 + (_alarm_reach(raw) if alarmed else reach[raw.all_day])):
                    continue
                if alarmed and _maybe_new_to_the_read(raw, since):
                    since = None
            for row, begun in _rows_for(
                plan, device, source_id, raw, per_source[source_id], use_alarms, zone, now, horizon, since
            ):
                (plan.realign if begun else plan.wanted)[(row["item_id"], row["rule"])] = row
    plan.make_rows = lambda source_id, raw: _rows_for(
        plan, device, source_id, raw, per_source[source_id], use_alarms, zone, now, None
    )
    plan.agenda = agenda_rule(device["extra_rules"].split())
    plan.agenda_complete = plan.agenda is not None and plan.ok_sources >= per_source.keys()
    if plan.agenda is not None and plan.agenda_complete:
        # A changed item may be on any day the horizon holds: a re-plan by item decides them all.
        _plan_agenda(plan, device, plan.agenda, zone, quiet, now, horizon, after if replan is None else None)
    return plan


def _agenda_items(plan: DevicePlan, zone: Zone) -> list[Item]:
    """Every item an agenda lists: the device's calendars' but those it muted or declined."""
    return [
        raw.for_local(zone)
        for source_id in plan.ok_sources - plan.muted
        for raw in plan.feeds[source_id].items
        if not raw.declined_by(plan.attendees)
    ]


def _plan_agenda(
    plan: DevicePlan,
    device: dict[str, Any],
    rule: Rule,
    zone: Zone,
    quiet: QuietHours | None,
    now: Instant,
    horizon: int,
    after: Instant | None,
) -> None:
    """The agenda of each day whose time the horizon reaches (past ``after``), from every item of
    the device's calendars but those it declined; made only when every calendar was read."""
    plan.agenda_come = agenda_come(rule, zone, now)
    listed = cache(lambda: _agenda_items(plan, zone))  # made once, for the first day that needs them
    plan.agenda_of = lambda item_id: agenda_row(device, rule, agenda_day(item_id), listed(), zone, quiet)
    for day in agenda_days(rule, zone, now, horizon, after):
        row = agenda_row(device, rule, day, listed(), zone, quiet)
        plan.agenda_days.add(row["item_id"] if row else agenda_item_id(day))
        if row is not None:
            plan.wanted[(row["item_id"], row["rule"])] = row


LEAVE_RULE = parse_rule(LEAVE)


@dataclass(frozen=True)
class _Calendar:
    """What one subscribed calendar's items are planned with."""

    rules: dict[str, Rule]  # the device's, or the calendar's own (``calendar_settings.calendar_rules``)
    quiet: QuietHours | None  # None when the calendar breaks through them
    travel_seconds: int  # the subscription's travel time, for items that state none (0: none)


def _left_to_other_steps(raw: Item, after: Instant, beyond: int) -> bool:
    """Not resolved by a step, which makes only rows whose time before any hold is after
    ``after`` and within the horizon: an item with every such time by ``after`` (a timed item's
    lead rules fall by its start or end; an all-day item's day rules by a day after its start), or
    past the horizon (it starts at or past ``beyond``, its rules' reach included). A floating time
    moves by the zone's offset."""
    shift = MAX_TZ_OFFSET_SECONDS if raw.floating else 0
    latest = max(raw.starts_at, raw.expires_at) + (86400 if raw.all_day else 0) + shift
    return latest <= after.unix or raw.starts_at - shift >= beyond


def _reach(rules: Iterable[Rule]) -> int:
    """How far before an item's start the rules it takes can fall (lead rules a timed item's, day
    rules an all-day one's)."""
    return max((r.reach_seconds for r in rules), default=0)


def _alarm_reach(raw: Item) -> int:
    """How far before its start an item's own alarms (or its time to leave) can fall."""
    return max(MAX_TRAVEL_SECONDS, *(known_rule(name).reach_seconds for name in raw.alarms))


def _maybe_new_to_the_read(raw: Item, after: Instant) -> bool:
    """Whether an alarmed calendar item may lie past the occurrences the last plan's read yielded,
    with an alarm early enough to fall by ``after`` (its ``planned_until``). That read yielded each
    series with alarms up to its longest lead past ``after``, but no more than
    ``ALARM_REACH_SECONDS`` (``ics_items.alarm_reaches``): an item starting within that bound was in it,
    and one past it has such an alarm only if it leads by more. Such an item is planned in full,
    as a full plan would. (A parse cached by an earlier parser read no further: ``PARSE_VERSION``
    makes every source be parsed again, and every device plan in full, once.) A floating time is
    widened by the most any zone moves it, more than the parser's own 14 hours."""
    shift = MAX_TZ_OFFSET_SECONDS if raw.floating else 0
    return raw.starts_at + shift > after.whole_seconds + ALARM_REACH_SECONDS


def _rows_for(
    plan: DevicePlan,
    device: dict[str, Any],
    source_id: int,
    raw: Item,
    calendar: _Calendar,
    use_alarms: bool,
    zone: Zone,
    now: Instant,
    horizon: int | None,
    after: Instant | None = None,
) -> Iterator[tuple[PlannedRow, bool]]:
    """One item's rows for this device (within ``horizon``, if given, and due after ``after``, if
    given), each with whether its anchor has passed; a kept item is entered in
    ``plan.feed_items``, a set-aside one is not."""
    item_id = namespaced(source_id, raw.id)
    if raw.declined_by(plan.attendees):
        plan.declined.add(item_id)
        return
    item = raw.for_local(zone)
    if horizon is not None:
        plan.feed_items[item_id] = item
    starts, expires = item.starts, item.expires
    travel = 0 if raw.all_day else raw.travel_seconds or calendar.travel_seconds
    rules = _item_rules(plan, item_id, raw, calendar.rules, use_alarms)
    if travel:
        plan.leaving.add(item_id)
        rules.append(LEAVE_RULE)
    for rule in rules:
        send_after = starts - travel if rule.leave else _send_after(rule, raw, starts, expires, zone)
        if horizon is not None and send_after > now + horizon:
            continue
        if after is not None and send_after <= after:
            continue
        anchor = rule.anchor_time(starts, expires)
        yield (
            {
                "device_id": device["id"],
                "source_id": source_id,
                "item_id": item_id,
                "rule": rule.name,
                "send_after": held_send_after(send_after, rule, anchor, calendar.quiet, zone),
                "event_at": starts,
                "expires_at": expires,
                "title": item.title,
                "body": item.body,
                "item_at": _own_anchor(rule, raw) if raw.floating else None,
            },
            anchor <= now,
        )


def _item_rules(plan: DevicePlan, item_id: str, raw: Item, rules: dict[str, Rule], use_alarms: bool) -> list[Rule]:
    """The calendar's alarms when the device uses them and the item has any; else the device's
    rules of the item's kind (day rules for all-day items, lead rules for timed ones)."""
    if use_alarms and raw.alarms:
        own = [known_rule(name) for name in raw.alarms]
        plan.rules.update((r.name, r) for r in own)
        plan.item_rules[item_id] = {r.name for r in own} | {LEAVE_RULE.name}
        return own
    return [r for r in rules.values() if r.all_day == raw.all_day]


def rules_of(device: dict[str, Any]) -> list[Rule]:
    """A build row's rules: lead rules and all-day rules (the column may be absent in old callers)."""
    all_day = device.get("all_day_rules")
    return device_rules(
        device["reminder_lead_seconds"],
        device["extra_rules"].split(),
        DEFAULT_ALL_DAY_RULES if all_day is None else all_day.split(),
    )


def _send_after(rule: Rule, raw: Item, starts: Instant, expires: Instant, zone: Zone) -> Instant:
    """A day rule names a local time on a local day (DST exact); a lead rule an offset from an instant."""
    if rule.anchor == "day" and raw.floating:
        return Instant.from_unix(zone.to_unix(rule.day_wall(raw.starts_at)))
    if rule.anchor == "day":
        return starts - rule.lead_seconds + rule.at_minutes * 60
    return rule.anchor_time(starts, expires) - rule.lead_seconds


def _own_anchor(rule: Rule, raw: Item) -> Instant:
    """A floating item's own time at the rule's anchor, before any zone fixes it (its wall time,
    stored as if it were UTC): what must move for a settled row to be re-armed
    (``ledger.rearm_anchor``'s counterpart)."""
    return Instant.from_unix(raw.expires_at if rule.anchor == "expiry" else raw.starts_at)


# What voids a snooze that its item's return undoes: the item left the feed, or the agenda's day
# emptied. Any other end of it (sent, Done, declined, muted, a dead token) is the snooze's last.
REVIVED_BY_RETURN = ledger.REVIVABLE_VOIDS


def want_snoozes(existing: Iterable[dict[str, Any]], plans: Mapping[str, DevicePlan], now: Instant) -> None:
    """Add each device's snoozes still to send to what its plan wants, like the rows of its rules:
    at the time the person asked for (their own ``send_after``), with their item as the plan read
    it (an agenda's as it now lists the day). So the build's upsert brings a pending one in line
    (moved, retitled), and a voided one back to pending when its item is back (``REVIVED_BY_RETURN``,
    while the item is not over), with the attempts it spent. One sent, settled otherwise, or in
    flight is never wanted; one whose item the plan cannot show is left to ``queued.void_reason``."""
    for row in existing:
        if not is_snooze(row["rule"]):
            continue
        revived = (
            row["status"] == "settled" and row["outcome"] == "voided" and row["outcome_detail"] in REVIVED_BY_RETURN
        )
        if row["status"] != "pending" and not revived:
            continue
        plan = plans[row["device_id"]]
        item = _snoozed_item(row["item_id"], plan)
        if item is None or (revived and item["expires_at"] <= now):
            continue
        plan.wanted[(row["item_id"], row["rule"])] = {
            "device_id": row["device_id"],
            "source_id": row["source_id"],
            "item_id": row["item_id"],
            "rule": row["rule"],
            "send_after": row["send_after"],
            "event_at": item["event_at"],
            "expires_at": item["expires_at"],
            "title": item["title"],
            "body": item["body"],
            "item_at": None,
        }


def _snoozed_item(item_id: str, plan: DevicePlan) -> Mapping[str, Any] | None:
    """A snooze's item as the plan read it: a feed's item, or the day's agenda; None when the plan
    cannot show it (gone, declined, muted, a read that failed, a day with no event)."""
    if item_id.startswith(AGENDA_ITEM):
        return plan.agenda_of(item_id) if plan.agenda_of is not None and plan.agenda_complete else None
    item = plan.feed_items.get(item_id)
    if item is None:
        return None
    return {"event_at": item.starts, "expires_at": item.expires, "title": item.title, "body": item.body}
