"""The image side of a consumer (prefill or colocated) worker.

Either encode workers fill the consumer's embedding slab — a shared-memory segment, or a
private tensor behind a TCP listener — and the consumer only points each image's rows at it;
or, without a slab, the consumer encodes the images itself (in-process encoder, batched by
image, with the same content-hash cache as an encode worker).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from epdserve.cluster import messages as m
from epdserve.engine.encoder_runner import EncodeJob, EncoderRunner
from epdserve.engine.engine import LLMEngine, RequestOutput
from epdserve.errors import InvalidRequestError
from epdserve.request import MMInput
from epdserve.transfer.locality import this_node
from epdserve.transfer.slab import EmbeddingSlab
from epdserve.transfer.slab_tcp import TcpSlabReceiver


@dataclass(frozen=True)
class ImageOptions:
    vision: str  # tower name ("default", "smolvlm-256m", "checkpoint")
    embed_slab_mb: float  # > 0: a slab for encode workers; 0: encode in-process
    embed_transport: str  # "auto" (shared memory for encode workers on this node, TCP for others), "shm", "tcp"
    listen_host: str  # tcp: address of the slab listener
    max_batch_images: int  # in-process encoder: images per forward pass
    encoder_cache_mb: float
    cluster_key: bytes = field(default=b"", repr=False)  # what the slab listener asks peers to prove


@dataclass
class _EncodeTimes:
    start: float  # seconds since the epoch
    end: float
    num_cache_hits: int = 0


class ConsumerImages:
    def __init__(self, opts: ImageOptions, engine: LLMEngine, model: str | None, seed: int,
                 wake: Callable[[], None]) -> None:
        """``wake()`` interrupts the worker's poll (a TCP landing happened)."""
        from epdserve.models.multimodal import load_multimodal_spec, load_vision_encoder

        self.opts = opts
        self.engine = engine
        self.wake = wake
        self.spec = load_multimodal_spec(model, opts.vision)
        self.slab: EmbeddingSlab | None = None
        self.rows: torch.Tensor | None = None  # [num_rows, hidden]: where encode workers write
        self.endpoint: m.SlabEndpoint | None = None
        self.receiver: TcpSlabReceiver | None = None
        self.encoder: EncoderRunner | None = None
        self.lock = threading.Lock()  # TCP landings vs aborts
        self._landed: list[tuple[str, int]] = []
        self._inline_jobs: deque[tuple[str, int, EncodeJob]] = deque()
        self._times: dict[str, _EncodeTimes] = {}  # in-process encoding, per request
        dtype = engine.kv_dtype
        if opts.embed_slab_mb > 0:
            self._create_slab(dtype)
        else:
            encoder = load_vision_encoder(model, dtype, engine.device, vision=opts.vision, seed=seed)
            self.encoder = EncoderRunner(encoder, self.spec.policy, int(opts.encoder_cache_mb * (1 << 20)))

    def _create_slab(self, dtype: torch.dtype) -> None:
        hidden = self.spec.hidden_size
        itemsize = torch.tensor([], dtype=dtype).element_size()
        num_rows = max(1, int(self.opts.embed_slab_mb * (1 << 20)) // (hidden * itemsize))
        transport = self.opts.embed_transport
        if transport in ("shm", "auto"):
            self.slab = EmbeddingSlab.create(num_rows, hidden, dtype)
            self.rows, self.endpoint = self.slab.rows, self.slab.endpoint()
        else:
            self.rows = torch.zeros(num_rows, hidden, dtype=dtype)
            self.endpoint = m.SlabEndpoint("tcp", num_rows=num_rows, hidden_size=hidden,
                                           dtype=str(dtype).removeprefix("torch."))
        self.endpoint = msgspec.structs.replace(self.endpoint, transport=transport, node=this_node())
        if transport in ("tcp", "auto"):
            self.receiver = TcpSlabReceiver(self.rows, self._on_landed, self._accepts, self.lock,
                                            self.opts.cluster_key, self.opts.listen_host)
            self.endpoint = msgspec.structs.replace(self.endpoint, host=self.receiver.host, port=self.receiver.port)

    @property
    def can_encode(self) -> bool:
        return self.encoder is not None

    @property
    def has_inline_jobs(self) -> bool:
        return bool(self._inline_jobs)

    # -- requests ------------------------------------------------------------------------
    def mm_inputs(self, msg: m.Submit) -> list[MMInput]:
        """The request's images: slab views (encode workers fill them) or in-process jobs."""
        image_token_id = self.spec.image_token_id
        mm_inputs = []
        for ref in msg.images:
            span = msg.prompt_token_ids[ref.offset : ref.offset + ref.length]
            positions = None
            if ref.num_embeds != ref.length:
                positions = [i for i, t in enumerate(span) if t == image_token_id]
            if len(span) != ref.length or (positions is not None and len(positions) != ref.num_embeds):
                raise InvalidRequestError(f"image span at {ref.offset} does not match the prompt")
            mm = MMInput(ref.offset, ref.length, ref.num_embeds, ref.content_hash, positions)
            if ref.slab_offset is not None:
                if self.rows is None or ref.slab_offset + ref.num_embeds > self.rows.shape[0]:
                    raise InvalidRequestError("image rows lie outside this worker's embedding slab")
                mm.embeds = self.rows[ref.slab_offset : ref.slab_offset + ref.num_embeds]
            elif self.encoder is None:
                raise InvalidRequestError("this worker has no vision encoder; images need encode workers")
            mm_inputs.append(mm)
        return mm_inputs

    def queue_inline(self, msg: m.Submit) -> None:
        for index, ref in enumerate(msg.images):
            if ref.slab_offset is None:
                self._inline_jobs.append((msg.request_id, index, EncodeJob(ref.content_hash, ref.data)))

    def abort(self, request_id: str) -> bool:
        """Stop the request (no TCP landing for it after this returns); True when the router
        must be told that nothing more lands (a TCP slab)."""
        if self._inline_jobs:
            self._inline_jobs = deque(job for job in self._inline_jobs if job[0] != request_id)
        self._times.pop(request_id, None)
        with self.lock:
            self.engine.abort(request_id)
        return self.receiver is not None

    # -- in-process encoder --------------------------------------------------------------
    def encode_inline(self) -> list[tuple[str, str]]:
        """Embed up to ``max_batch_images`` queued images (batched by image); returns the
        (request id, error) of requests whose image failed, already aborted."""
        assert self.encoder is not None
        num = min(self.opts.max_batch_images, len(self._inline_jobs))
        batch = [self._inline_jobs.popleft() for _ in range(num)]
        failed = []
        for (request_id, index, _), result in zip(batch, self.encoder.run([job for _, _, job in batch])):
            if result.rows is None:
                self.abort(request_id)
                failed.append((request_id, result.error))
                continue
            times = self._times.setdefault(request_id, _EncodeTimes(result.start, result.end))
            times.end = result.end
            times.num_cache_hits += int(result.is_cache_hit)
            self.engine.mark_image_ready(request_id, index, result.rows)
        return failed

    def timing(self, out: RequestOutput, is_last: bool) -> dict:
        """In-process encode times for the output that carries the first token."""
        times = self._times.get(out.request_id)
        if times is None or not out.prefill_end:
            return {}
        if is_last:
            del self._times[out.request_id]
        return {"encode_start": times.start, "encode_end": times.end, "num_encoder_cache_hits": times.num_cache_hits}

    # -- TCP landings --------------------------------------------------------------------
    def _accepts(self, request_id: str, image_index: int, row_offset: int, num_rows: int) -> bool:
        """Receiver thread, under ``lock``: whether these rows may land now (the request is
        live, the image not yet landed, and the rows are the ones the router placed it in)."""
        mm_inputs = self.engine.mm_inputs(request_id)
        if mm_inputs is None or not 0 <= image_index < len(mm_inputs) or mm_inputs[image_index].is_ready:
            return False
        embeds = mm_inputs[image_index].embeds
        return (isinstance(embeds, torch.Tensor) and num_rows > 0 and embeds.shape[0] == num_rows
                and embeds.data_ptr() == self.rows[row_offset].data_ptr())

    def _on_landed(self, request_id: str, image_index: int) -> None:
        with self.lock:
            self._landed.append((request_id, image_index))
        self.wake()

    def take_landed(self) -> list[tuple[str, int]]:
        """Mark the images that landed since the last call ready; returns them."""
        with self.lock:
            landed, self._landed = self._landed, []
        return [(rid, index) for rid, index in landed if self.engine.mark_image_ready(rid, index)]

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.slab is not None:
            self.rows = None
            self.slab.close()
            self.slab = None
