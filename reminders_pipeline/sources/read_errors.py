"""What a failed read is stored and shown as: a short code, never anything the source sent
(its text may quote the peer, or be written to mislead whoever reads the summary)."""

from __future__ import annotations

import httpx

from reminders_pipeline.sources.decoding import MAX_ENCODINGS
from reminders_pipeline.sources.egress import AddressRefused

# What a failed read is recorded as, beyond ``http_<status>`` and the feed codes (``FeedError``).
MAX_REDIRECTS = 3
READ_ERRORS = {
    "timeout": "no answer within REMINDERS_SOURCE_TIMEOUT_SECONDS",
    "too_large": "the body is larger than REMINDERS_SOURCE_MAX_BYTES (after decoding, at every layer)",
    "unsupported_encoding": f"a Content-Encoding other than gzip or deflate, or more than {MAX_ENCODINGS} stacked",
    "address_refused": "the host resolves only to internal addresses (REMINDERS_SOURCE_ALLOW_NETWORKS)",
    "insecure_redirect": "an https source redirected to plain http",
    "too_many_redirects": f"more than {MAX_REDIRECTS} redirects (no cookie is kept: a server that redirects until one comes back ends here)",
    "unsupported_url": "a URL (or redirect) the reader cannot fetch",
    "connect_failed": "name resolution, TCP or TLS failed",
    "read_failed": "the connection broke or the answer was not HTTP",
    "parse_timeout": "parsing took longer than REMINDERS_SOURCE_PARSE_SECONDS",
}


def read_error_code(exc: Exception) -> str:
    """The code a failed read is stored and shown as; the exception's own text may quote the peer."""
    if isinstance(exc, AddressRefused):
        return "address_refused"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return "unsupported_url"
    if isinstance(exc, httpx.ConnectError):
        return "connect_failed"
    return "read_failed"
