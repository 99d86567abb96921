"""The one module that reads the environment.

Everything else receives a ``Settings`` value, so tests and shells can build one explicitly. Each
setting is declared once below, with its type, default, minimum and meaning; ``from_env`` reads the
``REMINDERS_*`` variables into it and ``settings_table`` writes the table in docs/operations.md.

Every one of the ~60 settings is declared here with its help text, the operator's only reference,
so the table and the model stay one list; how a variable's text is read is ``setting_types``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from reminders_pipeline.config.cadence import cron_cadence_seconds
from reminders_pipeline.config.renamed import with_renamed
from reminders_pipeline.config.setting_types import (
    Contact,
    Cron,
    DatabaseUrl,
    ExactlyTrue,
    Flag,
    Networks,
    Number,
    Seconds,
    Whole,
    WholeSeconds,
    refused,
)

DEFAULT_DATABASE_PATH = Path("var") / "reminders.sqlite3"
ENV_PREFIX = "REMINDERS_"

# What ``reminders dev``, the demo, the tests and the benchmarks allow: their feeds are on this host.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


class SettingsError(ValueError):
    """A configuration value that cannot be used; the message is one line naming the variable."""


def default_database_url() -> str:
    return f"sqlite:///{DEFAULT_DATABASE_PATH}"


class Settings(BaseSettings):
    """Every setting, frozen: derive a variant with ``with_``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, env_ignore_empty=True, frozen=True, extra="forbid"
    )

    database_url: DatabaseUrl = Field(
        default_factory=default_database_url,
        description="the ledger, relative to the working folder by default; `postgresql://` and `postgres://` "
        "mean psycopg 3",
    )
    enabled: ExactlyTrue = Field(
        False,
        description="exactly `true` sends through APNs; anything else is a dry run, rows settle `disabled` with "
        "the payload that would have gone",
    )
    token: str | None = Field(
        None, description="bearer for the internal and management HTTP routes; unset, they answer 401"
    )
    token_previous: str | None = Field(
        None,
        description="the internal token being rotated out, still accepted (only while `REMINDERS_TOKEN` is set)",
    )
    http_accept_now: ExactlyTrue = Field(
        False, description="exactly `true`: HTTP routes accept a pretend `now`. Tests only"
    )
    max_lateness_seconds: Whole = Field(
        1800,
        ge=1,
        description="a due row older than this settles `too_late`; also the drain run's `max_runtime`",
    )
    build_cron: Cron = Field("0,15,30,45 * * * *", description="build schedule, UTC; only minute and hour may vary")
    drain_cron: Cron = Field(
        "5,20,35,50 * * * *",
        description="drain schedule, UTC; the check schedule runs 5 minutes after each tick",
    )
    scheduler_slack_seconds: Whole = Field(
        300, ge=0, description="how late a tick may fire; `reminders check` adds it to the drain cadence"
    )
    chunk_count: Whole = Field(
        16,
        ge=1,
        description="device chunks, the Dagster partitions; run `reminders device rechunk` after changing it",
    )
    chunk_size: Whole = Field(1000, ge=1, description="most devices one chunk build visits per run, stalest first")
    chunks_per_tick: Whole = Field(
        0,
        ge=0,
        description="chunks each build tick requests, stalest first; 0 = all; at most the chunk count",
    )
    build_chunks_per_run: Whole = Field(
        0,
        ge=0,
        description="cut each build tick into runs of this many chunks (1 for per-chunk pods); 0 = one run per tick",
    )
    sweep_margin_seconds: Whole = Field(600, ge=0, description="the margin in `sweep period < min lead − margin`")
    horizon_seconds: Whole = Field(86400, ge=1, description="only rows whose `send_after` lies within this are queued")
    default_lead_seconds: Whole = Field(
        3600,
        ge=0,
        description="lead of `reminders device put` without `--lead`; the lead the checks assume when no device exists",
    )
    rearm_threshold_seconds: Whole = Field(
        300,
        ge=1,
        description="a settled row is queued again only when its item moves at least this far (its start, or its "
        "end for an `@expiry` rule; a floating or all-day item's own wall time too): never for a quiet-hours or "
        "zone change",
    )
    abandon_after_seconds: Whole = Field(600, ge=1, description="a claim older than this is failed as `abandoned`")
    send_timeout_seconds: Whole = Field(
        10,
        ge=1,
        description="response timeout per notification; Web Push and FCM give it twice: to get the request written "
        "(connect, TLS, a wait for a connection or for the push service's slot), then from the write for the answer",
    )
    fence_margin_seconds: Whole = Field(
        60,
        ge=1,
        description="a claim sends only until abandon-after − send timeout − this after it was taken (the "
        "claim's fence, below); abandon-after must exceed send timeout + this or settings refuse to load",
    )
    send_max_attempts: Whole = Field(
        3,
        ge=1,
        description="sends of one row APNs answered 429/500/503 before it settles `failed` (a send that never "
        "reached APNs spends none)",
    )
    send_halt_after: Whole = Field(
        20,
        ge=1,
        description="that many sends of one provider in a row certainly not delivered (429 excepted: one target's "
        "throttle), or two or more over 10 s, across batches, halt that provider's rows and alert (`apns_unreachable`, `webpush_unreachable`, `fcm_unreachable`)",
    )
    send_retry_base_seconds: Seconds = Field(
        5.0,
        ge=0.0,
        description="a row given back after such a send waits this long, doubled per attempt, jittered down to "
        "half (its `not_before`)",
    )
    send_retry_max_seconds: Seconds = Field(300.0, ge=0.0, description="the longest such wait")
    claim_batch_size: Whole = Field(
        100, ge=1, description="rows claimed in one compare-and-swap, right before they are sent"
    )
    drain_batch_size: Whole = Field(500, ge=1, description="rows per send step of a Dagster drain run")
    drain_max_batches: Whole = Field(40, ge=1, description="most send steps one Dagster drain run makes")
    source_timeout_seconds: WholeSeconds = Field(
        10.0, ge=1, description="connect and read timeout of a source read, in whole seconds"
    )
    source_max_bytes: Whole = Field(
        5_000_000,
        ge=1,
        description="largest source body read, counted after decoding at every `Content-Encoding` layer (gzip or "
        "deflate, at most two stacked, else `unsupported_encoding`; deflate with or without its zlib header, and "
        "bytes after the last gzip member that start no other ignored, as httpx reads them); larger fails "
        "`too_large`",
    )
    source_concurrency: Whole = Field(32, ge=1, description="source reads in flight per build")
    source_per_host: Whole = Field(8, ge=1, description="source reads in flight per host")
    source_max_items: Whole = Field(
        2000,
        ge=1,
        description="future items kept per source per read, soonest first whatever the feed's order (items "
        "already over do not count); the rest counted `over_item_cap` and queue nothing new; their pending rows "
        "are not voided but follow the item's moves and the device's zone; once a kept item may be over, the "
        "source is read in full again (no 304 reuse of a cut); a row of an item in no part of the feed is voided "
        "`left_feed` all the same. Cancelled calendar events are not items and take no place",
    )
    source_parse_seconds: Seconds = Field(
        10.0,
        ge=0.1,
        description="a source whose parsing takes longer fails `parse_timeout` (checked at every calendar occurrence)",
    )
    source_series_seconds: Seconds = Field(
        1.0,
        ge=0.01,
        description="CPU one recurring calendar series may take per read; past it, or recurring more than once "
        "a minute (`FREQ=SECONDLY`), the series is dropped and counted `runaway_series`, the calendar's other "
        "events kept. A series that cannot be expanded (a year-9999 date) is dropped alone, counted "
        "`bad_recurrence`. A dropped series' pending rows are left alone, not voided. A series' cost does not "
        "grow with its age (a rule of fixed period is walked from just before the read window), and a rule that "
        "can never match (30 February) costs nothing",
    )
    feed_cache_seconds: Whole = Field(
        900,
        ge=1,
        description="the widget feed (`GET /v1/devices/{id}/feed`) serves a source's last read (a build's or its "
        "own, failures included) while it is this recent, so requests cannot multiply reads of a source; keep it "
        "near the build cadence",
    )
    source_alert_after_seconds: Whole = Field(
        3600, ge=1, description="alert once when a source has failed every read for this long"
    )
    source_allow_networks: Networks = Field(
        (),
        description="comma-separated CIDR networks sources may reach besides globally routable addresses "
        "(Python's `is_global`; multicast, reserved and IPv6 site-local `fec0::/10` are refused too, and an "
        "address embedding IPv4 — mapped, 6to4, NAT64 — is judged by that IPv4 address)",
    )
    alert_webhook_url: str | None = Field(
        None,
        description='Slack-compatible webhook every alert is POSTed to (`{"text": …}`); alerts are logged at '
        "ERROR either way",
    )
    dagster_executor: Literal["in_process", "multiprocess", "celery", "k8s_job"] = Field(
        "in_process", description="where Dagster job steps run"
    )
    retention_seconds: Whole = Field(
        7 * 86400,
        ge=3600,
        description="`reminders prune` deletes rows settled longer ago than this (7 days by default) whose event "
        "has ended",
    )
    prune_batch_size: Whole = Field(5000, ge=1, description="rows per prune transaction")
    apns_key_file: str | None = Field(None, description="the `.p8` token-auth key (EC P-256); required when enabled")
    apns_key_id: str | None = Field(None, description="its key id; required when enabled")
    apns_team_id: str | None = Field(None, description="the Apple team id; required when enabled")
    apns_topic: str | None = Field(None, description="the app's bundle id; required when enabled")
    apns_environment: Literal["production", "sandbox"] = Field(
        "production", description="must match where the device tokens come from"
    )
    apns_url: str | None = Field(
        None, description="`https://host:port` of another APNs endpoint (a proxy, a local mock)"
    )
    apns_ca_file: str | None = Field(None, description="the CA bundle that signs `REMINDERS_APNS_URL`'s certificate")
    apns_concurrency: Whole = Field(200, ge=1, description="sends in flight per drain process")
    vapid_private_key_file: str | None = Field(
        None,
        description="the VAPID key (EC P-256 PEM, `reminders vapid generate`) Web Push requests are signed with; "
        "required to send to a Web Push device",
    )
    vapid_subject: Contact | None = Field(
        None,
        description="the VAPID `sub`: a `mailto:` address or an `https://` URL (a path allowed), a contact a push "
        "service may reach",
    )
    webpush_allow_networks: Networks = Field(
        (), description="CIDR networks a Web Push endpoint may reach besides globally routable addresses (as sources)"
    )
    webpush_ca_file: str | None = Field(None, description="a CA bundle for Web Push endpoints (a local mock)")
    webpush_per_host: Whole = Field(50, ge=1, description="Web Push requests in flight per push service host")
    webpush_concurrency: Whole = Field(200, ge=1, description="Web Push connections open at most per drain process")
    fcm_credentials_file: str | None = Field(
        None,
        description="a Google service-account key (JSON) for FCM HTTP v1; its `project_id` names the project; "
        "required to send to an FCM device",
    )
    fcm_url: str = Field(
        "https://fcm.googleapis.com", description="`https://host:port` of FCM (another endpoint: a proxy, a local mock)"
    )
    fcm_ca_file: str | None = Field(
        None, description="a CA bundle for `REMINDERS_FCM_URL` and the key's token endpoint (a local mock)"
    )
    fcm_concurrency: Whole = Field(200, ge=1, description="FCM requests in flight per drain process")
    interruption_level: Literal["passive", "active", "time-sensitive", "critical"] = Field(
        "time-sensitive", description="the notifications' `interruption-level`"
    )
    dispatch_enabled: Flag = Field(
        True,
        description="`true` or `false` (any case); `false`: no exact-time dispatcher, rows wait for drain ticks",
    )
    dispatch_poll_seconds: Seconds = Field(
        2.0,
        ge=0.05,
        description="the dispatcher re-reads the earliest `send_after` at least this often (on SQLite its only "
        "wake-up)",
    )
    dispatch_run_seconds: Whole = Field(3600, ge=60, description="lifetime of one Dagster `dispatcher` run")
    dispatch_handover_seconds: Whole = Field(
        120,
        ge=10,
        description="its successor is requested this long before its end; must be shorter than the run",
    )
    dispatch_late_seconds: Whole = Field(
        10, ge=1, description="a due row waiting longer past `send_after` fails `dispatch_on_time`"
    )
    dispatch_heartbeat_seconds: Whole = Field(15, ge=1, description="how often a dispatcher records its heartbeat")
    db_pool_size: Whole = Field(
        10, ge=1, description="connections each process keeps (as many again may open under load)"
    )
    db_statement_timeout_ms: Whole = Field(
        60_000, ge=0, description="PostgreSQL `statement_timeout`; 0 = none; SQLite ignores it"
    )
    metrics_window_seconds: Whole = Field(
        900, ge=60, description="`/metrics` counts rows settled this long ago or since"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments only: a Settings built in code never picks up the process's environment."""
        return (init_settings,)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        """Relations between settings that no single minimum expresses."""
        if self.dispatch_handover_seconds >= self.dispatch_run_seconds:
            raise refused("REMINDERS_DISPATCH_HANDOVER_SECONDS must be shorter than REMINDERS_DISPATCH_RUN_SECONDS")
        if self.abandon_after_seconds <= self.send_timeout_seconds + self.fence_margin_seconds:
            raise refused(
                "REMINDERS_ABANDON_AFTER_SECONDS must exceed REMINDERS_SEND_TIMEOUT_SECONDS + "
                "REMINDERS_FENCE_MARGIN_SECONDS: a claim may send only until that much before another drain may "
                "fail it as abandoned"
            )
        if self.chunks_per_tick > self.chunk_count:
            raise refused("REMINDERS_CHUNKS_PER_TICK must not exceed REMINDERS_CHUNK_COUNT")
        return self

    @property
    def build_cadence_seconds(self) -> int:
        return cron_cadence_seconds(self.build_cron)

    @property
    def drain_cadence_seconds(self) -> int:
        return cron_cadence_seconds(self.drain_cron)

    @property
    def effective_chunks_per_tick(self) -> int:
        return self.chunks_per_tick or self.chunk_count

    def with_(self, **changes: Any) -> Settings:
        """A copy with ``changes``, unchecked like ``dataclasses.replace``: tests shrink bounds freely."""
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise TypeError(f"not a setting: {', '.join(unknown)}")
        return self.model_copy(update=changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The settings ``env`` (default ``os.environ``) gives; unset or empty variables keep their default."""
        env = with_renamed(os.environ if env is None else env)
        # Names count only in capitals, as the docs write them; an empty variable is unset.
        values = {
            field: env[name] for field in cls.model_fields if (name := env_name(field)) in env and env[name] != ""
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(_one_line(exc.errors()[0])) from None


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _one_line(error: ErrorDetails) -> str:
    """The first refusal as the line the CLI and the servers exit with."""
    if not error["loc"]:
        return str(error["ctx"]["text"]) if error["type"] == "setting" else error["msg"]
    field = str(error["loc"][0])
    name, ctx = env_name(field), error.get("ctx", {})
    if error["type"] == "setting":
        return f"{name}{ctx['text']}"
    if error["type"] == "greater_than_equal":
        return f"{name} must be at least {ctx['ge']}, got {_parsed(field, error['input'])}"
    if error["type"] == "literal_error":
        return f"{name} must be {ctx['expected']}"
    return f"{name}: {error['msg']}"


def _parsed(field: str, value: object) -> object:
    """The value a refused number was read as (``" 0"`` was 0), as the message shows it."""
    for rule in Settings.model_fields[field].metadata:
        if isinstance(rule, BeforeValidator) and isinstance(rule.func, Number) and isinstance(value, str):
            return rule.func.kind(value)
    return value
