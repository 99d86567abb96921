"""A step (a plan from unchanged inputs, ``after`` set) leaves unresolved the items it cannot
make a row for; skipping them must never change what it makes. Checked against the same step
with every item resolved, for any mix of fixed, floating and all-day items, zones from UTC-11 to
UTC+14, lead, end-anchored and day rules, and quiet hours."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reminders_pipeline.domain.items import Item, ParsedFeed
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning import plan as plan_mod
from reminders_pipeline.planning.plan import plan_device
from reminders_pipeline.sources.reader import SourceRead

NOW = 1_789_000_000
DAY = 86400

items = st.builds(
    lambda n, start, length, kind: Item(
        f"e{n}",
        f"Event {n}",
        None,
        start - start % DAY if kind == "all_day" else start,
        (start - start % DAY + DAY) if kind == "all_day" else start + length,
        floating=kind != "fixed",
        all_day=kind == "all_day",
    ),
    st.integers(0, 10**6),
    st.integers(NOW - 3 * DAY, NOW + 4 * DAY),
    st.integers(1, 2 * DAY),
    st.sampled_from(("fixed", "fixed", "floating", "all_day")),
)
devices = st.fixed_dictionaries(
    {
        "id": st.just("dev-1"),
        "reminder_lead_seconds": st.sampled_from((0, 900, 3600, DAY)),
        "extra_rules": st.sampled_from(("", "lead:0", "lead:600@expiry", "lead:7200 lead:0!")),
        "all_day_rules": st.sampled_from(("day:0@09:00", "day:1@18:00", "day:0@23:30 day:2@07:00", "")),
        "tz_name": st.sampled_from((None, "UTC", "Pacific/Kiritimati", "Pacific/Pago_Pago", "America/Los_Angeles")),
        "last_tz_offset_seconds": st.sampled_from((None, -39600, 50400)),
        "quiet_hours": st.sampled_from((None, "22:00-07:00", "09:00-17:00")),
        "use_alarms": st.just(False),
    }
)


def _step(device: dict[str, Any], feed: ParsedFeed, now: int, after: int) -> dict[Any, Any]:
    read = SourceRead(1, "https://example.com/a.json", feed=feed, content_hash="h")
    plan = plan_device(device, [1], {1: read}, Instant.from_unix(now), DAY, after=Instant.from_unix(after))
    return plan.wanted


@settings(max_examples=1000, deadline=None)
@given(devices, st.lists(items, max_size=12, unique_by=lambda i: i.id), st.integers(-DAY, 0), st.integers(0, DAY))
def test_a_step_makes_the_same_rows_with_or_without_the_items_it_skips(device, feed_items, since, moved):
    feed = ParsedFeed(list(feed_items))
    now = NOW + moved
    after = now + DAY + since  # the last plan's reach: at most this one's
    skipped = _step(device, feed, now, after)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_mod, "_left_to_other_steps", lambda *args: False)
        resolved = _step(device, feed, now, after)
    assert skipped == resolved


alarmed_items = st.builds(
    lambda item, alarms: Item(
        item.id,
        item.title,
        None,
        item.starts_at,
        item.expires_at,
        floating=item.floating,
        all_day=item.all_day,
        alarms=tuple(alarms),
    ),
    st.builds(
        lambda n, start, kind: Item(f"e{n}", f"Event {n}", None, start, start + 1800, floating=kind != "fixed"),
        st.integers(0, 10**6),
        st.integers(NOW - DAY, NOW + 12 * DAY),
        st.sampled_from(("fixed", "fixed", "floating")),
    ),
    st.lists(
        st.sampled_from(("lead:0", "lead:900", "lead:600@expiry", f"lead:{2 * DAY}", f"lead:{9 * DAY}")), max_size=2
    ),
)


@settings(max_examples=1000, deadline=None)
@given(
    devices.map(lambda d: {**d, "use_alarms": True}),
    st.lists(alarmed_items, max_size=12, unique_by=lambda i: i.id),
    st.integers(0, DAY),
)
def test_a_step_of_a_device_using_alarms_makes_every_row_its_last_plan_could_not(device, feed_items, back):
    """The last plan (a full one, at ``now - back``) was made from a read that reached
    ``ALARM_REACH_SECONDS`` past its horizon and no further; this read reaches further. Whatever
    a full plan now wants, the last plan made or this step makes, however early its alarm."""
    now = NOW + back
    after = NOW + DAY  # the last plan's planned_until
    reach = after + plan_mod.ALARM_REACH_SECONDS
    seen = [i for i in feed_items if i.starts_at + (plan_mod.MAX_TZ_OFFSET_SECONDS if i.floating else 0) <= reach]

    def plan(feed: list[Item], at: int, since: int | None) -> set[Any]:
        read = SourceRead(1, "https://example.com/a.ics", feed=ParsedFeed(feed), content_hash="h")
        step = Instant.from_unix(since) if since is not None else None
        return set(plan_device(device, [1], {1: read}, Instant.from_unix(at), DAY, after=step).wanted)

    made = plan(seen, NOW, None) | plan(list(feed_items), now, after)
    assert plan(list(feed_items), now, None) <= made
