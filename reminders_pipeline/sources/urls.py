"""A source's URL as it is shown (never its secret parts), fetched (``webcal`` read over https) and
recognised as a calendar."""

from __future__ import annotations

import hashlib
from urllib.parse import urlsplit


def shown_url(url: str) -> str:
    """A source URL as anything outside the ledger shows it (alerts, summaries, metadata, logs, API
    answers, the CLI): scheme, host and port, and a short id from a hash of the whole URL so an
    operator can tell sources apart and find one (``reminders sources``). Userinfo, path and query
    can hold the calendar's secret (Google's ``.../private-<token>/basic.ics``): never shown. The
    stored URL is unchanged: it is needed to read."""
    digest = hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:8]
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return f"?#{digest}"
    if not parts.scheme or not host:
        return f"?#{digest}"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/…#{digest}"


def fetch_url(url: str) -> str:
    return "https://" + url[len("webcal://") :] if url.startswith("webcal://") else url


def is_calendar(url: str, content_type: str, body: bytes) -> bool:
    return (
        url.startswith("webcal://")
        or "calendar" in content_type.lower()
        or body.lstrip()[:15].upper() == b"BEGIN:VCALENDAR"
    )
