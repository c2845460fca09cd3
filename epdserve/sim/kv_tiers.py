"""The KV tiers below a simulated instance's pool: which blocks a node's host and disk tiers
hold, and the reload rule deciding what a request loads from them.

A node's ``SimStore`` is the model of ``engine/kv_store.py``'s ``TieredStore`` that the
instances on one host share: block hashes per tier, capacity in blocks, least recently
written evicted first, host evictions demoted to disk, stored / removed events for the
router's prefix index. Writes land at once (the real writer thread works off the step's
path). ``SimLoader`` is an instance's ``Scheduler.prefix_loader``, as ``KVOffload`` is a
worker's: the same walk (``kv_store.find_prefix``) and the same rule
(``reload_rule.PrefixCost.plan_loads``), with the profile's prefill terms and the profile's
measured tier bandwidths; the load's time is added to the step that admits the request, as
the engine reads before its forward pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from epdserve.engine.kv_store import find_prefix
from epdserve.engine.reload_rule import PrefixCost
from epdserve.request import TierLoad


class SimTier:
    """One tier: block hashes, oldest write first; at most ``capacity_blocks``."""

    __slots__ = ("blocks", "capacity_blocks", "name")

    def __init__(self, name: str, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"{name} tier: capacity must be >= 1 block, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def contains(self, key: bytes) -> bool:
        return key in self.blocks

    def put(self, key: bytes) -> list[bytes]:
        """Store ``key`` (present: its write time is refreshed); returns the evicted keys."""
        blocks = self.blocks
        if key in blocks:
            blocks.move_to_end(key)
            return []
        blocks[key] = None
        evicted = []
        while len(blocks) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted


class SimStore:
    """A node's host and disk tiers (either may be absent, not both)."""

    def __init__(self, host_blocks: int, disk_blocks: int, record_events: bool = True) -> None:
        """``record_events``: keep stored / removed events for ``take_events`` (the router's
        prefix index reads them; without prefix-aware routing nobody does)."""
        self.record_events = record_events
        self.host = SimTier("host", host_blocks) if host_blocks > 0 else None
        self.disk = SimTier("disk", disk_blocks) if disk_blocks > 0 else None
        self.tiers = tuple(t for t in (self.host, self.disk) if t is not None)  # top first
        if not self.tiers:
            raise ValueError("a KV store needs a host tier, a disk tier or both")
        self.events: list[tuple[str, str, list[bytes]]] = []  # (kind, tier, hashes), oldest first
        self.num_written = 0

    def write(self, keys: Sequence[bytes]) -> None:
        """The blocks a request freed (last first), each the top tier lacks: stored there."""
        top = self.tiers[0]
        stored = [k for k in keys if not top.contains(k)]
        for key in stored:
            self._put(top, key)
        self.num_written += len(stored)

    def _put(self, tier: SimTier, key: bytes) -> None:
        evicted = tier.put(key)
        if self.record_events:
            self.events.append(("stored", tier.name, [key]))
            if evicted:
                self.events.append(("removed", tier.name, evicted))
        if evicted:
            if tier is self.host and self.disk is not None:
                for victim in evicted:  # demoted
                    self._put(self.disk, victim)

    def find_prefix(self, keys: Sequence[bytes]) -> list[str]:
        return find_prefix(self.tiers, keys)

    def take_events(self) -> list[tuple[str, str, list[bytes]]]:
        events, self.events = self.events, []
        return events


@dataclass
class SimLoad:
    """What one admitted request loads (the scheduler's ``PrefixLoad``), and how long it takes."""

    num_blocks: int
    num_host_blocks: int
    num_found_blocks: int
    load_s: float  # the rule's load time of what it chose: what the step pays
    compute_s: float  # the rule's prefill time of every found block's tokens
    block_ids: list[int] = field(default_factory=list)

    def info(self, block_size: int) -> TierLoad:
        return TierLoad(self.num_found_blocks * block_size, self.num_blocks * block_size,
                        self.num_host_blocks * block_size, (self.num_blocks - self.num_host_blocks) * block_size,
                        self.load_s, self.compute_s, self.load_s)


class SimLoader:
    """One instance's prefix loader over its node's ``SimStore``."""

    def __init__(self, store: SimStore, cost: PrefixCost) -> None:
        self.store = store
        self.cost = cost
        self.num_loaded_blocks = {"host": 0, "disk": 0}  # by the steps that admitted the loads (``loaded``)

    def loaded(self, loads: Sequence[SimLoad]) -> float:
        """The loads a step admitted: counted; returns the seconds they add to the step."""
        seconds = 0.0
        for load in loads:
            self.num_loaded_blocks["host"] += load.num_host_blocks
            self.num_loaded_blocks["disk"] += load.num_blocks - load.num_host_blocks
            seconds += load.load_s
        return seconds

    def on_free(self, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """``KVCacheManager.on_free``: the request's cached full blocks go down, last first."""
        self.store.write(list(reversed(block_hashes)))

    def plan_load(self, block_hashes: Sequence[bytes], num_cached_tokens: int) -> SimLoad | None:
        """``Scheduler.prefix_loader``: as ``KVOffload.plan_load``, without the bytes."""
        if not block_hashes:
            return None
        tiers = self.store.find_prefix(block_hashes)
        if not tiers:
            return None
        num_host = sum(1 for t in tiers if t == "host")
        cost = self.cost
        load_host, load_disk, load_s = cost.plan_loads(num_cached_tokens, num_host, len(tiers) - num_host)
        compute_s = cost.prefill_s(len(tiers) * cost.block_size, num_cached_tokens)
        return SimLoad(load_host + load_disk, load_host, len(tiers), load_s, compute_s)
