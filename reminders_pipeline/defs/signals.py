"""A clean stop for ops that send: run termination must not abandon what is on the wire."""

import asyncio
import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGINT or SIGTERM while the op's event loop runs.

    Run termination reaches the run worker as SIGINT (SIGTERM in a pod). Dagster's own handler
    would raise inside the event loop and abandon the sends on the wire (their rows stay claimed
    and are failed as abandoned, never sent); this one lets the core stop claiming and settle what
    is answered, then gives the signals back to Dagster. Off the main thread signals cannot be
    handled at all, and Dagster's handling stays as it is.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    installed = []
    try:
        for sig in previous:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    except (RuntimeError, ValueError):  # not the main thread
        pass
    try:
        yield stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous[sig])
