"""An encode worker: the vision encoder, batched by image, writing into consumers' slabs.

    epdserve worker --role encode --router tcp://HOST:PORT [--vision NAME] [engine options]

The router sends one ``EncodeImage`` per image (the image file, the consumer's id and the
row offset it allocated in that consumer's slab). The worker takes up to
``max_batch_images`` queued images per step, whichever requests they belong to, serves
repeated images from its content-hash cache, writes each embedding into the consumer's slab
(mapped once, when the router announces the consumer) and answers ``EncodeDone`` per image.
Every job gets exactly one answer, so the router knows when no more writes can land in a
slab region.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from epdserve.cluster import messages as m
from epdserve.cluster.router_link import MalformedFrame
from epdserve.cluster.step_trace import StepTrace
from epdserve.cluster.worker_base import Handler, WorkerBase, run_process
from epdserve.config import ENCODE_BATCH_IMAGES, resolve_device_name, resolve_dtype_name
from epdserve.engine.encoder_runner import EncodeJob, EncodeResult, EncoderRunner
from epdserve.engine.failures import describe, is_fatal
from epdserve.errors import ConfigError
from epdserve.models.multimodal import load_multimodal_spec, load_vision_encoder
from epdserve.roles import Role
from epdserve.transfer.locality import pick_transport
from epdserve.transfer.slab import EmbeddingSlab
from epdserve.transfer.slab_tcp import TcpSlabSender

log = logging.getLogger("epdserve.encode")


@dataclass(frozen=True)
class EncodeWorkerOptions:
    router: str
    worker_id: str
    model: str | None = None
    vision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    cores: tuple[int, ...] = ()
    max_batch_images: int = ENCODE_BATCH_IMAGES  # images per encoder forward pass
    cache_bytes: int = 256 << 20  # content-hash embedding cache
    heartbeat_s: float = 0.2
    die_with_parent: bool = False
    cluster_key: bytes = field(default=b"", repr=False)  # the cluster secret (epdserve/auth.py)
    step_trace_dir: str | None = None  # write every encoder batch to DIR/<worker id>.jsonl (step_trace.py)

    def __post_init__(self) -> None:
        if self.max_batch_images < 1:
            raise ConfigError(f"--encode-batch-images must be at least 1, got {self.max_batch_images}")
        if self.cache_bytes < 0:
            raise ConfigError("the encoder cache size must not be negative")


class EncodeWorker(WorkerBase):
    role = Role.ENCODE

    def __init__(self, opts: EncodeWorkerOptions) -> None:
        super().__init__(opts.router, opts.worker_id, opts.cluster_key, opts.cores, opts.heartbeat_s)
        self.opts = opts
        device_name = resolve_device_name(opts.device)
        dtype = getattr(torch, resolve_dtype_name(opts.dtype, device_name))
        device = torch.device(device_name)
        self.spec = load_multimodal_spec(opts.model, opts.vision)
        encoder = load_vision_encoder(opts.model, dtype, device, vision=opts.vision, seed=opts.seed)
        self.runner = EncoderRunner(encoder, self.spec.policy, opts.cache_bytes)
        self.slabs: dict[str, EmbeddingSlab | TcpSlabSender] = {}  # consumer id -> its slab (shm) or link (tcp)
        self.queue: deque[m.EncodeImage] = deque()
        self._num_busy = 0
        self._step_trace = (StepTrace(opts.step_trace_dir, opts.worker_id, "encode", torch.get_num_threads())
                            if opts.step_trace_dir else None)

    def register(self) -> m.Register:
        return self._register(model_name=self.opts.vision or "default", max_model_len=0, num_kv_blocks=0,
                              block_size=0)

    def load(self) -> m.Load:
        cache = self.runner.cache
        return m.Load(num_running=self._num_busy, num_waiting=len(self.queue), num_free_blocks=0, num_used_blocks=0,
                      num_encoder_cache_hits=cache.num_hits, num_encoder_cache_bytes=cache.num_bytes)

    # -- messages ------------------------------------------------------------------------
    def _handlers(self) -> dict[type, Handler]:
        return {
            **super()._handlers(),
            MalformedFrame: self._on_malformed,
            m.EncodeImage: lambda msg: self.queue.append(msg),  # self.queue is replaced on aborts
            m.Abort: self._on_abort,
            m.SlabUp: self._on_slab_up,
            m.PeerDown: lambda msg: self._unmap(msg.worker_id),
        }

    def _fail_message(self, msg: m.Message | MalformedFrame, exc: Exception) -> None:
        """An exception costs only its image (EncodeDone not ok)."""
        log.error("handling %s failed", type(msg).__name__, exc_info=exc)
        if isinstance(msg, m.EncodeImage):  # not queued: answered here
            self._reply(msg, False, reason=describe(exc, "queueing the image"))

    def _on_malformed(self, msg: MalformedFrame) -> None:
        if msg.kind == "EncodeImage" and msg.image_index >= 0:  # the router waits for its answer
            self._send(m.EncodeDone(msg.request_id, msg.image_index, False, reason=msg.reason))

    def _on_abort(self, msg: m.Abort) -> None:
        kept = deque()
        for job in self.queue:
            if job.request_id == msg.request_id:
                self._reply(job, False, reason="aborted")
            else:
                kept.append(job)
        self.queue = kept

    def _on_slab_up(self, msg: m.SlabUp) -> None:
        self._unmap(msg.worker_id)
        try:
            slab = msg.slab
            # The consumer's shared slab when it runs on this node, else its TCP listener.
            if pick_transport(slab.transport, slab.shm_name, slab.port, slab.node) == "tcp":
                self.slabs[msg.worker_id] = TcpSlabSender(
                    slab.host, slab.port, slab.num_rows, slab.hidden_size, getattr(torch, slab.dtype), self.key
                )
            else:
                self.slabs[msg.worker_id] = EmbeddingSlab.attach(slab)
        except (OSError, ValueError) as e:  # its jobs then fail one by one
            log.warning("cannot map the slab of %s: %s", msg.worker_id, e)

    def _unmap(self, worker_id: str) -> None:
        old = self.slabs.pop(worker_id, None)
        if old is not None:
            old.close()

    def _forget_all_but(self, keep: set[str]) -> None:
        self.queue = deque(job for job in self.queue if job.request_id in keep)

    # -- the loop ------------------------------------------------------------------------
    def _poll_timeout_ms(self) -> int:
        return 0 if self.queue else 100

    def _step(self) -> None:
        if self.queue:
            self.progress.begin()
            self._encode_batch()

    def _encode_batch(self) -> None:
        batch = [self.queue.popleft() for _ in range(min(self.opts.max_batch_images, len(self.queue)))]
        self._num_busy = len(batch)
        try:
            trace = self._step_trace
            with trace.batch(len(batch)) if trace else contextlib.nullcontext({}) as traced:
                results = self.runner.run([EncodeJob(job.content_hash, job.data) for job in batch])
                traced["num_tiles"] = sum(r.num_tiles for r in results)
        except Exception as e:  # past the runner's own per-image isolation: the batch fails
            if is_fatal(e):
                raise
            log.exception("encoding a batch of %d images failed", len(batch))
            for job in batch:
                self._reply(job, False, reason=describe(e, "encoding the image"))
            self._num_busy = 0
            return
        for job, result in zip(batch, results):
            try:
                self._deliver(job, result)
            except Exception as e:
                if is_fatal(e):
                    raise
                log.exception("delivering image %d of %s failed", job.image_index, job.request_id)
                self._reply(job, False, result=result, reason=describe(e, "writing the embedding"))
        self._num_busy = 0

    def _deliver(self, job: m.EncodeImage, result: EncodeResult) -> None:
        """Write one embedding into its consumer's slab and answer its job (exactly once)."""
        if result.rows is None:
            self._reply(job, False, result=result, reason=result.error)
            return
        slab = self.slabs.get(job.target)
        if slab is None:
            self._reply(job, False, result=result, reason=f"the slab of {job.target} is not mapped")
            return
        if result.rows.shape != (job.num_rows, slab.hidden_size):
            self._reply(job, False, result=result, reason=(
                f"embedding of shape {tuple(result.rows.shape)} does not fit {job.num_rows} rows "
                f"of {slab.hidden_size}"))
            return
        write_start = time.perf_counter()
        try:
            if isinstance(slab, TcpSlabSender):
                num_bytes = slab.send(job.request_id, job.image_index, job.slab_offset, result.rows)
            else:
                slab.region(job.slab_offset, job.num_rows).copy_(result.rows)
                num_bytes = result.rows.numel() * slab.rows.element_size()
        except (ValueError, OSError) as e:
            if isinstance(e, OSError):
                self.slabs.pop(job.target, None)
                slab.close()
            self._reply(job, False, result=result, reason=f"cannot write the embedding: {e}")
            return
        self._reply(job, True, result=result, write_s=time.perf_counter() - write_start, num_bytes=num_bytes,
                    via_tcp=isinstance(slab, TcpSlabSender))

    def _reply(self, job: m.EncodeImage, ok: bool, result: EncodeResult | None = None, write_s: float = 0.0,
               num_bytes: int = 0, reason: str = "", via_tcp: bool = False) -> None:
        self._send(m.EncodeDone(
            job.request_id, job.image_index, ok,
            is_cache_hit=bool(result and result.is_cache_hit),
            encode_start=result.start if result else 0.0, encode_end=result.end if result else 0.0,
            write_s=write_s, num_bytes=num_bytes, reason=reason, via_tcp=via_tcp,
        ))

    def _release(self) -> None:
        for slab in self.slabs.values():
            slab.close()
        self.slabs.clear()
        if self._step_trace is not None:
            self._step_trace.close()
            self._step_trace = None


def run_encode_worker(opts: EncodeWorkerOptions) -> int:
    return run_process(lambda: EncodeWorker(opts), opts.die_with_parent)
