"""``reminders check``: the relationships the cadences, leads and retention must keep, asserted as
relationships, never as numbers.

    full sweep period < min lead - margin          (else reminders never queue)
    MAX_LATENESS_SECONDS > drain cadence + slack   (else late rows are dropped as too_late)
    with the dispatcher off: every lead > drain cadence + slack   (else settled event_started)
    retention > horizon + MAX_LATENESS_SECONDS     (else a pruned row could be queued and sent again)

Cadences come from the cron strings the schedules run on, so retuning one side alone fails here.
The same health is watched while running: whether the sweep and the dispatcher keep up
(``SweepStatus``, ``DispatchHealth``), read by the Dagster sensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.rules import Rule, device_rules
from reminders_pipeline.domain.times import Instant, stored_or_none
from reminders_pipeline.ledger.db import Database


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    detail: str


def oldest_due_wait(conn: Connection, now: Instant) -> tuple[Instant | None, float]:
    """The oldest due pending row's ``send_after`` and how long it has waited past it (0 when none
    is due): how far behind sending is, read by the drain_backlog check and the dispatcher's."""
    oldest = ledger.oldest_due_pending(conn, now)
    return oldest, 0.0 if oldest is None else now - oldest


def sweep_period_seconds(settings: Settings, devices_per_chunk: Mapping[int, int]) -> int:
    """Worst-case time for every device to be visited once.

    A chunk is visited every ``ceil(chunk_count / chunks_per_tick)`` build ticks, and each visit
    builds at most ``chunk_size`` of its stalest devices.
    """
    ticks_between_visits = -(-settings.chunk_count // settings.effective_chunks_per_tick)
    biggest = max(devices_per_chunk.values(), default=0)
    visits = max(1, -(-biggest // settings.chunk_size))
    return settings.build_cadence_seconds * ticks_between_visits * visits


def short_leads(settings: Settings, rules: Iterable[Rule]) -> Finding:
    """Without the dispatcher, a row waits for the next drain tick: up to the cadence plus slack.
    A rule with a shorter lead comes due less than that before its anchor, so its reminder is
    settled ``event_started`` (or, for a zero lead, sent after the event began)."""
    if settings.dispatch_enabled:
        return Finding(
            "short_leads_deliverable",
            True,
            "the dispatcher sends each row at its send_after: any lead is deliverable, 0 included",
        )
    bound = settings.drain_cadence_seconds + settings.scheduler_slack_seconds
    short = sorted({r.name for r in rules if r.lead_seconds < bound})
    return Finding(
        "short_leads_deliverable",
        not short,
        f"the dispatcher is disabled, so rows wait for drain ticks (cadence {settings.drain_cadence_seconds}s + slack "
        f"{settings.scheduler_slack_seconds}s = {bound}s); rules with a shorter lead would be settled event_started: "
        + (", ".join(short) if short else "none in use"),
    )


def evaluate(
    settings: Settings, devices_per_chunk: Mapping[int, int], min_lead: int | None, rules: Iterable[Rule] = ()
) -> list[Finding]:
    drain, build = settings.drain_cadence_seconds, settings.build_cadence_seconds
    period = sweep_period_seconds(settings, devices_per_chunk)
    lead = settings.default_lead_seconds if min_lead is None else min_lead
    budget = lead - settings.sweep_margin_seconds
    return [
        Finding(
            "max_lateness_covers_drain_cadence",
            settings.max_lateness_seconds > drain + settings.scheduler_slack_seconds,
            f"MAX_LATENESS_SECONDS {settings.max_lateness_seconds} must exceed drain cadence {drain} + "
            f"scheduler slack {settings.scheduler_slack_seconds}",
        ),
        Finding(
            "sweep_period_within_lead",
            period < budget,
            f"full sweep period {period}s ({sum(devices_per_chunk.values())} devices, chunk size "
            f"{settings.chunk_size}, build cadence {build}s) must be under min lead {lead}s - margin "
            f"{settings.sweep_margin_seconds}s = {budget}s",
        ),
        Finding(
            "horizon_covers_sweep",
            settings.horizon_seconds > period + drain,
            f"horizon {settings.horizon_seconds}s must exceed sweep period {period}s + drain cadence {drain}s, "
            "so a row is queued before it comes due",
        ),
        Finding(
            "stored_chunks_match_chunk_count",
            max(devices_per_chunk, default=-1) < settings.chunk_count,
            f"every device's stored chunk must be below REMINDERS_CHUNK_COUNT {settings.chunk_count} "
            "(after changing it, run `reminders device rechunk`)",
        ),
        Finding(
            "abandon_after_outlives_a_send",
            settings.abandon_after_seconds > 2 * settings.send_timeout_seconds,
            f"abandon-after {settings.abandon_after_seconds}s must exceed twice the send timeout "
            f"{settings.send_timeout_seconds}s, so a live claim is never failed as abandoned",
        ),
        Finding(
            "retention_outlives_horizon_and_lateness",
            settings.retention_seconds > settings.horizon_seconds + settings.max_lateness_seconds,
            f"retention {settings.retention_seconds}s must exceed horizon {settings.horizon_seconds}s + MAX_LATENESS "
            f"{settings.max_lateness_seconds}s, so a settled row outlives every build that could queue it again",
        ),
        Finding(
            "abandon_after_within_drain_cadence",
            settings.abandon_after_seconds <= drain,
            f"abandon-after {settings.abandon_after_seconds}s must not exceed the drain cadence {drain}s, so the "
            "next tick settles a dead run's claims",
        ),
        short_leads(settings, rules),
    ]


def clock_findings(now: Instant, built_in_future: int) -> list[Finding]:
    """Stored times the clock says cannot have happened yet: a negative age is a fault, never 0."""
    return [
        Finding(
            "no_build_in_the_future",
            built_in_future == 0,
            f"{built_in_future} device(s) have reminders_built_at later than now ({now}): a wrong clock or a "
            "forged now; every build skips them until then, so their reminders stop queueing",
        )
    ]


def check(db: Database, settings: Settings, now: Instant | None = None) -> list[Finding]:
    now = now or Instant.now()
    with db.read() as conn:
        per_chunk = ledger.devices_per_chunk(conn)
        min_lead = ledger.min_lead_seconds(conn)
        rules = ledger.rules_in_use(conn)
        built_in_future = ledger.built_after(conn, now)
    in_use = (r for lead, extra in rules for r in device_rules(lead, extra.split()))
    return evaluate(settings, per_chunk, min_lead, in_use) + clock_findings(now, built_in_future)


def device_budget(settings: Settings, lead: int, period: int) -> int:
    """How old a device's last build may grow before its reminders may go unqueued: its own lead
    less the margin, but never less than the sweep the configuration promises (its period and one
    build cadence for the build itself). A shorter lead is a configuration finding
    (``sweep_period_within_lead``), not a stall: no catch-up build can rebuild it any sooner."""
    return max(lead - settings.sweep_margin_seconds, period + settings.build_cadence_seconds)


@dataclass(frozen=True)
class SweepStatus:
    """The design's ``full sweep period < lead time - margin``, measured per device instead of predicted."""

    now: Instant
    oldest_built_at: Instant | None  # among devices built at least once (live tokens only)
    never_built: int
    budget_seconds: int  # the smallest device budget: the shortest lead's (``device_budget``)
    sweep_period_seconds: int  # what the configuration promises for today's device count
    built_in_future: int = 0  # devices stamped later than now: builds skip them until then
    stale: Mapping[int, int] = field(default_factory=dict)  # chunk -> devices older than their own budget
    short_lead_devices: int = 0  # devices whose lead less the margin is under the sweep period

    @property
    def age_seconds(self) -> float | None:
        """Age of the oldest build; None when nothing is built or even the oldest lies in the future."""
        if self.oldest_built_at is None or self.oldest_built_at > self.now:
            return None
        return self.now - self.oldest_built_at

    @property
    def breached(self) -> bool:
        """Some device is older than its own budget, or built "in the future" (never rebuilt until
        then: its reminders stop queueing too)."""
        return self.built_in_future > 0 or bool(self.stale)

    def fields(self) -> dict[str, Any]:
        age = self.age_seconds
        return {
            "oldest_reminders_built_at": stored_or_none(self.oldest_built_at),
            "oldest_build_age_seconds": None if age is None else round(age, 1),
            "budget_seconds": self.budget_seconds,
            "sweep_period_seconds": self.sweep_period_seconds,
            "stale_devices": sum(self.stale.values()),
            "never_built_devices": self.never_built,
            "devices_built_in_future": self.built_in_future,
            "short_lead_devices": self.short_lead_devices or None,
        }

    def describe(self) -> str:
        age = self.age_seconds
        stale = sum(self.stale.values())
        text = (
            f"{stale} device(s) not rebuilt within their own lead - margin (at least the sweep period {self.sweep_period_seconds}s "
            f"+ a build cadence)"
            + (f", in chunks {sorted(self.stale)}" if stale else "")
            + f"; oldest build is {'unknown' if age is None else f'{age:.0f}s'} old; smallest budget is {self.budget_seconds}s"
        )
        if self.short_lead_devices:
            text += f"; {self.short_lead_devices} device(s) have a lead under the sweep period + margin (see `reminders check`)"
        if self.built_in_future:
            text += (
                f"; {self.built_in_future} device(s) have reminders_built_at later than now "
                "(a wrong clock or a forged now): builds skip them until then"
            )
        return text


def sweep_status(db: Database, settings: Settings, now: Instant) -> SweepStatus:
    with db.read() as conn:
        never, oldest = ledger.oldest_built(conn)
        per_chunk = ledger.devices_per_chunk(conn)
        min_lead = ledger.min_lead_seconds(conn)
        period = sweep_period_seconds(settings, per_chunk)
        floor = device_budget(settings, 0, period)
        stale = ledger.stale_per_chunk(conn, now, floor, settings.sweep_margin_seconds)
        short = ledger.count_devices_with_lead_below(conn, period + settings.sweep_margin_seconds + 1)
        future = ledger.built_after(conn, now)
    smallest = device_budget(settings, settings.default_lead_seconds if min_lead is None else min_lead, period)
    return SweepStatus(now, oldest, never, smallest, period, future, stale, short)


def stale_chunks(db: Database, status: SweepStatus) -> list[int]:
    """Chunks holding a never-built device or one older than its budget, stalest first."""
    with db.read() as conn:
        wanted = set(status.stale) | (ledger.never_built_chunks(conn) if status.never_built else set())
        return [chunk for chunk in ledger.stalest_chunks(conn) if chunk in wanted] if wanted else []


@dataclass(frozen=True)
class DispatchHealth:
    """Is the exact-time path keeping up? Due rows must not wait past ``send_after`` for more than
    ``REMINDERS_DISPATCH_LATE_SECONDS`` while a dispatcher should be running."""

    now: Instant
    enabled: bool
    late_after_seconds: int
    oldest_due: Instant | None  # the oldest pending row whose send_after has passed
    wait_seconds: float  # how long it has waited past its send_after
    latest_beat: Instant | None  # newest heartbeat of a running dispatcher

    @property
    def on_time(self) -> bool:
        return not self.enabled or self.wait_seconds <= self.late_after_seconds

    def detail(self) -> str:
        if not self.enabled:
            return "the dispatcher is disabled (REMINDERS_DISPATCH_ENABLED=false): the cron drain alone sends"
        if self.on_time:
            return f"no due row has waited more than {self.late_after_seconds}s past its send_after"
        beat = f"last heartbeat {self.latest_beat}" if self.latest_beat else "no dispatcher heartbeat"
        return (
            f"a due row has waited {self.wait_seconds:.0f}s past its send_after (limit {self.late_after_seconds}s): "
            f"the dispatcher is down or behind ({beat}); the cron drain will still send what is not too late"
        )

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "oldest_due_wait_seconds": round(self.wait_seconds, 1),
            "late_after_seconds": self.late_after_seconds,
        }
        if self.oldest_due:
            meta["oldest_due_send_after"] = self.oldest_due.stored
        if self.latest_beat:
            meta["latest_dispatcher_beat"] = self.latest_beat.stored
        return meta


def dispatch_health(db: Database, settings: Settings, now: Instant) -> DispatchHealth:
    with db.read() as conn:
        oldest, wait = oldest_due_wait(conn, now)
        beat = ledger.latest_beat(conn)
    return DispatchHealth(now, settings.dispatch_enabled, settings.dispatch_late_seconds, oldest, wait, beat)
