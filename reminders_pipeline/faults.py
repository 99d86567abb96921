"""What failed sends say about APNs: which rows go back to pending and when, and when a run of
them is an outage that halts the drain, alerted once.

A send that certainly never reached APNs (``SendResult.retry``) goes back to pending, a bounded
number of times, with a backoff; a run of them is an outage, judged across batches by one
``Outage`` per sender, and halts the drain as an APNs configuration fault does.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .alerts import raise_alert
from .sender import NOT_WRITTEN, SendResult
from .settings import Settings
from .settlement import Settlement
from .summary import DrainResult
from .times import Instant

log = logging.getLogger(__name__)

APNS_UNREACHABLE = "apns_unreachable"
FCM_FAULT = "fcm:"  # the reason prefix of FCM's configuration faults (``fcm.answer``)

OUTAGE_WINDOW_SECONDS = 10.0  # certain non-delivery for this long, over two answers or more, is an outage


@dataclass
class Outage:
    """Whether APNs is out, judged across batches: sends in a row that certainly never reached
    APNs or that APNs could not process (500, 503), ``limit`` of them or for ``window`` seconds.
    A 429 is APNs throttling one device token: that token's backoff, no outage. One instance
    lives as long as its sender (a dispatcher's, a drain call's), so a stream of one-row batches
    trips it as a burst does; ``alerted`` keeps its alert to one per outage."""

    limit: int
    window: float = OUTAGE_WINDOW_SECONDS
    streak: int = 0
    since: Instant | None = None  # when the streak's first answer was counted
    last: str | None = None
    alerted: bool = False

    def count(self, results: list[SendResult], now: Instant) -> str | None:
        """The halt reason while the outage lasts, else None."""
        for r in results:
            if not_written(r) or not r.outage:
                continue  # failed before the write for another reason, or a user's own endpoint: says nothing of it
            if r.retry and r.status != 429:
                self.since = now if self.streak == 0 else self.since
                self.streak, self.last = self.streak + 1, r.reason
            else:
                if self.alerted:
                    log.warning("APNs answers again after %d sends not delivered", self.streak)
                self.streak, self.since, self.alerted = 0, None, False
        lasting = self.since is not None and self.streak >= 2 and now - self.since >= self.window
        if self.streak < self.limit and not lasting:
            return None
        return f"{APNS_UNREACHABLE}: {self.streak} sends in a row not delivered (last: {self.last})"


def not_written(result: SendResult) -> bool:
    return (result.reason or "").startswith(NOT_WRITTEN + ":")


def return_undelivered(
    out: Settlement,
    rows: list[dict[str, Any]],
    results: list[SendResult],
    settings: Settings,
    outage: Outage,
    summary: DrainResult,
) -> Settlement:
    """Rows whose send certainly was not delivered go back to pending, not due again before their
    backoff ends (``retry_not_before``): those APNs answered (429, 500, 503) and those that failed
    before their write for another reason (``NOT_WRITTEN``) while attempts remain, one attempt
    spent; those that never reached APNs (refused, TLS, no route) always, spending none, as only
    APNs' answers count against a row (the lateness policy still bounds them). The rest stay
    failed as ``settlement_of`` wrote them. A long enough run of them, across batches, halts the drain."""
    attempts = {r["id"]: r.get("attempts") or 0 for r in rows}
    unreached = {r.row_id for r in results if r.retry and r.status is None and not not_written(r)}
    again = unreached | {r.row_id for r in results if r.retry and attempts[r.row_id] + 1 < settings.send_max_attempts}
    waits = {r.row_id: r.retry_after for r in results if r.retry_after}  # the provider's Retry-After
    if again:
        out.returned.extend(
            {"id": r["id"], "outcome_detail": r["outcome_detail"], "spent": r["id"] not in unreached,
             "not_before": max(retry_not_before(out.at, 1 if r["id"] in unreached else attempts[r["id"]] + 1, settings),
                               out.at + waits.get(r["id"], 0))}
            for r in out.rows if r["id"] in again
        )  # fmt: skip
        out.rows = [r for r in out.rows if r["id"] not in again]
    reason = outage.count(results, out.at)
    if reason and not summary.halted:
        summary.halted = reason
        if not outage.alerted:  # one line per outage, not one per batch that meets it
            log.error("APNs unreachable (%s): stopped claiming; remaining rows stay pending", reason)
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


def alert_halt(settings: Settings, summary: DrainResult, claimer: str) -> None:
    """The one alert of a halt: an outage, or a configuration fault that no retry can mend."""
    if summary.halted and summary.halted.startswith(APNS_UNREACHABLE):
        title = "APNs unreachable: drain stopped claiming"
        text = (
            f"{summary.halted}. Those rows are pending again (each send is bounded by REMINDERS_SEND_MAX_ATTEMPTS "
            "and MAX_LATENESS); rows not yet claimed stay pending for the next drain."
        )
    elif summary.halted and summary.halted.startswith(FCM_FAULT):
        title = "FCM configuration fault: drain stopped claiming"
        text = (
            f"FCM answered {summary.halted}: the service-account key (REMINDERS_FCM_CREDENTIALS_FILE) or its "
            "project is refused, not the row. Rows not yet claimed stay pending for the next drain."
        )
    else:
        title = "APNs configuration fault: drain stopped claiming"
        text = (
            f"APNs answered {summary.halted}: the credentials, key id, team or topic are wrong, not the row. "
            "Rows not yet claimed stay pending for the next drain."
        )
    raise_alert(settings, title, text, claimer=claimer, failed=summary.outcomes.get("failed", 0))
