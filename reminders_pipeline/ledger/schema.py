"""The tables, defined once. The migrations create them; ``ledger`` is the only module that queries them.

Time columns are ``IsoTime``: text in the fixed ``YYYY-MM-DDTHH:MM:SS.mmmZ`` format, with
``COLLATE "C"`` on PostgreSQL so their order never depends on a locale, and a CHECK (``iso_check``,
added to every such column) that rejects any other shape: a ``datetime()`` value with a space
instead of ``T`` fails loudly instead of sorting wrong. The column type is the storage boundary of
time: it binds an ``Instant`` as its stored text and reads the text back as an ``Instant``.
"""

from __future__ import annotations

from typing import Any

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
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeEngine

from reminders_pipeline.domain.times import Instant

metadata = MetaData()


class IsoTime(TypeDecorator[Instant]):
    """A stored time: an ``Instant`` in Python, its ISO text (``Instant.stored``) in the database."""

    impl = Text
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(postgresql.TEXT(collation="C") if dialect.name == "postgresql" else Text())

    def process_bind_param(self, value: Instant | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        if not isinstance(value, Instant):
            raise TypeError(f"a stored time is bound as an Instant, not {type(value).__name__} {value!r}")
        return value.stored

    def process_result_value(self, value: str | None, dialect: Dialect) -> Instant | None:
        return None if value is None else Instant.from_stored(value)


# SQLite only auto-increments INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
RowId = BigInteger().with_variant(Integer(), "sqlite")
MAX_ROW_ID = 2**63 - 1  # BIGINT on PostgreSQL, INTEGER on SQLite: no larger id can exist

STATUSES = ("pending", "claimed", "settled")
OUTCOMES = (
    "sent", "failed", "voided", "disabled", "event_started", "event_expired", "too_late", "quiet_hours", "acknowledged",
)  # fmt: skip


def iso_check(column: str, nullable: bool = True) -> CheckConstraint:
    shape = f"(length({column}) = 24 AND substr({column}, 11, 1) = 'T' AND substr({column}, 24, 1) = 'Z')"
    expr = f"{column} IS NULL OR {shape}" if nullable else shape
    return CheckConstraint(expr, name=f"ck_{column}_iso")


def _partial_index(name: str, *columns: str, where: str) -> Index:
    """An index over the rows matching ``where``, on both databases."""
    return Index(name, *columns, sqlite_where=text(where), postgresql_where=text(where))


def _table(name: str, *parts: Any, **options: Any) -> Table:
    """A table of the ledger: every time column carries its shape CHECK (``iso_check``)."""
    table = Table(name, metadata, *parts, **options)
    for column in table.columns:
        if isinstance(column.type, IsoTime):
            table.append_constraint(iso_check(column.name, bool(column.nullable)))
    return table


devices = _table(
    "devices",
    Column("id", Text, primary_key=True),
    # Renamed from ``apns_token`` by 0021: the device's target at its provider (``provider``, below).
    Column("target", Text, nullable=False),
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
    # From 0012: what the last build planned from (``plan_key.plan_key``: the device's planning
    # columns and each source's content) and up to which ``send_after`` it planned. A build whose
    # key matches plans only what the horizon has moved over since (``build``, "unchanged").
    Column("planned_key", Text),
    Column("planned_until", IsoTime),
    # From 0013: the device's attendee addresses, space-separated (``items.address_of``); an
    # invitation one of them declined queues nothing.
    Column("attendees", Text, nullable=False, server_default=text("''")),
    # From 0014: the alert's language (BCP 47, ``de-DE``) and clock (``12h``/``24h``, NULL: the
    # locale's own), ``phrases``. NULL locale: English, 24 hours.
    Column("locale", Text),
    Column("clock", Text),
    # From 0018: who delivers: ``apns``, ``webpush`` or ``fcm``; ``target`` is that provider's
    # target (an APNs token, a Web Push subscription as ``webpush.canonical`` JSON, an FCM token).
    Column("provider", Text, nullable=False, server_default=text("'apns'")),
    CheckConstraint("reminder_lead_seconds >= 0", name="ck_lead_nonnegative"),
    Index("ix_devices_chunk_built", "chunk", "reminders_built_at"),
    Index("ix_devices_built", "reminders_built_at"),
)

sources = _table(
    "sources",
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
    # From 0012: the body last parsed and how (item cap, format: ``sources.content_hash``), so an
    # identical 200 reuses the parse as a 304 does.
    Column("content_hash", Text),
)

device_sources = _table(
    "device_sources",
    Column("device_id", Text, ForeignKey("devices.id", ondelete="CASCADE"), nullable=False),
    Column("source_id", RowId, ForeignKey("sources.id", ondelete="CASCADE"), nullable=False),
    # From 0015: the device's settings for this calendar (``calendar_settings.CalendarSettings``).
    Column("rules", Text),  # space-separated rules; NULL: the device's
    Column("interruption_level", Text),  # passive, active, time-sensitive; NULL: the deployment's
    Column("breakthrough", Integer, nullable=False, server_default=text("0")),
    Column("muted", Integer, nullable=False, server_default=text("0")),
    Column("travel_seconds", Integer),  # from 0016: a ``leave`` reminder this long before each timed item
    PrimaryKeyConstraint("device_id", "source_id"),
    Index("ix_device_sources_source", "source_id"),
)

# device_id is deliberately not a foreign key: removing a device voids its pending rows and keeps
# the ledger of what was sent.
notification_queue = _table(
    "notification_queue",
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
    # From 0015: how ``sent_body`` re-renders (``notification.SENT_FORMAT``): NULL, as sent before
    # 0015 (``thread-id`` per item); 2, ``thread-id`` per calendar.
    Column("sent_format", Integer),
    # From 0017: a ``snooze:N`` row's origin, the sent row the person snoozed (``actions``); NULL
    # for every row a build queues.
    Column("snoozed_from", RowId),
    UniqueConstraint("device_id", "item_id", "rule", name="uq_queue_device_item_rule"),
    CheckConstraint("status IN ('pending', 'claimed', 'settled')", name="ck_queue_status"),
    CheckConstraint(
        "outcome IS NULL OR outcome IN ('sent', 'failed', 'voided', 'disabled', "
        "'event_started', 'event_expired', 'too_late', 'quiet_hours', 'acknowledged')",
        name="ck_queue_outcome",
    ),
    CheckConstraint("(status = 'settled') = (outcome IS NOT NULL)", name="ck_queue_settled_has_outcome"),
    # The literal 'pending' (not a bound parameter) lets a generic plan use the partial index.
    _partial_index("ix_queue_due", "send_after", "id", where="status = 'pending'"),
    # Few rows carry a not-before: the dispatcher's wake-up finds the earliest without a scan.
    _partial_index("ix_queue_not_before", "not_before", where="status = 'pending' AND not_before IS NOT NULL"),
    _partial_index("ix_queue_claimed", "claimed_at", where="status = 'claimed'"),
    _partial_index("ix_queue_settled", "settled_at", where="status = 'settled'"),
    # One snooze per snoozed alert: a repeated Snooze request inserts nothing.
    Index(
        "uq_queue_snoozed_from",
        "snoozed_from",
        unique=True,
        sqlite_where=text("snoozed_from IS NOT NULL"),
        postgresql_where=text("snoozed_from IS NOT NULL"),
    ),
    # From 0019: an id is never given twice (an alert's action token names its row's id), where
    # SQLite would otherwise give the highest again once it is pruned.
    sqlite_autoincrement=True,
)


# One row per exact-time dispatcher (``reminders_pipeline.sending.dispatch``): its heartbeat, for /metrics
# and the dispatcher check. Rows of stopped dispatchers are kept a while for the record.
dispatchers = _table(
    "dispatchers",
    Column("name", Text, primary_key=True),
    Column("started_at", IsoTime, nullable=False),
    Column("beat_at", IsoTime, nullable=False),
    Column("ends_at", IsoTime),  # planned end (a Dagster run's bounded lifetime); NULL = until stopped
    Column("stopped_at", IsoTime),
    Column("sent", Integer, nullable=False, server_default=text("0")),
    Column("settled", Integer, nullable=False, server_default=text("0")),
    Index("ix_dispatchers_beat", "beat_at"),
)


# What a settled row recorded before the build re-armed it (its item moved by at least
# REMINDERS_REARM_THRESHOLD_SECONDS): the ledger keeps every send, not only the latest. Its columns
# are the queue row's, as the row had them when settled (so ``outcome`` and ``settled_at`` are set).
HISTORY_COLUMNS = (
    "device_id", "item_id", "rule", "send_after", "outcome", "outcome_detail", "payload", "apns_id", "sent_at",
    "settled_at",
)  # fmt: skip


def _as_settled(name: str) -> Column[Any]:
    column = notification_queue.c[name]
    return Column(name, column.type, nullable=bool(column.nullable) and name not in ("outcome", "settled_at"))


notification_history = _table(
    "notification_history",
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("queue_id", RowId, nullable=False),
    *(_as_settled(name) for name in HISTORY_COLUMNS),
    Column("rearmed_at", IsoTime, nullable=False),
    UniqueConstraint("queue_id", "settled_at", name="uq_history_queue_settled"),
    Index("ix_history_rearmed", "rearmed_at"),
)

# One row per drain scope (a Dagster run id, or a CLI/HTTP drain's claimer) halted by an APNs
# fault. Written once by the batch that met it; every batch and process of the scope reads it
# before each claim, so the halt holds across executors.
drain_halts = _table(
    "drain_halts",
    Column("scope", Text, primary_key=True),
    Column("reason", Text, nullable=False),
    Column("claimer", Text, nullable=False),
    Column("halted_at", IsoTime, nullable=False),
    Index("ix_drain_halts_halted", "halted_at"),
)


# The oldest release head that may run against this schema (one row): a newer release whose
# migrations since that head only added what the older code neither reads nor must write leaves
# it there, so an older release still running during a rolling upgrade, or rolled back to, keeps
# working instead of refusing the ledger (``migrate.schema_problem``).
schema_readers = _table(
    "schema_readers",
    Column("oldest_head", Text, primary_key=True),
)
