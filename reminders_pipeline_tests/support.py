"""Small helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.devices.registration import DeviceSpec, put_device
from reminders_pipeline.domain.notification import as_shown
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger.db import Database

NOW = Instant.from_stored("2026-09-10T08:00:00.000Z")
NOW_S = NOW.whole_seconds
TOKEN = "ab" * 32
# Every ledger table, emptied between PostgreSQL tests (one database serves the session).
LEDGER_TABLES = "notification_queue, device_sources, sources, devices, dispatchers, notification_history, drain_halts"


def item(item_id: str, starts_in: int, duration: int = 1800, title: str | None = None, **extra: Any) -> dict[str, Any]:
    """A wire-format item starting ``starts_in`` seconds after NOW."""
    return {
        "id": item_id,
        "title": title or f"Event {item_id}",
        "startsAt": NOW_S + starts_in,
        "expiresAt": NOW_S + starts_in + duration,
        **extra,
    }


def device(
    db: Database,
    settings: Settings,
    device_id: str = "dev-1",
    *,
    sources: list[str],
    lead: int = 3600,
    rules: tuple[str, ...] = (),
    token: str = TOKEN,
) -> None:
    put_device(db, settings, DeviceSpec(device_id, token, lead, rules, tuple(sources)), now=NOW)


def subscribe(conn: Any, source_id: int, device_ids: Iterable[str], now: Instant) -> None:
    """Source ``source_id`` (made if missing), to which each of ``device_ids`` subscribes: the
    calendar of rows a test queues directly, as a build would have it (a row of a calendar its
    device dropped is voided at its claim)."""
    from sqlalchemy import insert, select  # noqa: PLC0415

    from reminders_pipeline.ledger.schema import device_sources, sources  # noqa: PLC0415

    if conn.scalar(select(sources.c.id).where(sources.c.id == source_id)) is None:
        url = f"https://tests.example/{source_id}.json"
        conn.execute(insert(sources).values(id=source_id, url=url, created_at=now))
    conn.execute(insert(device_sources), [{"device_id": d, "source_id": source_id} for d in device_ids])


def rows(db: Database, **filters: Any) -> list[dict[str, Any]]:
    """Queue rows as the CLI shows them (``notification.as_shown``)."""
    with db.read() as conn:
        return [as_shown(r) for r in ledger.list_queue(conn, **filters)]


def by_key(db: Database) -> dict[tuple[str, str], dict[str, Any]]:
    """Queue rows keyed by (raw item id, rule), dropping the source namespace."""
    return {(r["item_id"].split(":", 1)[1], r["rule"]): r for r in rows(db)}


def at(offset: int) -> Instant:
    return Instant.from_unix(NOW_S + offset)


def recorded(payload: dict[str, Any]) -> dict[str, Any]:
    """A payload as the ledger records it: without the alert's action token, a credential."""
    return {**payload, "reminder": {k: v for k, v in payload["reminder"].items() if k != "token"}}
