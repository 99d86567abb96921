"""``/metrics``: the ledger read at scrape time, so every drain shows whichever process ran it.

Dagster run workers, the exact-time dispatcher, the CLI and this server's own drain route all settle
rows in the same ledger; the scrape reads what was settled in the last ``REMINDERS_METRICS_WINDOW_SECONDS``
(sends by outcome and APNs reason, the lateness histogram; at most the latest ``WINDOW_MAX_ROWS``)
plus the queue's present state: two indexed statements whose cost is bounded by a row limit or by
recent activity, never by the table's size (bench/bench_metrics.py).
The windowed figures are gauges (a gauge histogram for lateness): every instance scraping the same
ledger reports the same numbers, so aggregate them with ``max``, not ``sum``.

An age is never negative and never clamped: a stored time later than the scrape's clock (a wrong
clock, a forged ``now``) is counted in ``reminders_clock_faults`` and the age it would have made is
NaN. Labels carry outcomes, reasons and fault kinds, never device ids: bounded cardinality.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reminders_pipeline import ledger
from reminders_pipeline.config.log_throttle import first_line
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database

log = logging.getLogger(__name__)

# Lateness is bounded by the drain cadence plus scheduler slack (900 + 300 s by default) and capped
# by MAX_LATENESS_SECONDS (1800): buckets resolve the sub-minute sends an exact-time trigger makes
# and the cadence-sized waits a sweep makes.
LATENESS_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1200, 1500, 1800, 3600)

# A dispatcher counts as live when it has not stopped and beat within this many of its heartbeat
# intervals (REMINDERS_DISPATCH_HEARTBEAT_SECONDS): one late beat on a busy machine is not a death.
DISPATCHER_LIVE_BEATS = 4

# Most settled rows one scrape reads: past this the window shrinks to the latest rows (and
# reminders_metrics_window_truncated says so), keeping a scrape in milliseconds at any send rate.
WINDOW_MAX_ROWS = 2_000


@dataclass(frozen=True)
class LatenessHistogram:
    """Cumulative counts per upper bound (``le``), as Prometheus buckets are; ``before_due`` counts
    sends stamped earlier than their ``send_after`` (a wrong clock or a forged now), kept apart."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum_seconds: float
    before_due: int


@dataclass(frozen=True)
class SettledWindow:
    """Rows settled in the window by (outcome, outcome_detail), and the lateness of those sent.

    ``since`` is where the window really starts: the one asked for, or later when more than
    ``WINDOW_MAX_ROWS`` settled in it (then it covers the latest rows, and ``truncated`` says so).
    """

    since: Instant
    truncated: bool
    settled: dict[tuple[str, str | None], int]
    lateness: LatenessHistogram
    by_provider: dict[tuple[str, str], int]  # (provider, outcome)


def settled_window(
    rows: list[tuple[Instant, str, str | None, Instant, Instant | None, str]], since: Instant, limit: int
) -> SettledWindow:
    """Counts and lateness buckets of ``ledger.latest_settled`` rows (newest first)."""
    settled: dict[tuple[str, str | None], int] = {}
    by_provider: dict[tuple[str, str], int] = {}
    per_bucket = [0] * (len(LATENESS_BUCKETS) + 1)  # the last: above every bound (+Inf only)
    total, before_due = 0.0, 0
    for _, outcome, detail, send_after, sent_at, provider in rows:
        settled[(outcome, detail)] = settled.get((outcome, detail), 0) + 1
        by_provider[(provider, outcome)] = by_provider.get((provider, outcome), 0) + 1
        if outcome != "sent" or sent_at is None:
            continue
        late = sent_at - send_after
        if late < 0:
            before_due += 1
            continue
        per_bucket[bisect_left(LATENESS_BUCKETS, late)] += 1  # le is inclusive: late == bound counts there
        total += late
    cumulative, running = [], 0
    for bound, n in zip(LATENESS_BUCKETS, per_bucket):
        running += n
        cumulative.append((float(bound), running))
    truncated = len(rows) >= limit
    histogram = LatenessHistogram(tuple(cumulative), sum(per_bucket), total, before_due)
    return SettledWindow(rows[-1][0] if truncated else since, truncated, settled, histogram, by_provider)


def age_seconds(now: Instant, then: Instant | None) -> float | None:
    """``now - then``; None when there is no ``then`` or it lies in the future (a fault, not an age)."""
    if then is None or then > now:
        return None
    return now - then


@dataclass(frozen=True)
class LedgerSnapshot:
    """What one scrape read, in one read transaction."""

    now: Instant
    window_seconds: float  # what the window covers: the setting, or less when it was truncated
    window_truncated: bool
    settled: dict[tuple[str, str | None], int]
    lateness: LatenessHistogram
    due_pending: int
    claimed: int
    never_built: int
    oldest_built_at: Instant | None
    oldest_due_send_after: Instant | None
    latest_beat: Instant | None
    live_dispatchers: int
    built_in_future: int
    settled_in_future: int
    by_provider: dict[tuple[str, str], int] = field(default_factory=dict)  # (provider, outcome)

    def clock_faults(self) -> dict[str, int]:
        beat_ahead = self.latest_beat is not None and self.latest_beat > self.now
        return {
            "reminders_built_at_in_future": self.built_in_future,
            "settled_at_in_future": self.settled_in_future,
            "sent_before_send_after": self.lateness.before_due,
            "beat_at_in_future": int(beat_ahead),
        }


def read_snapshot(db: Database, now: Instant, window_seconds: int, live_seconds: int) -> LedgerSnapshot:
    """Two statements in one read transaction: the window's latest settled rows (lateness is
    computed here, never in SQL), and the queue's present state."""
    with db.read() as conn:
        since = now - window_seconds
        latest = ledger.latest_settled(conn, since, now, WINDOW_MAX_ROWS)
        gauges = ledger.queue_gauges(conn, now, now - live_seconds)
    window = settled_window(latest, since, WINDOW_MAX_ROWS)
    return LedgerSnapshot(
        now=now,
        window_seconds=now - window.since,
        window_truncated=window.truncated,
        settled=window.settled,
        lateness=window.lateness,
        **asdict(gauges),
        by_provider=window.by_provider,
    )


def _gauge(name: str, doc: str, value: float, labels: list[str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    if labels is None:
        family.add_metric([], value)
    return family


def _age(value: float | None) -> float:
    return math.nan if value is None else value


def families(s: LedgerSnapshot) -> Iterator[Metric]:
    """The snapshot as metric families (names and help texts are the metrics list in docs/guide.md)."""
    window = "in the window (reminders_metrics_window_seconds)"
    yield _gauge(
        "reminders_metrics_window_seconds",
        f"Seconds the reminders_window_* figures cover: REMINDERS_METRICS_WINDOW_SECONDS, or less when more than {WINDOW_MAX_ROWS} rows settled in it.",
        s.window_seconds,
    )
    yield _gauge(
        "reminders_metrics_window_truncated",
        f"1 when more than {WINDOW_MAX_ROWS} rows settled in the configured window and only the latest were read.",
        int(s.window_truncated),
    )
    settled = GaugeMetricFamily(
        "reminders_window_settled_rows",
        f"Rows settled {window}, by any process, by outcome and detail (APNs reason, void reason; empty if none).",
        labels=["outcome", "detail"],
    )
    for (outcome, detail), n in sorted(s.settled.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        settled.add_metric([outcome, detail or ""], n)
    yield settled
    by_provider = GaugeMetricFamily(
        "reminders_window_settled_rows_by_provider",
        f"Rows settled {window}, by the device's provider (apns, webpush, fcm) and outcome.",
        labels=["provider", "outcome"],
    )
    for (provider, outcome), n in sorted(s.by_provider.items()):
        by_provider.add_metric([provider, outcome], n)
    yield by_provider
    yield GaugeHistogramMetricFamily(
        "reminders_window_send_lateness_seconds",
        f"sent_at - send_after of the rows sent {window}.",
        buckets=[(str(float(b)), n) for b, n in s.lateness.buckets] + [("+Inf", s.lateness.count)],
        gsum_value=s.lateness.sum_seconds,
    )
    yield _gauge(
        "reminders_due_pending_rows",
        f"Pending rows whose send_after has passed (counted up to {ledger.COUNT_CAP}).",
        s.due_pending,
    )
    yield _gauge(
        "reminders_claimed_rows", f"Rows claimed and not yet settled (counted up to {ledger.COUNT_CAP}).", s.claimed
    )
    yield _gauge(
        "reminders_oldest_due_pending_age_seconds",
        "How long the oldest due pending row has waited past send_after (0 when none is due).",
        _age(age_seconds(s.now, s.oldest_due_send_after)) if s.oldest_due_send_after else 0.0,
    )
    yield _gauge(
        "reminders_oldest_build_age_seconds",
        "Age of the oldest devices.reminders_built_at (live tokens; 0 when none is built; NaN when it is in the future).",
        _age(age_seconds(s.now, s.oldest_built_at)) if s.oldest_built_at else 0.0,
    )
    yield _gauge("reminders_never_built_devices", "Live devices never built yet.", s.never_built)
    yield _gauge(
        "reminders_dispatcher_heartbeat_age_seconds",
        f"Age of the newest heartbeat of an exact-time dispatcher not stopped that beat within {DISPATCHER_LIVE_BEATS} "
        "heartbeat intervals (NaN when none did, as after a dispatcher is killed, or when it is in the future).",
        _age(age_seconds(s.now, s.latest_beat)),
    )
    yield _gauge(
        "reminders_dispatchers_live",
        f"Exact-time dispatchers not stopped that beat within {DISPATCHER_LIVE_BEATS} heartbeat intervals.",
        s.live_dispatchers,
    )
    faults = GaugeMetricFamily(
        "reminders_clock_faults",
        "Stored times impossible at scrape time (a wrong clock or a forged now), by kind; 0 when healthy.",
        labels=["kind"],
    )
    for kind, n in s.clock_faults().items():
        faults.add_metric([kind], n)
    yield faults


class LedgerCollector(Collector):
    """Reads the ledger on every scrape; ``reminders_ledger_up`` 0 (with the reason logged) when it cannot."""

    def __init__(self, db: Database, settings: Settings, clock: Callable[[], Instant] = Instant.now) -> None:
        self.db = db
        self.settings = settings
        self.clock = clock

    def describe(self) -> list[Metric]:
        """Names only, so registering the collector does not query the database."""
        return [GaugeMetricFamily("reminders_ledger_up", ""), GaugeMetricFamily("reminders_schema_at_head", "")]

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("reminders_ledger_up", "1 if the ledger answered this scrape, else 0.")
        at_head = GaugeMetricFamily(
            "reminders_schema_at_head", "1 if the database is at this release's migration head."
        )
        try:
            migrate.require_head(self.db)
            live = DISPATCHER_LIVE_BEATS * self.settings.dispatch_heartbeat_seconds
            snapshot = read_snapshot(self.db, self.clock(), self.settings.metrics_window_seconds, live)
        except migrate.SchemaNotCurrent as exc:
            log.warning("metrics: %s", exc)
            at_head.add_metric([], 0)
            up.add_metric([], 0)
            yield from (up, at_head)
            return
        except Exception as exc:  # noqa: BLE001 - a scrape must answer even when the database does not
            log.warning("metrics: ledger unavailable: %s: %s", type(exc).__name__, first_line(exc))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        at_head.add_metric([], 1)
        yield from (up, at_head)
        yield from families(snapshot)


class Metrics:
    """One app's registry: the ledger collector, and the two counters only this process can know."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, db: Database, settings: Settings, clock: Callable[[], Instant] = Instant.now) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(LedgerCollector(db, settings, clock))
        self.drains = Counter("reminders_http_drains", "Drain route calls that ran a drain.", registry=self.registry)
        self.tz_failures = Counter(
            "reminders_tz_write_failures",
            "Best-effort tz offset writes that failed (the feed was still served).",
            registry=self.registry,
        )

    def observe_drain(self, summary: DrainResult) -> None:
        """Its sends show in the ledger figures like everyone else's; only the call is counted here."""
        self.drains.inc()

    def tz_write_failed(self) -> None:
        self.tz_failures.inc()

    def render(self) -> bytes:
        """The text exposition; queries the ledger, so call it off the event loop."""
        return generate_latest(self.registry)
