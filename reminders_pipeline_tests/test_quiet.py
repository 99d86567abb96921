"""Logging through an outage: a library's repeated lines held to one per template a minute."""

from __future__ import annotations

import logging

from reminders_pipeline.config.log_throttle import RepeatFilter


def _record(msg: str, args: tuple, created: float) -> logging.LogRecord:
    record = logging.LogRecord("aioapns", logging.ERROR, __file__, 1, msg, args, None)
    record.created = created
    return record


def test_each_template_passes_once_a_minute_and_then_says_how_many_it_stands_for():
    quiet = RepeatFilter(every=60)
    passed = []
    for second in range(0, 150):  # three lines a second, as aioapns writes for each send that cannot connect
        for msg, args in (("Could not connect to server: %s", ("refused",)), ("Could not send notification %s: %s", (second, "ConnectionError")),
                          ("Failed to send after %d attempts.", (1,))):  # fmt: skip
            record = _record(msg, args, 1000.0 + second)
            if quiet.filter(record):
                passed.append((second, record.getMessage()))
    assert [s for s, _ in passed] == [0, 0, 0, 60, 60, 60, 120, 120, 120]
    assert passed[0][1] == "Could not connect to server: refused"
    assert passed[3][1] == "Could not connect to server: refused (and 59 alike in the last 60s)"
    assert passed[4][1] == "Could not send notification 60: ConnectionError (and 59 alike in the last 60s)"
