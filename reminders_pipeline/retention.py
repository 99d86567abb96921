"""Retention: settled rows older than the retention period are deleted in small batches.

Settled rows are the ledger's history (why a reminder was or was not sent, and how late), so they
are kept for a while, but a queue table that only grows bloats its indexes and slows every claim.
Each batch is its own short transaction, so pruning never holds locks a claim would wait on.
"""

from __future__ import annotations

from typing import Callable

from . import ledger
from .db import Database
from .settings import Settings
from .times import now_utc, shift


def prune(
    db: Database,
    settings: Settings,
    now: str | None = None,
    max_batches: int | None = None,
    progress: Callable[[int, None], None] | None = None,
) -> int:
    """Delete rows settled before ``now - retention``; returns how many were deleted.

    ``progress``: called with the rows deleted so far after each batch (the total is not counted
    beforehand: that would be a scan of its own).
    """
    cutoff = shift(now or now_utc(), -settings.retention_seconds)
    total, batches = 0, 0
    while max_batches is None or batches < max_batches:
        with db.write() as conn:
            deleted = ledger.prune_settled(conn, cutoff, settings.prune_batch_size)
        total += deleted
        batches += 1
        if progress:
            progress(total, None)
        if deleted < settings.prune_batch_size:
            break
    return total
