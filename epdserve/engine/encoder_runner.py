"""Runs the vision encoder on a batch of images, with a content-hash embedding cache.

Encode workers and a consumer's in-process encoder share this: a batch is a list of images
(batched by image, whichever requests they belong to); an image whose content hash is in the
cache costs a copy, not a forward pass. The cache is LRU and bounded in bytes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from epdserve.engine.failures import describe, is_fatal
from epdserve.engine.host_memory import keep_freed_memory
from epdserve.errors import InvalidRequestError
from epdserve.models.image_processing import ImagePolicy, decode_image, preprocess
from epdserve.models.multimodal import encode_images
from epdserve.models.vision import VisionEncoder


class EncoderCache:
    """Image embeddings by content hash, least recently used evicted first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, content_hash: str) -> torch.Tensor | None:
        rows = self._entries.get(content_hash)
        if rows is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(content_hash)
        self.num_hits += 1
        return rows

    def put(self, content_hash: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or content_hash in self._entries:
            return
        while self.num_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
        self._entries[content_hash] = rows
        self.num_bytes += size


@dataclass(frozen=True)
class EncodeJob:
    content_hash: str
    data: bytes  # the image file


@dataclass(frozen=True)
class EncodeResult:
    rows: torch.Tensor | None  # [num_embeds, hidden]; None when the image failed
    is_cache_hit: bool
    start: float  # seconds since the epoch
    end: float
    error: str = ""
    num_tiles: int = 0  # tiles the encoder computed for it (0: a cache hit or a failure)


class EncoderRunner:
    def __init__(self, encoder: VisionEncoder, policy: ImagePolicy, cache_bytes: int) -> None:
        keep_freed_memory()  # the process's freed activations stay for the next image
        self.encoder = encoder
        self.policy = policy
        self.cache = EncoderCache(cache_bytes)

    @torch.inference_mode()
    def run(self, jobs: list[EncodeJob]) -> list[EncodeResult]:
        """Embed every job's image: cache hits first, the misses in one forward pass. An image
        that cannot be decoded or encoded gets a result with ``error`` (fatal errors raise)."""
        start = time.time()
        results: list[EncodeResult | None] = [None] * len(jobs)
        pixels: list[torch.Tensor] = []
        miss_indices: list[int] = []
        for i, job in enumerate(jobs):
            rows = self.cache.get(job.content_hash)
            if rows is not None:
                results[i] = EncodeResult(rows, True, start, time.time())
                continue
            try:
                pixels.append(preprocess(decode_image(job.data, self.policy), self.policy))
            except InvalidRequestError as e:  # the router probed it; a worker still never crashes
                results[i] = EncodeResult(None, False, start, time.time(), str(e))
                continue
            except Exception as e:
                if is_fatal(e):
                    raise
                results[i] = EncodeResult(None, False, start, time.time(), describe(e, "decoding the image"))
                continue
            miss_indices.append(i)
        if pixels:
            self._encode_misses(jobs, pixels, miss_indices, results, start)
        return [r for r in results if r is not None]

    def _encode_misses(self, jobs: list[EncodeJob], pixels: list[torch.Tensor], miss_indices: list[int],
                       results: list[EncodeResult | None], start: float) -> None:
        """One forward pass over the misses; if it raises, each image alone (images are
        encoded independently), so only the images that raise again fail."""
        try:
            outputs = encode_images(self.encoder, pixels)
        except Exception as e:
            if is_fatal(e):
                raise
            if len(pixels) == 1:
                results[miss_indices[0]] = EncodeResult(None, False, start, time.time(),
                                                        describe(e, "encoding the image"))
                return
            for i, image in zip(miss_indices, pixels):
                self._encode_misses(jobs, [image], [i], results, start)
            return
        end = time.time()
        for i, image, rows in zip(miss_indices, pixels, outputs):
            self.cache.put(jobs[i].content_hash, rows)
            results[i] = EncodeResult(rows, False, start, end, num_tiles=int(image.shape[0]))
