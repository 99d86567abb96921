"""The build half: compose each device's feed and make its queue rows match it.

Slow and failure-prone by nature (N devices x M source reads), so: sources are read once per run
however many devices share them, before any write transaction; a failed read is recorded and
leaves that source's rows exactly as they were; everything else builds normally.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from . import ledger
from .alerts import raise_alert
from .db import Database
from .egress import parse_networks
from .feed import Item, ParsedFeed
from .notification import sent_payload
from .policy import held_send_after
from .rules import DEFAULT_ALL_DAY_RULES, Rule, device_rules, expiry_anchored, parse_rule
from .settings import Settings
from .sources import SourceRead, SourceReader, SourceState, distinct_sources, shown_url
from .times import iso_from_unix, now_utc, shift, unix_from_iso
from .zones import LocalTime, local_time, parse_quiet_hours

WRITE_BATCH_DEVICES = 500
ALARM_REACH_SECONDS = 7 * 86400  # a device using calendar alarms reads a week further: alarms are rarely earlier


@dataclass
class BuildSummary:
    now: str
    devices_built: int = 0
    devices_skipped_newer: int = 0  # a build that started later already wrote them
    rows_inserted: int = 0
    rows_updated: int = 0
    rows_voided: Counter = field(default_factory=Counter)
    items_rejected: Counter = field(default_factory=Counter)
    sources_read: int = 0
    sources_failed: list[dict[str, str]] = field(default_factory=list)
    sources_not_modified: int = 0
    sources_alerted: list[str] = field(default_factory=list)
    oldest_built_at: str | None = None
    duration_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "now": self.now,
            "devices_built": self.devices_built,
            "devices_skipped_newer": self.devices_skipped_newer,
            "rows_inserted": self.rows_inserted,
            "rows_updated": self.rows_updated,
            "rows_voided": dict(self.rows_voided),
            "items_rejected": dict(self.items_rejected),
            "sources_read": self.sources_read,
            "sources_failed": self.sources_failed,
            "sources_not_modified": self.sources_not_modified,
            "sources_alerted": self.sources_alerted,
            "oldest_built_at": self.oldest_built_at,
            "duration_seconds": round(self.duration_seconds, 3),
        }


@dataclass
class DevicePlan:
    """What one device's queue should hold, and what is known about its feed."""

    wanted: dict[tuple[str, str], dict[str, Any]]
    feed_items: dict[str, Item]  # namespaced id -> item, from sources read successfully
    ok_sources: set[int]
    subscribed: set[int]
    rules: dict[str, Rule]  # every rule in use: the device's, and the calendar alarms' it uses
    item_rules: dict[str, set[str]] = field(default_factory=dict)  # items whose alarms replace the device's rules
    uses_alarms: bool = False  # a rule outside the device's own may be a calendar alarm's
    # Rows of items whose anchor has passed, or that the item cap set aside: never queued anew,
    # only used to bring a pending row in line.
    realign: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    feeds: dict[int, ParsedFeed] = field(default_factory=dict)  # per source read: what its absent items may be
    # Rows for an item the cap set aside (``ParsedFeed.aside``), made only for a pending row that
    # exists (``realigned``): a feed far over the cap costs its subscribers' builds nothing more.
    make_rows: Callable[[int, Item], Iterator[tuple[dict[str, Any], bool]]] | None = field(default=None, repr=False)
    made: set[str] = field(default_factory=set, repr=False)  # set-aside items whose rows are made: once each

    def realigned(self, item_id: str, rule: str) -> dict[str, Any] | None:
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


def namespaced(source_id: int, item_id: str) -> str:
    """Item ids are namespaced by source so two sources cannot collide."""
    return f"{source_id}:{item_id}"


def plan_device(
    device: dict[str, Any], subscribed: Iterable[int], reads: dict[int, SourceRead], now_unix: float, horizon: int
) -> DevicePlan:
    """Resolve each item in the device's local time and apply its rules: lead rules to timed items,
    day rules to all-day items (or, for a device that uses them, the item's own calendar alarms),
    then hold for quiet hours (``policy.held_send_after``)."""
    rules = {r.name: r for r in rules_of(device)}
    use_alarms = bool(device.get("use_alarms"))
    local = local_time(device)
    quiet = parse_quiet_hours(device.get("quiet_hours"))
    plan = DevicePlan({}, {}, set(), set(subscribed), dict(rules), uses_alarms=use_alarms)
    for source_id in plan.subscribed:
        read = reads.get(source_id)
        if read is None or not read.ok:
            continue
        plan.ok_sources.add(source_id)
        plan.feeds[source_id] = read.feed  # type: ignore[assignment]
        for raw in read.feed.items:  # type: ignore[union-attr]
            for row, begun in _rows_for(
                plan, device, source_id, raw, rules, use_alarms, local, quiet, now_unix, horizon
            ):
                (plan.realign if begun else plan.wanted)[(row["item_id"], row["rule"])] = row
    plan.make_rows = lambda source_id, raw: _rows_for(
        plan, device, source_id, raw, rules, use_alarms, local, quiet, now_unix, None
    )
    return plan


def _rows_for(
    plan: DevicePlan,
    device: dict[str, Any],
    source_id: int,
    raw: Item,
    rules: dict[str, Rule],
    use_alarms: bool,
    local: Any,
    quiet: Any,
    now_unix: float,
    horizon: int | None,
) -> Iterator[tuple[dict[str, Any], bool]]:
    """One item's rows for this device (within ``horizon``, if given), each with whether its
    anchor has passed; a kept item is entered in ``plan.feed_items``, a set-aside one is not."""
    item = raw.for_local(local)
    item_id = namespaced(source_id, item.id)
    if horizon is not None:
        plan.feed_items[item_id] = item
    for rule in _item_rules(plan, item_id, raw, rules, use_alarms):
        send_after = _send_after(rule, raw, item, local)
        if horizon is not None and send_after > now_unix + horizon:
            continue
        yield (
            {
                "device_id": device["id"],
                "source_id": source_id,
                "item_id": item_id,
                "rule": rule.name,
                "send_after": iso_from_unix(held_send_after(send_after, rule, item, quiet, local)),
                "event_at": iso_from_unix(item.starts_at),
                "expires_at": iso_from_unix(item.expires_at),
                "title": item.title,
                "body": item.body,
                "item_at": iso_from_unix(_own_anchor(rule, raw)) if raw.floating else None,
            },
            rule.anchor_unix(item.starts_at, item.expires_at) <= now_unix,
        )


def _item_rules(plan: DevicePlan, item_id: str, raw: Item, rules: dict[str, Rule], use_alarms: bool) -> list[Rule]:
    """The calendar's alarms when the device uses them and the item has any; else the device's
    rules of the item's kind (day rules for all-day items, lead rules for timed ones)."""
    if use_alarms and raw.alarms:
        own = [parse_rule(name) for name in raw.alarms]
        plan.rules.update((r.name, r) for r in own)
        plan.item_rules[item_id] = {r.name for r in own}
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


def _send_after(rule: Rule, raw: Item, item: Item, local: LocalTime) -> int:
    """A day rule names a local time on a local day (DST exact); a lead rule an offset from an instant."""
    if rule.anchor == "day":
        return (
            local.to_unix(rule.day_wall(raw.starts_at))
            if raw.floating
            else item.starts_at - rule.lead_seconds + rule.at_minutes * 60
        )
    return rule.send_after_unix(item.starts_at, item.expires_at)


def _own_anchor(rule: Rule, raw: Item) -> int:
    """A floating item's own time at the rule's anchor, as wall seconds, before any zone fixes it:
    what must move for a settled row to be re-armed (``ledger.rearm_anchor``'s counterpart)."""
    return raw.expires_at if rule.anchor == "expiry" else raw.starts_at


def void_reason(row: dict[str, Any], plan: DevicePlan, now_unix: float) -> str | None:
    """Why a pending row no longer belongs, or None to leave it.

    A failed read never voids. A row of a subscribed source whose read failed is voided only for
    what the device itself changed: a rule it dropped, when no calendar alarm can have given that
    rule (the device does not use alarms, so a successful read would void it all the same). For a
    device using alarms a rule outside its own may be the calendar's, and only a successful read
    can say: the row waits for one. A row whose item is still in the feed but has begun is left for
    the drain, which settles it with the true reason. Nor does an item the feed holds without
    carrying it void (``ParsedFeed.holds``): one the item cap cut, or one of a rejected series.
    """
    if row["source_id"] not in plan.subscribed:
        return "source_removed"
    if row["source_id"] not in plan.ok_sources:
        return "rule_removed" if row["rule"] not in plan.rules and not plan.uses_alarms else None
    if row["rule"] not in plan.rules:
        return "rule_removed"
    if (row["item_id"], row["rule"]) in plan.wanted:
        return None
    item = plan.feed_items.get(row["item_id"])
    if item is None:
        own_id = row["item_id"].split(":", 1)[1]
        return None if plan.feeds[row["source_id"]].holds(own_id, int(unix_from_iso(row["event_at"]))) else "left_feed"
    if row["item_id"] in plan.item_rules and row["rule"] not in plan.item_rules[row["item_id"]]:
        return "rule_removed"  # the calendar dropped that alarm
    if plan.rules[row["rule"]].anchor_unix(item.starts_at, item.expires_at) <= now_unix:
        return None
    return "out_of_horizon"


_ITEM_FIELDS = ("event_at", "expires_at", "title", "body")


def stale_pending_rows(existing: Iterable[dict[str, Any]], plans: dict[str, DevicePlan]) -> list[dict[str, Any]]:
    """Pending rows whose item has begun, or was set aside by the item cap, so the build does not
    queue it, but now reads differently (moved, possibly into the past, or retitled): each as the
    item was last read.

    Written over the pending row (``ledger.realign_pending``), so no alert goes out for the item's
    old version and the drain's policy settles it by the truth: ``event_started`` for a lead whose
    start has passed, a ``lead:0`` still sent while within lateness. Settled rows are never touched.
    """
    out = []
    for row in existing:
        if row["status"] != "pending":
            continue
        now_is = plans[row["device_id"]].realigned(row["item_id"], row["rule"])
        if now_is and any(row[c] != now_is[c] for c in _ITEM_FIELDS):
            out.append(now_is)
    return out


_COMPARED = ("source_id", "send_after", "event_at", "expires_at", "title", "body", "item_at")


def _unchanged(current: dict[str, Any] | None, wanted: dict[str, Any], rearm_threshold: int) -> bool:
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
    return current["outcome"] != "voided" and not item_moved(current, wanted, rearm_threshold)


def item_moved(settled: dict[str, Any], wanted: dict[str, Any], threshold: int) -> bool:
    """Whether a settled row's item itself moved by at least ``threshold``, the only reason it is
    re-armed (mirrors ``ledger.upsert_rows``, on the same ``ledger.rearm_bounds``): its anchor
    instant moved, and so did a floating item's own wall time. A row settled before its wall time
    was stored is compared by the widest gap any zone can put between wall time and instant.
    ``send_after`` is not compared: a quiet-hours hold or a zone moves it while the item stays put."""
    by_expiry = expiry_anchored(wanted["rule"])
    bounds = ledger.rearm_bounds(wanted, threshold, by_expiry)

    def outside(t: str, name: str) -> bool:
        return t <= bounds[f"{name}_before"] or t >= bounds[f"{name}_after"]

    anchor = ledger.rearm_anchor(settled, by_expiry)
    if not outside(anchor, "anchor"):
        return False
    if wanted["item_at"] is None:
        return True
    return outside(settled["item_at"], "item") if settled["item_at"] is not None else outside(anchor, "wall")


def build(
    db: Database,
    settings: Settings,
    *,
    device_ids: Sequence[str] | None = None,
    chunks: Sequence[int] | None = None,
    limit: int | None = None,
    now: str | None = None,
    reader: SourceReader | None = None,
    read_cache: dict[int, SourceRead] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BuildSummary:
    """Build the queue for the selected devices (all if neither ids nor chunks), stalest first.

    ``read_cache``: reads already made in this run (one Dagster run building several chunks passes
    the same dict to each call), so a source shared across chunks is still read once per run.
    ``progress``: called with (devices written, devices selected) before the reads and after each
    write batch, for a terminal's progress display.
    """
    started = time.perf_counter()
    now = now or now_utc()
    summary = BuildSummary(now=now)
    reader = reader or make_reader(settings)
    with db.read() as conn:
        devices = ledger.select_build_devices(conn, device_ids=device_ids, chunks=chunks, limit=limit)
        subs = ledger.subscriptions(conn, [d["id"] for d in devices])
        states = {sid: source_state(s) for sid, s in ledger.sources_by_id(conn, distinct_sources(subs)).items()}
    if progress:
        progress(0, len(devices))

    windows = source_windows(devices, subs, now, settings.horizon_seconds)
    cache = read_cache if read_cache is not None else {}
    missing = {sid: st for sid, st in states.items() if not _covers(cache.get(sid), windows[sid])}
    fresh = reader.read_all(missing, windows)
    cache.update(fresh)
    reads = {sid: cache[sid] for sid in states}
    summary.sources_alerted = [shown_url(s["url"]) for s in _record_reads(db, fresh, now, settings)]
    _summarize_reads(reads, summary)

    now_unix = unix_from_iso(now)
    for i in range(0, len(devices), WRITE_BATCH_DEVICES):
        batch = devices[i : i + WRITE_BATCH_DEVICES]
        with db.write() as conn:
            _write_batch(
                conn,
                batch,
                subs,
                reads,
                now,
                now_unix,
                settings.horizon_seconds,
                summary,
                settings.rearm_threshold_seconds,
            )
        if progress:
            progress(i + len(batch), len(devices))

    if devices:
        with db.read() as conn:
            summary.oldest_built_at = ledger.oldest_built(conn, sorted({d["chunk"] for d in devices}))[1]
    summary.duration_seconds = time.perf_counter() - started
    return summary


def make_reader(settings: Settings) -> SourceReader:
    return SourceReader(
        settings.source_timeout_seconds,
        settings.source_max_bytes,
        settings.source_concurrency,
        settings.source_per_host,
        parse_networks(settings.source_allow_networks),
        settings.source_max_items,
        settings.source_parse_seconds,
        settings.source_series_seconds,
    )


def source_state(row: dict[str, Any]) -> SourceState:
    return SourceState(row["url"], row["etag"], row["last_modified"], row["feed_cache"], row["cache_until"])


def read_window(rules: Iterable[Rule], now: str, horizon: int) -> tuple[int, int]:
    """The occurrences a calendar must yield: anything whose reminder could fall inside the horizon."""
    longest = max((r.reach_seconds for r in rules), default=0)
    start = int(unix_from_iso(now))
    return start, start + horizon + longest


def source_windows(
    devices: Sequence[dict[str, Any]], subs: dict[str, list[int]], now: str, horizon: int
) -> dict[int, tuple[int, int]]:
    """Each source's read window: the widest of its own subscribers' (not the chunk's longest lead),
    so one device with a year-long lead makes only its own calendars expand over a year."""
    windows: dict[int, tuple[int, int]] = {}
    for device in devices:
        start, end = read_window(rules_of(device), now, horizon)
        window = (start, end + ALARM_REACH_SECONDS) if device.get("use_alarms") else (start, end)
        for sid in subs.get(device["id"], ()):
            windows[sid] = max(windows.get(sid, window), window)
    return windows


def _covers(read: SourceRead | None, window: tuple[int, int]) -> bool:
    """A read made earlier in this run serves this build too, unless its calendar expansion ends too soon."""
    return read is not None and (read.cache_until is None or unix_from_iso(read.cache_until) >= window[1])


def failed_sources(reads: dict[int, SourceRead]) -> list[dict[str, str]]:
    """The reads that failed, as the build summary and the widget feed report them (URLs as shown)."""
    return [{"url": shown_url(r.url), "error": r.error or ""} for r in reads.values() if not r.ok]


def _summarize_reads(reads: dict[int, SourceRead], summary: BuildSummary) -> None:
    summary.sources_read = len(reads)
    summary.sources_not_modified = sum(1 for r in reads.values() if r.not_modified)
    summary.sources_failed = failed_sources(reads)
    for r in reads.values():
        if r.ok:
            summary.items_rejected.update(r.feed.rejected)  # type: ignore[union-attr]


def _record_reads(db: Database, reads: dict[int, SourceRead], now: str, settings: Settings) -> list[dict[str, Any]]:
    """Store each source's outcome; returns the sources that just crossed the failure-alert limit."""
    if not reads:
        return []
    ok = [r for r in reads.values() if r.ok]
    failed = [r for r in reads.values() if not r.ok]
    successes = [
        {
            "id": r.source_id,
            "items": len(r.feed.items),  # type: ignore[union-attr]
            "rejected": sum(r.feed.rejected.values()),  # type: ignore[union-attr]
            "etag": r.etag,
            "last_modified": r.last_modified,
            "feed_cache": None if r.not_modified else r.feed.to_json(),  # type: ignore[union-attr]
            "cache_until": r.cache_until,
        }
        for r in ok
    ]
    with db.write() as conn:
        ledger.record_source_success(conn, successes, now)
        ledger.record_source_failure(conn, [{"id": r.source_id, "error": r.error} for r in failed], now)
        long_failing = ledger.claim_source_alerts(conn, shift(now, -settings.source_alert_after_seconds), now)
    for src in long_failing:
        raise_alert(
            settings,
            "Source failing",
            f"{shown_url(src['url'])} has failed every read since {src['failing_since']} "
            f"({src['consecutive_failures']} reads); its reminders are frozen as last read. Last error: {src['last_error']}",
        )
    return long_failing


def _write_batch(conn, batch, subs, reads, now, now_unix, horizon, summary, rearm_threshold) -> None:  # type: ignore[no-untyped-def]
    # Devices first, in id order (ledger.lock_devices): racing builds queue instead of deadlocking
    # with a drain, and a build with older reads than the last one leaves those devices alone.
    fresh = ledger.lock_devices(conn, [d["id"] for d in batch], not_built_after=now)
    summary.devices_skipped_newer += len(batch) - len(fresh)
    batch = [d for d in batch if d["id"] in fresh]
    ids = [d["id"] for d in batch]
    plans = {d["id"]: plan_device(d, subs.get(d["id"], ()), reads, now_unix, horizon) for d in batch}
    existing = ledger.existing_rows(conn, ids)
    existing_ids = {r["id"] for r in existing}
    by_key = {(r["device_id"], r["item_id"], r["rule"]): r for r in existing}

    candidates = [
        row
        for p in plans.values()
        for row in p.wanted.values()
        if not _unchanged(by_key.get((row["device_id"], row["item_id"], row["rule"])), row, rearm_threshold)
    ]
    stale = stale_pending_rows(existing, plans)
    voids: dict[str, list[int]] = {}
    for row in existing:
        if row["status"] == "pending":
            reason = void_reason(row, plans[row["device_id"]], now_unix)
            if reason:
                voids.setdefault(reason, []).append(row["id"])
    # Every existing row this batch may write, locked in one pass in id order before the first write
    # (as a drain locks what it settles): statement by statement, each in id order, would still take
    # a lower id after a higher one and deadlock with a drain settling both.
    keys = {(r["device_id"], r["item_id"], r["rule"]) for r in (*candidates, *stale)}
    ledger.lock_rows(
        conn, [by_key[k]["id"] for k in keys if k in by_key] + [i for row_ids in voids.values() for i in row_ids]
    )

    written = ledger.upsert_rows(
        conn,
        candidates,
        now,
        rearm_threshold_seconds=rearm_threshold,
        by_expiry=expiry_anchored,
        payload_of=sent_payload,
    )
    written |= ledger.realign_pending(conn, stale, now)
    summary.rows_inserted += len(written - existing_ids)
    summary.rows_updated += len(written & existing_ids)
    for reason, row_ids in voids.items():
        summary.rows_voided[reason] += ledger.void_rows(conn, row_ids, reason, now)

    ledger.stamp_built(conn, ids, now)
    summary.devices_built += len(ids)


@dataclass
class ComposedFeed:
    """A device's feed as the widget sees it: item bounds stay Unix seconds (the wire contract)."""

    device_id: str
    items: list[dict[str, Any]]
    sources_failed: list[dict[str, str]]


def compose_feed(
    db: Database, settings: Settings, device_id: str, reader: SourceReader | None = None, now: str | None = None
) -> ComposedFeed | None:
    """The device's sources merged, soonest first; None for an unknown device.

    A source read in the last ``REMINDERS_FEED_CACHE_SECONDS`` (by a build or an earlier request)
    is served as that read left it, its feed from ``sources.feed_cache`` or its failure as recorded:
    requests, however many, cannot multiply the reads of one source. Older sources are read now,
    under the build's bounds, and recorded like a build's reads.
    """
    with db.read() as conn:
        record = ledger.get_device(conn, device_id)
        if record is None:
            return None
        subs = ledger.subscriptions(conn, [device_id])[device_id]
        rows = ledger.sources_by_id(conn, subs)
    now = now or now_utc()
    rules = device_rules(record.reminder_lead_seconds, record.extra_rules, record.all_day_rules)
    window = read_window(rules, now, settings.horizon_seconds)
    since = shift(now, -settings.feed_cache_seconds)
    reads = {sid: read for sid, row in rows.items() if (read := recent_read(row, since, window)) is not None}
    stale = {sid: source_state(row) for sid, row in rows.items() if sid not in reads}
    if stale:
        fresh = (reader or make_reader(settings)).read_all(stale, window)
        _record_reads(db, fresh, now, settings)
        reads.update(fresh)
    local = local_time(record)
    items = [
        {
            "id": namespaced(read.source_id, item.id),
            "title": item.title,
            "body": item.body,
            "startsAt": item.starts_at,
            "expiresAt": item.expires_at,
        }
        for read in reads.values()
        if read.ok
        for item in (i.for_local(local) for i in read.feed.items)  # type: ignore[union-attr]
    ]
    items.sort(key=lambda i: (i["startsAt"], i["id"]))
    return ComposedFeed(device_id, items, failed_sources(reads))


def recent_read(row: dict[str, Any], since: str, window: tuple[int, int]) -> SourceRead | None:
    """A source's last read as recorded, if it was made at or after ``since`` and its cached feed
    covers ``window``; None when the source must be read again."""
    if row["last_read_at"] is None or row["last_read_at"] < since:
        return None
    if row["last_error"] is not None:
        return SourceRead(row["id"], row["url"], error=row["last_error"])
    if row["feed_cache"] is None or (row["cache_until"] is not None and unix_from_iso(row["cache_until"]) < window[1]):
        return None
    try:
        feed = ParsedFeed.from_json(row["feed_cache"])
    except (ValueError, KeyError, TypeError):
        return None
    return SourceRead(row["id"], row["url"], feed=feed, cache_until=row["cache_until"])


def chunks_for_tick(settings: Settings, conn: Connection) -> list[int]:
    """Every chunk by default; with REMINDERS_CHUNKS_PER_TICK, the stalest that many."""
    if settings.effective_chunks_per_tick >= settings.chunk_count:
        return list(range(settings.chunk_count))
    return ledger.stalest_chunks(conn, limit=settings.effective_chunks_per_tick)
