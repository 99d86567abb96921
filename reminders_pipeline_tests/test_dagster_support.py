"""Helpers for the Dagster tests: devices in chosen chunks, items relative to the real clock, a local
alert webhook, resources for a test ledger, and the definitions wired to them.

(Named ``test_*`` so it lives beside the Dagster tests it serves; it holds no tests itself.)
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import dagster as dg

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.defs.build import LOAD_SETTINGS, build_job, build_schedule, notification_queue
from reminders_pipeline.defs.dispatch import (
    dispatch_check_job,
    dispatch_on_time,
    dispatch_on_time_sensor,
    dispatcher_job,
    dispatcher_sensor,
)
from reminders_pipeline.defs.drain import drain_job, drain_schedule
from reminders_pipeline.defs.monitoring import (
    drain_backlog,
    queue_checks_schedule,
    run_failure_alert,
    sweep_period_invariant,
    sweep_period_sensor,
)
from reminders_pipeline.defs.resources import AlertingResource, LedgerResource, SenderResource, SourcesResource
from reminders_pipeline.devices.registration import DeviceSpec, chunk_of, put_device
from reminders_pipeline.providers.base import RecordingSender, SenderFactory

from .support import TOKEN

RECORDER = RecordingSender()


class RecordingSenderResource(SenderResource):
    """Sends to ``RECORDER`` (a live run without APNs)."""

    def factory(self, in_use=()) -> SenderFactory:
        return RECORDER.factory()


def device_in_chunk(chunk: int, prefix: str = "dev") -> str:
    """The first ``{prefix}-N`` whose stable hash lands in ``chunk``."""
    return next(
        f"{prefix}-{i}" for i in itertools.count() if chunk_of(f"{prefix}-{i}", LOAD_SETTINGS.chunk_count) == chunk
    )


def add_device(db, settings: Settings, device_id: str, sources: list[str], lead: int = 3600) -> None:
    put_device(db, settings, DeviceSpec(device_id, TOKEN, lead, (), tuple(sources)))


def live_item(item_id: str, starts_in: float, duration: int = 1800) -> dict[str, Any]:
    """A wire-format item starting ``starts_in`` seconds from the real now (Dagster runs use real time)."""
    start = int(time.time() + starts_in)
    return {"id": item_id, "title": f"Event {item_id}", "startsAt": start, "expiresAt": start + duration}


def resources_for(db_url: str, *, live: bool = False, webhook: str | None = None) -> dict[str, Any]:
    return {
        "ledger": LedgerResource(database_url=db_url),
        "sender": RecordingSenderResource(enabled="true") if live else SenderResource(enabled="false"),
        "sources": SourcesResource(),
        "alerting": AlertingResource(webhook_url=webhook),
    }


def definitions_for(resources: dict[str, Any]) -> dg.Definitions:
    """The production wiring (same assets, jobs, schedules, sensors, checks) on test resources."""
    return dg.Definitions(
        assets=[notification_queue],
        asset_checks=[sweep_period_invariant, drain_backlog, dispatch_on_time],
        jobs=[build_job, drain_job, dispatcher_job, dispatch_check_job],
        schedules=[build_schedule, drain_schedule, queue_checks_schedule],
        sensors=[sweep_period_sensor, run_failure_alert, dispatcher_sensor, dispatch_on_time_sensor],
        resources=resources,
    )


class AlertReceiver:
    """A local Slack-style webhook that records every JSON body posted to it."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.received.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                return None

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/services/T000/B000/secret"

    def __enter__(self) -> AlertReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def titles(self) -> list[str]:
        return [m["text"].splitlines()[0] for m in self.received]
