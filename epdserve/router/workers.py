"""What the router knows of each worker, and how it picks one (routing policy)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from epdserve.cluster import messages as m
from epdserve.engine.block_pool import chain_hashes
from epdserve.engine.reload_rule import PRIOR_PREFILL_S_PER_TOKEN
from epdserve.errors import ConfigError
from epdserve.roles import Role
from epdserve.router.prefix_index import TIERS, Candidate, PrefixCost, PrefixIndex, choose, score
from epdserve.service import DEFAULT_KEY


class WorkerState(str, Enum):
    """A worker's standing with the router::

        READY ──lease missed / step hung──▶ SUSPECT ──heartbeats back, reconciled, registers──▶ READY
          │  ▲                                 │
          │  └── registers in its new role ──┐ └──▶ DEAD (process exited; a restarted one registers anew)
          │                                  │
          └─ switch of role ─▶ DRAINING ─▶ SWITCHING        (role_switch.py)
             begins            holds nothing: SwitchRole sent

    Only READY workers get new requests. A DRAINING one still serves what it holds (it beats,
    and losing it fails those requests as losing a READY one does); a SWITCHING one holds
    nothing and is rebuilding its role. Entering SUSPECT or DEAD fails the requests in hand.
    """

    READY = "ready"
    DRAINING = "draining"
    SWITCHING = "switching"
    SUSPECT = "suspect"
    DEAD = "dead"


# States in which a worker serves the requests it holds (heartbeats expected).
SERVING_STATES = (WorkerState.READY, WorkerState.DRAINING)


@dataclass
class WorkerInfo:
    """A worker as the router knows it: what it registered (``registration``, as sent) and the
    router's own state of it."""

    registration: m.Register
    state: WorkerState = WorkerState.READY
    load: m.Load = field(default_factory=lambda: m.Load(0, 0, 0, 0))
    last_seen: float = field(default_factory=time.monotonic)  # seconds, monotonic
    request_ids: set[str] = field(default_factory=set)  # router requests touching this worker
    num_submitted: int = 0  # requests sent since the last heartbeat (load the report lags)
    # Requests in hand whose prompt this worker has not finished prefilling: prompt tokens.
    prefill_tokens: dict[str, int] = field(default_factory=dict)
    num_prefill_tokens: int = 0  # their sum
    # Of them, those not of the default scheduling key (epdserve.service): request id -> key.
    prefill_keys: dict[str, int] = field(default_factory=dict)
    last_reconcile: float = 0.0  # monotonic seconds: when a Reconcile was last sent (SUSPECT)
    # Switches of role (role_switch.py): the role it drains for (DRAINING, SWITCHING), when the
    # switch began, and when it last took a role (registration; monotonic seconds).
    switch_to: str | None = None
    switch_began: float = 0.0
    role_since: float = field(default_factory=time.monotonic)
    num_switches: int = 0
    # Read on every routing decision (a simulated cluster of a hundred instances makes millions):
    # plain attributes, copied from the registration.
    worker_id: str = field(init=False)
    role: str = field(init=False)

    _prefix_cost: PrefixCost | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.worker_id = self.registration.worker_id
        self.role = self.registration.role

    @property
    def prefix_cost(self) -> PrefixCost:
        """The reload rule's costs on this worker (``engine/reload_rule.py``): its measured
        prefill per token (the last heartbeat's; ``PRIOR_PREFILL_S_PER_TOKEN`` until one
        measured it) and the tiers it registered."""
        per_token_s = self.load.prefill_s_per_token or PRIOR_PREFILL_S_PER_TOKEN
        cost = self._prefix_cost
        if cost is None or cost.per_prefill_token_s != per_token_s:
            reg = self.registration
            cost = PrefixCost(per_token_s, 0.0, {t.tier: t.bytes_per_s for t in reg.kv_tiers},
                              {t.tier: t.latency_s for t in reg.kv_tiers}, reg.kv_bytes_per_block, reg.block_size)
            self._prefix_cost = cost
        return cost

    @property
    def endpoint(self) -> m.KVEndpoint | None:
        return self.registration.kv_endpoint

    @property
    def can_encode(self) -> bool:
        """A consumer with an in-process vision encoder (takes images inline)."""
        return self.registration.can_encode

    def take(self, request_id: str, num_prompt_tokens: int = 0, key: int = DEFAULT_KEY) -> None:
        """A request sent to this worker; ``num_prompt_tokens`` > 0 when it prefills here, in
        the queue order ``key`` (``SamplingParams.priority``)."""
        self.request_ids.add(request_id)
        self.num_submitted += 1
        if num_prompt_tokens > 0:
            self.prefill_tokens[request_id] = num_prompt_tokens
            self.num_prefill_tokens += num_prompt_tokens
            if key != DEFAULT_KEY:
                self.prefill_keys[request_id] = key

    def prefill_tokens_ahead(self, key: int = DEFAULT_KEY) -> int:
        """Prompt tokens to prefill here before a new request of queue order ``key``: those of
        its order or ahead of it (the worker takes its waiting requests by key), and of the
        rest at most one step's worth (the step in flight may hold them; a worker that did not
        say its step size: all of them)."""
        if not self.prefill_keys and key >= DEFAULT_KEY:
            return self.num_prefill_tokens
        keys = self.prefill_keys
        ahead = sum(n for rid, n in self.prefill_tokens.items() if keys.get(rid, DEFAULT_KEY) <= key)
        behind = self.num_prefill_tokens - ahead
        step = self.registration.max_num_batched_tokens
        return ahead + (min(behind, step) if step else behind)

    def prefilled(self, request_id: str) -> None:
        """Its first token came back: the prompt is no longer work ahead of new requests."""
        self.num_prefill_tokens -= self.prefill_tokens.pop(request_id, 0)
        self.prefill_keys.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        self.request_ids.discard(request_id)
        self.prefilled(request_id)

    @property
    def is_ready(self) -> bool:
        return self.state is WorkerState.READY

    @property
    def is_serving(self) -> bool:
        """It runs the requests it holds (READY or DRAINING)."""
        return self.state in SERVING_STATES

    def as_json(self) -> dict:
        load = self.load
        return {
            "id": self.worker_id,
            "role": self.role,
            "pid": self.registration.pid,
            "host": self.registration.host,
            "node": self.registration.node,
            # The TCP listeners peers on other nodes connect to ("" when it offers none).
            "kv_listener": _listener(self.registration.kv_endpoint),
            "slab_listener": _listener(self.registration.slab),
            "state": self.state.value,
            **({"switch_to": self.switch_to} if self.switch_to else {}),
            "num_role_switches": self.num_switches,
            "load": {
                "num_requests": len(self.request_ids),
                "num_running": load.num_running,
                "num_waiting": load.num_waiting,
                "num_free_blocks": load.num_free_blocks,
                "num_used_blocks": load.num_used_blocks,
                "num_used_state_slots": load.num_used_state_slots,
                "num_reserved": load.num_reserved,
                "num_transferring": load.num_transferring,
                "num_kv_writes_refused": load.num_kv_writes_refused,
                "num_encoder_cache_hits": load.num_encoder_cache_hits,
                "num_encoder_cache_bytes": load.num_encoder_cache_bytes,
            },
        }


def _listener(endpoint: m.KVEndpoint | m.SlabEndpoint | None) -> str:
    return f"{endpoint.host}:{endpoint.port}" if endpoint is not None and endpoint.port else ""


# Routing policies (``epdserve serve --routing``): what ``WorkerRegistry.pick`` minimizes first.
ROUTING_POLICIES = ("least-prefill", "least-requests", "prefix-aware")
DEFAULT_ROUTING = ROUTING_POLICIES[0]
# prefix-aware, decode: a worker holding more of the prompt is preferred while it has at most
# this many more requests in hand than the least loaded one
DECODE_AFFINITY_SLACK = 2


@dataclass
class PromptBlocks:
    """A prompt as prefix-aware routing names it: its hash ids (``request.hash_prompt_ids``),
    chained into block keys (``engine/block_pool.py``) once per block size asked for."""

    hash_ids: list[int]
    ttft_slo_s: float | None = None  # the request's TTFT SLO, if it has one
    _by_block_size: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.hash_ids)

    def hashes(self, block_size: int) -> list[bytes]:
        hashes = self._by_block_size.get(block_size)
        if hashes is None:
            hashes = chain_hashes([], self.hash_ids, block_size, len(self.hash_ids) // block_size)
            self._by_block_size[block_size] = hashes
        return hashes


class TTFTCorrection:
    """How far measured times to first token run from ``WorkerRegistry.predict_ttft``'s: an
    exponentially weighted mean of measured / predicted over the admitted requests (clamped to
    [``MIN``, ``MAX``]; 1.0 until one is measured). The prediction's per-token rates are a
    median of recent prompt-only steps; batched, chunked steps and the hand-off add to that
    in service, and more so near saturation, where admission decides."""

    MIN, MAX = 0.5, 4.0
    WEIGHT = 0.1  # of each new request
    MIN_PREDICTED_S = 0.05  # shorter predictions say too little about the ratio

    def __init__(self) -> None:
        self.factor = 1.0
        self.num_observed = 0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if predicted_s < self.MIN_PREDICTED_S or not measured_s > 0:
            return
        ratio = min(max(measured_s / predicted_s, self.MIN), self.MAX)
        self.factor += self.WEIGHT * (ratio - self.factor)
        self.num_observed += 1


class WorkerRegistry:
    def __init__(self, routing: str = DEFAULT_ROUTING, ttft_slo_s: float | None = None) -> None:
        """``ttft_slo_s``: prefix-aware routing's TTFT SLO for requests that name none
        (``prefix_index.choose``); None: the fastest predicted worker."""
        if routing not in ROUTING_POLICIES:
            raise ConfigError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
        if ttft_slo_s is not None and not (ttft_slo_s > 0 and math.isfinite(ttft_slo_s)):
            raise ConfigError(f"the routing TTFT SLO must be a finite number of seconds > 0, got {ttft_slo_s!r}")
        self.workers: dict[str, WorkerInfo] = {}
        self.routing = routing
        self.ttft_slo_s = ttft_slo_s
        self.prefix_index = PrefixIndex()  # which worker holds which blocks (KV events)
        self.ttft_correction = TTFTCorrection()  # predict_ttft against what admitted requests took

    def add(self, info: WorkerInfo) -> None:
        """A worker registered (again: its pool starts empty in the prefix index)."""
        self.workers[info.worker_id] = info
        self.prefix_index.add_worker(info.worker_id, info.registration.node)

    def prefix_json(self, worker_id: str) -> dict:
        """``/v1/workers``: the KV blocks the router believes the worker can read, per tier."""
        index = self.prefix_index
        return {"cached_blocks": {tier: index.num_blocks(worker_id, tier) for tier in TIERS}}

    def apply_kv_events(self, worker_id: str, events: list[m.KVEvent]) -> None:
        for event in events:
            self.prefix_index.apply(worker_id, event.kind, event.tier, event.block_hashes)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self.workers.get(worker_id)

    def is_ready(self, worker_id: str) -> bool:
        worker = self.workers.get(worker_id)
        return worker is not None and worker.is_ready

    def ready(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role and w.is_ready]

    def count_ready(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.workers.values():
            if w.is_ready:
                counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def pick(self, role: str, prompt: PromptBlocks | None = None) -> WorkerInfo | None:
        """The worker for a new request's ``role``: by ``prefix-aware`` (``pick_by_prefix``)
        when that is the policy and the prompt is given, else ``pick_least_loaded``."""
        if prompt is not None and self.routing == "prefix-aware":
            return self.pick_by_prefix(role, prompt)
        return self.pick_least_loaded(role)

    def pick_by_prefix(self, role: str, prompt: PromptBlocks) -> WorkerInfo | None:
        """``prefix-aware``: the ready worker of ``role`` with the smallest predicted time to
        first token (``prefix_index.score``: prefill queued ahead, loads the reload rule
        takes, compute of the rest); with a TTFT SLO (the request's, else the registry's) that
        some meet, the one of those computing the fewest prompt tokens (``choose``); equals go
        to the least loaded (``pick_least_loaded``'s order).

        A decode worker computes no prompt: it takes the one holding the most of the prompt's
        blocks in its pool (the fewest bytes to send), among those with at most
        ``DECODE_AFFINITY_SLACK`` more requests in hand than the least loaded one.
        """
        workers = sorted((w for w in self.workers.values() if w.role == role and w.is_ready),
                         key=lambda w: (w.num_prefill_tokens, len(w.request_ids), -w.load.num_free_blocks))
        if not workers:
            return None
        index = self.prefix_index
        if role == Role.DECODE:
            most = len(workers[0].request_ids) + DECODE_AFFINITY_SLACK
            best, best_blocks = workers[0], -1
            for w in workers:
                if len(w.request_ids) <= most:
                    num_blocks = index.match(w.worker_id, prompt.hashes(w.registration.block_size)).num_pool_blocks
                    if num_blocks > best_blocks:
                        best, best_blocks = w, num_blocks
            return best
        scores = []
        for w in workers:
            cost = w.prefix_cost
            queued_s = cost.per_prefill_token_s * w.num_prefill_tokens
            scores.append(score(index, Candidate(w.worker_id, queued_s), prompt.hashes(cost.block_size),
                                prompt.num_tokens, cost))
        chosen = choose(scores, prompt.ttft_slo_s if prompt.ttft_slo_s is not None else self.ttft_slo_s)
        return self.workers[chosen.worker_id]

    def predict_ttft(self, role: str, prompt: PromptBlocks, key: int = DEFAULT_KEY) -> float | None:
        """The smallest predicted time to first token of ``prompt`` over the ready workers of
        ``role`` (``prefix_index.score``: prefill queued ahead of a request of queue order
        ``key``, loads, compute of the uncached rest), scaled by what measured TTFTs have run
        over the predictions (``ttft_correction``); None without such workers. Admission
        (``admission.check_predicted_ttft``) reads it."""
        best = None
        index = self.prefix_index
        for w in self.workers.values():
            if w.role != role or not w.is_ready:
                continue
            cost = w.prefix_cost
            queued_s = cost.per_prefill_token_s * w.prefill_tokens_ahead(key)
            s = score(index, Candidate(w.worker_id, queued_s), prompt.hashes(cost.block_size), prompt.num_tokens, cost)
            if best is None or s.predicted_ttft_s < best:
                best = s.predicted_ttft_s
        return best * self.ttft_correction.factor if best is not None else None

    def pick_least_loaded(self, role: str) -> WorkerInfo | None:
        """The ready worker of ``role`` with the fewest prompt tokens still to prefill, then the
        fewest requests in hand, then the most free blocks (``least-prefill``; with
        ``least-requests`` the first key is left out).

        A new request's first token waits for the prefill work queued ahead of it, so that
        comes first: by request count alone, a worker mid-way through a long prefill and one
        that is only decoding look alike, and two requests arriving close together could
        both queue behind the prefill. All three are the router's own exact counts except
        free blocks, which come with the (lagging) heartbeats.
        """
        by_prefill = self.routing != "least-requests"
        best, best_key = None, None
        # One pass, the first of equals (as min() would): it runs for every request, over a
        # hundred workers in a simulated cluster. The first key alone settles most pairs.
        for w in self.workers.values():
            if w.role != role or not w.is_ready:
                continue
            first = w.num_prefill_tokens if by_prefill else 0
            if best is not None and first > best_key[0]:
                continue
            key = (first, len(w.request_ids), -w.load.num_free_blocks)
            if best is None or key < best_key:
                best, best_key = w, key
        return best
