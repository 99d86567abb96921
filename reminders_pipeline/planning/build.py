"""The build half: read each device's sources and make its queue rows match what ``plan.py`` says
they should hold.

Slow and failure-prone by nature (N devices x M source reads), so: sources are read once per run
however many devices share them, before any write transaction; a failed read is recorded and
leaves that source's rows exactly as they were; everything else builds normally.

A build shares the database with the exact-time path, which claims and settles rows the moment
they come due; on SQLite every write waits for the one write lock. So each device is planned
before its transaction (planning is the build's CPU), and a transaction writes the devices of
about ``WRITE_TRANSACTION_ROWS`` rows: a claim never waits behind a whole sweep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.calendar_settings import CalendarSettings
from reminders_pipeline.domain.notification import sent_payload
from reminders_pipeline.domain.rules import expiry_anchored
from reminders_pipeline.domain.run_summary import BuildResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.plan import DevicePlan, Replan, namespaced, plan_device, want_snoozes
from reminders_pipeline.planning.plan_key import plan_key
from reminders_pipeline.planning.queued import stale_pending_rows, unchanged, void_reason
from reminders_pipeline.planning.source_reads import (
    covers,
    in_order,
    make_reader,
    record_reads,
    source_state,
    source_windows,
    summarize_reads,
)
from reminders_pipeline.sources.reader import SourceRead, SourceReader, distinct_sources
from reminders_pipeline.sources.urls import shown_url

WRITE_BATCH_DEVICES = 500  # devices whose plan states one read fetches, and the most one transaction writes
WRITE_TRANSACTION_ROWS = 1000  # planned rows past which a transaction takes no further device
ITEM_LOOKUP_MAX = 1000  # changed items and agenda days past which a transaction reads its devices' rows whole


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
    ``WRITE_BATCH_DEVICES`` devices are written, for a terminal's progress display.
    """
    started = time.perf_counter()
    now = now or Instant.now()
    summary = BuildResult(now=now)
    reader = reader or make_reader(settings)
    with db.read() as conn:
        devices = ledger.select_build_devices(conn, device_ids=device_ids, chunks=chunks, limit=limit)
        subs = ledger.subscriptions(conn, [d["id"] for d in devices])
        calendars = ledger.calendar_settings(conn, [d["id"] for d in devices])
        states = {sid: source_state(s) for sid, s in ledger.sources_by_id(conn, distinct_sources(subs)).items()}
    for d in devices:
        d["calendars"] = {sid: CalendarSettings.of_columns(c) for sid, c in sorted(calendars[d["id"]].items())}
    if progress:
        progress(0, len(devices))

    windows = source_windows(devices, subs, now, settings.horizon_seconds)
    cache = read_cache if read_cache is not None else {}
    missing = {sid: st for sid, st in states.items() if not covers(cache.get(sid), windows[sid])}
    fresh = reader.read_all(missing, windows)
    recorded = record_reads(db, fresh, now, settings)
    fresh = in_order(reader, fresh, recorded, windows)
    cache.update(fresh)
    reads = {sid: cache[sid] for sid in states}
    summary.sources_alerted = [shown_url(s["url"]) for s in recorded.alerted]
    summarize_reads(reads, summary)

    tick = _Tick(subs, reads, now, settings, summary)
    for i in range(0, len(devices), WRITE_BATCH_DEVICES):
        batch = devices[i : i + WRITE_BATCH_DEVICES]
        with db.read() as conn:
            planned = ledger.plan_states(conn, [d["id"] for d in batch])
        # A device removed while the sources were read has no plan state, and nothing to plan.
        for group in _transactions(_plan(d, planned[d["id"]], tick) for d in batch if d["id"] in planned):
            with db.write() as conn:
                _write_transaction(conn, group, tick)
        if progress:
            progress(i + len(batch), len(devices))

    if devices:
        with db.read() as conn:
            summary.oldest_built_at = ledger.oldest_built(conn, sorted({d["chunk"] for d in devices}))[1]
    summary.duration_seconds = time.perf_counter() - started
    return summary


@dataclass(frozen=True)
class _Tick:
    """What every write transaction of one build shares."""

    subs: dict[str, list[int]]
    reads: dict[int, SourceRead]
    now: Instant
    settings: Settings
    summary: BuildResult

    @property
    def until(self) -> Instant:
        return self.now + self.settings.horizon_seconds


PlanState = tuple[str | None, Instant | None]  # a device's planned_key and planned_until


@dataclass(frozen=True)
class _Planned:
    """One device's plan, made before its write transaction from the plan state read then."""

    device: dict[str, Any]
    state: PlanState
    key: str | None  # what this plan is made from (``plan_key``)
    step: bool  # the last plan had these inputs: only what the horizon moved over is planned
    plan: DevicePlan
    # The last plan had these inputs but for these items (own ids by source) of changed feeds:
    # they are planned in full, and only their rows are read; the other items as in a step.
    replan: Replan | None = None


def _plan(device: dict[str, Any], state: PlanState, tick: _Tick) -> _Planned:
    subscribed = tick.subs.get(device["id"], ())
    key = plan_key(device, subscribed, tick.reads, tick.now)
    step = _planned_already(key, state, tick.until)
    replan = None if step or key is None else _replan(device, subscribed, state, tick)
    if replan is not None and not replan:  # the bodies changed, none of their items did
        step, replan = True, None
    after = state[1] if step or replan is not None else None
    plan = plan_device(
        device,
        subscribed,
        tick.reads,
        tick.now,
        tick.settings.horizon_seconds,
        after=after,
        replan=replan,
    )
    return _Planned(device, state, key, step, plan, replan)


def _replan(device: dict[str, Any], subscribed: Sequence[int], state: PlanState, tick: _Tick) -> Replan | None:
    """The items to plan again, when the device's last plan was made from the very parses its
    changed feeds were compared with (``SourceRead.changes``): the rest of its rows are as that
    plan left them. Empty: no item changed, a step. None: plan in full."""
    changed = {sid: read.changes.item_ids for sid in subscribed if (read := tick.reads.get(sid)) and read.changes}
    if not changed or not _planned_already(
        plan_key(device, subscribed, tick.reads, tick.now, before_changes=True), state, tick.until
    ):
        return None
    return {sid: ids for sid, ids in changed.items() if ids}


def _transactions(planned: Iterable[_Planned]) -> Iterator[list[_Planned]]:
    """Consecutive devices, as many per transaction as stay within ``WRITE_TRANSACTION_ROWS``
    planned rows (one device at least, however many it has). Lazy: but for its first device,
    the next group is planned once the last one's transaction has ended, so the write lock is
    free while planning."""
    group: list[_Planned] = []
    rows = 0
    for p in planned:
        if group and rows + len(p.plan.wanted) > WRITE_TRANSACTION_ROWS:
            yield group
            group, rows = [], 0
        group.append(p)
        rows += len(p.plan.wanted)
    if group:
        yield group


def _write_transaction(conn: Connection, group: Sequence[_Planned], tick: _Tick) -> None:
    # Devices first, in id order (ledger.lock_devices): racing builds queue instead of deadlocking
    # with a drain, and a build with older reads than the last one leaves those devices alone.
    now, summary = tick.now, tick.summary
    fresh = ledger.lock_devices(conn, [p.device["id"] for p in group], not_built_after=now)
    summary.devices_skipped_newer += len(group) - len(fresh)
    # An overlapping build may have planned a device since its state was read: plan it again.
    states = ledger.plan_states(conn, sorted(fresh))
    batch = [
        p if p.state == states[p.device["id"]] else _plan(p.device, states[p.device["id"]], tick)
        for p in group
        if p.device["id"] in fresh
    ]
    _write_horizon_step(conn, [p for p in batch if p.step], tick)
    in_flight = _write_changed(conn, [p for p in batch if not p.step], tick)
    until = tick.until
    plans = {
        p.device["id"]: (None, None) if p.key is None or p.device["id"] in in_flight else (p.key, until) for p in batch
    }  # a device with claimed rows left as they were plans in full next time
    ledger.stamp_built(conn, list(plans), now, plans)
    summary.devices_built += len(batch)


def _planned_already(key: str | None, state: PlanState, until: Instant) -> bool:
    """The device's last plan was made from these very inputs (``plan_key``), and the horizon has
    not shrunk below it: only what the horizon has moved over since is left to plan."""
    planned_key, planned_until = state
    return key is not None and key == planned_key and planned_until is not None and planned_until <= until


def _write_horizon_step(conn: Connection, batch: Sequence[_Planned], tick: _Tick) -> None:
    """Devices whose inputs have not changed since their last plan: only rows due after it
    (``planned_until``) were planned, and no existing row is read. Those rows are new: from the
    same content, the last plan made every row due by then and none after. The upsert's guard
    still decides, should one exist."""
    if not batch:
        return
    rows = [row for p in batch for row in p.plan.wanted.values()]
    tick.summary.devices_unchanged += len(batch)
    written = queue_rows(conn, rows, tick.now, rearm_threshold_seconds=tick.settings.rearm_threshold_seconds)
    tick.summary.rows_inserted += len(written)


def _write_changed(conn: Connection, batch: Sequence[_Planned], tick: _Tick) -> set[str]:
    """Devices planned in full, or in their changed items: every row those want, checked against
    every row of the device, or of those items. Returns the devices with a row claimed meanwhile,
    which no write touches: once back to pending, it may still need voiding or realigning to what
    this plan read."""
    if not batch:
        return set()
    now, settings, summary = tick.now, tick.settings, tick.summary
    rearm_threshold = settings.rearm_threshold_seconds
    plans = {p.device["id"]: p.plan for p in batch}
    existing = _existing_rows(conn, batch)
    want_snoozes(existing, plans, now)
    summary.devices_items_replanned += sum(1 for p in batch if p.replan is not None)
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


def _existing_rows(conn: Connection, batch: Sequence[_Planned]) -> list[dict[str, Any]]:
    """Every row of the devices planned in full; of those that replan some items, those items'
    rows and their agendas' (``DevicePlan.agenda_days``: every day a changed item may be on, and
    the days whose agenda has gone, which a snooze of it may list)."""
    full = [p.device["id"] for p in batch if p.replan is None]
    rows = ledger.existing_rows(conn, full) if full else []
    some = {p.device["id"]: p for p in batch if p.replan is not None}
    if some:
        changed = {sid: ids for p in some.values() for sid, ids in (p.replan or {}).items()}  # one set per source
        days = {day for p in some.values() for day in _agenda_days(p.plan)}
        ids = [namespaced(sid, own) for sid, own_ids in changed.items() for own in own_ids] + sorted(days)
        found = ledger.existing_rows(conn, list(some), ids if len(ids) <= ITEM_LOOKUP_MAX else None)
        rows += (r for r in found if _replanned(r, some[r["device_id"]]))
    return rows


def _agenda_days(plan: DevicePlan) -> set[str]:
    """The days (item ids) whose agenda rows a re-plan by item decides: those it planned, and
    those whose agenda time has come (only their snoozes are still the plan's, ``want_snoozes``)."""
    return plan.agenda_days | plan.agenda_come if plan.agenda_complete else plan.agenda_days


def _replanned(row: dict[str, Any], planned: _Planned) -> bool:
    """A row a re-plan by item decides: of a changed item, or of a day whose agenda it decided."""
    if row["source_id"] is None:
        return row["item_id"] in _agenda_days(planned.plan)
    return row["item_id"].split(":", 1)[1] in (planned.replan or {}).get(row["source_id"], ())


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
