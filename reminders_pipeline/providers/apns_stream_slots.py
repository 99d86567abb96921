"""A connection's HTTP/2 stream slots, standing in for aioapns' ``ChannelPool`` (patch 2 in
``apns_transport``). Apart from the other patches because it touches no library's internals:
it is written on the public ``asyncio.Semaphore`` API only, which test_canaries keeps so."""

from __future__ import annotations

import asyncio

from h2.connection import H2Connection
from h2.exceptions import NoAvailableStreamIDError


class StreamSlots:
    """A connection's stream slots: at most ``bound`` requests in flight, ``bound`` set by APNs.

    Stands in for aioapns' ``ChannelPool`` (the interface aioapns uses: ``acquire`` returning the
    next client stream id, ``release``, ``bound``, ``is_busy``, ``destroy``), on the public
    ``asyncio.Semaphore`` API only. aioapns' ``bound`` setter raises the bound by calling
    ``release()`` while the old bound still caps the count, so 1 -> 1000 with a stream in flight
    leaves 2 usable streams. Here raising the bound releases that many permits; lowering it records
    permits ``owed``, swallowed by later releases (or by acquires that find a spare permit), so
    in-flight streams never exceed a lowered bound either.
    """

    def __init__(self, bound: int) -> None:
        self._bound = bound
        self._open = 0
        self._permits = asyncio.Semaphore(bound)
        self._owed = 0  # permits that a lowered bound took back, not yet swallowed
        self._stream_id = -1
        self._destroyed: Exception | None = None

    @property
    def bound(self) -> int:
        return self._bound

    @bound.setter
    def bound(self, new_bound: int) -> None:
        change = new_bound - self._bound
        self._bound = new_bound
        if change < 0:
            self._owed -= change
            return
        repaid = min(change, self._owed)
        self._owed -= repaid
        for _ in range(change - repaid):
            self._permits.release()

    @property
    def available(self) -> int:
        """Streams that may open now (negative after APNs lowered the bound below those in flight)."""
        return self._bound - self._open

    @property
    def is_busy(self) -> bool:
        """aioapns' pool skips a busy connection when it picks one for a request."""
        return self.available <= 0

    async def acquire(self) -> int:
        """A slot and the stream id to open in it (client ids are odd and only grow)."""
        while True:
            await self._permits.acquire()
            if self._destroyed is not None:
                self._permits.release()  # wakes the next waiter, which fails the same way
                raise self._destroyed
            if not self._owed:
                break
            self._owed -= 1  # a permit the lowered bound took back
        self._open += 1
        self._stream_id += 2
        if self._stream_id > H2Connection.HIGHEST_ALLOWED_STREAM_ID:
            raise NoAvailableStreamIDError()  # as aioapns: the caller closes the connection
        return self._stream_id

    def release(self) -> None:
        if self._open <= 0:  # as aioapns' bounded count: a stray release never adds a slot
            return
        self._open -= 1
        if self._owed:
            self._owed -= 1
        else:
            self._permits.release()

    def destroy(self, exc: Exception) -> None:
        """The connection is gone: requests waiting for a slot fail with ``exc``."""
        self._destroyed = exc
        self._permits.release()
