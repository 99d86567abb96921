"""The mock Web Push service itself: real RFC 8291 payloads and RFC 8292 VAPID over HTTP/2 and TLS.

Each request is built the way a sender builds it, with ``http_ece`` and ``py_vapid``, and sent with
httpx, so these tests pin both what the mock accepts and the statuses it answers when it refuses.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import http_ece
import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from py_vapid import Vapid02

from reminders_pipeline.domain.b64url import decode as b64url_decode
from reminders_pipeline.domain.b64url import encode as b64url
from reminders_pipeline_testing.mock_webpush import Answer, MockWebPush

SUB = "mailto:ops@example.com"


@pytest.fixture(scope="module")
def push(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MockWebPush]:
    with MockWebPush(workdir=tmp_path_factory.mktemp("webpush")) as mock:
        yield mock


@pytest.fixture(autouse=True)
def fresh(push: MockWebPush) -> None:
    push.reset()


@pytest.fixture(scope="module")
def vapid() -> Vapid02:
    key = Vapid02()
    key.generate_keys()
    return key


def tls(push: MockWebPush) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(push.ca_file))


@pytest.fixture(scope="module")
def client(push: MockWebPush) -> Iterator[httpx.Client]:
    with httpx.Client(http2=True, verify=tls(push), timeout=10) as c:
        yield c


def encrypt(subscription: dict[str, Any], plaintext: bytes) -> bytes:
    """RFC 8291 aes128gcm for a subscription, with a fresh sender key each time."""
    keys = subscription["keys"]
    return bytes(
        http_ece.encrypt(
            plaintext,
            private_key=ec.generate_private_key(ec.SECP256R1()),
            dh=b64url_decode(keys["p256dh"]),
            auth_secret=b64url_decode(keys["auth"]),
            version="aes128gcm",
        )
    )


def send(
    client: httpx.Client,
    vapid: Vapid02,
    subscription: dict[str, Any],
    plaintext: bytes = b'{"title": "Standup", "body": "in 10 minutes"}',
    *,
    claims: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    drop: tuple[str, ...] = (),
) -> httpx.Response:
    origin = subscription["endpoint"].split("/wpush/")[0]
    request_headers = {
        **vapid.sign(claims or {"sub": SUB, "aud": origin}),
        "TTL": "60",
        "Urgency": "high",
        "Content-Encoding": "aes128gcm",
        **(headers or {}),
    }
    for name in drop:
        del request_headers[name]
    return client.post(subscription["endpoint"], content=encrypt(subscription, plaintext), headers=request_headers)


def test_subscription_has_the_browser_shape(push: MockWebPush) -> None:
    sub = push.subscribe()
    assert sub["endpoint"].startswith(f"https://127.0.0.1:{push.port}/wpush/")
    assert sub["expirationTime"] is None
    assert len(b64url_decode(sub["keys"]["p256dh"])) == 65
    assert len(b64url_decode(sub["keys"]["auth"])) == 16
    assert "=" not in sub["keys"]["p256dh"] + sub["keys"]["auth"]
    assert Path(push.ca_file).read_text().startswith("-----BEGIN CERTIFICATE-----")


def test_accepts_an_encrypted_vapid_signed_push_over_h2(
    push: MockWebPush, client: httpx.Client, vapid: Vapid02
) -> None:
    sub = push.subscribe()
    payload = {"title": "Standup", "body": "in 10 minutes", "url": "/events/42"}
    response = send(client, vapid, sub, json.dumps(payload).encode(), headers={"Topic": "event-42"})
    assert response.status_code == 201
    assert response.http_version == "HTTP/2"
    assert response.headers["location"].startswith(push.origin + "/m/")
    assert response.content == b""
    [record] = push.wait_for_requests(1)
    assert record.status == 201 and record.protocol == "h2" and record.error is None
    assert record.endpoint == sub["endpoint"]
    assert record.payload == payload
    assert (record.ttl, record.urgency, record.topic) == (60, "high", "event-42")


def test_http1_fallback_is_served_and_recorded(push: MockWebPush, vapid: Vapid02) -> None:
    sub = push.subscribe()
    with httpx.Client(http2=False, verify=tls(push), timeout=10) as http1:
        response = send(http1, vapid, sub, b"not json")
    assert response.status_code == 201 and response.http_version == "HTTP/1.1"
    [record] = push.requests
    assert (record.protocol, record.plaintext, record.payload) == ("http/1.1", b"not json", None)


@pytest.mark.parametrize(
    "claims, status",
    [
        ({"sub": SUB, "aud": "https://push.example.net"}, 401),  # wrong aud
        ({"sub": SUB, "aud": "ORIGIN", "exp": int(time.time()) - 60}, 401),  # expired
        ({"sub": SUB, "aud": "ORIGIN", "exp": int(time.time()) + 25 * 3600}, 401),  # over 24 h ahead
    ],
    ids=["wrong-aud", "expired", "too-far-ahead"],
)
def test_refuses_bad_vapid(
    push: MockWebPush, client: httpx.Client, vapid: Vapid02, claims: dict[str, Any], status: int
) -> None:
    sub = push.subscribe()
    claims = {**claims, "aud": push.origin} if claims["aud"] == "ORIGIN" else claims
    response = send(client, vapid, sub, claims=claims)
    assert response.status_code == status
    assert response.json()["errno"] == 109
    assert push.requests[0].payload is None


def test_refuses_missing_vapid_and_a_key_other_than_the_subscriptions(
    push: MockWebPush, client: httpx.Client, vapid: Vapid02
) -> None:
    sub = push.subscribe()
    assert send(client, vapid, sub, drop=("Authorization",)).status_code == 401
    public = vapid.public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    bound = push.subscribe(application_server_key=b64url(public))
    assert send(client, vapid, bound).status_code == 201
    other = Vapid02()
    other.generate_keys()
    assert send(client, other, bound).status_code == 401


def test_header_checks(push: MockWebPush, client: httpx.Client, vapid: Vapid02) -> None:
    sub = push.subscribe()
    missing_ttl = send(client, vapid, sub, drop=("TTL",))
    assert missing_ttl.status_code == 400 and missing_ttl.json()["errno"] == 111
    assert send(client, vapid, sub, headers={"TTL": "-1"}).status_code == 400
    assert send(client, vapid, sub, headers={"Urgency": "urgent"}).status_code == 400
    assert send(client, vapid, sub, headers={"Topic": "x" * 33}).status_code == 400
    assert send(client, vapid, sub, headers={"Content-Encoding": "aesgcm"}).status_code == 400
    assert [r.status for r in push.requests] == [400] * 5


def test_body_checks(push: MockWebPush, client: httpx.Client, vapid: Vapid02) -> None:
    sub = push.subscribe()
    too_big = send(client, vapid, sub, b"x" * 4100)
    assert too_big.status_code == 413 and too_big.json()["errno"] == 104
    for_another = encrypt(push.subscribe(), b"{}")
    headers = {**vapid.sign({"sub": SUB, "aud": push.origin}), "TTL": "0", "Content-Encoding": "aes128gcm"}
    assert client.post(sub["endpoint"], content=for_another, headers=headers).status_code == 400
    no_payload = {k: v for k, v in headers.items() if k != "Content-Encoding"}
    assert client.post(sub["endpoint"], headers=no_payload).status_code == 201  # a push without payload
    assert push.requests[-1].plaintext == b""


def test_unknown_and_unsubscribed_endpoints(push: MockWebPush, client: httpx.Client, vapid: Vapid02) -> None:
    unknown = {**push.subscribe(), "endpoint": f"{push.origin}/wpush/nobody"}
    response = send(client, vapid, unknown)
    assert response.status_code == 404
    assert response.json() | {"message": ""} == {
        "code": 404,
        "errno": 102,
        "error": "Not Found",
        "message": "",
        "more_info": "http://autopush.readthedocs.io/en/latest/http.html#error-codes",
    }
    sub = push.subscribe()
    push.unsubscribe(sub)
    assert send(client, vapid, sub).status_code == 410


def test_scripted_answers(push: MockWebPush, client: httpx.Client, vapid: Vapid02) -> None:
    gone = push.subscribe(Answer(status=410))
    busy = push.subscribe()
    push.script(busy["endpoint"], Answer(status=429, retry_after=30))
    slow = push.subscribe(Answer(delay=0.3))

    response = send(client, vapid, gone)
    assert response.status_code == 410 and response.json()["errno"] == 106
    response = send(client, vapid, busy)
    assert response.status_code == 429 and response.headers["retry-after"] == "30"
    started = time.monotonic()
    assert send(client, vapid, slow).status_code == 201
    assert time.monotonic() - started >= 0.3
    # A scripted refusal still comes after every check: the payload was read.
    assert [r.payload is not None for r in push.requests] == [True, True, True]

    push.reset()
    assert send(client, vapid, gone).status_code == 201


def test_flow_control_over_many_pushes_on_one_connection(
    push: MockWebPush, client: httpx.Client, vapid: Vapid02
) -> None:
    """Far more than h2's 64 KB window in request bodies: only returned credit lets them through."""
    sub = push.subscribe()
    plaintext = json.dumps({"pad": "x" * 3900}).encode()
    for _ in range(40):
        assert send(client, vapid, sub, plaintext).status_code == 201
    assert len(push.wait_for_requests(40)) == 40
    assert push.stats()["connections_opened"] == 0  # reset() zeroed it; the client kept its connection


def test_an_ipv6_mock_serves_endpoints_with_a_bracketed_literal_host(tmp_path: Path) -> None:
    with MockWebPush(workdir=tmp_path, host="::1") as push6:
        endpoint = push6.subscribe()["endpoint"]
        assert push6.origin == f"https://[::1]:{push6.port}" and endpoint.startswith(push6.origin + "/wpush/")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(push6.ca_file)), http2=True) as http:
            answered = http.post(endpoint, headers={"TTL": "60"})
        assert answered.status_code == 401  # reached, over TLS for ::1, and VAPID is still required
        assert push6.requests[0].endpoint == endpoint
