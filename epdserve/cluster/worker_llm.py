"""A worker that runs the language model: one engine driven by the router.

``LLMWorker`` takes requests (``Submit``), their images (worker_images.py) and aborts, runs
one engine step per pass of the loop and reports the outputs; ``ColocatedWorker`` is that and
nothing more. The P/D roles add the KV transfer: worker_prefill.py pushes a prompt's KV to a
decode worker, worker_decode.py reserves the pages and starts decoding once the KV landed.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field

import torch

from epdserve.cluster import messages as m
from epdserve.cluster.router_link import MalformedFrame
from epdserve.cluster.step_trace import StepTrace
from epdserve.cluster.worker_base import Handler, WorkerBase
from epdserve.cluster.worker_images import ConsumerImages, ImageOptions
from epdserve.config import EngineArgs
from epdserve.engine.engine import KVCacheAllocator, LLMEngine, RequestOutput
from epdserve.engine.failures import describe, is_fatal
from epdserve.models.loader import LoadedModel
from epdserve.errors import EpdserveError, InvalidRequestError
from epdserve.request import MMInput, TierLoad
from epdserve.roles import LLM_ROLES, Role
from epdserve.transfer.locality import TRANSPORTS

ROLES = tuple(str(role) for role in LLM_ROLES)
log = logging.getLogger("epdserve.worker")


@dataclass(frozen=True)
class WorkerOptions:
    role: str
    router: str  # tcp://host:port of the router's worker socket
    worker_id: str = field(default_factory=lambda: f"w-{uuid.uuid4().hex[:8]}")
    cores: tuple[int, ...] = ()  # CPU cores to pin to; () = leave as is
    # Decode: how prefill workers reach its pages: its pool in shared memory for those on its
    # node and a TCP listener for the others ("auto"), or only one of them.
    kv_transport: str = "auto"
    kv_host: str = "127.0.0.1"  # the address its KV (decode) or slab (consumer) listener binds and offers
    cluster_key: bytes = field(default=b"", repr=False)  # the cluster secret (epdserve/auth.py)
    layerwise: bool = True  # prefill: push KV layer by layer (False: bulk after prefill)
    heartbeat_s: float = 0.2
    reservation_lease_s: float = 120.0  # decode: a reservation whose KV never lands expires
    die_with_parent: bool = False
    stall_kv_transfers: bool = False  # fault injection (tests): prefill never finishes a transfer
    # Images: the vision tower (None: text only). A consumer (colocated / prefill) with a slab
    # takes embeddings from encode workers; without one it encodes images itself.
    vision: str | None = None
    embed_slab_mb: float = 0.0
    embed_transport: str = "auto"  # how encode workers reach the slab (as kv_transport)
    max_batch_images: int = 1  # in-process encoder: images per forward pass
    encoder_cache_mb: float = 256.0
    step_trace_dir: str | None = None  # write every model step to DIR/<worker id>.jsonl (step_trace.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise EpdserveError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transport not in TRANSPORTS:
            raise EpdserveError(f"kv transport must be one of {', '.join(TRANSPORTS)}, got {self.kv_transport!r}")
        if self.embed_transport not in TRANSPORTS:
            raise EpdserveError(f"embedding transport must be one of {', '.join(TRANSPORTS)}, "
                                f"got {self.embed_transport!r}")


class LLMWorker(WorkerBase):
    """An engine in one of the LLM roles; the role subclasses add their KV transfer."""

    takes_images = True  # a consumer of image embeddings (with --vision)
    outputs_end_at_first_token = False  # prefill: a request's last output here carries its first token
    shares_kv_pages = False  # P/D: at tensor parallelism every rank's pages are shared with rank 0
    endpoint: m.KVEndpoint | None = None  # decode: where prefill workers write its KV pages

    def __init__(self, opts: WorkerOptions, engine_args: EngineArgs, loaded: LoadedModel | None = None,
                 num_switches: int = 0) -> None:
        """``loaded``: the model, when this process ran it in another role before (a switch);
        ``num_switches``: how many switches of role this process made before this one."""
        super().__init__(opts.router, opts.worker_id, opts.cluster_key, opts.cores, opts.heartbeat_s)
        self.opts = opts
        self.engine_args = engine_args
        self.num_switches = num_switches
        self.engine = LLMEngine(engine_args, loaded, kv_cache_allocator=self._kv_cache_allocator(),
                                share_rank_pages=self.shares_kv_pages,
                                state_cache_allocator=self._state_cache_allocator())
        self.engine.record_kv_events()  # the router's prefix index follows this pool
        self._step_trace = (StepTrace(opts.step_trace_dir, opts.worker_id, opts.role, torch.get_num_threads(),
                                      num_switches)
                            if opts.step_trace_dir else None)
        # Receiver threads (KV or image landings) wake the engine loop through this fd.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK)
        self.images: ConsumerImages | None = None
        if opts.vision is not None and self.takes_images:
            image_opts = ImageOptions(opts.vision, opts.embed_slab_mb, opts.embed_transport, opts.kv_host,
                                      opts.max_batch_images, opts.encoder_cache_mb, opts.cluster_key)
            self.images = ConsumerImages(image_opts, self.engine, engine_args.model, engine_args.seed, self._wake)

    def _state_cache_allocator(self) -> KVCacheAllocator | None:
        """Where a recurrent model's state tensors go (None: the engine allocates them)."""

    def _kv_cache_allocator(self) -> KVCacheAllocator | None:
        """Where the engine's KV pages go (None: the engine allocates them)."""
        return None

    def _wake(self) -> None:
        os.eventfd_write(self._wake_fd, 1)

    # -- the router's view ---------------------------------------------------------------
    def register(self) -> m.Register:
        cfg = self.engine.config
        return self._register(
            model_name=self.engine.loaded.spec.name, max_model_len=cfg.scheduler.max_model_len,
            num_kv_blocks=cfg.cache.num_blocks, block_size=cfg.cache.block_size, kv_endpoint=self.endpoint,
            slab=self.images.endpoint if self.images else None,
            can_encode=self.images is not None and self.images.can_encode,
            kv_bytes_per_block=self.engine.bytes_per_block, kv_tiers=self._tier_costs(),
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        )

    def _tier_costs(self) -> list[m.TierCost]:
        offload = self.engine.kv_offload
        if offload is None:
            return []
        return [m.TierCost(tier, bytes_per_s, latency_s) for tier, (bytes_per_s, latency_s) in offload.tier_costs.items()]

    def load(self) -> m.Load:
        load = self.engine.load()
        return m.Load(
            num_running=load.num_running, num_waiting=load.num_waiting, num_free_blocks=load.num_free_blocks,
            num_used_blocks=load.num_used_blocks, num_reserved=load.num_reserved,
            num_transferring=load.num_transferring, prefill_s_per_token=self.engine.prefill_rate.per_token_s,
            num_used_state_slots=load.num_used_state_slots,
            **self._transfer_load(),
        )

    def _transfer_load(self) -> dict:
        """The KV transfer fields of the load report (P/D roles)."""
        return {}

    # -- messages ------------------------------------------------------------------------
    def _handlers(self) -> dict[type, Handler]:
        return {
            **super()._handlers(),
            MalformedFrame: self._on_malformed,
            m.Submit: self._on_submit,
            m.EmbeddingReady: lambda msg: self.engine.mark_image_ready(msg.request_id, msg.image_index),
            m.Abort: lambda msg: self._drop(msg.request_id),
        }

    def _on_malformed(self, msg: MalformedFrame) -> None:
        self._fail_request(msg.request_id, msg.reason)

    def _on_submit(self, msg: m.Submit) -> None:
        mm_inputs = None
        if msg.images:
            if self.images is None:
                raise InvalidRequestError("this worker does not take images (start it with --vision)")
            mm_inputs = self.images.mm_inputs(msg)
        self._add_request(msg, mm_inputs)
        if mm_inputs is not None:
            self.images.queue_inline(msg)

    def _add_request(self, msg: m.Submit, mm_inputs: list[MMInput] | None) -> None:
        if msg.kv_target:
            raise InvalidRequestError(f"a {self.role} worker does not push KV to other workers")
        self.engine.add_request(msg.prompt_token_ids, msg.sampling, msg.request_id, mm_inputs, msg.mm_pipelined)

    def _fail_message(self, msg: m.Message | MalformedFrame, exc: Exception) -> None:
        """Handling ``msg`` raised: only its request fails (a message without one is logged)."""
        request_id = getattr(msg, "request_id", "")
        if not request_id:
            super()._fail_message(msg, exc)
            return
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
        """Tell the router the request failed here (its engine state is already gone)."""
        self._send(m.RequestFailed(request_id, message))

    def _drop(self, request_id: str) -> None:
        """Stop a request the router gave up (abort, failure) and free what it holds here."""
        if self.images is None:
            self.engine.abort(request_id)
        elif self.images.abort(request_id):  # TCP slab: the router frees the rows then
            self._send(m.EmbeddingLanded(request_id, None))

    def _held_request_ids(self) -> set[str]:
        """Requests held outside the engine (P/D roles)."""
        return set()

    def _can_switch_to(self, role: Role) -> bool:
        return role in LLM_ROLES

    def _holds_nothing(self) -> bool:
        images_busy = self.images is not None and self.images.has_inline_jobs
        return not (self.engine.has_unfinished() or self._held_request_ids() or self.engine.is_transferring()
                    or images_busy)

    def _forget_all_but(self, keep: set[str]) -> None:
        held = set(self.engine.live_request_ids()) | self._held_request_ids()
        for request_id in held - keep:
            self._drop(request_id)
        log.info("reconciled with the router: dropped %d requests; registering again", len(held - keep))

    # -- the loop ------------------------------------------------------------------------
    def _poll_timeout_ms(self) -> int:
        # Idle (or only waiting for KV to land or leave): sleep until a message or a landing
        # wakes the loop. A step that scheduled nothing waits for images: sleep until one arrives.
        encoding = self.images is not None and self.images.has_inline_jobs
        busy = (self.engine.has_unfinished() and self.engine.last_num_scheduled > 0) or encoding
        return 0 if busy else self._idle_timeout_ms()

    def _idle_timeout_ms(self) -> int:
        return 100

    def _wake_fds(self) -> list[int]:
        return [self._wake_fd]

    def _on_wake(self, ready: dict) -> None:
        if self._wake_fd in ready:
            os.eventfd_read(self._wake_fd)
            if self.images is not None:
                for request_id, image_index in self.images.take_landed():
                    self._send(m.EmbeddingLanded(request_id, image_index))

    def _step(self) -> None:
        self.progress.begin()
        self._before_step()
        if self.images is not None and self.images.has_inline_jobs:
            for request_id, error in self.images.encode_inline():
                self._fail_request(request_id, error)
        if self.engine.has_unfinished():
            if self._step_trace is None:
                self._send_outputs(self.engine.step())
            else:
                with self._step_trace.step(self.engine):
                    self._send_outputs(self.engine.step())
        self._after_step()
        self.engine.poll_kv_store()
        events = self._kv_events()  # cached or evicted outside a step (a reservation, say)
        if events:
            self._send(m.KVEvents(self.worker_id, events))

    def _before_step(self) -> None:
        """Before the engine step (decode: start the requests whose KV landed)."""

    def _after_step(self) -> None:
        """After the engine step (P/D roles: transfers and reservations that ended)."""

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
                kv_load=_kv_load(o.tier_load) if o.tier_load is not None else None,
                **(self.images.timing(o, o.finished or self.outputs_end_at_first_token) if self.images else {}),
            )
            for o in outputs if o.error is None
        ]
        events = self._kv_events()
        if items:
            self._send(m.Outputs(self.worker_id, items, events))
        elif events:
            self._send(m.KVEvents(self.worker_id, events))
        for o in outputs:
            if o.error is not None:
                self._fail_request(o.request_id, o.error)

    def _kv_events(self) -> list[m.KVEvent]:
        """What the pool cached and evicted since the last report, in order; at most
        ``MAX_EVENT_BLOCKS`` hashes an event."""
        events = []
        for kind, tier, hashes in self.engine.take_kv_events():
            for i in range(0, len(hashes), m.MAX_EVENT_BLOCKS):
                events.append(m.KVEvent(kind, tier, hashes[i : i + m.MAX_EVENT_BLOCKS]))
        return events

    def _release(self) -> None:
        self.engine.close()
        if self.images is not None:
            self.images.close()
        if self._step_trace is not None:
            self._step_trace.close()
        os.close(self._wake_fd)


def _kv_load(load: TierLoad) -> m.KVLoad:
    return m.KVLoad(load.num_found_tokens, load.num_chosen_tokens, load.num_host_tokens, load.num_disk_tokens, load.predicted_load_s,
                    load.predicted_compute_s, load.read_s, load.num_peer_tokens, load.predicted_peer_s)


class ColocatedWorker(LLMWorker):
    """Prefill and decode of each request in this one engine."""

    role = Role.COLOCATED

