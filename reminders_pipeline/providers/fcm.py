"""Firebase Cloud Messaging HTTP v1 as a ``Sender``: one POST per alert to
``/v1/projects/{project}/messages:send`` over one shared HTTP/2 client, authorised by an OAuth2
access token that google-auth makes from a service-account key and that is refreshed before it
expires (the refresh, a blocking call, runs in a thread, one at a time, waited for at most the send
timeout). A token endpoint that cannot be reached, times out or answers 5xx sends every row of the
batch back to pending unsent (``fcm_token_unreachable``); one that refuses the key (a 4xx such as
``invalid_grant``) is a configuration fault.

The message carries a notification (the alert's title and body), the row as data (FCM's data
values are strings), ``android.ttl`` the seconds to the event's start (or end), so a phone offline
until then never shows it, and ``android.collapse_key`` one per item.

Answers: 200 sent; ``UNREGISTERED`` (404) marks the device, as APNs' ``Unregistered`` does (by
FCM's ``errorCode``: a 404 without one is a wrong URL, not a dead token); ``INVALID_ARGUMENT`` (400)
and ``THIRD_PARTY_AUTH_ERROR`` (401, the APNs or web push credentials of one app) fail the row; ``QUOTA_EXCEEDED`` (429), ``UNAVAILABLE`` (503)
and ``INTERNAL`` (500) back off, honouring ``Retry-After``; 502, 504 and any other 5xx fail the row,
never sent again (a front end's answer, or a deadline past, may come after FCM took the message);
``SENDER_ID_MISMATCH`` (403: a token of another app, or our key of another project) goes again,
spending an attempt, and halts FCM as a configuration fault once several devices in a row answer it,
so one device registered with a foreign token halts no one; any other 401 or 403 (our credentials
or project refused) is a configuration fault for every device. A request never written (no
connection, a connect or TLS handshake or a wait for a connection past the send timeout: a
blackholed front end) goes back to pending, spending no attempt, and counts toward FCM's outage;
one written and unanswered within the send timeout from then fails ``timeout`` (``request_trace``).
The whole table: docs/operations.md, "Every FCM answer".
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import httpx
import requests
from google.auth.exceptions import GoogleAuthError, TransportError
from google.auth.transport.requests import Request
from google.oauth2 import service_account

from reminders_pipeline.config.settings import Settings
from reminders_pipeline.domain.wire import Notification, fcm_message
from reminders_pipeline.providers import request_trace
from reminders_pipeline.providers.base import SendResult, fence_expired
from reminders_pipeline.providers.request_trace import Attempt, FencePassed
from reminders_pipeline.providers.webpush import NOT_PROCESSED, retry_after

SCOPES = ["https://www.googleapis.com/auth/firebase.messaging"]
TOKEN_INVALID = frozenset({"UNREGISTERED"})  # FcmError codes: the token is dead, not us
# The APNs certificate or web push key of the app behind one token (a 401): that row fails, the
# device stays, and nothing halts.
ONE_APP = frozenset({"THIRD_PARTY_AUTH_ERROR"})
# A token of another app's project, or our key of another project (then every token answers it):
# the row goes again, spending an attempt, and FCM halts once several devices in a row answer it
# (``faults.Outage.maybe_ours``), so one device registered with a foreign token halts no one.
MAYBE_OURS = frozenset({"SENDER_ID_MISMATCH"})
BACK_OFF = frozenset({"QUOTA_EXCEEDED", "UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED"})


def load_credentials(settings: Settings) -> tuple[service_account.Credentials, str]:
    """The service account's credentials and its project, checked before any claim."""
    if not settings.fcm_credentials_file:
        raise RuntimeError("FCM needs REMINDERS_FCM_CREDENTIALS_FILE (a service-account key)")
    try:
        with open(settings.fcm_credentials_file, encoding="utf-8") as f:
            info = json.load(f)
        credentials = service_account.Credentials.from_service_account_info(info, scopes=SCOPES)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeError(
            f"REMINDERS_FCM_CREDENTIALS_FILE is not a service-account key ({type(exc).__name__})"
        ) from None
    project = info.get("project_id")
    if not isinstance(project, str) or not project:
        raise RuntimeError("REMINDERS_FCM_CREDENTIALS_FILE names no project_id")
    return credentials, project


# What every row of a batch gets when no access token can be had. Unreachable: the token endpoint
# refused the connection, timed out or answered 5xx, 408 or 429; it says nothing of our key, and no
# message left (status None: no attempt spent). Refused: it answered another 4xx (invalid_grant: the
# key is revoked or not the service account's), our configuration's fault.
UNREACHABLE = SendResult(0, False, reason="fcm_token_unreachable", retry=True)
REFUSED = SendResult(0, False, reason="fcm:not-sent:token_refresh", retry=True, config_fault=True)


class TokenRequest(Request):
    """google-auth's ``Request`` bounded by ``timeout`` (its default waits 120 s), remembering the
    status of the token endpoint's last answer."""

    def __init__(self, session: requests.Session, timeout: float) -> None:
        super().__init__(session)
        self.timeout = timeout
        self.status: int | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.status = None
        response = super().__call__(*args, **{**kwargs, "timeout": self.timeout})  # type: ignore[no-untyped-call]
        self.status = response.status
        return response


def token_failure(exc: Exception, status: int | None) -> SendResult:
    """A failed refresh as each row's result: ``UNREACHABLE`` unless the token endpoint answered a
    4xx other than 408 and 429 (``REFUSED``)."""
    if isinstance(exc, TransportError | requests.RequestException) or status is None:
        return UNREACHABLE
    return UNREACHABLE if status >= 500 or status in (408, 429) else REFUSED


class FcmSender:
    """Sends each notification once, never retried here; one ``SendResult`` per notification."""

    def __init__(self, settings: Settings, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.credentials, project = load_credentials(settings)
        self.url = f"{settings.fcm_url.rstrip('/')}/v1/projects/{project}/messages:send"
        self.monotonic = monotonic
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=settings.fcm_ca_file) if settings.fcm_ca_file else True
        )
        limits = httpx.Limits(max_connections=settings.fcm_concurrency)
        self.timeout = settings.send_timeout_seconds
        self.client = httpx.AsyncClient(http2=True, verify=verify, limits=limits, timeout=self.timeout, trust_env=False)
        self.session = requests.Session()  # google-auth's token requests
        self.session.verify = settings.fcm_ca_file or True
        self.session.trust_env = False  # else REQUESTS_CA_BUNDLE overrides ``verify``, and proxy variables apply
        self.token_request = TokenRequest(self.session, self.timeout)
        self.slots = asyncio.Semaphore(settings.fcm_concurrency)
        self.refreshing = asyncio.Lock()
        self.refresh: asyncio.Future[None] | None = None  # a token refresh under way, in its thread

    async def _token(self) -> str | SendResult:
        """A valid access token, refreshed (once, whoever asks meanwhile) when it is near its end;
        else what each row's result is to be (``token_failure``). The refresh, a blocking call, runs
        in a thread and is waited for at most the send timeout; one that outlasts it goes on, and
        the next batch waits for it instead of starting another."""
        async with self.refreshing:
            if not self.credentials.valid:
                if self.refresh is None:
                    self.refresh = asyncio.ensure_future(
                        asyncio.to_thread(self.credentials.refresh, self.token_request)
                    )
                try:
                    await asyncio.wait_for(asyncio.shield(self.refresh), self.timeout)
                except TimeoutError:
                    return UNREACHABLE
                except (GoogleAuthError, requests.RequestException) as exc:
                    return token_failure(exc, self.token_request.status)
                finally:
                    if self.refresh.done():
                        self.refresh = None
        token = self.credentials.token
        return token if isinstance(token, str) else REFUSED

    async def send_many(self, notifications: Sequence[Notification]) -> list[SendResult]:
        token = await self._token()
        if isinstance(token, SendResult):  # nothing sent: back to pending
            return [replace(token, row_id=n.row_id) for n in notifications]
        return list(await asyncio.gather(*(self._one(n, token) for n in notifications)))

    async def _one(self, note: Notification, token: str) -> SendResult:
        async with self.slots:
            if note.past_deadline(self.monotonic()):
                return fence_expired(note.row_id)
            attempt = Attempt(self.timeout, note.send_by, self.monotonic)
            try:
                async with attempt.bounded() as extensions:  # to write it, then for the whole answer
                    response = await self.client.post(
                        self.url,
                        json=fcm_message(note, time.time()),
                        headers={"Authorization": f"Bearer {token}"},
                        extensions=extensions,
                    )
            except (TimeoutError, FencePassed, httpx.HTTPError) as exc:
                return transport_failure(note.row_id, exc, attempt.written, attempt.connecting)
        result = answer(note.row_id, response, self.monotonic())
        if result.config_fault:
            self.credentials.token = None  # refused: the next send refreshes it first
        return result

    async def aclose(self) -> None:
        if self.refresh is not None:
            self.refresh.cancel()  # its thread ends within its own timeout; its outcome is no one's now
        await self.client.aclose()
        self.session.close()


def transport_failure(row_id: int, exc: Exception, written: bool, connecting: bool = True) -> SendResult:
    """A request to FCM that got no answer (``request_trace.transport_failure``): FCM's front end
    is our provider, so one never reached counts toward its outage."""
    return request_trace.transport_failure(row_id, exc, written=written, outage=True, connecting=connecting)


def error_code(response: httpx.Response) -> str:
    """FCM's ``errorCode`` from the error's details, else its status (``NOT_FOUND``), else ''."""
    try:
        error = response.json()["error"]
        details = error.get("details") or ()
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""
    for detail in details if isinstance(details, list) else ():
        if isinstance(detail, dict) and detail.get("errorCode"):
            return str(detail["errorCode"])
    return str(error.get("status") or "")


def _message_id(response: httpx.Response) -> str | None:
    """The message's name FCM gave (``projects/p/messages/0:…``), its last 64 characters."""
    try:
        name = response.json().get("name")
    except (ValueError, AttributeError):
        return None
    return str(name)[-64:] if name else None


def answer(row_id: int, response: httpx.Response, answered_at: float) -> SendResult:
    """FCM's answer as a ``SendResult`` (see the module docstring)."""
    status = response.status_code
    if status == 200:
        return SendResult(
            row_id, True, status=status, provider_message_id=_message_id(response), answered_at=answered_at
        )
    code = error_code(response)
    reason = code or f"http_{status}"
    if code in TOKEN_INVALID:
        return SendResult(row_id, False, reason=reason, status=status, token_invalid=True, answered_at=answered_at)
    if code in ONE_APP:
        return SendResult(row_id, False, reason=reason, status=status, answered_at=answered_at)
    if code in MAYBE_OURS:
        return SendResult(
            row_id, False, reason=f"fcm:{code}", status=status, retry=True, outage=False, maybe_ours=True,
            answered_at=answered_at,
        )  # fmt: skip
    if status in (401, 403):  # our credentials or project refused
        return SendResult(
            row_id, False, reason=f"fcm:{reason}", status=status, config_fault=True, answered_at=answered_at
        )
    if status in NOT_PROCESSED or (code in BACK_OFF and status < 500):
        wait = retry_after(response.headers.get("retry-after"), time.time())
        return SendResult(
            row_id, False, reason=reason, status=status, retry=True, retry_after=wait, answered_at=answered_at
        )
    if status >= 500:  # 502, 504 and the rest may come after FCM took it: failed, and no sign either way of an outage
        return SendResult(row_id, False, reason=reason, status=status, outage=False, answered_at=answered_at)
    return SendResult(row_id, False, reason=reason, status=status, answered_at=answered_at)
