"""``reminders queue``: list queue rows as people see them, and a person's Snooze and Done on a
sent alert, through the same core functions as the alert's own buttons (``devices.actions``)."""

from __future__ import annotations

from typing import Any

import click

from reminders_pipeline import ledger
from reminders_pipeline.cli.context import Ctx, When, emit, pass_ctx
from reminders_pipeline.devices import actions
from reminders_pipeline.domain.notification import as_shown
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.schema import OUTCOMES, STATUSES


@click.group()
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
    emit([as_shown(r) for r in rows])


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
    emit({"device_id": device_id, **snoozed.as_dict()})


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
    emit({"device_id": device_id, "row_id": row_id, "acknowledged": settled})
