"""An engine's page pool over the tiered KV store (``kv_store.py``): blocks written down when
their request frees them, and loaded back at admission when the reload rule says loading
beats recomputing (``reload_rule.py``).

Write-down: when a request frees its blocks, each full block the prefix cache names (and the
store lacks) is queued for the store's top tier. The block keeps a reference until the write
has finished, so the pool cannot hand it out while the store's writer thread gathers its pages
(every layer's K and V of the block, one blob); the step never waits for a write. The store
demotes what the host tier evicts to disk; ``poll`` each step frees the written blocks.

Load: at admission the scheduler asks ``plan_load`` about the blocks after its pool hit. The
store names the tier of each of the following blocks (a host run, then a disk run); the rule
decides per run from the tier's bandwidth and latency (measured when the store opens) against
the prefill time of those tokens (measured by the engine, ``PrefillRate``). The blocks chosen
are read and checked at once, straight into one buffer (a miss or a corrupt block ends the load
there: the rest is computed), and written into the request's new pages, layer by layer (one
indexed copy per layer for every block a step loads), before the step's forward pass
(``apply``). A loaded block joins the prefix cache like a computed one.

The pages are one tensor per layer, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(``runner.kv_cache_shapes``); a block's blob is ``[num_layers, 2, block_size, num_kv_heads,
head_dim]`` of the KV dtype's bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from epdserve.config import TierOptions, default_disk_dir, default_host_dir
from epdserve.engine.block_pool import BlockPool
from epdserve.engine.kv_store import FORMAT_VERSION, FileTier, StoreEvent, TieredStore, measure_tier_bandwidth
from epdserve.engine.reload_rule import PRIOR_PREFILL_S_PER_TOKEN, PrefillRate, PrefixCost
from epdserve.errors import ConfigError
from epdserve.request import TierLoad

log = logging.getLogger("epdserve.engine")

GIB = 2**30


def layout_key(model_name: str, dtype: torch.dtype, shape: Sequence[int]) -> str:
    """The directory under a tier's root for one model and KV layout: only engines whose blocks
    mean the same bytes share blocks (the block hash names tokens, not the model)."""
    text = f"{model_name}|{dtype}|{tuple(shape)}|v{FORMAT_VERSION}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def tier_root(options: TierOptions, tier: str) -> Path:
    """Where ``tier``'s medium is: the flag's directory, else the default one."""
    if tier == "host":
        return Path(options.host_dir or default_host_dir())
    return Path(options.disk_dir or default_disk_dir())


def tier_cost(options: TierOptions, tier: FileTier) -> tuple[float, float]:
    """(read bytes per second, seconds per load) of ``tier`` for the reload rule: the flag's
    bandwidth when given, else measured on its medium (``measure_tier_bandwidth``)."""
    gbps = options.read_gbps(tier.name)
    return (gbps * 1e9, 0.0) if gbps is not None else measure_tier_bandwidth(tier, num_blocks=8)


def probe_tiers(options: TierOptions, block_bytes: int, num_blocks: int = 32) -> dict[str, dict]:
    """``epdserve profile``: read bandwidth and latency of each tier's medium for blocks of
    ``block_bytes`` (whether or not a size is given for it), measured in a scratch tier that
    is removed after; a tier whose directory cannot be used is left out with the reason."""
    out: dict[str, dict] = {}
    for name in ("host", "disk"):
        root = tier_root(options, name) / f"probe-{os.getpid()}"
        try:
            tier = FileTier(name, root, num_blocks + 8, block_bytes)
        except OSError as e:
            out[name] = {"error": f"{root}: {e.strerror or e}"}
            continue
        try:
            bytes_per_s, latency_s = measure_tier_bandwidth(tier, num_blocks)
        finally:
            tier.remove_root()
        out[name] = {"bytes_per_s": bytes_per_s, "latency_s": latency_s, "dir": str(root.parent)}
    return out


@dataclass
class PrefixLoad:
    """Blocks the scheduler takes from the store for one request (``plan_load``), with the
    reload rule's inputs and choice."""

    data: torch.Tensor  # [blocks, block_bytes] uint8: the blocks read and checked, in prompt order
    num_host_blocks: int  # of them from the host tier (they come first)
    num_disk_blocks: int
    num_found_blocks: int  # blocks the store had after the pool hit (loaded or not)
    num_chosen_blocks: int  # of them, those the rule chose to load (read back: num_blocks)
    predicted_load_s: float  # the rule's load time of what it chose
    predicted_compute_s: float  # the rule's prefill time of every found block's tokens
    read_s: float  # measured: reading and checking the blobs
    block_ids: list[int] = field(default_factory=list)  # the pages they go to (set at allocation)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def info(self, block_size: int) -> TierLoad:
        return TierLoad(self.num_found_blocks * block_size, self.num_chosen_blocks * block_size,
                        self.num_host_blocks * block_size,
                        self.num_disk_blocks * block_size, self.predicted_load_s, self.predicted_compute_s, self.read_s)


class KVOffload:
    """The store below one engine's pool (a single full-attention KV group: models with
    sliding windows keep no prefix cache, see ``KVCacheGroupSpec.is_prefix_cacheable``)."""

    def __init__(self, store: TieredStore, kv_caches: Sequence[torch.Tensor], pool: BlockPool, block_size: int,
                 prefill_rate: PrefillRate, tier_costs: dict[str, tuple[float, float]]) -> None:
        self.store = store
        self.kv_caches = list(kv_caches)
        self.pool = pool
        self.block_size = block_size
        self.prefill_rate = prefill_rate
        # tier -> (read bytes per second, seconds per load), as measured at open
        self.tier_costs = dict(tier_costs)
        first = self.kv_caches[0]
        self.block_shape = (len(self.kv_caches), 2, *first.shape[2:])
        self.dtype = first.dtype
        self.block_bytes = store.block_bytes
        self._pinned: dict[bytes, int] = {}  # key -> block whose write is in flight
        self._cost: PrefixCost | None = None
        self.num_loaded_blocks = {"host": 0, "disk": 0}
        self.num_load_failures = 0  # blocks the store named but could not give back intact

    @classmethod
    def open(cls, options: TierOptions, model_name: str, kv_caches: Sequence[torch.Tensor], pool: BlockPool,
             block_size: int, prefill_rate: PrefillRate) -> KVOffload:
        first = kv_caches[0]
        block_shape = (len(kv_caches), 2, *first.shape[2:])
        block_bytes = first.element_size() * int(torch.Size(block_shape).numel())
        key = layout_key(model_name, first.dtype, block_shape)
        tiers: dict[str, FileTier | None] = {"host": None, "disk": None}
        for name, gib, root in (("host", options.host_gib, options.host_dir or default_host_dir()),
                                ("disk", options.disk_gib, options.disk_dir or default_disk_dir())):
            if gib > 0:
                capacity = int(gib * GIB) // block_bytes
                if capacity < 1:
                    raise ConfigError(f"a {gib:g} GiB {name} tier holds no {block_bytes}-byte KV block")
                tiers[name] = FileTier(name, Path(root) / key, capacity, block_bytes)
        costs = {}
        for name, tier in tiers.items():
            if tier is None:
                continue
            costs[name] = tier_cost(options, tier)
            log.info("KV %s tier at %s: %d blocks, %.2f GB/s, %.0f us per load", name, tier.root,
                     tier.capacity_blocks, costs[name][0] / 1e9, costs[name][1] * 1e6)
        store = TieredStore(tiers["host"], tiers["disk"])
        return cls(store, kv_caches, pool, block_size, prefill_rate, costs)

    # -- the reload rule's costs ---------------------------------------------------------
    @property
    def cost(self) -> PrefixCost:
        per_token_s = self.prefill_rate.per_token_s or PRIOR_PREFILL_S_PER_TOKEN
        cost = self._cost
        if cost is None or cost.per_prefill_token_s != per_token_s:
            cost = PrefixCost(per_token_s, 0.0, {t: c[0] for t, c in self.tier_costs.items()},
                              {t: c[1] for t, c in self.tier_costs.items()}, self.block_bytes, self.block_size)
            self._cost = cost
        return cost

    # -- write-down ----------------------------------------------------------------------
    def on_free(self, block_ids: Sequence[int], block_hashes: Sequence[bytes]) -> None:
        """A request is about to drop these blocks of its (cached, full) prefix: queue each
        one the store lacks, holding a reference on it until its write is done.

        Last block first: a tier evicts least recently written first, so a prefix's tail
        leaves before its head (a block is of use only after every block before it), as the
        pool evicts a freed sequence's last blocks first."""
        pool, pinned = self.pool, self._pinned
        for block_id, block_hash in zip(reversed(block_ids), reversed(block_hashes)):
            if block_hash in pinned:
                continue
            if self.store.submit_write(block_hash, lambda b=block_id: self._gather(b)):
                pool.touch([block_id])
                pinned[block_hash] = block_id

    def _gather(self, block_id: int) -> memoryview:
        """The block's blob (the store's writer thread calls this; the block is pinned)."""
        blob = torch.stack([kv[:, block_id] for kv in self.kv_caches]).cpu().contiguous()
        return memoryview(blob.view(torch.uint8).numpy()).cast("B")

    def poll(self) -> None:
        """Free the blocks whose write finished."""
        written = self.store.poll_written()
        if written:
            pinned = self._pinned
            done = [pinned.pop(key) for key in written if key in pinned]
            if done:
                self.pool.free(done)

    def take_events(self) -> list[StoreEvent]:
        return self.store.poll_events()

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    # -- load ----------------------------------------------------------------------------
    def plan_load(self, block_hashes: Sequence[bytes], num_cached_tokens: int) -> PrefixLoad | None:
        """After a pool hit of ``num_cached_tokens`` tokens, the blocks named by
        ``block_hashes`` (the prompt's next full blocks, those the engine may take from cache)
        that the rule loads, read and checked; None when the store has none of them. A load
        with no blobs records a decision to compute (or reads that failed)."""
        if not block_hashes:
            return None
        tiers = self.store.find_prefix(block_hashes)
        if not tiers:
            return None
        num_host = sum(1 for t in tiers if t == "host")
        num_disk = len(tiers) - num_host
        cost = self.cost
        load_host, load_disk, load_s = cost.plan_loads(num_cached_tokens, num_host, num_disk)
        compute_s = cost.prefill_s(len(tiers) * self.block_size, num_cached_tokens)
        start = time.perf_counter()
        num_chosen = load_host + load_disk
        data = torch.empty((num_chosen, self.block_bytes), dtype=torch.uint8)
        rows = data.numpy()
        num_read = 0
        for key, tier in zip(block_hashes, tiers[:num_chosen]):
            if not self.store.load_into(key, tier, memoryview(rows[num_read])):
                self.num_load_failures += 1
                break  # missing or corrupt: computed from here on
            num_read += 1
        num_host_loaded = min(num_read, load_host)
        return PrefixLoad(data[:num_read], num_host_loaded, num_read - num_host_loaded, len(tiers), num_chosen,
                          load_s, compute_s, time.perf_counter() - start)

    def apply(self, loads: Sequence[PrefixLoad]) -> None:
        """Write the loaded blocks into their pages, layer by layer (before the forward pass)."""
        block_ids: list[int] = []
        parts: list[torch.Tensor] = []
        for load in loads:
            assert len(load.block_ids) == load.num_blocks, "a load's pages were not allocated"
            if load.num_blocks:
                block_ids += load.block_ids
                parts.append(load.data)
            self.num_loaded_blocks["host"] += load.num_host_blocks
            self.num_loaded_blocks["disk"] += load.num_disk_blocks
        if not block_ids:
            return
        device = self.kv_caches[0].device
        data = parts[0] if len(parts) == 1 else torch.cat(parts)
        # [blocks, layers, 2, block_size, heads, dim]
        src = data.view(self.dtype).view(len(block_ids), *self.block_shape).to(device)
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        for layer, kv in enumerate(self.kv_caches):
            # [2, blocks, block_size, heads, dim], contiguous for the indexed copy
            kv.index_copy_(1, index, src[:, layer].transpose(0, 1).contiguous())

    def close(self) -> None:
        self.store.close()
