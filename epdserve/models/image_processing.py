"""Images in, tiles out: validation, the resolution policy and pixel normalisation.

Resolution policy (Idefics3 / SmolVLM style), for a decoded image of W x H pixels:

1. Scale so the longest edge is at most ``max_longest_edge`` pixels, keeping the aspect
   ratio (never upscaled; the short edge is rounded to the nearest pixel, at least 1).
2. Round each side UP to a multiple of ``tile_size`` (the image is stretched to that size):
   cols = ceil(W' / tile_size), rows = ceil(H' / tile_size).
3. Split into rows x cols tiles of tile_size x tile_size, row-major. When rows * cols > 1,
   append one global tile: the whole image resized to tile_size x tile_size. A small image
   (both sides <= tile_size) is therefore exactly one tile, with no global tile.

Pixels are RGB (transparency composited over white, as HF's ``convert_to_rgb``), resized
with Lanczos, scaled to [0, 1] and normalised with mean = std = 0.5 to [-1, 1].

With the defaults (tile 512, longest edge 2048) an image has at most 4 x 4 + 1 = 17 tiles;
e.g. 300x200 -> 1 tile, 1920x1080 -> 4 cols x 3 rows + global = 13 tiles.

Untrusted bytes: the header is parsed first (``Image.open`` is lazy), the format and the
pixel count are checked before any pixel is decoded. PIL's own decompression-bomb guard
(``Image.MAX_IMAGE_PIXELS``, process-wide, left at its default) stays active behind the
policy's limit; its error becomes the same one-line ``InvalidRequestError``.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import torch
from PIL import Image, UnidentifiedImageError

from epdserve.errors import ConfigError, InvalidRequestError

IMAGE_MEAN = 0.5
IMAGE_STD = 0.5
_RESAMPLE = Image.Resampling.LANCZOS
_KNOWN_FORMATS = frozenset(("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"))


@dataclass(frozen=True)
class ImagePolicy:
    """How an image becomes tiles, and which inputs are accepted."""

    tile_size: int = 512  # pixels per tile side; equals the vision tower's image_size
    max_longest_edge: int = 2048  # pixels, after the first resize
    max_input_pixels: int = 8192 * 8192  # width * height of the decoded input
    allowed_formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")  # PIL format names

    def __post_init__(self) -> None:
        if self.tile_size <= 0:
            raise ConfigError(f"tile_size must be positive, got {self.tile_size}")
        if self.max_longest_edge < self.tile_size:
            raise ConfigError(
                f"max_longest_edge={self.max_longest_edge} is smaller than tile_size={self.tile_size}"
            )
        if self.max_input_pixels <= 0:
            raise ConfigError(f"max_input_pixels must be positive, got {self.max_input_pixels}")
        if not self.allowed_formats:
            raise ConfigError("allowed_formats is empty")
        unknown = [name for name in self.allowed_formats if name not in _KNOWN_FORMATS]
        if unknown:
            raise ConfigError(f"unknown image formats {unknown} (known: {sorted(_KNOWN_FORMATS)})")

    @property
    def max_tiles_per_side(self) -> int:
        return math.ceil(self.max_longest_edge / self.tile_size)


@dataclass(frozen=True)
class ImageGrid:
    """The tiling of one image: ``rows`` x ``cols`` tiles, plus a global tile when > 1."""

    width: int  # of the decoded input image, pixels
    height: int
    rows: int
    cols: int

    def __post_init__(self) -> None:
        if min(self.width, self.height, self.rows, self.cols) <= 0:
            raise ValueError(f"invalid image grid {self}")

    @property
    def has_global_tile(self) -> bool:
        return self.rows * self.cols > 1

    @property
    def num_tiles(self) -> int:
        return self.rows * self.cols + int(self.has_global_tile)


def content_hash(data: bytes) -> str:
    """Hex digest of the raw bytes (blake2b, 16 bytes): the encoder-cache key."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _scaled_size(width: int, height: int, max_longest_edge: int) -> tuple[int, int]:
    """(width, height) with the longest edge at most ``max_longest_edge``, aspect kept."""
    longest = max(width, height)
    if longest <= max_longest_edge:
        return width, height
    scale = max_longest_edge / longest
    if width >= height:
        return max_longest_edge, max(1, round(height * scale))
    return max(1, round(width * scale)), max_longest_edge


def image_grid(width: int, height: int, policy: ImagePolicy) -> ImageGrid:
    """The tiling that ``preprocess`` produces for a ``width`` x ``height`` image."""
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"image has no pixels ({width}x{height})")
    scaled_width, scaled_height = _scaled_size(width, height, policy.max_longest_edge)
    return ImageGrid(
        width=width,
        height=height,
        rows=math.ceil(scaled_height / policy.tile_size),
        cols=math.ceil(scaled_width / policy.tile_size),
    )


def _open_checked(data: bytes, policy: ImagePolicy) -> Image.Image:
    """The lazily opened image after the format and size checks; no pixel decoded yet."""
    if not data:
        raise InvalidRequestError("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise InvalidRequestError(
            f"image is too large: over {limit} pixels (decompression-bomb guard)"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidRequestError("data is not a readable image (corrupt or unknown format)") from None
    if image.format not in policy.allowed_formats:
        allowed = ", ".join(policy.allowed_formats)
        raise InvalidRequestError(f"image format {image.format} is not supported (allowed: {allowed})")
    width, height = image.size
    if width * height > policy.max_input_pixels:
        raise InvalidRequestError(
            f"image is too large: {width}x{height} = {width * height} pixels, "
            f"the limit is {policy.max_input_pixels}"
        )
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"image has no pixels ({width}x{height})")
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels are composited over white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _decoded(data: bytes, policy: ImagePolicy) -> Image.Image:
    """The checked image with all its pixels decoded (``load``), in its own mode."""
    image = _open_checked(data, policy)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, EOFError):
        raise InvalidRequestError(
            f"{image.format} image is truncated or corrupt and cannot be decoded"
        ) from None
    return image


def decode_image(data: bytes, policy: ImagePolicy) -> Image.Image:
    """Decode untrusted bytes into an RGB image; InvalidRequestError for anything unusable."""
    return _to_rgb(_decoded(data, policy))


def probe_image(data: bytes, policy: ImagePolicy) -> ImageGrid:
    """Validate (format, size, fully decodable) and return the image's tiling."""
    image = _decoded(data, policy)
    return image_grid(image.width, image.height, policy)


def _normalise(image: Image.Image) -> torch.Tensor:
    """RGB image -> [3, H, W] float32 in [-1, 1]."""
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    pixels = pixels.view(image.height, image.width, 3).permute(2, 0, 1).float()
    return pixels.div_(255.0).sub_(IMAGE_MEAN).div_(IMAGE_STD)


def preprocess(image: Image.Image, policy: ImagePolicy) -> torch.Tensor:
    """Decoded image -> [num_tiles, 3, tile, tile] float32 in [-1, 1].

    Tiles are row-major (row 0: cols 0..C-1, then row 1, ...), the global tile last.
    """
    image = _to_rgb(image)
    grid = image_grid(image.width, image.height, policy)
    tile = policy.tile_size
    resized = image.resize((grid.cols * tile, grid.rows * tile), _RESAMPLE)
    pixels = _normalise(resized)  # [3, rows * tile, cols * tile]
    tiles = (
        pixels.view(3, grid.rows, tile, grid.cols, tile)
        .permute(1, 3, 0, 2, 4)
        .reshape(grid.rows * grid.cols, 3, tile, tile)
    )
    if grid.has_global_tile:
        whole = _normalise(image.resize((tile, tile), _RESAMPLE))
        tiles = torch.cat([tiles, whole[None]], dim=0)
    return tiles.contiguous()
