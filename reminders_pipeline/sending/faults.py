"""What failed sends say about each provider: which rows go back to pending and when, and when a
run of them is that provider's outage, which halts its rows (and only its rows), alerted once.

A send that certainly never reached its provider (``SendResult.retry``) goes back to pending, a
bounded number of times, with a backoff. Each provider is its own fault domain: one ``Outage`` per
provider judges its answers across batches, so an APNs outage halts APNs while Web Push and FCM go
on sending, and a success of one provider says nothing of another.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from reminders_pipeline.config.alerts import raise_alert
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.rows import ClaimedRow
from reminders_pipeline.domain.run_summary import DrainResult
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Provider
from reminders_pipeline.providers.base import NOT_WRITTEN, POOL_WAIT, SendResult
from reminders_pipeline.sending.settlement import Settlement

log = logging.getLogger(__name__)

UNREACHABLE = "_unreachable"  # the reason of an outage halt: ``apns_unreachable: ...``

OUTAGE_WINDOW_SECONDS = 10.0  # certain non-delivery for this long, over two answers or more, is an outage
MAYBE_OURS_DEVICES = 3  # distinct devices in a row answering ``SendResult.maybe_ours``: our fault, not theirs


def is_outage(reason: str | None) -> bool:
    """True for an outage halt (it ends when the provider answers again), False for a
    configuration fault (it ends when someone mends the credentials)."""
    return reason is not None and reason.split(":", 1)[0].endswith(UNREACHABLE)


def provider_name(provider: str) -> str:
    """How people write ``provider``'s name; an unknown one as it is."""
    try:
        return Provider(provider).display
    except ValueError:
        return provider


@dataclass
class Outage:
    """Whether one provider is out, judged across batches: its sends in a row that certainly never
    reached it or that it could not process (500, 503), ``limit`` of them or for ``window``
    seconds. A 429 is the provider throttling one target: that target's backoff, no outage. One
    instance per provider lives as long as its sender (a dispatcher's, a drain call's), so a
    stream of one-row batches trips it as a burst does; ``alerted`` keeps its alert to one per
    outage; ``spent`` holds the rows of the streak that spent an attempt, given back once the
    streak turns out to be an outage."""

    provider: str
    limit: int
    window: float = OUTAGE_WINDOW_SECONDS
    streak: int = 0
    since: Instant | None = None  # when the streak's first answer was counted
    last: str | None = None
    alerted: bool = False
    spent: Counter[int] = field(default_factory=Counter)  # row id -> attempts spent in this streak
    rows: set[int] = field(default_factory=set)  # the rows the streak's answers were for
    ours: set[str] = field(default_factory=set)  # devices answering ``maybe_ours`` since the last delivery
    ours_reason: str | None = None

    def count(self, results: Iterable[SendResult], now: Instant) -> str | None:
        """The halt reason while the outage lasts, else None."""
        for r in results:
            if not_written(r) or not r.outage:
                continue  # failed before the write for another reason, or a user's own endpoint: says nothing of it
            if r.retry and r.status != 429:
                self.since = now if self.streak == 0 else self.since
                self.streak, self.last = self.streak + 1, r.reason
                self.rows.add(r.row_id)
            else:
                if self.alerted:
                    log.warning(
                        "%s answers again after %d sends not delivered", provider_name(self.provider), self.streak
                    )
                self.streak, self.since, self.alerted = 0, None, False
                self.spent.clear()
                self.rows.clear()
        return self.reason(now)

    def maybe_ours(self, results: Iterable[SendResult], device_of: Mapping[int, str]) -> str | None:
        """A configuration fault's reason once ``MAYBE_OURS_DEVICES`` devices in a row answered what
        may be their fault or ours (``SendResult.maybe_ours``): one device's foreign token halts
        no one, our key of another project halts the provider. A delivery starts the count again."""
        for r in results:
            if r.ok:
                self.ours.clear()
            elif r.maybe_ours:
                self.ours.add(device_of.get(r.row_id, str(r.row_id)))
                self.ours_reason = r.reason
        if len(self.ours) < MAYBE_OURS_DEVICES:
            return None
        return f"{self.ours_reason} (answered for {len(self.ours)} devices in a row)"

    def shared(self) -> bool:
        """The streak spans several rows: maybe an outage not yet long enough to be sure of, so
        no row fails for attempts it spent on it (the window bounds how long that lasts)."""
        return len(self.rows) >= 2

    def reason(self, now: Instant) -> str | None:
        lasting = self.since is not None and self.streak >= 2 and now - self.since >= self.window
        if self.streak < self.limit and not lasting:
            return None
        return f"{self.provider}{UNREACHABLE}: {self.streak} sends in a row not delivered (last: {self.last})"


@dataclass
class Outages:
    """One ``Outage`` per provider, made on first need."""

    limit: int
    window: float = OUTAGE_WINDOW_SECONDS
    by_provider: dict[str, Outage] = field(default_factory=dict)

    def of(self, provider: str) -> Outage:
        if provider not in self.by_provider:
            self.by_provider[provider] = Outage(provider, self.limit, self.window)
        return self.by_provider[provider]


def not_written(result: SendResult) -> bool:
    return (result.reason or "").startswith(NOT_WRITTEN + ":")


def pool_wait(result: SendResult) -> bool:
    """Never written for want of a pooled connection: other rows' doing, not the row's endpoint's."""
    return (result.reason or "").endswith(":" + POOL_WAIT)


def return_undelivered(
    out: Settlement,
    rows: list[ClaimedRow],
    results: list[SendResult],
    settings: Settings,
    outages: Outages,
    summary: DrainResult,
) -> Settlement:
    """Rows whose send certainly was not delivered go back to pending, not due again before their
    backoff ends (``retry_not_before``): those the provider answered (429, 500, 503) and those that
    failed before their write for another reason (``NOT_WRITTEN``) while attempts remain, one
    attempt spent (so does a user's own endpoint that cannot be reached: a dead one fails after
    ``REMINDERS_SEND_MAX_ATTEMPTS``, backing off, instead of being tried every few seconds until
    ``MAX_LATENESS``); those that never reached our provider (refused, TLS, no route), and those its
    outage answered, always, spending none: only a provider's own answers count against a row
    (the lateness policy still bounds them). While a provider's streak spans several rows, no row
    fails for its attempts (it may be an outage not yet sure); once the streak is an outage, the
    attempts its answers spent are given back (``Settlement.refunds``). The rest stay failed as
    ``settlement_of`` wrote them. An outage halts its provider's rows only."""
    by_provider: dict[str, list[SendResult]] = {}
    for r in results:
        by_provider.setdefault(out.provider_of(r.row_id), []).append(r)
    out_now = {}
    devices = {r["id"]: r["device_id"] for r in rows}
    for provider, answers in by_provider.items():
        outage = outages.of(provider)
        ours = outage.maybe_ours(answers, devices)
        if ours and summary.halt(provider, ours):
            log.error(
                "%s configuration fault (%s): stopped claiming its rows; they stay pending",
                provider_name(provider),
                ours,
            )
        reason = outage.count(answers, out.at)
        if reason:
            out_now[provider] = reason
            for row_id, n in outage.spent.items():
                out.refunds[row_id] = out.refunds.get(row_id, 0) + n
            outage.spent.clear()
    attempts = {r["id"]: r.get("attempts") or 0 for r in rows}
    unreached = {
        r.row_id
        for r in results
        if r.retry
        and not not_written(r)
        and (r.status is None and r.outage or out.provider_of(r.row_id) in out_now or pool_wait(r))
    }
    streaked = {
        r.row_id: outages.of(out.provider_of(r.row_id))
        for r in results
        if r.retry and r.outage and r.status not in (None, 429) and not not_written(r) and r.row_id not in unreached
    }
    again = unreached | {
        r.row_id
        for r in results
        if r.retry
        and (
            attempts[r.row_id] + 1 < settings.send_max_attempts or r.row_id in streaked and streaked[r.row_id].shared()
        )
    }
    for row_id, outage in streaked.items():
        if row_id in again:
            outage.spent[row_id] += 1
    waits = {r.row_id: r.retry_after for r in results if r.retry_after}  # the provider's Retry-After
    # A row its provider's outage answered waits for no backoff of its own: the halt paces its
    # provider's rows (a dispatcher's probe, the next drain), and it goes as soon as one is answered.
    paced = {r.row_id for r in results if out.provider_of(r.row_id) in out_now}
    if again:
        out.returned.extend(
            {"id": r["id"], "outcome_detail": r["outcome_detail"], "spent": r["id"] not in unreached,
             "not_before": None if r["id"] in paced else max(
                 retry_not_before(out.at, 1 if r["id"] in unreached else attempts[r["id"]] + 1, settings),
                 out.at + waits.get(r["id"], 0))}
            for r in out.rows if r["id"] in again
        )  # fmt: skip
        out.rows = [r for r in out.rows if r["id"] not in again]
    for provider, reason in out_now.items():
        if summary.halt(provider, reason) and not outages.of(provider).alerted:
            log.error(
                "%s unreachable (%s): stopped claiming its rows; they stay pending", provider_name(provider), reason
            )
    return out


def retry_not_before(
    now: Instant, attempt: int, settings: Settings, uniform: Callable[[float, float], float] = random.uniform
) -> Instant:
    """When a row may go again after its ``attempt``-th send certainly did not deliver: exponential
    backoff (``REMINDERS_SEND_RETRY_BASE_SECONDS`` doubling per attempt, at most
    ``REMINDERS_SEND_RETRY_MAX_SECONDS``) with jitter down to half, so rows throttled together do
    not all come back together, and a second dispatcher or the cron drain waits as well."""
    delay = min(settings.send_retry_max_seconds, settings.send_retry_base_seconds * 2 ** (attempt - 1))
    return now + uniform(delay / 2, delay)


def alert_halt(settings: Settings, provider: str, reason: str, claimer: str, summary: DrainResult) -> None:
    """The one alert of a provider's halt: an outage, or a configuration fault no retry can mend."""
    name = provider_name(provider)
    if is_outage(reason):
        title = f"{name} unreachable: drain stopped claiming its rows"
        text = (
            f"{reason}. Those rows are pending again, no attempt spent; the other providers' rows are sent on, "
            f"and {name} rows go once it answers (each bounded by MAX_LATENESS)."
        )
    elif provider == Provider.FCM:
        title = "FCM configuration fault: drain stopped claiming its rows"
        text = (
            f"FCM answered {reason}: the service-account key (REMINDERS_FCM_CREDENTIALS_FILE) or its "
            "project is refused, not the row. Its rows not yet claimed stay pending; the other providers' are sent on."
        )
    elif provider == Provider.WEBPUSH:
        title = "Web Push configuration fault: drain stopped claiming its rows"
        text = (
            f"Web Push failed with {reason}: the VAPID key (REMINDERS_VAPID_PRIVATE_KEY_FILE) or subject is refused, "
            "not the row. Its rows not yet claimed stay pending; the other providers' are sent on."
        )
    else:
        title = "APNs configuration fault: drain stopped claiming its rows"
        text = (
            f"APNs answered {reason}: the credentials, key id, team or topic are wrong, not the row. "
            "Its rows not yet claimed stay pending; the other providers' are sent on."
        )
    raise_alert(settings, title, text, claimer=claimer, failed=summary.outcomes.get("failed", 0))


def describe_halts(halts: dict[str, str]) -> str:
    """One line naming each halted provider and why (a Dagster failure, a log line)."""
    return "; ".join(f"{provider_name(p)}: {reason}" for p, reason in sorted(halts.items()))
