"""What becomes of rows already queued when a device is planned again: which pending rows are
voided and why, which are brought in line with their item as now read, and which a write may leave
alone. Decided from the plan (``plan.DevicePlan``) and the rows alone; ``build.py`` writes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from reminders_pipeline import ledger
from reminders_pipeline.domain.rows import PlannedRow
from reminders_pipeline.domain.rules import (
    AGENDA,
    expiry_anchored,
    is_agenda,
    is_snooze,
)
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.agenda import ITEM_PREFIX as AGENDA_ITEM
from reminders_pipeline.planning.plan import LEAVE_RULE, DevicePlan


def void_reason(row: dict[str, Any], plan: DevicePlan, now: Instant) -> str | None:
    """Why a pending row no longer belongs, or None to leave it.

    A failed read never voids. A row of a subscribed source whose read failed is voided only for
    what the device itself changed: a rule it dropped, when no calendar alarm can have given that
    rule (the device does not use alarms, so a successful read would void it all the same). For a
    device using alarms a rule outside its own may be the calendar's, and only a successful read
    can say: the row waits for one. A row whose item is still in the feed but has begun is left for
    the drain, which settles it with the true reason. Nor does an item the feed holds without
    carrying it void (``ParsedFeed.holds``): one the item cap cut, or one of a rejected series.
    """
    if row["item_id"].startswith(AGENDA_ITEM):
        return _agenda_void(row, plan, now)
    if row["source_id"] not in plan.subscribed:
        return "source_removed"
    if row["source_id"] in plan.muted:
        return "muted"
    if is_snooze(row["rule"]):
        return _snooze_void(row, plan)
    its_rules = plan.source_rules[row["source_id"]]
    if row["source_id"] not in plan.ok_sources:
        return "rule_removed" if row["rule"] not in its_rules and not plan.uses_alarms else None
    if row["item_id"] in plan.declined:
        return "declined"
    if row["rule"] not in plan.rules or (row["rule"] not in its_rules and row["item_id"] not in plan.item_rules):
        return "rule_removed"
    if (row["item_id"], row["rule"]) in plan.wanted:
        return None
    item = plan.feed_items.get(row["item_id"])
    if item is None:
        own_id = row["item_id"].split(":", 1)[1]
        return None if plan.feeds[row["source_id"]].holds(own_id, row["event_at"].whole_seconds) else "left_feed"
    if row["item_id"] in plan.item_rules and row["rule"] not in plan.item_rules[row["item_id"]]:
        return "rule_removed"  # the calendar dropped that alarm
    if row["rule"] == LEAVE_RULE.name and row["item_id"] not in plan.leaving:
        return "rule_removed"  # the travel time is gone
    if plan.rules[row["rule"]].anchor_time(item.starts, item.expires) <= now:
        return None
    return "out_of_horizon"


def _agenda_void(row: dict[str, Any], plan: DevicePlan, now: Instant) -> str | None:
    """An agenda (or a snooze of one) stands while the device keeps the rule and its day holds an
    event, as far as a plan that read every calendar can tell. One no longer wanted whose time is
    ahead left the horizon (a new zone moved it): made again once the horizon reaches it."""
    if plan.agenda is None:
        return "rule_removed"
    if plan.agenda_complete and is_snooze(row["rule"]):
        return None if (row["item_id"], row["rule"]) in plan.wanted else "empty_day"  # (``want_snoozes``)
    if not plan.agenda_complete or (row["item_id"], AGENDA) in plan.wanted:
        return None
    if row["item_id"] in plan.agenda_come:  # held for quiet hours or due: the drain settles it, as it reads
        return "empty_day" if _day_went(row, plan) else None
    if row["item_id"] in plan.agenda_days:
        return "empty_day"
    return "out_of_horizon" if is_agenda(row["rule"]) and row["send_after"] > now else None


def _day_went(row: dict[str, Any], plan: DevicePlan) -> bool:
    """Whether no event of a come agenda's day is left in the calendars as read (those over before
    the read are not read): the agenda would list what is no longer there."""
    return is_agenda(row["rule"]) and plan.agenda_of is not None and plan.agenda_of(row["item_id"]) is None


def _snooze_void(row: dict[str, Any], plan: DevicePlan) -> str | None:
    """A snooze is no rule of the device's: it stands while its item is in the feed, whatever the
    item's new time or title (``want_snoozes`` brings it in line). Only a successful read can say
    the item went."""
    if row["source_id"] not in plan.ok_sources:
        return None
    if row["item_id"] in plan.declined:
        return "declined"
    if row["item_id"] in plan.feed_items:
        return None
    own_id = row["item_id"].split(":", 1)[1]
    return None if plan.feeds[row["source_id"]].holds(own_id, row["event_at"].whole_seconds) else "left_feed"


def stale_pending_rows(existing: Iterable[dict[str, Any]], plans: dict[str, DevicePlan]) -> list[PlannedRow]:
    """Pending rows whose item has begun, or was set aside by the item cap, so the build does not
    queue it, but now reads differently (moved, possibly into the past, or retitled): each as the
    item was last read.

    Written over the pending row (``ledger.realign_pending``), so no alert goes out for the item's
    old version and the drain's policy settles it by the truth: ``event_started`` for a lead whose
    start has passed, a ``lead:0`` still sent while within lateness. Settled rows are never touched.
    """
    out = []
    for row in existing:
        if row["status"] != "pending" or is_agenda(row["rule"]) or is_snooze(row["rule"]):
            continue  # an agenda is planned whole, a snooze wanted as it stands (``want_snoozes``)
        now_is = plans[row["device_id"]].realigned(row["item_id"], row["rule"])
        if now_is and any(row[c] != now_is[c] for c in ("event_at", "expires_at", "title", "body")):
            out.append(now_is)
    return out


_COMPARED = ("source_id", "send_after", "event_at", "expires_at", "title", "body", "item_at")


def unchanged(current: Mapping[str, Any] | None, wanted: Mapping[str, Any], rearm_threshold: int) -> bool:
    """Rows the upsert would leave alone anyway; skipping them spares the database the conflict checks.

    Only a shortcut, mirroring ``ledger.upsert_rows`` (change both together): its SQL stays the
    authority when rows race.
    """
    if current is None:
        return False
    if current["status"] == "claimed":
        return True
    if current["status"] == "pending":
        return all(current[c] == wanted[c] for c in _COMPARED)
    if current["outcome"] == "voided":
        return False
    return is_snooze(wanted["rule"]) or not item_moved(current, wanted, rearm_threshold)  # a snooze never re-arms


def item_moved(settled: Mapping[str, Any], wanted: Mapping[str, Any], threshold: int) -> bool:
    """Whether a settled row's item itself moved by at least ``threshold``, the only reason it is
    re-armed (mirrors ``ledger.upsert_rows``, on the same ``ledger.rearm_bounds``): its anchor
    instant moved, and so did a floating item's own wall time. A row settled before its wall time
    was stored is compared by the widest gap any zone can put between wall time and instant.
    ``send_after`` is not compared: a quiet-hours hold or a zone moves it while the item stays put."""
    by_expiry = expiry_anchored(wanted["rule"])
    bounds = ledger.rearm_bounds(wanted, threshold, by_expiry)

    def outside(t: Instant, name: str) -> bool:
        return bool(t <= bounds[f"{name}_before"] or t >= bounds[f"{name}_after"])

    anchor = ledger.rearm_anchor(settled, by_expiry)
    if not outside(anchor, "anchor"):
        return False
    if wanted["item_at"] is None:
        return True
    return outside(settled["item_at"], "item") if settled["item_at"] is not None else outside(anchor, "wall")
