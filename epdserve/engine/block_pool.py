"""One pool of paged KV blocks: reference counts, free queues, prefix-cache hashes; and the
pool of per-request state slots of a recurrent-state group (``SlotPool``).

Plain Python (ints and lists, no torch): the simulator drives this same code.

Block ids are per pool. Block 0 of every pool is the null block: it is never allocated and
stands in a block table for blocks that a sliding-window group has already released.

Prefix caching: a full block is named by a chained hash of its tokens and its parent's hash.
Cached blocks whose reference count drops to zero stay in the free queue, evicted in LRU
order when a new block is needed.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

from epdserve.transfer.descriptors import NULL_BLOCK  # re-exported: block 0 of every pool

if TYPE_CHECKING:
    import random

__all__ = ["HASH_BYTES", "NULL_BLOCK", "RUN_AGE_WINDOW", "BlockPool", "SlotPool", "chain_hashes", "hash_block"]

# struct packers for the usual block sizes: the same bytes as array("q", ids).tobytes(),
# about 20 % faster per block (prefix hashing is a large part of a simulated step)
_TOKEN_PACKERS = {n: struct.Struct(f"{n}q").pack for n in (1, 2, 4, 8, 16, 32, 64, 128)}


HASH_BYTES = 16  # a block key's length


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """One block's prefix-cache key (``chain_hashes``), after the block ``parent`` names (None:
    the first block)."""
    return _chain(parent or b"root", token_ids, len(token_ids), 0, len(token_ids), [])[0]


def chain_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """Extend ``hashes`` (the chained keys of the first blocks of ``token_ids``) in place to
    ``num_blocks`` keys; returns it. A block's key is blake2b-128 of its parent's key (``root``
    for the first block) and its token ids as native int64. The router names a prompt's blocks
    with this too (prefix routing, a decode worker's reservation), so both sides agree on every
    key."""
    if len(hashes) >= num_blocks:
        return hashes
    return _chain(hashes[-1] if hashes else b"root", token_ids, block_size, len(hashes) * block_size,
                  num_blocks * block_size, hashes)


def _chain(parent: bytes, token_ids: list[int], block_size: int, start: int, stop: int,
           out: list[bytes]) -> list[bytes]:
    """Append the keys of the blocks of ``token_ids[start:stop]`` after ``parent`` to ``out``.
    One loop, no call per block: this runs for every block of every prompt."""
    pack = _TOKEN_PACKERS.get(block_size)
    blake2b = hashlib.blake2b
    for first in range(start, stop, block_size):
        tokens = token_ids[first : first + block_size]
        if pack is not None and len(tokens) == block_size:
            data = pack(*tokens)
        else:
            data = array("q", tokens).tobytes()
        parent = blake2b(parent + data, digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


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
        # KV events (``record_events``): (stored?, block hash) in the order they happened.
        self.events: list[tuple[bool, bytes]] | None = None

    def record_events(self) -> None:
        """From now on, note each block hash cached (stored) or evicted (removed) in ``events``."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[tuple[bool, bytes]]:
        """The events noted since the last call (``record_events``), oldest first."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

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
            plain = self._plain
            if len(plain) >= num_blocks:
                pop = plain.popitem
                block_ids = [pop(last=False)[0] for _ in range(num_blocks)]
            else:
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
        if self.events is not None:
            self.events.append((True, block_hash))

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
            if self.events is not None:
                self.events.append((False, block_hash))



class SlotPool:
    """The state slots of one recurrent-state group: one per request, not per token.

    Slot ids are 0 .. num_slots - 1 and index the runner's state tensors directly; there is no
    null slot (a request's state table always holds one real slot). No sharing, no caching:
    a slot is used by one request or free. The most recently freed slot is handed out first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 on top
        self._is_used = [False] * num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use")
        slot_id = self._free.pop()
        self._is_used[slot_id] = True
        return slot_id

    def free(self, slot_id: int) -> None:
        assert self._is_used[slot_id], f"state slot {slot_id} freed twice"
        self._is_used[slot_id] = False
        self._free.append(slot_id)
