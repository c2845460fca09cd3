"""Images in chat requests: from OpenAI content parts to checked image files and a prompt.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}

Data URLs are decoded here; ``http(s)`` URLs are fetched only from hosts on the allow-list
(``--allowed-media-domains``), with a size cap and a timeout. Every image is probed (format,
size, fully decodable) before admission, so a bad image is a 400 and never reaches a worker.
The rendered chat prompt gets each image's token ids (the model's template for one image,
sized by the resolution policy) where the image part was.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import urllib.parse
from dataclasses import dataclass

from epdserve.errors import InvalidRequestError
from epdserve.models.image_processing import ImageGrid, content_hash, probe_image
from epdserve.models.multimodal import ImageSpan, MultimodalSpec
from epdserve.models.tokenizer import Tokenizer

# Stands for an image in the rendered chat text; split out before tokenizing.
_SENTINEL = "\x00epdserve-image\x00"


@dataclass(frozen=True)
class ImageLimits:
    max_images_per_request: int = 16
    max_image_bytes: int = 20 << 20  # the encoded file
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may come from
    fetch_timeout_s: float = 10.0


@dataclass(frozen=True)
class ImageInput:
    """One checked image of a request and its place in the prompt."""

    data: bytes  # the image file
    content_hash: str
    grid: ImageGrid
    span: ImageSpan


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    images: list[ImageInput]


def _decode_data_url(url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.startswith("data:") or ";base64" not in header:
        raise InvalidRequestError("an image data URL must look like data:image/png;base64,<data>")
    mime = header[5:].split(";")[0]
    if mime and not mime.startswith("image/"):
        raise InvalidRequestError(f"data URL has media type {mime!r}, not an image")
    if len(payload) > limits.max_image_bytes * 4 // 3 + 4:
        raise InvalidRequestError(f"image is larger than {limits.max_image_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image data URL is not valid base64") from None


async def _fetch(url: str, limits: ImageLimits) -> bytes:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=limits.fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            if resp.status != 200:
                raise InvalidRequestError(f"fetching image {url} returned HTTP {resp.status}")
            data = await resp.content.read(limits.max_image_bytes + 1)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise InvalidRequestError(f"cannot fetch image {url}: {type(e).__name__}") from None
    if len(data) > limits.max_image_bytes:
        raise InvalidRequestError(f"image is larger than {limits.max_image_bytes} bytes")
    return data


async def load_image_bytes(url: str, limits: ImageLimits) -> bytes:
    if url.startswith("data:"):
        return _decode_data_url(url, limits)
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise InvalidRequestError("image_url must be a data: URL or an http(s) URL")
    if parsed.hostname not in limits.allowed_media_domains:
        raise InvalidRequestError(
            f"remote image URLs are not allowed (host {parsed.hostname!r}); send the image as a "
            "data: URL, or start the server with --allowed-media-domains"
        )
    return await _fetch(url, limits)


def _image_url(part: dict) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("an image_url content part needs image_url.url")
    return url


def _render(tokenizer: Tokenizer, text_messages: list[dict], part_messages: list[dict], num_images: int) -> list[str]:
    """The rendered prompt split at the images: string content first, then content parts."""
    try:
        segments = tokenizer.apply_chat_template(text_messages).split(_SENTINEL)
    except InvalidRequestError:
        segments = []
    if len(segments) == num_images + 1 and "".join(segments).strip():
        return segments
    segments = tokenizer.apply_chat_template(part_messages).split(_SENTINEL)
    if len(segments) != num_images + 1:
        raise InvalidRequestError("the model's chat template does not keep every image of these messages")
    return segments


async def build_chat_prompt(
    messages: list[dict], tokenizer: Tokenizer, spec: MultimodalSpec | None, limits: ImageLimits
) -> ChatPrompt:
    """Render ``messages`` (OpenAI chat messages as dicts) into token ids and checked images."""
    urls: list[str] = []
    text_messages = []  # content as one string: most chat templates
    part_messages = []  # content as text parts: templates that iterate parts (SmolVLM's)
    for message in messages:
        content = message.get("content")
        parts = [{"type": "text", "text": content or ""}]
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                elif kind == "image_url":
                    urls.append(_image_url(part))
                    parts.append({"type": "text", "text": _SENTINEL})
                else:
                    raise InvalidRequestError(f"content part of type {kind!r} is not supported")
            content = "".join(p["text"] for p in parts)
        text_messages.append({"role": message["role"], "content": content or ""})
        part_messages.append({"role": message["role"], "content": parts})
    if urls and spec is None:
        raise InvalidRequestError(
            "this server does not take images; start it with --vision or --encode-workers"
        )
    if len(urls) > limits.max_images_per_request:
        raise InvalidRequestError(
            f"the request has {len(urls)} images; at most {limits.max_images_per_request} are allowed"
        )
    files = [await load_image_bytes(url, limits) for url in urls]
    grids = await asyncio.gather(*(asyncio.to_thread(probe_image, data, spec.policy) for data in files)) if files else []
    segments = _render(tokenizer, text_messages, part_messages, len(files))
    token_ids: list[int] = []
    images: list[ImageInput] = []
    for index, segment in enumerate(segments):
        if segment:
            token_ids += tokenizer.encode(segment, add_special_tokens=False)
        if index < len(files):
            ids = spec.image_prompt_ids(grids[index])
            span = ImageSpan(len(token_ids), len(ids), spec.num_image_tokens(grids[index]))
            token_ids += ids
            images.append(ImageInput(files[index], content_hash(files[index]), grids[index], span))
    return ChatPrompt(token_ids, images)
