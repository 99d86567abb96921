"""The one module that reads the environment.

Everything else receives a ``Settings`` value, so tests and shells can build one explicitly.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .cadence import CronError, cron_cadence_seconds

DEFAULT_DATABASE_PATH = Path("var") / "reminders.sqlite3"


class SettingsError(ValueError):
    """A configuration value that cannot be used; the message names the variable."""


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    return _number(env, name, default, minimum, int, "a whole number")


def _float(env: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    return _number(env, name, default, minimum, float, "a number of seconds")


def _number(
    env: Mapping[str, str], name: str, default: Any, minimum: Any, kind: Callable[[str], Any], what: str
) -> Any:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise SettingsError(f"{name} must be {what}, got {raw!r}") from None
    if not value >= minimum:  # also refuses nan
        raise SettingsError(f"{name} must be at least {minimum}, got {value}")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw not in ("true", "false"):
        raise SettingsError(f"{name} must be 'true' or 'false', got {env.get(name)!r}")
    return raw == "true"


def _networks(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated CIDR list, each checked here so a typo stops the process at start."""
    texts = tuple(t.strip() for t in (env.get(name) or "").split(",") if t.strip())
    for text in texts:
        try:
            ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise SettingsError(f"{name}: not a network in CIDR notation: {text!r}") from None
    return texts


# What ``reminders dev``, the demo, the tests and the benchmarks allow: their feeds are on this host.
LOOPBACK_NETWORKS = ("127.0.0.0/8", "::1/128")


def default_database_url() -> str:
    return f"sqlite:///{DEFAULT_DATABASE_PATH}"


def normalize_database_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3 here."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


@dataclass(frozen=True)
class Settings:
    database_url: str = field(default_factory=default_database_url)
    enabled: bool = False
    token: str | None = None
    max_lateness_seconds: int = 1800
    build_cron: str = "0,15,30,45 * * * *"
    drain_cron: str = "5,20,35,50 * * * *"
    scheduler_slack_seconds: int = 300
    chunk_count: int = 16
    chunk_size: int = 1000
    chunks_per_tick: int = 0  # 0 = all chunks every tick
    sweep_margin_seconds: int = 600
    horizon_seconds: int = 86400
    abandon_after_seconds: int = 600
    send_timeout_seconds: int = 10
    # A claim sends only until abandon_after - send_timeout - this (clock skew, settling): drain.fence_deadline.
    fence_margin_seconds: int = 60
    drain_batch_size: int = 500
    drain_max_batches: int = 40
    claim_batch_size: int = 100
    source_timeout_seconds: float = 10.0
    source_max_bytes: int = 5_000_000
    source_concurrency: int = 32
    source_per_host: int = 8
    source_alert_after_seconds: int = 3600
    default_lead_seconds: int = 3600
    alert_webhook_url: str | None = None
    dagster_executor: str = "in_process"  # in_process | multiprocess | celery | k8s_job (deploy/)
    build_chunks_per_run: int = 0  # 0 = each build tick is one run; 1 = one run per chunk (K8s pods)
    retention_seconds: int = 7 * 86400
    prune_batch_size: int = 5000
    apns_key_file: str | None = None
    apns_key_id: str | None = None
    apns_team_id: str | None = None
    apns_topic: str | None = None
    apns_environment: str = "production"  # or "sandbox"
    apns_url: str | None = None  # https://host:port: a proxy or a local mock instead of Apple
    apns_ca_file: str | None = None  # CA bundle that signs apns_url's certificate
    apns_concurrency: int = 200  # in-flight sends per drain process
    interruption_level: str = "time-sensitive"
    # The exact-time dispatcher (dispatch.py); the cron drain stays as the safety net.
    dispatch_enabled: bool = True
    dispatch_poll_seconds: float = 2.0  # backstop re-read of the earliest send_after (SQLite: the only wake-up)
    dispatch_run_seconds: int = 3600  # lifetime of one Dagster dispatcher run; the sensor hands over
    dispatch_handover_seconds: int = 120  # the successor run is requested this long before the end
    dispatch_late_seconds: int = 10  # a due row waiting longer fails the dispatch_on_time check
    dispatch_heartbeat_seconds: int = 15
    # Internal networks sources may be read from (CIDR); empty: only public addresses (egress.py).
    source_allow_networks: tuple[str, ...] = ()
    token_previous: str | None = None  # the internal token being rotated out: still accepted
    http_accept_now: bool = False  # testing only: the HTTP routes honour a pretend ``now``
    send_max_attempts: int = 3  # sends of one row that certainly never reached APNs, before it fails
    apns_halt_after: int = 20  # consecutive certain non-deliveries that halt a drain (an outage)
    # A row that certainly was not delivered waits base * 2**(attempt-1) seconds, jittered down to
    # half, at most the cap, as its not_before (Apple asks for exponential backoff on 429/500/503).
    send_retry_base_seconds: float = 5.0
    send_retry_max_seconds: float = 300.0
    rearm_threshold_seconds: int = 300  # a settled row is re-armed only if its item moves this far
    # Operations: the per-process engine and what /metrics reads.
    db_pool_size: int = 10  # connections kept per process; as many again may open under load
    db_statement_timeout_ms: int = 60_000  # PostgreSQL statement_timeout; 0 = none
    metrics_window_seconds: int = 900  # /metrics counts rows settled this long ago or since
    # Calendars as people keep them: per source per build, items kept and parse time.
    source_max_items: int = 2000
    source_parse_seconds: float = 10.0
    feed_cache_seconds: int = 900  # the widget feed serves a source's last read this long (the build cadence)
    source_series_seconds: float = 1.0  # CPU one calendar series may take per read before it is dropped

    @property
    def build_cadence_seconds(self) -> int:
        return cron_cadence_seconds(self.build_cron)

    @property
    def drain_cadence_seconds(self) -> int:
        return cron_cadence_seconds(self.drain_cron)

    @property
    def effective_chunks_per_tick(self) -> int:
        return self.chunks_per_tick or self.chunk_count

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        s = cls(
            database_url=normalize_database_url(env.get("REMINDERS_DATABASE_URL") or default_database_url()),
            # Exactly "true" sends; anything else is a dry run.
            enabled=env.get("REMINDERS_ENABLED") == "true",
            token=env.get("REMINDERS_TOKEN") or None,
            max_lateness_seconds=_int(env, "REMINDERS_MAX_LATENESS_SECONDS", 1800, 1),
            build_cron=env.get("REMINDERS_BUILD_CRON") or cls.build_cron,
            drain_cron=env.get("REMINDERS_DRAIN_CRON") or cls.drain_cron,
            scheduler_slack_seconds=_int(env, "REMINDERS_SCHEDULER_SLACK_SECONDS", 300),
            chunk_count=_int(env, "REMINDERS_CHUNK_COUNT", 16, 1),
            chunk_size=_int(env, "REMINDERS_CHUNK_SIZE", 1000, 1),
            chunks_per_tick=_int(env, "REMINDERS_CHUNKS_PER_TICK", 0),
            sweep_margin_seconds=_int(env, "REMINDERS_SWEEP_MARGIN_SECONDS", 600),
            horizon_seconds=_int(env, "REMINDERS_HORIZON_SECONDS", 86400, 1),
            abandon_after_seconds=_int(env, "REMINDERS_ABANDON_AFTER_SECONDS", 600, 1),
            send_timeout_seconds=_int(env, "REMINDERS_SEND_TIMEOUT_SECONDS", 10, 1),
            fence_margin_seconds=_int(env, "REMINDERS_FENCE_MARGIN_SECONDS", 60, 1),
            drain_batch_size=_int(env, "REMINDERS_DRAIN_BATCH_SIZE", 500, 1),
            drain_max_batches=_int(env, "REMINDERS_DRAIN_MAX_BATCHES", 40, 1),
            claim_batch_size=_int(env, "REMINDERS_CLAIM_BATCH_SIZE", 100, 1),
            source_timeout_seconds=float(_int(env, "REMINDERS_SOURCE_TIMEOUT_SECONDS", 10, 1)),
            source_max_bytes=_int(env, "REMINDERS_SOURCE_MAX_BYTES", 5_000_000, 1),
            source_concurrency=_int(env, "REMINDERS_SOURCE_CONCURRENCY", 32, 1),
            source_per_host=_int(env, "REMINDERS_SOURCE_PER_HOST", 8, 1),
            source_alert_after_seconds=_int(env, "REMINDERS_SOURCE_ALERT_AFTER_SECONDS", 3600, 1),
            default_lead_seconds=_int(env, "REMINDERS_DEFAULT_LEAD_SECONDS", 3600),
            alert_webhook_url=env.get("REMINDERS_ALERT_WEBHOOK_URL") or None,
            dagster_executor=env.get("REMINDERS_DAGSTER_EXECUTOR") or "in_process",
            build_chunks_per_run=_int(env, "REMINDERS_BUILD_CHUNKS_PER_RUN", 0),
            retention_seconds=_int(env, "REMINDERS_RETENTION_SECONDS", 7 * 86400, 3600),
            prune_batch_size=_int(env, "REMINDERS_PRUNE_BATCH_SIZE", 5000, 1),
            apns_key_file=env.get("REMINDERS_APNS_KEY_FILE") or None,
            apns_key_id=env.get("REMINDERS_APNS_KEY_ID") or None,
            apns_team_id=env.get("REMINDERS_APNS_TEAM_ID") or None,
            apns_topic=env.get("REMINDERS_APNS_TOPIC") or None,
            apns_environment=env.get("REMINDERS_APNS_ENVIRONMENT") or "production",
            apns_url=env.get("REMINDERS_APNS_URL") or None,
            apns_ca_file=env.get("REMINDERS_APNS_CA_FILE") or None,
            apns_concurrency=_int(env, "REMINDERS_APNS_CONCURRENCY", 200, 1),
            interruption_level=env.get("REMINDERS_INTERRUPTION_LEVEL") or "time-sensitive",
            dispatch_enabled=_flag(env, "REMINDERS_DISPATCH_ENABLED", True),
            dispatch_poll_seconds=_float(env, "REMINDERS_DISPATCH_POLL_SECONDS", 2.0, 0.05),
            dispatch_run_seconds=_int(env, "REMINDERS_DISPATCH_RUN_SECONDS", 3600, 60),
            dispatch_handover_seconds=_int(env, "REMINDERS_DISPATCH_HANDOVER_SECONDS", 120, 10),
            dispatch_late_seconds=_int(env, "REMINDERS_DISPATCH_LATE_SECONDS", 10, 1),
            dispatch_heartbeat_seconds=_int(env, "REMINDERS_DISPATCH_HEARTBEAT_SECONDS", 15, 1),
            source_allow_networks=_networks(env, "REMINDERS_SOURCE_ALLOW_NETWORKS"),
            token_previous=env.get("REMINDERS_TOKEN_PREVIOUS") or None,
            http_accept_now=env.get("REMINDERS_HTTP_ACCEPT_NOW") == "true",
            send_max_attempts=_int(env, "REMINDERS_SEND_MAX_ATTEMPTS", 3, 1),
            apns_halt_after=_int(env, "REMINDERS_APNS_HALT_AFTER", 20, 1),
            send_retry_base_seconds=_float(env, "REMINDERS_SEND_RETRY_BASE_SECONDS", 5.0, 0.0),
            send_retry_max_seconds=_float(env, "REMINDERS_SEND_RETRY_MAX_SECONDS", 300.0, 0.0),
            rearm_threshold_seconds=_int(env, "REMINDERS_REARM_THRESHOLD_SECONDS", 300, 1),
            db_pool_size=_int(env, "REMINDERS_DB_POOL_SIZE", 10, 1),
            db_statement_timeout_ms=_int(env, "REMINDERS_DB_STATEMENT_TIMEOUT_MS", 60_000),
            metrics_window_seconds=_int(env, "REMINDERS_METRICS_WINDOW_SECONDS", 900, 60),
            source_max_items=_int(env, "REMINDERS_SOURCE_MAX_ITEMS", 2000, 1),
            source_parse_seconds=_float(env, "REMINDERS_SOURCE_PARSE_SECONDS", 10.0, 0.1),
            feed_cache_seconds=_int(env, "REMINDERS_FEED_CACHE_SECONDS", 900, 1),
            source_series_seconds=_float(env, "REMINDERS_SOURCE_SERIES_SECONDS", 1.0, 0.01),
        )
        if s.apns_environment not in ("production", "sandbox"):
            raise SettingsError("REMINDERS_APNS_ENVIRONMENT must be 'production' or 'sandbox'")
        if s.dagster_executor not in ("in_process", "multiprocess", "celery", "k8s_job"):
            raise SettingsError("REMINDERS_DAGSTER_EXECUTOR must be in_process, multiprocess, celery or k8s_job")
        if s.interruption_level not in ("passive", "active", "time-sensitive", "critical"):
            raise SettingsError("REMINDERS_INTERRUPTION_LEVEL must be passive, active, time-sensitive or critical")
        for name, cron in (("REMINDERS_BUILD_CRON", s.build_cron), ("REMINDERS_DRAIN_CRON", s.drain_cron)):
            try:
                cron_cadence_seconds(cron)
            except CronError as exc:
                raise SettingsError(f"{name}: {exc}") from None
        if s.dispatch_handover_seconds >= s.dispatch_run_seconds:
            raise SettingsError(
                "REMINDERS_DISPATCH_HANDOVER_SECONDS must be shorter than REMINDERS_DISPATCH_RUN_SECONDS"
            )
        if s.abandon_after_seconds <= s.send_timeout_seconds + s.fence_margin_seconds:
            raise SettingsError(
                "REMINDERS_ABANDON_AFTER_SECONDS must exceed REMINDERS_SEND_TIMEOUT_SECONDS + REMINDERS_FENCE_MARGIN_SECONDS: "
                "a claim may send only until that much before another drain may fail it as abandoned"
            )
        if s.chunks_per_tick > s.chunk_count:
            raise SettingsError("REMINDERS_CHUNKS_PER_TICK must not exceed REMINDERS_CHUNK_COUNT")
        return s
