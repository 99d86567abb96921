"""The failure reasons after which a row's alert may still be on the phone.

A send is at most once, so a row whose request may have reached its provider is failed, never
retried. The providers name why (``timeout``, ``transport:…``), the claims sweep names its own
(``abandoned``) and the settlement its own (``no_result``); Done and Snooze must still act on such
a row, since the person may be holding its alert. One list here keeps the four writers and that
reader from drifting apart.
"""

from __future__ import annotations

TIMEOUT = "timeout"  # the request was written and no answer came in time
ABANDONED = "abandoned"  # its claimer died or stalled between the claim and the settlement
TRANSPORT = "transport:"  # prefix: the connection broke after the request was written
NO_RESULT = "no_result"  # the sender returned no result for a request it may have written

MAY_HAVE_GONE = (TIMEOUT, ABANDONED, NO_RESULT)  # exact reasons; with TRANSPORT as a prefix


def transport(exc: BaseException) -> str:
    """The reason for a connection that broke after its request was written."""
    return f"{TRANSPORT}{type(exc).__name__}"
