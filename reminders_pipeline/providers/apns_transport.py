"""The HTTP/2 layer under aioapns 4.0, patched: every change this project makes to aioapns, h2 and hpack.

aioapns does the HTTP/2 work; ``reminders_pipeline/providers/apns.py`` (the Sender) builds on it through
``protocol_class``, which is assigned to ``APNs.pool.protocol_class``. Each patch below was found by
running aioapns against the mock APNs (``reminders_pipeline_testing/mock_apns.py``). aioapns, h2 and
hpack are pinned to exact versions in pyproject.toml because these patches read or override their
internals; ``reminders_pipeline_tests/test_canaries.py`` checks each internal they rely on and fails,
naming the library, its version and the attribute, when an upgrade changes it. None of these is
fixed in aioapns 4.0, the pinned release; some canaries fail when upstream fixes one, so the patch
can go. "No upstream issue found" means none turned up in a search of the issue trackers.

Patches (what changes / the upstream bug or cost / the test that proves it, in
``reminders_pipeline_tests/test_apns_sender.py`` unless named otherwise). 10 to 13 and 16 were
written to save CPU: each can be switched off (``enabled_speed_patches``) and stays only while
``bench/bench_drain.py --patch-worth`` finds it worth at least 5% of the drain's throughput (on
PostgreSQL, or over the PostgreSQL and SQLite rounds together); each dated measurement is in
docs/benchmarks.md ("Which speed patches earn their place" and "Each speed patch's worth again").
11 is kept below that bar because it is not only a saving: without it, a request behind a GOAWAY
was seen failed "may have been sent" instead of "certainly not sent" (docs/benchmarks.md). 13 is
kept below the bar because it pins no library's internals and skips work whose result is thrown away.
Every other patch fixes a behaviour, and its test fails without it.

1. One provider token for every connection (``protocol_class`` passes the sender's
   ``ProviderToken`` as ``auth_provider``). aioapns' key pool signs a new JWT per connection, and
   APNs answers 429 ``TooManyProviderTokenUpdates`` when the token changes too often; no aioapns
   issue found (the same bug in PyAPNs2: https://github.com/Pr0Ger/PyAPNs2/issues/76).
   Tests: ``test_one_provider_token_across_connections_and_senders``,
   ``test_token_churn_is_answered_429_by_apns_but_not_provoked``.
2. Stream slots (``StreamSlots`` in ``apns_stream_slots.py``, replacing aioapns' ``ChannelPool``,
   written on the public ``asyncio.Semaphore`` API only). aioapns' ``DynamicBoundedSemaphore.bound`` setter raises the
   bound by calling ``release()`` while the old bound still caps the count, so APNs raising
   MAX_CONCURRENT_STREAMS from 1 to 1000 with a stream in flight leaves 2 usable streams on that
   connection for good; no upstream issue found. A connection also starts at one stream (Apple's
   bound until it has seen a valid token) rather than aioapns' 1000.
   Tests: ``test_stream_slots_raise_to_the_full_new_limit_with_a_stream_in_flight``,
   ``test_stream_slots_lower_and_raise_keep_the_count``,
   ``test_stream_slots_hand_out_aioapns_stream_ids_and_wait_at_the_bound``,
   ``test_a_burst_uses_one_connection_raised_after_the_first_answer``,
   ``test_in_flight_sends_are_bounded_by_apns_concurrency``.
3. The exact ``apns-expiration`` and a compact JSON body (``WireH2Connection.send_headers`` and
   ``send_data``, found by ``apns-id``). aioapns only takes a relative TTL (``now + ttl`` when it
   sends) and serialises with spaces, bigger than the 4 KB the payload was fitted to; both happen
   inside one aioapns method, so h2 is the smallest place to fix them.
   Tests: ``test_request_carries_alert_headers_topic_token_and_compact_payload``,
   ``test_expiration_already_past_is_sent_as_zero``,
   ``test_payload_fitted_to_4kb_compact_is_not_inflated_by_spaces``.
4. Outbound flow control (``WireH2Connection.reserve_window``). aioapns sends HEADERS, then DATA,
   and when the connection window is spent raises FlowControlError in between, leaking a half-open
   stream on both ends; a burst of a few hundred requests spends the default 64 KB window. Each
   request now reserves room for its body first and waits for a WINDOW_UPDATE.
   Test: ``test_burst_beyond_the_flow_control_window_waits_instead_of_failing``.
5. Inbound flow control (``WireH2Connection.receive_data`` calls ``acknowledge_received_data``).
   aioapns reads every answer body but never returns the credit, so after ~64 KB of error bodies on
   one connection APNs can send no more answers. Upstream: https://github.com/Fatal1ty/aioapns/pull/75
   (open). Test: ``test_1500_error_answers_on_one_connection_all_arrive``.
6. Stream resets (``WireH2Connection.resets``, ``ReminderApnsProtocol._stream_reset``). aioapns
   ignores RST_STREAM: the request waits for its timeout as "maybe sent" and its stream slot stays
   taken. REFUSED_STREAM fails it as ``NotProcessed`` (RFC 9113 8.7: certainly not processed) and
   frees the slot; any other code as ``StreamResetByApns``. No upstream issue found.
   Test: ``test_refused_stream_is_certainly_not_sent_and_frees_its_slot``.
7. GOAWAY (``on_connection_terminated``): streams above its last stream id fail as ``NotProcessed``
   instead of "connection closed" (which means "maybe sent"). No upstream issue found.
   Test: ``test_streams_above_a_goaway_last_stream_id_are_certainly_not_sent``.
8. ``on_stream_ended`` drops the stream's entry from ``request_streams``: aioapns keeps it forever
   after a 200, a leak per request on a long-lived connection. No upstream issue found.
   Test: ``test_a_connection_forgets_each_stream_once_it_ended``.
9. Connections idle for ``CONNECTION_IDLE_SECONDS`` (60 s) instead of aioapns' 10 s
   (``INACTIVITY_TIME``), since a drain's batches can be further apart and each reconnect costs a
   TLS handshake and the one-stream start. Test: ``test_a_connection_stays_open_between_batches``.
10. HPACK indexing (``hpack_headers``): the constant headers (the ~300-byte provider token above
    all) enter the connection's HPACK table once, per-request values never after the first request.
    h2 by default never indexes ``authorization``; the cost was CPU and bytes per request. Test: ``test_the_provider_token_is_sent_once_per_connection_and_per_request_values_enter_the_table_once``.
11. One TLS write per loop pass (``flush`` coalesced with ``call_soon``; ``close`` first writes what
    was already encoded): aioapns writes once per request. Cost: CPU per request.
    Tests: ``test_a_burst_of_sends_shares_tls_writes``,
    ``test_closing_a_connection_first_writes_what_was_already_encoded``.
12. h2's per-header normalising and validation are off (``H2Configuration``): every header value is
    checked before it reaches aioapns (hex device token, collapse id, bundle-id topic, uuid
    ``apns-id``). Cost: CPU per request. Tests: ``test_a_collapse_id_that_is_not_a_header_value_fails_that_row_without_a_request``,
    ``test_a_topic_that_is_not_a_bundle_id_names_the_variable``.
13. aioapns' own serialisation of the payload is skipped (``message={}`` in ``apns.py``; the body
    sent is ``Wire.body``, serialised once for the size check, the request and the ledger). Not a
    patch of a library's internals; listed because it is switched and measured with the others.
14. The endpoint (``Endpoint``; ``APNS_SERVER``/``APNS_PORT`` class attributes): aioapns can only
    reach Apple's two hosts, so a proxy or the mock needs a subclass. Tests: every mock test, and
    ``test_unreachable_endpoint_is_certainly_not_sent``.
15. The claim's fence (``WireH2Connection.send_headers``, ``FenceExpired``): the last check before
    a request's HEADERS are encoded, after every await of the send (stream slot, flow-control
    window). A request whose claim may by now have been failed as abandoned elsewhere is refused,
    its stream slot released, and it certainly never reached APNs. Not an upstream bug: the drain's
    at-most-once rule (``base.fence_deadline``). Tests: ``test_a_send_whose_fence_passes_while_it_waits_for_a_stream_is_never_written``
    (test_apns_sender.py), ``test_a_paused_sender_never_sends_a_row_another_claimer_sent`` (test_apns_drain.py).
16. Header values as plain literals (``LiteralEncoder``, set as h2's ``H2Connection.encoder``):
    hpack Huffman-codes every literal in pure Python, a byte at a time, and the values that change
    per request (device path, collapse id, apns-id, expiration) are the only literals after the
    first request. Sent plain they cost about 65 bytes more per request and no Huffman pass (RFC
    7541 5.2: every decoder reads both). Cost: CPU per request.
    Test: ``test_per_request_values_go_as_plain_literals_that_apns_decodes``.

Longer than 350 lines because its job is the complete list of patches to aioapns, h2 and hpack, each
documented above with its reason and test; spread over modules, it would hide which internals an
upgrade must recheck.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aioapns import NotificationRequest
from aioapns.common import NotificationResult
from aioapns.connection import APNsTLSClientProtocol, AuthorizationHeaderProvider
from aioapns.exceptions import ConnectionClosed
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived, RemoteSettingsChanged, StreamReset, WindowUpdated
from hpack import Encoder, HeaderTuple, NeverIndexedHeaderTuple

from reminders_pipeline.providers.apns_stream_slots import StreamSlots

CONNECTION_IDLE_SECONDS = 60  # aioapns closes after 10 s; a drain's batches can be further apart

SPEED_PATCHES = frozenset({"hpack_indexing", "tls_writes", "h2_checks_off", "one_serialisation", "literal_headers"})
enabled_speed_patches: set[str] = set(SPEED_PATCHES)
"""The speed patches in force (all of them in production). ``bench/bench_drain.py --patch-worth``
turns one off at a time to measure what it is worth; read when a connection class or connection
is built, so a change holds for senders made after it."""


class NotProcessed(ConnectionError):
    """APNs said it did not process this stream (REFUSED_STREAM, or above a GOAWAY's last stream id)."""


class FenceExpired(NotProcessed):
    """The request's claim fence passed before its HEADERS were encoded: it was never written."""


class StreamResetByApns(ConnectionError):
    """APNs reset the stream for another reason: it may have processed the request."""


@dataclass(frozen=True)
class Endpoint:
    """Where connections go: Apple's host or REMINDERS_APNS_URL's, and the aioapns class to start from."""

    host: str
    port: int
    base: type[APNsTLSClientProtocol]


@dataclass
class Wire:
    """What goes on the wire instead of aioapns' choice (set by the sender, keyed by ``apns-id``);
    ``written`` once h2 has encoded the request's HEADERS (from then on it may reach APNs);
    ``send_by``: the claim's fence on ``time.monotonic()``, past which the HEADERS are never encoded."""

    expiration: str
    body: bytes
    written: bool = False
    send_by: float | None = None


class WireH2Connection(H2Connection):
    """The h2 connection under aioapns, patched where aioapns' own code gets the wire wrong.

    * The exact ``apns-expiration`` and a compact body, found by ``apns-id``: aioapns computes
      ``now + ttl`` when it sends, and serialises with spaces (bigger than the 4 KB the payload
      was fitted to). Both happen inside one aioapns method; h2 is the smallest place to fix them.
    * Flow control: aioapns sends HEADERS, then DATA, and if the connection window is spent it
      raises FlowControlError in between, leaking a half-open stream on both ends. A burst of a
      few hundred requests spends the default 64 KB window, so each request first reserves room
      for its body (``reserve_window``) and waits for a WINDOW_UPDATE when there is none.
    * Incoming flow control: aioapns reads every answer body but never acknowledges it, so the
      window APNs may send into only shrinks; credit is returned here for every DATA frame read,
      on the stream and the connection (h2 sends a WINDOW_UPDATE once enough has accumulated).
    * Resets: aioapns ignores RST_STREAM, leaving its request to time out as "maybe sent" and its
      stream slot taken; they are kept in ``resets`` for the protocol to settle.
    """

    def __init__(self, wire: dict[str, Wire]) -> None:
        # aioapns builds every header itself from values checked in AioApnsSender.send_one (hex
        # token, collapse id) or before (topic; uuid apns-id), so h2's per-header normalising and
        # validation are skipped.
        checks = "h2_checks_off" not in enabled_speed_patches
        super().__init__(
            H2Configuration(client_side=True, normalize_outbound_headers=checks, validate_outbound_headers=checks)
        )
        self._index = hpack_headers if "hpack_indexing" in enabled_speed_patches else h2_default_indexing
        if "literal_headers" in enabled_speed_patches:
            self.encoder = LiteralEncoder()
        self._wire = wire
        self._bodies: dict[int, bytes] = {}
        self._stream_requests: dict[int, str] = {}
        self._reserved: dict[str, int] = {}
        self._reserved_total = 0
        self._window_moved: asyncio.Event | None = None
        self._closed: BaseException | None = None
        self.resets: list[StreamReset] = []

    def body_size(self, request: NotificationRequest) -> int:
        wire = self._wire.get(request.notification_id)
        return len(wire.body) if wire is not None else 0

    async def reserve_window(self, apns_id: str, size: int) -> None:
        while self._closed is None and self.outbound_flow_control_window - self._reserved_total < size:
            if self._window_moved is None:
                self._window_moved = asyncio.Event()
            self._window_moved.clear()
            await self._window_moved.wait()
        if self._closed is not None:
            raise ConnectionClosed(str(self._closed))
        self._reserved[apns_id] = size
        self._reserved_total += size

    def release_window(self, apns_id: str) -> None:
        self._reserved_total -= self._reserved.pop(apns_id, 0)
        self._wake()

    def closed(self, exc: BaseException) -> None:
        self._closed = exc
        self._wake()

    def _wake(self) -> None:
        if self._window_moved is not None:
            self._window_moved.set()

    def receive_data(self, data: Any) -> list[Any]:
        events = super().receive_data(data)
        for event in events:
            if isinstance(event, DataReceived):
                self.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamReset):
                self.resets.append(event)
        if any(isinstance(e, (WindowUpdated, RemoteSettingsChanged)) for e in events):
            self._wake()
        return events

    def send_headers(self, stream_id: int, headers: Any, *args: Any, **kwargs: Any) -> None:
        apns_id = next((v for k, v in headers if k == "apns-id"), None)
        wire = self._wire.get(apns_id) if apns_id else None
        if wire is not None and wire.send_by is not None and time.monotonic() >= wire.send_by:
            raise FenceExpired("fence_expired")  # before h2 encodes a byte: the stream was never opened
        if wire is not None and apns_id:
            del self._wire[apns_id]
        if wire is not None:
            headers = [(k, v) for k, v in headers if k != "apns-expiration"] + [("apns-expiration", wire.expiration)]
            self._bodies[stream_id] = wire.body
        if apns_id:
            self._stream_requests[stream_id] = apns_id
        super().send_headers(stream_id, self._index(headers, first=stream_id == 1), *args, **kwargs)
        if wire is not None:
            wire.written = True

    def send_data(self, stream_id: int, data: Any, *args: Any, **kwargs: Any) -> None:
        try:
            super().send_data(stream_id, self._bodies.pop(stream_id, data), *args, **kwargs)
        finally:
            self.release_window(self._stream_requests.pop(stream_id, ""))


class LiteralEncoder(Encoder):
    """hpack's encoder, never Huffman-coding a literal: its coder is a Python loop per byte, paid
    on every per-request value, to save about 65 bytes a request (patch 16)."""

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        return super().encode(headers, huffman=False)


PER_REQUEST_HEADERS = frozenset({":path", "apns-id", "apns-expiration", "apns-collapse-id"})


def hpack_headers(headers: Sequence[tuple[str, str]], first: bool) -> list[HeaderTuple]:
    """Which headers go into the connection's HPACK table.

    The constant ones (method, host, topic, priority, push type and the provider token) are
    indexed, so after the first request each costs one byte. Values that change with every request
    (token path, ids, expiration) are kept out of the table, where they would only evict the
    constant ones; the first request indexes them too, so their names are in the table and later
    requests send only the values.

    h2's default keeps ``authorization`` out of the table, against compression attacks. Those work
    by guessing a secret piece by piece, while HPACK only matches a whole name and value; and
    nothing an outsider controls (feed text reaches only the body and a hashed collapse id) is ever
    sent under the ``authorization`` name. (hpack's own debug log, off unless someone turns it
    on, then prints the token when it enters the table.)
    """
    if first:
        return [HeaderTuple(k, v) for k, v in headers]
    return [NeverIndexedHeaderTuple(k, v) if k in PER_REQUEST_HEADERS else HeaderTuple(k, v) for k, v in headers]


def h2_default_indexing(headers: Sequence[tuple[str, str]], first: bool) -> list[HeaderTuple]:
    """h2's own choice, for measuring ``hpack_headers``: every header indexed but ``authorization``."""
    return [NeverIndexedHeaderTuple(k, v) if k == "authorization" else HeaderTuple(k, v) for k, v in headers]


def protocol_class(
    where: Endpoint, token: AuthorizationHeaderProvider, wire: dict[str, Wire]
) -> type[APNsTLSClientProtocol]:
    """aioapns' connection class for ``where``, with the shared token and the patches above."""

    coalesce_writes = "tls_writes" in enabled_speed_patches

    class ReminderApnsProtocol(where.base):  # type: ignore[misc, name-defined]
        APNS_SERVER = where.host
        APNS_PORT = where.port
        INACTIVITY_TIME = CONNECTION_IDLE_SECONDS
        conn: WireH2Connection

        def __init__(
            self, apns_topic: str, loop: Any = None, on_connection_lost: Any = None, auth_provider: Any = None
        ) -> None:
            super().__init__(apns_topic, loop, on_connection_lost, token)
            self.conn = WireH2Connection(wire)
            # Apple allows one stream until it has seen a valid token; start there instead of
            # bursting before its SETTINGS arrive.
            self.free_channels = StreamSlots(1)
            self._flush_scheduled = False

        async def send_notification(self, request: NotificationRequest) -> NotificationResult:
            await self.conn.reserve_window(request.notification_id, self.conn.body_size(request))
            try:
                result: NotificationResult = await super().send_notification(request)
                return result
            except FenceExpired:
                self.free_channels.release()  # raised only after aioapns took a stream slot
                raise
            finally:
                self.conn.release_window(request.notification_id)  # no-op once its DATA went out

        def flush(self) -> None:
            """One TLS write per loop pass, not one per request: a burst of sends shares records."""
            if not coalesce_writes:
                super().flush()
            elif not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush_now)

        def _flush_now(self) -> None:
            self._flush_scheduled = False
            if self.transport is not None and not self.transport.is_closing():
                super().flush()

        def close(self) -> None:
            if self._flush_scheduled:  # frames already encoded (their sends count as made) go out first
                self._flush_now()
            super().close()

        def on_stream_ended(self, stream_id: int) -> None:
            self.request_streams.pop(stream_id, None)  # aioapns keeps it forever after a 200
            super().on_stream_ended(stream_id)

        def connection_lost(self, exc: Exception | None) -> None:
            self.conn.closed(exc or ConnectionError("connection closed"))
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            while self.conn.resets:
                self._stream_reset(self.conn.resets.pop(0))

        def _stream_reset(self, event: StreamReset) -> None:
            """REFUSED_STREAM means APNs did not process the request (RFC 9113 8.7); any other reset may not."""
            refused = event.error_code == ErrorCodes.REFUSED_STREAM
            error = NotProcessed("REFUSED_STREAM") if refused else StreamResetByApns(str(event.error_code))
            if self._fail_stream(event.stream_id, error):
                self.free_channels.release()  # aioapns releases a slot only when a stream ends

        def on_connection_terminated(self, event: ConnectionTerminated) -> None:
            """GOAWAY: streams above its last stream id were never processed; the rest may have been."""
            for stream_id in [s for s in self.request_streams if s > (event.last_stream_id or 0)]:
                self._fail_stream(stream_id, NotProcessed("GOAWAY"))
            super().on_connection_terminated(event)

        def _fail_stream(self, stream_id: int, error: Exception) -> bool:
            notification_id = self.request_streams.pop(stream_id, None)
            if notification_id is None:
                return False
            self.request_statuses.pop(notification_id, None)
            future = self.requests.pop(notification_id, None)
            if future is not None and not future.done():
                future.set_exception(error)
            return True

    return ReminderApnsProtocol
