"""An alert's text in the person's language: its clock time, date and relative phrases ("in 15
minutes", "morgen um 9:00") from CLDR through Babel, in the locale's 12- or 24-hour clock unless
the device names one.

Babel's CLDR data has no words for "starts", "started", "ends", "today" and "tomorrow" and no
"{day} at {time}" pattern, so those few come from ``WORDS``, written for each language it lists. A
locale of another language is shown in English with its own clock (``pt-BR``: 24 hours). Titles
are never translated: they are the calendar's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Literal

import babel
from babel.dates import format_skeleton, format_timedelta

from reminders_pipeline.domain.rules import MAX_DAYS

Clock = Literal["12h", "24h"]
CLOCKS: tuple[Clock, ...] = ("12h", "24h")
MAX_LOCALE_LENGTH = 35  # BCP 47 tags in practice; longer ones are refused before Babel parses them
LOCALE_SHAPE = r"[A-Za-z]{2,8}(?:[-_][A-Za-z0-9]{1,8})*"  # a BCP 47 tag's shape, whether CLDR knows it or not
FALLBACK = "en"
NOW_WITHIN = timedelta(minutes=1)  # a start this close to the send, either side, is "now"
SAID_AGO_WITHIN = timedelta(hours=1)  # a start passed longer ago is named by its clock time


@dataclass(frozen=True)
class Words:
    starts: str  # "{when}" is the time phrase
    ends: str
    started: str  # once the start has passed: "{when}" is "5 minutes ago · 10:00" or "at 10:00"
    ended: str
    today: str
    tomorrow: str
    now: str
    at: str  # "{day}" and "{time}"
    at_time: str  # "{time}": a clock time of the same day, after "started"
    leave: str  # "{title}": time to leave
    agenda: tuple[str, str]  # the agenda's title for one event and for another count ("{count}")


WORDS = {
    "en": Words(
        "Starts {when}",
        "Ends {when}",
        "Started {when}",
        "Ended {when}",
        "today",
        "tomorrow",
        "now",
        "{day} at {time}",
        "at {time}",
        "Leave now for {title}",
        ("Today: {count} event", "Today: {count} events"),
    ),
    "de": Words(
        "Beginnt {when}",
        "Endet {when}",
        "Begann {when}",
        "Endete {when}",
        "heute",
        "morgen",
        "jetzt",
        "{day} um {time}",
        "um {time}",
        "Jetzt aufbrechen zu {title}",
        ("Heute: {count} Termin", "Heute: {count} Termine"),
    ),
    "fr": Words(
        "Commence {when}",
        "Se termine {when}",
        "A commencé {when}",
        "S’est terminé {when}",
        "aujourd’hui",
        "demain",
        "maintenant",
        "{day} à {time}",
        "à {time}",
        "Partez maintenant pour {title}",
        ("Aujourd’hui : {count} événement", "Aujourd’hui : {count} événements"),
    ),
    "es": Words(
        "Empieza {when}",
        "Termina {when}",
        "Empezó {when}",
        "Terminó {when}",
        "hoy",
        "mañana",
        "ahora",
        "{day} a las {time}",
        "a las {time}",
        "Sal ya hacia {title}",
        ("Hoy: {count} evento", "Hoy: {count} eventos"),
    ),
    "ja": Words(
        "{when}に開始",
        "{when}に終了",
        "{when}に開始しました",
        "{when}に終了しました",
        "今日",
        "明日",
        "今すぐ",
        "{day} {time}",
        "{time}",
        "{title}に出発する時間です",
        ("今日の予定: {count}件", "今日の予定: {count}件"),
    ),
}


class LocaleError(ValueError):
    """A locale Babel does not know, or a clock other than ``12h``/``24h``."""


def canonical_locale(text: str) -> str:
    """A BCP 47 tag as stored (``de-DE``), or ``LocaleError`` for one CLDR does not know."""
    if not isinstance(text, str) or len(text) > MAX_LOCALE_LENGTH or not re.fullmatch(LOCALE_SHAPE, text):
        raise LocaleError(f"a locale is a BCP 47 tag like 'de-DE' of at most {MAX_LOCALE_LENGTH} characters")
    unknown = LocaleError(f"unknown locale {text!r}: expected a tag like 'de-DE'")
    tag = text.strip().replace("_", "-")
    if tag.split("-")[0].lower() in ("root", "und"):
        raise unknown
    try:
        parsed = babel.Locale.parse(tag, sep="-")
    except (ValueError, TypeError, babel.UnknownLocaleError):
        raise unknown from None
    return str(parsed).replace("_", "-")


def valid_clock(text: str | None) -> Clock | None:
    if text is None:
        return None
    for clock in CLOCKS:
        if text == clock:
            return clock
    raise LocaleError(f"clock must be '12h' or '24h', got {str(text)[:16]!r}")


@dataclass(frozen=True)
class Speaker:
    """How one device's alerts are worded: a Babel locale, its words, and its clock."""

    locale: babel.Locale
    words: Words
    clock: Clock

    def time(self, wall: datetime) -> str:
        return format_skeleton("hm" if self.clock == "12h" else "Hm", wall, locale=self.locale)

    def anchored(self, at: datetime, sent: datetime, ahead: timedelta, words: tuple[str, str], marker: str = "") -> str:
        """What is said of ``at`` in an alert sent at ``sent`` (both local wall times; ``ahead``,
        how far ``at`` is from the send, comes from instants, so a DST change between them counts
        as it passes): ``words`` are said of it coming ("Starts {when}") until a minute after it,
        and once passed ("Started {when}"). ``marker`` follows the time phrase (" UTC")."""
        coming, passed = words
        if ahead > -NOW_WITHIN:
            return coming.format(when=self.when(at, sent, ahead) + marker)
        return passed.format(when=self.since(at, sent, -ahead) + marker)

    def when(self, at: datetime, sent: datetime, ahead: timedelta) -> str:
        """The time phrase of ``at``, ``ahead`` of the send at ``sent``: "in 15 minutes · 2:30 PM"
        the same day, "now · 2:30 PM" within a minute either side, "tomorrow at 9:00 AM" the next
        day, "Thu, Dec 10 at 9:00 AM" later."""
        days = (at.date() - sent.date()).days
        time = self.time(at)
        if days <= 0:
            relative = (
                self.words.now
                if ahead < NOW_WITHIN
                else format_timedelta(ahead, add_direction=True, threshold=2, locale=self.locale)
            )
            return f"{relative} · {time}"
        day = self.words.tomorrow if days == 1 else format_skeleton("MMMEd", at, locale=self.locale)
        return self.words.at.format(day=day, time=time)

    def since(self, at: datetime, sent: datetime, ago: timedelta) -> str:
        """The time phrase of ``at``, ``ago`` before the send at ``sent``: "5 minutes ago · 2:30 PM"
        within the hour, then its clock time: "at 2:30 PM" the same day, "Thu, Dec 10 at 2:30 PM"
        an earlier one."""
        time = self.time(at)
        if ago < SAID_AGO_WITHIN:
            return f"{format_timedelta(-ago, add_direction=True, threshold=2, locale=self.locale)} · {time}"
        if at.date() == sent.date():
            return self.words.at_time.format(time=time)
        return self.words.at.format(day=format_skeleton("MMMEd", at, locale=self.locale), time=time)

    def agenda(self, count: int) -> str:
        """The agenda's title: how many events the day holds, in the language's plural form."""
        one, other = self.words.agenda
        return (one if self.locale.plural_form(count) == "one" else other).format(count=count)

    def day(self, days: int) -> str:
        """An all-day reminder's day: "Today", "Tomorrow", "In 3 days"."""
        if days == 0:
            text = self.words.today
        elif days == 1:
            text = self.words.tomorrow
        else:
            text = format_timedelta(
                timedelta(days=days),
                granularity="day",
                threshold=MAX_DAYS + 1,  # in days, never months
                add_direction=True,
                locale=self.locale,
            )
        return text[:1].upper() + text[1:]


@lru_cache(maxsize=256)
def speaker(locale: str, clock: Clock | None = None) -> Speaker:
    """The ``Speaker`` of a stored locale (cached: a drain words many alerts for few locales).
    A language ``WORDS`` lacks speaks English, keeping its own clock."""
    asked = babel.Locale.parse(locale, sep="-")
    own = asked if asked.language in WORDS else babel.Locale.parse(FALLBACK)
    pattern = re.sub(r"'[^']*'", "", asked.time_formats["short"].pattern)  # quoted text is no field
    hours = clock or ("12h" if "h" in pattern or "K" in pattern else "24h")
    return Speaker(own, WORDS[own.language], hours)
