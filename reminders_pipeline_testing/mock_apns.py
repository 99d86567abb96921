"""A faithful mock of Apple's APNs provider API: HTTP/2 over TLS on raw ``h2`` + asyncio.

Why raw h2: hypercorn (and so Starlette) ends every response with an empty DATA frame, and aioapns
runs ``json.loads`` on every DATA frame. This server answers the way APNs does:

* 200: HEADERS with END_STREAM, no body, always with ``apns-id`` (the request's, echoed).
* error: ``:status`` + ``apns-id``, then one DATA frame ``{"reason": ...}`` (410 adds ``timestamp``, ms).
* checks ``:path /3/device/<hex token>``, ``apns-topic``, the ES256 provider JWT (``kid``, ``iss``,
  ``iat`` under an hour old, signature by the test key), header formats and the 4096-byte payload.
* each connection starts at MAX_CONCURRENT_STREAMS=1 and raises it after the first valid token.
* h2's default 64 KB receive window is kept (Apple does not document its own), so a client that
  ignores flow control fails here instead of in production. The other way too: an error answer's
  body waits for the client's WINDOW_UPDATE, as a real server's would, so a client that never
  returns credit for the answers it reads stops getting answers.
* faults a real network and APNs produce: GOAWAY with a last stream id (``goaway_after``),
  RST_STREAM(REFUSED_STREAM) (``Answer(refuse_stream=True)``), and a listener that refuses the
  TCP connection or fails the TLS handshake (``refuse``).

It runs on ``tls_loop``'s loop in a background thread. Keys and certificates are generated when it
is created; nothing secret lives in the repository. ``python -m reminders_pipeline_testing.mock_apns``
runs one in its own process, prints where it listens as JSON, and answers ``stats`` / ``reset`` /
``stop`` on stdin.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset, WindowUpdated
from h2.exceptions import ProtocolError, StreamClosedError, TooManyStreamsError
from h2.settings import SettingCodes, Settings

from .tls_loop import LoopServer, Scripts, parsed_json

MAX_PAYLOAD_BYTES = 4096
TOKEN_MAX_AGE_SECONDS = 3600
PATH = re.compile(r"^/3/device/(?P<token>[^/]*)$")
HEX_TOKEN = re.compile(r"^[0-9a-fA-F]{64,200}$")
PUSH_TYPES = {
    "alert",
    "background",
    "voip",
    "complication",
    "fileprovider",
    "mdm",
    "liveactivity",
    "location",
    "pushtotalk",
    "widgets",
    "controls",
}
# The optional headers APNs checks: whether it takes a value, and the reason it answers when not.
HEADER_CHECKS: dict[str, tuple[Callable[[str], object], str]] = {
    "apns-push-type": (PUSH_TYPES.__contains__, "InvalidPushType"),
    "apns-priority": (("1", "5", "10").__contains__, "BadPriority"),
    "apns-expiration": (re.compile(r"\d+").fullmatch, "BadExpirationDate"),
    "apns-collapse-id": (lambda value: len(value.encode()) <= 64, "BadCollapseId"),
    "apns-id": (re.compile(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", re.IGNORECASE).fullmatch, "BadMessageId"),
}


def write_p8_key(path: Path) -> ec.EllipticCurvePrivateKey:
    """A fresh EC P-256 key written as Apple's ``AuthKey_*.p8`` (PKCS#8 PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    return key


@dataclass(frozen=True)
class Answer:
    """How the mock answers one request that passed validation."""

    status: int = 200
    reason: str | None = None
    timestamp_ms: int | None = None  # 410 only; default "now"
    delay: float = 0.0  # seconds before answering
    drop_connection: bool = False  # abort the TCP connection instead of answering
    omit_apns_id: bool = False  # a broken server: aioapns cannot match the answer to its request
    refuse_stream: bool = False  # RST_STREAM(REFUSED_STREAM): the request was not processed
    hold: bool = False  # no answer until the test calls MockApns.release_held(): a late answer without a clock


@dataclass(frozen=True)
class RecordedRequest:
    connection_id: int
    path: str
    token: str
    headers: dict[str, str]
    body: bytes
    payload: Any  # parsed JSON, or None when the body is not JSON
    status: int | None  # what the mock answered; None if it dropped the connection
    reason: str | None
    received_at: float


@dataclass
class _Stream:
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)
    received_at: float = field(default_factory=time.time)


class _ApnsConnection(asyncio.Protocol):
    """One client connection: h2 framing, stream bookkeeping and the SETTINGS ramp."""

    def __init__(self, server: MockApns, connection_id: int) -> None:
        self.server = server
        self.id = connection_id
        self.transport: asyncio.Transport  # set by connection_made(), before any other call
        self.conn = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        # Leave MAX_CONCURRENT_STREAMS out of h2's first SETTINGS so h2 enforces the advertised
        # limit only once the client has acknowledged it, as RFC 9113 allows a client to assume.
        self.conn.local_settings = Settings(
            client=False, initial_values={SettingCodes.MAX_HEADER_LIST_SIZE: H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE}
        )
        self.streams: dict[int, _Stream] = {}
        self.raised = False
        self.blocked: dict[int, bytes] = {}  # answer bodies waiting for the client's flow-control credit
        self.requests_seen = 0
        self.last_processed = 0
        self.going_away = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._opened(transport)
        self.conn.initiate_connection()
        self.conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: self.server.initial_max_streams})
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server._closed(self.transport)
        self.server._finished(len(self.streams))
        self.streams.clear()

    def flush(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except TooManyStreamsError:
            with self.server._lock:
                self.server.stream_limit_violations += 1
            self._hang_up()
            return
        except ProtocolError:
            self._hang_up()
            return
        for event in events:
            self._on_event(event)
        self.flush()

    def _hang_up(self) -> None:
        self.flush()  # the GOAWAY h2 queued
        self.transport.close()

    def _on_event(self, event: object) -> None:
        if isinstance(event, RequestReceived):
            if self.going_away:
                return  # above the GOAWAY's last stream id: ignored, never processed
            self.streams[event.stream_id] = _Stream(dict(event.headers))  # type: ignore[arg-type]  # str: header_encoding
            self.server._started()
        elif isinstance(event, DataReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream.body += event.data
            self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, StreamEnded):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                self._on_request(event.stream_id, stream)
        elif isinstance(event, StreamReset):
            self.blocked.pop(event.stream_id, None)
            if self.streams.pop(event.stream_id, None) is not None:
                self.server._finished()
        elif isinstance(event, WindowUpdated):
            self._send_blocked()
        elif isinstance(event, ConnectionTerminated):
            self.transport.close()

    def _on_request(self, stream_id: int, stream: _Stream) -> None:
        if self.going_away:
            return
        self.requests_seen += 1
        if self.server.goaway_after is not None and self.requests_seen > self.server.goaway_after:
            self._go_away()
            return
        answer, token_ok = self.server._judge(stream)
        self.last_processed = stream_id
        if token_ok and not self.raised:
            self.raised = True
            self.conn.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: self.server.raised_max_streams})
        self.server._record_stream(self.id, stream, answer)
        if answer.drop_connection:
            self.transport.abort()
        elif answer.refuse_stream:
            self.streams.pop(stream_id, None)
            self.server._finished()
            self.conn.reset_stream(stream_id, ErrorCodes.REFUSED_STREAM)
        elif answer.hold:
            self.server._held.append((self, stream_id, stream, answer))
        elif answer.delay > 0:
            asyncio.get_running_loop().call_later(answer.delay, self._answer, stream_id, stream, answer)
        else:
            self._answer(stream_id, stream, answer)

    def _answer(self, stream_id: int, stream: _Stream, answer: Answer) -> None:
        if self.streams.pop(stream_id, None) is None:
            return  # reset by the client or the connection is gone
        self.server._finished()
        if self.transport.is_closing():
            return
        apns_id = stream.headers.get("apns-id") or str(uuid.uuid4()).upper()
        headers = [(":status", str(answer.status))]
        if not answer.omit_apns_id:
            headers.append(("apns-id", apns_id))
        try:
            if answer.status == 200:
                self.conn.send_headers(stream_id, headers, end_stream=True)
            else:
                headers.append(("content-type", "application/json"))
                self.conn.send_headers(stream_id, headers)
                self.blocked[stream_id] = _error_body(answer)
                self._send_blocked()
        except (StreamClosedError, ProtocolError):
            return
        self.flush()

    def _send_blocked(self) -> None:
        """Send each waiting body whose stream and connection windows both have room, in order.

        A real HTTP/2 server does the same: DATA beyond the peer's window waits for its
        WINDOW_UPDATE. The bodies are one frame each (APNs' answers are small).
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

    def _go_away(self) -> None:
        """GOAWAY naming the last stream processed: every later stream is dropped unprocessed, as
        RFC 9113 promises a client it may retry them. The connection then closes."""
        self.going_away = True
        last = self.last_processed
        for stream_id in [sid for sid in self.streams if sid > last]:
            self.streams.pop(stream_id)
            self.server._finished()
        with self.server._lock:
            self.server.goaways_sent += 1
        self.conn.close_connection(last_stream_id=last)
        self.flush()
        asyncio.get_running_loop().call_later(0.05, self.transport.close)


def _error_body(answer: Answer) -> bytes:
    body: dict[str, Any] = {"reason": answer.reason or "BadRequest"}
    if answer.status == 410:
        body["timestamp"] = answer.timestamp_ms if answer.timestamp_ms is not None else int(time.time() * 1000)
    return json.dumps(body).encode()


class MockApns(LoopServer["RecordedRequest"]):
    """An APNs look-alike in a background thread. ``start()`` → ``(host, port)``; ``stop()``.

    Defaults answer 200. ``script(token, ...)`` sets the answer for one device token (optionally
    only ``times`` times); ``script_default(...)`` for all others. Everything it saw is in
    ``requests``; ``jwts_seen`` lists distinct provider tokens in order of first use;
    ``max_in_flight`` is the most requests open at once across all connections.
    """

    alpn = ("h2",)  # APNs speaks HTTP/2 only
    wait_seconds = 5.0
    # Requests answered with hold=True, waiting for release_held() (server thread only).
    _held: list[tuple[_ApnsConnection, int, _Stream, Answer]]

    def __init__(
        self,
        *,
        key_id: str = "MOCKKEY001",
        team_id: str = "MOCKTEAM01",
        topics: tuple[str, ...] = ("com.example.reminders",),
        workdir: str | Path | None = None,
        initial_max_streams: int = 1,
        raised_max_streams: int = 1000,
        min_token_refresh_seconds: float | None = None,
    ) -> None:
        # After this many requests on one connection, the next one gets GOAWAY; None = never.
        self.goaway_after: int | None = None
        # Seconds before every answer that has no delay of its own: the network to Apple. Kept by reset().
        self.latency = 0.0
        self.key_id = key_id
        self.team_id = team_id
        self.topics = topics
        self.initial_max_streams = initial_max_streams
        self.raised_max_streams = raised_max_streams
        # Apple answers 429 TooManyProviderTokenUpdates when the token changes too often; None = off.
        self.min_token_refresh_seconds = min_token_refresh_seconds
        super().__init__(workdir, name="mock-apns")
        self.key_file = self.workdir / f"AuthKey_{key_id}.p8"
        self.public_key = write_p8_key(self.key_file).public_key()
        self._connection_ids = itertools.count(1)

    # -- lifecycle: start(), stop() and the context manager are LoopServer's -------------------

    def _protocol(self) -> asyncio.Protocol:
        return _ApnsConnection(self, next(self._connection_ids))

    def release_held(self) -> int:
        """Answer every request held by ``Answer(hold=True)`` now, as a late APNs would; returns how
        many answers went out (a held request whose connection is gone gets none)."""

        async def answer_held() -> int:
            held, self._held = self._held, []
            sent = 0
            for connection, stream_id, stream, answer in held:
                sent += stream_id in connection.streams
                connection._answer(stream_id, stream, answer)
            return sent

        result: int = self._call(answer_held())
        return result

    # -- configuration ---------------------------------------------------------------------

    @property
    def topic(self) -> str:
        return self.topics[0]

    def apns_settings(self) -> dict[str, Any]:
        """``Settings`` fields pointing a sender at this mock: ``Settings().with_(**mock.apns_settings())``."""
        return {
            "apns_key_file": str(self.key_file),
            "apns_key_id": self.key_id,
            "apns_team_id": self.team_id,
            "apns_topic": self.topic,
            "apns_url": self.url,
            "apns_ca_file": str(self.ca_file),
        }

    def env(self) -> dict[str, str]:
        """The same as environment variables, for a process that reads ``Settings.from_env``."""
        return {f"REMINDERS_{name.upper()}": value for name, value in self.apns_settings().items()}

    def script(self, token: str, *, times: int | None = None, **answer: Any) -> None:
        """Answer requests for ``token`` with ``Answer(**answer)`` (``times`` times, or always)."""
        with self._lock:
            self._scripts.set(token.lower(), Answer(**answer), times)

    def script_default(self, **answer: Any) -> None:
        with self._lock:
            self._scripts.default = Answer(**answer)

    def _reset_state(self) -> None:
        super()._reset_state()
        self._scripts = Scripts(Answer())
        self._held = []
        self._jwts: list[str] = []
        self._jwt_first_seen: dict[str, float] = {}
        self._verified: dict[str, dict[str, Any]] = {}
        # Apple's clock for provider-token ages and refresh spacing; a test may pin it. Reset to real time.
        self.token_clock: Callable[[], float] = time.time
        # Streams still open from before a reset stay counted, so the counter never goes negative.
        self._in_flight = getattr(self, "_in_flight", 0)
        self.max_in_flight = self._in_flight
        self.stream_limit_violations = 0
        self.goaways_sent = 0

    # -- observations ----------------------------------------------------------------------

    @property
    def jwts_seen(self) -> list[str]:
        with self._lock:
            return list(self._jwts)

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no connection is open (clients closed theirs); True if it got there."""
        deadline = time.monotonic() + timeout
        while self._transports or self._in_flight:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _more_stats(self) -> dict[str, Any]:
        return {
            "max_in_flight": self.max_in_flight,
            "distinct_jwts": len(self._jwts),
            "stream_limit_violations": self.stream_limit_violations,
        }

    # -- called from the server thread -----------------------------------------------------

    def _started(self) -> None:
        with self._lock:
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)

    def _finished(self, streams: int = 1) -> None:
        with self._lock:
            self._in_flight -= streams

    def _record_stream(self, connection_id: int, stream: _Stream, answer: Answer) -> None:
        match = PATH.match(stream.headers.get(":path", ""))
        record = RecordedRequest(
            connection_id=connection_id,
            path=stream.headers.get(":path", ""),
            token=match["token"] if match else "",
            headers=dict(stream.headers),
            body=bytes(stream.body),
            payload=parsed_json(bytes(stream.body)),
            status=None if answer.drop_connection or answer.refuse_stream else answer.status,
            reason=answer.reason,
            received_at=stream.received_at,
        )
        self._record(record)

    def _judge(self, stream: _Stream) -> tuple[Answer, bool]:
        """APNs' checks in roughly APNs' order; the bool says whether the provider token was valid."""
        h = stream.headers
        if h.get(":method") != "POST":
            return Answer(405, "MethodNotAllowed"), False
        match = PATH.match(h.get(":path", ""))
        if not match:
            return Answer(404, "BadPath"), False
        if not match["token"]:
            return Answer(400, "MissingDeviceToken"), False
        if not HEX_TOKEN.match(match["token"]):
            return Answer(400, "BadDeviceToken"), False
        if not h.get("apns-topic"):
            return Answer(400, "MissingTopic"), False
        auth_error = self._check_provider_token(h.get("authorization"))
        if auth_error is not None:
            return auth_error, False
        if h["apns-topic"] not in self.topics:
            return Answer(400, "TopicDisallowed"), True
        for name, (valid, reason) in HEADER_CHECKS.items():
            if name in h and not valid(h[name]):
                return Answer(400, reason), True
        if not stream.body:
            return Answer(400, "PayloadEmpty"), True
        if len(stream.body) > MAX_PAYLOAD_BYTES:
            return Answer(413, "PayloadTooLarge"), True
        with self._lock:
            answer = self._scripts.next(match["token"].lower())
        if self.latency and not answer.delay:
            answer = replace(answer, delay=self.latency)
        return answer, True

    def _check_provider_token(self, authorization: str | None) -> Answer | None:
        if not authorization:
            return Answer(403, "MissingProviderToken")
        if not authorization.startswith("bearer "):
            return Answer(403, "InvalidProviderToken")
        token = authorization[len("bearer ") :]
        claims = self._verify(token)
        if claims is None:
            return Answer(403, "InvalidProviderToken")
        age = self.token_clock() - claims["iat"]
        if age > TOKEN_MAX_AGE_SECONDS:
            return Answer(403, "ExpiredProviderToken")
        if age < -60:
            return Answer(403, "InvalidProviderToken")
        return self._note_token(token)

    def _verify(self, token: str) -> dict[str, Any] | None:
        with self._lock:
            cached = self._verified.get(token)
        if cached is not None:
            return cached
        try:
            if jwt.get_unverified_header(token).get("kid") != self.key_id:
                return None
            claims = jwt.decode(
                token,
                self.public_key,
                algorithms=["ES256"],
                issuer=self.team_id,
                options={"require": ["iss", "iat"], "verify_iat": False},
            )
        except jwt.PyJWTError:
            return None
        if not isinstance(claims.get("iat"), int):
            return None
        with self._lock:
            self._verified[token] = claims
        return claims

    def _note_token(self, token: str) -> Answer | None:
        now = self.token_clock()
        with self._lock:
            if token in self._jwt_first_seen:
                return None
            previous = self._jwts[-1] if self._jwts else None
            self._jwts.append(token)
            self._jwt_first_seen[token] = now
            limit = self.min_token_refresh_seconds
            if previous is not None and limit is not None and now - self._jwt_first_seen[previous] < limit:
                return Answer(429, "TooManyProviderTokenUpdates")
        return None


def _serve_stdio(mock: MockApns) -> None:
    """Line protocol for a parent process (the benchmark): ``stats``, ``reset``, ``stop``, and
    ``delay SECONDS`` (every answer that long after its request, as Apple's servers tens of
    milliseconds away answer; ``reset`` keeps it)."""
    for line in sys.stdin:
        command = line.strip()
        if command.startswith("delay "):
            mock.latency = float(command.split()[1])
            print(json.dumps({"ok": True, "delay": mock.latency}), flush=True)
        elif command == "stats":
            print(json.dumps(mock.stats()), flush=True)
        elif command == "reset":
            mock.reset()
            print(json.dumps({"ok": True}), flush=True)
        elif command == "stop":
            break


def main() -> None:
    with MockApns() as mock:
        info = {
            "host": mock.host,
            "port": mock.port,
            "url": mock.url,
            "ca_file": str(mock.ca_file),
            "key_file": str(mock.key_file),
            "key_id": mock.key_id,
            "team_id": mock.team_id,
            "topic": mock.topic,
            "env": mock.env(),
        }
        print(json.dumps(info), flush=True)
        _serve_stdio(mock)


if __name__ == "__main__":
    main()
