"""KV cache bookkeeping: typed groups, paged block pools, prefix cache.

Plain Python (ints and lists, no torch): the simulator drives this same code.

A model's layers fall into groups by attention kind; each group has its own spec and its own
block pool, and a request holds one block table per group. Block ids are per group. Block 0
of every pool is the null block: it is never allocated and stands in a block table for
blocks that a sliding-window group has already released.

Token ranges of one request in one group (block size 4, sliding window 6)::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    full       [blk 7 ] [blk 3  ] [blk 9  ]
    sliding    [null  ] [blk 2  ] [blk 5  ]   next query at 10 needs positions 5..10

Prefix caching: a full block is named by a chained hash of its tokens and its parent's hash.
Cached blocks whose reference count drops to zero stay in the free queue, evicted in LRU
order when a new block is needed. Prefix reuse needs every group's state for the prefix,
so it is disabled for models with a group that cannot be rebuilt from a prefix (sliding
window or recurrent state).
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import random

NULL_BLOCK = 0


@dataclass(frozen=True)
class KVCacheGroupSpec:
    group_id: int
    kind: str  # "full" | "sliding"
    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # tokens; a query at p sees p-W+1 .. p

    @property
    def is_prefix_cacheable(self) -> bool:
        return self.kind == "full"

    def bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """K and V of every layer of the group for one block."""
        per_layer = 2 * block_size * self.num_kv_heads * self.head_dim * dtype_bytes
        return per_layer * len(self.layer_ids)


def make_group_specs(
    sliding_windows: tuple[int | None, ...], num_kv_heads: int, head_dim: int
) -> list[KVCacheGroupSpec]:
    """Group layers by attention kind: full attention first, then one group per window."""
    windows = sorted({w for w in sliding_windows if w is not None})
    kinds: list[int | None] = ([None] if None in sliding_windows else []) + windows
    specs = []
    for group_id, window in enumerate(kinds):
        layer_ids = tuple(i for i, w in enumerate(sliding_windows) if w == window)
        kind = "full" if window is None else "sliding"
        specs.append(KVCacheGroupSpec(group_id, kind, layer_ids, num_kv_heads, head_dim, window))
    return specs


# struct packers for the usual block sizes: the same bytes as array("q", ids).tobytes(),
# about 20 % faster per block (prefix hashing is a large part of a simulated step)
_TOKEN_PACKERS = {n: struct.Struct(f"{n}q").pack for n in (1, 2, 4, 8, 16, 32, 64, 128)}


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """A block's prefix-cache key: blake2b-128 of the parent block's key, the token ids as
    native int64 and ``extra``."""
    pack = _TOKEN_PACKERS.get(len(token_ids))
    tokens = pack(*token_ids) if pack is not None else array("q", token_ids).tobytes()
    return hashlib.blake2b((parent or b"root") + tokens + extra, digest_size=16).digest()


RUN_AGE_WINDOW = 64  # BlockPool: how far past the oldest cached free block a run may reach (blocks)


class BlockPool:
    """One group's blocks: reference counts, free queue, hash -> cached block.

    Free blocks wait in two queues: blocks without a hash (handed out first, most recently
    freed first) and cached blocks (handed out least recently freed first, so the prefix cache
    keeps what was used last)."""

    def __init__(self, num_blocks: int, enable_caching: bool, keep_runs: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.keep_runs = keep_runs
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Block 0 is the null block, never free.
        self._plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._freed_at = [0] * num_blocks  # when a cached block joined its queue (a count of frees)
        self._clock = 0

    @property
    def free_queue(self) -> list[int]:
        """The free blocks in the order they would be handed out without runs."""
        return [*self._plain, *self._cached_free]

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, num_blocks: int, after: int | None = None) -> list[int]:
        """``num_blocks`` free blocks, each with one reference.

        With ``keep_runs``, in runs of consecutive ids where the free queues allow: first the
        blocks right after ``after`` (the end of the table being grown), then, around the
        block the queues hand out next, the free blocks next to it. Decode attention reads a
        sequence's pages in table order and runs markedly faster over consecutive pages than
        over scattered ones (``benchmarks/scattered_pages.py``); handed out one by one in queue
        order, the pages of requests that come and go end up scattered. A cached block joins a
        run only while it is among the oldest cached free blocks (``_run_age_limit``), so the
        prefix cache still evicts least recently used first, to within that window.
        """
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        if not self.keep_runs:
            block_ids = [self._pop_next() for _ in range(num_blocks)]
        else:
            block_ids = []
            limit = self._run_age_limit()
            if after is not None:
                block_id = after + 1
                while len(block_ids) < num_blocks and self._take(block_id, limit):
                    block_ids.append(block_id)
                    block_id += 1
            while len(block_ids) < num_blocks:
                low = high = self._pop_next()
                while len(block_ids) + high - low + 1 < num_blocks and self._take(low - 1, limit):
                    low -= 1
                while len(block_ids) + high - low + 1 < num_blocks and self._take(high + 1, limit):
                    high += 1
                block_ids.extend(range(low, high + 1))
        ref_counts = self.ref_counts
        for block_id in block_ids:
            self._evict(block_id)
            ref_counts[block_id] = 1
        return block_ids

    def _pop_next(self) -> int:
        return (self._plain if self._plain else self._cached_free).popitem(last=False)[0]

    def _take(self, block_id: int, limit: int) -> bool:
        """Take a free block out of its queue for a run: any block without a hash, a cached one
        only if it joined the queue no later than ``limit``."""
        if block_id in self._plain:
            del self._plain[block_id]
            return True
        if block_id in self._cached_free and self._freed_at[block_id] <= limit:
            del self._cached_free[block_id]
            return True
        return False

    def _run_age_limit(self) -> int:
        """The latest queue time a cached block taken into a run may have: the oldest cached
        free block's plus a quarter of the free blocks (at least RUN_AGE_WINDOW)."""
        if not self._cached_free:
            return -1
        oldest = next(iter(self._cached_free))
        return self._freed_at[oldest] + max(RUN_AGE_WINDOW, self.num_free_blocks // 4)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                (self._cached_free if block_id in self._cached_free else self._plain).pop(block_id)
            self.ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; the last blocks of a sequence are evicted first."""
        ref_counts, block_hashes, plain, cached_free = self.ref_counts, self.block_hashes, self._plain, self._cached_free
        for block_id in reversed(block_ids):
            if block_id == NULL_BLOCK:
                continue
            count = ref_counts[block_id] - 1
            assert count >= 0, f"block {block_id} freed twice"
            ref_counts[block_id] = count
            if count == 0:
                if block_hashes[block_id] is None:
                    plain[block_id] = None
                    plain.move_to_end(block_id, last=False)
                else:
                    cached_free[block_id] = None
                    self._freed_at[block_id] = self._clock
                    self._clock += 1

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self.cached:
            return  # the same content already lives in another block
        self.block_hashes[block_id] = block_hash
        self.cached[block_hash] = block_id

    def count_evictable(self, block_ids: list[int]) -> int:
        """How many of these (hit) blocks currently sit in the free queue."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def reorder_free(self, rng: random.Random | None) -> None:
        """Each free queue in block-id order (as in a fresh pool: a request's blocks come in
        one contiguous run), or shuffled by ``rng`` (as after requests have come and gone
        without runs)."""
        for name in ("_plain", "_cached_free"):
            block_ids = list(getattr(self, name))
            if rng is None:
                block_ids.sort()
            else:
                rng.shuffle(block_ids)
            setattr(self, name, OrderedDict((b, None) for b in block_ids))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds (they join the uncached free blocks)."""
        for block_id in self._cached_free:
            self._evict(block_id)
            self._plain[block_id] = None
        self._cached_free.clear()

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None


def _last_block(table: list[int]) -> int | None:
    """Where a growing table's next run should start after (None: empty, or out of window)."""
    return table[-1] if table and table[-1] != NULL_BLOCK else None


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per group

    @classmethod
    def empty(cls, num_groups: int) -> PrefixHit:
        return cls(0, tuple(() for _ in range(num_groups)))


@dataclass
class _RequestBlocks:
    tables: list[list[int]]  # per group
    hashes: list[bytes]  # chained hashes of this request's full blocks, in order
    num_cached_blocks: int = 0  # leading full blocks already registered in the prefix cache


class KVCacheManager:
    def __init__(
        self,
        groups: list[KVCacheGroupSpec],
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        keep_runs: bool = True,
    ) -> None:
        """``keep_runs``: hand out blocks in runs of consecutive ids (``BlockPool.allocate``)."""
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching and all(
            g.is_prefix_cacheable for g in groups
        )
        self.pools = [BlockPool(num_blocks, self.enable_prefix_caching, keep_runs) for _ in groups]
        self._has_windows = any(g.sliding_window is not None for g in groups)
        self._requests: dict[str, _RequestBlocks] = {}
        # Block hashes computed by find_cached_prefix for a request that holds no blocks yet;
        # its first allocate takes them over (a prompt is hashed once, not per lookup).
        self._pending_hashes: dict[str, list[bytes]] = {}

    # -- queries -------------------------------------------------------------------------
    def block_tables(self, request_id: str) -> list[list[int]]:
        return self._requests[request_id].tables

    def num_free_blocks(self) -> int:
        """Free blocks of the scarcest group."""
        return min(pool.num_free_blocks for pool in self.pools)

    def num_used_blocks(self) -> int:
        return max(pool.num_used_blocks for pool in self.pools)

    def usage(self) -> float:
        return self.num_used_blocks() / (self.num_blocks - 1)

    def is_all_free(self) -> bool:
        """No request holds a block and every reference count is zero (a leak check)."""
        return not self._requests and all(
            pool.num_free_blocks == pool.num_blocks - 1 and not any(pool.ref_counts)
            for pool in self.pools
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """Longest cached prefix of whole blocks, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return PrefixHit.empty(len(self.groups))
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = self._full_block_hashes(request_id, token_ids, max_blocks)
        per_group: list[list[int]] = [[] for _ in self.groups]
        for block_hash in hashes[:max_blocks]:
            hits = [pool.lookup(block_hash) for pool in self.pools]
            if any(h is None for h in hits):
                break
            for group_blocks, block_id in zip(per_group, hits):
                group_blocks.append(block_id)
        num_blocks = len(per_group[0])
        return PrefixHit(num_blocks * self.block_size, tuple(tuple(b) for b in per_group))

    def _full_block_hashes(self, request_id: str, token_ids: list[int], num_blocks: int) -> list[bytes]:
        entry = self._requests.get(request_id)
        hashes = entry.hashes if entry else self._pending_hashes.setdefault(request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def block_hashes(self, request_id: str) -> list[bytes]:
        """The chained hashes of the request's full blocks computed so far (a copy)."""
        entry = self._requests.get(request_id)
        return list(entry.hashes if entry else self._pending_hashes.get(request_id, ()))

    def adopt_block_hashes(self, request_id: str, hashes: list[bytes]) -> None:
        """Take over hashes another manager computed for the same leading tokens of this
        request (a prefilled request's prompt), so they are not computed again here."""
        entry = self._requests.get(request_id)
        known = entry.hashes if entry else self._pending_hashes.setdefault(request_id, [])
        if len(hashes) > len(known):
            known[len(known):] = hashes[len(known):]

    def has_uncached_full_blocks(self, request_id: str, num_computed: int) -> bool:
        """Whether ``cache_computed_blocks`` would register a block (a cheap test that spares
        building the token list on the steps that fill no block)."""
        return (self.enable_prefix_caching
                and num_computed // self.block_size > self._requests[request_id].num_cached_blocks)

    def cache_computed_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.has_uncached_full_blocks(request_id, num_computed):
            return
        entry = self._requests[request_id]
        num_full = num_computed // self.block_size
        hashes = self._full_block_hashes(request_id, token_ids, num_full)
        for group_id, pool in enumerate(self.pools):
            table = entry.tables[group_id]
            for i in range(entry.num_cached_blocks, num_full):
                pool.cache_block(table[i], hashes[i])
        entry.num_cached_blocks = num_full

    # -- allocation ----------------------------------------------------------------------
    def can_allocate(
        self, request_id: str, num_computed: int, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        return all(
            need <= pool.num_free_blocks
            for need, pool in zip(self._blocks_needed(request_id, num_computed, num_new_tokens, hit), self.pools)
        )

    def allocate(
        self, request_id: str, num_computed: int, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> bool:
        """Make room for tokens num_computed .. num_computed+num_new_tokens-1.

        ``num_computed`` counts tokens already in the cache, including a prefix hit being
        applied now. Returns False and changes nothing when a pool is short of blocks.
        """
        if hit is None and not self._has_windows:
            fast = self._grow(request_id, num_computed + num_new_tokens)
            if fast is not None:
                return fast
        if not self.can_allocate(request_id, num_computed, num_new_tokens, hit):
            return False
        entry = self._requests.get(request_id)
        if entry is None:
            entry = _RequestBlocks([[] for _ in self.groups], self._pending_hashes.pop(request_id, []))
            self._requests[request_id] = entry
        for group_id, pool in enumerate(self.pools):
            table = entry.tables[group_id]
            if hit is not None and hit.block_ids[group_id]:
                pool.touch(list(hit.block_ids[group_id]))
                table.extend(hit.block_ids[group_id])
            self._release_out_of_window(group_id, table, num_computed)
            num_missing = self.num_blocks_for(num_computed + num_new_tokens) - len(table)
            if num_missing > 0:
                table.extend(pool.allocate(num_missing, _last_block(table)))
        if hit is not None and hit.num_tokens:
            entry.num_cached_blocks = max(entry.num_cached_blocks, hit.num_tokens // self.block_size)
        return True

    def _grow(self, request_id: str, num_tokens: int) -> bool | None:
        """``allocate`` for a request that holds blocks, without a prefix hit or a sliding
        window (every decode step): its table only ever grows at the end. Without sliding
        windows there is one group (``make_group_specs``). None: not such a request, take the
        general path."""
        entry = self._requests.get(request_id)
        if entry is None or len(entry.tables) != 1:
            return None
        table, pool = entry.tables[0], self.pools[0]
        missing = -(-num_tokens // self.block_size) - len(table)
        if missing <= 0:
            return True
        if missing > pool.num_free_blocks:
            return False
        table.extend(pool.allocate(missing, _last_block(table)))
        return True

    def _blocks_needed(
        self, request_id: str, num_computed: int, num_new_tokens: int, hit: PrefixHit | None
    ) -> list[int]:
        """Blocks each pool must hand out, net of blocks leaving a sliding window."""
        entry = self._requests.get(request_id)
        total = self.num_blocks_for(num_computed + num_new_tokens)
        needs = []
        for group_id, pool in enumerate(self.pools):
            hit_blocks = list(hit.block_ids[group_id]) if hit is not None else []
            table = (entry.tables[group_id] if entry else []) + hit_blocks
            num_dead = min(self._num_out_of_window(group_id, num_computed), len(table))
            num_released = sum(1 for b in table[:num_dead] if b != NULL_BLOCK)
            num_missing = max(0, total - len(table))
            needs.append(num_missing + pool.count_evictable(hit_blocks) - num_released)
        return needs

    def _num_out_of_window(self, group_id: int, num_computed: int) -> int:
        """Leading blocks no query at position >= num_computed can see."""
        window = self.groups[group_id].sliding_window
        if window is None:
            return 0
        first_visible = max(0, num_computed - window + 1)
        return first_visible // self.block_size

    def _release_out_of_window(self, group_id: int, table: list[int], num_computed: int) -> None:
        num_dead = min(self._num_out_of_window(group_id, num_computed), len(table))
        dead = [b for b in table[:num_dead] if b != NULL_BLOCK]
        if dead:
            self.pools[group_id].free(dead)
            table[:num_dead] = [NULL_BLOCK] * num_dead

    def free(self, request_id: str) -> None:
        self._pending_hashes.pop(request_id, None)
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        for pool, table in zip(self.pools, entry.tables):
            pool.free(table)

    def reorder_free_blocks(self, rng: random.Random | None) -> None:
        """Every pool's free blocks in id order (None) or shuffled (``BlockPool.reorder_free``);
        where a request's pages lie changes how fast the attention kernels read them."""
        for pool in self.pools:
            pool.reorder_free(rng)

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
