"""The router's index of which worker (and which tier) holds which KV prefix blocks, fed by the
KV events workers publish, and the ``prefix-aware`` routing policy's score.

Blocks are named by their chained hashes (``engine/block_pool.py``, ``hash_block``): a block's
hash covers every token before it, so a prompt's cached prefix is the leading run of its hashes
that some tier holds, and a block after the first miss is of no use.

Tiers (``engine/reload_rule.py``, ``TIERS``): ``pool`` is a worker's own page pool; ``host``
and ``disk`` belong to a node and every worker on it reads them. Plain Python: the simulator
makes millions of routing decisions with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from epdserve.engine.reload_rule import LOAD_TIERS, TIERS, PrefixCost, max_cached_blocks

__all__ = ["KV_EVENT_KINDS", "NO_LOADS", "NO_MATCH", "TIERS", "Candidate", "LoadBlocks", "PrefixCost",
           "PrefixIndex", "PrefixMatch", "Score", "choose", "score"]

KV_EVENT_KINDS = ("stored", "removed", "cleared")


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What of a prompt one worker could take without computing, in prompt order::

        blocks  | pool ... | host ... | disk ... | (first block it cannot get) ...
    """

    num_pool_blocks: int  # leading blocks in the worker's own pool
    num_host_blocks: int  # the following blocks in its node's host tier
    num_disk_blocks: int  # then the following ones on its node's disk tier

    @property
    def num_blocks(self) -> int:
        return self.num_pool_blocks + self.num_host_blocks + self.num_disk_blocks


NO_MATCH = PrefixMatch(0, 0, 0)


class PrefixIndex:
    """Which blocks each worker's pool and each node's host and disk tiers hold, as the router
    believes from KV events (a belief: events lag, and a load checks what it reads).

    Invariants: every known worker has one pool set and shares its node's host and disk sets
    (the same set objects) with the other workers of its node; a node's tiers live while it
    has a worker. Host and disk events from any worker of a node act on the node's one tier.
    A worker registered with no node (``""``) shares its tiers with no other worker.
    """

    def __init__(self) -> None:
        # worker id -> (pool, host, disk) hash sets: one dict lookup per match.
        self._tiers_of: dict[str, tuple[set[bytes], set[bytes], set[bytes]]] = {}
        self._node_of: dict[str, str] = {}  # worker id -> node key
        self._worker_ids_of: dict[str, set[str]] = {}  # node key -> worker ids on it
        self._node_tiers: dict[str, tuple[set[bytes], set[bytes]]] = {}  # node key -> (host, disk)

    def add_worker(self, worker_id: str, node: str) -> None:
        """A worker registered on ``node``. A worker registering again (a restarted process)
        starts with an empty pool; its node's tiers are kept."""
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        node_key = node if node else "\0" + worker_id  # no node: a node of its own
        if self._node_of.get(worker_id, node_key) != node_key:
            self.remove_worker(worker_id)  # moved to another node
        self._node_of[worker_id] = node_key
        self._worker_ids_of.setdefault(node_key, set()).add(worker_id)
        host, disk = self._node_tiers.setdefault(node_key, (set(), set()))
        self._tiers_of[worker_id] = (set(), host, disk)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker's pool; its node's tiers stay while another worker of the node
        remains. Unknown worker: nothing to do."""
        node_key = self._node_of.pop(worker_id, None)
        if node_key is None:
            return
        del self._tiers_of[worker_id]
        worker_ids = self._worker_ids_of[node_key]
        worker_ids.discard(worker_id)
        if not worker_ids:
            del self._worker_ids_of[node_key]
            del self._node_tiers[node_key]

    def is_known(self, worker_id: str) -> bool:
        return worker_id in self._tiers_of

    def apply(self, worker_id: str, kind: str, tier: str, block_hashes: Iterable[bytes]) -> None:
        """One KV event from ``worker_id``: blocks ``stored`` in or ``removed`` from ``tier``, or
        the whole tier ``cleared`` (``block_hashes`` ignored). An unknown worker's events are
        dropped (it has not registered yet, or has gone)."""
        tier_id = _tier_id(tier)
        if kind not in KV_EVENT_KINDS:
            raise ValueError(f"unknown KV event kind {kind!r} (kinds: {', '.join(KV_EVENT_KINDS)})")
        tiers = self._tiers_of.get(worker_id)
        if tiers is None:
            return
        blocks = tiers[tier_id]
        if kind == "stored":
            blocks.update(block_hashes)
        elif kind == "removed":
            blocks.difference_update(block_hashes)
        else:
            blocks.clear()

    def match(self, worker_id: str, block_hashes: Sequence[bytes],
              max_blocks: int | None = None) -> PrefixMatch:
        """How many of the leading ``block_hashes`` (a prompt's chained hashes, in order; at
        most ``max_blocks``) the worker could get without computing, per tier.

        Each block comes from the fastest tier that holds it, and the walk only moves down
        (pool run, then host run, then disk run): it ends at the first block that neither the
        current tier nor a lower one holds. A block held only by a tier above the current one
        ends it too (the engine takes pool blocks before its first pool miss only); that can
        under-count what a worker could get, never over-count it. Unknown worker: no match.
        """
        tiers = self._tiers_of.get(worker_id)
        if tiers is None:
            return NO_MATCH
        pool, host, disk = tiers
        n = len(block_hashes)
        if max_blocks is not None and max_blocks < n:
            n = max_blocks
        i = 0
        while i < n and block_hashes[i] in pool:
            i += 1
        end_pool = i
        while i < n and block_hashes[i] in host:
            i += 1
        end_host = i
        while i < n and block_hashes[i] in disk:
            i += 1
        if i == 0:
            return NO_MATCH
        return PrefixMatch(end_pool, end_host - end_pool, i - end_host)

    def num_blocks(self, worker_id: str, tier: str) -> int:
        """How many blocks the index believes ``worker_id`` can read in ``tier`` (its pool, or
        its node's host or disk tier); 0 for an unknown worker."""
        tier_id = _tier_id(tier)
        tiers = self._tiers_of.get(worker_id)
        return 0 if tiers is None else len(tiers[tier_id])


_TIER_IDS = {tier: i for i, tier in enumerate(TIERS)}


def _tier_id(tier: str) -> int:
    tier_id = _TIER_IDS.get(tier)
    if tier_id is None:
        raise ValueError(f"unknown tier {tier!r} (tiers: {', '.join(TIERS)})")
    return tier_id


# -- the prefix-aware policy ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    worker_id: str
    queued_prefill_s: float  # seconds of prefill queued ahead on that worker (the caller's estimate)

    def __post_init__(self) -> None:
        if not 0.0 <= self.queued_prefill_s < float("inf"):
            raise ValueError(f"queued_prefill_s must be finite and >= 0, got {self.queued_prefill_s!r}")


class LoadBlocks(NamedTuple):
    """Blocks the reload rule chose to load, per tier in ``LOAD_TIERS`` order."""

    host: int
    disk: int


NO_LOADS = LoadBlocks(0, 0)
assert LoadBlocks._fields == LOAD_TIERS


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate's predicted time to first token for a prompt. Tokens add up::

        num_prompt_tokens = (match.num_pool_blocks + sum(num_load_blocks)) * block_size + num_compute_tokens
    """

    worker_id: str
    predicted_ttft_s: float  # queued prefill ahead + loads + compute of the rest
    match: PrefixMatch  # what the worker could take from cache (at most all but the last token)
    num_load_blocks: LoadBlocks
    num_compute_tokens: int  # from the first block neither in the pool nor loaded to the prompt's end


def score(index: PrefixIndex, candidate: Candidate, block_hashes: Sequence[bytes], num_prompt_tokens: int,
          cost: PrefixCost) -> Score:
    """Predicted TTFT of a prompt (``num_prompt_tokens`` tokens, ``block_hashes`` its full
    blocks' chained hashes) on ``candidate``::

        queued prefill ahead
          + for the host run, then the disk run, after the pool blocks: its load time when the
            reload rule (``PrefixCost.should_load``) loads it; at the first run it does not,
            stop (the engine computes one range, from its first missing token to the end)
          + compute of the rest, after the tokens in cache
    """
    if num_prompt_tokens < 1:
        raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
    block_size = cost.block_size
    match = index.match(candidate.worker_id, block_hashes, max_cached_blocks(num_prompt_tokens, block_size))
    num_cached = match.num_pool_blocks * block_size
    num_host_loaded, num_disk_loaded, load_s = cost.plan_loads(num_cached, match.num_host_blocks,
                                                               match.num_disk_blocks)
    ttft_s = candidate.queued_prefill_s + load_s
    num_cached += (num_host_loaded + num_disk_loaded) * block_size
    loads = LoadBlocks(num_host_loaded, num_disk_loaded) if num_host_loaded or num_disk_loaded else NO_LOADS
    num_compute = num_prompt_tokens - num_cached
    ttft_s += cost.prefill_s(num_compute, num_cached)
    return Score(candidate.worker_id, ttft_s, match, loads, num_compute)


def choose(scores: Sequence[Score], ttft_slo_s: float | None = None) -> Score | None:
    """The candidate to route to.

    With a TTFT SLO (``ttft_slo_s``) that some candidates are predicted to meet (predicted
    TTFT <= SLO): among those, the one that computes the fewest prompt tokens, then the
    smallest predicted TTFT. The request's slack goes to cache affinity: a worker holding the
    prefix takes it while its queue still lets it meet the SLO, and the tokens it need not
    compute stay free for other requests. Otherwise (no SLO, or none meets it): the smallest
    predicted TTFT. Ties go to the first (the caller lists candidates least loaded first).
    None for no scores.
    """
    if ttft_slo_s is not None and not ttft_slo_s >= 0:
        raise ValueError(f"ttft_slo_s must be >= 0, got {ttft_slo_s!r}")
    fastest = best = None
    for s in scores:
        if fastest is None or s.predicted_ttft_s < fastest.predicted_ttft_s:
            fastest = s
        if ttft_slo_s is not None and s.predicted_ttft_s <= ttft_slo_s and (
                best is None or (s.num_compute_tokens, s.predicted_ttft_s)
                < (best.num_compute_tokens, best.predicted_ttft_s)):
            best = s
    return best if best is not None else fastest
