"""Whether a Web Push or FCM request was written, and what a failed one is as a ``SendResult``.

A request whose headers never began to leave certainly never reached anyone: a connect or TLS
handshake that stalls, a wait for a pooled connection or an HTTP/2 stream. httpcore reports each
step of a request to its ``trace`` request extension (``connection.connect_tcp.started``,
``connection.start_tls.complete``, ``http2.send_request_headers.started``,
``http11.send_request_headers.started``, ...); ``Attempt`` listens, so a failure is judged by
whether the request was written, not by which timer fired first.

The send timeout is given up to three times: to get a connection from the pool, again from the
moment a connection of its own is opened to get the request written, and again, from the moment its
headers begin to leave, to get its answer. Only the last can end in "may have been delivered"
(``timeout``), so a row waiting for a connection that other rows' stalled connects hold is never
failed for them, and a wait for the pool alone (``pool_timeout``) spends none of its attempts. At that moment the claim's fence is checked too, as the APNs transport checks it
when it encodes HEADERS: no request leaves after its fence (``base.fence_deadline``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from reminders_pipeline.domain.outcomes import TIMEOUT, transport
from reminders_pipeline.providers.base import NOT_WRITTEN, POOL_WAIT, SendResult, fence_expired
from reminders_pipeline.sources.egress import AddressRefused

NOT_SENT = "not-sent"  # reason prefix: certainly never reached the endpoint (``SendResult.retry``)
HEADERS = ".send_request_headers.started"  # httpcore's event, after ``http11`` or ``http2``
# What failing to reach the other end raises before the request is written: no connection, TLS,
# a pool or stream wait, a connection closed or garbled under it.
UNREACHED = (TimeoutError, httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


class FencePassed(Exception):
    """The request's claim fence passed before its headers began to leave: it was never written."""


@dataclass
class Attempt:
    """One request's way out: ``written`` once its headers began to leave; ``connecting`` once a
    connection was being opened for it (before that it waited for one from the pool)."""

    seconds: float  # the send timeout
    send_by: float | None  # the claim's fence, on ``monotonic``
    monotonic: Callable[[], float]
    written: bool = False
    connecting: bool = False
    window: asyncio.Timeout | None = None

    @asynccontextmanager
    async def bounded(self) -> AsyncIterator[dict[str, Any]]:
        """The request's extensions, for a block given the send timeout to write the request and
        the send timeout again, from its write, for the answer."""
        async with asyncio.timeout(self.seconds) as self.window:
            yield {"trace": self.trace}

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        if event.endswith(HEADERS):
            self._writing()
        elif not self.written and not self.connecting:
            # connect_tcp, start_tls, the HTTP/2 preface: a connection of its own, given the send
            # timeout afresh, so a wait for the pool (other rows' doing) takes none of it
            self.connecting = True
            assert self.window is not None
            self.window.reschedule(asyncio.get_running_loop().time() + self.seconds)

    def _writing(self) -> None:
        assert self.window is not None
        if self.window.expired():
            raise TimeoutError  # its cancellation was swallowed on the way here: still unwritten
        if self.send_by is not None and self.monotonic() >= self.send_by:
            raise FencePassed
        self.written = True
        self.window.reschedule(asyncio.get_running_loop().time() + self.seconds)


def transport_failure(
    row_id: int, exc: Exception, *, written: bool, outage: bool, connecting: bool = True
) -> SendResult:
    """A request that got no answer. Before its write: certainly not delivered, so pending again,
    ``not-sent:…`` when the other end could not be reached (``outage``: whether that counts toward
    the provider's outage), ``not-written:…`` for anything else (it may fail the same way, so it
    spends an attempt); refused by the egress guard, failed. After its write: maybe delivered,
    failed and never sent again (``timeout``, ``transport:…``)."""
    if isinstance(exc, FencePassed):
        return fence_expired(row_id)
    if isinstance(exc, AddressRefused):
        return SendResult(row_id, False, reason="address_refused")
    if written:
        timed_out = isinstance(exc, TimeoutError | httpx.TimeoutException)
        return SendResult(row_id, False, reason=TIMEOUT if timed_out else transport(exc), outage=outage)
    if isinstance(exc, UNREACHED):
        return SendResult(row_id, False, reason=f"{NOT_SENT}:{unreached(exc, connecting)}", retry=True, outage=outage)
    return SendResult(row_id, False, reason=f"{NOT_WRITTEN}:{type(exc).__name__}", retry=True, outage=outage)


def unreached(exc: Exception, connecting: bool) -> str:
    """What held a request that was never written: ``connect_failed`` (refused, DNS, TLS refused),
    ``connect_timeout`` (a connect or TLS handshake that stalled), ``pool_timeout`` (no connection
    to be had from the pool in time), else the error's name."""
    if isinstance(exc, httpx.ConnectError):
        return "connect_failed"
    if isinstance(exc, httpx.ConnectTimeout) or isinstance(exc, TimeoutError) and connecting:
        return "connect_timeout"
    if isinstance(exc, httpx.PoolTimeout | TimeoutError):
        return POOL_WAIT
    return type(exc).__name__
