"""Retention cannot make the ledger send twice, on SQLite and PostgreSQL."""

from __future__ import annotations

from reminders_pipeline.ops.check import evaluate
from reminders_pipeline.ops.retention import prune
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.base import RecordingSender
from reminders_pipeline.sending.drain import drain

from .support import at, device, item, rows


def test_a_pruned_row_whose_item_is_still_in_the_feed_is_never_sent_again(db, settings, feeds):
    """A short retention and a long lateness: pruned as soon as retention allowed, the settled row
    used to be queued again as new by the next build, still within MAX_LATENESS, and sent twice."""
    live = settings.with_(enabled=True, retention_seconds=3600, max_lateness_seconds=7200)
    url = feeds.items("/a.json", [item("e", 3 * 3600)])  # starts in 3 h, ends half an hour later
    device(db, live, sources=[url], lead=3 * 3600)  # reminded now
    sender = RecordingSender()
    build(db, live, now=at(0))
    assert drain(db, live, sender.factory(), now=at(0)).outcomes == {"sent": 1}

    pruned = prune(db, live, now=at(3601))
    build(db, live, now=at(3601))
    drain(db, live, sender.factory(), now=at(3601))
    assert len(sender.sent) == 1
    assert pruned == 0  # settled over the retention ago, but its event has not ended

    ended = at(3 * 3600 + 1800 + 1)
    assert prune(db, live, now=ended) == 1  # ended, and settled over the retention ago: no rule can want it again
    build(db, live, now=ended)
    assert rows(db) == [] and drain(db, live, sender.factory(), now=ended).claimed == 0
    assert len(sender.sent) == 1


def test_check_asserts_retention_outlives_horizon_plus_max_lateness(settings):
    def finding(s):
        return next(f for f in evaluate(s, {}, None) if f.name == "retention_outlives_horizon_and_lateness")

    assert finding(settings).ok  # 7 days > 24 h + 30 min
    short = settings.with_(retention_seconds=settings.horizon_seconds + settings.max_lateness_seconds)
    assert not finding(short).ok and "MAX_LATENESS" in finding(short).detail
