"""KV cache bookkeeping: typed groups, per-request block tables, prefix reuse across groups.

Plain Python (ints and lists, no torch): the simulator drives this same code.

A model's layers fall into groups by attention kind; each group has its own spec and its own
block pool (``block_pool.BlockPool``), and a request holds one block table per group. Block ids
are per group. Block 0 of every pool is the null block: it is never allocated and stands in a
block table for blocks that a sliding-window group has already released.

Token ranges of one request in one group (block size 4, sliding window 6)::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .
    full       [blk 7 ] [blk 3  ] [blk 9  ]
    sliding    [null  ] [blk 2  ] [blk 5  ]   next query at 10 needs positions 5..10

A request whose prompt KV another worker writes (a decode worker's reservation) first
queries at the prompt's end, so a sliding group reserves only the blocks in the window there
(``first_query`` of ``allocate``); the leading entries are null blocks from the start, and only
the window's blocks travel (``KVCacheGroupSpec.first_kept_block``).

Prefix caching: a full block is named by a chained hash of its tokens and its parent's hash
(``block_pool.hash_block``); each pool keeps its cached blocks and evicts them in LRU order.
A hit of n blocks counts where every group can rebuild the state for a query at n * block_size
(as vLLM's hybrid allocator): a full group needs all n blocks, a sliding group only the blocks
in the window before that point; the rest of its table is null blocks. A group kind with state
that cannot be rebuilt from cached blocks (recurrent state) switches prefix caching off.

Recurrent state (kind ``"state"``): layers without KV (LFM2's short convolutions) keep a
fixed-size state per request instead of KV per token. Their group has no blocks: a pool of
slots (``block_pool.SlotPool``), one slot per request, taken with the request's first blocks
and kept across chunked-prefill and decode steps until ``free`` (finish, abort, preemption,
failure). The group's "block table" holds just that slot id; the runner's state tensors
(``[num_slots, *state_shape]`` per layer) are indexed by it, so one request's state is one
row per layer, and copying it elsewhere is a copy of those rows by slot id. State groups come
after the paged groups (``make_group_specs``), so ``pools[g]`` is paged group g's pool.

Prefix caching is off for such models: the state at a block boundary is not kept, so a
request cannot resume after a cached attention prefix (``prefix_caching_off_reason``).
A slot is not zeroed here: the forward pass clears it when its request's first chunk runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from epdserve.engine.block_pool import NULL_BLOCK, RUN_AGE_WINDOW, BlockPool, SlotPool, chain_hashes, hash_block
from epdserve.engine.reload_rule import max_cached_blocks

if TYPE_CHECKING:
    import random

# The pool-level names are re-exported from block_pool.
__all__ = ["NULL_BLOCK", "RUN_AGE_WINDOW", "BlockPool", "KVCacheGroupSpec", "KVCacheManager", "PrefixHit",
           "SlotPool", "chain_hashes", "hash_block", "make_group_specs"]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    group_id: int
    kind: str  # "full" | "sliding" | "state"
    layer_ids: tuple[int, ...]
    num_kv_heads: int  # 0 for a state group
    head_dim: int  # 0 for a state group
    sliding_window: int | None = None  # tokens; a query at p sees p-W+1 .. p
    state_shape: tuple[int, ...] = ()  # a state group: one request's state in one layer

    @property
    def is_prefix_cacheable(self) -> bool:
        return self.kind in ("full", "sliding")

    @property
    def is_paged(self) -> bool:
        """KV per token in blocks (full, sliding); False for a state group's per-request slots."""
        return self.kind != "state"

    @property
    def name(self) -> str:
        """``full``, ``sliding<W>`` or ``state``: the group in timings and metrics."""
        if self.kind == "state":
            return "state"
        return "full" if self.sliding_window is None else f"sliding{self.sliding_window}"

    def first_kept_block(self, first_query: int, block_size: int) -> int:
        """The first block a query at position ``first_query`` (or any later one) can see."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query - self.sliding_window + 1) // block_size

    def bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """K and V of every layer of the group for one block (0 for a state group)."""
        if not self.is_paged:
            return 0
        per_layer = 2 * block_size * self.num_kv_heads * self.head_dim * dtype_bytes
        return per_layer * len(self.layer_ids)

    def bytes_per_slot(self, dtype_bytes: int) -> int:
        """One request's state in every layer of a state group (0 for a paged group)."""
        if self.is_paged:
            return 0
        return prod(self.state_shape) * dtype_bytes * len(self.layer_ids)


def make_group_specs(
    sliding_windows: tuple[int | None, ...], num_kv_heads: int, head_dim: int,
    state_shapes: tuple[tuple[int, ...] | None, ...] = (),
) -> list[KVCacheGroupSpec]:
    """Group layers by kind: full attention first, then one group per window, then one state
    group per state shape (``state_shapes[i]``: layer i's per-request state, None for an
    attention layer; empty: every layer attends)."""
    has_state = [bool(state_shapes) and state_shapes[i] is not None for i in range(len(sliding_windows))]
    attending = [w for w, stateful in zip(sliding_windows, has_state) if not stateful]
    windows = sorted({w for w in attending if w is not None})
    kinds: list[int | None] = ([None] if None in attending else []) + windows
    specs = []
    for group_id, window in enumerate(kinds):
        layer_ids = tuple(i for i, w in enumerate(sliding_windows) if w == window and not has_state[i])
        kind = "full" if window is None else "sliding"
        specs.append(KVCacheGroupSpec(group_id, kind, layer_ids, num_kv_heads, head_dim, window))
    shapes = list(dict.fromkeys(tuple(s) for s, stateful in zip(state_shapes, has_state) if stateful))
    for shape in shapes:
        layer_ids = tuple(i for i, stateful in enumerate(has_state) if stateful and tuple(state_shapes[i]) == shape)
        specs.append(KVCacheGroupSpec(len(specs), "state", layer_ids, 0, 0, None, shape))
    return specs


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
        *,
        num_state_slots: int = 0,
    ) -> None:
        """``keep_runs``: hand out blocks in runs of consecutive ids (``BlockPool.allocate``).
        ``num_state_slots``: slots of each state group (requests that can hold state at once)."""
        paged = [g for g in groups if g.is_paged]
        if groups[: len(paged)] != paged or [g.group_id for g in groups] != list(range(len(groups))):
            raise ValueError("KV cache groups are numbered in order, paged groups before state groups")
        if len(paged) < len(groups) and num_state_slots < 1:
            raise ValueError(f"a model with recurrent state needs state slots, got {num_state_slots}")
        self.groups = groups
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Why prefix caching is off whatever was asked (None: the model allows it).
        self.prefix_caching_off_reason: str | None = None
        if len(paged) < len(groups):
            layer_ids = sorted(i for g in groups if not g.is_paged for i in g.layer_ids)
            self.prefix_caching_off_reason = (
                f"layers {layer_ids} keep a recurrent state per request, not per block: the state at the end of a "
                "cached prefix is not kept, so a request cannot resume after it")
        self.enable_prefix_caching = enable_prefix_caching and all(
            g.is_prefix_cacheable for g in groups
        )
        # One block pool per paged group (by group id), one slot pool per state group after them.
        self.pools = [BlockPool(num_blocks, self.enable_prefix_caching, keep_runs) for _ in paged]
        self.slot_pools = [SlotPool(num_state_slots) for _ in groups[len(paged):]]
        self.num_state_slots = num_state_slots if self.slot_pools else 0
        self._has_windows = any(g.sliding_window is not None for g in groups)
        self._requests: dict[str, _RequestBlocks] = {}
        # Block hashes computed by find_cached_prefix for a request that holds no blocks yet;
        # its first allocate takes them over (a prompt is hashed once, not per lookup).
        self._pending_hashes: dict[str, list[bytes]] = {}
        # Called with a request's cached full blocks (the first group's) and their hashes just
        # before ``free`` drops them (kv_offload.py writes them down below the pool).
        self.on_free: Callable[[list[int], list[bytes]], None] | None = None

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

    def num_free_slots(self) -> int | None:
        """Free state slots of the scarcest state group; None without state groups."""
        return min((pool.num_free_slots for pool in self.slot_pools), default=None)

    def is_all_free(self) -> bool:
        """No request holds a block or a state slot and every reference count is zero (a leak
        check)."""
        return not self._requests and all(
            pool.num_free_blocks == pool.num_blocks - 1 and not any(pool.ref_counts)
            for pool in self.pools
        ) and all(pool.num_free_slots == pool.num_slots for pool in self.slot_pools)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_for_prompt(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt and its first output token take (at most: a sliding group takes fewer)."""
        return self.num_blocks_for(num_prompt_tokens + 1)

    def can_ever_hold_prompt(self, num_prompt_tokens: int) -> bool:
        """The prompt and its first output token fit the whole pool (else no wait helps)."""
        return self.num_blocks_for_prompt(num_prompt_tokens) <= self.num_blocks - 1

    # -- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, request_id: str, token_ids: list[int]) -> PrefixHit:
        """Longest cached prefix of whole blocks, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return PrefixHit.empty(len(self.groups))
        max_blocks = max_cached_blocks(len(token_ids), self.block_size)
        return self.lookup_prefix(self._full_block_hashes(request_id, token_ids, max_blocks), max_blocks)

    def lookup_prefix(self, hashes: list[bytes], max_blocks: int) -> PrefixHit:
        """The longest cached prefix of the leading ``hashes`` (at most ``max_blocks``) that
        every group can rebuild: full groups hold all its blocks, sliding groups the blocks in
        the window before its end (their table starts with null blocks)."""
        if not self.enable_prefix_caching:
            return PrefixHit.empty(len(self.groups))
        n = min(len(hashes), max_blocks)
        found: list[list[int | None]] = []
        for group, pool in zip(self.groups, self.pools):  # full groups first (make_group_specs)
            if group.sliding_window is None:
                blocks: list[int | None] = []
                for block_hash in hashes[:n]:  # up to the first miss: a full group needs them all
                    block_id = pool.lookup(block_hash)
                    if block_id is None:
                        break
                    blocks.append(block_id)
                n = len(blocks)
            else:
                blocks = [pool.lookup(h) for h in hashes[:n]]
            found.append(blocks)
        while n and not all(self._window_cached(g, blocks, n) for g, blocks in zip(self.groups, found)):
            n -= 1
        bs = self.block_size
        per_group = []
        for group, blocks in zip(self.groups, found):
            first = group.first_kept_block(n * bs, bs)
            per_group.append((NULL_BLOCK,) * first + tuple(blocks[first:n]))
        return PrefixHit(n * bs, tuple(per_group))

    def _window_cached(self, group: KVCacheGroupSpec, blocks: list[int | None], n: int) -> bool:
        """Whether a sliding group holds what a query after ``n`` cached blocks can see."""
        first = group.first_kept_block(n * self.block_size, self.block_size)
        return all(b is not None for b in blocks[first:n])

    def _full_block_hashes(self, request_id: str, token_ids: list[int], num_blocks: int) -> list[bytes]:
        entry = self._requests.get(request_id)
        hashes = entry.hashes if entry else self._pending_hashes.setdefault(request_id, [])
        return chain_hashes(hashes, token_ids, self.block_size, num_blocks)

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
                if table[i] != NULL_BLOCK:  # a sliding group's block left its window, or never held
                    pool.cache_block(table[i], hashes[i])
        entry.num_cached_blocks = num_full

    # -- allocation ----------------------------------------------------------------------
    def can_allocate(
        self, request_id: str, num_computed: int, num_new_tokens: int, hit: PrefixHit | None = None,
        first_query: int | None = None,
    ) -> bool:
        """Whether ``allocate`` would succeed: enough free blocks in every pool and, for a
        request without its state slots yet, a free slot in every state group."""
        if self.slot_pools and request_id not in self._requests and not all(p.num_free_slots for p in self.slot_pools):
            return False
        return all(
            need <= pool.num_free_blocks
            for need, pool in zip(self._blocks_needed(request_id, num_computed, num_new_tokens, hit, first_query),
                                  self.pools)
        )

    def allocate(
        self, request_id: str, num_computed: int, num_new_tokens: int, hit: PrefixHit | None = None,
        first_query: int | None = None,
    ) -> bool:
        """Make room for tokens num_computed .. num_computed+num_new_tokens-1.

        ``num_computed`` counts tokens already in the cache, including a prefix hit being
        applied now. ``first_query``: the first position this worker computes a query for
        (default ``num_computed``); a reservation whose KV another worker writes queries first
        at the prompt's end, and a sliding group then takes only the blocks in the window
        there. A request's first allocation also takes one slot in each state group. Returns
        False and changes nothing when a pool is short of blocks or slots.
        """
        if first_query is None:
            first_query = num_computed
        if hit is None and not self._has_windows:
            fast = self._grow(request_id, num_computed + num_new_tokens)
            if fast is not None:
                return fast
        if not self.can_allocate(request_id, num_computed, num_new_tokens, hit, first_query):
            return False
        entry = self._requests.get(request_id)
        if entry is None:
            entry = _RequestBlocks([[] for _ in self.groups], self._pending_hashes.pop(request_id, []))
            self._requests[request_id] = entry
        for group_id, pool in enumerate(self.pools):
            table = entry.tables[group_id]
            if hit is not None and hit.block_ids[group_id]:
                pool.touch([b for b in hit.block_ids[group_id] if b != NULL_BLOCK])
                table.extend(hit.block_ids[group_id])
            num_dead = self._num_out_of_window(group_id, first_query)
            if len(table) < num_dead:  # positions this worker never holds
                table.extend([NULL_BLOCK] * (num_dead - len(table)))
            self._release_out_of_window(group_id, table, first_query)
            num_missing = self.num_blocks_for(num_computed + num_new_tokens) - len(table)
            if num_missing > 0:
                table.extend(pool.allocate(num_missing, _last_block(table)))
        for offset, slot_pool in enumerate(self.slot_pools):
            table = entry.tables[len(self.pools) + offset]
            if not table:  # the request's first allocation: its slot for the rest of its life
                table.append(slot_pool.allocate())
        if hit is not None and hit.num_tokens:
            entry.num_cached_blocks = max(entry.num_cached_blocks, hit.num_tokens // self.block_size)
        return True

    def _grow(self, request_id: str, num_tokens: int) -> bool | None:
        """``allocate`` for a request that holds blocks, without a prefix hit or a sliding
        window (every decode step): its table only ever grows at the end. Without sliding
        windows there is one paged group (``make_group_specs``); a request that holds blocks
        holds its state slots already. None: not such a request, take the general path."""
        entry = self._requests.get(request_id)
        if entry is None or len(self.pools) != 1:
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
        self, request_id: str, num_computed: int, num_new_tokens: int, hit: PrefixHit | None,
        first_query: int | None = None,
    ) -> list[int]:
        """Blocks each pool must hand out, net of blocks leaving a sliding window."""
        entry = self._requests.get(request_id)
        total = self.num_blocks_for(num_computed + num_new_tokens)
        first_query = num_computed if first_query is None else first_query
        needs = []
        for group_id, pool in enumerate(self.pools):
            hit_blocks = [b for b in hit.block_ids[group_id] if b != NULL_BLOCK] if hit is not None else []
            table = (entry.tables[group_id] if entry else []) + list(hit.block_ids[group_id] if hit else ())
            num_dead = self._num_out_of_window(group_id, first_query)
            num_released = sum(1 for b in table[:num_dead] if b != NULL_BLOCK)
            num_missing = max(0, total - max(len(table), num_dead))
            needs.append(num_missing + pool.count_evictable(hit_blocks) - num_released)
        return needs

    def _num_out_of_window(self, group_id: int, first_query: int) -> int:
        """Leading blocks no query at position >= first_query can see."""
        return self.groups[group_id].first_kept_block(first_query, self.block_size)

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
        if self.on_free is not None and entry.num_cached_blocks:
            n = entry.num_cached_blocks
            self.on_free(entry.tables[0][:n], entry.hashes[:n])
        for pool, table in zip(self.pools, entry.tables):
            pool.free(table)
        for offset, slot_pool in enumerate(self.slot_pools):
            for slot_id in entry.tables[len(self.pools) + offset]:
                slot_pool.free(slot_id)

    def record_events(self) -> None:
        """From now on, note the prefix-cache blocks stored and removed (``take_events``);
        nothing to note without prefix caching."""
        if self.enable_prefix_caching:
            self.pools[0].record_events()  # every group caches the same keys

    def take_events(self) -> list[tuple[str, list[bytes]]]:
        """The block hashes cached (``"stored"``) and evicted (``"removed"``) since the last
        call, oldest first, in runs of one kind."""
        runs: list[tuple[str, list[bytes]]] = []
        for stored, block_hash in self.pools[0].take_events():
            kind = "stored" if stored else "removed"
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(block_hash)
            else:
                runs.append((kind, [block_hash]))
        return runs

    def reorder_free_blocks(self, rng: random.Random | None) -> None:
        """Every pool's free blocks in id order (None) or shuffled (``BlockPool.reorder_free``);
        where a request's pages lie changes how fast the attention kernels read them."""
        for pool in self.pools:
            pool.reorder_free(rng)

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
