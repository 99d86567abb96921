"""Alerts in the person's language and clock: a device's locale (``--locale de-DE``, the device
API's ``locale``, the widget's ``?locale=``) words the alert's times and relative phrases from CLDR
through Babel, in the locale's 12- or 24-hour clock unless the device names one; titles are the
calendar's own; a settled row keeps the body it sent. End to end on SQLite and PostgreSQL through
the CLI, the HTTP routes and the mock APNs."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from babel.dates import format_skeleton, format_timedelta

from reminders_pipeline.domain.notification import compose
from reminders_pipeline.domain.phrases import LocaleError, canonical_locale, speaker
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.routing import default_sender_factory
from reminders_pipeline.sending.drain import drain

from .support import TOKEN, rows

pytestmark = pytest.mark.usefixtures("fresh_mock")  # conftest: one mock APNs per module, reset per test

SENT = datetime(2026, 12, 10, 8, 45)


def _when(s, at: datetime) -> str:
    """The time phrase of ``at`` in an alert sent at ``SENT`` (no DST change between them)."""
    return s.when(at, SENT, at - SENT)


@pytest.mark.parametrize(
    "locale, same_day, tomorrow, later, days",
    [
        ("en-US", "Starts in 15 minutes · 9:00 AM", "Starts tomorrow at 9:00 AM", "Ends Mon, Dec 14 at 9:00 PM",
         ("Today", "Tomorrow", "In 3 days")),
        ("en-GB", "Starts in 15 minutes · 09:00", "Starts tomorrow at 09:00", "Ends Mon 14 Dec at 21:00",
         ("Today", "Tomorrow", "In 3 days")),
        ("de-DE", "Beginnt in 15 Minuten · 09:00", "Beginnt morgen um 09:00", "Endet Mo., 14. Dez. um 21:00",
         ("Heute", "Morgen", "In 3 Tagen")),
        ("fr-FR", "Commence dans 15 minutes · 09:00", "Commence demain à 09:00", "Se termine lun. 14 déc. à 21:00",
         ("Aujourd’hui", "Demain", "Dans 3 jours")),
        ("es-ES", "Empieza dentro de 15 minutos · 9:00", "Empieza mañana a las 9:00",
         "Termina lun, 14 dic a las 21:00", ("Hoy", "Mañana", "Dentro de 3 días")),
        ("ja-JP", "15 分後 · 9:00に開始", "明日 9:00に開始", "12月14日(月) 21:00に終了", ("今日", "明日", "3 日後")),
        # Another language: English words, the locale's own clock.
        ("pt-BR", "Starts in 15 minutes · 09:00", "Starts tomorrow at 09:00", "Ends Mon, Dec 14 at 21:00",
         ("Today", "Tomorrow", "In 3 days")),
    ],
)  # fmt: skip
def test_each_language_words_the_time_from_cldr(locale, same_day, tomorrow, later, days):
    s = speaker(canonical_locale(locale))
    assert s.words.starts.format(when=_when(s, datetime(2026, 12, 10, 9, 0))) == same_day
    assert s.words.starts.format(when=_when(s, datetime(2026, 12, 11, 9, 0))) == tomorrow
    assert s.words.ends.format(when=_when(s, datetime(2026, 12, 14, 21, 0))) == later
    assert (s.day(0), s.day(1), s.day(3)) == days


def test_the_device_clock_overrides_the_locales():
    assert speaker("de-DE", "12h").time(datetime(2026, 1, 1, 21, 5)) == format_skeleton(
        "hm", datetime(2026, 1, 1, 21, 5), locale="de_DE"
    )
    assert "PM" not in speaker("en-US", "24h").time(datetime(2026, 1, 1, 21, 5))
    assert speaker("fr-CA").clock == "24h"  # its pattern "HH 'h' mm" quotes an h: text, not a 12-hour field
    assert speaker("en-US", "24h").time(datetime(2026, 1, 1, 21, 5)) == "21:05"


def test_a_long_day_count_stays_in_days_and_a_lead_under_a_minute_is_now():
    assert speaker("de-DE").day(300) == "In 300 Tagen"
    assert speaker("fr-FR").when(SENT, SENT, timedelta(0)) == "maintenant · 08:45"


@pytest.mark.parametrize("text", ["xx-YY", "", "root", "und", "../etc", "en-" + "a" * 40, "de DE"])
def test_an_unknown_locale_is_refused(text):
    with pytest.raises(LocaleError):
        canonical_locale(text)


def test_a_locale_tag_is_stored_canonical():
    assert [canonical_locale(t) for t in ("de_DE", "de-de", "ja", "zh-Hant-TW")] == [
        "de-DE",
        "de-DE",
        "ja",
        "zh-Hant-TW",
    ]


def _row(**extra):
    starts = Instant.from_unix(1_781_000_000)
    base = {
        "id": 1, "device_id": "d", "item_id": "1:x", "rule": "lead:900", "title": "Zahnarzt", "body": None,
        "event_at": starts, "expires_at": starts + 1800, "send_after": starts - 900, "target": TOKEN,
        "tz_name": "Europe/Berlin", "last_tz_offset_seconds": None,
    }  # fmt: skip
    return {**base, **extra}


def _alert(row, late: float = 0) -> dict:
    """The alert of ``row`` sent ``late`` seconds after its ``send_after``."""
    return compose(row, now=row["send_after"] + late).payload["aps"]["alert"]


def test_a_device_without_a_locale_reads_as_before_and_titles_and_bodies_are_never_translated():
    assert _alert(_row())["body"].startswith("Starts at ")
    german = _alert(_row(locale="de-DE"))
    assert german["title"] == "Zahnarzt" and german["body"].startswith("Beginnt in 15 Minuten · ")
    assert _alert(_row(locale="de-DE", body="Raum 4"))["body"] == "Raum 4"


def test_a_device_without_a_known_zone_reads_utc_marked():
    body = _alert(_row(locale="de-DE", tz_name=None))["body"]
    assert body.endswith(" UTC") and body.startswith("Beginnt ")
    started = _row(locale="ja-JP", tz_name=None, rule="lead:0", send_after=_row()["event_at"])
    assert _alert(started, late=300)["body"] == "5 分前 · 10:13 UTCに開始しました"


# ---------------------------------------------------------------- end to end


def expected_body(
    starts: int, sent: float, tz: str, babel_locale: str, pattern: str, words: tuple[str, str, str]
) -> str:
    """The oracle, from Babel and zoneinfo directly: ``words`` (how the language says "starts
    {when}", "tomorrow" and "{day} at {time}") around "in 10 minutes · <time>" (the start seen from
    ``sent``, when the alert went) the same local day as the send, or "tomorrow at <time>" across
    local midnight."""
    local = datetime.fromtimestamp(starts, ZoneInfo(tz)).replace(tzinfo=None)
    sent_local = datetime.fromtimestamp(sent, ZoneInfo(tz)).replace(tzinfo=None)
    time = format_skeleton(pattern, local, locale=babel_locale)
    starts_words, tomorrow, at = words
    if local.date() == sent_local.date():
        ahead = timedelta(seconds=starts - sent)
        relative = format_timedelta(ahead, add_direction=True, threshold=2, locale=babel_locale)
        return starts_words.format(when=f"{relative} · {time}")
    return starts_words.format(when=at.format(day=tomorrow, time=time))


def feed_of(starts: int, title: str = "Zahnarzt") -> list[dict]:
    return [{"id": "dentist", "title": title, "startsAt": starts, "expiresAt": starts + 1800}]


def test_the_cli_locale_words_the_alert_and_a_later_change_never_rewrites_a_sent_one(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 600
    url = feeds.items("/a.json", feed_of(starts))
    put = json.loads(
        cli(
            "device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url,
            "--tz", "Europe/Berlin", "--locale", "de_DE",
        ).output
    )  # fmt: skip
    assert (put["locale"], put["clock"]) == ("de-DE", None)
    cli("build", "--all")
    assert json.loads(cli("drain").output)["outcomes"] == {"sent": 1}
    (request,) = mock.wait_for_requests(1)
    alert = request.payload["aps"]["alert"]
    assert alert["title"] == "Zahnarzt"
    assert alert["body"] == expected_body(
        starts, request.received_at, "Europe/Berlin", "de_DE", "Hm", ("Beginnt {when}", "morgen", "{day} um {time}")
    )
    assert request.payload["aps"]["interruption-level"] == "time-sensitive"

    cli("device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url, "--locale", "fr-FR")
    (settled,) = rows(db, device_id="phone")
    assert json.loads(settled["payload"])["payload"]["aps"]["alert"]["body"] == alert["body"]  # still German
    listed = json.loads(cli("queue", "list").output)
    assert json.loads(listed[0]["payload"])["payload"]["aps"]["alert"]["body"] == alert["body"]


def test_a_12_hour_clock_on_a_24_hour_locale(db, cli, feeds, mock):
    starts = Instant.now().whole_seconds + 600
    url = feeds.items("/a.json", feed_of(starts))
    cli(
        "device", "put", "phone", "--apns-token", TOKEN, "--lead", "1800", "--source", url,
        "--tz", "America/New_York", "--locale", "es-ES", "--clock", "12h",
    )  # fmt: skip
    cli("build", "--all")
    cli("drain")
    (request,) = mock.wait_for_requests(1)
    body = request.payload["aps"]["alert"]["body"]
    assert body == expected_body(
        starts,
        request.received_at,
        "America/New_York",
        "es_ES",
        "hm",
        ("Empieza {when}", "mañana", "{day} a las {time}"),
    )


@pytest.mark.parametrize("args, field", [(["--locale", "xx-YY"], "locale"), (["--clock", "13h"], "clock")])
def test_a_bad_locale_or_clock_exits_2_and_stores_nothing(cli, args, field):
    out = cli("device", "put", "p", "--apns-token", TOKEN, *args, code=2).output
    assert field in out
    assert json.loads(cli("device", "list").output) == []


def test_the_widget_reports_its_locale_and_the_next_alert_follows_it(db, served, feeds, mock, live):
    starts = Instant.now().whole_seconds + 600
    url = feeds.items("/a.json", feed_of(starts, "歯医者"))
    r = served.put_device("phone", source_urls=[url], reminder_lead_seconds=1800, tz="Asia/Tokyo", locale="en-US")
    assert r.status_code == 200 and r.json()["locale"] == "en-US", r.text
    assert served.api.get("/v1/devices/phone/feed?locale=ja_JP").status_code == 200
    assert served.api.get("/v1/devices/phone").json()["locale"] == "ja-JP"
    for bad in ("a" * 100, "de DE", "de-DE&locale=fr"):
        r = served.api.get("/v1/devices/phone/feed", params={"locale": bad})
        assert r.status_code == 422 and r.json()["field"] == "locale", r.text
    assert served.api.get("/v1/devices/phone/feed?locale=de-DE&locale=fr-FR").status_code == 422
    assert served.api.get("/v1/devices/phone/feed?locale=xx-YY").status_code == 200  # unknown to CLDR: ignored
    assert served.api.get("/v1/devices/phone").json()["locale"] == "ja-JP"
    r = served.put_device("phone", source_urls=[url], reminder_lead_seconds=1800, clock="25h")
    assert r.status_code == 422 and r.json()["field"] == "clock", r.text
    r = served.put_device("phone", source_urls=[url], reminder_lead_seconds=1800)  # omitted: the stored locale stays
    assert r.json()["locale"] == "ja-JP"

    settings = live.with_(send_timeout_seconds=5, send_retry_base_seconds=0, **mock.apns_settings())
    build(db, settings)
    drain(db, settings, default_sender_factory(settings))
    (request,) = mock.wait_for_requests(1)
    alert = request.payload["aps"]["alert"]
    assert alert["title"] == "歯医者"
    assert alert["body"] == expected_body(
        starts, request.received_at, "Asia/Tokyo", "ja_JP", "Hm", ("{when}に開始", "明日", "{day} {time}")
    )


# ---------------------------------------------------------------- worded at the send


def _sent_bodies(db, live, feeds, locale: str | None) -> list[str]:
    """A ``lead:900`` reminder sent 5 minutes before its 11:00 (Berlin) start, 10 minutes late,
    and a ``lead:0`` one sent 5 minutes after it: the alert bodies in the order sent."""
    from reminders_pipeline.devices.registration import DeviceSpec, put_device
    from reminders_pipeline.providers.base import RecordingSender

    from .support import NOW, at, item

    url = feeds.items("/a.json", [item("e", 3600, title="Zahnarzt")])
    spec = DeviceSpec("dev-1", TOKEN, 900, ("lead:0",), (url,), tz_name="Europe/Berlin", locale=locale)
    put_device(db, live, spec, now=NOW)
    build(db, live, now=NOW)
    sender = RecordingSender()
    drain(db, live, sender.factory(), now=at(3600 - 300))
    drain(db, live, sender.factory(), now=at(3600 + 300))
    return [n.payload["aps"]["alert"]["body"] for n in sender.sent]


@pytest.mark.parametrize(
    "locale, bodies",
    [
        ("en-US", ["Starts in 5 minutes · 11:00 AM", "Started 5 minutes ago · 11:00 AM"]),
        ("de-DE", ["Beginnt in 5 Minuten · 11:00", "Begann vor 5 Minuten · 11:00"]),
        ("fr-FR", ["Commence dans 5 minutes · 11:00", "A commencé il y a 5 minutes · 11:00"]),
        (None, ["Starts at 11:00", "Started at 11:00"]),
    ],
)
def test_the_phrase_is_worded_when_the_alert_is_sent_not_when_it_was_due(db, live, feeds, locale, bodies):
    """A late send says how far the start is at the send ("in 5 minutes", not the lead's 15), and
    one after the start says it started, never "now"."""
    assert _sent_bodies(db, live, feeds, locale) == bodies


@pytest.mark.parametrize(
    "locale, late, body",
    [
        ("en-US", 30, "Starts now · 12:13 PM"),  # within a minute of the start: now, either side
        ("en-US", -30, "Starts now · 12:13 PM"),
        ("en-US", 59 * 60, "Started 59 minutes ago · 12:13 PM"),
        ("en-US", 3 * 3600, "Started at 12:13 PM"),  # long ago: its clock time
        ("en-US", 14 * 3600, "Started Tue, Jun 9 at 12:13 PM"),  # an earlier local day
        ("de-DE", 3 * 3600, "Begann um 12:13"),
        ("fr-FR", 3 * 3600, "A commencé à 12:13"),
        ("es-ES", 300, "Empezó hace 5 minutos · 12:13"),
        ("ja-JP", 3 * 3600, "12:13に開始しました"),
    ],
)
def test_a_snooze_sent_after_the_start_says_when_it_started(locale, late, body):
    """A snooze goes up to the item's end, long after its start: its words are the send's."""
    starts = _row()["event_at"]
    row = _row(locale=locale, rule="snooze:1", send_after=starts, expires_at=starts + 86400)
    assert _alert(row, late=late)["body"] == body


@pytest.mark.parametrize(
    "locale, late, body",
    [
        ("en-US", 300, "Ended 5 minutes ago · 12:43 PM"),
        ("de-DE", 300, "Endete vor 5 Minuten · 12:43"),
        (None, 300, "Ended at 12:43"),
    ],
)
def test_an_end_reminder_sent_after_the_end_says_it_ended(locale, late, body):
    ends = _row()["expires_at"]
    row = _row(locale=locale, rule="lead:0@expiry", send_after=ends)
    assert _alert(row, late=late)["body"] == body


def test_an_all_day_reminder_names_the_day_as_seen_when_it_is_sent():
    """``day:1@23:50`` held past midnight (quiet hours, or a late drain) goes on the day itself."""
    day = Instant.from_stored("2026-06-09T22:00:00.000Z")  # 10 June, midnight in Berlin
    row = _row(rule="day:1@23:50", event_at=day, expires_at=day + 86400, send_after=day - 600)
    assert [_alert(row)["body"], _alert(row, late=1200)["body"]] == ["Tomorrow", "Today"]
    german = {**row, "locale": "de-DE"}
    assert [_alert(german)["body"], _alert(german, late=1200)["body"]] == ["Morgen", "Heute"]
