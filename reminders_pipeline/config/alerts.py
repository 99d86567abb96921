"""The one alert path: an ERROR log line, and a Slack-compatible POST when a webhook is configured.

Plain Python so every shell can use it: the sweep-period sensor, the asset checks and the run-failure
sensor call it today, and the drain core can call it when APNs reports a configuration fault.
Open-source Dagster has no alert policies of its own, so this is where alerts leave the system.

An alert must never break what raised it: a webhook that is down, slow or rejects the message is
logged and the caller carries on (the log line has already recorded the alert).
(The push notification a reminder becomes is composed in ``notification.py``.)
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from reminders_pipeline.config.settings import Settings

log = logging.getLogger(__name__)

WEBHOOK_TIMEOUT_SECONDS = 5.0


def format_alert(title: str, detail: str, fields: dict[str, Any]) -> str:
    """One message readable in a log file and in Slack alike: title, detail, then ``key: value`` lines."""
    lines = [f"[reminders] {title}", detail] if detail else [f"[reminders] {title}"]
    lines += [f"{key}: {value}" for key, value in fields.items() if value is not None]
    return "\n".join(lines)


def raise_alert(settings: Settings, title: str, detail: str = "", **fields: Any) -> bool:
    """Log ``title`` at ERROR and POST ``{"text": ...}`` to ``settings.alert_webhook_url`` if set.

    Returns True when a webhook accepted the message (2xx); False when there is no webhook or the
    POST failed. Never raises.
    """
    text = format_alert(title, detail, fields)
    log.error("%s", text)
    url = settings.alert_webhook_url
    if not url:
        return False
    host = _host(url)  # the URL's path is the webhook's secret: never logged
    try:
        response = httpx.post(url, json={"text": text}, timeout=WEBHOOK_TIMEOUT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - an unreachable webhook must not fail the caller
        log.error("alert webhook at %s unreachable: %s", host, type(exc).__name__)
        return False
    if not response.is_success:
        log.error("alert webhook at %s answered HTTP %d: %s", host, response.status_code, response.text[:200])
        return False
    return True


def _host(url: str) -> str:
    try:
        return httpx.URL(url).host or "?"
    except Exception:  # noqa: BLE001 - a malformed URL still must not raise
        return "?"
