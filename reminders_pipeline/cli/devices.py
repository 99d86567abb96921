"""``reminders device``: register a device with its calendars and rules, rotate its credential,
list, remove and rechunk devices. Each command is a few lines over ``devices.registration``; a
refused field names the option that gave it (``OPTION_OF_FIELD``)."""

from __future__ import annotations

import json
from typing import Any

import click

from reminders_pipeline import ledger
from reminders_pipeline.cli.context import Ctx, emit, known, pass_ctx
from reminders_pipeline.devices.credentials import CredentialChanged, rotate_credential
from reminders_pipeline.devices.registration import DeviceError, DeviceSpec, put_device, rechunk, remove_device
from reminders_pipeline.domain.calendar_settings import LEVELS, CalendarSettings, SubscriptionError, checked
from reminders_pipeline.domain.phrases import CLOCKS
from reminders_pipeline.domain.rules import MAX_TRAVEL_SECONDS
from reminders_pipeline.sources.urls import shown_url


@click.group()
def device() -> None:
    """Register, list and remove devices."""


def _calendars(
    rules: tuple[tuple[str, str], ...],
    levels: tuple[tuple[str, str], ...],
    breakthrough: tuple[str, ...],
    muted: tuple[str, ...],
    travel: tuple[tuple[str, int], ...],
) -> dict[str, CalendarSettings]:
    """The ``--calendar-*`` options as settings per source URL."""
    urls = dict.fromkeys(
        [u for u, _ in rules] + [u for u, _ in levels] + list(breakthrough) + list(muted) + [u for u, _ in travel]
    )
    out = {}
    for url in urls:
        own = [r for u, r in rules if u == url]
        level = [lv for u, lv in levels if u == url]
        if len(level) > 1:
            raise click.BadParameter(
                f"one level per source, got {len(level)} for {shown_url(url)}", param_hint="--calendar-level"
            )
        try:
            seconds = [t for u, t in travel if u == url]
            out[url] = checked(
                own or None,
                level[0] if level else None,
                url in breakthrough,
                url in muted,
                seconds[-1] if seconds else None,
            )
        except SubscriptionError as exc:
            raise click.BadParameter(str(exc), param_hint="--calendar-rule") from None
    return out


@device.command("put")
@click.argument("device_id")
@click.option("--apns-token", default=None, help="Hex APNs device token (or --webpush-subscription, --fcm-token).")
@click.option(
    "--webpush-subscription",
    "webpush_file",
    type=click.File("r", encoding="utf-8"),
    default=None,
    help="A file holding the browser's PushSubscription JSON (endpoint and keys): deliver by Web Push.",
)
@click.option("--fcm-token", default=None, help="An FCM registration token: deliver by Firebase Cloud Messaging.")
@click.option("--lead", type=click.IntRange(min=0), default=None, help="reminder_lead_seconds (default 3600).")
@click.option("--rule", "rules", multiple=True, help="Extra rule, e.g. lead:0@expiry. Repeatable.")
@click.option("--source", "sources", multiple=True, help="Source URL (JSON feed). Repeatable.")
@click.option(
    "--tz", "tz_name", default=None, help="IANA time zone, e.g. Europe/Berlin (default: keep the stored one)."
)
@click.option(
    "--all-day-rule",
    "all_day_rules",
    multiple=True,
    help="Rule for all-day items, e.g. day:1@18:00 (default day:0@09:00). Repeatable.",
)
@click.option("--no-all-day-rules", is_flag=True, help="No reminders for all-day items.")
@click.option("--quiet-hours", default=None, help="Quiet hours in the device's zone, e.g. 22:00-07:00.")
@click.option("--alarms", is_flag=True, help="Use each calendar event's own alarms (VALARM) as its rules.")
@click.option(
    "--attendee",
    "attendees",
    multiple=True,
    help="The person's own address, e.g. ann@example.org: invitations it declined alert nothing. Repeatable.",
)
@click.option("--locale", default=None, help="The alerts' language, e.g. de-DE (default: keep the stored one).")
@click.option("--clock", type=click.Choice(CLOCKS), default=None, help="12h or 24h (default: the locale's own).")
@click.option(
    "--calendar-rule",
    "calendar_rules",
    type=(str, str),
    multiple=True,
    metavar="URL RULE",
    help="A rule of that source's own, e.g. --calendar-rule URL lead:600: its items take these instead of "
    "the device's rules of that kind. Repeatable.",
)
@click.option(
    "--calendar-level",
    "calendar_levels",
    type=(str, click.Choice(LEVELS)),
    multiple=True,
    metavar="URL LEVEL",
    help="That source's interruption level: passive, active or time-sensitive. Repeatable.",
)
@click.option(
    "--calendar-breakthrough", multiple=True, metavar="URL", help="That source's reminders break through quiet hours."
)
@click.option("--calendar-muted", multiple=True, metavar="URL", help="That source alerts nothing. Repeatable.")
@click.option(
    "--calendar-travel",
    "calendar_travel",
    type=(str, click.IntRange(1, MAX_TRAVEL_SECONDS)),
    multiple=True,
    metavar="URL SECONDS",
    help="A `leave` reminder that long before each timed item of that source without its own travel time.",
)
@pass_ctx
def device_put(
    ctx: Ctx,
    device_id: str,
    apns_token: str | None,
    webpush_file: Any,
    fcm_token: str | None,
    lead: int | None,
    rules: tuple[str, ...],
    sources: tuple[str, ...],
    tz_name: str | None,
    all_day_rules: tuple[str, ...],
    no_all_day_rules: bool,
    quiet_hours: str | None,
    alarms: bool,
    attendees: tuple[str, ...],
    locale: str | None,
    clock: str | None,
    calendar_rules: tuple[tuple[str, str], ...],
    calendar_levels: tuple[tuple[str, str], ...],
    calendar_breakthrough: tuple[str, ...],
    calendar_muted: tuple[str, ...],
    calendar_travel: tuple[tuple[str, int], ...],
) -> None:
    """Create or replace a device: exactly these rules and sources.

    A new device's own credential (its bearer for GET /v1/devices/ID/feed) is printed this once.
    """
    if no_all_day_rules and all_day_rules:
        raise click.UsageError("give --all-day-rule or --no-all-day-rules, not both")
    spec = DeviceSpec.requested(
        ctx.settings,
        device_id,
        apns_token=apns_token,
        webpush=_subscription_json(webpush_file),
        fcm_token=fcm_token,
        lead=lead,
        rules=rules,
        sources=sources,
        tz=tz_name,
        all_day_rules=() if no_all_day_rules else all_day_rules or None,
        quiet_hours=quiet_hours,
        alarms=alarms,
        attendees=attendees,
        locale=locale,
        clock=clock,
        calendars=_calendars(calendar_rules, calendar_levels, calendar_breakthrough, calendar_muted, calendar_travel),
    )
    try:
        registration = put_device(ctx.db, ctx.settings, spec)
    except DeviceError as exc:
        raise click.BadParameter(exc.message, param_hint=OPTION_OF_FIELD.get(exc.field, exc.field)) from None
    emit(registration.as_dict())


# What a registration's error names (its HTTP field) as the option typed here.
OPTION_OF_FIELD = {
    "id": "DEVICE_ID",
    "apns_token": "--apns-token",
    "webpush_subscription": "--webpush-subscription",
    "fcm_token": "--fcm-token",
    "target": "--apns-token / --webpush-subscription / --fcm-token",
    "reminder_lead_seconds": "--lead",
    "rules": "--rule",
    "all_day_rules": "--all-day-rule",
    "sources": "--source",
    "tz": "--tz",
    "quiet_hours": "--quiet-hours",
    "attendees": "--attendee",
    "locale": "--locale",
    "clock": "--clock",
    "calendars": "--calendar-*",
}


def _subscription_json(file: Any) -> dict[str, Any] | None:
    """The browser's PushSubscription JSON from ``--webpush-subscription``, or None."""
    if file is None:
        return None
    try:
        data = json.loads(file.read(64 * 1024))
    except ValueError:
        raise click.BadParameter("not JSON", param_hint="--webpush-subscription") from None
    if not isinstance(data, dict):
        raise click.BadParameter("a JSON object with endpoint and keys", param_hint="--webpush-subscription")
    return data


@device.command("rotate-credential")
@click.argument("device_id")
@pass_ctx
def device_rotate_credential(ctx: Ctx, device_id: str) -> None:
    """Issue the device a new credential (printed this once); the old one stops working at once."""
    try:
        credential = rotate_credential(ctx.db, device_id)
    except CredentialChanged as exc:
        raise click.ClickException(str(exc)) from None
    emit({"device_id": device_id, "credential": known(credential, device_id)})


@device.command("list")
@pass_ctx
def device_list(ctx: Ctx) -> None:
    with ctx.db.read() as conn:
        emit([d.as_dict() for d in ledger.list_devices(conn)])


@device.command("remove")
@click.argument("device_id")
@pass_ctx
def device_remove(ctx: Ctx, device_id: str) -> None:
    """Delete a device; its pending reminders are voided (device_removed)."""
    emit({"removed": device_id, "rows_voided": known(remove_device(ctx.db, device_id), device_id)})


@device.command("rechunk")
@pass_ctx
def device_rechunk(ctx: Ctx) -> None:
    """Recompute stored chunks after REMINDERS_CHUNK_COUNT changed."""
    emit({"devices_moved": rechunk(ctx.db, ctx.settings), "chunk_count": ctx.settings.chunk_count})
