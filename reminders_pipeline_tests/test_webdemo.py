"""The quick start's web page in a real browser: headless Chromium, driven by Playwright, opens
the page the demo source serves, registers its service worker, asks for notification permission,
fetches the VAPID key and subscribes, and posts the subscription, which registers the browser as
a device. On SQLite and PostgreSQL.

Chromium's own push service cannot be reached from the test machine, so ``PushManager.subscribe``
is the one call stood in for: an init script answers it with a subscription on the local mock
push service, after checking the page passed the served VAPID key. Everything before it (the page,
the service worker, the permission, the key) and after it (the registration, a drain that sends
to that subscription, decrypted by the mock as the browser would) is real."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import sync_playwright

from reminders_pipeline import ledger
from reminders_pipeline.dev.demo import DEMO_ITEMS, DemoSource, prepare_ledger
from reminders_pipeline.dev.webdemo import DEVICE_ID, WebDemo
from reminders_pipeline.planning.build import build
from reminders_pipeline.providers.routing import default_sender_factory
from reminders_pipeline.providers.webpush import generate_key
from reminders_pipeline.sending.drain import drain
from reminders_pipeline_testing.mock_webpush import MockWebPush

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps trying hosts this machine cannot reach.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Stands in for the browser's push service: the subscription the mock made, once the page asked
# with the deployment's key.
STAND_IN = """
window.__subscription = %s;
PushManager.prototype.subscribe = async function (options) {
  window.__askedKey = btoa(String.fromCharCode(...new Uint8Array(options.applicationServerKey)));
  window.__userVisibleOnly = options.userVisibleOnly;
  const json = window.__subscription;
  return { endpoint: json.endpoint, toJSON: () => json };
};
"""


@pytest.fixture
def push(tmp_path: Path):  # type: ignore[no-untyped-def]
    with MockWebPush(workdir=tmp_path) as server:
        yield server


@contextmanager
def _demo_page(source: DemoSource, init_script: str, *, driven_clock: bool = False) -> Iterator[Any]:
    """The demo's web page in Chromium, notifications allowed, ``init_script`` run before the
    page's own; on Playwright's clock when ``driven_clock``."""
    page_url = source.url.removesuffix("/demo.json") + "/web/"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context()
            context.grant_permissions(["notifications"], origin=page_url.removesuffix("/web/"))
            context.add_init_script(init_script)
            page = context.new_page()
            if driven_clock:
                page.clock.install()
            page.goto(page_url)
            yield page
        finally:
            browser.close()


def test_the_demo_page_subscribes_the_browser_and_registers_it(settings, db, push, tmp_path):
    key = tmp_path / "vapid.pem"
    public = generate_key(str(key))
    web_settings = settings.with_(
        vapid_private_key_file=str(key),
        vapid_subject="mailto:demo@example.org",
        webpush_allow_networks=("127.0.0.0/8",),
        webpush_ca_file=str(push.ca_file),
    )
    subscription = push.subscribe()
    with DemoSource(0) as source:
        prepare_ledger(web_settings, source.url)
        source.web = WebDemo(db, web_settings, source.url)
        with _demo_page(source, STAND_IN % json.dumps(subscription)) as page:
            page.click("#subscribe")
            page.wait_for_function("document.getElementById('status').textContent !== ''", timeout=20_000)
            status = page.text_content("#status")
            asked = page.evaluate("window.__askedKey")
            visible = page.evaluate("window.__userVisibleOnly")
            workers = page.evaluate("navigator.serviceWorker.getRegistrations().then(r => r.length)")
        assert status == f"registered as {DEVICE_ID}", status
        assert base64.b64decode(asked) == base64.urlsafe_b64decode(public + "=" * (-len(public) % 4))
        assert visible is True and workers == 1
        with db.read() as conn:
            device = next(d for d in ledger.list_devices(conn) if d.id == DEVICE_ID)
        assert device.provider == "webpush" and json.loads(device.target)["endpoint"] == subscription["endpoint"]

        # The registered browser gets the demo's reminders: a build and a drain send to its subscription.
        live = web_settings.with_(enabled=True, max_lateness_seconds=10**9)  # the demo starts with one 40 min late
        build(db, live)
        summary = drain(db, live, default_sender_factory(live))
    assert summary.providers.get("webpush:sent", 0) >= 1, summary.as_dict()
    titles = {r.payload["title"] for r in push.wait_for_requests(1)}
    assert titles and titles <= {title for _, title, _ in DEMO_ITEMS}


# A push service that never answers: subscribe() neither resolves nor rejects.
UNREACHABLE = """
PushManager.prototype.subscribe = function () { window.__subscribing = true; return new Promise(() => {}); };
"""


def test_the_demo_page_says_why_when_the_push_service_never_answers(settings, db, tmp_path):
    key = tmp_path / "vapid.pem"
    generate_key(str(key))
    web_settings = settings.with_(vapid_private_key_file=str(key), vapid_subject="mailto:demo@example.org")
    with DemoSource(0) as source:
        prepare_ledger(web_settings, source.url)
        source.web = WebDemo(db, web_settings, source.url)
        with _demo_page(source, UNREACHABLE, driven_clock=True) as page:
            page.click("#subscribe")
            page.wait_for_function("window.__subscribing === true", timeout=20_000)
            page.clock.run_for(19_000)
            before = page.text_content("#status")
            page.clock.run_for(2_000)
            page.wait_for_function("document.getElementById('status').textContent !== ''", timeout=20_000)
            status = page.text_content("#status")
    assert before == ""
    assert status.startswith("failed: TimeoutError: the browser's push service did not answer within 20 s"), status
    with db.read() as conn:
        assert DEVICE_ID not in {d.id for d in ledger.list_devices(conn)}
