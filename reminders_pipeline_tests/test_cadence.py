"""Cron cadences (``reminders check``'s gaps) and the delayed copy the check schedule runs on."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from dagster._utils.schedules import cron_string_iterator

from reminders_pipeline.config.cadence import CronError, cron_cadence_seconds, crons_after, firing_minutes
from reminders_pipeline.config.settings import Settings, SettingsError

DAY = datetime(2026, 9, 10, tzinfo=UTC)


def dagster_ticks(crons: str | tuple[str, ...], start: datetime, end: datetime) -> list[datetime]:
    """Every tick in [start, end) as Dagster's scheduler computes it, merged over a list of crons."""
    ticks: set[datetime] = set()
    for cron in [crons] if isinstance(crons, str) else crons:
        for tick in cron_string_iterator(start.timestamp(), cron, "UTC"):
            if tick >= end:
                break
            ticks.add(tick.astimezone(UTC))
    return sorted(ticks)


@pytest.mark.parametrize(
    "cron, seconds",
    [
        ("0,15,30,45 * * * *", 900),  # the default build cron
        ("5,20,35,50 * * * *", 900),  # the default drain cron
        ("*/30 * * * *", 1800),
        ("* * * * *", 60),
        ("0 */2 * * *", 7200),
        ("*/30 1-3 * * *", 77400),  # 03:30 to 01:00 the next day
        ("5/15 * * * *", 900),
        ("0,50 * * * *", 3000),
        ("0 0 * * *", 86400),
    ],
)
def test_longest_gap_between_firings(cron, seconds):
    assert cron_cadence_seconds(cron) == seconds


@pytest.mark.parametrize("cron", ["5,20,35,50 * * * *", "*/30 1-3 * * *", "7,37 9-17 * * *", "0 */2 * * *"])
def test_firings_are_the_ones_dagsters_scheduler_makes(cron):
    expected = [t.hour * 60 + t.minute for t in dagster_ticks(cron, DAY, DAY + timedelta(days=1))]
    assert list(firing_minutes(cron)) == expected


@pytest.mark.parametrize(
    "cron, message",
    [
        ("5 * * *", "must have 5 fields"),
        ("0 0 1 * *", "day, month and weekday fields must be '*'"),
        ("61 * * * *", "61 * * * *"),
        ("*/0 * * * *", "*/0 * * * *"),
        ("5-3 * * * *", "5-3 * * * *"),
    ],
)
def test_bad_crons_are_refused_by_name(cron, message):
    with pytest.raises(CronError, match=message.replace("*", r"\*")):
        cron_cadence_seconds(cron)
    with pytest.raises(SettingsError, match="REMINDERS_DRAIN_CRON"):
        Settings.from_env({"REMINDERS_DRAIN_CRON": cron})


def test_the_default_drain_cron_gives_the_checks_their_usual_minutes():
    assert crons_after(Settings().drain_cron, 5) == ("10,25,40,55 * * * *",)


@pytest.mark.parametrize(
    "cron, delay",
    [
        ("5,20,35,50 * * * *", 5),
        ("7,37 * * * *", 5),
        ("58 */2 * * *", 5),  # crosses into the next hour: another hour field
        ("0,50 1 * * *", 15),  # two minutes, two different hours: a list of two crons
        ("55 23 * * *", 10),  # crosses midnight
        ("* * * * *", 5),
    ],
)
def test_each_drain_tick_is_followed_by_exactly_one_check_tick_delay_minutes_later(cron, delay):
    start, end = DAY, DAY + timedelta(days=2)
    drains = dagster_ticks(cron, start, end)
    checks = dagster_ticks(crons_after(cron, delay), start + timedelta(minutes=delay), end + timedelta(minutes=delay))
    assert checks == [t + timedelta(minutes=delay) for t in drains]
