"""Fetching ``image_url`` http(s) URLs (router.media_fetch, through router.images): allow-list,
address checks, redirects, byte limits, one deadline for a request's images, decompression bombs.

A real aiohttp server on 127.0.0.1 (port 0, in a thread) serves the images; ``localhost``
is a host name that resolves to it, so "an allowed name that resolves to loopback" is real.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import io
import socket
import struct
import threading
import zlib

import httpx
import numpy as np
import pytest
from aiohttp import web
from PIL import Image
from serving import SMALL, start_server, stop_server

from epdserve.errors import InvalidRequestError
from epdserve.models.loader import load_model_info
from epdserve.models.multimodal import load_multimodal_spec
from epdserve.router.images import ImageLimits, build_chat_prompt, load_images
from epdserve.router.media_fetch import forbidden_address_kind

STOP_WAIT_S = 10.0  # longest a stalling handler holds a response


def png(seed: int, size: tuple[int, int] = (48, 32)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def png_claiming_size(width: int, height: int) -> bytes:
    """A tiny valid PNG whose header claims ``width`` x ``height`` pixels."""
    small = png(5, (8, 8))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return small[:8] + chunk + small[8 + 25:]


IMAGE = png(1)
BOMB = png_claiming_size(100_000, 100_000)  # 10^10 pixels declared, a few hundred bytes


class MediaServer:
    """Images, redirects, slow and oversized bodies over real HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        self.hits: collections.Counter[str] = collections.Counter()  # requests per path
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.max_in_flight: collections.Counter[str] = collections.Counter()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=STOP_WAIT_S + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    async def _start(self) -> None:
        self._stopping = asyncio.Event()
        self._everyone_in: dict[str, asyncio.Event] = collections.defaultdict(asyncio.Event)
        app = web.Application(middlewares=[self._count])
        app.router.add_get("/image.png", self._image)
        app.router.add_get("/bomb.png", self._image)
        app.router.add_get("/redirect", self._redirect)
        app.router.add_get("/chunks.png", self._chunks)
        app.router.add_get("/endless", self._endless)
        app.router.add_get("/declares-big", self._declares_big)
        app.router.add_get("/together/{group}/{name}", self._together)
        app.router.add_get("/stall", self._stall)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock).start()

    async def _stop(self) -> None:
        self._stopping.set()
        await self._runner.cleanup()

    @web.middleware
    async def _count(self, request: web.Request, handler) -> web.StreamResponse:
        self.hits[request.path] += 1
        return await handler(request)

    async def _image(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=BOMB if request.path == "/bomb.png" else IMAGE, content_type="image/png")

    async def _redirect(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(request.query.get("to", "/redirect"))

    async def _chunks(self, request: web.Request) -> web.StreamResponse:
        """IMAGE in three chunks with pauses between them, without Content-Length."""
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        third = len(IMAGE) // 3
        for part in (IMAGE[:third], IMAGE[third:2 * third], IMAGE[2 * third:]):
            await resp.write(part)
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        """A chunked body of ``?bytes=N``, no Content-Length."""
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(int(request.query["bytes"]) // 1024):
            await resp.write(b"\0" * 1024)
        await resp.write_eof()
        return resp

    async def _declares_big(self, request: web.Request) -> web.StreamResponse:
        """Content-Length: 10 MB, then 16 bytes, then nothing until the server stops."""
        resp = web.StreamResponse(headers={"Content-Type": "image/png"})
        resp.content_length = 10_000_000
        await resp.prepare(request)
        await resp.write(IMAGE[:16])
        await self._wait_for_stop()
        return resp

    async def _together(self, request: web.Request) -> web.StreamResponse:
        """Answers once every request of its group is in flight, or after 0.6 s."""
        group = request.match_info["group"]
        self.in_flight[group] += 1
        self.max_in_flight[group] = max(self.max_in_flight[group], self.in_flight[group])
        if self.in_flight[group] >= 2:
            self._everyone_in[group].set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._everyone_in[group].wait(), 0.6)
        self.in_flight[group] -= 1
        return web.Response(body=IMAGE, content_type="image/png")

    async def _stall(self, request: web.Request) -> web.StreamResponse:
        await self._wait_for_stop()
        return web.Response(body=IMAGE, content_type="image/png")

    async def _wait_for_stop(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), STOP_WAIT_S)


@pytest.fixture(scope="module")
def media():
    server = MediaServer()
    server.start()
    yield server
    server.stop()


def fetch(urls: list[str], **limits) -> list[bytes]:
    return asyncio.run(load_images(urls, ImageLimits(**limits)))


def refused(urls: list[str], fragment: str, **limits) -> str:
    with pytest.raises(InvalidRequestError) as excinfo:
        fetch(urls, **limits)
    message = str(excinfo.value)
    assert fragment in message and "\n" not in message
    return message


LOCAL = {"allowed_media_domains": ("localhost",), "allow_private_addresses": True}


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("64:ff9b::7f00:1", "loopback"), ("2002:7f00:1::", "loopback"),
    ("10.1.2.3", "private"), ("192.168.0.1", "private"), ("fc00::1", "private"),
    ("::ffff:10.0.0.1", "private"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("fe80::1%1", "link-local"), ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("::127.0.0.1", "reserved"),
    ("100.64.0.1", "non-global"), ("8.8.8.8", None), ("2606:4700::1111", None),
    ("::ffff:8.8.8.8", None),
])
def test_address_kinds(address: str, kind: str | None) -> None:
    assert forbidden_address_kind(address) == kind


def test_redirect_is_refused_unless_followed(media: MediaServer) -> None:
    to_loopback = media.url(f"/redirect?to={media.url('/image.png', '127.0.0.1')}")
    before = media.hits["/image.png"]
    refused([to_loopback], "redirects are not followed (start the server with --media-follow-redirects)", **LOCAL)
    # Followed: the hop's host is checked against the allow-list like the URL's.
    message = refused([to_loopback], "not allowed", follow_redirects=True, **LOCAL)
    assert "'127.0.0.1'" in message
    assert media.hits["/image.png"] == before
    allowed = LOCAL | {"allowed_media_domains": ("localhost", "127.0.0.1"), "follow_redirects": True}
    assert fetch([to_loopback], **allowed) == [IMAGE]
    # ... and against the address rules, like any URL: a loopback literal is refused.
    refused([media.url("/image.png", "127.0.0.1")], "is a loopback address",
            allowed_media_domains=("127.0.0.1",), follow_redirects=True)
    refused([media.url("/redirect")], "redirects more than 3 times", **allowed)


def test_allowed_name_resolving_to_loopback(media: MediaServer) -> None:
    url = media.url("/image.png")
    before = media.hits["/image.png"]
    message = refused([url], "is a loopback address", allowed_media_domains=("localhost",))
    assert "--allow-private-media-addresses" in message
    refused([media.url("/image.png", "[::ffff:127.0.0.1]")], "is a loopback address",
            allowed_media_domains=("::ffff:127.0.0.1",))
    assert media.hits["/image.png"] == before  # refused before connecting
    assert fetch([url], **LOCAL) == [IMAGE]


def test_body_is_read_to_its_end(media: MediaServer) -> None:
    assert fetch([media.url("/chunks.png")], **LOCAL) == [IMAGE]


def test_chunked_body_over_the_limit(media: MediaServer) -> None:
    assert fetch([media.url("/endless?bytes=4096")], max_image_bytes=4096, **LOCAL) == [b"\0" * 4096]
    refused([media.url("/endless?bytes=8192")], "larger than 4096 bytes", max_image_bytes=4096, **LOCAL)


def test_content_length_over_the_limit_is_refused_before_reading(media: MediaServer) -> None:
    # The body never completes: reading it would end at the deadline, not at this message.
    refused([media.url("/declares-big")], "larger than 1048576 bytes (Content-Length 10000000)",
            max_image_bytes=1 << 20, fetch_timeout_s=STOP_WAIT_S * 2, **LOCAL)


def test_images_of_a_request_are_fetched_concurrently(media: MediaServer) -> None:
    # Each answer waits up to 0.6 s for the other request: one after the other would take
    # 1.2 s and miss the 1 s deadline for both.
    urls = [media.url("/together/pair/a"), media.url("/together/pair/b")]
    assert fetch(urls, fetch_timeout_s=1.0, **LOCAL) == [IMAGE, IMAGE]
    assert media.max_in_flight["pair"] == 2


def test_slow_server_misses_the_deadline(media: MediaServer) -> None:
    refused([media.url("/image.png"), media.url("/stall")], "took longer than 0.3 s", fetch_timeout_s=0.3, **LOCAL)


@pytest.fixture(scope="module")
def chat_model():
    return load_model_info(None).tokenizer, load_multimodal_spec(None, "default")


def chat_prompt(chat_model, urls: list[str], limits: ImageLimits):
    content = [{"type": "text", "text": "Compare."}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    tokenizer, spec = chat_model
    return asyncio.run(build_chat_prompt([{"role": "user", "content": content}], tokenizer, spec, limits))


def test_chat_prompt_with_remote_images(media: MediaServer, chat_model) -> None:
    other = png(2, (600, 40))
    data_url = "data:image/png;base64," + base64.b64encode(other).decode()
    prompt = chat_prompt(chat_model, [media.url("/image.png"), data_url, media.url("/chunks.png")],
                         ImageLimits(**LOCAL))
    assert [image.data for image in prompt.images] == [IMAGE, other, IMAGE]
    assert [image.grid.num_tiles for image in prompt.images] == [1, 3, 1]


def test_decompression_bomb_is_refused_from_its_header(media: MediaServer, chat_model) -> None:
    assert len(BOMB) < 1000
    with pytest.raises(InvalidRequestError, match="too large"):
        chat_prompt(chat_model, [media.url("/bomb.png")], ImageLimits(**LOCAL))


@pytest.mark.slow
def test_served_chat_with_remote_images(media: MediaServer, tmp_path) -> None:
    server = start_server([*SMALL, "--colocated-workers", "1", "--cores-per-worker", "2", "--vision", "default",
                           "--allowed-media-domains", "localhost", "--allow-private-media-addresses",
                           "--media-follow-redirects"], str(tmp_path))
    try:
        def chat(url: str) -> httpx.Response:
            content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
            body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": content}],
                    "max_tokens": 2}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)

        r = chat(media.url(f"/redirect?to={media.url('/image.png', '127.0.0.1')}"))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "not allowed" in error["message"] and error["type"] == "BadRequestError" and error["code"] == 400
        r = chat(media.url(f"/redirect?to={media.url('/image.png')}"))
        assert r.status_code == 200, r.text
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
