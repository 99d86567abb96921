"""Setting aside, before parsing, the single events of a large calendar that surely fall outside the
read window: a text scan of each VEVENT block's DTSTART and DTEND, never of a recurring one."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from reminders_pipeline.domain.zones import MAX_OFFSET_SECONDS

_VEVENT = re.compile(rb"^BEGIN:VEVENT\r?\n.*?^END:VEVENT\r?\n", re.S | re.M)


_RECURRING = re.compile(rb"^(RRULE|RDATE|EXRULE|RECURRENCE-ID)[;:]", re.M)


_DURATION = re.compile(rb"^DURATION[;:]", re.M)

PRESELECT_ABOVE = 2000  # events in one calendar above which out-of-window single events skip parsing


def preselect(body: bytes, window_start: int, window_end: int) -> bytes:
    """A calendar with more than ``PRESELECT_ABOVE`` events loses, before parsing, the single
    (non-recurring) events that surely lie outside the window: parsing costs a fraction of a
    millisecond per event, so years of exported history would otherwise take seconds. "Surely":
    a local time read as UTC is within 14 h of its instant, and an event whose start or end cannot
    be read from its raw text is kept. Nothing in the window is dropped, so nothing is counted."""
    if body.count(b"BEGIN:VEVENT") <= PRESELECT_ABOVE:
        return body
    text = re.sub(rb"\r?\n[ \t]", b"", body)  # unfold (RFC 5545 3.1); icalendar does the same
    lo, hi = window_start - 2 * MAX_OFFSET_SECONDS, window_end + 2 * MAX_OFFSET_SECONDS
    kept, last = [], 0
    for block in _VEVENT.finditer(text):
        if _surely_outside(block.group(), lo, hi):
            kept.append(text[last : block.start()])
            last = block.end()
    kept.append(text[last:])
    return b"".join(kept)


def _surely_outside(block: bytes, lo: int, hi: int) -> bool:
    if _RECURRING.search(block):
        return False
    start = _raw_time(block, b"DTSTART")
    if start is None:
        return False
    if start > hi:
        return True
    if _DURATION.search(block):
        return False
    end = _raw_time(block, b"DTEND")
    return (end if end is not None else start + 86400) < lo


def _raw_time(block: bytes, name: bytes) -> int | None:
    """A DATE or DATE-TIME property's value as UTC seconds (local times read as UTC), or None."""
    match = re.search(rb"^" + name + rb"(?:;[^:\r\n]*)?:(\d{8})(?:T(\d{6})Z?)?\r?$", block, re.M)
    if not match:
        return None
    try:
        day, clock = match.group(1).decode(), (match.group(2) or b"000000").decode()
        return int(datetime.strptime(day + clock, "%Y%m%d%H%M%S").replace(tzinfo=UTC).timestamp())
    except ValueError:
        return None
