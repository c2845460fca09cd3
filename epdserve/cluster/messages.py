"""Control messages between the router and workers: msgspec structs over ZMQ, never pickle.

Every message is a tagged struct; ``encode``/``decode`` turn it into msgpack bytes. Tensors
never travel here: KV and embeddings move through the transfer layer, and only descriptors
(request, group, block ids, token ranges) appear in these messages.

Times are seconds since the epoch (``time.time()``), comparable across processes on one host.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from epdserve.engine.block_pool import HASH_BYTES
from epdserve.request import EventType
from epdserve.roles import Role
from epdserve.sampling import SamplingParams
from epdserve.service import MAX_SCHEDULE_KEY, MIN_SCHEDULE_KEY
from epdserve.transfer.descriptors import KVEndpoint, SlabEndpoint


class Msg(msgspec.Struct, tag=True, omit_defaults=True):
    pass


# -- worker -> router --------------------------------------------------------------------
# (KVEndpoint and SlabEndpoint, the descriptors a worker registers, live in the transfer layer.)


class Load(msgspec.Struct):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_used_blocks: int
    num_reserved: int = 0  # decode: requests holding blocks while their KV arrives
    num_transferring: int = 0  # prefill: requests holding blocks while their KV leaves
    kv_bytes_sent: int = 0
    kv_seconds_sent: float = 0.0
    num_kv_writes_refused: int = 0  # KV layer writes a reservation fence refused (fence.py)
    num_encoder_cache_hits: int = 0  # encode: images served from the embedding cache
    num_encoder_cache_bytes: int = 0
    # Measured prefill compute per prompt token (engine/reload_rule.py ``PrefillRate``); 0 until measured.
    prefill_s_per_token: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    num_used_state_slots: int = 0  # a recurrent model's requests holding a state slot


class Register(Msg):
    worker_id: str
    role: Role
    pid: int
    host: str
    model_name: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    kv_endpoint: KVEndpoint | None = None
    slab: SlabEndpoint | None = None  # consumer: where encode workers write its embeddings
    can_encode: bool = False  # has a vision encoder in-process (takes images inline)
    node: str = ""  # the node it runs on (transfer/locality.py)
    # The reload rule's inputs (engine/reload_rule.py): KV bytes of one block (every layer),
    # and the tiers below its pool it reads.
    kv_bytes_per_block: Annotated[int, msgspec.Meta(ge=0)] = 0
    kv_tiers: list[TierCost] = []
    # Prompt tokens one step takes at most (0: not said): admission's bound on the lower-class
    # work a step in flight may hold (router/workers.py ``prefill_tokens_ahead``).
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Its load as it registers (its pool's free blocks among them), so that a worker is never
    # routed to on a blank report before its first heartbeat arrives.
    load: Load | None = None


class TierCost(msgspec.Struct, array_like=True):
    """A KV tier below a worker's pool as measured at its start (``engine/kv_store.py``)."""

    tier: Literal["host", "disk"]
    bytes_per_s: Annotated[float, msgspec.Meta(gt=0)]
    latency_s: Annotated[float, msgspec.Meta(ge=0)]


class Heartbeat(Msg):
    worker_id: str
    load: Load
    # Progress: steps the worker's loop has completed, and how long the step now running has
    # been running (seconds; 0 between steps). The router's watchdog reads the second: a loop
    # stuck in one step while this thread still beats is treated like a dead worker.
    num_steps: int = 0
    step_age_s: float = 0.0


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class Timing(msgspec.Struct, omit_defaults=True):
    """Server-side timestamps of one request (seconds since the epoch; 0 = did not happen),
    one field per ``request.EventType`` the router sees (named by its value), then durations
    and counts."""

    arrived: float = 0.0
    admitted: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    kv_transfer_start: float = 0.0
    kv_transfer_end: float = 0.0
    kv_exposed_s: float = 0.0  # transfer time not hidden behind prefill compute (a duration)
    kv_blocking_s: float = 0.0  # of which inside the prefill step (delays the first token)
    first_token: float = 0.0
    decode_start: float = 0.0
    finished: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens the prefill side (or colocated worker) had cached
    num_decode_cached_tokens: int = 0  # P/D: prompt tokens the decode worker had cached
    kv_bytes: int = 0  # P/D: KV bytes moved prefill -> decode
    kv_bytes_skipped: int = 0  # P/D: KV bytes not moved (the decode worker held them)
    kv_bytes_by_group: dict[str, int] = {}  # P/D: kv_bytes per KV cache group (full, sliding<W>)
    kv_load: KVLoad | None = None  # of num_cached_tokens, what came from the tiers below the pool
    encode_start: float = 0.0  # first image's encode began
    encode_end: float = 0.0  # last image's embedding is in the consumer's memory
    embed_transfer_s: float = 0.0  # time spent writing embeddings into slabs (summed)
    num_images: int = 0
    num_encoder_cache_hits: int = 0
    service_class: str = "interactive"  # epdserve.service

    def at(self, event: EventType) -> float:
        """When ``event`` happened (0.0: not yet)."""
        return getattr(self, event.value)

    def record(self, event: EventType, when: float) -> None:
        """``event`` happened at ``when`` (0.0: nothing to record); see ``EventType`` for
        which time a repeated event keeps."""
        if not when:
            return
        old = getattr(self, event.value)
        if not old or (when < old if event.is_first_wins else when > old):
            setattr(self, event.value, when)


TIMED_EVENTS = tuple(e for e in EventType if e.value in Timing.__struct_fields__)


class KVLoad(msgspec.Struct, omit_defaults=True):
    """What a request's prefill took from the KV tiers below the worker's pool, and the reload
    rule's inputs (``request.TierLoad``)."""

    num_found_tokens: int = 0  # tokens the tiers held after the pool hit
    num_chosen_tokens: int = 0  # of them, those the reload rule chose to load (0: computed)
    num_host_tokens: int = 0  # of them loaded from the host tier
    num_disk_tokens: int = 0  # and from disk
    predicted_load_s: float = 0.0  # the rule: loading what it loaded
    predicted_compute_s: float = 0.0  # the rule: computing every found token instead
    read_s: float = 0.0  # measured: reading and checking the blocks
    num_peer_tokens: int = 0  # P/D: copied from the decode worker's pages (shared memory)
    predicted_peer_s: float = 0.0  # the rule: that copy


class TokenOutput(msgspec.Struct, omit_defaults=True):
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    encode_start: float = 0.0  # in-process encoder (no encode workers)
    encode_end: float = 0.0
    num_encoder_cache_hits: int = 0
    kv_load: KVLoad | None = None  # first output: what the prompt took from the tiers below the pool


MAX_EVENT_BLOCKS = 1 << 16  # block hashes one KV event may carry
BlockHash = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]


class KVEvent(msgspec.Struct, array_like=True):
    """Blocks (by prefix-cache key) ``stored`` in or ``removed`` from one of a worker's tiers,
    or the whole tier ``cleared`` (``router/prefix_index.py`` keeps the router's index)."""

    kind: Literal["stored", "removed", "cleared"]
    tier: Literal["pool", "host", "disk"]
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_EVENT_BLOCKS)]


class Outputs(Msg):
    worker_id: str
    outputs: list[TokenOutput]
    kv_events: list[KVEvent] = []  # what the step cached and evicted, in order


class KVEvents(Msg):
    """KV events outside a step's outputs (tier writes that finished while the worker idled)."""

    worker_id: str
    events: list[KVEvent]


class Reserved(Msg):
    """Decode worker's answer to Reserve: block ids per group and the reservation's generation
    (every KV write for it must carry that number), or why not."""

    request_id: str
    ok: bool
    block_ids: list[list[int]] = []
    generation: int = 0
    reason: str = ""
    # Leading prompt tokens whose KV the decode worker already holds (its prefix cache): the
    # prefill worker writes only the blocks after them. A multiple of the block size.
    num_cached_tokens: int = 0


class ReservationExpired(Msg):
    """Decode worker: a reservation's KV did not land within its lease; its blocks are free
    again and any later write carrying its generation is refused."""

    request_id: str


class TransferDone(Msg):
    """Prefill worker: the request's KV has landed in the decode worker's pages (or failed)."""

    request_id: str
    ok: bool
    kv_bytes: int = 0
    kv_bytes_skipped: int = 0  # KV of the prompt's leading tokens the decode worker already held
    transfer_start: float = 0.0
    transfer_end: float = 0.0
    exposed_s: float = 0.0  # transfer time not hidden behind prefill compute
    blocking_s: float = 0.0  # of which the prefill worker's compute thread spent moving bytes
    reason: str = ""
    transport: str = ""  # how the KV went: "shm" (same node) or "tcp"
    kv_bytes_by_group: dict[str, int] = {}  # kv_bytes per KV cache group (full, sliding<W>)


class Paused(Msg):
    """Decode worker -> router, answering ``Pause``: the request stopped between steps with its
    KV kept for a hand-over (``output_token_ids``: every token it generated, the last one's KV
    not computed yet), or it could not be (``ok`` False: it goes on here)."""

    request_id: str
    ok: bool
    output_token_ids: list[int] = []
    reason: str = ""


class Retargeted(Msg):
    """Prefill worker -> router, answering ``Retarget``: the prompt's KV now goes to the new
    decode worker's blocks (``ok``), or some of it may already have gone to the old one."""

    request_id: str
    ok: bool


class RequestFailed(Msg):
    request_id: str
    message: str


class EmbeddingLanded(Msg):
    """Consumer (TCP slab): image ``image_index`` of the request has landed in its slab."""

    request_id: str
    image_index: int | None  # None: the consumer dropped the request and lands nothing more of it


class EncodeDone(Msg):
    """Encode worker: one image's embedding is in the consumer's slab (or failed)."""

    request_id: str
    image_index: int
    ok: bool
    is_cache_hit: bool = False
    encode_start: float = 0.0
    encode_end: float = 0.0
    write_s: float = 0.0  # copying the rows into the slab
    num_bytes: int = 0
    reason: str = ""
    via_tcp: bool = False  # sent over TCP: it has landed once the consumer says so


# -- router -> worker --------------------------------------------------------------------
class ImageRef(msgspec.Struct, omit_defaults=True):
    """One image of a submitted prompt: its token span and where its embedding comes from."""

    offset: int  # prompt position of the span's first token
    length: int  # tokens in the span
    num_embeds: int  # of which image tokens (= embedding rows)
    content_hash: str
    slab_offset: int | None = None  # first row in the consumer's slab; None: encode in-process from ``data``
    data: bytes = b""  # the image file (in-process encoding only)


class Submit(Msg):
    """Run a request to completion on a colocated worker (or prefill-only on a prefill one)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # P/D: where the KV goes (decode worker id, its block ids per group, the reservation's
    # generation, which every write carries)
    kv_target: str = ""
    kv_target_block_ids: list[list[int]] = []
    kv_target_generation: int = 0
    # Leading prompt tokens the decode worker holds already: their KV is not written.
    kv_target_num_cached: int = 0
    images: list[ImageRef] = []
    mm_pipelined: bool = True  # prefill may start before every image's embedding is there


class EncodeImage(Msg):
    """Router -> encode worker: embed one image into ``target``'s slab at ``slab_offset``."""

    request_id: str
    image_index: int
    content_hash: str
    data: bytes  # the image file as the client sent it (PNG/JPEG/WebP)
    target: str  # consumer worker id
    slab_offset: int
    num_rows: int


class EmbeddingReady(Msg):
    """Router -> consumer: image ``image_index`` of the request is in the slab."""

    request_id: str
    image_index: int


class SlabUp(Msg):
    """Router -> encode worker: a consumer's slab to map."""

    worker_id: str
    slab: SlabEndpoint


MAX_RESERVE_WAIT_S = 86400.0


class Reserve(Msg):
    request_id: str
    num_prompt_tokens: int
    # The prompt's full blocks by prefix-cache key (engine/block_pool.py ``chain_hashes`` over
    # ``request.hash_prompt_ids``, at the decode worker's block size): the decode worker reuses
    # the leading blocks it has cached.
    block_hashes: list[bytes] = []
    has_images: bool = False  # the decode worker cannot name blocks past ``block_hashes`` itself
    # Seconds the reservation may wait for blocks or a sequence seat the decode worker has not
    # free now (in order of ``priority``, then arrival); then it is refused. 0: refuse at once.
    max_wait_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_RESERVE_WAIT_S)] = 0.0
    # The request's scheduling key (``SamplingParams.priority``, service.py: lower first).
    priority: Annotated[int, msgspec.Meta(ge=MIN_SCHEDULE_KEY, le=MAX_SCHEDULE_KEY)] = 0


class StartDecode(Msg):
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: SamplingParams
    kv_via_tcp: bool = False  # the KV came over TCP: start once its end marker has landed


class Abort(Msg):
    request_id: str


class Pause(Msg):
    """Router -> a draining decode worker: stop the running request between steps and keep its
    KV, to hand it over to another decode worker (``Paused`` answers)."""

    request_id: str


class _ToReservation(Msg):
    """A request's KV is to go into ``target``'s reservation (its blocks and fence
    generation), less the ``target_num_cached`` leading positions the target holds."""

    request_id: str
    target: str
    target_block_ids: list[list[int]]
    target_generation: int
    target_num_cached: int = 0


class Retarget(_ToReservation):
    """Router -> a prefill worker: a queued prompt's KV goes to ``target``'s reserved blocks
    instead of its decode worker's (which is leaving its role); ``Retargeted`` answers."""


class HandOver(_ToReservation):
    """Router -> the decode worker a paused request is on: copy its KV into ``target``'s
    reserved blocks (as a prefill worker pushes a prompt's; ``TransferDone`` reports the end)."""


class PeerUp(Msg):
    worker_id: str
    endpoint: KVEndpoint


class PeerDown(Msg):
    worker_id: str


class Reconcile(Msg):
    """Router -> a worker it had given up on (missed lease, hung step) whose heartbeats came
    back: drop every request not in ``request_ids`` (freeing their blocks), then register
    again."""

    request_ids: list[str] = []


class Shutdown(Msg):
    pass


class SwitchRole(Msg):
    """Router -> an LLM worker that holds no request (it was drained): free this role's
    transfer resources (KV pages, listener, peer links, slab) and register again as ``role``,
    in the same process, keeping the loaded model."""

    role: Role


Message = Union[
    Register, Heartbeat, Outputs, Reserved, TransferDone, RequestFailed, EncodeDone, EmbeddingLanded,
    Submit, Reserve, StartDecode, Abort, PeerUp, PeerDown, Shutdown, EncodeImage, EmbeddingReady, SlabUp,
    ReservationExpired, Reconcile, KVEvents, SwitchRole, Pause, Paused, HandOver, Retarget, Retargeted,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
