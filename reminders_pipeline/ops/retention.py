"""Retention: settled rows older than the retention period are deleted in small batches.

Settled rows are the ledger's history (why a reminder was or was not sent, and how late), so they
are kept for a while, but a queue table that only grows bloats its indexes and slows every claim.
Each batch is its own short transaction, so pruning never holds locks a claim would wait on.

A settled row is also the ledger's memory that its reminder went: deleted while its item is still
in the feed, the next build would queue it again as new and send it twice. So only rows whose event
has ended (``expires_at`` in the past, when no rule can want them again) are pruned, and
``reminders check`` asserts the retention outlives the horizon plus MAX_LATENESS.
"""

from __future__ import annotations

from collections.abc import Callable

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database


def prune(
    db: Database,
    settings: Settings,
    now: Instant | None = None,
    max_batches: int | None = None,
    progress: Callable[[int, None], None] | None = None,
) -> int:
    """Delete rows settled before ``now - retention`` whose event has ended (and history, drain
    halts and dispatcher heartbeats older than the retention); returns how many queue rows were deleted.

    ``progress``: called with the rows deleted so far after each batch (the total is not counted
    beforehand: that would be a scan of its own).
    """
    now = now or Instant.now()
    cutoff = now - settings.retention_seconds
    with db.write() as conn:
        ledger.prune_halts(conn, cutoff)
        ledger.prune_dispatchers(conn, cutoff)
    history_full = True
    while history_full:
        with db.write() as conn:
            history_full = ledger.prune_history(conn, cutoff, settings.prune_batch_size) == settings.prune_batch_size
    total, batches = 0, 0
    while max_batches is None or batches < max_batches:
        with db.write() as conn:
            deleted = ledger.prune_settled(conn, cutoff, settings.prune_batch_size, ended_before=now)
        total += deleted
        batches += 1
        if progress:
            progress(total, None)
        if deleted < settings.prune_batch_size:
            break
    return total
