"""Images in chat requests: from OpenAI content parts to checked image files and a prompt.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}

Data URLs are decoded here; ``http(s)`` URLs are fetched by ``media_fetch`` (allow-listed
hosts, public addresses only, redirects refused or checked per hop, a size cap, one deadline
for all of a request's images). Every image is probed (format, pixel count from the header,
then fully decodable) before admission, so a bad image is a 400 and never reaches a worker.
The rendered chat prompt gets each image's token ids (the model's template for one image,
sized by the resolution policy) where the image part was.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass

from epdserve.errors import InvalidRequestError
from epdserve.models.image_processing import ImageGrid, content_hash, probe_image
from epdserve.models.multimodal import ImageSpan, MultimodalSpec
from epdserve.models.tokenizer import Tokenizer
from epdserve.router.media_fetch import ImageLimits, check_remote_url, fetch_images

__all__ = ["ChatPrompt", "ImageInput", "ImageLimits", "build_chat_prompt", "load_image_bytes", "load_images"]

# Stands for an image in the rendered chat text; split out before tokenizing.
_SENTINEL = "\x00epdserve-image\x00"


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


async def load_images(urls: list[str], limits: ImageLimits) -> list[bytes]:
    """The image file of each URL, in order: data URLs decoded, http(s) URLs checked, then
    fetched concurrently within one deadline (``media_fetch``)."""
    files: dict[int, bytes] = {}
    remote: dict[int, str] = {}
    for index, url in enumerate(urls):
        if url.startswith("data:"):
            files[index] = _decode_data_url(url, limits)
        else:
            check_remote_url(url, limits)
            remote[index] = url
    if remote:
        files.update(zip(remote, await fetch_images(list(remote.values()), limits)))
    return [files[index] for index in range(len(urls))]


async def load_image_bytes(url: str, limits: ImageLimits) -> bytes:
    """The image file of one ``image_url`` (see ``load_images``)."""
    return (await load_images([url], limits))[0]


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
    files = await load_images(urls, limits)
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
