"""Block pool, typed groups and prefix cache invariants (plain Python, no model)."""

import pytest

from epdserve.engine.kv_cache import (
    NULL_BLOCK,
    BlockPool,
    KVCacheManager,
    chain_hashes,
    hash_block,
    make_group_specs,
)


def full_only(num_blocks=16, block_size=4, caching=True) -> KVCacheManager:
    groups = make_group_specs((None, None), num_kv_heads=1, head_dim=8)
    return KVCacheManager(groups, num_blocks, block_size, caching)


def test_group_specs_split_by_window():
    windows = (8, 8, None, 8, None)
    groups = make_group_specs(windows, num_kv_heads=2, head_dim=4)
    assert [(g.kind, g.layer_ids, g.sliding_window) for g in groups] == [
        ("full", (2, 4), None),
        ("sliding", (0, 1, 3), 8),
    ]
    assert groups[0].is_prefix_cacheable and groups[1].is_prefix_cacheable
    assert [g.name for g in groups] == ["full", "sliding8"]
    assert [groups[1].first_kept_block(q, 2) for q in (0, 8, 9, 10, 11)] == [0, 0, 1, 1, 2]
    assert groups[1].bytes_per_block(16, 2) == 3 * 2 * 16 * 2 * 4 * 2


def test_pool_never_hands_out_null_block_and_counts():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.allocate(3)
    assert NULL_BLOCK not in blocks and pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.num_free_blocks == 3 and not any(pool.ref_counts)


def test_block_keys_chain_blake2b_of_the_parent_and_the_int64_tokens():
    """The key format the router and every worker share (a change makes them disagree)."""
    import hashlib
    import struct

    def key(parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(parent + struct.pack(f"{len(tokens)}q", *tokens), digest_size=16).digest()

    tokens = list(range(1000, 1000 + 70))  # 4 blocks of 16 and 6 tokens over; ids past one byte
    expected, parent = [], b"root"
    for i in range(4):
        parent = key(parent, tokens[i * 16 : (i + 1) * 16])
        expected.append(parent)
    assert chain_hashes([], tokens, 16, 4) == expected
    assert [hash_block(None, tokens[:16]), hash_block(expected[0], tokens[16:32])] == expected[:2]
    known = expected[:2]
    assert chain_hashes(known, tokens, 16, 4) is known and known == expected  # extended in place
    assert chain_hashes(list(expected), tokens, 16, 3) == expected  # never shortens
    # a block size without a packer, and a last block cut short
    h1 = key(b"root", tokens[:24])
    h2 = key(h1, tokens[24:48])
    assert chain_hashes([], tokens, 24, 3) == [h1, h2, key(h2, tokens[48:72])]


def test_pool_without_runs_hands_out_the_queue_order():
    pool = BlockPool(8, enable_caching=True, keep_runs=False)
    first = pool.allocate(3)
    assert first == [1, 2, 3]
    pool.cache_block(2, b"k" * 16)
    pool.free(first)  # uncached blocks first, most recently freed first; cached after them
    assert pool.free_queue == [1, 3, 4, 5, 6, 7, 2]
    assert pool.allocate(2) == [1, 3]  # enough uncached blocks
    assert pool.allocate(5) == [4, 5, 6, 7, 2] and pool.lookup(b"k" * 16) is None  # then the cached one


def test_allocate_grows_table_and_refuses_when_short():
    kv = full_only(num_blocks=5, block_size=4)  # 4 usable blocks
    assert kv.allocate("a", 0, 6)
    assert len(kv.block_tables("a")[0]) == 2
    assert kv.allocate("a", 6, 2)  # fills block 2 exactly
    assert len(kv.block_tables("a")[0]) == 2
    assert kv.allocate("a", 8, 1)
    assert len(kv.block_tables("a")[0]) == 3
    assert not kv.allocate("b", 0, 8)  # needs 2, one left: nothing changes
    assert kv.num_free_blocks() == 1
    kv.free("a")
    assert kv.is_all_free()


def test_reorder_free_blocks_id_order_or_shuffled():
    import random

    kv = full_only(num_blocks=33, block_size=4, caching=False)
    kv.allocate("a", 0, 8)
    kv.free("a")  # its blocks return to the end, last block first
    kv.reorder_free_blocks(None)  # id order: a fresh pool's contiguous runs
    assert kv.allocate("b", 0, 16)
    assert kv.block_tables("b")[0] == [1, 2, 3, 4]
    kv.free("b")
    kv.reorder_free_blocks(random.Random(0))  # a permutation of the same free blocks
    for pool in kv.pools:
        assert sorted(pool.free_queue) == list(range(1, 33)) and list(pool.free_queue) != list(range(1, 33))
    assert kv.allocate("c", 0, 128) and kv.num_free_blocks() == 0
    kv.free("c")
    assert kv.is_all_free()


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = full_only(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks
    assert kv.find_cached_prefix("a", prompt).num_tokens == 0
    assert kv.allocate("a", 0, 10)
    kv.cache_computed_blocks("a", prompt, 10)
    hit = kv.find_cached_prefix("b", prompt)
    assert hit.num_tokens == 8
    assert kv.allocate("b", 8, 2, hit)
    assert kv.block_tables("b")[0][:2] == kv.block_tables("a")[0][:2]
    assert kv.block_tables("b")[0][2] != kv.block_tables("a")[0][2]
    # a prompt of exactly 8 tokens may reuse only 4: one token must be computed
    assert kv.find_cached_prefix("c", prompt[:8]).num_tokens == 4
    kv.free("a")
    kv.free("b")
    assert kv.is_all_free()
    # cached blocks survive the free and are hit again
    assert kv.find_cached_prefix("d", prompt).num_tokens == 8


def test_different_prefix_does_not_hit():
    kv = full_only(num_blocks=16, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert kv.allocate("a", 0, len(a))
    kv.cache_computed_blocks("a", a, len(a))
    b = [1, 2, 3, 4, 0, 6, 7, 8, 9]
    assert kv.find_cached_prefix("b", b).num_tokens == 4  # chained: second block differs
    kv.free("a")


def test_lru_eviction_reuses_cached_blocks_last():
    kv = full_only(num_blocks=5, block_size=2)  # 4 usable
    p = [1, 2, 3, 4, 5]
    assert kv.allocate("a", 0, 5)  # 3 blocks
    kv.cache_computed_blocks("a", p, 5)
    kv.free("a")
    assert kv.num_free_blocks() == 4
    # an unrelated request needing one block takes the uncached one first
    assert kv.allocate("b", 0, 2)
    kv.free("b")
    assert kv.find_cached_prefix("c", p).num_tokens == 4
    # needing all four evicts the cached ones; their hashes are gone
    assert kv.allocate("d", 0, 8)
    assert kv.find_cached_prefix("c", p).num_tokens == 0
    kv.free("d")
    assert kv.is_all_free()


def test_hit_on_free_cached_blocks_counts_against_capacity():
    kv = full_only(num_blocks=4, block_size=2)  # 3 usable
    p = [1, 2, 3, 4, 5]
    assert kv.allocate("a", 0, 5)
    kv.cache_computed_blocks("a", p, 5)
    kv.free("a")
    hit = kv.find_cached_prefix("b", p)
    assert hit.num_tokens == 4
    assert kv.can_allocate("b", 4, 1, hit)
    assert not kv.can_allocate("b", 4, 3, hit)
    kv.allocate("b", 4, 1, hit)
    kv.free("b")
    assert kv.is_all_free()


def test_sliding_hit_needs_only_the_window():
    """Window 4, block size 2: a hit of n blocks needs every full block and, in the sliding
    group, the blocks a query at 2n can see (from (2n-3)//2 on)."""
    groups = make_group_specs((4, None), num_kv_heads=1, head_dim=8)
    full, sliding = groups[0].group_id, groups[1].group_id
    kv = KVCacheManager(groups, 32, 2, enable_prefix_caching=True)
    assert kv.enable_prefix_caching
    p = list(range(100, 110))
    for start in range(0, 10, 2):  # chunks of 2: the sliding group lets blocks 0 and 1 go
        assert kv.allocate("a", start, 2)
        kv.cache_computed_blocks("a", p, start + 2)
    assert kv.block_tables("a")[sliding][:2] == [NULL_BLOCK, NULL_BLOCK]
    kv.pools[sliding].reset_prefix_cache()  # the sliding group forgets its free blocks 0 and 1

    hit = kv.find_cached_prefix("b", p)
    assert hit.num_tokens == 8  # (10 - 1) // 2 blocks: the last token is always computed
    assert hit.block_ids[full] == tuple(kv.block_tables("a")[full][:4])
    assert hit.block_ids[sliding] == (NULL_BLOCK, NULL_BLOCK, *kv.block_tables("a")[sliding][2:4])
    assert kv.allocate("b", 8, 2, hit)
    assert kv.block_tables("b")[sliding][:4] == list(hit.block_ids[sliding])
    assert kv.pools[sliding].ref_counts[hit.block_ids[sliding][2]] == 2
    kv.free("a")
    kv.free("b")
    assert kv.is_all_free()

    # Without the window's blocks there is no hit, however many full blocks are cached.
    kv.pools[sliding].reset_prefix_cache()
    assert kv.find_cached_prefix("c", p).num_tokens == 0


def test_reservation_takes_only_the_window_at_the_prompt_end():
    """A decode worker's reservation for a 10-token prompt (plus the first output token)
    queries first at position 10, which sees 7..10: the sliding group holds blocks 3.. only."""
    groups = make_group_specs((4, None), num_kv_heads=1, head_dim=8)
    full, sliding = groups[0].group_id, groups[1].group_id
    kv = KVCacheManager(groups, 8, 2, enable_prefix_caching=False)  # 7 usable blocks per group
    assert kv.can_allocate("r", 0, 11, first_query=10)
    assert kv.allocate("r", 0, 11, first_query=10)
    tables = kv.block_tables("r")
    assert NULL_BLOCK not in tables[full] and len(tables[full]) == 6
    assert tables[sliding][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in tables[sliding][3:]
    assert kv.pools[sliding].num_used_blocks == 3 and kv.pools[full].num_used_blocks == 6
    # A second reservation of the same size finds 1 full block free: refused, nothing taken.
    assert not kv.can_allocate("s", 0, 11, first_query=10)
    assert not kv.allocate("s", 0, 11, first_query=10)
    assert kv.pools[sliding].num_used_blocks == 3
    for pos in range(11, 14):  # decoding on: the window moves, the full group grows
        assert kv.allocate("r", pos, 1)
    assert kv.block_tables("r")[sliding][:5] == [NULL_BLOCK] * 5
    kv.free("r")
    assert kv.is_all_free()


def test_random_churn_with_sliding_groups_hits_only_what_every_group_holds():
    """Random prompts, decodes and frees over a full and two sliding groups with prefix
    caching: every hit's blocks carry the prompt's block hashes in every group (null only
    before the window), the hit is the longest one every group can rebuild, and the pools'
    counts stay consistent."""
    bs = 2
    groups = make_group_specs((3, None, 6, 3), num_kv_heads=1, head_dim=8)
    kv = KVCacheManager(groups, 41, bs, enable_prefix_caching=True)
    assert kv.enable_prefix_caching
    hits = []

    def on_lookup(rid: str, tokens: list[int], hit) -> None:
        hashes = kv.block_hashes(rid)
        n = hit.num_tokens // bs
        for group, pool, ids in zip(groups, kv.pools, hit.block_ids):
            first = group.first_kept_block(hit.num_tokens, bs)
            assert len(ids) == n and all(b == NULL_BLOCK for b in ids[:first])
            assert all(pool.block_hashes[b] == hashes[i] for i, b in enumerate(ids) if i >= first)

        def rebuildable(m: int) -> bool:
            return all(pool.lookup(hashes[i]) is not None for group, pool in zip(groups, kv.pools)
                       for i in range(group.first_kept_block(m * bs, bs), m))
        assert n == max(m for m in range(len(tokens) // bs + 1) if m * bs < len(tokens) and rebuildable(m))
        hits.append(n)

    def check(live: dict[str, list[int]]) -> None:
        for group_id, pool in enumerate(kv.pools):
            held = [b for rid in live for b in kv.block_tables(rid)[group_id] if b != NULL_BLOCK]
            free = pool.free_queue
            assert not set(free) & set(held)
            assert all(pool.ref_counts[b] == held.count(b) for b in set(held))
            assert len(set(free) | set(held)) == pool.num_free_blocks + pool.num_used_blocks

    churn(kv, seed=1, steps=2000, alphabet=3, max_len=24, min_free=10, on_lookup=on_lookup, check=check)
    assert sum(n > 0 for n in hits) > 100


def test_sliding_window_releases_blocks_out_of_window():
    # window 4, block size 2: a query at position p sees p-3..p
    groups = make_group_specs((4, None), num_kv_heads=1, head_dim=8)
    kv = KVCacheManager(groups, 32, 2, enable_prefix_caching=False)
    full, sliding = groups[0].group_id, groups[1].group_id
    assert kv.allocate("a", 0, 6)  # positions 0..5, next query at 6 sees 3..6
    assert kv.allocate("a", 6, 1)
    tables = kv.block_tables("a")
    assert tables[sliding][0] == NULL_BLOCK and tables[sliding][1] != NULL_BLOCK
    assert NULL_BLOCK not in tables[full]
    used_full = kv.pools[full].num_used_blocks
    used_sliding = kv.pools[sliding].num_used_blocks
    assert used_sliding == used_full - 1
    # decode far past the window: the sliding group keeps a bounded number of blocks
    for pos in range(7, 40):
        assert kv.allocate("a", pos, 1)
    assert kv.pools[sliding].num_used_blocks <= 4
    assert kv.pools[full].num_used_blocks == 20
    kv.free("a")
    assert kv.is_all_free()


def test_chunk_start_keeps_whole_window_of_first_query():
    groups = make_group_specs((4,), num_kv_heads=1, head_dim=8)
    kv = KVCacheManager(groups, 32, 2, enable_prefix_caching=False)
    assert kv.allocate("a", 0, 5)
    assert kv.allocate("a", 5, 4)  # chunk of positions 5..8; query 5 needs 2..5
    table = kv.block_tables("a")[0]
    assert table[0] == NULL_BLOCK  # positions 0,1
    assert table[1] != NULL_BLOCK  # positions 2,3 still visible
    kv.free("a")
    assert kv.is_all_free()


def pool_of_two_cached_sequences(keep_runs: bool) -> KVCacheManager:
    """Every block in use by a (1-4) and b (5-8), then a finishes with its blocks cached: a
    cached sequence is freed last block first, so the queue holds 4, 3, 2, 1."""
    kv = full_only(num_blocks=9, block_size=4)
    for pool in kv.pools:
        pool.keep_runs = keep_runs
    for rid, first in (("a", 100), ("b", 200)):
        assert kv.allocate(rid, 0, 16)
        kv.cache_computed_blocks(rid, list(range(first, first + 16)), 16)
    kv.free("a")
    return kv


def test_tables_take_blocks_in_runs_of_consecutive_ids():
    kv = pool_of_two_cached_sequences(keep_runs=True)
    assert kv.allocate("c", 0, 16)
    assert kv.block_tables("c")[0] == [1, 2, 3, 4]  # the run around the block handed out first
    kv.free("b")  # the queue: 8, 7, 6, 5
    assert kv.allocate("c", 16, 4)
    assert kv.block_tables("c")[0] == [1, 2, 3, 4, 5]  # grown into the next block
    kv.free("c")
    assert kv.is_all_free()

    old = pool_of_two_cached_sequences(keep_runs=False)  # one by one in queue order
    assert old.allocate("c", 0, 16)
    assert old.block_tables("c")[0] == [4, 3, 2, 1]
    old.free("b")
    assert old.allocate("c", 16, 4)
    assert old.block_tables("c")[0] == [4, 3, 2, 1, 8]


def test_interleaved_growth_starts_new_runs_and_continues_them():
    kv = full_only(num_blocks=64, block_size=4, caching=False)
    assert kv.allocate("a", 0, 8) and kv.allocate("b", 0, 8)
    assert kv.block_tables("a")[0] == [1, 2] and kv.block_tables("b")[0] == [3, 4]
    assert kv.allocate("a", 8, 4)  # block 3 is b's: a new run starts where the queue hands out
    assert kv.allocate("a", 12, 4)  # ... and continues
    assert kv.allocate("b", 8, 8)
    assert kv.block_tables("a")[0] == [1, 2, 5, 6]
    assert kv.block_tables("b")[0] == [3, 4, 7, 8]
    kv.free("a")
    kv.free("b")
    assert kv.is_all_free()


def test_runs_take_only_old_cached_blocks():
    """A cached free block joins a run only while it is among the oldest cached free blocks:
    the prefix cache keeps evicting least recently used first, to within that window."""
    from epdserve.engine import kv_cache

    kv = full_only(num_blocks=kv_cache.RUN_AGE_WINDOW * 4 + 8, block_size=1)
    pool = kv.pools[0]
    n = kv_cache.RUN_AGE_WINDOW * 4 + 7
    prompt = list(range(1000, 1000 + n))
    assert kv.allocate("a", 0, n)  # every block, ids 1..n in order
    kv.cache_computed_blocks("a", prompt, n)
    kv.free("a")  # all cached; freed last block first: block n is the oldest
    assert pool.free_queue[0] == n
    assert kv.allocate("b", 0, 2)
    assert kv.block_tables("b")[0] == [n - 1, n]  # the oldest, and its old neighbour
    kv.free("b")
    # Block 1 was freed last of all (the newest): a table ending at block 0's side may not grow
    # into it; one ending next to old blocks grows into them.
    oldest = pool.free_queue[0]
    assert pool.allocate(1, after=0) == [oldest] != [1]
    assert pool.allocate(1, after=n - 3) == [n - 2]
    pool.free([oldest, n - 2])


def churn(kv: KVCacheManager, seed: int, steps: int, alphabet: int, max_len: int, min_free: int,
          on_lookup=None, check=None) -> None:
    """Random prompts (a small alphabet: prefix hits), decode steps and frees; ``on_lookup(rid,
    tokens, hit)`` sees every prefix lookup, ``check(live)`` the manager after every step.
    Everything is freed at the end."""
    import random

    rng = random.Random(seed)
    live: dict[str, list[int]] = {}
    for step in range(steps):
        if live and (rng.random() < 0.3 or kv.num_free_blocks() < min_free):
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        elif rng.random() < 0.5 or not live:
            rid = f"r{step}"
            tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(2, max_len))]
            hit = kv.find_cached_prefix(rid, tokens)
            if on_lookup is not None:
                on_lookup(rid, tokens, hit)
            if kv.allocate(rid, hit.num_tokens, len(tokens) - hit.num_tokens, hit):
                kv.cache_computed_blocks(rid, tokens, len(tokens))
                live[rid] = tokens
        else:
            rid = rng.choice(sorted(live))
            tokens = live[rid]
            tokens.append(rng.randrange(alphabet))
            if kv.allocate(rid, len(tokens) - 1, 1):
                kv.cache_computed_blocks(rid, tokens, len(tokens))
            else:
                tokens.pop()
        if check is not None:
            check(live)
    for rid in list(live):
        kv.free(rid)
    assert kv.is_all_free()


def test_random_churn_keeps_the_pool_consistent():
    kv = full_only(num_blocks=97, block_size=4)

    def check(live: dict[str, list[int]]) -> None:
        pool = kv.pools[0]
        held = [b for rid in live for b in kv.block_tables(rid)[0]]
        free = pool.free_queue
        assert len(free) == len(set(free)) and not set(free) & set(held)
        assert len(set(free) | set(held)) == pool.num_free_blocks + pool.num_used_blocks
        assert all(pool.ref_counts[b] == 0 for b in free)
        assert all(pool.ref_counts[b] == held.count(b) for b in set(held))
        assert all(pool.block_hashes[b] == h for h, b in pool.cached.items())

    churn(kv, seed=0, steps=3000, alphabet=4, max_len=30, min_free=8, check=check)


def test_reset_prefix_cache_forgets_free_cached_blocks_only():
    kv = full_only(num_blocks=16, block_size=4)
    a, b = list(range(100, 109)), list(range(200, 209))
    for rid, tokens in (("a", a), ("b", b)):
        assert kv.allocate(rid, 0, len(tokens))
        kv.cache_computed_blocks(rid, tokens, len(tokens))
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.find_cached_prefix("c", a).num_tokens == 0  # a's blocks were free: forgotten
    assert kv.find_cached_prefix("d", b).num_tokens == 8  # b still holds its blocks
    pool = kv.pools[0]
    assert all(pool.block_hashes[blk] is None for blk in pool.free_queue)
    kv.free("b")
    assert kv.is_all_free()
