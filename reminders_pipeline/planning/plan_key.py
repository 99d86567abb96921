"""When a device's last plan can be reused: the key of everything a plan is made from.

``plan_key`` digests the device columns the plan reads (``PLANNED_FROM``), each subscribed source's
content and the horizon. A column ``plan.py`` starts to read must join ``PLANNED_FROM``, or a change
to it would leave the key as it was and the device's plan stale.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.sources.reader import SourceRead

# What a plan is made from on the device's side; ``registered_at`` and ``created_at`` stand for a
# new token or a re-created device, whose voided rows a full plan queues again.
PLANNED_FROM = (
    "reminder_lead_seconds",
    "extra_rules",
    "all_day_rules",
    "use_alarms",
    "tz_name",
    "last_tz_offset_seconds",
    "quiet_hours",
    "attendees",
    "locale",  # an agenda's words
    "clock",
    "calendars",
    "created_at",
    "registered_at",
)


# Bumped whenever planning changes meaning: every device then plans in full once.
PLAN_VERSION = "1"


# However unchanged its inputs, each device plans in full at least this often (at a time of day of
# its own, so the full plans spread over the day): whatever no key can see, a zone database
# update for one, is taken in within a day.
FULL_PLAN_SECONDS = 86400


def plan_key(
    device: Mapping[str, Any],
    subscribed: Iterable[int],
    reads: Mapping[int, SourceRead],
    now: Instant,
    *,
    before_changes: bool = False,
) -> str | None:
    """What the device's plan is made from: its planning columns, each subscribed source's
    content, and the day (``FULL_PLAN_SECONDS``). Two builds with the same key plan the same rows,
    except those the horizon has moved over. None when a source was not read whole (failed, cut by
    the item cap, a series dropped): the build plans in full, and so does the next. A device that
    uses calendar alarms steps too: an alarm may lead by more than the calendar is expanded ahead,
    so a step plans in full the items its last plan's read may not have yielded
    (``_maybe_new_to_the_read``).

    ``before_changes``: the key from the parses the reads replaced (``SourceRead.changes``)."""
    contents = []
    for source_id in sorted(set(subscribed)):
        read = reads.get(source_id)
        if read is None or not read.whole or read.content_hash is None:
            return None
        changes = read.changes if before_changes else None
        contents.append(f"{source_id}={read.content_hash if changes is None else changes.previous_hash}")
    spread = int(hashlib.sha256(str(device["id"]).encode()).hexdigest()[:8], 16) % FULL_PLAN_SECONDS
    day = (now.whole_seconds + spread) // FULL_PLAN_SECONDS
    columns = (_key_text(device.get(c)) for c in PLANNED_FROM)
    return hashlib.sha256("\x1f".join((PLAN_VERSION, str(day), *columns, *contents)).encode()).hexdigest()


def _key_text(value: Any) -> str:
    return value.stored if isinstance(value, Instant) else repr(value)
