"""``reminders``: the command-line shell over the core.

Exit codes: 0 done; 1 the environment is not ready (a database not at this release's migration
head, a failed check); 2 a bad argument or setting, and nothing was written. A command that reports
a result prints it as JSON on stdout, except ``check``, whose one line per relationship is read by a
person; long ones also show progress on stderr when it is a terminal.

Longer than 350 lines because it declares every ``reminders`` command and its options, each a few
lines over a core call: one command tree, which split up would only be harder to read as one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click

from reminders_pipeline import ledger
from reminders_pipeline.config import dev_run
from reminders_pipeline.config.settings import Settings, SettingsError
from reminders_pipeline.devices import actions
from reminders_pipeline.devices.credentials import CredentialChanged, rotate_credential
from reminders_pipeline.devices.registration import DeviceError, DeviceSpec, put_device, rechunk, remove_device
from reminders_pipeline.domain.calendar_settings import LEVELS, CalendarSettings, SubscriptionError, checked
from reminders_pipeline.domain.notification import as_shown
from reminders_pipeline.domain.phrases import CLOCKS
from reminders_pipeline.domain.rules import MAX_TRAVEL_SECONDS
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ledger.schema import OUTCOMES, STATUSES
from reminders_pipeline.ops.check import check as run_check
from reminders_pipeline.planning.build import build as run_build
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.providers.webpush import generate_key
from reminders_pipeline.sending.drain import drain as run_drain
from reminders_pipeline.sources.urls import shown_url

T = TypeVar("T")


def _emit(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _known(result: T | None, device_id: str) -> T:
    """A device command's result; None means there is no such device, a bad argument (exit 2)."""
    if result is None:
        raise click.BadParameter(f"no device {device_id!r}", param_hint="DEVICE_ID")
    return result


class When(click.ParamType):
    name = "TIME"

    def convert(self, value: Any, param: Any, ctx: Any) -> Instant:
        try:
            return Instant.parse(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Ctx:
    def __init__(self) -> None:
        env, dev_env = dev_run.with_dev_run(os.environ, Path.cwd())
        if dev_env is not None:
            click.echo(
                f"reminders: with the settings of `reminders dev` in {dev_env} (the environment overrides them)",
                err=True,
            )
        try:
            self.settings = Settings.from_env(env)
        except SettingsError as exc:
            raise click.UsageError(f"configuration: {exc}") from None
        self._db: Database | None = None

    @property
    def db(self) -> Database:
        """The ledger, refused with one line (exit 1) unless it is at this release's migration head."""
        db = self.unchecked_db
        try:
            migrate.require_head(db)
        except migrate.SchemaNotCurrent as exc:
            raise click.ClickException(str(exc)) from None
        return db

    @property
    def unchecked_db(self) -> Database:
        """The ledger's engine (one per process), made on first use, at whatever revision it is."""
        if self._db is None:
            self._db = Database.for_settings(self.settings)
        return self._db


Progress = Callable[[int, "int | None"], None]


@contextmanager
def progress(label: str, unit: str) -> Iterator[Progress | None]:
    """A counter rewritten in place on stderr while the core works, only when stderr is a terminal:
    stdout stays exactly one JSON summary, and logs or pipes get no control characters."""
    if not sys.stderr.isatty():
        yield None
        return
    shown = False

    def show(done: int, total: int | None) -> None:
        nonlocal shown
        shown = True
        counted = f"{done}/{total}" if total is not None else str(done)
        click.echo(f"\r{label}: {counted} {unit}", err=True, nl=False)

    try:
        yield show
    finally:
        if shown:
            click.echo(err=True)


pass_ctx = click.make_pass_decorator(Ctx, ensure=True)


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO.")
def main(verbose: bool) -> None:
    """Reminders pipeline: build the notification queue from device feeds and drain it to APNs."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr)


@main.group()
def db() -> None:
    """Database schema."""


@db.command("upgrade")
@pass_ctx
def db_upgrade(ctx: Ctx) -> None:
    """Apply the packaged migrations (creates the SQLite file under ./var/ by default)."""
    # No statement timeout: building an index on a large queue may take longer than any query should.
    database = Database(ctx.settings.database_url)
    try:
        try:
            migrate.upgrade(database)
        except migrate.MigrationBlocked as exc:
            raise click.ClickException(str(exc)) from None
        _emit(
            {
                "database": database.engine.url.render_as_string(hide_password=True),
                "revision": migrate.current_revision(database),
            }
        )
    finally:
        database.dispose()


@main.group()
def vapid() -> None:
    """The VAPID key pair every Web Push request is signed with."""


@vapid.command("generate")
@click.option(
    "--out",
    "path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where to write the private key (PEM); it must not exist yet.",
)
def vapid_generate(path: Path) -> None:
    """Write a new VAPID private key (readable by its owner only) and print its public key, the
    browser's applicationServerKey. Set REMINDERS_VAPID_PRIVATE_KEY_FILE to the file."""
    if path.exists():
        raise click.BadParameter(
            f"{path} exists: a new key means every browser must subscribe again; remove it first", param_hint="--out"
        )
    public = generate_key(str(path))
    _emit({"private_key_file": str(path), "public_key": public})


@main.group()
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
    _emit(registration.as_dict())


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
    _emit({"device_id": device_id, "credential": _known(credential, device_id)})


@device.command("list")
@pass_ctx
def device_list(ctx: Ctx) -> None:
    with ctx.db.read() as conn:
        _emit([d.as_dict() for d in ledger.list_devices(conn)])


@device.command("remove")
@click.argument("device_id")
@pass_ctx
def device_remove(ctx: Ctx, device_id: str) -> None:
    """Delete a device; its pending reminders are voided (device_removed)."""
    _emit({"removed": device_id, "rows_voided": _known(remove_device(ctx.db, device_id), device_id)})


@device.command("rechunk")
@pass_ctx
def device_rechunk(ctx: Ctx) -> None:
    """Recompute stored chunks after REMINDERS_CHUNK_COUNT changed."""
    _emit({"devices_moved": rechunk(ctx.db, ctx.settings), "chunk_count": ctx.settings.chunk_count})


@main.command("sources")
@pass_ctx
def sources_list(ctx: Ctx) -> None:
    """Sources with their last read, last error and consecutive failures; URLs as shown (no secrets)."""
    with ctx.db.read() as conn:
        _emit([source | {"url": shown_url(source["url"])} for source in ledger.list_sources(conn)])


@main.command("build")
@click.option("--all", "all_devices", is_flag=True, help="Every device.")
@click.option("--device", "device_ids", multiple=True, help="Only this device. Repeatable.")
@click.option("--chunk", "chunks", multiple=True, type=click.IntRange(min=0), help="Only this chunk. Repeatable.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most this many stalest devices.")
@click.option("--now", type=When(), default=None, help="Pretend it is this time (ISO-8601 or Unix seconds).")
@pass_ctx
def build_cmd(
    ctx: Ctx,
    all_devices: bool,
    device_ids: tuple[str, ...],
    chunks: tuple[int, ...],
    limit: int | None,
    now: Instant | None,
) -> None:
    """Compose feeds and upsert queue rows; print one JSON summary."""
    if sum(map(bool, (all_devices, device_ids, chunks))) != 1:
        raise click.UsageError("give exactly one of --all, --device ID..., --chunk N...")
    if any(c >= ctx.settings.chunk_count for c in chunks):
        raise click.BadParameter(f"chunks are 0..{ctx.settings.chunk_count - 1}", param_hint="--chunk")
    with ctx.db.read() as conn:
        unknown = [d for d in device_ids if ledger.get_device(conn, d) is None]
    if unknown:
        raise click.BadParameter(f"no device {', '.join(map(repr, unknown))}", param_hint="--device")
    with progress("build", "devices") as shown:
        summary = run_build(
            ctx.db,
            ctx.settings,
            device_ids=device_ids or None,
            chunks=chunks or None,
            limit=limit,
            now=now,
            progress=shown,
        )
    _emit(summary.as_dict())


@main.command("drain")
@click.option("--id", "row_id", type=click.IntRange(min=1), default=None, help="Drain only this row, if due.")
@click.option("--now", type=When(), default=None, help="Pretend it is this time (ISO-8601 or Unix seconds).")
@pass_ctx
def drain_cmd(ctx: Ctx, row_id: int | None, now: Instant | None) -> None:
    """Claim due rows, apply the send-time policy, send, settle; print one JSON summary."""
    try:
        factory = checked_sender_factory(ctx.db, ctx.settings)  # every provider in use checked before any claim
    except ValueError as exc:  # credentials missing or unreadable: nothing was claimed
        raise click.UsageError(str(exc)) from None
    with progress("drain", "due rows claimed") as shown:
        summary = run_drain(ctx.db, ctx.settings, factory, now=now, row_id=row_id, progress=shown)
    _emit(summary.as_dict())


@main.command("dispatch")
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop after this long (default: until SIGTERM or Ctrl-C).",
)
@pass_ctx
def dispatch_cmd(ctx: Ctx, seconds: float | None) -> None:
    """Send each row at its own send_after, in the foreground; SIGTERM or Ctrl-C stops it cleanly
    (in-flight sends finish and settle). Prints one JSON summary. Safe beside Dagster's dispatcher
    and the cron drain: the claim decides who sends."""
    from reminders_pipeline.sending.dispatch import run_in_foreground

    try:
        factory = checked_sender_factory(ctx.db, ctx.settings)  # every provider in use checked before any claim
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _emit(run_in_foreground(ctx.db, ctx.settings, factory, seconds=seconds).as_dict())


@main.group()
def queue() -> None:
    """Inspect notification_queue."""


@queue.command("list")
@click.option("--device", "device_id", default=None)
@click.option("--status", type=click.Choice(STATUSES), default=None)
@click.option("--outcome", type=click.Choice(OUTCOMES), default=None)
@click.option("--limit", type=click.IntRange(min=1), default=None)
@pass_ctx
def queue_list(ctx: Ctx, device_id: str | None, status: str | None, outcome: str | None, limit: int | None) -> None:
    with ctx.db.read() as conn:
        rows = ledger.list_queue(conn, device_id=device_id, status=status, outcome=outcome, limit=limit)
    _emit([as_shown(r) for r in rows])


def _acted(act: Any) -> Any:
    """An action's result; one refused is a bad argument (exit 2) or a refusal (exit 1), said why."""
    try:
        return act()
    except actions.ActionError as exc:
        if exc.status == 422:
            raise click.BadParameter(exc.message, param_hint=f"--{exc.field}") from None
        raise click.ClickException(f"{exc.code}: {exc.message}") from None


@queue.command("snooze")
@click.argument("device_id")
@click.argument("row_id", type=click.IntRange(min=1))
@click.option("--seconds", type=click.IntRange(1, actions.MAX_SNOOZE_SECONDS), default=None, help="From now.")
@click.option("--until", type=When(), default=None, help="At this time (ISO-8601 or Unix seconds).")
@click.option("--now", type=When(), default=None, help="Pretend it is this time (ISO-8601 or Unix seconds).")
@pass_ctx
def queue_snooze(
    ctx: Ctx, device_id: str, row_id: int, seconds: int | None, until: Instant | None, now: Instant | None
) -> None:
    """Snooze a sent reminder as the device's Snooze action would (an operator needs no action token)."""
    snoozed = _acted(lambda: actions.snooze(ctx.db, device_id, row_id, None, seconds=seconds, until=until, now=now))
    _emit({"device_id": device_id, **snoozed.as_dict()})


@queue.command("done")
@click.argument("device_id")
@click.argument("row_id", type=click.IntRange(min=1))
@click.option("--now", type=When(), default=None, help="Pretend it is this time (ISO-8601 or Unix seconds).")
@pass_ctx
def queue_done(ctx: Ctx, device_id: str, row_id: int, now: Instant | None) -> None:
    """Done on a sent reminder: the event's other pending reminders on the device settle `acknowledged`."""
    settled = _acted(
        lambda: actions.done(ctx.db, device_id, row_id, None, same_within=ctx.settings.rearm_threshold_seconds, now=now)
    )
    _emit({"device_id": device_id, "row_id": row_id, "acknowledged": settled})


@main.command("dev", context_settings={"ignore_unknown_options": True})
@click.option("--port", "ui_port", type=int, default=3000, show_default=True, help="Dagster UI port.")
@click.option("--demo-port", type=int, default=8765, show_default=True, help="Port of the local demo source.")
@click.argument("dagster_args", nargs=-1, type=click.UNPROCESSED)
def dev_cmd(ui_port: int, demo_port: int, dagster_args: tuple[str, ...]) -> None:
    """The whole pipeline in `dagster dev`: ledger and Dagster home under ./var/, a demo source and device, dry run."""
    from pathlib import Path

    from reminders_pipeline.dev.demo import run_dev

    try:
        sys.exit(run_dev(Path.cwd(), ui_port, demo_port, dagster_args))
    except SettingsError as exc:
        raise click.UsageError(f"configuration: {exc}") from None
    except migrate.MigrationBlocked as exc:
        raise click.ClickException(str(exc)) from None


@main.command("demo")
@click.option("--demo-port", type=int, default=8765, show_default=True)
def demo_cmd(demo_port: int) -> None:
    """Serve the demo source and register the demo device (no Dagster) until Ctrl-C."""
    from reminders_pipeline.dev.demo import serve_demo

    try:
        serve_demo(demo_port)
    except SettingsError as exc:
        raise click.UsageError(f"configuration: {exc}") from None
    except migrate.MigrationBlocked as exc:
        raise click.ClickException(str(exc)) from None


@main.command("prune")
@click.option("--now", type=When(), default=None, help="Pretend it is this time (ISO-8601 or Unix seconds).")
@pass_ctx
def prune_cmd(ctx: Ctx, now: Instant | None) -> None:
    """Delete rows settled longer ago than REMINDERS_RETENTION_SECONDS, in small batches."""
    from reminders_pipeline.ops.retention import prune

    with progress("prune", "rows deleted") as shown:
        deleted = prune(ctx.db, ctx.settings, now=now, progress=shown)
    _emit({"deleted": deleted, "retention_seconds": ctx.settings.retention_seconds})


@main.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0 for all).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@pass_ctx
def serve_cmd(ctx: Ctx, host: str, port: int) -> None:
    """Serve the HTTP routes (build/drain, device API, widget feed, /healthz, /metrics) under uvicorn."""
    from reminders_pipeline.http.serve import serve  # imported here: the other commands do not need uvicorn/starlette

    serve(host, port, ctx.settings)


@main.command("check")
@pass_ctx
def check_cmd(ctx: Ctx) -> None:
    """Assert the sweep-period and lateness relationships; exit 1 naming each broken one."""
    findings = run_check(ctx.db, ctx.settings)
    for f in findings:
        click.echo(f"{'ok  ' if f.ok else 'FAIL'} {f.name}: {f.detail}")
    broken = [f.name for f in findings if not f.ok]
    if broken:
        click.echo(f"broken: {', '.join(broken)}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
