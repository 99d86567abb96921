"""Resources: the ledger database, the sender, the source reader's limits and the alert path.

Each resource reads ``Settings`` once (per run or sensor tick) and owns what it stands for: the
ledger its ``Database``, the sender its sender factory, the alerting resource the webhook alerts go
to. A resource field stands for one ``REMINDERS_*`` variable and overrides it, checked by the same
model; in the definitions it is bound to an ``EnvVar`` when that variable is set where the code
location loads, so the UI shows which variable a value comes from and the value itself (a database
password, a webhook secret) never lands in stored run config. Unset, the field is None and the
environment or the embedded default stands: the quick start needs no variable at all.
"""

import asyncio
import os
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import dagster as dg
from pydantic import PrivateAttr

from reminders_pipeline import ledger as core_ledger
from reminders_pipeline.config.alerts import raise_alert
from reminders_pipeline.config.settings import ENV_PREFIX, Settings
from reminders_pipeline.ledger import migrate
from reminders_pipeline.ledger.db import Database, shared
from reminders_pipeline.providers.base import SenderFactory
from reminders_pipeline.providers.routing import default_sender_factory


def env_var(name: str) -> dg.EnvVar | None:
    """``EnvVar(name)`` if the variable is set now, else None (leave the embedded default)."""
    return dg.EnvVar(name) if os.environ.get(name) else None


def int_env_var(name: str) -> Any:
    return dg.EnvVar.int(name) if os.environ.get(name) else None


class SettingsResource(dg.ConfigurableResource):
    """A resource whose fields override the ``REMINDERS_*`` variables named in ``VARIABLES``."""

    VARIABLES: ClassVar[dict[str, str]] = {}  # resource field -> the variable it overrides
    _settings: Settings | None = PrivateAttr(default=None)

    def settings(self) -> Settings:
        """The environment with this resource's fields in place, read on first use and kept."""
        if self._settings is None:
            given = {var: getattr(self, field) for field, var in self.VARIABLES.items()}
            # A field set to "" stands for the variable set empty (its default), not for the environment's value.
            overrides = {var: str(value) for var, value in given.items() if value is not None}
            self._settings = Settings.from_env({**os.environ, **overrides})
        return self._settings

    def overrides(self) -> dict[str, Any]:
        """The settings this resource decides, as ``Settings`` field names and values."""
        settings = self.settings()
        fields = [var.removeprefix(ENV_PREFIX).lower() for var in self.VARIABLES.values()]
        return {field: getattr(settings, field) for field in fields}


class LedgerResource(SettingsResource):
    """The ledger database, and the ``Settings`` every op, sensor and check works from."""

    VARIABLES: ClassVar[dict[str, str]] = {"database_url": "REMINDERS_DATABASE_URL"}
    database_url: str | None = None

    @contextmanager
    def open(self) -> Iterator[Database]:
        """This process's ``Database`` (one engine and pool per process, kept across ops and sensor
        ticks), checked to be at this release's migration head.

        A database behind fails the op, sensor or check with the one-line reason, not a traceback.
        """
        db = shared(self.settings())
        try:
            migrate.require_head(db)
        except migrate.SchemaNotCurrent as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        yield db

    async def wait_until_ready(self, give_up_at: float, stop: asyncio.Event) -> None:
        """Wait (``migrate.wait_for_head``) while the ledger is away or not at this release's
        head, until ``give_up_at`` (``time.monotonic()``) or ``stop``: a dispatcher successor
        started in a failover or an upgrade takes over once it can, instead of failing into the
        sensor's backoff (30 s to 15 minutes without a dispatcher)."""

        async def pause(seconds: float) -> bool:
            try:
                await asyncio.wait_for(stop.wait(), seconds)
            except TimeoutError:
                return False
            return True

        try:
            await migrate.wait_for_head(shared(self.settings()), give_up_at, pause)
        except migrate.WAITED_FOR as exc:
            raise dg.Failure(description=str(exc), allow_retries=False) from None


class SenderResource(SettingsResource):
    """Who the drain hands notifications to: APNs when enabled, nobody in a dry run.

    ``enabled`` follows REMINDERS_ENABLED (exactly "true" sends); setting it to "false" in the
    launchpad dry-runs one drain without touching the deployment's environment.
    """

    VARIABLES: ClassVar[dict[str, str]] = {"enabled": "REMINDERS_ENABLED"}
    enabled: str | None = None
    _factory: SenderFactory | None = PrivateAttr(default=None)

    def factory(self, in_use: Collection[str] = ()) -> SenderFactory:
        """Made on first use, so each provider's credentials are checked before any claim, once
        per run; ``in_use``: the providers live devices use, each of which must be configured."""
        if self._factory is None:
            self._factory = default_sender_factory(self.settings(), in_use)
        return self._factory


class SourcesResource(SettingsResource):
    """How the build reads source feeds: timeout, body size cap, concurrency overall and per host."""

    VARIABLES: ClassVar[dict[str, str]] = {
        "timeout_seconds": "REMINDERS_SOURCE_TIMEOUT_SECONDS",
        "max_bytes": "REMINDERS_SOURCE_MAX_BYTES",
        "concurrency": "REMINDERS_SOURCE_CONCURRENCY",
        "per_host": "REMINDERS_SOURCE_PER_HOST",
    }
    timeout_seconds: int | None = None
    max_bytes: int | None = None
    concurrency: int | None = None
    per_host: int | None = None


class AlertingResource(SettingsResource):
    """The one alert path (``reminders_pipeline.config.alerts``) with the webhook this deployment uses."""

    VARIABLES: ClassVar[dict[str, str]] = {"webhook_url": "REMINDERS_ALERT_WEBHOOK_URL"}
    webhook_url: str | None = None

    def alert(self, title: str, detail: str = "", **fields: Any) -> bool:
        return raise_alert(self.settings(), title, detail, **fields)


def in_use(db: Database, settings: Settings) -> set[str]:
    """The providers live devices use, which a sending run must reach (none checked in a dry run)."""
    if not settings.enabled:
        return set()
    with db.read() as conn:
        return core_ledger.providers_in_use(conn)


def core_settings(ledger: LedgerResource, *others: SettingsResource) -> Settings:
    """The ``Settings`` an op hands the core: the ledger's, with what the other resources decide.

    The core reads them from ``Settings`` itself: ``enabled`` makes a dry run, the source limits
    bound the build's reads, and the drain and the build raise some alerts (APNs faults, failing
    sources) to ``alert_webhook_url``.
    """
    decided: dict[str, Any] = {}
    for resource in others:
        decided.update(resource.overrides())
    return ledger.settings().with_(**decided)


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
