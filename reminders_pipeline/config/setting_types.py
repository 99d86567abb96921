"""How a setting's text in the environment becomes its value: numbers (blank means the default),
flags, network lists, cron cadences, the VAPID contact, database URLs. Each refusal is a
``PydanticCustomError`` whose text follows the variable's name in the one-line message
(``settings.SettingsError``), so a typo stops the process at start with its name."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator
from pydantic_core import PydanticCustomError, PydanticUseDefault
from pydantic_settings import NoDecode

from reminders_pipeline.config.cadence import CronError, cron_cadence_seconds


def normalize_database_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def refused(text: str) -> PydanticCustomError:
    """An error whose text follows the variable's name in the one-line message."""
    return PydanticCustomError("setting", "{text}", {"text": text})


class Number:
    """How a number is written in the environment: Python's ``int`` or ``float`` of the text.

    Blank means the default, so an operator can empty a variable instead of unsetting it.
    """

    def __init__(self, kind: Callable[[str], float], what: str) -> None:
        self.kind, self.what = kind, what

    def __call__(self, value: object) -> object:
        if not isinstance(value, str):
            return value
        if not value.strip():
            raise PydanticUseDefault()
        try:
            return self.kind(value)
        except ValueError:
            raise refused(f" must be {self.what}, got {value!r}") from None


WHOLE = Number(int, "a whole number")


SECONDS = Number(float, "a number of seconds")


def _exactly_true(value: object) -> object:
    """Exactly "true" switches it on; any other text leaves it off."""
    return value == "true" if isinstance(value, str) else value


def _flag(value: object) -> object:
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if not text:
        raise PydanticUseDefault()
    if text not in ("true", "false"):
        raise refused(f" must be 'true' or 'false', got {value!r}")
    return text == "true"


def _networks(value: object) -> object:
    """A comma-separated CIDR list, each checked here so a typo stops the process at start."""
    texts = value.split(",") if isinstance(value, str) else value
    if not isinstance(texts, (list, tuple)):
        return value
    networks = tuple(t.strip() for t in texts if isinstance(t, str) and t.strip())
    for text in networks:
        try:
            ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise refused(f": not a network in CIDR notation: {text!r}") from None
    return networks


def _contact(subject: str) -> str:
    """The VAPID ``sub`` (RFC 8292 §2.1): a ``mailto:`` address or an https URL naming a host (a
    path is allowed). Anything else a push service may refuse for every request: refused here, at
    start, instead."""
    if subject.startswith("mailto:"):
        local, at, domain = subject.removeprefix("mailto:").partition("@")
        if local and at and domain and not any(c.isspace() for c in subject):
            return subject
    elif subject.startswith("https://") and not any(c.isspace() for c in subject):
        try:
            parts = urlsplit(subject)
            parts.port  # noqa: B018 - raises ValueError on a malformed port
        except ValueError:
            parts = None
        if parts is not None and parts.hostname and not parts.username and not parts.password:
            return subject
    raise refused(": a mailto: address (mailto:ops@example.org) or an https URL with a host, got " + repr(subject))


def _cadence(cron: str) -> str:
    try:
        cron_cadence_seconds(cron)
    except CronError as exc:
        raise refused(f": {exc}") from None
    return cron


Whole = Annotated[int, BeforeValidator(WHOLE)]


WholeSeconds = Annotated[float, BeforeValidator(WHOLE)]


Seconds = Annotated[float, BeforeValidator(SECONDS)]


ExactlyTrue = Annotated[bool, BeforeValidator(_exactly_true)]


Flag = Annotated[bool, BeforeValidator(_flag)]


Networks = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_networks)]


Cron = Annotated[str, AfterValidator(_cadence)]


Contact = Annotated[str, AfterValidator(_contact)]


DatabaseUrl = Annotated[str, AfterValidator(normalize_database_url)]
