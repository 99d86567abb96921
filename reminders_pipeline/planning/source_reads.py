"""What a build reads and what it keeps of the reads: the window each source is read over (its
own subscribers' widest), the reader made from the settings, and each read's outcome in the
ledger, with an alert once a source has failed for too long. ``widget_feed.py`` reads one device's
sources the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from reminders_pipeline import ledger
from reminders_pipeline.config.alerts import raise_alert
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.calendar_settings import calendar_rules
from reminders_pipeline.domain.rules import LEAVE, Rule, agenda_rule, parse_rule
from reminders_pipeline.domain.run_summary import BuildResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.planning.plan import rules_of
from reminders_pipeline.sources.egress import parse_networks
from reminders_pipeline.sources.reader import SourceRead, SourceReader, SourceState, Window, Windows
from reminders_pipeline.sources.urls import shown_url


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
    so one device with a year-long lead makes only its own calendars expand over a year. A series
    with alarms is read further by the parser itself, by its own alarms' reach (``ics_items.alarm_reaches``)."""
    windows: dict[int, Window] = {}
    for device in devices:
        own = {r.name: r for r in rules_of(device)}
        calendars = device.get("calendars") or {}
        agenda = agenda_rule(device["extra_rules"].split())  # lists the whole of a day the horizon reaches
        for sid in subs.get(device["id"], ()):
            rules = (*calendar_rules(own, calendars.get(sid)).values(), parse_rule(LEAVE))  # a travel time may lead
            rules += (agenda,) if agenda else ()
            window = read_window(rules, now, horizon)
            windows[sid] = max(windows.get(sid, window), window)
    return windows


def covers(read: SourceRead | None, window: Window) -> bool:
    """A read made earlier in this run serves this build too, unless its calendar expansion ends too soon."""
    return read is not None and (read.cache_until is None or read.cache_until >= window[1])


def failed_sources(reads: dict[int, SourceRead]) -> list[dict[str, str]]:
    """The reads that failed, as the build summary and the widget feed report them (URLs as shown)."""
    return [{"url": shown_url(r.url), "error": r.error or ""} for r in reads.values() if not r.ok]


def summarize_reads(reads: dict[int, SourceRead], summary: BuildResult) -> None:
    summary.sources_read = len(reads)
    summary.sources_not_modified = sum(1 for r in reads.values() if r.not_modified)
    summary.sources_failed = failed_sources(reads)
    for r in reads.values():
        if r.ok:
            summary.items_rejected.update(r.feed.rejected)  # type: ignore[union-attr]


@dataclass(frozen=True)
class RecordedReads:
    """What recording a build's reads found."""

    alerted: list[dict[str, Any]]  # sources that just crossed the failure-alert limit
    newer: dict[int, SourceState]  # sources whose stored parse is newer than this read's, kept


def record_reads(db: Database, reads: dict[int, SourceRead], now: Instant, settings: Settings) -> RecordedReads:
    """Store each source's outcome, in order (``ledger.record_source_success``): a read older than
    the one stored is not recorded, and ``newer`` names those sources."""
    if not reads:
        return RecordedReads([], {})
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
        newer = ledger.newer_parses(conn, [r.source_id for r in ok], now)
        long_failing = ledger.claim_source_alerts(conn, now - settings.source_alert_after_seconds, now)
    for src in long_failing:
        raise_alert(
            settings,
            "Source failing",
            f"{shown_url(src['url'])} has failed every read since {src['failing_since'].stored} "
            f"({src['consecutive_failures']} reads); its reminders are frozen as last read. Last error: {src['last_error']}",
        )
    return RecordedReads(long_failing, {sid: source_state(row) for sid, row in newer.items()})


def in_order(
    reader: SourceReader, reads: dict[int, SourceRead], recorded: RecordedReads, window: Windows
) -> dict[int, SourceRead]:
    """``reads``, each one older than the parse stored meanwhile (an overlapping build's) replaced
    by that parse where it serves the read's window: nothing is planned from an item a newer read
    showed gone. A calendar expanded from a later start serves what starts from then; before it,
    the build's own read stays (``ParsedFeed.with_earlier``). One that does not serve the window
    (a calendar expanded over a shorter one) stays."""
    stored = reader.stored_reads(recorded.newer, window)
    return {**reads, **{sid: _from_both(reads.get(sid), read) for sid, read in stored.items()}}


def _from_both(own: SourceRead | None, newer: SourceRead) -> SourceRead:
    if own is None or own.feed is None or newer.feed is None:
        return newer
    return replace(newer, feed=newer.feed.with_earlier(own.feed))
