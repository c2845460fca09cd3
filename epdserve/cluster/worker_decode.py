"""A decode worker: reserves KV pages for prompts a prefill worker computes, then generates.

Its KV pages live in shared memory, which prefill workers on its node write directly, and
behind a TCP listener for prefill workers on other nodes (``auto``; ``shm`` or ``tcp`` offer
only one); the endpoint it registers says what it offers. ``Reserve`` takes blocks and opens a
reservation in the fence (transfer/fence.py), so only writes of that reservation land; when no
blocks or sequence seat are free it waits in a first-come-first-served queue for up to the
router's ``max_wait_s`` (blocks come free as requests finish), then is refused;
``StartDecode`` starts the request once its KV is in place (KV that came over TCP: once its
end marker landed). A reservation whose KV never lands expires after the lease; one that a
peer's frame broke (it named blocks outside it, or more tokens than it holds) fails at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

import msgspec
import torch

from epdserve.cluster import messages as m
from epdserve.cluster.worker_base import Handler
from epdserve.cluster.worker_llm import LLMWorker, WorkerOptions
from epdserve.config import EngineArgs, resolve_device_name
from epdserve.engine.block_pool import HASH_BYTES
from epdserve.engine.engine import KVCacheAllocator
from epdserve.engine.failures import describe, is_fatal
from epdserve.engine.reservation_queue import ReservationQueue
from epdserve.errors import InvalidRequestError
from epdserve.models.loader import LoadedModel
from epdserve.roles import Role
from epdserve.transfer.fence import ReservationFence
from epdserve.transfer.locality import this_node
from epdserve.transfer.shm_pool import SharedKVPool, SharedStatePool
from epdserve.transfer.tcp import TcpKVReceiver

log = logging.getLogger("epdserve.worker")


class DecodeWorker(LLMWorker):
    role = Role.DECODE
    takes_images = False  # the prefill worker took the prompt's images
    shares_kv_pages = True

    def __init__(self, opts: WorkerOptions, engine_args: EngineArgs, loaded: LoadedModel | None = None,
                 num_switches: int = 0) -> None:
        if opts.kv_transport != "tcp" and resolve_device_name(engine_args.device) != "cpu":
            # Shared-memory pages are host memory; pages on an accelerator are reached over tcp.
            log.info("KV pages on %s: prefill workers write them over tcp", engine_args.device)
            opts = replace(opts, kv_transport="tcp")
        self.pool: SharedKVPool | None = None
        self.state_pool: SharedStatePool | None = None  # a recurrent model's state slots
        self.receiver: TcpKVReceiver | None = None
        self._landed: set[str] = set()  # tcp: requests whose KV end marker arrived
        self._landed_lock = threading.Lock()
        self._refused: list[tuple[str, str]] = []  # (request id, why): frames the receiver refused
        self._pending_decode: dict[str, m.StartDecode] = {}
        self._handovers: set[str] = set()  # paused for a hand-over, until its TransferDone
        self._image_reservations: set[str] = set()  # reservations of prompts with images
        # Open reservations, request id -> (fence generation, monotonic time reserved).
        self._reservations: dict[str, tuple[int, float]] = {}
        self._waiting: ReservationQueue[m.Reserve] = ReservationQueue()  # no blocks or seat free yet
        super().__init__(opts, engine_args, loaded, num_switches)
        caches = self.engine.kv_caches
        # The fence guards blocks and, of a state group, slots (ids of either kind).
        num_ids = max(caches[0].shape[1], self.engine.kv_cache.num_state_slots)
        self.fence = ReservationFence(self.engine.num_kv_groups, num_ids, shm=self.pool is not None)
        self.endpoint = self._kv_endpoint()

    # -- set-up --------------------------------------------------------------------------
    def _kv_cache_allocator(self) -> KVCacheAllocator | None:
        return self._shm_allocator if self.opts.kv_transport in ("shm", "auto") else None

    def _state_cache_allocator(self) -> KVCacheAllocator | None:
        return self._shm_state_allocator if self.opts.kv_transport in ("shm", "auto") else None

    def _shm_state_allocator(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        num_slots = max(s[0] for s in shapes)
        self.state_pool = SharedStatePool.create(num_slots, [tuple(s[1:]) if s[0] else () for s in shapes], dtype)
        return self.state_pool.layers

    def _shm_allocator(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        num_blocks, block_size = shapes[0][1], shapes[0][2]
        self.pool = SharedKVPool.create(num_blocks, block_size, [s[3:] for s in shapes], dtype)
        return self.pool.layers

    def _kv_endpoint(self) -> m.KVEndpoint:
        caches = list(self.engine.kv_caches)
        if self.pool is not None:
            endpoint = msgspec.structs.replace(self.pool.endpoint(), fence_shm_name=self.fence.shm_name)
        else:
            endpoint = m.KVEndpoint(
                transport="tcp", num_blocks=caches[0].shape[1], block_size=caches[0].shape[2],
                dtype=str(caches[0].dtype).removeprefix("torch."), layer_shapes=[tuple(c.shape[3:]) for c in caches],
            )
        engine = self.engine
        endpoint = msgspec.structs.replace(endpoint, transport=self.opts.kv_transport, node=this_node(),
                                           num_groups=self.fence.num_groups, tp_size=engine.tp_size,
                                           total_kv_heads=engine.loaded.spec.num_kv_heads,
                                           rank_shm_names=[pool.name for pool in engine.rank_pools])
        states = engine.state_caches
        if states is not None:
            endpoint = msgspec.structs.replace(
                endpoint, num_state_slots=engine.kv_cache.num_state_slots,
                state_shapes=[list(s.shape[1:]) if s.numel() else [] for s in states],
                state_shm_name=self.state_pool.name if self.state_pool is not None else "")
        if self.opts.kv_transport == "shm":
            return endpoint
        self.receiver = TcpKVReceiver(caches, self._on_landed, self.fence, list(engine.kv_layer_to_group),
                                      self.key, self.opts.kv_host, self._on_refused, engine.rank_kv_caches,
                                      list(states) if states is not None else None)
        return msgspec.structs.replace(endpoint, host=self.receiver.host, port=self.receiver.port)

    def _on_landed(self, request_id: str) -> None:
        """Receiver thread: the request's KV has landed."""
        with self._landed_lock:
            self._landed.add(request_id)
        self._wake()

    def _on_refused(self, request_id: str, reason: str) -> None:
        """Receiver thread: a frame for ``request_id`` failed its checks (nothing was written)."""
        with self._landed_lock:
            self._refused.append((request_id, reason))
        self._wake()

    def _transfer_load(self) -> dict:
        return {"num_kv_writes_refused": self.receiver.num_refused_frames if self.receiver else 0}

    def load(self) -> m.Load:
        """Reservations waiting for room count as waiting requests (the router's queue bound)."""
        load = super().load()
        return msgspec.structs.replace(load, num_waiting=load.num_waiting + len(self._waiting))

    # -- messages ------------------------------------------------------------------------
    def _handlers(self) -> dict[type, Handler]:
        return {**super()._handlers(), m.Reserve: self._on_reserve, m.StartDecode: self._on_start_decode,
                m.Pause: self._on_pause, m.HandOver: self._on_hand_over, m.PeerUp: self._on_peer_up,
                m.PeerDown: self._on_peer_down}

    # -- handing requests over to another decode worker (a switch of role) ----------------
    def _on_peer_up(self, msg: m.PeerUp) -> None:
        """Another decode worker this one may hand requests over to (sent while it drains)."""
        try:
            self.engine.add_handover_peer(msg.worker_id, msg.endpoint, self.key)
        except (OSError, ValueError) as e:
            log.warning("cannot reach decode worker %s: %s", msg.worker_id, e)

    def _on_peer_down(self, msg: m.PeerDown) -> None:
        pusher = self.engine.handover_pusher
        if pusher is not None:
            for request_id in pusher.remove_peer(msg.worker_id):
                self._handovers.discard(request_id)
                self.engine.scheduler.release_transfer(request_id)
                self._send(m.TransferDone(request_id, False, reason="the target decode worker left"))

    def _on_pause(self, msg: m.Pause) -> None:
        tokens = self.engine.pause_for_handover(msg.request_id)
        if tokens is None:
            self._send(m.Paused(msg.request_id, False, reason="not running whole here, or constrained"))
            return
        self._handovers.add(msg.request_id)
        self._send(m.Paused(msg.request_id, True, tokens))

    def _on_hand_over(self, msg: m.HandOver) -> None:
        if msg.request_id not in self._handovers:
            self._send(m.TransferDone(msg.request_id, False, reason="not paused for a hand-over here"))
            return
        try:
            self.engine.push_handover(msg.request_id, msg.target, msg.target_block_ids, msg.target_generation,
                                      msg.target_num_cached)
        except Exception as e:  # the router recomputes it elsewhere
            if is_fatal(e):
                raise
            if not isinstance(e, InvalidRequestError):
                log.exception("handing %s over to %s failed", msg.request_id, msg.target)
            self._handovers.discard(msg.request_id)
            self.engine.scheduler.release_transfer(msg.request_id)
            self._send(m.TransferDone(msg.request_id, False, reason=describe(e, "handing the request over")))

    def _on_reserve(self, msg: m.Reserve) -> None:
        block_size = self.engine.kv_cache.block_size
        if (len(msg.block_hashes) > msg.num_prompt_tokens // block_size
                or any(len(h) != HASH_BYTES for h in msg.block_hashes)):
            self._send(m.Reserved(msg.request_id, False, reason=(
                f"block_hashes must be at most one {HASH_BYTES}-byte key per full block of the prompt")))
            return
        if (msg.request_id in self._waiting or self.engine.is_reserved(msg.request_id)
                or msg.request_id in self.engine.scheduler.requests):
            self._send(m.Reserved(msg.request_id, False, reason="the request holds a reservation here already"))
            return
        try:
            self.engine.check_fits_kv_cache(msg.num_prompt_tokens)  # else no wait would help
        except InvalidRequestError as e:
            self._send(m.Reserved(msg.request_id, False, reason=str(e)))
            return
        if not self._waiting.offer(msg.request_id, msg, msg.max_wait_s, time.monotonic(), self._try_reserve,
                                   msg.priority):
            self._send(m.Reserved(msg.request_id, False, reason=self._full_reason()))

    def _full_reason(self) -> str:
        return ("no free KV blocks" if self.engine.scheduler.can_reserve()
                else "every sequence seat (--max-num-seqs) is taken")

    def _grant_waiting(self) -> None:
        """Reserve for the waiting reservations in arrival order while there is room; refuse
        those whose wait ran out."""
        for request_id, msg in self._waiting.serve(time.monotonic(), self._try_reserve):
            self._send(m.Reserved(request_id, False, reason=(
                f"{self._full_reason()} for {msg.max_wait_s:g} s (--decode-queue-timeout)")))

    def _try_reserve(self, _: str, msg: m.Reserve) -> bool:
        """Take the blocks and answer ``Reserved``; False when there is no room now."""
        block_size = self.engine.kv_cache.block_size
        block_ids = self.engine.reserve(msg.request_id, msg.num_prompt_tokens, msg.block_hashes)
        if block_ids is None:
            return False
        num_cached = self.engine.num_reserved_cached(msg.request_id)
        tables = [list(b) for b in block_ids]
        # Only the blocks after the cached prefix are written; the cached ones may be shared
        # with other requests and stay outside the fence.
        skip = num_cached // block_size
        generation = self.fence.open([t[skip:] for t in tables], msg.request_id)
        self._reservations[msg.request_id] = (generation, time.monotonic())
        if msg.has_images:
            self._image_reservations.add(msg.request_id)
        self._send(m.Reserved(msg.request_id, True, tables, generation, num_cached_tokens=num_cached))
        return True

    def _on_start_decode(self, msg: m.StartDecode) -> None:
        self._pending_decode[msg.request_id] = msg

    def _drop(self, request_id: str) -> None:
        self._waiting.remove(request_id)
        self._pending_decode.pop(request_id, None)
        self._end_reservation(request_id)
        if request_id in self._handovers:
            self._handovers.discard(request_id)
            pusher = self.engine.handover_pusher
            if pusher is not None:
                pusher.abort(request_id)
        super()._drop(request_id)

    def _held_request_ids(self) -> set[str]:
        return (super()._held_request_ids() | set(self._reservations) | set(self._pending_decode)
                | self._handovers | self._waiting.request_ids())

    def _end_reservation(self, request_id: str) -> None:
        """The reservation's KV may no longer be written (landed, aborted or expired); call
        before its blocks go back to the pool."""
        reservation = self._reservations.pop(request_id, None)
        self._image_reservations.discard(request_id)
        if reservation is not None:
            self.fence.close(reservation[0])

    # -- the loop ------------------------------------------------------------------------
    def _before_step(self) -> None:
        """Start the requests whose KV is in place."""
        super()._before_step()
        if self._refused:
            with self._landed_lock:
                refused, self._refused = self._refused, []
            for request_id, reason in refused:
                if request_id in self._reservations:  # fails once; its blocks go back to the pool
                    self._drop(request_id)
                    self.engine.release_reservation(request_id)
                    self._fail_request(request_id, f"a KV frame was refused: {reason}")
        if not self._pending_decode:
            return
        for request_id, msg in list(self._pending_decode.items()):
            if msg.kv_via_tcp:
                with self._landed_lock:
                    if request_id not in self._landed:
                        continue
                    self._landed.discard(request_id)
            del self._pending_decode[request_id]
            has_images = request_id in self._image_reservations
            self._end_reservation(request_id)
            if not self.engine.is_reserved(request_id):
                continue  # aborted meanwhile
            self.engine.start_decode(request_id, msg.prompt_token_ids, msg.first_token_id, msg.sampling,
                                     cache_new_blocks=not has_images)

    def _after_step(self) -> None:
        """Hand-overs that ended; a reservation whose KV did not land within the lease: its
        blocks go back to the pool (after the fence refuses its writes) and the router hears
        of it; then waiting reservations take the room this step freed."""
        super()._after_step()
        if self._handovers:
            for stats in self.engine.poll_handovers():
                self._handovers.discard(stats.request_id)
                self._send(m.TransferDone(
                    stats.request_id, stats.ok, stats.kv_bytes, stats.kv_bytes_skipped, stats.start, stats.end,
                    stats.exposed_s, stats.blocking_s, "" if stats.ok else "KV hand-over failed", stats.transport,
                    self.engine.kv_bytes_by_group(stats)))
        if self._reservations:
            deadline = time.monotonic() - self.opts.reservation_lease_s
            for request_id, (_, since) in list(self._reservations.items()):
                if since < deadline:
                    self._pending_decode.pop(request_id, None)
                    self._end_reservation(request_id)
                    self.engine.release_reservation(request_id)
                    log.warning("reservation of %s expired after %g s", request_id, self.opts.reservation_lease_s)
                    self._send(m.ReservationExpired(request_id))
        if self._waiting:
            self._grant_waiting()

    def _idle_timeout_ms(self) -> int:
        return 5 if self._handovers else super()._idle_timeout_ms()  # poll the hand-overs

    def _release(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.pool is not None:
            self.engine.release_kv_pages()
            self.pool.close()
            self.pool = None
        if self.state_pool is not None:
            self.state_pool.close()
            self.state_pool = None
        self.fence.close_all()
        super()._release()
