"""Continuous batching with chunked prefill, preemption by recompute and prefix caching.

Plain Python (no torch): the simulator drives this same class with modelled step times.

One step spends a token budget (``max_num_batched_tokens``): running requests first, in
arrival order (one token each when decoding, the next chunk when their prompt is still being
computed), then waiting requests in arrival order. When a running request cannot get blocks,
the most recently admitted running request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed (its full blocks are likely still in the
prefix cache).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from epdserve.config import SchedulerConfig
from epdserve.engine.kv_cache import KVCacheManager
from epdserve.engine.reload_rule import max_cached_blocks
from epdserve.request import NO_TIER_LOAD, EventType, Request, RequestStatus, TierLoad


class PrefixLoad(Protocol):
    """Blocks read from below the pool for one request (kv_offload.py ``PrefixLoad``)."""

    num_blocks: int
    block_ids: list[int]  # the pages they go to: set here, at allocation

    def info(self, block_size: int) -> TierLoad: ...


class PrefixLoader(Protocol):
    def plan_load(self, block_hashes: Sequence[bytes], num_cached_tokens: int) -> PrefixLoad | None: ...


class PeerPull(Protocol):
    """Blocks copied from the decode worker's pages for one request (kv_pull.py ``PeerPull``)."""

    num_blocks: int
    predicted_s: float
    block_ids: list[int]  # the pages they go to: set here, at allocation


class PeerLoader(Protocol):
    def plan_pull(self, request: Request, num_cached_tokens: int) -> PeerPull | None: ...


@dataclass
class ScheduledRequest:
    request: Request
    start_pos: int  # first position computed this step (tokens before it are in the cache)
    num_new_tokens: int
    block_tables: list[list[int]]  # per group, the request's whole table (shared, not a copy)
    will_sample: bool  # the step computes the request's last known token: a new token follows


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Blocks read from the tiers below the pool for requests admitted now (``PrefixLoader``),
    # to write into their pages before the forward pass.
    loads: list[PrefixLoad] = field(default_factory=list)
    # P/D prefill: blocks copied from the decode worker's pages (``PeerLoader``), likewise.
    pulls: list[PeerPull] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Finished requests whose blocks a KV transfer still reads (prefill side).
        self.transferring: dict[str, Request] = {}
        # Blocks reserved for a request whose KV another worker is writing (decode side):
        # request id -> leading prompt tokens the reservation took from the prefix cache.
        self.reserved: dict[str, int] = {}
        self.num_computed_prompt_tokens = 0  # prompt tokens actually run through the model
        # The tiers below the pool (kv_offload.KVOffload; None: none): asked at admission for
        # the blocks after a pool hit.
        self.prefix_loader: PrefixLoader | None = None
        # P/D prefill (kv_pull.PeerPuller; None: none): asked at admission for the blocks the
        # decode worker holds past the pool hit.
        self.peer_loader: PeerLoader | None = None
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request, ahead_of_equals=False)

    def _enqueue(self, request: Request, ahead_of_equals: bool) -> None:
        """Into the waiting queue in order of ``sampling.priority`` (lower first,
        ``epdserve.service``): a new request behind its equals, a preempted one ahead of them.
        All of one priority (the common case): an append at either end."""
        key = request.sampling.priority
        waiting = self.waiting
        if ahead_of_equals:
            if not waiting or key <= waiting[0].sampling.priority:
                waiting.appendleft(request)
                return
            i = next((i for i, r in enumerate(waiting) if r.sampling.priority >= key), len(waiting))
        else:
            if not waiting or waiting[-1].sampling.priority <= key:
                waiting.append(request)
                return
            i = next(i for i, r in enumerate(waiting) if r.sampling.priority > key)
        waiting.insert(i, request)

    def _victim_index(self, start: int = 0) -> int:
        """The running request to preempt among ``running[start:]``: the lowest priority
        (highest key), the latest admitted of those."""
        running = self.running
        best = len(running) - 1
        for i in range(len(running) - 2, start - 1, -1):
            if running[i].sampling.priority > running[best].sampling.priority:
                best = i
        return best

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """A waiting request of a higher class or priority than a running one, with no seat or
        no blocks for its first chunk: the lowest running one is preempted (recomputed later)."""
        kv = self.kv_cache
        while self.waiting and self.running:
            head = self.waiting[0]
            victim_index = self._victim_index()
            victim = self.running[victim_index]
            if victim.sampling.priority <= head.sampling.priority:
                return
            if (head.wait_for_request_id is not None and self._is_prompt_pending(head.wait_for_request_id)) \
                    or head.num_ready_tokens(0) <= 0:
                return  # it could not start now anyway
            first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
            if (len(self.running) < self.config.max_num_seqs
                    and kv.num_free_blocks() >= kv.num_blocks_for(first_chunk + 1)):
                return
            self.running.pop(victim_index)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def holds_blocks(self) -> bool:
        return bool(self.waiting or self.running or self.transferring or self.reserved)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort, stop string) and free its blocks; None if unknown.

        A request that finishes normally with ``hold_kv_for_transfer`` keeps its blocks
        (``transferring``) until ``release_transfer``; an aborted one frees them at once.
        """
        request = self.requests.pop(request_id, None)
        if request is None:
            return self._drop_held(request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        if request.hold_kv_for_transfer and status is not RequestStatus.FINISHED_ABORTED:
            self.transferring[request_id] = request
        else:
            self.kv_cache.free(request_id)
        return request

    def drop_queued(self) -> list[Request]:
        """Forget every waiting and running request and free its blocks (after ``schedule``
        raised: its queues may be half-updated); transfers and reservations stay."""
        dropped = list(self.requests.values())
        for request in dropped:
            request.status = RequestStatus.FINISHED_ABORTED
            self.kv_cache.free(request.request_id)
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()
        return dropped

    def _drop_held(self, request_id: str) -> Request | None:
        if request_id in self.reserved:
            self.release_reservation(request_id)
            return None
        request = self.transferring.get(request_id)
        if request is not None:
            self.release_transfer(request_id)
        return request

    def is_untouched(self, request_id: str) -> bool:
        """Waiting with nothing computed yet: its KV may still go elsewhere (a re-pointed
        hand-off)."""
        request = self.requests.get(request_id)
        return request is not None and request.status is RequestStatus.WAITING and not request.num_computed_tokens

    def has_whole_kv(self, request_id: str) -> bool:
        """Running with every token but the last sampled one computed (a request being
        prefilled or preempted has no whole KV to hand over)."""
        request = self.requests.get(request_id)
        return (request is not None and request.status is RequestStatus.RUNNING and bool(request.output_token_ids)
                and request.num_computed_tokens == request.num_tokens - 1)

    def hold_for_handover(self, request_id: str) -> Request | None:
        """Stop a running request between steps, keeping its blocks (``transferring``) so its
        KV can be copied to another worker; None unless it ``has_whole_kv``."""
        if not self.has_whole_kv(request_id):
            return None
        request = self.requests.pop(request_id)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.transferring[request_id] = request
        return request

    def release_transfer(self, request_id: str) -> None:
        """The KV transfer of a finished request is over (done or failed): free its blocks."""
        if self.transferring.pop(request_id, None) is not None:
            self.kv_cache.free(request_id)

    # -- decode side of a P/D pair --------------------------------------------------------
    def can_reserve(self) -> bool:
        return len(self.running) + len(self.reserved) < self.config.max_num_seqs

    def reserve(
        self, request_id: str, num_prompt_tokens: int, block_hashes: list[bytes] | None = None
    ) -> list[list[int]] | None:
        """Allocate blocks for a prompt whose KV another worker will write, plus the first
        output token; None when there is no room (the caller turns that into back-pressure).

        ``block_hashes``: the prompt's full blocks by their prefix-cache keys; the leading ones
        this worker has cached are taken from the cache (``num_reserved_cached``), and only the
        rest need writing."""
        if request_id in self.requests or request_id in self.reserved or not self.can_reserve():
            return None
        hit = None
        if block_hashes:
            self.kv_cache.adopt_block_hashes(request_id, block_hashes)
            hit = self.kv_cache.lookup_prefix(block_hashes, (num_prompt_tokens - 1) // self.kv_cache.block_size)
        num_cached = hit.num_tokens if hit is not None else 0
        # The first query here is at the prompt's end: a sliding group reserves its window only.
        if not self.kv_cache.allocate(request_id, num_cached, num_prompt_tokens + 1 - num_cached, hit,
                                      first_query=num_prompt_tokens):
            self.kv_cache.free(request_id)  # the adopted hashes
            return None
        self.reserved[request_id] = num_cached
        return self.kv_cache.block_tables(request_id)

    def num_reserved_cached(self, request_id: str) -> int:
        """Leading prompt tokens of a reservation that were in the prefix cache (0: unknown)."""
        return self.reserved.get(request_id, 0)

    def release_reservation(self, request_id: str) -> None:
        if self.reserved.pop(request_id, None) is not None:
            self.kv_cache.free(request_id)

    def add_prefilled(self, request: Request) -> None:
        """Start decoding a reserved request whose prompt KV has landed in its blocks.

        ``request.output_token_ids`` holds the first token, sampled by the prefill worker.
        """
        request.num_cached_tokens = self.reserved.pop(request.request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        request.record(EventType.SCHEDULED)
        self.requests[request.request_id] = request
        self.running.append(request)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.waiting and self.running:
            self._preempt_for_priority(out)
        num_priority_preempted = len(out.preempted_ids)
        # Prompt work of a lower class than the most urgent prompt waits while that one's runs:
        # its prefill chunks would lengthen the urgent request's steps (its time to first token).
        urgent_key = self._most_urgent_prompt_key()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_tokens_to_compute(request, budget)
            if num_new == 0 or (request.sampling.priority > urgent_key
                                and request.num_computed_tokens < request.num_prompt_tokens):
                i += 1
                continue
            while not self.kv_cache.allocate(request.request_id, request.num_computed_tokens, num_new):
                victim = self.running.pop(self._victim_index(i))
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._entry(request, num_new))
                budget -= num_new
                i += 1
        if len(out.preempted_ids) == num_priority_preempted:  # no block shortage among the running
            self._admit_waiting(out, budget, urgent_key)
        return out

    def _most_urgent_prompt_key(self) -> int:
        """The smallest queue key of a prompt that can be computed now: the waiting head (when
        it can start) or a running request still in its prompt; ``sys.maxsize`` for none."""
        key = sys.maxsize
        if self.waiting:
            head = self.waiting[0]
            if not (head.wait_for_request_id is not None and self._is_prompt_pending(head.wait_for_request_id)) \
                    and head.num_ready_tokens(0) > 0:
                key = head.sampling.priority
        for request in self.running:
            if request.sampling.priority < key and request.num_computed_tokens < request.num_prompt_tokens:
                key = request.sampling.priority
        return key

    def _admit_waiting(self, out: SchedulerOutput, budget: int, urgent_key: int = sys.maxsize) -> None:
        """Start waiting requests in queue order while the step has budget and seats; one of a
        lower class than ``urgent_key``'s (the most urgent prompt) waits for a step without it."""
        blocked: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.sampling.priority > urgent_key and any(
                    e.start_pos < e.request.num_prompt_tokens and e.request.sampling.priority <= urgent_key
                    for e in out.scheduled):
                break
            leader = request.wait_for_request_id
            if leader is not None and self._is_prompt_pending(leader):
                blocked.append(self.waiting.popleft())
                continue
            hit = self.kv_cache.find_cached_prefix(request.request_id, request.hash_token_ids)
            num_computed = hit.num_tokens
            pull = None
            if self.peer_loader is not None and request.kv_target_num_cached > num_computed:
                pull = self.peer_loader.plan_pull(request, num_computed)
                if pull is not None:
                    num_computed += pull.num_blocks * self.kv_cache.block_size
            load = self._plan_load(request, num_computed) if self.prefix_loader is not None else None
            if load is not None:
                num_computed += load.num_blocks * self.kv_cache.block_size
            num_new = self._num_tokens_to_compute(request, budget, num_computed)
            if num_new == 0:
                if num_computed >= request.num_ready_tokens(num_computed):
                    # Waiting for an image's embedding, not for room: let later requests pass.
                    blocked.append(self.waiting.popleft())
                    continue
                break
            if not self.kv_cache.allocate(request.request_id, num_computed, num_new, hit):
                break
            self.waiting.popleft()
            block_size = self.kv_cache.block_size
            request.tier_load = load.info(block_size) if load is not None else None
            first = hit.num_tokens // block_size
            if pull is not None:  # copied pages come right after the pool hit, then the loaded ones
                pull.block_ids = self.kv_cache.block_tables(request.request_id)[0][first : first + pull.num_blocks]
                out.pulls.append(pull)
                first += pull.num_blocks
                request.tier_load = replace(request.tier_load or NO_TIER_LOAD, predicted_peer_s=pull.predicted_s,
                                            num_peer_tokens=pull.num_blocks * block_size)
            if load is not None and load.num_blocks:
                load.block_ids = self.kv_cache.block_tables(request.request_id)[0][first : first + load.num_blocks]
                out.loads.append(load)
            request.num_computed_tokens = num_computed
            request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.record(EventType.SCHEDULED)
            self.running.append(request)
            out.scheduled.append(self._entry(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(blocked))

    def _plan_load(self, request: Request, num_cached: int) -> PrefixLoad | None:
        """The prefix loader's load for the blocks after a pool hit of ``num_cached`` tokens
        (None: nothing to load)."""
        kv = self.kv_cache
        max_blocks = max_cached_blocks(len(request.hash_token_ids), kv.block_size)
        first = num_cached // kv.block_size
        if first >= max_blocks:
            return None
        return self.prefix_loader.plan_load(kv.block_hashes(request.request_id)[first:max_blocks], num_cached)

    def _is_prompt_pending(self, request_id: str) -> bool:
        leader = self.requests.get(request_id)
        return leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens

    def _num_tokens_to_compute(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        computed = request.num_computed_tokens if num_computed is None else num_computed
        remaining = request.num_tokens - computed
        num_ready = request.num_ready_tokens(computed) - computed  # images still encoding end it early
        if num_ready < remaining:
            if num_ready <= 0 or not self.config.enable_chunked_prefill:
                return 0
            return min(num_ready, budget)
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _entry(self, request: Request, num_new: int) -> ScheduledRequest:
        tables = self.kv_cache.block_tables(request.request_id)
        start = request.num_computed_tokens
        will_sample = start + num_new == request.num_tokens
        return ScheduledRequest(request, start, num_new, tables, will_sample)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.record(EventType.PREEMPTED)
        self._enqueue(request, ahead_of_equals=True)

    # -- after the step ------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish what stops; returns those."""
        finished = []
        for entry in out.scheduled:
            request = entry.request
            if request.is_finished or request.request_id not in self.requests:
                continue
            if entry.start_pos < request.num_prompt_tokens:
                self.num_computed_prompt_tokens += (
                    min(entry.start_pos + entry.num_new_tokens, request.num_prompt_tokens) - entry.start_pos
                )
            request.num_computed_tokens += entry.num_new_tokens
            num_cacheable = (request.num_computed_tokens if request.cache_new_blocks
                             else min(request.num_computed_tokens, request.num_prompt_tokens))
            if self.kv_cache.has_uncached_full_blocks(request.request_id, num_cacheable):
                self.kv_cache.cache_computed_blocks(request.request_id, request.hash_token_ids, num_cacheable)
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
