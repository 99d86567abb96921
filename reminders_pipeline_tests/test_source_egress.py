"""Source URLs cannot reach inside (SSRF): addresses checked where the socket opens.

A device can subscribe any URL, so every test here is an attacker's URL: straight at an internal
address, through a name that resolves to one, or through a redirect from an allowed source. The
feed servers listen on loopback, which the default settings refuse; a test allows one loopback
address at a time where it needs a first hop that is allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import Iterator

import httpcore
import httpx
import pytest
import trustme

from reminders_pipeline import ledger
from reminders_pipeline.config.settings import LOOPBACK_NETWORKS, Settings, SettingsError
from reminders_pipeline.domain.times import Instant
from reminders_pipeline.planning.build import build
from reminders_pipeline.planning.widget_feed import compose_feed
from reminders_pipeline.sources.egress import GuardedBackend, is_allowed, parse_networks
from reminders_pipeline.sources.reader import SourceReader, SourceState
from reminders_pipeline.sources.urls import shown_url

from .http_sources import FeedServer, Route
from .support import device

NOW = Instant.from_stored("2026-10-18T12:00:00.000Z")
SECRET = "i-0123456789abcdef-SECRET"  # what an internal endpoint would answer


@pytest.fixture
def outside() -> Iterator[FeedServer]:
    """A second feed server on 127.0.0.2: the "public" first hop a test allows by name."""
    server = FeedServer(host="127.0.0.2")
    server.start()
    yield server
    server.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(url: str, allow: tuple[str, ...] = ()) -> str | None:
    return SourceReader(timeout=3, allow_networks=parse_networks(allow)).read_all({1: url})[1].error


def test_internal_addresses_are_refused_without_a_connection(feeds):
    """Open port or closed port, literal or name: the same answer, and nothing reaches the server."""
    feeds.items("/secret.json", [])
    port = feeds.httpd.server_address[1]
    urls = [
        feeds.url("/secret.json"),
        f"http://127.0.0.1:{closed_port()}/secret.json",  # closed: same code as open (no port scan)
        f"http://localhost:{port}/secret.json",  # a name that resolves to loopback
        f"http://[::1]:{port}/secret.json",
        f"http://[::ffff:127.0.0.1]:{port}/secret.json",  # IPv4-mapped IPv6
        f"http://[::ffff:7f00:1]:{port}/secret.json",
        "http://169.254.169.254/latest/meta-data/",
        "http://0.0.0.0/",
        "http://10.0.0.1/",
        "http://192.168.1.1/",
        "http://100.64.0.1/",
        "http://[fc00::1]/",
        "http://[fe80::1]/",
        "http://224.0.0.1/",
        "http://[2002:7f00:1::1]/",
        "webcal://127.0.0.1/x.ics",
    ]
    assert {url: read(url) for url in urls} == {url: "address_refused" for url in urls}
    assert feeds.hits["/secret.json"] == 0


@pytest.mark.parametrize(
    "target",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://127.0.0.1:{port}/secret.json",
        "http://localhost:{port}/secret.json",
        "http://[::1]:{port}/secret.json",
        "http://[::ffff:127.0.0.1]:{port}/secret.json",
    ],
)
def test_every_redirect_hop_is_checked(feeds, outside, target):
    feeds.items(
        "/secret.json", [{"id": SECRET, "title": SECRET, "startsAt": 2_000_000_000, "expiresAt": 2_000_000_060}]
    )
    outside.redirect("/feed.json", target.format(port=feeds.httpd.server_address[1]))
    reads = SourceReader(timeout=3, allow_networks=parse_networks(["127.0.0.2/32"])).read_all(
        {1: outside.url("/feed.json")}
    )
    assert reads[1].error == "address_refused" and outside.hits["/feed.json"] == 1
    assert feeds.hits["/secret.json"] == 0


def test_an_allowed_network_is_read_and_only_that_one(feeds, outside):
    feeds.items("/a.json", [])
    outside.items("/b.json", [])
    reads = SourceReader(timeout=3, allow_networks=parse_networks(["127.0.0.2/32"])).read_all(
        {1: feeds.url("/a.json"), 2: outside.url("/b.json")}
    )
    assert (reads[1].error, reads[2].ok) == ("address_refused", True)
    assert feeds.hits["/a.json"] == 0 and outside.hits["/b.json"] == 1


def test_an_ipv4_mapped_address_counts_as_its_ipv4_network():
    loopback = parse_networks(["127.0.0.0/8"])
    mapped = ipaddress.ip_address("::ffff:127.0.0.1")
    assert not is_allowed(mapped, ()) and is_allowed(mapped, loopback)
    assert is_allowed(ipaddress.ip_address("93.184.216.34"), ()) and is_allowed(
        ipaddress.ip_address("2606:4700::1"), ()
    )


class Recorder(httpcore.AsyncNetworkBackend):
    """Records where the guard connects; the connection itself fails (nothing listens)."""

    def __init__(self) -> None:
        self.hosts: list[str] = []

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):  # type: ignore[no-untyped-def]
        self.hosts.append(host)
        raise httpcore.ConnectError("recorded")


class Rebinding(GuardedBackend):
    """A name that answers a public address and an internal one (a rebinding resolver)."""

    async def resolve(self, host: str, port: int, timeout: float | None) -> list:  # type: ignore[override]
        return [
            ipaddress.ip_address("127.0.0.1"),
            ipaddress.ip_address("93.184.216.34"),
            ipaddress.ip_address("10.1.2.3"),
        ]


def test_the_connection_goes_to_the_checked_address_never_the_name_again():
    """DNS rebinding: the name is resolved once; only checked addresses are dialled, as literals."""
    recorder = Recorder()
    with pytest.raises(httpcore.ConnectError):
        asyncio.run(Rebinding((), backend=recorder).connect_tcp("rebind.example", 80, timeout=1))
    assert recorder.hosts == ["93.184.216.34"]

    recorder = Recorder()
    with pytest.raises(httpcore.ConnectError):  # localhost resolved here; the literal is what is dialled
        guard = GuardedBackend(parse_networks(LOOPBACK_NETWORKS), backend=recorder)
        asyncio.run(guard.connect_tcp("localhost", 80, timeout=1))
    assert recorder.hosts and all(ipaddress.ip_address(h).is_loopback for h in recorder.hosts)


def test_https_never_redirects_to_http():
    """Checked on every hop by the reader itself (httpx would follow it)."""
    seen: list[str] = []

    def peer(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/feed.json":
            return httpx.Response(302, headers={"Location": "http://feeds.example/plain.json"})
        if request.url.path == "/up.json":
            return httpx.Response(302, headers={"Location": "https://feeds.example/ok.json"})
        return httpx.Response(200, json={"items": []})

    async def run(url: str) -> str | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(peer)) as client:
            return (await SourceReader()._read(client, 1, SourceState(url), None)).error

    assert asyncio.run(run("https://feeds.example/feed.json")) == "insecure_redirect"
    assert asyncio.run(run("webcal://feeds.example/feed.json")) == "insecure_redirect"  # webcal is read over https
    assert "http://feeds.example/plain.json" not in seen
    assert asyncio.run(run("http://feeds.example/up.json")) is None  # upgrading is fine


def test_https_verifies_the_name_while_dialling_the_checked_address(feeds, tmp_path, monkeypatch):
    """TLS still checks the certificate against the URL's name; a redirect down to http is refused."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))  # httpx's default context reads it
    secure = FeedServer(ca=ca)
    secure.start()
    try:
        ok = secure.items(
            "/feed.json", [{"id": "e", "title": "E", "startsAt": 2_000_000_000, "expiresAt": 2_000_000_060}]
        )
        down = secure.redirect("/down.json", feeds.items("/plain.json", []))
        by_address = ok.replace("localhost", "127.0.0.1")  # the certificate names localhost only
        reads = SourceReader(timeout=3, allow_networks=parse_networks(LOOPBACK_NETWORKS)).read_all(
            {1: ok, 2: down, 3: by_address}
        )
    finally:
        secure.stop()
    assert len(reads[1].feed.items) == 1, reads[1]
    assert reads[2].error == "insecure_redirect" and feeds.hits["/plain.json"] == 0
    assert reads[3].error == "connect_failed"


def test_source_allow_networks_setting():
    assert Settings.from_env({}).source_allow_networks == ()
    env = {"REMINDERS_SOURCE_ALLOW_NETWORKS": "10.0.0.0/8, fd00::/8,127.0.0.1"}
    assert Settings.from_env(env).source_allow_networks == ("10.0.0.0/8", "fd00::/8", "127.0.0.1")
    with pytest.raises(SettingsError, match="REMINDERS_SOURCE_ALLOW_NETWORKS.*'10.0.0.0/33'"):
        Settings.from_env({"REMINDERS_SOURCE_ALLOW_NETWORKS": "10.0.0.0/33"})


BODIES = {  # path -> (answer, the code stored for it)
    "/cal.ics": (
        Route(body=f"BEGIN:VCALENDAR\r\nami-id: {SECRET}\r\n".encode(), content_type="text/calendar"),
        "not_icalendar",
    ),
    "/page.json": (Route(body=f"<html>{SECRET}</html>".encode(), content_type="text/html"), "not_json"),
    "/shape.json": (Route(body=json.dumps({"items": SECRET}).encode()), "items_not_a_list"),
    "/gone.json": (Route(404, SECRET.encode(), content_type="text/plain"), "http_404"),
    "/ms.json": (
        Route(body=json.dumps({"items": [{"id": SECRET, "title": SECRET, "startsAt": 1}]}).encode()),
        "every_item_rejected",
    ),
}


def test_a_failed_read_is_stored_and_shown_as_a_code_never_the_body(db, settings, feeds):
    urls = {feeds.set(path, route): code for path, (route, code) in BODIES.items()}
    metadata = feeds.redirect("/meta.json", "http://169.254.169.254/latest/meta-data/")
    urls[metadata] = "address_refused"
    device(db, settings, sources=list(urls))
    summary = build(db, settings, now=NOW)
    shown = {shown_url(url): code for url, code in urls.items()}
    assert {f["url"]: f["error"] for f in summary.sources_failed} == shown
    with db.read() as conn:
        stored = {s["url"]: s["last_error"] for s in ledger.list_sources(conn)}
    assert stored == urls
    composed = compose_feed(db, settings, "dev-1")
    assert composed is not None and {f["url"]: f["error"] for f in composed.sources_failed} == shown
    assert SECRET not in json.dumps([summary.as_dict(), stored, composed.sources_failed])


def test_the_default_settings_refuse_a_loopback_source(db, settings, feeds):
    url = feeds.items("/local.json", [])
    device(db, settings, sources=[url])
    summary = build(db, settings.with_(source_allow_networks=()), now=NOW)
    assert (
        summary.sources_failed == [{"url": shown_url(url), "error": "address_refused"}]
        and feeds.hits["/local.json"] == 0
    )


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("fec0::1", True),  # IPv6 site-local: ``is_global`` says global, and must not pass
        ("feff::1", True),  # the top of fec0::/10
        ("64:ff9b::a00:1", True),  # NAT64 of 10.0.0.1
        ("64:ff9b::808:808", False),  # NAT64 of 8.8.8.8
        ("::ffff:10.0.0.1", True),  # IPv4-mapped private
        ("2002:a00:1::1", True),  # 6to4 of 10.0.0.1
        ("2002:808:808::1", False),  # 6to4 of 8.8.8.8
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", True),  # Teredo: a tunnel to anywhere
        ("2001:db8::1", True),  # documentation
        ("ff0e::1", True),  # global-scope multicast
        ("100.64.0.1", True),  # shared (CGNAT)
        ("192.0.2.1", True),  # documentation
        ("2606:4700:4700::1111", False),
        ("93.184.216.34", False),
    ],
)
def test_only_globally_routable_addresses_pass(text, refused):
    assert is_allowed(ipaddress.ip_address(text), ()) is not refused
