"""Resources: the ledger database, the sender, the source reader and the alert path.

``Settings.from_env()`` stays the one reader of the environment and supplies every default. A
resource field overrides one setting; in the definitions it is bound to an ``EnvVar`` when that
variable is set where the code location loads, so the UI shows which variable a value comes from and
the value itself (a database password, a webhook secret) never lands in stored run config. Unset,
the field is None and the embedded default stands: the quick start needs no variable at all.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dagster as dg

from reminders_pipeline import migrate
from reminders_pipeline.alerts import raise_alert
from reminders_pipeline.db import Database, shared
from reminders_pipeline.sender import SenderFactory, default_sender_factory
from reminders_pipeline.settings import Settings, normalize_database_url


def env_var(name: str) -> dg.EnvVar | None:
    """``EnvVar(name)`` if the variable is set now, else None (leave the embedded default)."""
    return dg.EnvVar(name) if os.environ.get(name) else None


def int_env_var(name: str) -> Any:
    return dg.EnvVar.int(name) if os.environ.get(name) else None


class LedgerResource(dg.ConfigurableResource):
    """The ledger database, and the ``Settings`` every op, sensor and check works from."""

    database_url: str | None = None

    def settings(self) -> Settings:
        base = Settings.from_env()
        return base.with_(database_url=normalize_database_url(self.database_url)) if self.database_url else base

    @contextmanager
    def open(self) -> Iterator[Database]:
        """This process's ``Database`` (one engine and pool per process, kept across ops and sensor
        ticks), checked once to be at this release's migration head.

        A database behind fails the op, sensor or check with the one-line reason, not a traceback.
        """
        db = shared(self.settings())
        try:
            migrate.require_head(db)
        except migrate.SchemaNotCurrent as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        yield db


class SenderResource(dg.ConfigurableResource):
    """Who the drain hands notifications to: APNs when enabled, nobody in a dry run.

    ``enabled`` follows REMINDERS_ENABLED (exactly "true" sends); setting it to "false" in the
    launchpad dry-runs one drain without touching the deployment's environment.
    """

    enabled: str | None = None

    def apply(self, settings: Settings) -> Settings:
        return settings if self.enabled is None else settings.with_(enabled=self.enabled == "true")

    def factory(self, settings: Settings) -> SenderFactory:
        return default_sender_factory(settings)


class SourcesResource(dg.ConfigurableResource):
    """How the build reads source feeds: timeout, body size cap, concurrency overall and per host."""

    timeout_seconds: int | None = None
    max_bytes: int | None = None
    concurrency: int | None = None
    per_host: int | None = None

    def apply(self, settings: Settings) -> Settings:
        overrides = {
            "source_timeout_seconds": float(self.timeout_seconds) if self.timeout_seconds else None,
            "source_max_bytes": self.max_bytes,
            "source_concurrency": self.concurrency,
            "source_per_host": self.per_host,
        }
        return settings.with_(**{k: v for k, v in overrides.items() if v is not None})


class AlertingResource(dg.ConfigurableResource):
    """The one alert path (``reminders_pipeline.alerts``) with the webhook this deployment uses."""

    webhook_url: str | None = None

    def apply(self, settings: Settings) -> Settings:
        """Settings whose alerts (the core raises some itself: APNs faults, failing sources) go here."""
        return settings.with_(alert_webhook_url=self.webhook_url) if self.webhook_url else settings

    def alert(self, settings: Settings, title: str, detail: str = "", **fields: Any) -> bool:
        return raise_alert(self.apply(settings), title, detail, **fields)


def production_resources() -> dict[str, Any]:
    """Resources bound to the environment the code location loads in."""
    return {
        "ledger": LedgerResource(database_url=env_var("REMINDERS_DATABASE_URL")),
        "sender": SenderResource(enabled=env_var("REMINDERS_ENABLED")),
        "sources": SourcesResource(
            timeout_seconds=int_env_var("REMINDERS_SOURCE_TIMEOUT_SECONDS"),
            max_bytes=int_env_var("REMINDERS_SOURCE_MAX_BYTES"),
            concurrency=int_env_var("REMINDERS_SOURCE_CONCURRENCY"),
            per_host=int_env_var("REMINDERS_SOURCE_PER_HOST"),
        ),
        "alerting": AlertingResource(webhook_url=env_var("REMINDERS_ALERT_WEBHOOK_URL")),
    }


@dg.definitions
def defs() -> dg.Definitions:
    return dg.Definitions(resources=production_resources())
