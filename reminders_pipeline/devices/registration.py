"""Device registration: validation, the stable chunk a device belongs to, and storing it; a new
device is issued its own credential (``credentials.py``)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.devices.credentials import new_credential
from reminders_pipeline.domain.calendar_settings import CalendarSettings, SubscriptionError, checked
from reminders_pipeline.domain.items import address_of
from reminders_pipeline.domain.phrases import LocaleError, canonical_locale, valid_clock
from reminders_pipeline.domain.rules import DEFAULT_ALL_DAY_RULES, MAX_LEAD_SECONDS, RuleError, is_agenda, parse_rule
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Provider
from reminders_pipeline.domain.zones import ZoneError, parse_quiet_hours, valid_zone_name
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.push_subscription import (
    PushSubscriptionError,
    Subscription,
    check_reachable,
    parse_subscription,
)
from reminders_pipeline.sources.egress import parse_networks
from reminders_pipeline.sources.urls import shown_url

APNS_TOKEN_PATTERN = re.compile(r"[0-9a-fA-F]{64,200}")
FCM_TOKEN_PATTERN = re.compile(r"[A-Za-z0-9_:-]{32,4096}")
MAX_DEVICE_ID = 128
SCHEME_PATTERN = re.compile(r"[a-z][a-z0-9+.-]{0,19}")  # a scheme short and plain enough to name
DEVICE_ID_PATTERN = re.compile(rf"[A-Za-z0-9._:@-]{{1,{MAX_DEVICE_ID}}}")
DEVICE_ID_SHAPE = f"1-{MAX_DEVICE_ID} characters of letters, digits and . _ : @ -"
MAX_SOURCES = 100
MAX_URL_LENGTH = 2048
MAX_EXTRA_RULES = 32  # per rule list (extra_rules, all_day_rules); enforced by the HTTP contract
MAX_ATTENDEES = 16
ATTENDEE_PATTERN = re.compile(r"[^\s@]{1,64}@[^\s@]{1,189}")  # the local part and domain: 254 at most


class DeviceError(ValueError):
    """Invalid registration; ``field`` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class DeviceSpec:
    id: str
    apns_token: str
    reminder_lead_seconds: int = 3600
    extra_rules: Sequence[str] = field(default_factory=tuple)
    source_urls: Sequence[str] = field(default_factory=tuple)
    tz_name: str | None = None  # IANA zone; None keeps the stored one (the widget reports it too)
    all_day_rules: Sequence[str] = DEFAULT_ALL_DAY_RULES
    quiet_hours: str | None = None  # "22:00-07:00" in the device's zone
    alarms: bool = False  # a calendar event's own alarms (VALARM) replace the device's rules for it
    attendees: Sequence[str] = field(default_factory=tuple)  # its person's addresses: what they declined alerts nothing
    locale: str | None = None  # BCP 47 (de-DE): the alert's language; None keeps the stored one
    clock: str | None = None  # "12h" or "24h"; None: the locale's own
    calendars: Mapping[str, CalendarSettings] = field(default_factory=dict)  # by source URL, each among source_urls
    # The delivery target instead of ``apns_token`` (then ""): exactly one of the three. A Web Push
    # subscription is the browser's ``PushSubscription`` JSON; an FCM registration token, text.
    webpush: Mapping[str, Any] | None = None
    fcm_token: str | None = None
    provider: str = Provider.APNS  # set by ``validate`` from the target given; ``apns_token`` then holds it

    @classmethod
    def requested(
        cls,
        settings: Settings,
        device_id: str,
        *,
        apns_token: str | None = None,
        webpush: Mapping[str, Any] | None = None,
        fcm_token: str | None = None,
        lead: int | None = None,
        rules: Sequence[str] = (),
        sources: Sequence[str] = (),
        tz: str | None = None,
        all_day_rules: Sequence[str] | None = None,
        quiet_hours: str | None = None,
        alarms: bool = False,
        attendees: Sequence[str] = (),
        locale: str | None = None,
        clock: str | None = None,
        calendars: Mapping[str, CalendarSettings] | None = None,
    ) -> DeviceSpec:
        """A registration as the CLI, HTTP and the demo take it, what was left out defaulted in one
        place: the deployment's lead (``REMINDERS_DEFAULT_LEAD_SECONDS``), the all-day rules, no
        target but the one given. ``validate`` still has the last word on every value."""
        return cls(
            device_id,
            apns_token or "",
            settings.default_lead_seconds if lead is None else lead,
            tuple(rules),
            tuple(sources),
            tz,
            DEFAULT_ALL_DAY_RULES if all_day_rules is None else tuple(all_day_rules),
            quiet_hours,
            alarms,
            tuple(attendees),
            locale,
            clock,
            dict(calendars or {}),
            webpush=webpush,
            fcm_token=fcm_token,
        )


@dataclass(frozen=True)
class Registration:
    """A stored device, and its credential when this registration issued one (shown this once)."""

    record: ledger.DeviceRecord
    credential: str | None = None

    def as_dict(self) -> dict[str, object]:
        d = self.record.as_dict()
        if self.credential is not None:
            d["credential"] = self.credential
        return d


def chunk_of(device_id: str, chunk_count: int) -> int:
    """Stable across processes and releases (unlike ``hash()``), uniform enough for partitions."""
    digest = hashlib.blake2b(device_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % chunk_count


def _source_url_problem(url: object) -> str | None:
    """Why ``url`` cannot be a source, or None. The URL itself is never echoed (it may hold a
    secret); a refused scheme is named, as it is what the person typed wrong."""
    if not isinstance(url, str):
        return f"not a URL: {type(url).__name__}"
    if len(url) > MAX_URL_LENGTH:
        return f"longer than {MAX_URL_LENGTH} characters"
    if any(ord(c) < 33 for c in url):
        return "holds a space or a control character; a source is an http, https or webcal URL"
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return f"not an http(s) or webcal URL: {shown_url(url)}"
    if not parsed.scheme:
        return "no scheme; a source is an http, https or webcal URL"
    if parsed.scheme not in ("http", "https", "webcal"):
        scheme = parsed.scheme if SCHEME_PATTERN.fullmatch(parsed.scheme) else "?"
        return f"the {scheme}: scheme is refused; a source is an http, https or webcal URL"
    if not parsed.hostname:
        return f"a {parsed.scheme} URL with no host: {shown_url(url)}"
    return None


def validate(spec: DeviceSpec) -> DeviceSpec:
    if not isinstance(spec.id, str) or not DEVICE_ID_PATTERN.fullmatch(spec.id):
        raise DeviceError("id", DEVICE_ID_SHAPE)
    provider, token = _target(spec)
    lead = spec.reminder_lead_seconds
    if isinstance(lead, bool) or not isinstance(lead, int) or not 0 <= lead <= MAX_LEAD_SECONDS:
        raise DeviceError("reminder_lead_seconds", f"a whole number of seconds from 0 to {MAX_LEAD_SECONDS}")
    rules = _rules(spec.extra_rules, "rules", all_day=False)
    all_day_rules = _rules(spec.all_day_rules, "all_day_rules", all_day=True)
    try:
        tz_name = None if spec.tz_name is None else valid_zone_name(spec.tz_name)
    except ZoneError as exc:
        raise DeviceError("tz", str(exc)) from None
    try:
        quiet = parse_quiet_hours(spec.quiet_hours)
    except ZoneError as exc:
        raise DeviceError("quiet_hours", str(exc)) from None
    if len(spec.source_urls) > MAX_SOURCES:
        raise DeviceError("sources", f"at most {MAX_SOURCES} sources")
    for url in spec.source_urls:
        problem = _source_url_problem(url)
        if problem:
            raise DeviceError("sources", problem)
    return DeviceSpec(
        spec.id,
        token,
        lead,
        tuple(dict.fromkeys(rules)),
        tuple(dict.fromkeys(spec.source_urls)),
        tz_name,
        tuple(dict.fromkeys(all_day_rules)),
        quiet.text if quiet else None,
        bool(spec.alarms),
        _attendees(spec.attendees),
        *_language(spec.locale, spec.clock),
        _calendars(spec.calendars, spec.source_urls),
        provider=provider,
    )


def _check_configured(provider: str, settings: Settings) -> None:
    """A device of a provider this deployment cannot send to is refused now, not failed at each send."""
    if provider == Provider.WEBPUSH and not settings.vapid_private_key_file:
        raise DeviceError("webpush_subscription", "this deployment sends no Web Push (no VAPID key)")
    if provider == Provider.FCM and not settings.fcm_credentials_file:
        raise DeviceError("fcm_token", "this deployment sends no FCM (no service-account key)")


def _target(spec: DeviceSpec) -> tuple[str, str]:
    """The device's one delivery target as (provider, what ``devices.target`` keeps)."""
    given = [name for name, value in (("apns_token", spec.apns_token), ("webpush", spec.webpush),
                                       ("fcm_token", spec.fcm_token)) if value]  # fmt: skip
    if not given:
        raise DeviceError("apns_token", "hex string of 64 to 200 characters (or webpush_subscription, or fcm_token)")
    if len(given) > 1:
        raise DeviceError("target", f"exactly one of apns_token, webpush_subscription or fcm_token, not {given}")
    if spec.webpush:
        try:
            return Provider.WEBPUSH, parse_subscription(spec.webpush).canonical
        except PushSubscriptionError as exc:
            raise DeviceError("webpush_subscription", str(exc)) from None
    if spec.fcm_token:
        if not isinstance(spec.fcm_token, str) or not FCM_TOKEN_PATTERN.fullmatch(spec.fcm_token):
            raise DeviceError("fcm_token", "an FCM registration token: 32 to 4096 letters, digits, - _ :")
        return Provider.FCM, spec.fcm_token
    if not isinstance(spec.apns_token, str) or not APNS_TOKEN_PATTERN.fullmatch(spec.apns_token):
        raise DeviceError("apns_token", "hex string of 64 to 200 characters")
    return Provider.APNS, spec.apns_token.lower()


def _calendars(calendars: Mapping[str, CalendarSettings], urls: Sequence[str]) -> dict[str, CalendarSettings]:
    """Each calendar's settings checked again (``calendar_settings.checked``), for a subscribed URL only."""
    out = {}
    for url, given in calendars.items():
        if url not in urls:
            shown = shown_url(url) if isinstance(url, str) else type(url).__name__
            raise DeviceError("calendars", f"{shown} is not among the device's sources")
        try:
            settings = checked(
                given.rules, given.interruption_level, given.breakthrough, given.muted, given.travel_seconds
            )
        except SubscriptionError as exc:
            raise DeviceError("calendars", f"{shown_url(url)}: {exc}") from None
        if not settings.default:
            out[url] = settings
    return out


def _language(locale: str | None, clock: str | None) -> tuple[str | None, str | None]:
    """The stored locale tag (``de-DE``) and clock, each checked on its own field."""
    try:
        tag = None if locale is None else canonical_locale(locale)
    except LocaleError as exc:
        raise DeviceError("locale", str(exc)) from None
    try:
        return tag, valid_clock(clock)
    except LocaleError as exc:
        raise DeviceError("clock", str(exc)) from None


def _attendees(texts: Sequence[str]) -> tuple[str, ...]:
    """Addresses as a calendar's ATTENDEE is compared (``items.address_of``), each once."""
    if isinstance(texts, str) or len(texts) > MAX_ATTENDEES:
        raise DeviceError("attendees", f"a list of at most {MAX_ATTENDEES} addresses")
    out = []
    for text in texts:
        address = address_of(text) if isinstance(text, str) else ""
        if not ATTENDEE_PATTERN.fullmatch(address):
            shown = text[:64] if isinstance(text, str) else type(text).__name__
            raise DeviceError("attendees", f"not an email address: {shown!r}")
        out.append(address)
    return tuple(dict.fromkeys(out))


def _rules(texts: Sequence[str], field: str, *, all_day: bool) -> list[str]:
    """Canonical rule names; lead rules and day rules each in their own list (``field``)."""
    out = []
    for text in texts:
        try:
            rule = parse_rule(text)
        except RuleError as exc:
            raise DeviceError(field, str(exc)) from None
        if rule.derived:
            raise DeviceError(field, f"{text!r}: {rule.derived}")
        if rule.agenda and rule.name != text.strip():
            raise DeviceError(field, f"{text!r}: an agenda names its time, e.g. 'agenda@07:00'")
        if rule.all_day != all_day:
            want = "day:N@HH:MM rules" if all_day else "lead rules (day:N@HH:MM rules go in all_day_rules)"
            raise DeviceError(field, f"{text!r}: only {want} here")
        out.append(rule.name)
    if sum(1 for name in out if is_agenda(name)) > 1:
        raise DeviceError(field, "at most one agenda@HH:MM rule")
    return out


def put_device(db: Database, settings: Settings, spec: DeviceSpec, now: Instant | None = None) -> Registration:
    """Create or replace a device with exactly these rules and sources. Raises ``DeviceError``.

    A device without a credential (a new one, or one registered before credentials existed) is
    issued one; replacing a device keeps its credential, so the phone's copy stays valid.
    """
    spec = validate(spec)
    _check_configured(spec.provider, settings)
    if spec.provider == Provider.WEBPUSH:
        try:
            check_reachable(
                Subscription.stored(spec.apns_token).endpoint, parse_networks(settings.webpush_allow_networks)
            )
        except PushSubscriptionError as exc:
            raise DeviceError("webpush_subscription", str(exc)) from None
    secret, digest = new_credential()
    now = now or Instant.now()
    values = {
        "id": spec.id,
        "target": spec.apns_token,
        "provider": spec.provider,
        "reminder_lead_seconds": spec.reminder_lead_seconds,
        "extra_rules": " ".join(spec.extra_rules),
        "all_day_rules": " ".join(spec.all_day_rules),
        "quiet_hours": spec.quiet_hours,
        "tz_name": spec.tz_name,
        "use_alarms": 1 if spec.alarms else 0,
        "attendees": " ".join(spec.attendees),
        "locale": spec.locale,
        "clock": spec.clock,
        "chunk": chunk_of(spec.id, settings.chunk_count),
    }
    with db.write() as conn:
        before = ledger.get_device(conn, spec.id)
        ledger.upsert_device(conn, values, now)
        calendars = {url: settings.columns() for url, settings in spec.calendars.items()}
        ledger.set_subscriptions(conn, spec.id, list(spec.source_urls), now, calendars)
        dropped = ledger.unsubscribed_pending(conn, spec.id)  # of a calendar no longer subscribed
        if dropped:
            ledger.lock_rows(conn, dropped)
            ledger.void_rows(conn, dropped, "source_removed", now)
        muted = [url for url, settings in spec.calendars.items() if settings.muted]
        ledger.void_pending_of_urls(conn, spec.id, muted, "muted", now)
        issued = ledger.set_device_credential(conn, spec.id, digest, only_if_missing=True)
        record = ledger.get_device(conn, spec.id)
        assert record is not None
        if before is not None and _quiet_terms(before) != _quiet_terms(record):
            ledger.end_holds(conn, spec.id, now)
    return Registration(record, secret if issued else None)


def _quiet_terms(record: ledger.DeviceRecord) -> tuple[object, ...]:
    """What a quiet-hours hold was decided on: a change of any ends the device's holds (a calendar
    that now breaks through them among them)."""
    breaking = sorted(c["url"] for c in record.calendars if c["breakthrough"])
    return record.tz_name, record.quiet_hours, tuple(breaking)


def remove_device(db: Database, device_id: str, now: Instant | None = None) -> int | None:
    """Voids the device's pending rows (``device_removed``) and deletes it; None if unknown."""
    with db.write() as conn:
        return ledger.delete_device(conn, device_id, now or Instant.now())


def rechunk(db: Database, settings: Settings, now: Instant | None = None) -> int:
    """Recompute every stored chunk after ``REMINDERS_CHUNK_COUNT`` changed."""
    with db.write() as conn:
        ids = [d.id for d in ledger.list_devices(conn)]
        return ledger.set_chunks(conn, {i: chunk_of(i, settings.chunk_count) for i in ids}, now or Instant.now())
