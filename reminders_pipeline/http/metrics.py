"""``/metrics``: the ledger's state read at scrape time, plus what this process's drains did.

Gauges come from the ledger on every scrape (a custom collector), so they are true whoever wrote
the rows: Dagster runs, the CLI, other processes. Counters and the lateness histogram are fed from
the drain summaries of the drain route in this process only (Dagster drains report to Dagster);
that is why ``reminders serve`` runs one worker. Each app gets its own ``CollectorRegistry``, so two
apps in one process (the tests) never share or collide.

Labels carry statuses, outcomes and APNs reasons, never device ids: bounded cardinality.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import ledger
from ..db import Database
from ..drain import DrainSummary
from ..schema import OUTCOMES
from ..times import now_utc, unix_from_iso

log = logging.getLogger(__name__)

# Lateness is bounded by the drain cadence plus scheduler slack (900 + 300 s by default) and capped
# by MAX_LATENESS_SECONDS (1800): buckets resolve the sub-minute sends an exact-time trigger makes
# and the cadence-sized waits a sweep makes.
LATENESS_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1200, 1500, 1800, 3600)


def first_line(exc: BaseException) -> str:
    """An exception's first line: SQLAlchemy appends the whole statement, too much for a warning."""
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _age(now: str, then: str | None) -> float:
    return 0.0 if then is None else max(0.0, unix_from_iso(now) - unix_from_iso(then))


class LedgerCollector(Collector):
    """Queue rows by status and outcome, the oldest build and the oldest due pending row, per scrape."""

    def __init__(self, db: Database, clock: Callable[[], str] = now_utc) -> None:
        self.db = db
        self.clock = clock

    def describe(self) -> list[Metric]:
        """Names only, so registering the collector does not query the database."""
        return list(self._families().values())

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {
            "rows": GaugeMetricFamily(
                "reminders_queue_rows", "notification_queue rows by status and outcome (outcome empty until settled).",
                labels=["status", "outcome"],
            ),
            "built_age": GaugeMetricFamily(
                "reminders_oldest_build_age_seconds",
                "Age of the oldest devices.reminders_built_at (live tokens); must stay below min lead - margin.",
            ),
            "never_built": GaugeMetricFamily("reminders_never_built_devices", "Live devices never built yet."),
            "due_age": GaugeMetricFamily(
                "reminders_oldest_due_pending_age_seconds",
                "How long the oldest due pending row has waited past send_after (0 when none is due).",
            ),
            "up": GaugeMetricFamily("reminders_ledger_up", "1 if the ledger answered this scrape, else 0."),
        }

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        now = self.clock()
        try:
            with self.db.read() as conn:
                counts = ledger.queue_counts(conn)
                never, oldest = ledger.oldest_built(conn)
                oldest_due = ledger.oldest_due_pending(conn, now)
        except Exception as exc:  # noqa: BLE001 - a scrape must answer even when the database does not
            log.warning("metrics: ledger unavailable: %s: %s", type(exc).__name__, first_line(exc))
            families["up"].add_metric([], 0)
            yield families["up"]
            return
        # Every known series, zeros included, so a status that empties does not vanish from graphs.
        known = {("pending", None): 0, ("claimed", None): 0, **{("settled", o): 0 for o in OUTCOMES}}
        for (status, outcome), n in {**known, **counts}.items():
            families["rows"].add_metric([status, outcome or ""], n)
        families["built_age"].add_metric([], _age(now, oldest))
        families["never_built"].add_metric([], never)
        families["due_age"].add_metric([], _age(now, oldest_due))
        families["up"].add_metric([], 1)
        yield from families.values()


class Metrics:
    """One app's registry: the ledger collector and the counters its drain route feeds."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, db: Database, clock: Callable[[], str] = now_utc) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(LedgerCollector(db, clock))
        self.sends = Counter(
            "reminders_sends", "Rows this process's drains settled sent or failed, by APNs reason (empty when sent).",
            ["outcome", "reason"], registry=self.registry,
        )
        self.settled = Counter(
            "reminders_drained_rows", "Rows this process's drains settled, by outcome.", ["outcome"], registry=self.registry
        )
        self.abandoned = Counter(
            "reminders_abandoned_claims", "Claims this process's drains failed as abandoned (never retried).", registry=self.registry
        )
        self.lateness = Histogram(
            "reminders_send_lateness_seconds", "sent_at - send_after of each row this process's drains sent.",
            buckets=LATENESS_BUCKETS, registry=self.registry,
        )
        self.drains = Counter("reminders_http_drains", "Drain route calls that ran a drain.", registry=self.registry)
        self.tz_failures = Counter(
            "reminders_tz_write_failures", "Best-effort tz offset writes that failed (the feed was still served).",
            registry=self.registry,
        )

    def observe_drain(self, summary: DrainSummary) -> None:
        self.drains.inc()
        self.abandoned.inc(summary.abandoned)
        for outcome, n in summary.outcomes.items():
            self.settled.labels(outcome).inc(n)
        if summary.outcomes.get("sent"):
            self.sends.labels("sent", "").inc(summary.outcomes["sent"])
        explained = 0
        for key, n in summary.details.items():
            outcome, _, reason = key.partition(":")
            if outcome == "failed":
                self.sends.labels("failed", reason).inc(n)
                explained += n
        if summary.outcomes.get("failed", 0) > explained:
            self.sends.labels("failed", "unknown").inc(summary.outcomes["failed"] - explained)
        for seconds in summary.lateness_seconds:
            self.lateness.observe(seconds)

    def tz_write_failed(self) -> None:
        self.tz_failures.inc()

    def render(self) -> bytes:
        """The text exposition; queries the ledger, so call it off the event loop."""
        return generate_latest(self.registry)
