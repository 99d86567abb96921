"""Outbound HTTP for source reads that cannot reach inside the deployment (no request forgery).

A device may subscribe any URL, so a source read is a request made on an attacker's behalf. The
check is made where the socket is opened, in an httpcore network backend (public httpcore API):
the host is resolved once, every address is checked, and the connection goes to a checked address
itself, never to the name again. A hostname that resolves to ``127.0.0.1``, or answers a public
address once and a private one the next time (DNS rebinding), or a redirect hop to
``169.254.169.254``, all meet the same check, because every hop opens its connection here.

Refused unless a deployment allows the network (``REMINDERS_SOURCE_ALLOW_NETWORKS``): every
address that is not globally routable (``ipaddress``' ``is_global``: loopback, private,
link-local, unique-local, unspecified, shared CGNAT, documentation, Teredo ...), multicast,
reserved and IPv6 site-local ones, and any IPv6 address that embeds a refused IPv4 address
(IPv4-mapped ``::ffff:127.0.0.1``, 6to4, NAT64). A refused address is refused before any packet is sent to it, so a closed port and
an open one look the same (no port-scanner signal).
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import typing
from collections.abc import AsyncIterator, Iterable, Sequence

import anyio
import httpcore
import httpx

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

NAT64 = ipaddress.ip_network("64:ff9b::/96")


class AddressRefused(httpx.ConnectError):
    """The host resolves only to addresses a source may not reach."""


def parse_networks(texts: Iterable[str]) -> tuple[Network, ...]:
    """CIDR texts (``127.0.0.0/8``, ``::1/128``, a bare address); raises ``ValueError`` naming the bad one."""
    networks = []
    for text in texts:
        try:
            networks.append(ipaddress.ip_network(text.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not a network in CIDR notation: {text.strip()!r}") from None
    return tuple(networks)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries to an IPv4 host (mapped, 6to4, NAT64)."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_internal(address: Address) -> bool:
    """Anything but a globally routable unicast address (IPv4 or IPv6, embedded IPv4 included).

    ``is_global`` is the registries' list (IANA special-purpose registries), kept by Python rather
    than by hand here. It still calls two kinds global that no source may be: IPv6 site-local
    ``fec0::/10`` (deprecated, but routed inside some networks) and multicast. Reserved IPv6
    space is refused too; Teredo (``2001::/32``) is not global, so it is refused with its tunnel.
    An address embedding an IPv4 one (mapped, 6to4, NAT64) is judged by that IPv4 address.
    """
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_ipv4(address)
        if inner is not None:  # the packets go to the IPv4 host (NAT64 sits in reserved space)
            return is_internal(inner)
        if address.is_site_local:
            return True
    return not address.is_global or address.is_multicast or address.is_reserved


def is_allowed(address: Address, allow: Sequence[Network]) -> bool:
    """Public, or inside a network the deployment allows (an IPv4-mapped address counts as its IPv4)."""
    candidates: list[Address] = [address]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        candidates.append(address.ipv4_mapped)
    if any(a in n for a in candidates for n in allow if a.version == n.version):
        return True
    return not is_internal(address)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolve, check every address, connect to a checked one: the only way a source socket opens."""

    def __init__(self, allow: Sequence[Network] = (), backend: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.allow = tuple(allow)
        self.backend = backend or httpcore.AnyIOBackend()

    async def resolve(self, host: str, port: int, timeout: float | None) -> list[Address]:
        try:
            with anyio.fail_after(timeout):
                infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise httpcore.ConnectTimeout("name resolution timed out") from None
        except OSError as exc:
            raise httpcore.ConnectError(f"name resolution failed: {type(exc).__name__}") from None
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
        return list(dict.fromkeys(addresses))

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        allowed = [a for a in await self.resolve(host, port, timeout) if is_allowed(a, self.allow)]
        if not allowed:
            raise AddressRefused("the source's address is not reachable from here")
        error: Exception | None = None
        for address in allowed:  # every candidate is checked; DNS is not asked again
            try:
                return await self.backend.connect_tcp(str(address), port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(self, *args: object, **kwargs: object) -> httpcore.AsyncNetworkStream:
        raise AddressRefused("sources are read over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self.backend.sleep(seconds)


# httpcore's exceptions as httpx's, most specific first (httpx maps them the same way, privately).
_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = tuple(
    (getattr(httpcore, name), getattr(httpx, name))
    for name in (
        *("ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout"),
        *("ConnectError", "ReadError", "WriteError", "RemoteProtocolError", "LocalProtocolError"),
        *("UnsupportedProtocol", "ProtocolError", "NetworkError", "TimeoutException"),
    )
)


def _as_httpx(exc: Exception) -> Exception:
    if isinstance(exc, httpx.HTTPError):
        return exc
    for core, mapped in _ERRORS:
        if isinstance(exc, core):
            return mapped(str(exc))
    return exc


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: typing.AsyncIterable[bytes]) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self.stream:
                yield part
        except Exception as exc:  # noqa: BLE001 - re-raised as httpx's own type
            raise _as_httpx(exc) from exc

    async def aclose(self) -> None:
        aclose = getattr(self.stream, "aclose", None)
        if aclose is not None:
            await aclose()


class GuardedTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncHTTPTransport``'s job on an httpcore pool whose sockets open through ``GuardedBackend``.

    httpx's own transport takes no network backend, so this is the few lines that hand a request
    to httpcore and its answer back (both public API).
    """

    def __init__(
        self,
        allow: Sequence[Network] = (),
        limits: httpx.Limits | None = None,
        ssl_context: ssl.SSLContext | None = None,
        http2: bool = False,
    ) -> None:
        limits = limits or httpx.Limits()
        self.pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(),
            http2=http2,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=GuardedBackend(allow),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        try:
            response = await self.pool.handle_async_request(core_request)
        except Exception as exc:  # noqa: BLE001 - re-raised as httpx's own type
            raise _as_httpx(exc) from exc
        assert isinstance(response.stream, typing.AsyncIterable)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_Body(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self.pool.aclose()
