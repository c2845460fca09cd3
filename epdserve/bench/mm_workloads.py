"""``--dataset random-mm``: random prompts with synthetic images, for multimodal serving.

Like vLLM's random multimodal dataset: each request gets a random text prompt (as ``random``)
and ``base`` images, varied by ``--random-mm-num-mm-items-range-ratio``; each image takes one
of the ``--random-mm-resolutions`` at random. Images are smooth random fields (a coarse random
grid upsampled) sent as JPEG data URLs: distinct per request and per image, small on the wire,
real work for the server's decoder and encoder.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np

from epdserve.bench import BenchError
from epdserve.bench.workloads import BenchTokenizer, SampleRequest, random_requests

COARSE_GRID = 12  # random pixels per side before upsampling


def parse_resolutions(text: str) -> list[tuple[int, int]]:
    """``"256x256,1024x768"`` -> ``[(256, 256), (1024, 768)]`` (width x height)."""
    sizes = []
    for item in text.split(","):
        width, sep, height = item.strip().lower().partition("x")
        try:
            size = (int(width), int(height))
        except ValueError:
            raise BenchError(f"--random-mm-resolutions takes WxH[,WxH...], got {text!r}") from None
        if not sep or min(size) < 1 or max(size) > 8192:
            raise BenchError(f"image resolution must be WxH with sides in 1..8192, got {item!r}")
        sizes.append(size)
    return sizes


def synthetic_image(rng: np.random.Generator, width: int, height: int, quality: int = 90) -> bytes:
    """A JPEG of a smooth random RGB field of ``width`` x ``height`` pixels."""
    from PIL import Image

    coarse = rng.integers(0, 256, (COARSE_GRID, COARSE_GRID, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def random_mm_requests(
    tok: BenchTokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    base_items: int,
    items_range_ratio: float,
    resolutions: list[tuple[int, int]],
) -> list[SampleRequest]:
    if base_items < 0:
        raise BenchError(f"--random-mm-base-items-per-request must be >= 0, got {base_items}")
    if not 0.0 <= items_range_ratio <= 1.0:
        raise BenchError(f"--random-mm-num-mm-items-range-ratio must be in [0, 1], got {items_range_ratio}")
    texts = random_requests(tok, num_prompts, input_len, output_len, range_ratio, seed)
    rng = np.random.default_rng(seed + 1)
    low = math.floor(base_items * (1 - items_range_ratio))
    high = math.ceil(base_items * (1 + items_range_ratio))
    requests = []
    for text in texts:
        num_images = int(rng.integers(low, high + 1))
        images = []
        for _ in range(num_images):
            width, height = resolutions[int(rng.integers(0, len(resolutions)))]
            images.append(data_url(synthetic_image(rng, width, height)))
        requests.append(SampleRequest(text.prompt, text.prompt_len, text.expected_output_len, tuple(images)))
    return requests
