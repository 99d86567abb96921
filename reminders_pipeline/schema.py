"""The tables, defined once. The migrations create them; ``ledger`` is the only module that queries them.

Time columns are ``IsoTime``: text in the fixed ``YYYY-MM-DDTHH:MM:SS.mmmZ`` format, with
``COLLATE "C"`` on PostgreSQL so their order never depends on a locale, and a CHECK that rejects any
other shape (a ``datetime()`` value with a space instead of ``T`` fails loudly instead of sorting
wrong).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import postgresql

metadata = MetaData()

IsoTime = Text().with_variant(postgresql.TEXT(collation="C"), "postgresql")
# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
RowId = BigInteger().with_variant(Integer(), "sqlite")
MAX_ROW_ID = 2**63 - 1  # BIGINT on PostgreSQL, INTEGER on SQLite: no larger id can exist

STATUSES = ("pending", "claimed", "settled")
OUTCOMES = ("sent", "failed", "voided", "disabled", "event_started", "event_expired", "too_late", "quiet_hours")


def iso_check(column: str, nullable: bool = True) -> CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    expr = f"{column} IS NULL OR {shape}" if nullable else shape
    return CheckConstraint(expr, name=f"ck_{column}_iso")


devices = Table(
    "devices",
    metadata,
    Column("id", Text, primary_key=True),
    Column("apns_token", Text, nullable=False),
    Column("reminder_lead_seconds", Integer, nullable=False, server_default=text("3600")),
    Column("extra_rules", Text, nullable=False, server_default=text("''")),  # space-separated rules
    Column("last_tz_offset_seconds", Integer),
    Column("reminders_built_at", IsoTime),
    Column("chunk", Integer, nullable=False),
    Column("token_invalid_at", IsoTime),  # set when APNs says the token is dead; builds skip it
    Column("token_invalid_reason", Text),
    Column("credential_hash", Text),  # sha256 of the device's own bearer credential; the secret is never stored
    Column("tz_name", Text),  # IANA zone (Europe/Berlin); beats last_tz_offset_seconds when set
    Column("all_day_rules", Text, nullable=False, server_default=text("'day:0@09:00'")),  # space-separated day rules
    Column("quiet_hours", Text),  # "22:00-07:00" in the device's zone, or NULL
    Column(
        "use_alarms", Integer, nullable=False, server_default=text("0")
    ),  # 1: a calendar's VALARMs are the item's rules
    Column("created_at", IsoTime, nullable=False),
    Column("updated_at", IsoTime, nullable=False),
    # From 0011: the last registration (``device put``); a dead-token answer older than it marks
    # nothing. NULL: registered before 0011, unknown.
    Column("registered_at", IsoTime),
    iso_check("reminders_built_at"),
    iso_check("token_invalid_at"),
    iso_check("created_at", False),
    iso_check("updated_at", False),
    iso_check("registered_at"),
    CheckConstraint("reminder_lead_seconds >= 0", name="ck_lead_nonnegative"),
    Index("ix_devices_chunk_built", "chunk", "reminders_built_at"),
    Index("ix_devices_built", "reminders_built_at"),
)

sources = Table(
    "sources",
    metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("url", Text, nullable=False, unique=True),
    Column("kind", Text, nullable=False, server_default=text("'json'")),
    Column("last_read_at", IsoTime),
    Column("last_success_at", IsoTime),
    Column("last_error_at", IsoTime),
    Column("last_error", Text),
    Column("consecutive_failures", Integer, nullable=False, server_default=text("0")),
    Column("last_item_count", Integer),
    Column("last_rejected_count", Integer),
    Column("created_at", IsoTime, nullable=False),
    # Conditional GET: validators and the parsed feed a 304 reuses without parsing.
    Column("etag", Text),
    Column("last_modified", Text),
    Column("feed_cache", Text),
    Column("cache_until", IsoTime),  # an iCalendar cache covers occurrences up to here only
    Column("failing_since", IsoTime),
    Column("alerted_at", IsoTime),
    iso_check("cache_until"),
    iso_check("failing_since"),
    iso_check("alerted_at"),
    iso_check("last_read_at"),
    iso_check("last_success_at"),
    iso_check("last_error_at"),
    iso_check("created_at", False),
)

device_sources = Table(
    "device_sources",
    metadata,
    Column("device_id", Text, ForeignKey("devices.id", ondelete="CASCADE"), nullable=False),
    Column("source_id", RowId, ForeignKey("sources.id", ondelete="CASCADE"), nullable=False),
    PrimaryKeyConstraint("device_id", "source_id"),
    Index("ix_device_sources_source", "source_id"),
)

# device_id is deliberately not a foreign key: removing a device voids its pending rows and keeps
# the ledger of what was sent.
notification_queue = Table(
    "notification_queue",
    metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("device_id", Text, nullable=False),
    Column("source_id", RowId),
    Column("item_id", Text, nullable=False),
    Column("rule", Text, nullable=False),
    Column("send_after", IsoTime, nullable=False),
    Column("event_at", IsoTime, nullable=False),
    Column("expires_at", IsoTime, nullable=False),
    Column("title", Text, nullable=False),
    Column("body", Text),
    Column("status", Text, nullable=False, server_default=text("'pending'")),
    Column("outcome", Text),
    Column("outcome_detail", Text),
    # What was sent (or would have been, in a dry run): the alert body as sent when the row
    # re-renders the rest exactly, else the whole payload's JSON (``notification.record_of_send``;
    # read back through ``notification.sent_payload``). Both NULL: nothing was composed.
    Column("payload", Text),
    Column("apns_id", Text),
    Column("claimed_by", Text),
    Column("claimed_at", IsoTime),
    Column("settled_at", IsoTime),
    Column("sent_at", IsoTime),
    Column("created_at", IsoTime, nullable=False),
    Column("updated_at", IsoTime, nullable=False),
    # Times this row went back to pending after a send that certainly never reached APNs.
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("sent_body", Text),  # from 0008, see payload
    # From 0009: a floating or all-day item's own time at this rule's anchor, as wall time (read as
    # UTC) before any zone; NULL for an item fixed in time. A re-arm needs the item to move, and a
    # zone change moves event_at without moving the item.
    Column("item_at", IsoTime),
    # A pending row is not due before this (a retry's backoff, a quiet-hours hold at send time);
    # ``send_after`` stays the rule's time. NULL: due at ``send_after``.
    Column("not_before", IsoTime),
    # From 0011: the end of a quiet-hours hold at send time, which lateness counts from
    # (``policy.lateness_base``). A retry's backoff leaves it; a change of the device's zone or
    # quiet hours, or a rewrite of the row, ends it. NULL: never held.
    Column("held_until", IsoTime),
    UniqueConstraint("device_id", "item_id", "rule", name="uq_queue_device_item_rule"),
    CheckConstraint("status IN ('pending', 'claimed', 'settled')", name="ck_queue_status"),
    CheckConstraint(
        "outcome IS NULL OR outcome IN ('sent', 'failed', 'voided', 'disabled', "
        "'event_started', 'event_expired', 'too_late', 'quiet_hours')",
        name="ck_queue_outcome",
    ),
    CheckConstraint("(status = 'settled') = (outcome IS NOT NULL)", name="ck_queue_settled_has_outcome"),
    iso_check("send_after", False),
    iso_check("event_at", False),
    iso_check("expires_at", False),
    iso_check("claimed_at"),
    iso_check("settled_at"),
    iso_check("sent_at"),
    iso_check("item_at"),
    iso_check("created_at", False),
    iso_check("updated_at", False),
    iso_check("not_before"),
    iso_check("held_until"),
    # The literal 'pending' (not a bound parameter) lets a generic plan use the partial index.
    Index(
        "ix_queue_due",
        "send_after",
        "id",
        sqlite_where=text("status = 'pending'"),
        postgresql_where=text("status = 'pending'"),
    ),
    # Few rows carry a not-before: the dispatcher's wake-up finds the earliest without a scan.
    Index(
        "ix_queue_not_before",
        "not_before",
        sqlite_where=text("status = 'pending' AND not_before IS NOT NULL"),
        postgresql_where=text("status = 'pending' AND not_before IS NOT NULL"),
    ),
    Index(
        "ix_queue_claimed",
        "claimed_at",
        sqlite_where=text("status = 'claimed'"),
        postgresql_where=text("status = 'claimed'"),
    ),
    Index(
        "ix_queue_settled",
        "settled_at",
        sqlite_where=text("status = 'settled'"),
        postgresql_where=text("status = 'settled'"),
    ),
)


# One row per exact-time dispatcher (``reminders_pipeline.dispatch``): its heartbeat, for /metrics
# and the dispatcher check. Rows of stopped dispatchers are kept a while for the record.
dispatchers = Table(
    "dispatchers",
    metadata,
    Column("name", Text, primary_key=True),
    Column("started_at", IsoTime, nullable=False),
    Column("beat_at", IsoTime, nullable=False),
    Column("ends_at", IsoTime),  # planned end (a Dagster run's bounded lifetime); NULL = until stopped
    Column("stopped_at", IsoTime),
    Column("sent", Integer, nullable=False, server_default=text("0")),
    Column("settled", Integer, nullable=False, server_default=text("0")),
    iso_check("started_at", False),
    iso_check("beat_at", False),
    iso_check("ends_at"),
    iso_check("stopped_at"),
    Index("ix_dispatchers_beat", "beat_at"),
)


# What a settled row recorded before the build re-armed it (its item moved by at least
# REMINDERS_REARM_THRESHOLD_SECONDS): the ledger keeps every send, not only the latest.
notification_history = Table(
    "notification_history",
    metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("queue_id", RowId, nullable=False),
    Column("device_id", Text, nullable=False),
    Column("item_id", Text, nullable=False),
    Column("rule", Text, nullable=False),
    Column("send_after", IsoTime, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("outcome_detail", Text),
    Column("payload", Text),
    Column("apns_id", Text),
    Column("sent_at", IsoTime),
    Column("settled_at", IsoTime, nullable=False),
    Column("rearmed_at", IsoTime, nullable=False),
    UniqueConstraint("queue_id", "settled_at", name="uq_history_queue_settled"),
    iso_check("send_after", False),
    iso_check("sent_at"),
    iso_check("settled_at", False),
    iso_check("rearmed_at", False),
    Index("ix_history_rearmed", "rearmed_at"),
)

# One row per drain scope (a Dagster run id, or a CLI/HTTP drain's claimer) halted by an APNs
# fault. Written once by the batch that met it; every batch and process of the scope reads it
# before each claim, so the halt holds across executors.
drain_halts = Table(
    "drain_halts",
    metadata,
    Column("scope", Text, primary_key=True),
    Column("reason", Text, nullable=False),
    Column("claimer", Text, nullable=False),
    Column("halted_at", IsoTime, nullable=False),
    iso_check("halted_at", False),
    Index("ix_drain_halts_halted", "halted_at"),
)
