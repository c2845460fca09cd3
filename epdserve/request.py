"""A request's state as the scheduler and engine see it.

Token ids only, no tensors: the scheduler and the simulator share this module.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from epdserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class EventType(enum.Enum):
    """One vocabulary for a request's life, shared by the engine (``Request.events``), the
    router (``messages.Timing``, whose timestamp fields are named by these values) and the
    simulator. An event may happen more than once (a request preempted and rescheduled, images
    encoded one by one): a Timing keeps the earliest time of the events that mark a start (the
request's prompt is prefilled when its first sequence's is) and the latest of the others (the
last image's embedding, the last layer of KV, the last sequence's end)."""

    ARRIVED = "arrived"
    ADMITTED = "admitted"
    SCHEDULED = "scheduled"
    PREEMPTED = "preempted"
    ENCODE_START = "encode_start"
    ENCODE_END = "encode_end"
    PREFILL_START = "prefill_start"
    PREFILL_END = "prefill_end"
    KV_TRANSFER_START = "kv_transfer_start"
    KV_TRANSFER_END = "kv_transfer_end"
    FIRST_TOKEN = "first_token"
    DECODE_START = "decode_start"
    FINISHED = "finished"

    @property
    def is_first_wins(self) -> bool:
        """A Timing keeps this event's earliest time (else its latest)."""
        return self in _FIRST_WINS


_FIRST_WINS = frozenset({EventType.ARRIVED, EventType.ADMITTED, EventType.ENCODE_START, EventType.PREFILL_START,
                         EventType.PREFILL_END, EventType.KV_TRANSFER_START, EventType.FIRST_TOKEN,
                         EventType.DECODE_START})


@dataclass
class MMInput:
    """One image of a prompt: where its tokens sit and whether its embedding has arrived.

    Prompt positions ``offset .. offset + length`` stand for the image; ``num_embeds`` of them
    (those holding the model's image token id) take the encoder's rows, in order. ``embeds``
    is the worker's handle on those rows (a tensor view of a slab, or the in-process encoder's
    output); this module never looks inside it.
    """

    offset: int
    length: int
    num_embeds: int
    content_hash: str
    # Span-relative positions of the image tokens, ascending; None: every position of the span.
    embed_positions: list[int] | None = None
    is_ready: bool = False
    embeds: object = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def cache_key(self) -> int:
        return image_cache_key(self.content_hash)


def image_cache_key(content_hash: str) -> int:
    """A negative id standing for an image's tokens in prefix-cache hashes: equal placeholders
    of different images must not hit each other's blocks."""
    return -1 - int(content_hash[:15], 16)


def hash_prompt_ids(prompt_token_ids: list[int], images: list[tuple[int, int, str]]) -> list[int]:
    """The ids that name a prompt's blocks in the prefix cache: its tokens, with each image's
    span (offset, length, content hash) replaced by the image's key."""
    if not images:
        return prompt_token_ids
    ids = list(prompt_token_ids)
    for offset, length, content_hash in images:
        ids[offset : offset + length] = [image_cache_key(content_hash)] * length
    return ids


@dataclass(frozen=True)
class TierLoad:
    """What a request's admission took from the KV store below the pool (``engine/kv_offload.py``)
    and the reload rule's inputs: blocks found after the pool hit, of them those the rule chose
    to load and those read back per tier (a block that fails its check ends the load), the
    rule's predicted load and compute times (seconds), and the measured read time."""

    num_found_tokens: int
    num_chosen_tokens: int
    num_host_tokens: int
    num_disk_tokens: int
    predicted_load_s: float
    predicted_compute_s: float
    read_s: float
    # P/D: tokens copied from the decode worker's pages before the tiers (``engine/kv_pull.py``),
    # and the rule's copy time for them
    num_peer_tokens: int = 0
    predicted_peer_s: float = 0.0


NO_TIER_LOAD = TierLoad(0, 0, 0, 0, 0.0, 0.0, 0.0)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)  # seconds since the epoch
    # A request that must not start before another has computed its prompt (n > 1 siblings
    # wait for the first so that they hit its prompt blocks in the prefix cache).
    wait_for_request_id: str | None = None
    # Prefill worker of a P/D pair: when the request finishes, its blocks stay allocated
    # until the KV transfer reports done (Scheduler.release_transfer).
    hold_kv_for_transfer: bool = False
    kv_target: str | None = None  # decode worker that receives this request's KV
    kv_target_block_ids: list[list[int]] = field(default_factory=list)  # its blocks, per group
    kv_target_generation: int = 0  # the decode worker's reservation (its write fence)
    # Images in the prompt, in prompt order (no overlaps); see ``num_ready_tokens``.
    mm_inputs: list[MMInput] = field(default_factory=list)
    # Prefill may compute the tokens before an image whose embedding has not arrived
    # (pipelined); False: nothing until every image's embedding is there.
    is_mm_pipelined: bool = True
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on the last admission
    tier_load: TierLoad | None = None  # of them, loaded from the tiers below the pool
    # P/D: leading prompt tokens the decode worker already holds (its prefix cache): their KV
    # is not sent. A multiple of the block size.
    kv_target_num_cached: int = 0
    # Register the request's full blocks in the prefix cache (False: a decode worker's request
    # whose prompt has images it never saw, so it cannot name blocks past the prompt's hashes).
    cache_new_blocks: bool = True
    num_preemptions: int = 0
    events: list[tuple[EventType, float]] = field(default_factory=list)
    _hash_prompt_ids: list[int] | None = field(default=None, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def num_ready_tokens(self, num_computed: int = 0) -> int:
        """Tokens whose inputs are all available: the whole sequence, or up to the first
        image past ``num_computed`` whose embedding has not arrived::

            | text | image 0 (ready) | text | image 1 (pending) | text |
            |<------------- ready ------------>|

        Not pipelined: 0 while any such image is pending.
        """
        for mm in self.mm_inputs:
            if not mm.is_ready and mm.end > num_computed:
                return mm.offset if self.is_mm_pipelined else 0
        return self.num_tokens

    @property
    def hash_token_ids(self) -> list[int]:
        """The ids that name this request's blocks in the prefix cache: its tokens, with each
        image's positions replaced by that image's content key."""
        if not self.mm_inputs:
            return self.prompt_token_ids + self.output_token_ids
        if self._hash_prompt_ids is None:
            spans = [(mm.offset, mm.length, mm.content_hash) for mm in self.mm_inputs]
            self._hash_prompt_ids = hash_prompt_ids(self.prompt_token_ids, spans)
        return self._hash_prompt_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def record(self, event: EventType, when: float | None = None) -> None:
        """``when``: seconds since the epoch (comparable across worker processes on a host);
        the simulator passes its own clock."""
        self.events.append((event, time.time() if when is None else when))

    def first_event_time(self, event: EventType) -> float | None:
        for kind, when in self.events:
            if kind is event:
                return when
        return None
