"""The shapes queue rows travel in between the ledger, the plan and the drain.

A row is a dict keyed by the ledger's column names, so SQL results pass through unchanged; these
TypedDicts name its keys and their types, so a misspelt key or a wrong type is a type error
rather than a ``KeyError`` in a send, and a reader sees what a claimed row carries without
opening the claim's statement.
"""

from __future__ import annotations

from typing import Required, TypedDict

from reminders_pipeline.domain.times import Instant


class PlannedRow(TypedDict):
    """A row the plan wants for one item occurrence and rule (``planning.plan``): what the build
    upserts. ``item_at``: a floating item's own wall time at the rule's anchor, else None."""

    device_id: str
    source_id: int | None
    item_id: str
    rule: str
    send_after: Instant
    event_at: Instant
    expires_at: Instant
    title: str
    body: str | None
    item_at: Instant | None


class QueueRow(PlannedRow):
    """Every column of a ``notification_queue`` row (``ledger.schema``)."""

    id: int
    status: str
    outcome: str | None
    outcome_detail: str | None
    payload: str | None
    apns_id: str | None
    claimed_by: str | None
    claimed_at: Instant | None
    settled_at: Instant | None
    sent_at: Instant | None
    created_at: Instant
    updated_at: Instant
    attempts: int
    sent_body: str | None
    not_before: Instant | None
    held_until: Instant | None
    sent_format: int | None
    snoozed_from: int | None


class ClaimedRow(QueueRow):
    """A row the claim returned, with what the send needs of its device and its calendar
    subscription, read in the claim's own transaction (``ledger.claims.claim``). A device or
    subscription gone since the build leaves its columns None (``subscribed`` then false)."""

    target: str
    provider: str
    last_tz_offset_seconds: int | None
    token_invalid_at: Instant | None
    tz_name: str | None
    quiet_hours: str | None
    locale: str | None
    clock: str | None
    credential_hash: str | None
    interruption_level: str | None
    calendar_breakthrough: int | None
    calendar_muted: int | None
    subscribed: int | None  # a bool on PostgreSQL, 0 or 1 on SQLite


class SendRecord(TypedDict):
    """What a row's settlement records of the alert composed for it
    (``notification.record_of_send``)."""

    payload: str | None
    sent_body: str | None
    sent_format: int | None


class RowSettlement(TypedDict, total=False):
    """What one claimed row came to, as ``ledger.claims.settle`` writes it. ``payload``,
    ``sent_body`` and ``sent_format`` are the record of what was composed
    (``notification.record_of_send``); ``apns_id`` the provider's message id."""

    id: Required[int]
    outcome: Required[str]
    outcome_detail: str | None
    payload: str | None
    sent_body: str | None
    sent_format: int | None
    apns_id: str | None
    sent_at: Instant | None


class ReturnedRow(TypedDict, total=False):
    """A claimed row given back to pending (``ledger.claims.return_to_pending``): why, not due
    before ``not_before``, a quiet-hours hold's end (``held_until``), and whether a send was tried
    (``spent``, one attempt more)."""

    id: Required[int]
    outcome_detail: str | None
    not_before: Instant | None
    held_until: Instant | None
    spent: bool
