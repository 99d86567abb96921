"""The root of the ``reminders`` command tree and the commands that run the pipeline (``db``,
``build``, ``drain``, ``dispatch``, ``serve``, ``dev``, ``check``, ...); ``devices`` and ``queue`` are
their own modules, ``context`` what every command shares."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from reminders_pipeline import ledger
from reminders_pipeline.cli.context import Ctx, When, emit, pass_ctx, progress
from reminders_pipeline.cli.devices import device
from reminders_pipeline.cli.queue import queue
from reminders_pipeline.config.settings import SettingsError
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.ops.check import check as run_check
from reminders_pipeline.planning.build import build as run_build
from reminders_pipeline.providers.routing import checked_sender_factory
from reminders_pipeline.providers.webpush import generate_key
from reminders_pipeline.sending.drain import drain as run_drain
from reminders_pipeline.sources.urls import shown_url


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
        emit(
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
    emit({"private_key_file": str(path), "public_key": public})


@main.command("sources")
@pass_ctx
def sources_list(ctx: Ctx) -> None:
    """Sources with their last read, last error and consecutive failures; URLs as shown (no secrets)."""
    with ctx.db.read() as conn:
        emit([source | {"url": shown_url(source["url"])} for source in ledger.list_sources(conn)])


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
    emit(summary.as_dict())


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
    emit(summary.as_dict())


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
    emit(run_in_foreground(ctx.db, ctx.settings, factory, seconds=seconds).as_dict())


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
    emit({"deleted": deleted, "retention_seconds": ctx.settings.retention_seconds})


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


main.add_command(device)
main.add_command(queue)
