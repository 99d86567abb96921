"""Logging a step that keeps failing: one line when it starts, a summary a minute while it lasts,
one line when it works again.

A long-lived loop (the dispatcher) retries a failing step every poll; logging each failure with
its traceback would write thousands of lines through a database outage and bury the one that
says when it began.
"""

from __future__ import annotations

import logging

from reminders_pipeline.domain.times import Instant

SUMMARY_EVERY_SECONDS = 60.0


def first_line(exc: BaseException) -> str:
    """An exception's first line: SQLAlchemy appends the whole statement, too much for a warning."""
    text = str(exc)
    return text.splitlines()[0] if text else ""


class QuietFailures:
    """The failures of one step (``what``), logged to ``log`` by state change and summary only."""

    def __init__(self, log: logging.Logger, what: str, every: float = SUMMARY_EVERY_SECONDS) -> None:
        self.log, self.what, self.every = log, what, every
        self.failures = 0
        self.since: Instant | None = None
        self._next_summary = Instant(0)

    def failed(self, exc: BaseException, now: Instant) -> None:
        self.failures += 1
        reason = f"{type(exc).__name__}: {first_line(exc)}"
        if self.since is None:
            self.since, self._next_summary = now, now + self.every
            self.log.error("%s failed (%s); retrying quietly, a summary every %.0fs", self.what, reason, self.every)
        elif now >= self._next_summary:
            self._next_summary = now + self.every
            self.log.error(
                "%s still failing: %d times in %.0fs (last: %s)", self.what, self.failures, now - self.since, reason
            )

    def succeeded(self, now: Instant) -> None:
        if self.since is not None:
            self.log.warning("%s works again after %d failure(s) in %.0fs", self.what, self.failures, now - self.since)
        self.failures, self.since = 0, None


class RepeatFilter(logging.Filter):
    """A library's log lines, one per message template a minute: aioapns logs three lines for every
    send that cannot connect (a two-minute APNs outage wrote 1,300). The first of each template
    passes at once; the next to pass says how many alike it stands for."""

    def __init__(self, every: float = SUMMARY_EVERY_SECONDS) -> None:
        super().__init__()
        self.every = every
        self._last: dict[str, tuple[float, int]] = {}  # template -> (when one last passed, how many held since)

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)
        passed, held = self._last.get(key, (float("-inf"), 0))
        if record.created - passed < self.every:
            self._last[key] = (passed, held + 1)
            return False
        self._last[key] = (record.created, 0)
        if held:
            record.msg = f"{record.msg} (and {held} alike in the last {record.created - passed:.0f}s)"
        return True
