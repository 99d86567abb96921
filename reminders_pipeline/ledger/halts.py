"""The halts that stop one provider's rows in every drain of a scope (a Dagster run id, or a CLI
or HTTP drain's claimer): written once by the batch that met the fault, read by every claim."""

from __future__ import annotations

from sqlalchemy import Connection, delete, select

from reminders_pipeline.domain.times import Instant
from reminders_pipeline.ledger._common import insert_on_conflict
from reminders_pipeline.ledger.schema import drain_halts


def halt_key(scope: str, provider: str) -> str:
    """The ``drain_halts`` key of one provider halted in one drain scope."""
    return f"{scope}{HALT_SEPARATOR}{provider}"


HALT_SEPARATOR = "/"


def record_halt(conn: Connection, scope: str, provider: str, reason: str, claimer: str, now: Instant) -> None:
    """Halt ``provider``'s rows in every drain of ``scope`` (written once: the first fault found
    is the one kept)."""
    ins = insert_on_conflict(conn)(drain_halts).values(
        scope=halt_key(scope, provider), reason=reason, claimer=claimer, halted_at=now
    )
    conn.execute(ins.on_conflict_do_nothing(index_elements=[drain_halts.c.scope]))


def halts_of(conn: Connection, scope: str) -> dict[str, str]:
    """Which providers drains of ``scope`` halted, and why: one read of the primary key's range."""
    prefix = scope + HALT_SEPARATOR
    found = conn.execute(
        select(drain_halts.c.scope, drain_halts.c.reason).where(drain_halts.c.scope.startswith(prefix, autoescape=True))
    )
    return {key[len(prefix) :]: reason for key, reason in found}


def prune_halts(conn: Connection, before: Instant) -> int:
    return conn.execute(delete(drain_halts).where(drain_halts.c.halted_at < before)).rowcount
