"""The build half: read each device's sources and make its queue rows match what ``plan.py`` says
they should hold.

Slow and failure-prone by nature (N devices x M source reads), so: sources are read once per run
however many devices share them, before any write transaction; a failed read is recorded and
leaves that source's rows exactly as they were; everything else builds normally.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from . import ledger
from .alerts import raise_alert
from .db import Database
from .egress import parse_networks
from .notification import sent_payload
from .plan import plan_device, plan_key, rules_of, stale_pending_rows, unchanged, void_reason
from .rules import Rule, expiry_anchored
from .settings import Settings
from .sources import SourceRead, SourceReader, SourceState, Window, distinct_sources, shown_url
from .summary import BuildResult
from .times import Instant

WRITE_BATCH_DEVICES = 500
ALARM_REACH_SECONDS = 7 * 86400  # a device using calendar alarms reads a week further: alarms are rarely earlier


def build(
    db: Database,
    settings: Settings,
    *,
    device_ids: Sequence[str] | None = None,
    chunks: Sequence[int] | None = None,
    limit: int | None = None,
    now: Instant | None = None,
    reader: SourceReader | None = None,
    read_cache: dict[int, SourceRead] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> BuildResult:
    """Build the queue for the selected devices (all if neither ids nor chunks), stalest first.

    ``read_cache``: reads already made in this run (one Dagster run building several chunks passes
    the same dict to each call), so a source shared across chunks is still read once per run.
    ``progress``: called with (devices written, devices selected) before the reads and after each
    write batch, for a terminal's progress display.
    """
    started = time.perf_counter()
    now = now or Instant.now()
    summary = BuildResult(now=now)
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
    summary.sources_alerted = [shown_url(s["url"]) for s in record_reads(db, fresh, now, settings)]
    _summarize_reads(reads, summary)

    tick = _Tick(subs, reads, now, settings, summary)
    for i in range(0, len(devices), WRITE_BATCH_DEVICES):
        batch = devices[i : i + WRITE_BATCH_DEVICES]
        with db.write() as conn:
            _write_batch(conn, batch, tick)
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
    return SourceState(
        row["url"], row["etag"], row["last_modified"], row["feed_cache"], row["cache_until"], row["content_hash"]
    )


def read_window(rules: Iterable[Rule], now: Instant, horizon: int) -> Window:
    """The occurrences a calendar must yield: anything whose reminder could fall inside the horizon."""
    longest = max((r.reach_seconds for r in rules), default=0)
    return now, now + (horizon + longest)


def source_windows(
    devices: Sequence[dict[str, Any]], subs: dict[str, list[int]], now: Instant, horizon: int
) -> dict[int, Window]:
    """Each source's read window: the widest of its own subscribers' (not the chunk's longest lead),
    so one device with a year-long lead makes only its own calendars expand over a year."""
    windows: dict[int, Window] = {}
    for device in devices:
        start, end = read_window(rules_of(device), now, horizon)
        window = (start, end + ALARM_REACH_SECONDS if device.get("use_alarms") else end)
        for sid in subs.get(device["id"], ()):
            windows[sid] = max(windows.get(sid, window), window)
    return windows


def _covers(read: SourceRead | None, window: Window) -> bool:
    """A read made earlier in this run serves this build too, unless its calendar expansion ends too soon."""
    return read is not None and (read.cache_until is None or read.cache_until >= window[1])


def failed_sources(reads: dict[int, SourceRead]) -> list[dict[str, str]]:
    """The reads that failed, as the build summary and the widget feed report them (URLs as shown)."""
    return [{"url": shown_url(r.url), "error": r.error or ""} for r in reads.values() if not r.ok]


def _summarize_reads(reads: dict[int, SourceRead], summary: BuildResult) -> None:
    summary.sources_read = len(reads)
    summary.sources_not_modified = sum(1 for r in reads.values() if r.not_modified)
    summary.sources_failed = failed_sources(reads)
    for r in reads.values():
        if r.ok:
            summary.items_rejected.update(r.feed.rejected)  # type: ignore[union-attr]


def record_reads(db: Database, reads: dict[int, SourceRead], now: Instant, settings: Settings) -> list[dict[str, Any]]:
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
            "content_hash": r.content_hash,
        }
        for r in ok
    ]
    with db.write() as conn:
        ledger.record_source_success(conn, successes, now)
        ledger.record_source_failure(conn, [{"id": r.source_id, "error": r.error} for r in failed], now)
        long_failing = ledger.claim_source_alerts(conn, now - settings.source_alert_after_seconds, now)
    for src in long_failing:
        raise_alert(
            settings,
            "Source failing",
            f"{shown_url(src['url'])} has failed every read since {src['failing_since'].stored} "
            f"({src['consecutive_failures']} reads); its reminders are frozen as last read. Last error: {src['last_error']}",
        )
    return long_failing


@dataclass(frozen=True)
class _Tick:
    """What every write batch of one build shares."""

    subs: dict[str, list[int]]
    reads: dict[int, SourceRead]
    now: Instant
    settings: Settings
    summary: BuildResult


def _write_batch(conn: Connection, batch: Sequence[dict[str, Any]], tick: _Tick) -> None:
    # Devices first, in id order (ledger.lock_devices): racing builds queue instead of deadlocking
    # with a drain, and a build with older reads than the last one leaves those devices alone.
    subs, reads, now, settings, summary = tick.subs, tick.reads, tick.now, tick.settings, tick.summary
    fresh = ledger.lock_devices(conn, [d["id"] for d in batch], not_built_after=now)
    summary.devices_skipped_newer += len(batch) - len(fresh)
    planned = ledger.plan_states(conn, sorted(fresh))
    batch = [
        {**d, "planned_key": planned[d["id"]][0], "planned_until": planned[d["id"]][1]}
        for d in batch
        if d["id"] in fresh
    ]
    until = now + settings.horizon_seconds
    keys = {d["id"]: plan_key(d, subs.get(d["id"], ()), reads, now) for d in batch}
    same = [d for d in batch if _planned_already(d, keys[d["id"]], until)]
    _write_horizon_step(conn, same, tick)
    in_flight = _write_changed(conn, [d for d in batch if d not in same], tick)
    for device_id in in_flight:  # its claimed rows were left as they were: the next build plans in full
        keys[device_id] = None
    plans = {i: (k, until if k else None) for i, k in keys.items()}
    ledger.stamp_built(conn, list(plans), now, plans)
    summary.devices_built += len(batch)


def _planned_already(device: Mapping[str, Any], key: str | None, until: Instant) -> bool:
    """The device's last plan was made from these very inputs (``plan_key``), and the horizon has
    not shrunk below it: only what the horizon has moved over since is left to plan."""
    planned_until = device.get("planned_until")
    return key is not None and key == device.get("planned_key") and planned_until is not None and planned_until <= until


def _write_horizon_step(conn: Connection, batch: Sequence[dict[str, Any]], tick: _Tick) -> None:
    """Devices whose inputs have not changed since their last plan: only rows due after it
    (``planned_until``) are made, and no existing row is read. Those rows are new: from the same
    content, the last plan made every row due by then and none after. The upsert's guard still
    decides, should one exist."""
    if not batch:
        return
    subs, reads, now, settings, summary = tick.subs, tick.reads, tick.now, tick.settings, tick.summary
    horizon = settings.horizon_seconds
    rows = [
        row
        for d in batch
        for row in plan_device(d, subs.get(d["id"], ()), reads, now, horizon, after=d["planned_until"]).wanted.values()
    ]
    summary.devices_unchanged += len(batch)
    summary.rows_inserted += len(queue_rows(conn, rows, now, rearm_threshold_seconds=settings.rearm_threshold_seconds))


def _write_changed(conn: Connection, batch: Sequence[dict[str, Any]], tick: _Tick) -> set[str]:
    """Devices planned in full: every row their feeds want, checked against every row they have.
    Returns the devices with a row claimed meanwhile, which no write touches: once back to
    pending, it may still need voiding or realigning to what this plan read."""
    if not batch:
        return set()
    subs, reads, now, settings, summary = tick.subs, tick.reads, tick.now, tick.settings, tick.summary
    ids = [d["id"] for d in batch]
    rearm_threshold = settings.rearm_threshold_seconds
    plans = {d["id"]: plan_device(d, subs.get(d["id"], ()), reads, now, settings.horizon_seconds) for d in batch}
    existing = ledger.existing_rows(conn, ids)
    existing_ids = {r["id"] for r in existing}
    by_key = {(r["device_id"], r["item_id"], r["rule"]): r for r in existing}

    candidates = [
        row
        for p in plans.values()
        for row in p.wanted.values()
        if not unchanged(by_key.get((row["device_id"], row["item_id"], row["rule"])), row, rearm_threshold)
    ]
    stale = stale_pending_rows(existing, plans)
    voids: dict[str, list[int]] = {}
    for row in existing:
        if row["status"] == "pending":
            reason = void_reason(row, plans[row["device_id"]], now)
            if reason:
                voids.setdefault(reason, []).append(row["id"])
    # Every existing row this batch may write, locked in one pass in id order before the first write
    # (as a drain locks what it settles): statement by statement, each in id order, would still take
    # a lower id after a higher one and deadlock with a drain settling both.
    keys = {(r["device_id"], r["item_id"], r["rule"]) for r in (*candidates, *stale)}
    ledger.lock_rows(
        conn, [by_key[k]["id"] for k in keys if k in by_key] + [i for row_ids in voids.values() for i in row_ids]
    )

    written = queue_rows(conn, candidates, now, rearm_threshold_seconds=rearm_threshold)
    written |= ledger.realign_pending(conn, stale, now)
    summary.rows_inserted += len(written - existing_ids)
    summary.rows_updated += len(written & existing_ids)
    for reason, row_ids in voids.items():
        summary.rows_voided[reason] += ledger.void_rows(conn, row_ids, reason, now)
    return {r["device_id"] for r in existing if r["status"] == "claimed"}


def queue_rows(
    conn: Connection, rows: Sequence[Mapping[str, Any]], now: Instant, *, rearm_threshold_seconds: int = 300
) -> set[int]:
    """``ledger.upsert_rows`` with what the ledger cannot know itself: which rules are anchored at an
    item's end, and how a re-armed row's send is rendered for its history."""
    return ledger.upsert_rows(
        conn,
        rows,
        now,
        rearm_threshold_seconds=rearm_threshold_seconds,
        by_expiry=expiry_anchored,
        payload_of=sent_payload,
    )
