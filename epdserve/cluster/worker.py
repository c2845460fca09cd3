"""A worker process: one engine in a role (colocated, prefill or decode), driven by the router.

    epdserve worker --role prefill|decode|colocated --router tcp://HOST:PORT [engine options]

The worker registers with the router (role, pid, KV endpoint), sends heartbeats from a thread
of its own, and runs the engine loop: take control messages, run one step, report outputs and
finished KV transfers. A decode worker's KV pages live in shared memory (``shm``) or behind a
TCP listener (``tcp``) so prefill workers can write them; a prefill worker keeps one link per
decode worker, opened when the router announces the peer.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

import msgspec
import torch
import zmq

from epdserve.cluster import messages as m
from epdserve.cluster.router_link import (
    MalformedFrame,
    StepProgress,
    connect_to_router,
    recv_message,
    start_heartbeats,
)
from epdserve.cluster.step_trace import StepTrace
from epdserve.cluster.worker_images import ConsumerImages, ImageOptions
from epdserve.config import EngineArgs, resolve_device_name
from epdserve.engine.engine import LLMEngine, RequestOutput
from epdserve.engine.failures import EXIT_FATAL, describe, is_fatal
from epdserve.errors import EpdserveError, InvalidRequestError
from epdserve.gc_heap import freeze_startup_heap
from epdserve.transfer.connector import KVPusher
from epdserve.transfer.fence import ReservationFence
from epdserve.transfer.shm_pool import SharedKVPool
from epdserve.transfer.tcp import TcpKVReceiver

ROLES = ("colocated", "prefill", "decode")
log = logging.getLogger("epdserve.worker")


@dataclass(frozen=True)
class WorkerOptions:
    role: str
    router: str  # tcp://host:port of the router's worker socket
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    cores: tuple[int, ...] = ()  # CPU cores to pin to; () = leave as is
    kv_transport: str = "shm"  # decode: how prefill workers reach its pages
    kv_host: str = "127.0.0.1"  # decode + tcp: address its KV listener binds
    layerwise: bool = True  # prefill: push KV layer by layer (False: bulk after prefill)
    heartbeat_s: float = 0.2
    reservation_lease_s: float = 120.0  # decode: a reservation whose KV never lands expires
    die_with_parent: bool = False
    stall_kv_transfers: bool = False  # fault injection (tests): prefill never finishes a transfer
    # Images: the vision tower (None: text only). A consumer (colocated / prefill) with a slab
    # takes embeddings from encode workers; without one it encodes images itself.
    vision: str | None = None
    embed_slab_mb: float = 0.0
    embed_transport: str = "shm"  # how encode workers reach the slab: shm (same host) or tcp
    max_batch_images: int = 1  # in-process encoder: images per forward pass
    encoder_cache_mb: float = 256.0
    step_trace_dir: str | None = None  # write every model step to DIR/<worker id>.jsonl (step_trace.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EpdserveError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transport not in ("shm", "tcp"):
            raise EpdserveError(f"kv transport must be shm or tcp, got {self.kv_transport!r}")
        if self.embed_transport not in ("shm", "tcp"):
            raise EpdserveError(f"embedding transport must be shm or tcp, got {self.embed_transport!r}")


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent (the router) dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Worker:
    def __init__(self, opts: WorkerOptions, engine_args: EngineArgs) -> None:
        self.opts = opts
        if opts.cores:
            os.sched_setaffinity(0, opts.cores)
            torch.set_num_threads(len(opts.cores))
        self.pool: SharedKVPool | None = None
        self.receiver: TcpKVReceiver | None = None
        if opts.kv_transport == "shm" and resolve_device_name(engine_args.device) != "cpu":
            # Shared-memory pages are host memory; a decode worker's pages on an accelerator
            # are reached over tcp (the endpoint it registers says which).
            if opts.role == "decode":
                log.info("KV pages on %s: prefill workers write them over tcp", engine_args.device)
            opts = self.opts = replace(opts, kv_transport="tcp")
        allocator = self._shm_allocator if opts.role == "decode" and opts.kv_transport == "shm" else None
        self.engine = LLMEngine(engine_args, kv_cache_allocator=allocator)
        self._step_trace = (StepTrace(opts.step_trace_dir, opts.worker_id, opts.role, torch.get_num_threads())
                            if opts.step_trace_dir else None)
        self.endpoint: m.KVEndpoint | None = None
        self._landed: set[str] = set()
        self._landed_lock = threading.Lock()
        # Receiver threads wake the engine loop through this fd when a request's KV has landed.
        self._landed_fd = os.eventfd(0, os.EFD_NONBLOCK)
        self._pending_decode: dict[str, m.StartDecode] = {}
        self._prefill_ids: set[str] = set()  # P/D prefills whose TransferDone is still due
        # Decode: open reservations, request id -> (fence generation, monotonic time reserved).
        self._reservations: dict[str, tuple[int, float]] = {}
        self.fence: ReservationFence | None = None
        if opts.role == "decode":
            caches = self.engine.runner.kv_caches
            self.fence = ReservationFence(len(self.engine.kv_cache.groups), caches[0].shape[1],
                                          shm=self.pool is not None)
            self.endpoint = self._decode_endpoint()
        self.progress = StepProgress()
        self.images: ConsumerImages | None = None
        if opts.vision is not None and opts.role in ("colocated", "prefill"):
            image_opts = ImageOptions(opts.vision, opts.embed_slab_mb, opts.embed_transport, opts.kv_host,
                                      opts.max_batch_images, opts.encoder_cache_mb)
            self.images = ConsumerImages(image_opts, self.engine, engine_args.model, engine_args.seed,
                                         lambda: os.eventfd_write(self._landed_fd, 1))
        if opts.role == "prefill":
            runner = self.engine.runner
            runner.pusher = KVPusher(runner.kv_caches, runner.layer_to_group, runner.block_size, opts.layerwise)
            runner.pusher.stall = opts.stall_kv_transfers
        self.ctx = zmq.Context()
        self.sock = connect_to_router(self.ctx, opts.router, opts.worker_id)
        self._stop = threading.Event()

    # -- set-up --------------------------------------------------------------------------
    def _shm_allocator(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        num_blocks, block_size = shapes[0][1], shapes[0][2]
        self.pool = SharedKVPool.create(num_blocks, block_size, [s[3:] for s in shapes], dtype)
        return self.pool.layers

    def _decode_endpoint(self) -> m.KVEndpoint:
        assert self.fence is not None
        if self.pool is not None:
            return msgspec.structs.replace(self.pool.endpoint(), fence_shm_name=self.fence.shm_name,
                                           num_groups=self.fence.num_groups)
        runner = self.engine.runner
        self.receiver = TcpKVReceiver(runner.kv_caches, self._on_landed, self.fence, runner.layer_to_group,
                                      self.opts.kv_host)
        caches = runner.kv_caches
        return m.KVEndpoint(
            transport="tcp", host=self.receiver.host, port=self.receiver.port,
            num_blocks=caches[0].shape[1], block_size=caches[0].shape[2],
            dtype=str(caches[0].dtype).removeprefix("torch."),
            layer_shapes=[tuple(c.shape[3:]) for c in caches], num_groups=self.fence.num_groups,
        )

    def _send(self, msg: m.Msg) -> None:
        """To the router; a router that stopped reading costs this message, never the loop
        (the router's own deadlines settle what it was about)."""
        try:
            self.sock.send(m.encode(msg))
        except zmq.Again:
            log.warning("router is not reading: dropped %s", type(msg).__name__)

    def _on_landed(self, request_id: str) -> None:
        with self._landed_lock:
            self._landed.add(request_id)
        os.eventfd_write(self._landed_fd, 1)

    def register(self) -> m.Register:
        cfg = self.engine.config
        return m.Register(
            worker_id=self.opts.worker_id, role=self.opts.role, pid=os.getpid(), host=socket.gethostname(),
            model_name=self.engine.loaded.spec.name, max_model_len=cfg.scheduler.max_model_len,
            num_kv_blocks=cfg.cache.num_blocks, block_size=cfg.cache.block_size, kv_endpoint=self.endpoint,
            slab=self.images.endpoint if self.images else None,
            can_encode=self.images is not None and self.images.can_encode,
        )

    def load(self) -> m.Load:
        sched = self.engine.scheduler
        pusher = self.engine.runner.pusher
        return m.Load(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_free_blocks=self.engine.kv_cache.num_free_blocks(),
            num_used_blocks=self.engine.kv_cache.num_used_blocks(),
            num_reserved=len(sched.reserved), num_transferring=len(sched.transferring),
            kv_bytes_sent=pusher.num_bytes_sent if pusher else 0,
            kv_seconds_sent=pusher.seconds_sending if pusher else 0.0,
            num_kv_writes_refused=(pusher.num_refused_writes if pusher else 0)
            + (self.receiver.num_refused_frames if self.receiver else 0),
        )

    # -- loops ---------------------------------------------------------------------------
    def run(self) -> int:
        freeze_startup_heap()  # the model, tokenizer and libraries: never garbage (epdserve/gc_heap.py)
        self._send(self.register())
        start_heartbeats(self.ctx, self.opts.router, self.opts.worker_id, self.load, self.opts.heartbeat_s,
                         self._stop, self.progress)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._landed_fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Idle (or only waiting for KV to land or leave): sleep until a message or a
                # landing wakes the loop; the timeout bounds how stale transfer polls get.
                # A step that scheduled nothing waits for images: sleep until one arrives.
                encoding = self.images is not None and self.images.has_inline_jobs
                busy = (self.engine.has_unfinished() and self.engine.last_num_scheduled > 0) or encoding
                timeout_ms = 0 if busy else (5 if self.engine.scheduler.transferring else 100)
                self.progress.end()
                while True:
                    ready = dict(poller.poll(timeout_ms))
                    if self._landed_fd in ready:
                        os.eventfd_read(self._landed_fd)
                        self._report_landed_images()
                    if self.sock not in ready:
                        break
                    self.progress.begin()
                    msg = recv_message(self.sock)
                    if msg is not None:
                        self._handle(msg)
                    timeout_ms = 0
                    if self._stop.is_set():
                        return 0
                self.progress.begin()
                self._start_landed()
                if self.images is not None and self.images.has_inline_jobs:
                    for request_id, error in self.images.encode_inline():
                        self._fail_request(request_id, error)
                if self.engine.has_unfinished():
                    if self._step_trace is None:
                        self._send_outputs(self.engine.step())
                    else:
                        with self._step_trace.step(self.engine):
                            self._send_outputs(self.engine.step())
                self._report_transfers()
                self._expire_reservations()
        except Exception as e:
            if not is_fatal(e):
                raise
            # The process's memory or device can no longer be trusted: stop (the launcher
            # restarts the worker; the router fails its requests when the process exits).
            log.critical("fatal error, the worker exits with status %d", EXIT_FATAL, exc_info=True)
            return EXIT_FATAL
        finally:
            self.close()
        return 0

    def _handle(self, msg: m.Message | MalformedFrame) -> None:
        engine = self.engine
        try:
            if isinstance(msg, MalformedFrame):
                if msg.kind == "Submit" and msg.kv_target:
                    self._prefill_ids.add(msg.request_id)  # its TransferDone is due
                self._fail_request(msg.request_id, msg.reason)
            elif isinstance(msg, m.Submit):
                params = msg.sampling
                mm_inputs = None
                if msg.images:
                    if self.images is None:
                        raise InvalidRequestError("this worker does not take images (start it with --vision)")
                    mm_inputs = self.images.mm_inputs(msg)
                if msg.kv_target:
                    engine.add_prefill_request(
                        msg.request_id, msg.prompt_token_ids, params, msg.kv_target, msg.kv_target_block_ids,
                        mm_inputs, msg.mm_pipelined, msg.kv_target_generation,
                    )
                    self._prefill_ids.add(msg.request_id)
                else:
                    engine.add_request(msg.prompt_token_ids, params, msg.request_id, mm_inputs, msg.mm_pipelined)
                if mm_inputs is not None:
                    self.images.queue_inline(msg)
            elif isinstance(msg, m.EmbeddingReady):
                engine.mark_image_ready(msg.request_id, msg.image_index)
            elif isinstance(msg, m.Reserve):
                block_ids = engine.reserve(msg.request_id, msg.num_prompt_tokens)
                if block_ids is None:
                    self._send(m.Reserved(msg.request_id, False, reason="no free KV blocks"))
                else:
                    tables = [list(b) for b in block_ids]
                    generation = self.fence.open(tables)
                    self._reservations[msg.request_id] = (generation, time.monotonic())
                    self._send(m.Reserved(msg.request_id, True, tables, generation))
            elif isinstance(msg, m.StartDecode):
                self._pending_decode[msg.request_id] = msg
            elif isinstance(msg, m.Abort):
                self._drop(msg.request_id)
            elif isinstance(msg, m.Reconcile):
                self._reconcile(set(msg.request_ids))
            elif isinstance(msg, m.PeerUp) and engine.runner.pusher is not None:
                try:
                    engine.runner.pusher.add_peer(msg.worker_id, msg.endpoint)
                except (OSError, ValueError) as e:
                    # Transfers to this peer then fail one by one; the worker keeps serving.
                    log.warning("cannot reach decode worker %s: %s", msg.worker_id, e)
            elif isinstance(msg, m.PeerDown) and engine.runner.pusher is not None:
                engine.runner.pusher.remove_peer(msg.worker_id)
            elif isinstance(msg, m.Shutdown):
                self._stop.set()
        except Exception as e:
            if is_fatal(e):
                raise
            self._fail_message(msg, e)

    def _fail_message(self, msg: m.Message, exc: Exception) -> None:
        """Handling ``msg`` raised: only its request fails (a message without one is logged)."""
        request_id = getattr(msg, "request_id", "")
        if not request_id:
            log.error("handling %s failed", type(msg).__name__, exc_info=exc)
            return
        if isinstance(msg, m.Submit) and msg.kv_target:
            self._prefill_ids.add(request_id)  # its TransferDone is due, however far it got
        if isinstance(exc, EpdserveError):
            message = str(exc)  # refused before it changed anything here
        else:
            log.error("handling %s of %s failed", type(msg).__name__, request_id, exc_info=exc)
            message = describe(exc, f"handling {type(msg).__name__}")
            try:
                self._drop(request_id)
            except Exception as cleanup_error:
                if is_fatal(cleanup_error):
                    raise
                log.exception("cleaning up %s failed", request_id)
        self._fail_request(request_id, message)

    def _fail_request(self, request_id: str, message: str) -> None:
        """Tell the router the request failed here (its engine state is already gone); a P/D
        prefill whose TransferDone is still due sends it now, once: nothing more is written
        into the decode worker's blocks for it."""
        self._send(m.RequestFailed(request_id, message))
        if request_id in self._prefill_ids:
            self._prefill_ids.discard(request_id)
            self._send(m.TransferDone(request_id, False, reason=message))

    def _drop(self, request_id: str) -> None:
        """Stop a request the router gave up (abort, failure) and free what it holds here."""
        self._pending_decode.pop(request_id, None)
        self._end_reservation(request_id)
        if self.images is None:
            self.engine.abort(request_id)
        elif self.images.abort(request_id):  # TCP slab: the router frees the rows then
            self._send(m.EmbeddingLanded(request_id, -1))
        if self.opts.role == "prefill":
            # Confirms, even for a request never seen, that from here on nothing is
            # written into the decode worker's blocks for it.
            self._prefill_ids.discard(request_id)
            self._send(m.TransferDone(request_id, False, reason="aborted"))

    def _reconcile(self, keep: set[str]) -> None:
        """The router had given this worker up (missed lease, hung step) and failed its
        requests: drop every request it no longer knows here, then register again."""
        held = (set(self.engine.live_request_ids()) | set(self._reservations) | set(self._pending_decode)
                | self._prefill_ids)
        for request_id in held - keep:
            self._drop(request_id)
        log.info("reconciled with the router: dropped %d requests; registering again", len(held - keep))
        self._send(self.register())

    def _end_reservation(self, request_id: str) -> None:
        """The reservation's KV may no longer be written (landed, aborted or expired); call
        before its blocks go back to the pool."""
        reservation = self._reservations.pop(request_id, None)
        if reservation is not None:
            self.fence.close(reservation[0])

    def _report_landed_images(self) -> None:
        if self.images is not None:
            for request_id, image_index in self.images.take_landed():
                self._send(m.EmbeddingLanded(request_id, image_index))

    def _start_landed(self) -> None:
        if not self._pending_decode:
            return
        for request_id, msg in list(self._pending_decode.items()):
            if self.opts.kv_transport == "tcp":
                with self._landed_lock:
                    if request_id not in self._landed:
                        continue
                    self._landed.discard(request_id)
            del self._pending_decode[request_id]
            self._end_reservation(request_id)
            if request_id not in self.engine.scheduler.reserved:
                continue  # aborted meanwhile
            self.engine.start_decode(request_id, msg.prompt_token_ids, msg.first_token_id, msg.sampling)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """Token outputs in one message, then each request that failed in the step."""
        items = [
            m.TokenOutput(
                request_id=o.request_id, index=o.index, token_ids=o.new_token_ids, text=o.new_text,
                finished=o.finished, finish_reason=o.finish_reason, num_prompt_tokens=o.num_prompt_tokens,
                num_cached_tokens=o.num_cached_tokens,
                logprobs=[m.TokenLogprob(lp.token_id, lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs))
                          for lp in o.new_logprobs],
                prefill_start=o.prefill_start, prefill_end=o.prefill_end,
                **(self.images.timing(o, o.finished or self.opts.role == "prefill") if self.images else {}),
            )
            for o in outputs if o.error is None
        ]
        if items:
            self._send(m.Outputs(self.opts.worker_id, items))
        for o in outputs:
            if o.error is not None:
                self._fail_request(o.request_id, o.error)

    def _report_transfers(self) -> None:
        for stats in self.engine.poll_transfers():
            self._prefill_ids.discard(stats.request_id)
            self._send(m.TransferDone(
                stats.request_id, stats.ok, stats.kv_bytes, stats.start, stats.end, stats.exposed_s,
                stats.blocking_s, "" if stats.ok else "KV transfer failed",
            ))

    def _expire_reservations(self) -> None:
        """A reservation whose KV did not land within the lease: its blocks go back to the pool
        (after the fence refuses its writes) and the router hears of it."""
        if not self._reservations:
            return
        deadline = time.monotonic() - self.opts.reservation_lease_s
        for request_id, (_, since) in list(self._reservations.items()):
            if since < deadline:
                self._pending_decode.pop(request_id, None)
                self._end_reservation(request_id)
                self.engine.scheduler.release_reservation(request_id)
                log.warning("reservation of %s expired after %g s", request_id, self.opts.reservation_lease_s)
                self._send(m.ReservationExpired(request_id))

    def close(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        self._stop.set()
        if self.engine.runner.pusher is not None:
            self.engine.runner.pusher.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.pool is not None:
            self.engine.runner.kv_caches = []
            self.pool.close()
            self.pool = None
        if self.fence is not None:
            self.fence.close_all()
        if self.images is not None:
            self.images.close()
        if self._step_trace is not None:
            self._step_trace.close()
        self.sock.close()
        self.ctx.term()
        os.close(self._landed_fd)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_worker(opts: WorkerOptions, engine_args: EngineArgs) -> int:
    if opts.die_with_parent:
        _die_with_parent()
    # SIGTERM and SIGINT end the loop; the shared-memory pool is unlinked on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    worker = Worker(opts, engine_args)
    try:
        return worker.run()
    except KeyboardInterrupt:
        return 0
