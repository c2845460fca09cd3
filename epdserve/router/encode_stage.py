"""The router's side of the encode stage: slab space, encode jobs, embedding readiness.

An image request's path, with encode workers::

    admit: place every image in the consumer's slab (all or none; full -> 503 Retry-After)
    submit: consumer gets the prompt with (slab offset, rows) per image, nothing ready yet
    encode: one EncodeImage per image to an encode worker (same content -> same worker while
            its queue is not much longer: its cache has the embedding)
    EncodeDone(ok) -> EmbeddingReady to the consumer (it may prefill up to the next image)

A slab region is freed only when both hold: the consumer is done with the path (finished,
aborted or dead) and no encoder can still write the region (every job answered, or its
encoder gone). A suspected encoder (lease missed, step hung) may still be alive and resume in
the middle of a batch, writing into the rows of requests the router has failed meanwhile: the
rows of its jobs stay held (quarantined) until it has reconciled and registered again, which
it does only after the batch in hand is written, or until its process is known to have
exited. Without encode workers, a consumer that has its own encoder gets the image
files inline and encodes them itself.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from epdserve.cluster import messages as m
from epdserve.request import EventType
from epdserve.roles import Role
from epdserve.router import admission
from epdserve.router.admission import Overloaded
from epdserve.router.path import Path, PathImages
from epdserve.router.workers import WorkerRegistry, WorkerState
from epdserve.transfer.slab import SlabAllocator

if TYPE_CHECKING:
    from epdserve.router.metrics import RouterMetrics

    from epdserve.router.channel import WorkerChannel
    from epdserve.router.images import ImageInput
    from epdserve.router.workers import WorkerInfo

AFFINITY_SLACK = 2  # jobs an encoder may have beyond the least loaded and still get its images


class PathOwner(Protocol):
    """What the encode stage needs of the request flow (flow.py)."""

    paths: dict[str, Path]

    def fail(self, path: Path, message: str) -> None: ...

    def forget_if_idle(self, path: Path) -> None: ...


class EncodeStage:
    def __init__(self, owner: PathOwner, channel: WorkerChannel, registry: WorkerRegistry, metrics: RouterMetrics,
                 pipelined: bool = True) -> None:
        self.owner = owner
        self.channel = channel
        self.registry = registry
        self.metrics = metrics
        self.pipelined = pipelined
        self.allocators: dict[str, SlabAllocator] = {}  # consumer worker id -> its slab's rows
        self.slabs: dict[str, m.SlabEndpoint] = {}
        self.jobs_per_encoder: dict[str, set[tuple[str, int]]] = {}  # (path id, image index)
        # Suspected encoder -> its jobs whose rows stay held until it reconciles or exits.
        self.quarantined: dict[str, set[tuple[str, int]]] = {}

    # -- workers -------------------------------------------------------------------------
    def on_register(self, msg: m.Register) -> None:
        if msg.slab is not None:
            self.allocators[msg.worker_id] = SlabAllocator(msg.slab.num_rows)
            self.slabs[msg.worker_id] = msg.slab
            self.metrics.slab_rows_free.labels(msg.worker_id).set(msg.slab.num_rows)
            for encoder in self.registry.ready(Role.ENCODE):
                self.channel.post(encoder.worker_id, m.SlabUp(msg.worker_id, msg.slab))
        if msg.role == Role.ENCODE:
            self._release_quarantine(msg.worker_id)  # back and reconciled, or a new process
            self.jobs_per_encoder[msg.worker_id] = set()
            for worker_id, slab in self.slabs.items():
                if self.registry.is_ready(worker_id):
                    self.channel.post(msg.worker_id, m.SlabUp(worker_id, slab))

    def on_worker_dead(self, worker: WorkerInfo) -> None:
        """``worker`` left READY (for SUSPECT or DEAD): its requests fail."""
        if worker.role == Role.ENCODE:
            jobs = self.jobs_per_encoder.pop(worker.worker_id, set())
            is_suspect = worker.state is WorkerState.SUSPECT
            if is_suspect:
                self.quarantined[worker.worker_id] = jobs
            for path_id, index in jobs:
                path = self.owner.paths.get(path_id)
                if path is None or path.mm is None:
                    continue
                if not is_suspect:
                    path.mm.pending_jobs.pop(index, None)  # a dead encoder writes nothing more
                if not path.done:
                    self.owner.fail(path, f"encode worker {worker.worker_id} failed while serving this request")
                self.maybe_free(path)
            return
        if worker.worker_id in self.allocators:  # its slab went with it
            del self.allocators[worker.worker_id]
            self.slabs.pop(worker.worker_id, None)
            for path in list(self.owner.paths.values()):
                if path.mm is not None and path.mm.consumer == worker.worker_id:
                    path.mm.pending_jobs.clear()  # nothing will land; late writes hit a dead slab
                    path.mm.regions = []
                    self.owner.forget_if_idle(path)
            for encoder in self.registry.ready(Role.ENCODE):
                self.channel.post(encoder.worker_id, m.PeerDown(worker.worker_id))

    def on_worker_gone(self, worker: WorkerInfo) -> None:
        """A suspected worker's process exited: it writes nothing more."""
        if worker.role == Role.ENCODE:
            self._release_quarantine(worker.worker_id)

    def _release_quarantine(self, encoder: str) -> None:
        for path_id, index in self.quarantined.pop(encoder, set()):
            path = self.owner.paths.get(path_id)
            if path is None or path.mm is None or path.mm.pending_jobs.get(index) != encoder:
                continue
            del path.mm.pending_jobs[index]
            path.mm.sent_indices.discard(index)
            self.maybe_free(path)

    def has_encoders(self) -> bool:
        return bool(self.registry.ready(Role.ENCODE))

    # -- admission -----------------------------------------------------------------------
    def place(self, path: Path, consumer: WorkerInfo, images: list[ImageInput]) -> list[m.ImageRef]:
        """The image refs for ``consumer``'s Submit; raises Overloaded when there is no room
        (slab full) or nobody can encode."""
        allocator = self.allocators.get(consumer.worker_id)
        if self.has_encoders() and allocator is not None:
            regions = []
            for image in images:
                region = allocator.allocate(image.span.num_embeds)
                if region is None:
                    for r in regions:
                        allocator.free(r)
                    raise Overloaded(admission.slab_full(consumer.worker_id))
                regions.append(region)
            path.mm = PathImages(images, consumer.worker_id, regions)
            self._observe_slab(consumer.worker_id)
            return [
                m.ImageRef(im.span.offset, im.span.length, im.span.num_embeds, im.content_hash, r.offset)
                for im, r in zip(images, regions)
            ]
        if consumer.can_encode:
            path.mm = PathImages(images, consumer.worker_id)
            return [
                m.ImageRef(im.span.offset, im.span.length, im.span.num_embeds, im.content_hash, data=im.data)
                for im in images
            ]
        raise Overloaded(admission.no_encoder())

    def dispatch(self, path: Path) -> None:
        """Send the encode jobs of a submitted path (slab mode)."""
        mm = path.mm
        if mm is None or not mm.regions:
            return
        for index, (image, region) in enumerate(zip(mm.images, mm.regions)):
            encoder = self._pick_encoder(image.content_hash)
            mm.pending_jobs[index] = encoder
            self.jobs_per_encoder[encoder].add((path.path_id, index))
            self.channel.post(encoder, m.EncodeImage(
                path.path_id, index, image.content_hash, image.data, mm.consumer, region.offset, region.num_rows,
            ))

    def _pick_encoder(self, content_hash: str) -> str:
        encoders = sorted(w.worker_id for w in self.registry.ready(Role.ENCODE))
        loads = {e: len(self.jobs_per_encoder.setdefault(e, set())) for e in encoders}
        affine = encoders[int(content_hash[:8], 16) % len(encoders)]
        least = min(encoders, key=lambda e: loads[e])
        return affine if loads[affine] <= loads[least] + AFFINITY_SLACK else least

    # -- progress ------------------------------------------------------------------------
    def on_encode_done(self, sender: str, msg: m.EncodeDone) -> None:
        job = (msg.request_id, msg.image_index)
        assigned, held = self.jobs_per_encoder.get(sender, set()), self.quarantined.get(sender, set())
        if job not in assigned and job not in held:
            return  # answered already, or never this encoder's job
        assigned.discard(job)
        held.discard(job)
        if msg.ok:  # counted whatever became of the request: over TCP the landing can come first
            self.metrics.embedding_bytes.inc(msg.num_bytes)
            self.metrics.encode_time.observe(max(0.0, msg.encode_end - msg.encode_start))
            self.metrics.encoder_cache_hits.inc(int(msg.is_cache_hit))
        path = self.owner.paths.get(msg.request_id)
        if path is None or path.mm is None:
            return
        timing = path.handle.timing
        if msg.ok:
            timing.record(EventType.ENCODE_START, msg.encode_start)
            timing.record(EventType.ENCODE_END, time.time())
            timing.embed_transfer_s += msg.write_s
            timing.num_encoder_cache_hits += int(msg.is_cache_hit)
        if msg.image_index not in path.mm.pending_jobs:
            return  # landed (TCP) before its encoder's report, or its encoder was given up on
        is_tcp = msg.via_tcp
        if msg.ok and is_tcp and not path.mm.is_consumer_closed:
            # Sent is not landed: the job ends when the consumer reports the landing (or that
            # it takes no more for this request).
            path.mm.sent_indices.add(msg.image_index)
        else:
            del path.mm.pending_jobs[msg.image_index]
        if msg.ok:
            if not path.done and not is_tcp:
                self.channel.post(path.mm.consumer, m.EmbeddingReady(path.path_id, msg.image_index))
        elif not path.done:
            self.owner.fail(path, f"image {msg.image_index} could not be encoded: {msg.reason}")
        self.maybe_free(path)

    def on_embedding_landed(self, msg: m.EmbeddingLanded) -> None:
        """An image landed in a TCP slab; index None: the consumer dropped the request and lands
        nothing more of it."""
        path = self.owner.paths.get(msg.request_id)
        if path is None or path.mm is None:
            return
        mm = path.mm
        if msg.image_index is None:
            mm.is_consumer_closed = True
            for index in mm.sent_indices:
                mm.pending_jobs.pop(index, None)
        else:
            mm.pending_jobs.pop(msg.image_index, None)
        mm.sent_indices.discard(msg.image_index)
        self.maybe_free(path)

    def on_consumer_done(self, path: Path) -> None:
        if path.mm is not None and not path.mm.is_consumer_done:
            path.mm.is_consumer_done = True
            self.maybe_free(path)

    def abort(self, path: Path) -> None:
        """Drop the path's queued jobs (each encoder still answers every job)."""
        if path.mm is None:
            return
        for encoder in set(path.mm.pending_jobs.values()):
            self.channel.post(encoder, m.Abort(path.path_id))

    def maybe_free(self, path: Path) -> None:
        mm = path.mm
        if mm is None or not mm.regions or not mm.is_consumer_done or mm.pending_jobs:
            return
        allocator = self.allocators.get(mm.consumer)
        if allocator is not None:
            for region in mm.regions:
                allocator.free(region)
            self._observe_slab(mm.consumer)
        mm.regions = []
        self.owner.forget_if_idle(path)

    def is_holding(self, path: Path) -> bool:
        """Whether the path still holds slab space or waits for encoders."""
        return path.mm is not None and bool(path.mm.regions or path.mm.pending_jobs)

    def worker_json(self, worker_id: str) -> dict:
        """Slab occupancy of a consumer, for ``/v1/workers``; {} for other workers."""
        allocator = self.allocators.get(worker_id)
        if allocator is None:
            return {}
        return {"embedding_slab": {"num_rows": allocator.num_rows, "num_free_rows": allocator.num_free_rows}}

    def _observe_slab(self, worker_id: str) -> None:
        allocator = self.allocators.get(worker_id)
        if allocator is not None:
            self.metrics.slab_rows_free.labels(worker_id).set(allocator.num_free_rows)
