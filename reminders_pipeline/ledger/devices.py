"""Devices: registration, credentials, the build's device selection and locks, zones, dead tokens.

Longer than 350 lines because ``ledger/`` keeps the statements on one table in one module, and the
devices table is written by registration, the build and the drain (dead tokens) and read by the per-
chunk reports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import (
    Connection,
    delete,
    func,
    null,
    or_,
    select,
    update,
)

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.domain.wire import Provider
from reminders_pipeline.ledger._common import batches, insert_on_conflict
from reminders_pipeline.ledger.queue import end_holds
from reminders_pipeline.ledger.schema import device_sources, devices, sources
from reminders_pipeline.ledger.sources import HAS_CALENDAR_SETTINGS
from reminders_pipeline.ledger.voids import void_pending_of_device

SHOWN_AS = {"target": "apns_token"}  # a field the CLI and HTTP name as they always have


@dataclass(frozen=True)
class DeviceRecord:
    id: str
    target: str  # the device's target at its provider: an APNs token, a Web Push subscription, an FCM token
    reminder_lead_seconds: int
    extra_rules: tuple[str, ...]
    source_urls: tuple[str, ...]
    chunk: int
    last_tz_offset_seconds: int | None
    reminders_built_at: Instant | None
    token_invalid_at: Instant | None
    token_invalid_reason: str | None
    created_at: Instant
    updated_at: Instant
    has_credential: bool = False  # the device's own credential exists (its hash only is stored)
    tz_name: str | None = None  # IANA zone; floating and all-day times resolve in it when set
    all_day_rules: tuple[str, ...] = ("day:0@09:00",)
    quiet_hours: str | None = None
    use_alarms: bool = False
    attendees: tuple[str, ...] = ()
    locale: str | None = None
    clock: str | None = None
    calendars: tuple[dict[str, Any], ...] = ()  # subscriptions with settings of their own, as shown
    provider: str = Provider.APNS  # who delivers: apns, webpush (``target`` holds the subscription) or fcm

    def as_dict(self) -> dict[str, Any]:
        """As the CLI and the HTTP routes show it (the target as ``apns_token``, its name there): lists, and each time as its stored text. The
        target by its provider: an APNs or FCM token as it is, a Web Push subscription by its
        push service's origin alone (the endpoint's path is the subscription's capability)."""
        d = {SHOWN_AS.get(k, k): v.stored if isinstance(v, Instant) else v for k, v in self.__dict__.items()}
        if self.provider != Provider.APNS:
            d["apns_token"] = None
            if self.provider == Provider.FCM:
                d["fcm_token"] = self.target
            else:
                parts = urlsplit(json.loads(self.target)["endpoint"])
                d["webpush_endpoint"] = f"{parts.scheme}://{parts.netloc}/…"
        d["extra_rules"], d["source_urls"] = list(self.extra_rules), list(self.source_urls)
        d["all_day_rules"], d["attendees"] = list(self.all_day_rules), list(self.attendees)
        d["calendars"] = [dict(c) for c in self.calendars]
        return d


def set_device_credential(
    conn: Connection, device_id: str, credential_hash: str, *, only_if_missing: bool = False
) -> bool:
    """Store a device's credential hash; ``only_if_missing`` keeps an existing one (two racing
    first registrations: one issues, the other is told nothing was issued)."""
    return (
        swap_device_credential(conn, device_id, None, credential_hash)
        if only_if_missing
        else (
            conn.execute(
                update(devices).where(devices.c.id == device_id).values(credential_hash=credential_hash)
            ).rowcount
            == 1
        )
    )


def swap_device_credential(conn: Connection, device_id: str, old_hash: str | None, new_hash: str) -> bool:
    """Compare-and-swap: the new hash only over ``old_hash`` (None: over no credential). Of two
    rotations that read the same credential, one swaps and the other finds it changed."""
    same = devices.c.credential_hash.is_(None) if old_hash is None else devices.c.credential_hash == old_hash
    return (
        conn.execute(update(devices).where(devices.c.id == device_id, same).values(credential_hash=new_hash)).rowcount
        == 1
    )


def device_credential_hash(conn: Connection, device_id: str) -> str | None:
    return conn.execute(select(devices.c.credential_hash).where(devices.c.id == device_id)).scalar_one_or_none()


def upsert_device(conn: Connection, values: Mapping[str, Any], now: Instant) -> None:
    """Create or replace a device's registration. Registering clears a dead-token mark, whatever the
    token: Apple's rule for 410 is "stop sending unless the device registered again since", and a
    device that re-registers a token APNs rejects is marked again by its next send."""
    ins = insert_on_conflict(conn)(devices).values(**values, created_at=now, updated_at=now, registered_at=now)
    stmt = ins.on_conflict_do_update(
        index_elements=[devices.c.id],
        set_={
            "target": ins.excluded.target,
            "provider": ins.excluded.provider,
            "reminder_lead_seconds": ins.excluded.reminder_lead_seconds,
            "extra_rules": ins.excluded.extra_rules,
            "all_day_rules": ins.excluded.all_day_rules,
            "quiet_hours": ins.excluded.quiet_hours,
            "use_alarms": ins.excluded.use_alarms,
            "attendees": ins.excluded.attendees,
            "locale": func.coalesce(ins.excluded.locale, devices.c.locale),  # omitted: the widget's last
            "clock": ins.excluded.clock,
            "tz_name": func.coalesce(ins.excluded.tz_name, devices.c.tz_name),  # omitted: the widget's last
            "chunk": ins.excluded.chunk,
            "updated_at": ins.excluded.updated_at,
            "registered_at": ins.excluded.registered_at,
            "token_invalid_at": null(),
            "token_invalid_reason": null(),
        },
    )
    conn.execute(stmt)


def _device_records(conn: Connection, where: Any = None) -> list[DeviceRecord]:
    stmt = select(devices).order_by(devices.c.id)
    if where is not None:
        stmt = stmt.where(where)
    rows = conn.execute(stmt).mappings().all()
    urls: dict[str, list[str]] = {r["id"]: [] for r in rows}
    calendars: dict[str, list[dict[str, Any]]] = {r["id"]: [] for r in rows}
    if rows:
        for ids in batches(list(urls)):
            sub = (
                select(device_sources, sources.c.url, HAS_CALENDAR_SETTINGS.label("own"))
                .join(sources, sources.c.id == device_sources.c.source_id)
                .where(device_sources.c.device_id.in_(ids))
                .order_by(sources.c.url)
            )
            for s in conn.execute(sub).mappings():
                urls[s["device_id"]].append(s["url"])
                if s["own"]:
                    calendars[s["device_id"]].append(_shown_calendar(dict(s)))
    return [
        DeviceRecord(
            id=r["id"],
            target=r["target"],
            reminder_lead_seconds=r["reminder_lead_seconds"],
            extra_rules=tuple(r["extra_rules"].split()),
            source_urls=tuple(urls[r["id"]]),
            chunk=r["chunk"],
            last_tz_offset_seconds=r["last_tz_offset_seconds"],
            reminders_built_at=r["reminders_built_at"],
            token_invalid_at=r["token_invalid_at"],
            token_invalid_reason=r["token_invalid_reason"],
            created_at=r["created_at"],
            updated_at=r["updated_at"],
            has_credential=r["credential_hash"] is not None,
            tz_name=r["tz_name"],
            all_day_rules=tuple(r["all_day_rules"].split()),
            quiet_hours=r["quiet_hours"],
            use_alarms=bool(r["use_alarms"]),
            attendees=tuple(r["attendees"].split()),
            locale=r["locale"],
            clock=r["clock"],
            calendars=tuple(calendars[r["id"]]),
            provider=r["provider"],
        )
        for r in rows
    ]


def _shown_calendar(row: Mapping[str, Any]) -> dict[str, Any]:
    """A subscription's own settings as the CLI and the device API show them."""
    return {
        "url": row["url"],
        "rules": None if row["rules"] is None else row["rules"].split(),
        "interruption_level": row["interruption_level"],
        "breakthrough": bool(row["breakthrough"]),
        "muted": bool(row["muted"]),
        "travel_seconds": row["travel_seconds"],
    }


def get_device(conn: Connection, device_id: str) -> DeviceRecord | None:
    found = _device_records(conn, devices.c.id == device_id)
    return found[0] if found else None


def list_devices(conn: Connection) -> list[DeviceRecord]:
    return _device_records(conn)


def delete_device(conn: Connection, device_id: str, now: Instant) -> int | None:
    """Void the device's pending rows and delete it. Returns rows voided, or None if it did not exist."""
    if conn.execute(select(devices.c.id).where(devices.c.id == device_id).with_for_update()).first() is None:
        return None
    voided = void_pending_of_device(conn, device_id, "device_removed", now)
    conn.execute(delete(devices).where(devices.c.id == device_id))
    return voided


def store_tz_offset(conn: Connection, device_id: str, offset_seconds: int, now: Instant | None = None) -> bool:
    """Conditional: writes only when the offset differs, so an unchanged feed read stays a read.
    A new offset ends the device's quiet-hours holds (``end_holds``): they were decided in the old."""
    stmt = (
        update(devices)
        .where(devices.c.id == device_id, devices.c.last_tz_offset_seconds.is_distinct_from(offset_seconds))
        .values(last_tz_offset_seconds=offset_seconds)
    )
    return _zone_changed(conn, stmt, device_id, now)


def store_tz_name(conn: Connection, device_id: str, tz_name: str, now: Instant | None = None) -> bool:
    """Conditional like ``store_tz_offset``: a widget sending the same zone on every read writes nothing."""
    stmt = (
        update(devices)
        .where(devices.c.id == device_id, devices.c.tz_name.is_distinct_from(tz_name))
        .values(tz_name=tz_name)
    )
    return _zone_changed(conn, stmt, device_id, now)


def store_locale(conn: Connection, device_id: str, locale: str) -> bool:
    """Conditional like ``store_tz_name``: the widget's locale, written only when it changed."""
    stmt = (
        update(devices)
        .where(devices.c.id == device_id, devices.c.locale.is_distinct_from(locale))
        .values(locale=locale)
    )
    return conn.execute(stmt).rowcount == 1


def _zone_changed(conn: Connection, stmt: Any, device_id: str, now: Instant | None) -> bool:
    changed = conn.execute(stmt).rowcount == 1
    if changed:
        end_holds(conn, device_id, now or Instant.now())
    return changed


def mark_token_invalid(
    conn: Connection,
    device_id: str,
    token: str,
    at: Instant,
    reason: str,
    now: Instant,
    since: Instant | None = None,
) -> int:
    """APNs said this token is dead: mark it (if it is still the registered one) and void its pending rows.

    ``since``: the time the answer speaks for (APNs' timestamp of a 410, else the send's claim;
    default ``at``). Apple: stop sending "unless the device registers again after" it, so a device
    that registered later than that (the same token again) is not marked: the answer is stale.
    """
    fresh = or_(devices.c.registered_at.is_(None), devices.c.registered_at <= (since or at))
    marked = conn.execute(
        update(devices)
        .where(devices.c.id == device_id, devices.c.target == token, devices.c.token_invalid_at.is_(None), fresh)
        .values(token_invalid_at=at, token_invalid_reason=reason, updated_at=now)
    ).rowcount
    if not marked:
        return 0
    return void_pending_of_device(conn, device_id, "unregistered" if reason == "Unregistered" else "token_invalid", now)


def rules_in_use(conn: Connection) -> list[tuple[int, str]]:
    """Each distinct (reminder_lead_seconds, extra_rules) of live devices."""
    stmt = (
        select(devices.c.reminder_lead_seconds, devices.c.extra_rules)
        .where(devices.c.token_invalid_at.is_(None))
        .distinct()
    )
    return [(lead, extra) for lead, extra in conn.execute(stmt)]


def min_lead_seconds(conn: Connection) -> int | None:
    least: int | None = conn.scalar(
        select(func.min(devices.c.reminder_lead_seconds)).where(devices.c.token_invalid_at.is_(None))
    )
    return least


def count_devices_with_lead_below(conn: Connection, seconds: int) -> int:
    """Live devices whose ``reminder_lead_seconds`` is under ``seconds``."""
    live = devices.c.token_invalid_at.is_(None)
    return int(conn.scalar(select(func.count()).where(live, devices.c.reminder_lead_seconds < seconds)) or 0)


def providers_in_use(conn: Connection) -> set[str]:
    """The providers live devices are delivered by: those a sending deployment must reach."""
    return set(conn.scalars(select(devices.c.provider).where(devices.c.token_invalid_at.is_(None)).distinct()))
