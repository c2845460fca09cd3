"""What the router holds for a request: its handle (what the client reads) and one path per
output sequence (the sequence's way through the workers). Plain data; flow.py changes it.

A path's phases (``Phase``)::

    colocated   RUNNING (on its colocated worker, first to last token)

    P/D         NEW ─▶ RESERVING ──Reserved──▶ PREFILLING ──first token──▶ TRANSFERRING ──TransferDone──▶ DECODING
                       (decode worker           (prefill worker            (KV still landing;             (decode worker
                        holds blocks)            computes, pushes KV)       first token already out)       streams the rest)
                                                                 └─ the first token is the last ─▶ DRAINING (blocks go
                                                                                                    when the transfer ends)

    DECODING ──its decode worker drains for a switch of role──▶ HANDING_OVER ──▶ DECODING on
    another decode worker; PREFILLING, still queued: its KV re-pointed to another decode
    worker's blocks (handover.py)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum

from epdserve.cluster import messages as m
from epdserve.request import EventType
from epdserve.router.images import ImageInput
from epdserve.router.workers import PromptBlocks
from epdserve.sampling import SamplingParams
from epdserve.service import DEFAULT_CLASS
from epdserve.transfer.slab import SlabRegion


class Mode(StrEnum):
    """How the ready workers serve a request."""

    COLOCATED = "colocated"  # one worker runs it to completion
    PD = "pd"  # a prefill worker, then a decode worker


class Phase(StrEnum):
    NEW = "new"
    RUNNING = "running"
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    DRAINING = "draining"
    HANDING_OVER = "handing_over"


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
    service_class: str = DEFAULT_CLASS  # epdserve.service
    num_output_tokens: int = 0  # every sequence's, so far
    predicted_ttft_s: float | None = None  # --admission predictive: before ``ttft_correction``

    async def events(self) -> AsyncIterator[StreamEvent]:
        async for batch in self.event_batches():
            for event in batch:
                yield event

    async def event_batches(self) -> AsyncIterator[list[StreamEvent]]:
        """The events as ``events`` gives them, each wake-up's worth at once: the one awaited
        and every one queued behind it (a stream writes them in one chunk). Ends after an
        error or the last sequence's end."""
        while self.num_finished < self.n:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            out = []
            for event in batch:
                out.append(event)
                if event.error is not None:
                    yield out
                    return
                if event.output is not None and event.output.finished:
                    self.num_finished += 1
                    if self.num_finished >= self.n:
                        break
            yield out

    @property
    def has_first_token(self) -> bool:
        return self.timing.at(EventType.FIRST_TOKEN) > 0.0


@dataclass
class PathImages:
    """A path's images and the slab space they hold on its consumer."""

    images: list[ImageInput]
    consumer: str
    regions: list[SlabRegion] = field(default_factory=list)
    pending_jobs: dict[int, str] = field(default_factory=dict)  # image index -> encode worker
    sent_indices: set[int] = field(default_factory=set)  # TCP: sent by the encoder, not yet landed
    is_consumer_done: bool = False
    is_consumer_closed: bool = False  # TCP: the consumer confirmed that nothing more lands


@dataclass
class Path:
    """One sequence's way through the workers (the worker-side request id is ``path_id``)."""

    path_id: str
    handle: RequestHandle
    index: int | None  # P/D: the sequence index; colocated: the worker reports indices
    prompt_token_ids: list[int]
    params: SamplingParams
    mode: Mode
    phase: Phase = Phase.NEW
    colocated: str | None = None
    prefill: str | None = None
    decode: str | None = None
    reserved: asyncio.Future | None = None  # P/D: the decode worker's answer to Reserve
    first_token_id: int | None = None
    continues: bool = False  # the prefill's first token is not the last one
    transfer_done: bool = False
    kv_transport: str = ""  # how its KV reached the decode worker ("shm", "tcp")
    transfer_timer: asyncio.TimerHandle | None = None
    done: bool = False
    mm: PathImages | None = None  # images: slab space and encode jobs
    # Handing over from a draining decode worker (handover.py): the decode worker it moves to,
    # the tokens generated before the move (from ``Paused``), and whether it may not be tried.
    handover_to: str | None = None
    handover_tokens: list[int] | None = None
    handover_generation: int = 0
    no_handover: bool = False
    # ... or, still queued at its prefill worker, re-pointed to another decode worker's blocks
    retarget_to: str | None = None
    no_retarget: bool = False
    # After a hand-over, the prompt and parameters its decode worker runs it with: the original
    # prompt plus the tokens generated before the move, the answer's remaining length.
    decode_prompt: list[int] | None = None
    decode_params: SamplingParams | None = None
    prompt_blocks: PromptBlocks | None = None  # P/D: the prompt's blocks by prefix-cache key

    @property
    def current_prompt(self) -> list[int]:
        return self.decode_prompt if self.decode_prompt is not None else self.prompt_token_ids

    @property
    def current_params(self) -> SamplingParams:
        return self.decode_params if self.decode_params is not None else self.params

    @property
    def workers(self) -> tuple[str | None, ...]:
        return self.colocated, self.prefill, self.decode, self.handover_to, self.retarget_to
