"""The quick start's web page: it subscribes the browser it is opened in to Web Push and
registers it as a device, so the demo's reminders reach that browser.

Served by the demo source (``demo.DemoSource``) on 127.0.0.1, which a browser counts as a secure
context: ``/web/`` the page, ``/web/sw.js`` its service worker (it shows each push as a
notification, tagged per item), ``/web/vapid-public-key`` the key to subscribe with, and
``POST /web/subscribe`` the browser's ``PushSubscription``, registered as ``demo-browser`` through
``registration.put_device`` (the egress guard and every check of a registration apply). The page shows
what happened in one line: the device registered, or why not.
"""

from __future__ import annotations

import json
from typing import Any

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.devices.registration import DeviceError, DeviceSpec, put_device
from reminders_pipeline.ledger.db import Database
from reminders_pipeline.providers.webpush import load_key, public_key_text

DEVICE_ID = "demo-browser"
MAX_BODY_BYTES = 16 * 1024

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>reminders_pipeline demo</title>
<style>body{font:16px system-ui,sans-serif;margin:3em auto;max-width:36em}button{font-size:1em}</style></head>
<body><h1>Reminders in this browser</h1>
<p>Subscribes this browser to Web Push and registers it as the device <code>demo-browser</code>,
subscribed to the demo feed: its reminders then arrive here as notifications.</p>
<button id="subscribe">Subscribe this browser</button>
<p id="status" role="status"></p>
<script>
const say = text => { document.getElementById("status").textContent = text; };
// A browser whose push service cannot be reached (a network that blocks it, a build without one)
// never settles subscribe(): give up after this long and say so.
const SUBSCRIBE_SECONDS = 20;
const within = (promise, seconds, why) => Promise.race([promise, new Promise((_, reject) =>
  setTimeout(() => reject(Object.assign(new Error(why), { name: "TimeoutError" })), seconds * 1000))]);
const bytes = b64 => Uint8Array.from(
  atob(b64.replace(/-/g, "+").replace(/_/g, "/") + "=".repeat((4 - b64.length % 4) % 4)), c => c.charCodeAt(0));
document.getElementById("subscribe").onclick = async () => {
  try {
    if (!("serviceWorker" in navigator) || !("PushManager" in window)) return say("this browser has no Web Push");
    const registration = await navigator.serviceWorker.register("/web/sw.js");
    await navigator.serviceWorker.ready;
    if (await Notification.requestPermission() !== "granted") return say("notifications are not allowed");
    const answer = await fetch("/web/vapid-public-key");
    if (!answer.ok) return say("this demo sends no Web Push");
    const { public_key } = await answer.json();
    const subscription = await within(
      registration.pushManager.subscribe({ userVisibleOnly: true, applicationServerKey: bytes(public_key) }),
      SUBSCRIBE_SECONDS,
      `the browser's push service did not answer within ${SUBSCRIBE_SECONDS} s; ` +
        "this browser cannot reach it (a network that blocks it, or a browser without one)");
    const registered = await fetch("/web/subscribe", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(subscription) });
    const body = await registered.json();
    say(registered.ok ? `registered as ${body.device_id}` : `refused: ${body.detail}`);
  } catch (error) {
    say(`failed: ${error.name}: ${error.message}`);
  }
};
</script></body></html>
"""

SERVICE_WORKER = """self.addEventListener("push", event => {
  const alert = event.data ? event.data.json() : {};
  event.waitUntil(self.registration.showNotification(alert.title || "Reminder",
    { body: alert.body, tag: alert.tag, data: alert.reminder }));
});
"""


class WebDemo:
    """The page's routes over the demo's ledger: ``get`` and ``post`` give (status, type, body)."""

    def __init__(self, db: Database, settings: Settings, source_url: str) -> None:
        self.db, self.settings, self.source_url = db, settings, source_url

    def get(self, path: str) -> tuple[int, str, bytes] | None:
        if path in ("/web", "/web/"):
            return 200, "text/html; charset=utf-8", PAGE.encode()
        if path == "/web/sw.js":
            return 200, "text/javascript", SERVICE_WORKER.encode()
        if path == "/web/vapid-public-key":
            try:
                return _json(200, {"public_key": public_key_text(load_key(self.settings))})
            except RuntimeError as exc:
                return _json(404, {"error": "webpush_not_configured", "detail": str(exc)})
        return None

    def post(self, path: str, body: bytes) -> tuple[int, str, bytes] | None:
        if path != "/web/subscribe":
            return None
        try:
            subscription = json.loads(body)
        except ValueError:
            return _json(400, {"error": "malformed_json", "detail": "the body is not JSON"})
        spec = DeviceSpec.requested(self.settings, DEVICE_ID, webpush=subscription, sources=(self.source_url,))
        try:
            put_device(self.db, self.settings, spec)
        except DeviceError as exc:
            return _json(422, {"error": "invalid", "detail": exc.message, "field": exc.field})
        return _json(200, {"device_id": DEVICE_ID})


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(body).encode()
