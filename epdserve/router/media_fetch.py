"""Fetching remote images: ``http(s)`` URLs of chat requests, checked at every step.

A URL is fetched only when its host is on the allow-list (``--allowed-media-domains``) and
only from global unicast addresses: aiohttp connects to exactly the addresses a checking
resolver returned (an IP literal, which aiohttp connects to unresolved, is checked before the
request), so no second DNS answer can slip in between check and connect. A redirect is a 400,
or is followed for at most ``max_redirects`` hops, each checked like the first URL. A
request's URLs are fetched concurrently within one deadline; each body is read to its end
(no decompression) and refused once past ``max_image_bytes``. Every failure is an
``InvalidRequestError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from epdserve.errors import ConfigError, InvalidRequestError

_REDIRECT_STATUSES = frozenset((301, 302, 303, 307, 308))
_READ_CHUNK_BYTES = 64 << 10
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # IPv4 address in the low 32 bits
_MAX_URL_CHARS_IN_ERRORS = 200


@dataclass(frozen=True)
class ImageLimits:
    max_images_per_request: int = 16
    max_image_bytes: int = 20 << 20  # the encoded file
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may come from
    fetch_timeout_s: float = 10.0  # all remote images of one request together
    follow_redirects: bool = False  # False: a redirect is a 400
    max_redirects: int = 3  # hops per image when following
    allow_private_addresses: bool = False  # True: loopback, private, link-local, ... hosts too

    def __post_init__(self) -> None:
        if self.max_images_per_request < 1 or self.max_image_bytes < 1 or self.max_redirects < 0:
            raise ConfigError(f"invalid image limits {self}")
        if not self.fetch_timeout_s > 0:
            raise ConfigError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")


def forbidden_address_kind(address: str) -> str | None:
    """Why ``address`` (an IP literal) must not be fetched from ("loopback", "private", ...),
    or None for a global unicast address. An IPv4 address carried in IPv6 (IPv4-mapped,
    NAT64, 6to4) is judged as itself."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        nat64 = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF) if ip in _NAT64 else None
        ip = ip.ipv4_mapped or ip.sixtofour or nat64 or ip
    checks = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("site-local", isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
        ("non-global", not ip.is_global),
    )
    return next((kind for kind, is_kind in checks if is_kind), None)


def _check_address(host: str, address: str, limits: ImageLimits) -> None:
    kind = None if limits.allow_private_addresses else forbidden_address_kind(address)
    if kind is not None:
        shown = host if host == address else f"{host!r} ({address})"
        raise InvalidRequestError(
            f"image host {shown} is a {kind} address; images are fetched from public addresses only "
            "(start the server with --allow-private-media-addresses to allow it)"
        )


class _CheckedResolver(AbstractResolver):
    """The system resolver whose every answer passes ``_check_address``; aiohttp connects
    only to the addresses this returns, so the checked address is the connected one."""

    def __init__(self, limits: ImageLimits) -> None:
        self._resolver = ThreadedResolver()
        self._limits = limits

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._resolver.resolve(host, port, family)
        for result in results:
            _check_address(host, result["host"], self._limits)
        return results

    async def close(self) -> None:
        await self._resolver.close()


def _short(url: str | URL) -> str:
    text = str(url)
    return text if len(text) <= _MAX_URL_CHARS_IN_ERRORS else text[:_MAX_URL_CHARS_IN_ERRORS] + "..."


def _checked_url(url: str | URL) -> URL:
    """``url`` parsed as aiohttp will use it; http(s) with a host."""
    try:
        parsed = url if isinstance(url, URL) else URL(url)
        host = parsed.host
    except (ValueError, TypeError):
        raise InvalidRequestError(f"image URL {_short(url)} is not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not host:
        raise InvalidRequestError("image_url must be a data: URL or an http(s) URL")
    return parsed


def _check_host(url: URL, limits: ImageLimits) -> None:
    """The host allow-list; an IP literal (aiohttp connects to it unresolved) is checked here."""
    host = url.host or ""
    if _host_key(host) not in {_host_key(domain) for domain in limits.allowed_media_domains}:
        raise InvalidRequestError(
            f"remote image URLs are not allowed (host {_short(host)!r}); send the image as a "
            "data: URL, or start the server with --allowed-media-domains"
        )
    if _is_ip_literal(host):  # a name's addresses are checked by the resolver
        _check_address(host, host, limits)


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_key(host: str) -> str:
    """A host as the allow-list compares it: an IP literal in its canonical form, a name in
    lower case."""
    bare = host.strip("[]")
    return str(ipaddress.ip_address(bare)) if _is_ip_literal(bare) else host.lower()


def _redirect_target(url: str, hop: URL, status: int, location: str | None, num_redirects: int,
                     limits: ImageLimits) -> URL:
    """The checked next hop of a redirect from ``hop``, or a 400 when it is not followed."""
    if location is None:
        raise InvalidRequestError(f"image URL {_short(url)} redirects (HTTP {status}) without a Location")
    if not limits.follow_redirects:
        raise InvalidRequestError(
            f"image URL {_short(url)} redirects (HTTP {status}) to {_short(location)}; redirects are not "
            "followed (start the server with --media-follow-redirects)"
        )
    if num_redirects >= limits.max_redirects:
        raise InvalidRequestError(f"image URL {_short(url)} redirects more than {limits.max_redirects} times")
    try:
        target = hop.join(URL(location))
    except (ValueError, TypeError):
        raise InvalidRequestError(f"image URL {_short(url)} redirects to an invalid URL") from None
    target = _checked_url(target)
    _check_host(target, limits)
    return target


async def _read_body(resp: aiohttp.ClientResponse, url: str, limits: ImageLimits) -> bytes:
    """The whole body, read to EOF; a 400 as soon as it is known to pass ``max_image_bytes``."""
    if resp.status != 200:
        raise InvalidRequestError(f"fetching image {_short(url)} returned HTTP {resp.status}")
    too_large = f"image {_short(url)} is larger than {limits.max_image_bytes} bytes"
    if resp.content_length is not None and resp.content_length > limits.max_image_bytes:
        raise InvalidRequestError(f"{too_large} (Content-Length {resp.content_length})")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(_READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limits.max_image_bytes:
            raise InvalidRequestError(too_large)
    return bytes(body)


async def _fetch(session: aiohttp.ClientSession, url: str, limits: ImageLimits) -> bytes:
    """The image file at ``url``, whose first hop is already checked."""
    hop = _checked_url(url)
    num_redirects = 0
    while True:
        try:
            async with session.get(hop, allow_redirects=False) as resp:
                if resp.status not in _REDIRECT_STATUSES:
                    return await _read_body(resp, url, limits)
                status, location = resp.status, resp.headers.get(aiohttp.hdrs.LOCATION)
        except aiohttp.ClientError as e:
            raise InvalidRequestError(f"cannot fetch image {_short(url)}: {type(e).__name__}") from None
        hop = _redirect_target(url, hop, status, location, num_redirects, limits)
        num_redirects += 1


@contextlib.asynccontextmanager
async def _session(limits: ImageLimits) -> AsyncIterator[aiohttp.ClientSession]:
    """A session that connects only to checked addresses and never decompresses bodies (the
    byte limit applies to what arrives)."""
    resolver = _CheckedResolver(limits)
    connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
    try:
        async with aiohttp.ClientSession(
            connector=connector, auto_decompress=False, headers={"Accept-Encoding": "identity"}
        ) as session:
            yield session
    finally:
        await resolver.close()


async def _fetch_concurrently(urls: list[str], limits: ImageLimits) -> list[bytes]:
    """Every URL's file, in order; the first failure cancels the other fetches and is raised."""
    async with _session(limits) as session:
        tasks = [asyncio.ensure_future(_fetch(session, url, limits)) for url in urls]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]


def check_remote_url(url: str, limits: ImageLimits) -> None:
    """Refuse ``url`` before any connection: not http(s), host not allowed, or a forbidden
    IP literal."""
    _check_host(_checked_url(url), limits)


async def fetch_images(urls: list[str], limits: ImageLimits) -> list[bytes]:
    """The file at each of ``urls``, in order, fetched concurrently within one deadline of
    ``limits.fetch_timeout_s`` for all of them together."""
    try:
        return await asyncio.wait_for(_fetch_concurrently(urls, limits), limits.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise InvalidRequestError(
            f"fetching the request's {len(urls)} remote image(s) took longer than "
            f"{limits.fetch_timeout_s:g} s"
        ) from None
