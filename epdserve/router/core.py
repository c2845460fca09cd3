"""The router's request path: admission, routing, the P/D hand-off, streaming, failures.

A P/D request goes through these phases (one "path" per output sequence)::

    reserving ──Reserved──▶ prefilling ──first token──▶ transferring ──TransferDone──▶ decoding
    (decode worker           (prefill worker            (KV still landing;           (decode worker
     holds blocks)            computes, pushes KV)       first token already out)     streams the rest)

The first token is streamed the moment the prefill worker samples it. A decode worker's
reserved blocks are released only after the prefill worker has confirmed that it stopped
writing into them (TransferDone, ok or not), so no late write lands in reused pages.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import msgspec
import zmq
import zmq.asyncio

from epdserve.cluster import messages as m
from epdserve.errors import EpdserveError
from epdserve.gc_heap import GCPauseObserver
from epdserve.router.encode_stage import EncodeStage, PathImages
from epdserve.router.images import ImageInput
from epdserve.router.metrics import RouterMetrics
from epdserve.router.workers import DEFAULT_ROUTING, WorkerInfo, WorkerRegistry, WorkerState
from epdserve.sampling import SamplingParams

log = logging.getLogger("epdserve.router")


class Overloaded(EpdserveError):
    """Admission refused; the client should retry after ``retry_after`` seconds."""

    def __init__(self, message: str, status: int = 503, retry_after: int = 1) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class RouterConfig:
    # Liveness lease: a worker whose heartbeats stop this long is suspected, its requests fail.
    heartbeat_timeout_s: float = 1.0
    # Progress watchdog: a worker whose loop has been in one step this long (its heartbeats say)
    # is treated like a dead one; either way it serves again once it reconciles.
    step_timeout_s: float = 60.0
    first_token_timeout_s: float = 120.0  # admitted -> first token; then the request fails (0: none)
    reserve_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0  # first token out -> KV landed; then the policy applies
    transfer_policy: str = "fail"  # "fail" | "recompute" (decode worker computes the prompt)
    max_pending: int = 512  # requests in the router at once; beyond: 429
    max_waiting_per_worker: int = 256  # queued at one worker; beyond: 429
    encode_pipelined: bool = True  # prefill may start before all of a request's images are encoded
    routing: str = DEFAULT_ROUTING  # WorkerRegistry.pick's policy (checked there)

    def __post_init__(self) -> None:
        if self.transfer_policy not in ("fail", "recompute"):
            raise EpdserveError(f"transfer policy must be fail or recompute, got {self.transfer_policy!r}")
        if self.heartbeat_timeout_s <= 0 or self.step_timeout_s <= 0 or self.first_token_timeout_s < 0:
            raise EpdserveError("the worker lease and step timeout must be positive, the first-token timeout >= 0")


@dataclass
class StreamEvent:
    output: m.TokenOutput | None = None
    error: str | None = None


@dataclass
class RequestHandle:
    request_id: str
    n: int
    num_prompt_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    timing: m.Timing = field(default_factory=m.Timing)
    paths: list[Path] = field(default_factory=list)
    num_finished: int = 0  # finished sequences the consumer of ``events`` has seen
    num_finished_outputs: int = 0  # finished sequences the router has seen
    last_token_time: float = 0.0
    first_token_timer: asyncio.TimerHandle | None = None

    async def events(self) -> AsyncIterator[StreamEvent]:
        while self.num_finished < self.n:
            event: StreamEvent = await self.queue.get()
            if event.error is not None:
                yield event
                return
            if event.output is not None and event.output.finished:
                self.num_finished += 1
            yield event


@dataclass
class Path:
    """One sequence's way through the workers (the worker-side request id is ``path_id``)."""

    path_id: str
    handle: RequestHandle
    index: int | None  # P/D: the sequence index; colocated: the worker reports indices
    prompt_token_ids: list[int]
    params: SamplingParams
    mode: str  # "colocated" | "pd"
    phase: str = "new"
    colocated: str | None = None
    prefill: str | None = None
    decode: str | None = None
    reserved: asyncio.Future | None = None
    first_token_id: int | None = None
    continues: bool = False  # the prefill's first token is not the last one
    transfer_done: bool = False
    transfer_timer: asyncio.TimerHandle | None = None
    done: bool = False
    mm: PathImages | None = None  # images: slab space and encode jobs


class Router:
    def __init__(self, config: RouterConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config or RouterConfig()
        self.registry = WorkerRegistry(self.config.routing)
        self.metrics = RouterMetrics()
        self.gc_observer = GCPauseObserver(self.metrics.observe_gc_pause)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its id
        # A send to a worker that is not connected, or whose queue is full, fails at once (and
        # fails the request it was for) instead of being dropped unseen.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.paths: dict[str, Path] = {}
        self.handles: dict[str, RequestHandle] = {}
        self._tasks: list[asyncio.Task] = []
        self._registered = asyncio.Event()
        self._pidfds: dict[str, int] = {}
        self.encode = EncodeStage(self, self.config.encode_pipelined)
        self.metrics.pending.set_function(lambda: len(self.handles))
        self.metrics.paths.set_function(lambda: len(self.paths))

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name="router-recv"),
            asyncio.create_task(self._liveness_loop(), name="router-liveness"),
        ]

    async def close(self) -> None:
        for worker in self.registry.workers.values():
            if worker.is_ready:
                self._post(worker.worker_id, m.Shutdown())
        for task in self._tasks:
            task.cancel()
        for fd in self._pidfds.values():
            self._unwatch_fd(fd)
        self.sock.close()
        self.ctx.term()
        self.gc_observer.close()

    async def wait_for_workers(
        self, roles: dict[str, int], timeout_s: float, alive: Callable[[], bool] = lambda: True
    ) -> bool:
        """True once ``roles`` have registered; False at the deadline, or as soon as
        ``alive()`` says a worker process has exited (checked every half second)."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.registry.count_ready()
            if all(counts.get(r, 0) >= k for r, k in roles.items()):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not alive():
                return False
            self._registered.clear()
            try:
                await asyncio.wait_for(self._registered.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                continue

    def watch_process(self, worker_id: str, pid: int) -> None:
        """Local worker: learn of its exit at once (pidfd), not only by missed heartbeats."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        self._pidfds[worker_id] = fd
        asyncio.get_running_loop().add_reader(fd, self._on_process_exit, worker_id)

    def _on_process_exit(self, worker_id: str) -> None:
        fd = self._pidfds.pop(worker_id, None)
        if fd is not None:
            self._unwatch_fd(fd)
        self._mark_dead(worker_id, "worker process exited")

    @staticmethod
    def _unwatch_fd(fd: int) -> None:
        try:
            asyncio.get_running_loop().remove_reader(fd)
        except RuntimeError:
            pass
        os.close(fd)

    # -- admission -----------------------------------------------------------------------
    def mode(self) -> str | None:
        counts = self.registry.count_ready()
        if counts.get("prefill") and counts.get("decode"):
            return "pd"
        if counts.get("colocated"):
            return "colocated"
        return None

    async def open(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list[ImageInput] | None = None,
        arrived: float | None = None,
    ) -> RequestHandle:
        """Admit a request and start it; raises Overloaded (429/503) when it cannot run now."""
        if len(self.handles) >= self.config.max_pending:
            self.metrics.rejected.labels("queue_full").inc()
            raise Overloaded(f"server is at its limit of {self.config.max_pending} requests", 429)
        mode = self.mode()
        if mode is None:
            self.metrics.rejected.labels("no_workers").inc()
            raise Overloaded("no workers are available", 503, retry_after=5)
        images = images or []
        handle = RequestHandle(request_id, params.n, len(prompt_token_ids))
        handle.timing.arrived = arrived or time.time()  # seconds since the epoch
        handle.timing.num_images = len(images)
        self.handles[request_id] = handle
        try:
            if mode == "colocated":
                self._start_colocated(handle, prompt_token_ids, params, images)
            else:
                await self._start_pd(handle, prompt_token_ids, params, images)
        except BaseException as e:
            # Whatever stopped the start (a refusal, a send that failed, the client's task
            # cancelled while a reservation was pending): nothing of the request stays behind.
            for path in list(handle.paths):
                self._abort_path(path)
            self._drop_handle(handle)
            if isinstance(e, Overloaded | asyncio.CancelledError):
                raise
            log.exception("cannot start request %s", request_id)
            raise Overloaded(f"cannot start the request: {type(e).__name__}", 503) from None
        if self.config.first_token_timeout_s:
            handle.first_token_timer = asyncio.get_running_loop().call_later(
                self.config.first_token_timeout_s, self._on_first_token_timeout, handle)
        handle.timing.admitted = time.time()
        self.metrics.prompt_tokens.inc(len(prompt_token_ids) * params.n)
        self.metrics.images.inc(len(images))
        return handle

    def _check_queue(self, worker: WorkerInfo) -> None:
        if worker.load.num_waiting + worker.num_submitted >= self.config.max_waiting_per_worker:
            self.metrics.rejected.labels("worker_queue_full").inc()
            raise Overloaded(f"worker queues are full ({self.config.max_waiting_per_worker})", 429)

    def _start_colocated(
        self, handle: RequestHandle, prompt: list[int], params: SamplingParams, images: list[ImageInput]
    ) -> None:
        worker = self.registry.pick("colocated")
        assert worker is not None
        self._check_queue(worker)
        path = Path(handle.request_id, handle, None, prompt, params, "colocated", phase="running",
                    colocated=worker.worker_id)
        refs = self.encode.place(path, worker, images) if images else []
        self._add_path(path, worker, len(prompt))
        self._submit(worker.worker_id, m.Submit(path.path_id, prompt, params, images=refs,
                                                mm_pipelined=self.config.encode_pipelined))
        self.encode.dispatch(path)

    async def _start_pd(
        self, handle: RequestHandle, prompt: list[int], params: SamplingParams, images: list[ImageInput]
    ) -> None:
        paths = []
        for index, (path_id, seq_params) in enumerate(params.split(handle.request_id)):
            paths.append(Path(path_id, handle, index, prompt, seq_params, "pd"))
        try:
            for path in paths:
                await self._reserve(path)
        except Overloaded:
            for path in paths:
                self._abort_path(path)
            raise
        for path in paths:
            prefill = self.registry.pick("prefill")
            if prefill is None:
                for p in paths:
                    self._abort_path(p)
                raise Overloaded("no prefill workers are available", 503, retry_after=5)
            try:
                refs = self.encode.place(path, prefill, images) if images else []
            except Overloaded:
                for p in paths:
                    self._abort_path(p)
                raise
            path.prefill = prefill.worker_id
            path.phase = "prefilling"
            prefill.take(path.path_id, len(prompt))
            block_ids, generation = path.reserved.result() if path.reserved else ([], 0)
            self._submit(prefill.worker_id, m.Submit(
                path.path_id, prompt, path.params, kv_target=path.decode or "",
                kv_target_block_ids=block_ids, kv_target_generation=generation,
                images=refs, mm_pipelined=self.config.encode_pipelined,
            ))
            self.encode.dispatch(path)

    async def _reserve(self, path: Path) -> None:
        decode = self.registry.pick("decode")
        if decode is None:
            raise Overloaded("no decode workers are available", 503, retry_after=5)
        self._check_queue(decode)
        path.phase = "reserving"
        path.decode = decode.worker_id
        path.reserved = asyncio.get_running_loop().create_future()
        self._add_path(path, decode, 0)
        self._submit(decode.worker_id, m.Reserve(path.path_id, len(path.prompt_token_ids)))
        try:
            await asyncio.wait_for(asyncio.shield(path.reserved), self.config.reserve_timeout_s)
        except asyncio.TimeoutError:
            raise Overloaded("decode worker did not answer the reservation in time", 503) from None
        except _ReservationRefused as e:
            self.metrics.rejected.labels("no_kv_blocks").inc()
            raise Overloaded(f"decode KV cache is full: {e}", 503) from None

    def _add_path(self, path: Path, worker: WorkerInfo, num_prefill_tokens: int) -> None:
        self.paths[path.path_id] = path
        path.handle.paths.append(path)
        worker.take(path.path_id, num_prefill_tokens)

    # -- abort and clean-up --------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """The client went away (or gave up): stop the request on every worker."""
        handle = self.handles.get(request_id)
        if handle is None:
            return
        for path in list(handle.paths):
            self._abort_path(path)
        self._drop_handle(handle)
        self.metrics.requests.labels("aborted").inc()

    def _abort_path(self, path: Path) -> None:
        if path.reserved is not None and not path.reserved.done():
            path.reserved.set_exception(_ReservationRefused("request aborted"))
            path.reserved.exception()  # retrieved: no "never retrieved" warning
        if path.done:
            return
        path.done = True
        self.encode.abort(path)
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
        if path.mode == "colocated":
            self._post(path.colocated, m.Abort(path.path_id))
            self._release(path, path.colocated)
            return
        prefill_alive = path.prefill is not None and self._is_ready(path.prefill)
        if path.prefill is not None:
            self._post(path.prefill, m.Abort(path.path_id))
        if path.decode is not None and (path.transfer_done or not prefill_alive or path.phase == "reserving"):
            self._post(path.decode, m.Abort(path.path_id))
            self._release(path, path.decode)
            self._release(path, path.prefill)
        # Otherwise the decode worker's blocks are released when the prefill worker confirms
        # (TransferDone) that it no longer writes into them; the path stays indexed until then.

    def _finish_path(self, path: Path) -> None:
        path.done = True
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
        for worker_id in (path.colocated, path.prefill, path.decode):
            self._release(path, worker_id)

    def _release(self, path: Path, worker_id: str | None) -> None:
        if worker_id is None:
            return
        worker = self.registry.get(worker_id)
        if worker is not None:
            worker.drop(path.path_id)
        if path.mm is not None and worker_id == path.mm.consumer:
            self.encode.on_consumer_done(path)
        self.forget_if_idle(path)

    def forget_if_idle(self, path: Path) -> None:
        """Drop the path from the index once no worker, slab region or encode job holds it."""
        if not self.encode.is_holding(path) and all(
            path.path_id not in w.request_ids for w in self.registry.workers.values()
        ):
            self.paths.pop(path.path_id, None)

    def _drop_handle(self, handle: RequestHandle) -> None:
        self.handles.pop(handle.request_id, None)
        if handle.first_token_timer is not None:
            handle.first_token_timer.cancel()
            handle.first_token_timer = None

    def _fail(self, path: Path, message: str) -> None:
        self._fail_handle(path.handle, message)

    def _fail_handle(self, handle: RequestHandle, message: str, outcome: str = "failed") -> None:
        """End the request with an error to its client; every path of it is stopped."""
        if handle.request_id in self.handles:
            handle.queue.put_nowait(StreamEvent(error=message))
            self._drop_handle(handle)
            self.metrics.requests.labels(outcome).inc()
        for other in list(handle.paths):
            self._abort_path(other)

    def _on_first_token_timeout(self, handle: RequestHandle) -> None:
        handle.first_token_timer = None
        if handle.request_id in self.handles and handle.timing.first_token == 0.0:
            self._fail_handle(handle, f"no first token within {self.config.first_token_timeout_s:g} s "
                                      "(--first-token-timeout)", outcome="timeout")

    # -- worker messages -----------------------------------------------------------------
    def _post(self, worker_id: str | None, msg: m.Msg) -> bool:
        """Send without waiting; False when the message could not be sent (the worker is not
        connected, its queue is full, or the message cannot be encoded)."""
        if worker_id is None:
            return False
        try:
            # With NOBLOCK the asyncio socket tries the send at once and hands back a finished
            # future, holding the error when the send failed.
            sent = self.sock.send_multipart([worker_id.encode(), m.encode(msg)], zmq.NOBLOCK)
            error = sent.exception() if sent.done() else None
        except (zmq.ZMQError, msgspec.EncodeError, OverflowError, TypeError) as e:
            error = e
        if error is not None:
            log.warning("cannot send %s to %s: %s", type(msg).__name__, worker_id, error)
            return False
        return True

    def _submit(self, worker_id: str, msg: m.Msg) -> None:
        """Send what starts a request; a worker that cannot take it is a 503 for the request."""
        if not self._post(worker_id, msg):
            raise Overloaded(f"worker {worker_id} cannot be reached", 503, retry_after=1)

    def _is_ready(self, worker_id: str) -> bool:
        worker = self.registry.get(worker_id)
        return worker is not None and worker.is_ready

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:  # a worker sends one frame (the router socket adds its identity)
                log.warning("dropping a message of %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = m.decode(payload)
            except Exception as e:  # a malformed frame must not stop the router
                log.warning("dropping malformed message from %r: %s", identity, e)
                continue
            try:
                self._dispatch(identity.decode(), msg)
            except Exception:
                log.exception("error handling %s", type(msg).__name__)

    def _dispatch(self, sender: str, msg: m.Message) -> None:
        match msg:
            case m.Heartbeat():
                self._on_heartbeat(msg)
            case m.Register():
                self._on_register(msg)
            case m.Outputs():
                self._on_outputs(msg)
            case m.Reserved():
                self._on_reserved(msg)
            case m.TransferDone():
                self._on_transfer_done(msg)
            case m.ReservationExpired():
                self._on_reservation_expired(sender, msg)
            case m.EncodeDone():
                self.encode.on_encode_done(sender, msg)
            case m.EmbeddingLanded():
                self.encode.on_embedding_landed(msg)
            case m.RequestFailed():
                path = self.paths.get(msg.request_id)
                if path is not None:
                    self._fail(path, msg.message)

    def _on_register(self, msg: m.Register) -> None:
        old = self.registry.get(msg.worker_id)
        if old is not None and old.is_ready:
            self._mark_dead(msg.worker_id, "worker re-registered")
        elif old is not None and old.state is WorkerState.SUSPECT:
            log.info("worker %s is back and reconciled", msg.worker_id)
        info = WorkerInfo(msg.worker_id, msg.role, msg.pid, msg.host, msg.model_name, msg.max_model_len,
                          msg.num_kv_blocks, msg.block_size, msg.kv_endpoint, can_encode=msg.can_encode)
        self.registry.add(info)
        self.encode.on_register(msg)
        self.metrics.worker_up.labels(msg.worker_id, msg.role).set(1)
        if msg.role == "decode" and msg.kv_endpoint is not None:
            for prefill in self.registry.ready("prefill"):
                self._post(prefill.worker_id, m.PeerUp(msg.worker_id, msg.kv_endpoint))
        if msg.role == "prefill":
            for decode in self.registry.ready("decode"):
                if decode.endpoint is not None:
                    self._post(msg.worker_id, m.PeerUp(decode.worker_id, decode.endpoint))
        log.info("worker %s (%s, pid %d) registered", msg.worker_id, msg.role, msg.pid)
        self._registered.set()

    def _on_heartbeat(self, msg: m.Heartbeat) -> None:
        worker = self.registry.get(msg.worker_id)
        if worker is None or worker.state is WorkerState.DEAD:
            return
        now = time.monotonic()
        worker.last_seen = now
        is_hung = msg.step_age_s > self.config.step_timeout_s
        if worker.state is WorkerState.SUSPECT:
            # Its heartbeats are back: once its loop moves again, it drops what the router
            # failed meanwhile and registers again (then it is READY).
            if not is_hung and now - worker.last_reconcile >= self.config.heartbeat_timeout_s:
                worker.last_reconcile = now
                self._post(worker.worker_id, m.Reconcile([]))
            return
        if is_hung:
            self._suspect(worker.worker_id, f"its step has been running for {msg.step_age_s:.1f} s "
                                            f"(step timeout {self.config.step_timeout_s:g} s)")
            return
        worker.load = msg.load
        worker.num_submitted = 0
        load = msg.load
        self.metrics.observe_load(worker.worker_id, worker.role, load.num_running, load.num_waiting,
                                  load.num_used_blocks, load.num_free_blocks)

    def _on_reserved(self, msg: m.Reserved) -> None:
        path = self.paths.get(msg.request_id)
        if path is None or path.reserved is None or path.reserved.done():
            return
        if msg.ok:
            path.reserved.set_result((msg.block_ids, msg.generation))
        else:
            path.reserved.set_exception(_ReservationRefused(msg.reason))

    def _on_outputs(self, msg: m.Outputs) -> None:
        now = time.time()
        worker = self.registry.get(msg.worker_id)
        for out in msg.outputs:
            if worker is not None:
                worker.prefilled(out.request_id)
            path = self.paths.get(out.request_id)
            if path is None or path.done:
                continue
            handle = path.handle
            if path.mode == "pd":
                out = msgspec.structs.replace(out, index=path.index)
                if msg.worker_id == path.prefill and path.phase == "prefilling":
                    out = self._on_first_token(path, out)
                elif msg.worker_id != path.decode or path.phase != "decoding":
                    continue  # late output of a worker this path has left (e.g. after a recompute)
                elif out.finished:
                    self._finish_path(path)
            self._observe_token(handle, out, now)
            if out.finished:
                handle.num_finished_outputs += 1
                if handle.num_finished_outputs >= handle.n:
                    if path.mode == "colocated":
                        self._finish_path(path)
                    self._complete(handle, now)
            handle.queue.put_nowait(StreamEvent(output=out))

    def _on_first_token(self, path: Path, out: m.TokenOutput) -> m.TokenOutput:
        timing = path.handle.timing
        self._observe_inline_encode(timing, out)
        timing.prefill_start = timing.prefill_start or out.prefill_start
        timing.prefill_end = timing.prefill_end or out.prefill_end
        timing.num_cached_tokens = out.num_cached_tokens
        path.first_token_id = out.token_ids[0] if out.token_ids else None
        path.continues = out.finish_reason == "length" and path.params.max_tokens > 1
        if not path.continues:
            path.phase = "draining"  # the answer is complete; blocks go when the transfer ends
            if path.transfer_done:
                self._post(path.decode, m.Abort(path.path_id))
                self._finish_path(path)
            return out
        path.phase = "transferring"
        if path.transfer_done:
            self._start_decode(path)
        else:
            loop = asyncio.get_running_loop()
            path.transfer_timer = loop.call_later(self.config.transfer_timeout_s, self._on_transfer_timeout, path)
        return msgspec.structs.replace(out, finished=False, finish_reason=None)

    def _on_transfer_done(self, msg: m.TransferDone) -> None:
        path = self.paths.get(msg.request_id)
        if path is None:
            return
        path.transfer_done = True
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
            path.transfer_timer = None
        timing = path.handle.timing
        if msg.ok:
            timing.kv_transfer_start = timing.kv_transfer_start or msg.transfer_start
            timing.kv_transfer_end = max(timing.kv_transfer_end, msg.transfer_end)
            self.metrics.kv_bytes.inc(msg.kv_bytes)
            self.metrics.kv_seconds.inc(max(0.0, msg.transfer_end - msg.transfer_start))
            self.metrics.kv_exposed.inc(msg.exposed_s)
            timing.kv_exposed_s = max(timing.kv_exposed_s, msg.exposed_s)
            timing.kv_blocking_s = max(timing.kv_blocking_s, msg.blocking_s)
        if path.done or path.phase == "draining":
            self._post(path.decode, m.Abort(path.path_id))
            self._finish_path(path)
            return
        self._release(path, path.prefill)
        if path.phase != "transferring":
            return  # the first token has not reached the router yet
        if msg.ok:
            self._start_decode(path)
        else:
            self._transfer_failed(path, msg.reason or "KV transfer failed")

    def _start_decode(self, path: Path) -> None:
        path.phase = "decoding"
        path.handle.timing.decode_start = time.time()
        assert path.first_token_id is not None
        self._post(path.decode, m.StartDecode(path.path_id, path.prompt_token_ids, path.first_token_id,
                                              path.params))

    def _on_transfer_timeout(self, path: Path) -> None:
        path.transfer_timer = None
        if path.phase == "transferring" and not path.transfer_done:
            self._post(path.prefill, m.Abort(path.path_id))
            self._transfer_failed(path, f"KV transfer did not finish within {self.config.transfer_timeout_s:g} s")

    def _transfer_failed(self, path: Path, reason: str) -> None:
        decode = self.registry.get(path.decode) if path.decode else None
        # A prompt with images cannot be recomputed by a decode worker (it has no embeddings).
        if (self.config.transfer_policy == "recompute" and decode is not None and decode.is_ready
                and path.mm is None):
            # The decode worker computes the prompt itself and continues after the first token
            # (or from the prompt, when no first token came yet). Same id: the abort releases
            # the reservation before the new request arrives.
            path.phase = "decoding"
            params, prompt = path.params, path.prompt_token_ids
            if path.first_token_id is not None:
                params = replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(0, params.min_tokens - 1))
                prompt = prompt + [path.first_token_id]
            self._post(decode.worker_id, m.Abort(path.path_id))
            if self._post(decode.worker_id, m.Submit(path.path_id, prompt, params)):
                return
        self._fail(path, reason)

    def _observe_token(self, handle: RequestHandle, out: m.TokenOutput, now: float) -> None:
        if not out.token_ids:
            return
        if handle.timing.first_token == 0.0:
            self._observe_inline_encode(handle.timing, out)
            handle.timing.first_token = now
            if handle.first_token_timer is not None:
                handle.first_token_timer.cancel()
                handle.first_token_timer = None
            self.metrics.ttft.observe(now - handle.timing.arrived)
            if handle.timing.prefill_start or out.prefill_start:
                start = handle.timing.prefill_start or out.prefill_start
                self.metrics.queue_time.observe(max(0.0, start - handle.timing.arrived))
                handle.timing.prefill_start = start
                handle.timing.prefill_end = handle.timing.prefill_end or out.prefill_end
        elif handle.last_token_time:
            self.metrics.itl.observe(now - handle.last_token_time)
        handle.last_token_time = now
        self.metrics.generation_tokens.inc(len(out.token_ids))

    def _observe_inline_encode(self, timing: m.Timing, out: m.TokenOutput) -> None:
        """A consumer that encoded the images itself reports when."""
        if out.encode_start and not timing.encode_start:
            timing.encode_start, timing.encode_end = out.encode_start, out.encode_end
            timing.num_encoder_cache_hits = out.num_encoder_cache_hits

    def _complete(self, handle: RequestHandle, now: float) -> None:
        handle.timing.finished = now
        self.metrics.e2e.observe(now - handle.timing.arrived)
        self.metrics.requests.labels("ok").inc()
        self._drop_handle(handle)

    # -- liveness ------------------------------------------------------------------------
    async def _liveness_loop(self) -> None:
        period = self.config.heartbeat_timeout_s / 4
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.config.heartbeat_timeout_s
            for worker in list(self.registry.workers.values()):
                if worker.is_ready and worker.last_seen < deadline:
                    self._suspect(worker.worker_id, "worker missed its heartbeat lease "
                                                    f"({self.config.heartbeat_timeout_s:g} s)")

    def _suspect(self, worker_id: str, reason: str) -> None:
        """READY -> SUSPECT: the worker may still be alive (paused, hung); it gets no more
        requests, those in hand fail now, and it serves again after it reconciles."""
        self._give_up(worker_id, WorkerState.SUSPECT, reason)

    def _mark_dead(self, worker_id: str, reason: str) -> None:
        """The worker's process exited (or another registered under its id)."""
        self._give_up(worker_id, WorkerState.DEAD, reason)

    def _give_up(self, worker_id: str, state: WorkerState, reason: str) -> None:
        worker = self.registry.get(worker_id)
        if worker is None or worker.state is WorkerState.DEAD:
            return
        was_ready = worker.is_ready
        worker.state = state
        if not was_ready:  # SUSPECT -> DEAD: its requests failed already
            if state is WorkerState.DEAD:
                self.encode.on_worker_gone(worker)
            return
        worker.last_reconcile = 0.0
        self.metrics.worker_up.labels(worker_id, worker.role).set(0)
        log.warning("worker %s (%s) is %s: %s", worker_id, worker.role, state.value, reason)
        if worker.role == "decode":
            for prefill in self.registry.ready("prefill"):
                self._post(prefill.worker_id, m.PeerDown(worker_id))
        for path_id in list(worker.request_ids):
            path = self.paths.get(path_id)
            worker.drop(path_id)
            if path is None:
                continue
            if path.mode == "pd" and worker.role == "prefill":
                # It writes nothing more that could land: a dead process writes nothing, and a
                # paused or hung one that resumes finds the decode worker's fence closed
                # (transfer/fence.py). So the decode side need not wait for its TransferDone.
                path.transfer_done = True
                if path.done:
                    self._post(path.decode, m.Abort(path.path_id))
                    self._release(path, path.decode)
                    continue
            if path.done:
                continue
            if path.mode == "pd" and worker.role == "decode" and path.phase == "draining":
                path.done = True
                continue
            self._fail(path, f"{worker.role} worker {worker_id} failed while serving this request ({reason})")
        self.encode.on_worker_dead(worker)

    def _on_reservation_expired(self, sender: str, msg: m.ReservationExpired) -> None:
        """The decode worker gave the reservation's blocks back (its KV did not land in time);
        writes for it are refused from now on. The prefill side stops, and the request fails or
        the decode worker computes the prompt itself (``transfer_policy``)."""
        path = self.paths.get(msg.request_id)
        if path is None or path.done or path.mode != "pd" or sender != path.decode:
            return
        if path.phase == "prefilling":
            self._post(path.prefill, m.Abort(path.path_id))
            path.first_token_id = None
            self._transfer_failed(path, "the decode worker's KV reservation expired before the prompt's KV landed")
        elif path.phase == "transferring":
            self._post(path.prefill, m.Abort(path.path_id))
            self._transfer_failed(path, "the decode worker's KV reservation expired before the KV landed")


class _ReservationRefused(Exception):
    pass


SEND_HWM = 100_000  # messages queued for one worker at most; then sends to it fail
