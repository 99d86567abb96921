"""A strict mock of a Web Push service (RFC 8030): HTTP/2 over TLS on raw ``h2`` + asyncio.

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

* h2's default windows are kept and received DATA is acknowledged as it is consumed; an answer's
  body waits for the client's WINDOW_UPDATE as a real server's would. Stopping sends GOAWAY.
* ALPN offers ``h2`` and ``http/1.1``; a client that picks HTTP/1.1 (or offers no ALPN) is served
  by ``h11`` with the same checks, so a sender that quietly falls back is visible in ``protocol``.

It runs its own event loop in a background thread, so a synchronous test, an asyncio test and a
benchmark script can all use it. Keys and certificates are generated when it is created; nothing
secret lives in the repository. ``python -m reminders_pipeline_testing.mock_webpush`` runs one in
its own process, prints where it listens as JSON, and answers ``subscribe`` / ``stats`` / ``reset``
/ ``stop`` on stdin.
"""

from __future__ import annotations

import asyncio
import http
import json
import re
import secrets
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import http_ece
import jwt
import trustme
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset, WindowUpdated
from h2.exceptions import ProtocolError, StreamClosedError

from reminders_pipeline.domain.b64url import decode as b64url_decode
from reminders_pipeline.domain.b64url import encode as b64url

from .tls_loop import LoopServer

MAX_PAYLOAD_BYTES = 4096
VAPID_MAX_LIFETIME_SECONDS = 24 * 3600
MAX_TTL_SECONDS = 60 * 24 * 3600  # autopush lowers a longer TTL to this, silently
URGENCIES = ("very-low", "low", "normal", "high")
PATH = re.compile(r"^/wpush/(?P<id>[^/?]*)$")
TOPIC = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
VAPID_PARAM = re.compile(r"^\s*(?P<name>[A-Za-z]+)\s*=\s*(?P<value>[^\s,]*)\s*$")
MORE_INFO = "http://autopush.readthedocs.io/en/latest/http.html#error-codes"
AES128GCM_HEADER_BYTES = 21  # salt(16) rs(4) idlen(1), then the keyid: the sender's 65-byte public point


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


@dataclass
class _Subscription:
    id: str
    endpoint: str
    private_key: ec.EllipticCurvePrivateKey
    auth: bytes
    application_server_key: bytes | None
    answer: Answer | None  # None: the default (201)


@dataclass(frozen=True)
class _Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    delay: float = 0.0


class _Refused(Exception):
    """A check failed: answer ``status`` with autopush's error body."""

    def __init__(self, status: int, errno: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.errno = errno
        self.message = message


@dataclass
class _Stream:
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)
    size: int = 0  # bytes received; the body keeps only the first MAX_PAYLOAD_BYTES + 1


class _AlpnSwitch(asyncio.Protocol):
    """Accepts the TLS connection, then hands it to the HTTP/2 or HTTP/1.1 side ALPN chose."""

    def __init__(self, server: MockWebPush) -> None:
        self.server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ssl_object = transport.get_extra_info("ssl_object")
        chosen = ssl_object.selected_alpn_protocol() if ssl_object is not None else None
        protocol: _H2Connection | _H11Connection
        protocol = _H2Connection(self.server) if chosen == "h2" else _H11Connection(self.server)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)


class _H2Connection(asyncio.Protocol):
    """One HTTP/2 client connection: h2 framing, flow control both ways, GOAWAY on stop."""

    def __init__(self, server: MockWebPush) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.conn = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        self.streams: dict[int, _Stream] = {}
        self.blocked: dict[int, bytes] = {}  # answer bodies waiting for the client's flow-control credit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._opened(self)
        self.conn.initiate_connection()  # h2's default SETTINGS: 64 KB windows, 100 streams
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._closed(self)
        self.streams.clear()
        self.blocked.clear()

    def flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except ProtocolError:
            self.flush()  # the GOAWAY h2 queued
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            self._on_event(event)
        self.flush()

    def _on_event(self, event: object) -> None:
        if isinstance(event, RequestReceived):
            self.streams[event.stream_id] = _Stream({_text(k): _text(v) for k, v in event.headers})
        elif isinstance(event, DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.size += len(event.data)
                room = MAX_PAYLOAD_BYTES + 1 - len(stream.body)
                if room > 0:
                    stream.body += event.data[:room]
            # Consumed: give the credit back (h2 sends WINDOW_UPDATE once enough has been read).
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                reply = self.server._handle(stream.headers, bytes(stream.body), stream.size, "h2")
                if reply.delay > 0:
                    asyncio.get_running_loop().call_later(reply.delay, self._answer, event.stream_id, reply)
                else:
                    self._answer(event.stream_id, reply)
        elif isinstance(event, StreamReset):
            self.blocked.pop(event.stream_id, None)
            self.streams.pop(event.stream_id, None)
        elif isinstance(event, WindowUpdated):
            self._send_blocked()
        elif isinstance(event, ConnectionTerminated):
            if self.transport is not None:
                self.transport.close()

    def _answer(self, stream_id: int, reply: _Reply) -> None:
        if self.streams.pop(stream_id, None) is None:
            return  # reset by the client, or the connection is gone
        if self.transport is None or self.transport.is_closing():
            return
        headers = [(":status", str(reply.status)), *reply.headers]
        try:
            if not reply.body:
                self.conn.send_headers(stream_id, headers, end_stream=True)
            else:
                self.conn.send_headers(stream_id, [*headers, ("content-length", str(len(reply.body)))])
                self.blocked[stream_id] = reply.body
                self._send_blocked()
        except (StreamClosedError, ProtocolError):
            return
        self.flush()

    def _send_blocked(self) -> None:
        """Send each waiting body whose stream and connection windows both have room.

        A real HTTP/2 server does the same: DATA beyond the peer's window waits for its
        WINDOW_UPDATE. The bodies are one frame each (the service's answers are small).
        """
        for stream_id, body in list(self.blocked.items()):
            try:
                if self.conn.local_flow_control_window(stream_id) < len(body):
                    continue
                self.conn.send_data(stream_id, body, end_stream=True)
            except (StreamClosedError, ProtocolError):
                pass
            del self.blocked[stream_id]
        self.flush()

    def go_away(self) -> None:
        """GOAWAY(NO_ERROR) naming the last stream seen, then close once it is written."""
        if self.transport is None or self.transport.is_closing():
            return
        try:
            self.conn.close_connection()
        except ProtocolError:
            pass
        self.flush()
        self.transport.close()


class _H11Connection(asyncio.Protocol):
    """One HTTP/1.1 client connection (ALPN fallback): one request at a time, keep-alive."""

    def __init__(self, server: MockWebPush) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.conn = h11.Connection(h11.SERVER)
        self.stream: _Stream | None = None
        self.busy = False  # a request is being answered; later (pipelined) ones wait in h11's buffer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._closed(self)

    def data_received(self, data: bytes) -> None:
        self.conn.receive_data(data)
        self._process()

    def eof_received(self) -> bool | None:
        self.conn.receive_data(b"")
        self._process()
        return None

    def _process(self) -> None:
        while not self.busy and self.transport is not None and not self.transport.is_closing():
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                self._send(_Reply(400, [("connection", "close")], b""))
                self.transport.close()
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
                headers[":method"] = event.method.decode("ascii")
                headers[":path"] = event.target.decode("latin-1")
                headers[":authority"] = headers.get("host", "")
                self.stream = _Stream(headers)
            elif isinstance(event, h11.Data) and self.stream is not None:
                self.stream.size += len(event.data)
                room = MAX_PAYLOAD_BYTES + 1 - len(self.stream.body)
                if room > 0:
                    self.stream.body += event.data[:room]
            elif isinstance(event, h11.EndOfMessage) and self.stream is not None:
                stream, self.stream = self.stream, None
                reply = self.server._handle(stream.headers, bytes(stream.body), stream.size, "http/1.1")
                self.busy = True
                if reply.delay > 0:
                    asyncio.get_running_loop().call_later(reply.delay, self._answer, reply)
                else:
                    self._answer(reply)
            elif isinstance(event, h11.ConnectionClosed):
                self.transport.close()
                return

    def _answer(self, reply: _Reply) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self._send(reply)
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is h11.MUST_CLOSE:
            self.transport.close()
            return
        self.conn.start_next_cycle()
        self.busy = False
        self._process()

    def _send(self, reply: _Reply) -> None:
        assert self.transport is not None
        headers = [*reply.headers, ("content-length", str(len(reply.body)))]
        try:
            data = self.conn.send(h11.Response(status_code=reply.status, headers=headers)) or b""
            if reply.body:
                data += self.conn.send(h11.Data(data=reply.body)) or b""
            data += self.conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            self.transport.close()
            return
        self.transport.write(data)

    def go_away(self) -> None:
        if self.transport is not None:
            self.transport.close()


class MockWebPush(LoopServer):
    """A Web Push service look-alike in a background thread. ``start()`` → ``(host, port)``; ``stop()``.

    ``subscribe()`` returns a browser's subscription JSON; every request to its endpoint answers
    201 unless ``subscribe(answer)`` or ``script(subscription, answer)`` says otherwise. Everything
    it saw is in ``requests``, with the decrypted payload.
    """

    def __init__(self, *, workdir: str | Path | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(workdir, name="mock-webpush")
        self.host = host  # "::1": endpoints with an IPv6 literal host, https://[::1]:<port>/...
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._ca = trustme.CA()
        self.ca_file = self.workdir / "mock-webpush-ca.pem"
        self._ca.cert_pem.write_to_path(str(self.ca_file))
        self._lock = threading.Lock()
        self._subscriptions: dict[str, _Subscription] = {}
        self._unsubscribed: set[str] = set()
        # The service's clock for VAPID ``exp``; a test may pin it. reset() keeps it.
        self.clock: Callable[[], float] = time.time
        self._reset_state()
        self._connections: set[_H2Connection | _H11Connection] = set()

    # -- lifecycle: start(), stop() and the context manager are LoopServer's -------------------

    def _protocol(self) -> asyncio.Protocol:
        return _AlpnSwitch(self)

    async def _close_connections(self) -> None:
        """GOAWAY to every HTTP/2 client, a close to every HTTP/1.1 one; abort what lingers."""
        for connection in list(self._connections):
            connection.go_away()
        deadline = time.monotonic() + 0.25  # a client that holds on past GOAWAY is then aborted
        while self._connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(self._connections):
            if connection.transport is not None:
                connection.transport.abort()

    # -- subscriptions and scripts ---------------------------------------------------------

    @property
    def origin(self) -> str:
        """``https://127.0.0.1:<port>`` (``https://[::1]:<port>``): every endpoint's origin, the
        VAPID ``aud`` it expects."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}"

    url = origin

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
        endpoint = f"{self.origin}/wpush/{sub_id}"
        with self._lock:
            self._subscriptions[sub_id] = _Subscription(
                sub_id, endpoint, private_key, auth, application_server_key, answer
            )
        public = private_key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        return {"endpoint": endpoint, "expirationTime": None, "keys": {"p256dh": b64url(public), "auth": b64url(auth)}}

    def script(self, subscription: str | Mapping[str, Any], answer: Answer) -> None:
        """Answer every later request to this subscription (its JSON or its endpoint) with ``answer``."""
        sub_id = self._id_of(subscription)
        with self._lock:
            self._subscriptions[sub_id].answer = answer

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

    def reset(self) -> None:
        """Forget requests and scripts (every subscription answers 201 again); subscriptions stay."""
        with self._lock:
            self._reset_state()
            for subscription in self._subscriptions.values():
                subscription.answer = None

    def _reset_state(self) -> None:
        self._requests: list[RecordedRequest] = []
        self.connections_opened = 0

    # -- observations ----------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def wait_for_requests(self, count: int, timeout: float = 10.0) -> list[RecordedRequest]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self._requests) >= count:
                break
            time.sleep(0.005)
        return self.requests

    def decrypt(self, subscription: str | Mapping[str, Any], body: bytes) -> bytes:
        """What the browser would read from an aes128gcm ``body`` sent to ``subscription``."""
        sub_id = self._id_of(subscription)
        with self._lock:
            sub = self._subscriptions[sub_id]
        return _decrypt(sub, body)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": len(self._requests),
                "statuses": dict(Counter(r.status for r in self._requests)),
                "connections_opened": self.connections_opened,
                "open_connections": len(self._connections),
                "subscriptions": len(self._subscriptions),
            }

    # -- called from the server thread -----------------------------------------------------

    def _opened(self, connection: _H2Connection | _H11Connection) -> None:
        self._connections.add(connection)
        with self._lock:
            self.connections_opened += 1

    def _closed(self, connection: _H2Connection | _H11Connection) -> None:
        self._connections.discard(connection)

    def _handle(self, headers: dict[str, str], body: bytes, size: int, protocol: str) -> _Reply:
        """Judge one complete request, record it, and say what to answer."""
        path = headers.get(":path", "")
        facts: dict[str, Any] = {"ttl": None, "urgency": headers.get("urgency"), "topic": headers.get("topic")}
        location: str | None = None
        plaintext: bytes | None = None
        error: str | None = None
        try:
            sub = self._subscription_for(headers.get(":method", ""), path)
            self._check_vapid(headers.get("authorization"), sub)
            facts["ttl"] = self._check_push_headers(headers)
            plaintext = self._check_body(headers, body, size, sub)
            answer = sub.answer or Answer()
            reply_headers: list[tuple[str, str]] = []
            if answer.retry_after is not None:
                reply_headers.append(("retry-after", str(answer.retry_after)))
            if 200 <= answer.status < 300:
                if answer.status == 201:
                    location = f"{self.origin}/m/{secrets.token_urlsafe(24)}"
                    reply_headers += [("location", location), ("ttl", str(min(facts["ttl"], MAX_TTL_SECONDS)))]
                reply = _Reply(answer.status, reply_headers, b"", answer.delay)
            else:
                errno, message = _SCRIPTED_ERRORS.get(answer.status, (None, http.HTTPStatus(answer.status).phrase))
                refusal = _error_reply(_Refused(answer.status, errno, message), reply_headers)
                reply = _Reply(refusal.status, refusal.headers, refusal.body, answer.delay)
        except _Refused as refused:
            reply = _error_reply(refused, [("allow", "POST")] if refused.status == 405 else [])
            plaintext = None
            error = refused.message
        try:
            payload = json.loads(plaintext) if plaintext else None
        except ValueError:
            payload = None
        record = RecordedRequest(
            endpoint=f"{self.origin}{path}",
            status=reply.status,
            ttl=facts["ttl"],
            urgency=facts["urgency"],
            topic=facts["topic"],
            payload=payload,
            plaintext=plaintext,
            at=time.time(),
            headers=dict(headers),
            protocol=protocol,
            error=error,
            location=location,
        )
        with self._lock:
            self._requests.append(record)
        return reply

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

    @staticmethod
    def _check_push_headers(headers: dict[str, str]) -> int:
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

    @staticmethod
    def _check_body(headers: dict[str, str], body: bytes, size: int, sub: _Subscription) -> bytes:
        if size == 0:
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
        if size > MAX_PAYLOAD_BYTES:
            raise _Refused(413, 104, f"Payload of {size} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")
        return _decrypt(sub, body)


def _decrypt(sub: _Subscription, body: bytes) -> bytes:
    """RFC 8291 with one record; anything a browser could not read is 400 errno 110."""
    if len(body) < AES128GCM_HEADER_BYTES or body[20] != 65:
        raise _Refused(400, 110, "aes128gcm header must carry the sender's 65-byte public key as keyid")
    record_size = int.from_bytes(body[16:20], "big")
    if len(body) - AES128GCM_HEADER_BYTES - 65 > record_size:
        raise _Refused(400, 110, "A push message must be a single aes128gcm record (RFC 8291 §4)")
    try:
        return bytes(http_ece.decrypt(body, private_key=sub.private_key, auth_secret=sub.auth, version="aes128gcm"))
    except Exception as exc:  # http_ece raises ECEException, and ValueError for a bad point
        raise _Refused(400, 110, f"Payload does not decrypt with the subscription's keys: {exc}") from None


# Scripted error statuses: autopush's errno and message where it has one.
_SCRIPTED_ERRORS: dict[int, tuple[int | None, str]] = {
    404: (102, "Invalid token"),
    410: (106, "No such subscription"),
    413: (104, "Payload too large"),
}


def _error_reply(refused: _Refused, headers: list[tuple[str, str]]) -> _Reply:
    body = {
        "code": refused.status,
        "errno": refused.errno,
        "error": http.HTTPStatus(refused.status).phrase,
        "message": refused.message,
        "more_info": MORE_INFO,
    }
    extra = [("cache-control", "max-age=86400")] if refused.status == 410 else []
    return _Reply(refused.status, [*headers, *extra, ("content-type", "application/json")], json.dumps(body).encode())


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _serve_stdio(mock: MockWebPush) -> None:
    """Line protocol for a parent process: ``subscribe`` (prints the subscription JSON), ``stats``,
    ``reset``, ``stop``."""
    for line in sys.stdin:
        command = line.strip()
        if command == "subscribe":
            print(json.dumps(mock.subscribe()), flush=True)
        elif command == "stats":
            print(json.dumps(mock.stats()), flush=True)
        elif command == "reset":
            mock.reset()
            print(json.dumps({"ok": True}), flush=True)
        elif command == "stop":
            break


def main() -> None:
    with MockWebPush() as mock:
        info = {"host": mock.host, "port": mock.port, "origin": mock.origin, "ca_file": str(mock.ca_file)}
        print(json.dumps(info), flush=True)
        _serve_stdio(mock)


if __name__ == "__main__":
    main()
