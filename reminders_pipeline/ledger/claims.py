"""The drain's side of a queue row: due ids, the claim (the only lock, which honours the halts of
``halts.py``), settle, return to pending, and abandoned claims; and a person's Done, which settles
rows as a settlement does.

Every statement that settles a row is here, where the claim's compare-and-swap they all honour
is (``lock_rows``, ``_due``), so no settle path can drift from the claim it must agree with."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from functools import cache
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Connection,
    Text,
    and_,
    any_,
    bindparam,
    case,
    exists,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql

from reminders_pipeline.domain.outcomes import ABANDONED
from reminders_pipeline.domain.rows import ClaimedRow, ReturnedRow, RowSettlement
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import CLAIMED, PENDING, REVIVABLE_VOIDS, now_param, rows_json, rows_text
from reminders_pipeline.ledger.halts import HALT_SEPARATOR
from reminders_pipeline.ledger.schema import IsoTime, device_sources, devices, drain_halts
from reminders_pipeline.ledger.schema import notification_queue as q
from reminders_pipeline.ledger.wakeups import announce_pending


def lock_rows(conn: Connection, ids: Iterable[int]) -> None:
    """Row-lock these queue rows in id order before statements write them.

    The build's upsert locks the rows it conflicts with (claimed ones included) in id order too, so
    a drain settling its claimed rows and a build re-reading the same devices wait for each other's
    commit instead of deadlocking, which PostgreSQL would answer by aborting one of them. SQLite
    serialises writers: nothing to order there.
    """
    if conn.dialect.name != "postgresql":
        return
    conn.execute(_LOCK_ROWS, {"lock_ids": sorted(set(ids))}).all()


# One array parameter, so one prepared statement whatever the number of ids.
_LOCK_ROWS = (
    select(q.c.id)
    .where(q.c.id == any_(bindparam("lock_ids", type_=postgresql.ARRAY(BigInteger))))
    .order_by(q.c.id)
    .with_for_update()
)


def fail_abandoned(conn: Connection, cutoff: Instant, now: Instant) -> int:
    """Claims older than ``cutoff`` belong to a run that died mid-send: failed, never retried."""
    return conn.execute(
        update(q)
        .where(q.c.status == CLAIMED, q.c.claimed_at < cutoff)
        .values(status="settled", outcome="failed", outcome_detail=ABANDONED, settled_at=now, updated_at=now)
    ).rowcount


def not_held(now: Any) -> Any:
    """A retry's backoff or a quiet-hours hold has ended (or there is none): half the due predicate."""
    return or_(q.c.not_before.is_(None), q.c.not_before <= now)


def _due(rows: Any, now: Any) -> tuple[Any, ...]:
    """The due predicate on ``rows`` (the queue, or what a lock returned of it)."""
    return (
        rows.c.status == PENDING,
        rows.c.send_after <= now,
        or_(rows.c.not_before.is_(None), rows.c.not_before <= now),
    )


def due_ids(
    conn: Connection,
    now: Instant,
    row_id: int | None = None,
    limit: int | None = None,
    after: Instant | None = None,
    *,
    skip_providers: Collection[str] = (),
    only_provider: str | None = None,
) -> list[int]:
    """The due predicate: pending, ``send_after`` has passed and so has ``not_before``. Plain text
    comparison in SQL: ``now`` is bound as its stored text.

    ``after``: only rows that came due after it (the later of ``send_after`` and ``not_before``),
    so a dispatcher with a burst in flight reads what is new, not every row it is already sending.
    ``skip_providers``: not the rows of these providers' devices (halted ones); ``only_provider``:
    only that provider's (a probe of a halted one). Either joins the devices; neither reads the
    queue alone, as every pass of a healthy dispatcher does.
    """
    stmt = (
        select(q.c.id)
        .where(q.c.status == PENDING, q.c.send_after <= now, not_held(now))
        .order_by(q.c.send_after, q.c.id)
    )
    if skip_providers or only_provider is not None:
        stmt = stmt.join(devices, devices.c.id == q.c.device_id)
        if skip_providers:
            stmt = stmt.where(devices.c.provider.not_in(sorted(skip_providers)))
        if only_provider is not None:
            stmt = stmt.where(devices.c.provider == only_provider)
    if after is not None:
        stmt = stmt.where(or_(q.c.send_after > after, q.c.not_before > after))
    if row_id is not None:
        stmt = stmt.where(q.c.id == row_id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(conn.scalars(stmt))


def claim(
    conn: Connection, ids: Sequence[int], now: Instant, claimer: str, *, unless_halted: str | None = None
) -> list[ClaimedRow]:
    """The compare-and-swap. A row is this caller's to send iff it comes back.

    On PostgreSQL the candidates are locked with SKIP LOCKED in id order, so overlapping claimers
    never deadlock and never wait on each other; the status and due check runs on the locked,
    latest row version. ``unless_halted``: a drain scope; once one provider is halted in it
    (``record_halt``) none of that provider's rows is claimed, checked by the same statement
    (``halts_of`` says why); the other providers' rows are claimed on.
    """
    if not ids:
        return []
    params = {"claim_ids": sorted(ids), "now": now, "claimer": claimer, "halt_scope": unless_halted}
    dialect = conn.dialect.name
    claimed = [dict(r) for r in conn.execute(_claim_statement(dialect), params).mappings()]
    if dialect == "postgresql" or not claimed:
        return cast(list[ClaimedRow], claimed)
    return _with_devices_read_after(conn, claimed)


def _with_devices_read_after(conn: Connection, claimed: list[dict[str, Any]]) -> list[ClaimedRow]:
    """SQLite cannot use UPDATE ... RETURNING as a CTE, so the device columns PostgreSQL joins in
    the claim's own statement come from a second read here, in the same transaction."""
    dev_ids = sorted({r["device_id"] for r in claimed})
    dev = {
        r["id"]: r
        for r in conn.execute(select(devices.c.id, *_CLAIM_DEVICE_COLUMNS).where(devices.c.id.in_(dev_ids))).mappings()
    }
    empty = {c.name: None for c in _CLAIM_DEVICE_COLUMNS}
    calendar = {
        (r["device_id"], r["source_id"]): r
        for r in conn.execute(
            select(device_sources.c.device_id, device_sources.c.source_id, *_CLAIM_CALENDAR_COLUMNS).where(
                device_sources.c.device_id.in_(dev_ids)
            )
        ).mappings()
    }
    no_calendar = {c.name: None for c in _CLAIM_CALENDAR_COLUMNS}
    rows = [
        {
            **r,
            **({k: dev[r["device_id"]][k] for k in empty} if r["device_id"] in dev else empty),
            **{k: calendar.get((r["device_id"], r["source_id"]), no_calendar)[k] for k in no_calendar},
        }
        for r in claimed
    ]
    return cast(list[ClaimedRow], rows)


_CLAIM_DEVICE_COLUMNS = (
    devices.c.target,
    devices.c.provider,
    devices.c.last_tz_offset_seconds,
    devices.c.token_invalid_at,
    devices.c.tz_name,
    devices.c.quiet_hours,
    devices.c.locale,
    devices.c.clock,
    devices.c.credential_hash,  # the key of the alert's action token (``actions``)
)
# What the row's calendar subscription says of its send (``calendar_settings.CalendarSettings``).
_CLAIM_CALENDAR_COLUMNS = (
    device_sources.c.interruption_level,
    device_sources.c.breakthrough.label("calendar_breakthrough"),
    device_sources.c.muted.label("calendar_muted"),
    device_sources.c.device_id.is_not(None).label("subscribed"),  # false or None: the device dropped it
)


def _not_halted(rows: Any) -> Any:
    """No halt of the row's device's provider in the claim's scope. A correlated read of the
    device (not a join): the claim's row lock must not take the device's. NULL matches no scope:
    no halt stops a claim made without one."""
    provider = select(devices.c.provider).where(devices.c.id == rows.c.device_id).correlate(rows).scalar_subquery()
    key = bindparam("halt_scope", type_=Text()).op("||")(literal(HALT_SEPARATOR)).op("||")(provider)
    return ~exists().where(drain_halts.c.scope == key)


@cache
def _claim_statement(dialect: str) -> Any:
    """Built once per dialect: the drain claims every slice with the same statement."""
    now = now_param()
    values = dict(status="claimed", claimed_at=now, claimed_by=bindparam("claimer"), updated_at=now)
    if dialect != "postgresql":
        return (
            update(q)
            .where(q.c.id.in_(bindparam("claim_ids", expanding=True)), _not_halted(q), *_due(q, now))
            .values(**values)
            .returning(*q.c)
        )
    # Lock by primary key only, and test the due predicate on what the lock returned (the row's
    # latest version, held until commit, so the claim stays a compare-and-swap). On the UPDATE's
    # own columns the predicate steered the planner onto the partial due index: every pending row
    # read and joined against the ids once per claim (21 ms for a 50-row slice at 3,000 due rows).
    ids = bindparam("claim_ids", type_=postgresql.ARRAY(BigInteger))
    locked = q.alias("locked")
    target = (
        select(locked.c.id, locked.c.status, locked.c.send_after, locked.c.not_before)
        .where(locked.c.id == any_(ids), _not_halted(locked))
        .order_by(locked.c.id)
        .with_for_update(skip_locked=True)
        .subquery("target")
    )
    stmt = update(q).where(q.c.id == target.c.id, *_due(target, now)).values(**values).returning(*q.c)
    claimed = stmt.cte("claimed")  # one round trip: the UPDATE as a CTE joined to devices
    calendar = and_(
        device_sources.c.device_id == claimed.c.device_id, device_sources.c.source_id == claimed.c.source_id
    )
    return (
        select(claimed, *_CLAIM_DEVICE_COLUMNS, *_CLAIM_CALENDAR_COLUMNS)
        .outerjoin(devices, devices.c.id == claimed.c.device_id)
        .outerjoin(device_sources, calendar)
    )


SETTLE_FIELDS = ("id", "outcome", "outcome_detail", "payload", "sent_body", "sent_format", "apns_id", "sent_at")


_SETTLE_ROWS_SOURCE = {
    "postgresql": (
        "SELECT r.* FROM json_to_recordset(CAST(:rows AS json)) AS r(id bigint, outcome text, "
        "outcome_detail text, payload text, sent_body text, sent_format int, apns_id text, sent_at text)"
    ),
    "sqlite": "SELECT "
    + ", ".join(f"json_extract(value, '$.{c}') AS {c}" for c in SETTLE_FIELDS)
    + " FROM json_each(:rows)",
}


_SETTLE = """
UPDATE notification_queue AS q SET status = 'settled', outcome = r.outcome, outcome_detail = r.outcome_detail,
    payload = r.payload, sent_body = r.sent_body, sent_format = r.sent_format, apns_id = r.apns_id, sent_at = r.sent_at,
    settled_at = :now, updated_at = :now
FROM ({rows}) AS r
WHERE q.id = r.id AND q.status = 'claimed' AND q.claimed_by = :claimer
"""


def settle(conn: Connection, settlements: Sequence[RowSettlement], claimer: str, now: Instant) -> int:
    """Settle claimed rows in one statement; only the claimer's own claims (a swept abandoned claim stays failed).

    Each settlement: ``id, outcome`` and optionally ``outcome_detail, payload, sent_body, sent_format,
    apns_id, sent_at`` (``payload``/``sent_body``/``sent_format`` as ``notification.record_of_send`` makes them).
    """
    if not settlements:
        return 0
    stmt = rows_text(_SETTLE.format(rows=_SETTLE_ROWS_SOURCE[conn.dialect.name]))
    payload = rows_json({c: s.get(c) for c in SETTLE_FIELDS} for s in settlements)
    return conn.execute(stmt, {"rows": payload, "claimer": claimer, "now": now}).rowcount


_RETURN_ROWS_SOURCE = {
    "postgresql": (
        "SELECT r.* FROM json_to_recordset(CAST(:rows AS json)) AS r(id bigint, outcome_detail text, hold text, held text, spent int)"
    ),
    "sqlite": (
        "SELECT "
        + ", ".join(f"json_extract(value, '$.{c}') AS {c}" for c in ("id", "outcome_detail", "hold", "held", "spent"))
        + " FROM json_each(:rows)"
    ),
}


_RETURN_TO_PENDING = """
UPDATE notification_queue AS q SET status = 'pending', attempts = q.attempts + r.spent, outcome_detail = r.outcome_detail,
    not_before = r.hold, held_until = COALESCE(r.held, q.held_until), claimed_by = NULL, claimed_at = NULL, updated_at = :now
FROM ({rows}) AS r
WHERE q.id = r.id AND q.status = 'claimed' AND q.claimed_by = :claimer
RETURNING send_after, not_before
"""


def return_to_pending(conn: Connection, rows: Sequence[ReturnedRow], claimer: str, now: Instant) -> int:
    """Give the claimer's claimed rows back to pending: none of them reached APNs. Wakes listening
    dispatchers.

    Each row: ``id``, ``outcome_detail`` (why, kept until the row settles), ``not_before`` (not due
    before it: a retry's backoff, a quiet-hours hold; None: due at once), ``held_until`` (a new
    quiet-hours hold, which lateness counts from; None keeps the row's hold, so a retry after a hold
    is still bounded from its end) and ``spent`` (True: a send was tried, one attempt more toward
    ``REMINDERS_SEND_MAX_ATTEMPTS``).
    """
    if not rows:
        return 0
    stmt = rows_text(
        _RETURN_TO_PENDING.format(rows=_RETURN_ROWS_SOURCE[conn.dialect.name]), send_after=IsoTime, not_before=IsoTime
    )
    payload = rows_json(
        {
            "id": r["id"],
            "outcome_detail": r.get("outcome_detail"),
            "hold": r.get("not_before"),
            "held": r.get("held_until"),
            "spent": int(bool(r.get("spent"))),
        }
        for r in rows
    )
    back = conn.execute(stmt, {"rows": payload, "claimer": claimer, "now": now}).all()
    if back:
        announce_pending(conn, min(max(sa, nb or sa) for sa, nb in back))
    return len(back)


def refund_attempts(conn: Connection, refunds: Mapping[int, int], now: Instant) -> int:
    """Give back the attempts these rows spent (row id -> how many) on a provider's answers that
    turned out to be its outage, and the backoff they set: an outage counts against nobody, and
    its halt paces the rows. A settled row stays as it is; a claim's policy holds a pending one
    for quiet hours again if they began meanwhile. One statement per distinct count (almost always one)."""
    given = 0
    for spent in sorted(set(refunds.values())):
        ids = sorted(i for i, n in refunds.items() if n == spent)
        given += conn.execute(
            update(q)
            .where(q.c.id.in_(ids), q.c.status != "settled", q.c.attempts > 0)
            .values(
                attempts=case((q.c.attempts > spent, q.c.attempts - spent), else_=0), not_before=None, updated_at=now
            )
        ).rowcount
    return given


def acknowledge(
    conn: Connection, device_id: str, item_id: str, event_between: tuple[Instant, Instant], now: Instant
) -> int:
    """Settle the item's pending reminders on this device whose event starts strictly between
    ``event_between`` ``acknowledged``; a claimed one is in flight and goes. Returns how many.
    A snooze of it voided while its item was away (``REVIVABLE_VOIDS``), which a build would bring
    back with the item, is acknowledged too (not counted): Done ends it as well. Locked in id order
    first, as a build and a drain lock the rows they write (``lock_rows``), so none of them
    deadlocks with another."""
    occurrence = (
        q.c.device_id == device_id,
        q.c.item_id == item_id,
        q.c.event_at > event_between[0],
        q.c.event_at < event_between[1],
    )
    pending = (*occurrence, q.c.status == PENDING)
    revivable = (
        *occurrence,
        q.c.snoozed_from.is_not(None),
        q.c.outcome == "voided",
        q.c.outcome_detail.in_(sorted(REVIVABLE_VOIDS)),
    )
    ids = list(conn.scalars(select(q.c.id).where(*pending).order_by(q.c.id)))
    voided = list(conn.scalars(select(q.c.id).where(*revivable).order_by(q.c.id)))
    lock_rows(conn, [*ids, *voided])
    done = {"outcome": "acknowledged", "outcome_detail": "done", "settled_at": now, "updated_at": now}
    if voided:
        conn.execute(update(q).where(q.c.id.in_(voided), *revivable).values(**done))
    if not ids:
        return 0
    stmt = update(q).where(q.c.id.in_(ids), *pending).values(status="settled", **done)
    return int(conn.execute(stmt).rowcount or 0)
