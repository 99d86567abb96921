"""Which provider each notification goes to, and the senders a deployment can make.

Only the shells (CLI, HTTP, Dagster) import this module: they hand the sending core a
``SenderFactory`` made here, so the core never imports a provider. Each provider's own module is
imported here when its credentials are configured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.wire import Notification, Provider
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.base import Sender, SenderFactory, SendResult

log = logging.getLogger(__name__)


def checked_sender_factory(db: Database, settings: Settings) -> SenderFactory:
    """``default_sender_factory`` checked against the providers the ledger's devices use, so a
    provider whose credentials are not mounted is refused before any claim (ValueError)."""
    if not settings.enabled:
        return default_sender_factory(settings)
    with db.read() as conn:
        return default_sender_factory(settings, ledger.providers_in_use(conn))


def default_sender_factory(settings: Settings, in_use: Collection[str] = ()) -> SenderFactory:
    """Each configured provider's sender, credentials checked now, before any claim; no sender at
    all in a dry run. APNs is checked when any of its settings is set, or when nothing else is
    (so a deployment with no provider at all is refused). ``in_use``: the providers live devices
    use (``ledger.providers_in_use``); one of them this deployment has no credentials for is
    refused here (ValueError), before anything is claimed, rather than failing each of its rows.
    A ``RoutingSender`` hands each notification to its device's provider."""
    if not settings.enabled:

        def refuse() -> Sender:
            raise RuntimeError("REMINDERS_ENABLED is not 'true': a dry run never connects to APNs")

        return refuse
    factories: dict[str, SenderFactory] = {}
    if settings.vapid_private_key_file or settings.vapid_subject:
        from reminders_pipeline.providers.webpush import WebPushSender, signing_key  # noqa: PLC0415

        signing_key(settings)
        factories[Provider.WEBPUSH] = lambda: WebPushSender(settings)
    if settings.fcm_credentials_file:
        from reminders_pipeline.providers.fcm import FcmSender, load_credentials  # noqa: PLC0415

        load_credentials(settings)
        factories[Provider.FCM] = lambda: FcmSender(settings)
    if not factories or any(getattr(settings, name) for name in APNS_SETTINGS):
        from reminders_pipeline.providers.apns import apns_sender_factory  # noqa: PLC0415

        factories[Provider.APNS] = apns_sender_factory(settings)
    missing = sorted(set(in_use) - set(factories))
    if missing:
        raise ValueError(
            f"devices are delivered by {', '.join(missing)}, which this deployment has no credentials for "
            f"(set {'; '.join(PROVIDER_SETTINGS[p] for p in missing)}): nothing was claimed"
        )
    return lambda: RoutingSender(factories)


APNS_SETTINGS = ("apns_key_file", "apns_key_id", "apns_team_id", "apns_topic")
PROVIDER_SETTINGS: dict[str, str] = {
    Provider.APNS: "REMINDERS_APNS_KEY_FILE, _KEY_ID, _TEAM_ID and _TOPIC",
    Provider.WEBPUSH: "REMINDERS_VAPID_PRIVATE_KEY_FILE and REMINDERS_VAPID_SUBJECT",
    Provider.FCM: "REMINDERS_FCM_CREDENTIALS_FILE",
}
NOT_CONFIGURED = "provider_not_configured"


@dataclass
class RoutingSender:
    """Hands each notification to its device's provider (``Notification.provider``), each
    provider's sender made on first use inside the running loop. A notification for a provider
    this deployment has no credentials for fails (``provider_not_configured:webpush``, logged):
    it can never be sent here, and the other providers' rows go on."""

    factories: dict[str, SenderFactory]
    senders: dict[str, Sender] = field(default_factory=dict)

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        groups: dict[str, list[Notification]] = {}
        for n in notifications:
            groups.setdefault(n.provider, []).append(n)
        answers = await asyncio.gather(
            *(self._send(provider, notes) for provider, notes in groups.items()), return_exceptions=True
        )
        out: list[SendResult] = []
        for notes, part in zip(groups.values(), answers):
            if isinstance(part, BaseException):  # one provider's sender raised: only its rows fail
                log.error("the %s sender raised (%s); its %d row(s) fail", notes[0].provider, part, len(notes))
                out += [SendResult(n.row_id, False, reason=f"sender_error:{type(part).__name__}") for n in notes]
            else:
                out += part
        return out

    async def _send(self, provider: str, notes: list[Notification]) -> list[SendResult]:
        if provider not in self.factories:
            log.error("%d row(s) for %s, which this deployment has no credentials for: failed", len(notes), provider)
            return [SendResult(n.row_id, False, reason=f"{NOT_CONFIGURED}:{provider}") for n in notes]
        if provider not in self.senders:
            self.senders[provider] = self.factories[provider]()
        return await self.senders[provider].send_many(notes)

    async def aclose(self) -> None:
        for sender in self.senders.values():
            try:
                await sender.aclose()
            except Exception:  # noqa: BLE001 - one sender's close must not leave the others open
                log.exception("closing a sender failed")
