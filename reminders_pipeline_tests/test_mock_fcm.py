"""The mock FCM itself: google-auth gets a token from it, and its sends answer as FCM's do.

No database and no pipeline code: these pin the mock's behaviour that the FCM sender's tests rely on.
"""

from __future__ import annotations

import re
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import google.auth.transport.requests
import httpx
import jwt
import pytest
import requests
from cryptography.hazmat.primitives.asymmetric import rsa
from google.auth.exceptions import RefreshError
from google.oauth2 import service_account

from reminders_pipeline_testing.mock_fcm import FCM_ERROR_TYPE, FCM_SCOPE, Answer, MockFcm

PROJECT = "demo-project"
VALID_MESSAGE: dict[str, Any] = {
    "token": "device-token-1",
    "notification": {"title": "Dentist", "body": "In 30 minutes"},
    "data": {"event": "42"},
    "android": {"ttl": "3600s", "collapse_key": "event-42", "priority": "HIGH"},
}


@pytest.fixture
def fcm(tmp_path: Path) -> Iterator[MockFcm]:
    with MockFcm(workdir=tmp_path) as server:
        yield server


def requests_session(fcm: MockFcm) -> requests.Session:
    session = requests.Session()
    session.verify = str(fcm.ca_file)
    # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override session.verify when it trusts the
    # environment (and CI machines set them): without this the mock's CA is silently not used.
    session.trust_env = False
    return session


def credentials(fcm: MockFcm, scopes: list[str] | None = None) -> service_account.Credentials:
    path = str(fcm.service_account_file(PROJECT))
    creds: service_account.Credentials = service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
        path, scopes=scopes or [FCM_SCOPE]
    )
    return creds


def refresh(fcm: MockFcm, creds: service_account.Credentials) -> None:
    """What a sender does: google-auth's requests transport, on a session that trusts the mock's CA."""
    creds.refresh(google.auth.transport.requests.Request(requests_session(fcm)))  # type: ignore[no-untyped-call]


def access_token(fcm: MockFcm) -> str:
    creds = credentials(fcm)
    refresh(fcm, creds)
    return str(creds.token)


def client(fcm: MockFcm, *, http2: bool = True) -> httpx.Client:
    return httpx.Client(http2=http2, verify=ssl.create_default_context(cafile=str(fcm.ca_file)), timeout=10)


def send(fcm: MockFcm, token: str, body: dict[str, Any], *, http2: bool = True) -> httpx.Response:
    with client(fcm, http2=http2) as http:
        return http.post(fcm.send_url(PROJECT), headers={"Authorization": f"Bearer {token}"}, json=body)


def fcm_error_code(response: httpx.Response) -> str | None:
    details = response.json()["error"].get("details", [])
    codes = [detail["errorCode"] for detail in details if detail.get("@type") == FCM_ERROR_TYPE]
    return codes[0] if codes else None


def test_google_auth_refreshes_through_the_mock(fcm: MockFcm) -> None:
    creds = credentials(fcm)
    refresh(fcm, creds)

    assert creds.valid and creds.token and creds.token.startswith("ya29.")
    assert creds.expiry is not None
    assert fcm.tokens_issued == 1


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "http1.1"])
def test_a_valid_message_is_sent_and_recorded(fcm: MockFcm, http2: bool) -> None:
    token = access_token(fcm)

    response = send(fcm, token, {"message": VALID_MESSAGE}, http2=http2)

    assert response.status_code == 200, response.text
    assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert re.fullmatch(rf"projects/{PROJECT}/messages/\S+", response.json()["name"])
    [recorded] = fcm.wait_for_requests(1)
    assert (recorded.token, recorded.status, recorded.access_token) == ("device-token-1", 200, token)
    assert recorded.message == VALID_MESSAGE
    assert recorded.protocol == ("h2" if http2 else "http/1.1")


def assert_unauthenticated(response: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.json()["error"]["status"] == "UNAUTHENTICATED"
    assert response.json()["error"]["code"] == 401


def test_expired_revoked_and_unknown_tokens_get_401(fcm: MockFcm) -> None:
    fcm.token_lifetime = 1
    short_lived = access_token(fcm)
    time.sleep(1.1)
    assert_unauthenticated(send(fcm, short_lived, {"message": VALID_MESSAGE}))

    fcm.token_lifetime = 3600
    token = access_token(fcm)
    assert send(fcm, token, {"message": VALID_MESSAGE}).status_code == 200
    fcm.revoke_tokens()
    assert_unauthenticated(send(fcm, token, {"message": VALID_MESSAGE}))

    assert_unauthenticated(send(fcm, "ya29.never-issued", {"message": VALID_MESSAGE}))
    assert [r.status for r in fcm.requests] == [401, 200, 401, 401]


def test_scripted_unregistered_is_404_with_its_error_code(fcm: MockFcm) -> None:
    fcm.script("gone-token", Answer(error_code="UNREGISTERED"))

    response = send(fcm, access_token(fcm), {"message": {**VALID_MESSAGE, "token": "gone-token"}})

    assert response.status_code == 404
    assert response.json()["error"]["status"] == "NOT_FOUND"
    assert fcm_error_code(response) == "UNREGISTERED"
    assert fcm.requests[-1].error_code == "UNREGISTERED"


def test_scripted_quota_exceeded_is_429_with_retry_after(fcm: MockFcm) -> None:
    fcm.script("busy-token", Answer(error_code="QUOTA_EXCEEDED", retry_after=30), times=1)
    token = access_token(fcm)

    response = send(fcm, token, {"message": {**VALID_MESSAGE, "token": "busy-token"}})

    assert response.status_code == 429
    assert response.headers["retry-after"] == "30"
    assert response.json()["error"]["status"] == "RESOURCE_EXHAUSTED"
    assert fcm_error_code(response) == "QUOTA_EXCEEDED"
    assert send(fcm, token, {"message": {**VALID_MESSAGE, "token": "busy-token"}}).status_code == 200


@pytest.mark.parametrize(
    "message",
    [
        {key: value for key, value in VALID_MESSAGE.items() if key != "token"},
        {**VALID_MESSAGE, "token": ""},
        {**VALID_MESSAGE, "android": {"ttl": "3600"}},
        {**VALID_MESSAGE, "android": {"ttl": "-5s"}},
        {**VALID_MESSAGE, "android": {"priority": "high"}},
        {**VALID_MESSAGE, "data": {"count": 3}},
        {**VALID_MESSAGE, "notification": {"title": "x", "subtitle": "y"}},
        {**VALID_MESSAGE, "data": {"blob": "x" * 4100}},
        {**VALID_MESSAGE, "android": {"collapse_key": "a", "collapseKey": "b"}},
    ],
    ids=[
        "no-token",
        "empty-token",
        "ttl-without-s",
        "negative-ttl",
        "lowercase-priority",
        "data-not-string",
        "unknown-field",
        "too-big",
        "both-spellings",
    ],
)
def test_a_malformed_message_is_400_invalid_argument(fcm: MockFcm, message: dict[str, Any]) -> None:
    response = send(fcm, access_token(fcm), {"message": message})

    assert response.status_code == 400, response.text
    assert response.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert fcm_error_code(response) == "INVALID_ARGUMENT"
    assert fcm.wait_for_requests(1)[0].status == 400


def test_bad_assertions_are_refused(fcm: MockFcm) -> None:
    with pytest.raises(RefreshError, match="invalid_scope"):
        refresh(fcm, credentials(fcm, ["https://www.googleapis.com/auth/userinfo.email"]))

    fcm.service_account_file(PROJECT)
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = int(time.time())
    claims = {
        "iss": f"reminders@{PROJECT}.iam.gserviceaccount.com",
        "aud": fcm.token_uri,
        "scope": FCM_SCOPE,
        "iat": now,
        "exp": now + 3600,
    }
    form = {
        "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
        "assertion": jwt.encode(claims, stranger, algorithm="RS256"),
    }
    with client(fcm) as http:
        response = http.post(fcm.token_uri, data=form)

    assert response.status_code == 400
    assert response.json()["error"] == "invalid_grant"
    assert fcm.tokens_issued == 0


def test_a_scripted_token_endpoint_answers_its_oauth_error_until_unscripted(fcm: MockFcm) -> None:
    creds = credentials(fcm)
    session = requests_session(fcm)
    for status, error in ((400, "invalid_grant"), (503, "temporarily_unavailable")):
        fcm.script_token(status)
        answered = session.post(fcm.token_uri, data={"grant_type": "x"}, timeout=10)
        assert (answered.status_code, answered.json()["error"]) == (status, error)
    fcm.script_token(None)
    refresh(fcm, creds)
    assert creds.valid and fcm.tokens_issued == 1 and fcm.token_requests == 3
