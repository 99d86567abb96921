"""Every SQL statement the project runs against the ledger, and nowhere else.

Shells (Dagster, HTTP, CLI) and the core's orchestration modules call these functions with a
connection from ``Database.write()``/``read()``; nothing outside this package writes SQL. No statement
computes a time: every stored time arrives as an ``Instant``, bound as its stored text by the time
columns' type (``schema.IsoTime``), and comes back as one.

One module per table or concern:

- ``devices``: registration, credentials, zones, dead tokens;
- ``sweep``: the build's selection of devices, its locks, stamps and plan keys, each chunk's staleness;
- ``sources``: subscriptions and each feed's last read;
- ``queue``: the build's upserts, re-arms with their history, a person's snooze;
- ``voids``: voiding pending rows whose item, token or calendar is gone;
- ``wakeups``: the NOTIFY and the earliest pending time that wake dispatchers;
- ``actions``: a person's Snooze and Done on a sent alert;
- ``claims``: due ids, the claim, settle, return to pending, abandoned claims;
- ``halts``: the drain halts of one provider in one scope;
- ``heartbeats``: exact-time dispatchers' heartbeats;
- ``reports``: reads for people and the bounded reads of /metrics;
- ``retention``: pruning settled rows and history.

Callers use the package (``ledger.claim(conn, ...)``); the modules are how it is read.
"""

from __future__ import annotations

from reminders_pipeline.ledger._common import CLAIMED, IN_LIST_MAX, PENDING, REVIVABLE_VOIDS, SETTLED
from reminders_pipeline.ledger.actions import acted_on, count_snoozes, held_as_read, item_as_read, snooze_of
from reminders_pipeline.ledger.claims import (
    SETTLE_FIELDS,
    acknowledge,
    claim,
    due_ids,
    fail_abandoned,
    lock_rows,
    refund_attempts,
    return_to_pending,
    settle,
)
from reminders_pipeline.ledger.devices import (
    DeviceRecord,
    count_devices_with_lead_below,
    delete_device,
    device_credential_hash,
    get_device,
    list_devices,
    mark_token_invalid,
    min_lead_seconds,
    providers_in_use,
    rules_in_use,
    set_device_credential,
    store_locale,
    store_tz_name,
    store_tz_offset,
    swap_device_credential,
    upsert_device,
)
from reminders_pipeline.ledger.halts import halt_key, halts_of, prune_halts, record_halt
from reminders_pipeline.ledger.heartbeats import (
    beat,
    dispatcher_stopped,
    latest_beat,
    live_dispatchers,
    prune_dispatchers,
)
from reminders_pipeline.ledger.queue import (
    REARM_BOUNDS,
    UPSERT_COLUMNS,
    end_holds,
    existing_rows,
    insert_snooze,
    realign_pending,
    rearm_anchor,
    rearm_bounds,
    upsert_rows,
)
from reminders_pipeline.ledger.reports import (
    COUNT_CAP,
    QUEUE_COLUMNS,
    QueueGauges,
    built_after,
    get_row,
    history_of,
    latest_settled,
    list_queue,
    oldest_due_pending,
    ping,
    queue_gauges,
)
from reminders_pipeline.ledger.retention import prune_history, prune_settled
from reminders_pipeline.ledger.sources import (
    calendar_settings,
    claim_source_alerts,
    list_sources,
    newer_parses,
    record_source_failure,
    record_source_success,
    set_subscriptions,
    sources_by_id,
    subscriptions,
)
from reminders_pipeline.ledger.sweep import (
    devices_per_chunk,
    lock_devices,
    never_built_chunks,
    oldest_built,
    plan_states,
    select_build_devices,
    set_chunks,
    stale_per_chunk,
    stalest_chunks,
    stamp_built,
)
from reminders_pipeline.ledger.voids import (
    unsubscribed_pending,
    void_pending_of_device,
    void_pending_of_urls,
    void_rows,
)
from reminders_pipeline.ledger.wakeups import DUE_CHANNEL, announce_pending, next_send_after

__all__ = [
    "REVIVABLE_VOIDS",
    "acknowledge",
    "acted_on",
    "count_snoozes",
    "held_as_read",
    "insert_snooze",
    "item_as_read",
    "snooze_of",
    "calendar_settings",
    "CLAIMED",
    "COUNT_CAP",
    "DUE_CHANNEL",
    "DeviceRecord",
    "IN_LIST_MAX",
    "PENDING",
    "QUEUE_COLUMNS",
    "QueueGauges",
    "REARM_BOUNDS",
    "SETTLED",
    "SETTLE_FIELDS",
    "UPSERT_COLUMNS",
    "announce_pending",
    "beat",
    "built_after",
    "claim",
    "claim_source_alerts",
    "count_devices_with_lead_below",
    "delete_device",
    "device_credential_hash",
    "devices_per_chunk",
    "dispatcher_stopped",
    "due_ids",
    "end_holds",
    "existing_rows",
    "fail_abandoned",
    "get_device",
    "get_row",
    "halt_key",
    "halts_of",
    "history_of",
    "latest_beat",
    "latest_settled",
    "list_devices",
    "list_queue",
    "list_sources",
    "live_dispatchers",
    "lock_devices",
    "lock_rows",
    "mark_token_invalid",
    "min_lead_seconds",
    "never_built_chunks",
    "next_send_after",
    "oldest_built",
    "plan_states",
    "providers_in_use",
    "oldest_due_pending",
    "ping",
    "prune_dispatchers",
    "prune_halts",
    "prune_history",
    "prune_settled",
    "queue_gauges",
    "realign_pending",
    "rearm_anchor",
    "rearm_bounds",
    "record_halt",
    "refund_attempts",
    "newer_parses",
    "record_source_failure",
    "record_source_success",
    "return_to_pending",
    "rules_in_use",
    "select_build_devices",
    "set_chunks",
    "set_device_credential",
    "set_subscriptions",
    "settle",
    "sources_by_id",
    "stale_per_chunk",
    "stalest_chunks",
    "stamp_built",
    "store_locale",
    "store_tz_name",
    "store_tz_offset",
    "subscriptions",
    "swap_device_credential",
    "upsert_device",
    "unsubscribed_pending",
    "upsert_rows",
    "void_pending_of_device",
    "void_pending_of_urls",
    "void_rows",
]
