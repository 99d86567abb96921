"""A strict mock of a Web Push service (RFC 8030): an ASGI app served over TLS by hypercorn (``tls_loop``).

It plays the part of Mozilla's autopush or FCM's web push endpoint for one sender under test, and
it is stricter than either where they trust the sender, because it also holds the browser's keys:

* ``subscribe()`` makes what a browser's ``PushSubscription.toJSON()`` gives a page: an endpoint
  ``https://127.0.0.1:<port>/wpush/<id>`` (``https://[::1]:<port>/…`` from
  ``MockWebPush(host="::1")``) and the user agent's P-256 ``p256dh`` key and 16-byte ``auth``
  secret. The mock keeps the private half and decrypts every message (RFC 8291).
* ``POST /wpush/<id>`` is checked in this order, each failure answered with autopush's JSON body
  ``{"code", "errno", "error", "message", "more_info"}``:

  - an id the mock never issued: 404, errno 102; one dropped by ``unsubscribe()``: 410, errno 106;
    another method than POST: 405;
  - VAPID (RFC 8292), required as FCM requires it: ``Authorization: vapid t=<JWT>, k=<key>``, an
    ES256 JWT verified with ``k`` (the uncompressed P-256 point, base64url), ``aud`` exactly the
    endpoint's origin, ``exp`` in the future and at most 24 h ahead, ``sub`` a ``mailto:`` or
    ``https:`` URI; and ``k`` the subscription's ``applicationServerKey`` when it was made with
    one. Every VAPID failure, a wrong ``aud`` included, is 401 with errno 109, as autopush answers.
    The draft scheme (``WebPush <JWT>`` + ``Crypto-Key: p256ecdsa=``) is refused the same way;
  - ``TTL`` (missing or not an integer: 400 errno 111; negative: 400 errno 114), ``Urgency``
    (very-low, low, normal or high, else 400) and ``Topic`` (up to 32 characters of the URL-safe
    base64 alphabet, else 400 errno 113);
  - a body needs ``Content-Encoding: aes128gcm`` and no ``dh``/``salt`` of the older drafts in
    ``Crypto-Key``/``Encryption`` (else 400 errno 110), at most 4096 bytes (else 413 errno 104),
    and one record (RFC 8291 §4) that decrypts with the subscription's keys (else 400 errno 110).
    A push without a body (no payload, as RFC 8030 allows) needs no Content-Encoding;
  - then the subscription's ``Answer``: 201 Created with ``Location`` and ``TTL`` and no body by
    default, or a scripted status (404/410/413/429/500/503 ... with the JSON body; ``Retry-After``
    when the answer has one; 410 also with ``Cache-Control: max-age=86400``, as autopush sends).

* HTTP/2 with h2's default windows and flow control both ways, as hypercorn serves it; ALPN offers
  ``h2`` and ``http/1.1``, and a client that picks HTTP/1.1 (or offers no ALPN) gets the same
  checks, so a sender that quietly falls back is visible in ``protocol``.

It runs on ``tls_loop``'s loop in a background thread. Keys and certificates are generated when it
is created; nothing secret lives in the repository.
"""

from __future__ import annotations

import http
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import http_ece
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from starlette.requests import Request

from reminders_pipeline.domain.b64url import decode as b64url_decode
from reminders_pipeline.domain.b64url import encode as b64url

from .tls_loop import AsgiServer, Reply, Scripts, parsed_json, request_target

MAX_PAYLOAD_BYTES = 4096
VAPID_MAX_LIFETIME_SECONDS = 24 * 3600
MAX_TTL_SECONDS = 60 * 24 * 3600  # autopush lowers a longer TTL to this, silently
URGENCIES = ("very-low", "low", "normal", "high")
PATH = re.compile(r"^/wpush/(?P<id>[^/?]*)$")
TOPIC = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
VAPID_PARAM = re.compile(r"^\s*(?P<name>[A-Za-z]+)\s*=\s*(?P<value>[^\s,]*)\s*$")
MORE_INFO = "http://autopush.readthedocs.io/en/latest/http.html#error-codes"
AES128GCM_HEADER_BYTES = 21  # salt(16) rs(4) idlen(1), then the keyid: the sender's 65-byte public point
# Scripted error statuses: autopush's errno and message where it has one.
SCRIPTED_ERRORS: dict[int, tuple[int | None, str]] = {
    404: (102, "Invalid token"),
    410: (106, "No such subscription"),
    413: (104, "Payload too large"),
}


@dataclass(frozen=True)
class Answer:
    """How the mock answers one request to a subscription that passed validation."""

    status: int = 201
    retry_after: int | None = None  # seconds, sent as Retry-After (e.g. with 429 or 503)
    delay: float = 0.0  # seconds before answering: a slow push service


@dataclass(frozen=True)
class RecordedRequest:
    endpoint: str  # the URL the request was sent to (origin + path)
    status: int  # what the mock answered
    ttl: int | None  # None when the TTL header was missing or not an integer
    urgency: str | None
    topic: str | None
    payload: Any  # the decrypted body parsed as JSON, or None when it is not JSON (or not decrypted)
    plaintext: bytes | None  # the decrypted body; b"" for a push without one; None when it failed a check
    at: float  # time.time() when the request was complete
    headers: dict[str, str] = field(default_factory=dict)
    protocol: str = "h2"  # "h2" or "http/1.1"
    error: str | None = None  # why the mock refused it; None when it got its scripted answer
    location: str | None = None  # the Location of an accepted message


@dataclass(frozen=True)
class _Subscription:
    id: str
    private_key: ec.EllipticCurvePrivateKey
    auth: bytes
    application_server_key: bytes | None


class _Refused(Exception):
    """A check failed: answer ``status`` with autopush's error body."""

    def __init__(self, status: int, errno: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.errno = errno

    def reply(self, headers: Sequence[tuple[str, str]] = (), delay: float = 0.0) -> Reply:
        body = {
            "code": self.status,
            "errno": self.errno,
            "error": http.HTTPStatus(self.status).phrase,
            "message": str(self),
            "more_info": MORE_INFO,
        }
        extra = [("cache-control", "max-age=86400")] if self.status == 410 else []
        return Reply(
            self.status, [*headers, *extra, ("content-type", "application/json")], json.dumps(body).encode(), delay
        )


class MockWebPush(AsgiServer[RecordedRequest]):
    """A Web Push service look-alike in a background thread. ``start()`` → ``(host, port)``; ``stop()``.

    ``subscribe()`` returns a browser's subscription JSON; every request to its endpoint answers
    201 unless ``subscribe(answer)`` or ``script(subscription, answer)`` says otherwise. Everything
    it saw is in ``requests``, with the decrypted payload.
    """

    # ``https://127.0.0.1:<port>`` (``https://[::1]:<port>``): every endpoint's origin, the VAPID ``aud`` it expects.
    origin = AsgiServer.url

    def __init__(self, *, workdir: str | Path | None = None, host: str = "127.0.0.1") -> None:
        # host "::1": endpoints with an IPv6 literal host, https://[::1]:<port>/...
        super().__init__(workdir, name="mock-webpush", host=host)
        self._subscriptions: dict[str, _Subscription] = {}
        self._unsubscribed: set[str] = set()
        # The service's clock for VAPID ``exp``; a test may pin it. reset() keeps it.
        self.clock: Callable[[], float] = time.time

    # -- subscriptions and scripts ---------------------------------------------------------

    def subscribe(
        self, answer: Answer | None = None, *, application_server_key: str | bytes | None = None
    ) -> dict[str, Any]:
        """A new subscription as ``PushSubscription.toJSON()`` gives it: a fresh P-256 key pair and
        auth secret (the mock keeps the private key). With ``application_server_key`` (the VAPID
        public key, base64url or raw), requests must be signed by that key, as a browser's
        ``subscribe({applicationServerKey})`` binds them."""
        if self._loop is None:
            raise RuntimeError("start the mock before subscribing: the endpoint needs its port")
        if isinstance(application_server_key, str):
            application_server_key = b64url_decode(application_server_key)
        private_key = ec.generate_private_key(ec.SECP256R1())
        auth = secrets.token_bytes(16)
        sub_id = secrets.token_urlsafe(32)
        with self._lock:
            self._subscriptions[sub_id] = _Subscription(sub_id, private_key, auth, application_server_key)
            if answer is not None:
                self._scripts.set(sub_id, answer)
        public = private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        keys = {"p256dh": b64url(public), "auth": b64url(auth)}
        return {"endpoint": f"{self.origin}/wpush/{sub_id}", "expirationTime": None, "keys": keys}

    def script(self, subscription: str | Mapping[str, Any], answer: Answer) -> None:
        """Answer every later request to this subscription (its JSON or its endpoint) with ``answer``."""
        sub_id = self._id_of(subscription)
        with self._lock:
            self._scripts.set(sub_id, answer)

    def script_default(self, answer: Answer) -> None:
        """Answer every later request to a subscription not scripted on its own with ``answer``."""
        with self._lock:
            self._scripts.default = answer

    def unsubscribe(self, subscription: str | Mapping[str, Any]) -> None:
        """Forget a subscription as a browser does on ``unsubscribe()``: its endpoint answers 410."""
        sub_id = self._id_of(subscription)
        with self._lock:
            del self._subscriptions[sub_id]
            self._unsubscribed.add(sub_id)

    def _id_of(self, subscription: str | Mapping[str, Any]) -> str:
        endpoint = subscription if isinstance(subscription, str) else str(subscription["endpoint"])
        match = PATH.match(endpoint.removeprefix(self.origin))
        with self._lock:
            if not match or match["id"] not in self._subscriptions:
                raise KeyError(f"not a live subscription of this mock: {endpoint}")
        return match["id"]

    def _reset_state(self) -> None:
        super()._reset_state()
        self._scripts = Scripts(Answer())  # every subscription answers 201 again

    def _more_stats(self) -> dict[str, Any]:
        return {"subscriptions": len(self._subscriptions)}

    # -- called from the server thread -----------------------------------------------------

    async def _respond(self, request: Request, protocol: str) -> Reply:
        path = request_target(request)
        headers = {":method": request.method, ":path": path, ":authority": request.headers.get("host", "")}
        headers.update(request.headers)
        body = await request.body()
        ttl: int | None = None
        plaintext: bytes | None = None
        error: str | None = None
        try:
            sub = self._subscription_for(request.method, path)
            self._check_vapid(headers.get("authorization"), sub)
            ttl = _check_push_headers(headers)
            plaintext = _check_body(headers, body, sub)
            with self._lock:
                reply = self._scripted_reply(self._scripts.next(sub.id), ttl)
        except _Refused as refused:  # the last check, the body's, is what sets plaintext
            reply = refused.reply([("allow", "POST")] if refused.status == 405 else [])
            error = str(refused)
        record = RecordedRequest(
            endpoint=f"{self.origin}{path}",
            status=reply.status,
            ttl=ttl,
            urgency=headers.get("urgency"),
            topic=headers.get("topic"),
            payload=parsed_json(plaintext or b""),
            plaintext=plaintext,
            at=time.time(),
            headers=headers,
            protocol=protocol,
            error=error,
            location=dict(reply.headers).get("location"),
        )
        self._record(record)
        return reply

    def _scripted_reply(self, answer: Answer, ttl: int) -> Reply:
        """The scripted answer to a request that passed every check."""
        headers = [] if answer.retry_after is None else [("retry-after", str(answer.retry_after))]
        if answer.status == 201:
            location = f"{self.origin}/m/{secrets.token_urlsafe(24)}"
            headers += [("location", location), ("ttl", str(min(ttl, MAX_TTL_SECONDS)))]
        if 200 <= answer.status < 300:
            return Reply(answer.status, headers, b"", answer.delay)
        errno, message = SCRIPTED_ERRORS.get(answer.status, (None, http.HTTPStatus(answer.status).phrase))
        return _Refused(answer.status, errno, message).reply(headers, answer.delay)

    def _subscription_for(self, method: str, path: str) -> _Subscription:
        match = PATH.match(path)
        with self._lock:
            sub = self._subscriptions.get(match["id"]) if match else None
            gone = match is not None and match["id"] in self._unsubscribed
        if gone:
            raise _Refused(410, 106, "No such subscription")
        if sub is None:
            raise _Refused(404, 102, "Invalid token")
        if method != "POST":
            raise _Refused(405, None, f"Method {method} not allowed; a push message is a POST")
        return sub

    def _check_vapid(self, authorization: str | None, sub: _Subscription) -> None:
        """RFC 8292: ``vapid t=<JWT>, k=<key>``; every failure is 401 errno 109, as autopush answers."""
        if not authorization:
            raise _Refused(401, 109, "Missing Authorization header: VAPID (RFC 8292) is required")
        scheme, _, params = authorization.strip().partition(" ")
        if scheme.lower() != "vapid":
            raise _Refused(401, 109, f"Unsupported Authorization scheme {scheme!r}: use 'vapid t=..., k=...'")
        values: dict[str, str] = {}
        for part in params.split(","):
            param = VAPID_PARAM.match(part)
            if not param:
                raise _Refused(401, 109, "Malformed vapid Authorization header")
            values[param["name"].lower()] = param["value"]
        if "t" not in values or "k" not in values:
            raise _Refused(401, 109, "vapid Authorization needs both t= and k=")
        try:
            raw_key = b64url_decode(values["k"])
            public_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), raw_key)
        except ValueError:
            raise _Refused(401, 109, "k= is not a base64url uncompressed P-256 public key") from None
        if len(raw_key) != 65:
            raise _Refused(401, 109, "k= must be the 65-byte uncompressed point")
        if sub.application_server_key is not None and raw_key != sub.application_server_key:
            raise _Refused(401, 109, "VAPID key does not match the subscription's applicationServerKey")
        try:
            if jwt.get_unverified_header(values["t"]).get("alg") != "ES256":
                raise _Refused(401, 109, "VAPID JWT must be ES256")
            claims = jwt.decode(
                values["t"],
                public_key,
                algorithms=["ES256"],
                options={"verify_exp": False, "verify_aud": False, "verify_iat": False, "verify_nbf": False},
            )
        except jwt.PyJWTError as exc:
            raise _Refused(401, 109, f"Invalid VAPID JWT: {exc}") from None
        exp = claims.get("exp")
        now = self.clock()
        if not isinstance(exp, int) or isinstance(exp, bool):
            raise _Refused(401, 109, "VAPID JWT needs a numeric exp")
        if exp <= now:
            raise _Refused(401, 109, "VAPID JWT has expired")
        if exp > now + VAPID_MAX_LIFETIME_SECONDS:
            raise _Refused(401, 109, "VAPID JWT exp is more than 24 hours ahead")
        if claims.get("aud") != self.origin:
            raise _Refused(401, 109, f"VAPID aud {claims.get('aud')!r} is not this push service's origin {self.origin}")
        sub_claim = claims.get("sub")
        if not isinstance(sub_claim, str) or not sub_claim.startswith(("mailto:", "https:")):
            raise _Refused(401, 109, "VAPID sub must be a mailto: or https: URI")


def _check_push_headers(headers: dict[str, str]) -> int:
    """The message's TTL, once it and the Urgency and Topic headers are valid."""
    ttl_text = headers.get("ttl")
    if ttl_text is None or not re.fullmatch(r"-?\d+", ttl_text.strip()):
        raise _Refused(400, 111, "Missing TTL value")
    ttl = int(ttl_text)
    if ttl < 0:
        raise _Refused(400, 114, "TTL must be greater than 0")
    urgency = headers.get("urgency")
    if urgency is not None and urgency not in URGENCIES:
        raise _Refused(400, None, f"Urgency must be one of {', '.join(URGENCIES)}")
    topic = headers.get("topic")
    if topic is not None and not TOPIC.match(topic):
        raise _Refused(400, 113, "Topic must be at most 32 characters of the URL and filename safe base64 alphabet")
    return ttl


def _check_body(headers: dict[str, str], body: bytes, sub: _Subscription) -> bytes:
    """The plaintext: RFC 8291 with one record; anything a browser could not read is 400 errno 110."""
    if not body:
        return b""  # a push without payload (RFC 8030 §5): no encryption headers needed
    encoding = headers.get("content-encoding")
    if encoding is None:
        raise _Refused(400, 110, "Missing Content-Encoding header")
    if encoding.strip().lower() != "aes128gcm":
        raise _Refused(400, 110, f"Unsupported Content-Encoding {encoding!r}: only aes128gcm (RFC 8291)")
    if re.search(r"(^|[;,\s])dh=", headers.get("crypto-key", "")):
        raise _Refused(400, 110, "Do not include 'dh' in the aes128gcm Crypto-Key header")
    if re.search(r"(^|[;,\s])salt=", headers.get("encryption", "")):
        raise _Refused(400, 110, "Do not include 'salt' in the aes128gcm Encryption header")
    if len(body) > MAX_PAYLOAD_BYTES:
        raise _Refused(413, 104, f"Payload of {len(body)} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")
    if len(body) < AES128GCM_HEADER_BYTES or body[20] != 65:
        raise _Refused(400, 110, "aes128gcm header must carry the sender's 65-byte public key as keyid")
    if len(body) - AES128GCM_HEADER_BYTES - 65 > int.from_bytes(body[16:20], "big"):
        raise _Refused(400, 110, "A push message must be a single aes128gcm record (RFC 8291 §4)")
    try:
        return bytes(http_ece.decrypt(body, private_key=sub.private_key, auth_secret=sub.auth, version="aes128gcm"))
    except Exception as exc:  # http_ece raises ECEException, and ValueError for a bad point
        raise _Refused(400, 110, f"Payload does not decrypt with the subscription's keys: {exc}") from None
