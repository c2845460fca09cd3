"""The router's prefix index (``router/prefix_index.py``) and the reload-or-recompute rule it
scores with (``engine/reload_rule.py``)."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest

from epdserve.cluster import messages as m
from epdserve.engine.block_pool import hash_block
from epdserve.engine.reload_rule import (
    LOAD_TIERS,
    TIERS,
    PrefillRate,
    PrefixCost,
    causal_attn_pairs,
    max_cached_blocks,
)
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.router.prefix_index import (
    NO_LOADS,
    NO_MATCH,
    Candidate,
    LoadBlocks,
    PrefixIndex,
    PrefixMatch,
    Score,
    choose,
    score,
)
from epdserve.router.workers import DECODE_AFFINITY_SLACK, PromptBlocks, WorkerInfo, WorkerRegistry
from epdserve.sim.cost_model import StepCost


def chain(num_blocks: int, block_size: int = 4, seed: int = 0) -> list[bytes]:
    """A prompt's chained block hashes, as the engine computes them."""
    hashes: list[bytes] = []
    for i in range(num_blocks):
        tokens = [seed * 100_000 + i * block_size + j for j in range(block_size)]
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
    return hashes


def index_of(**nodes: str) -> PrefixIndex:
    index = PrefixIndex()
    for worker_id, node in nodes.items():
        index.add_worker(worker_id, node)
    return index


# -- the walk --------------------------------------------------------------------------------


def test_walk_takes_each_block_from_the_fastest_tier_in_order():
    b = chain(6)
    index = index_of(a="n1")
    index.apply("a", "stored", "pool", b[0:2])
    index.apply("a", "stored", "host", b[1:3])
    index.apply("a", "stored", "disk", [b[3]])
    m = index.match("a", b)
    assert m == PrefixMatch(2, 1, 1) and m.num_blocks == 4
    # A block in both host and disk comes from host.
    index.apply("a", "stored", "disk", b[2:5])
    assert index.match("a", b) == PrefixMatch(2, 1, 2)
    # max_blocks bounds the walk.
    assert index.match("a", b, max_blocks=3) == PrefixMatch(2, 1, 0)
    assert index.match("a", b, max_blocks=0) == NO_MATCH


def test_walk_stops_at_the_first_miss():
    b = chain(5)
    index = index_of(a="n1")
    index.apply("a", "stored", "pool", [b[0], b[1], b[3], b[4]])  # b2 missing: b3, b4 are useless
    assert index.match("a", b) == PrefixMatch(2, 0, 0)
    index.apply("a", "stored", "host", [b[2]])
    # b2 from host, then b3 is only in the pool: the walk does not climb back up (the engine
    # takes pool blocks before its first pool miss only).
    assert index.match("a", b) == PrefixMatch(2, 1, 0)
    assert index.match("a", b[2:]) == PrefixMatch(0, 1, 0)  # a prompt starting at b2
    assert index.match("a", chain(3, seed=5)) == NO_MATCH  # a prompt whose first block nobody holds
    assert index.match("a", []) == NO_MATCH


def test_host_and_disk_are_shared_by_a_node_and_the_pool_by_nobody():
    b = chain(4)
    index = index_of(a="n1", b="n1", c="n2")
    index.apply("a", "stored", "pool", b[:1])
    index.apply("a", "stored", "host", b[1:3])
    index.apply("b", "stored", "disk", b[3:4])
    assert index.match("a", b) == PrefixMatch(1, 2, 1)
    assert index.match("b", b) == NO_MATCH  # a's pool is a's alone: b's walk misses block 0
    assert index.match("b", b[1:]) == PrefixMatch(0, 2, 1)  # same node: a's host, b's disk
    assert index.match("c", b[1:]) == NO_MATCH  # another node
    assert [index.num_blocks(w, "host") for w in "abc"] == [2, 2, 0]
    assert [index.num_blocks(w, "pool") for w in "abc"] == [1, 0, 0]


def test_workers_without_a_node_share_nothing():
    b = chain(2)
    index = index_of(a="", b="")
    index.apply("a", "stored", "host", b)
    assert index.match("a", b) == PrefixMatch(0, 2, 0)
    assert index.match("b", b) == NO_MATCH


# -- events ------------------------------------------------------------------------------------


def test_removed_and_cleared_events():
    b = chain(4)
    index = index_of(a="n1", b="n1")
    index.apply("a", "stored", "pool", iter(b))  # any iterable
    index.apply("a", "removed", "pool", [b[1]])
    assert index.match("a", b) == PrefixMatch(1, 0, 0)
    assert index.num_blocks("a", "pool") == 3
    index.apply("a", "removed", "pool", [chain(1, seed=9)[0]])  # a block it never had
    assert index.num_blocks("a", "pool") == 3
    index.apply("a", "stored", "host", b)
    index.apply("b", "cleared", "host", [b[0]])  # one tier per node: cleared for a too; hashes ignored
    assert index.num_blocks("a", "host") == 0
    assert index.num_blocks("a", "pool") == 3
    index.apply("a", "cleared", "pool", ())
    assert index.match("a", b) == NO_MATCH


def test_events_of_unknown_workers_are_dropped_and_bad_ones_raise():
    b = chain(2)
    index = index_of(a="n1")
    index.apply("ghost", "stored", "pool", b)
    assert index.match("ghost", b) == NO_MATCH and index.num_blocks("ghost", "pool") == 0
    assert not index.is_known("ghost") and index.is_known("a")
    for kind, tier in (("evicted", "pool"), ("stored", "ssd"), ("stored", "Pool")):
        for worker_id in ("a", "ghost"):
            with pytest.raises(ValueError):
                index.apply(worker_id, kind, tier, b)
    with pytest.raises(ValueError):
        index.num_blocks("a", "gpu")
    with pytest.raises(ValueError):
        index.add_worker("", "n1")


def test_remove_worker_forgets_its_pool_and_the_last_one_its_node():
    b = chain(3)
    index = index_of(a="n1", b="n1")
    index.apply("a", "stored", "pool", b)
    index.apply("a", "stored", "host", b)
    index.remove_worker("a")
    assert index.match("a", b) == NO_MATCH
    assert index.match("b", b) == PrefixMatch(0, 3, 0)  # the node's tier outlives a
    index.remove_worker("a")  # twice: nothing to do
    index.add_worker("a", "n1")  # back, with an empty pool
    assert index.match("a", b) == PrefixMatch(0, 3, 0)
    index.remove_worker("a")
    index.remove_worker("b")  # the node's last worker
    index.add_worker("b", "n1")
    assert index.match("b", b) == NO_MATCH


def test_a_worker_registering_again_starts_with_an_empty_pool():
    b = chain(2)
    index = index_of(a="n1", b="n1")
    index.apply("a", "stored", "pool", b)
    index.apply("a", "stored", "host", b)
    index.add_worker("a", "n1")  # a restarted process
    assert index.num_blocks("a", "pool") == 0 and index.num_blocks("a", "host") == 2
    index.add_worker("a", "n2")  # and on another node: n1's tiers are not its own any more
    assert index.match("a", b) == NO_MATCH
    assert index.match("b", b) == PrefixMatch(0, 2, 0)


def test_match_over_many_workers_stays_plain():
    b = chain(64, block_size=16)
    index = PrefixIndex()
    for i in range(10_000):
        index.add_worker(f"w{i}", f"n{i // 8}")
        index.apply(f"w{i}", "stored", "pool", b[: i % 65])
    index.apply("w0", "stored", "host", b)
    matches = [index.match(f"w{i}", b) for i in range(10_000)]
    assert matches[0] == PrefixMatch(0, 64, 0) and matches[7] == PrefixMatch(7, 57, 0)
    assert matches[64] == PrefixMatch(64, 0, 0) and matches[65] == NO_MATCH


# -- the reload-or-recompute rule ----------------------------------------------------------


def test_prefill_s_counts_attention_pairs_as_step_shape_does():
    cost = PrefixCost(0.5, 0.25)
    assert cost.prefill_s(3, 10) == 0.5 * 3 + 0.25 * (11 + 12 + 13)
    assert cost.prefill_s(0, 10) == 0.0
    for n, start in ((1, 0), (7, 0), (5, 13), (16, 32)):
        request = SimpleNamespace(num_prompt_tokens=start + n)
        entry = SimpleNamespace(num_new_tokens=n, start_pos=start, request=request)
        shape = StepShape.from_scheduler_output(SimpleNamespace(scheduled=[entry]))
        assert causal_attn_pairs(n, start) == shape.prefill_attn_pairs
    with pytest.raises(ValueError):
        cost.prefill_s(-1, 0)


def test_max_cached_blocks_leaves_the_last_token_to_compute():
    assert [max_cached_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_should_load_crossover_without_latency():
    # A block is 16 tokens of 1/1024 s each: 1/64 s to compute; 2**20 bytes.
    def rule(bytes_per_s: float) -> PrefixCost:
        return PrefixCost(1 / 1024, 0.0, {"host": bytes_per_s}, {}, 1 << 20, 16)

    at_crossover = rule(64 * 2**20)  # reads a block in exactly 1/64 s
    assert at_crossover.load_s("host", 3) == at_crossover.prefill_s(48, 0) == 3 / 64
    assert not at_crossover.should_load("host", 3, 0)  # a tie computes
    assert rule(64 * 2**20 * 1.001).should_load("host", 3, 0)
    assert not rule(64 * 2**20 * 0.999).should_load("host", 3, 0)
    assert rule(10e9).should_load("host", 1000, 0)  # high bandwidth: load
    assert not rule(1.0).should_load("host", 1000, 0)  # a trickle: recompute
    assert not rule(10e9).should_load("host", 0, 0)  # nothing to load
    assert not rule(10e9).should_load("disk", 1000, 0)  # no bandwidth for disk
    assert rule(10e9).load_s("disk", 4) == math.inf and rule(10e9).load_s("disk", 0) == 0.0


def test_should_load_crossover_with_latency_is_long_runs():
    # Load: n/128 + 1/32 s; compute: n/64 s. Loading wins for n > 4.
    cost = PrefixCost(1 / 1024, 0.0, {"host": 2**27}, {"host": 1 / 32}, 1 << 20, 16)
    assert cost.load_s("host", 4) == cost.prefill_s(64, 0) == 1 / 16
    assert [n for n in range(1, 9) if cost.should_load("host", n, 0)] == [5, 6, 7, 8]


def test_should_copy_is_the_same_rule_for_another_workers_pages():
    # As above: a block is 1/64 s to compute and 2**20 bytes; no tier is needed for a copy.
    cost = PrefixCost(1 / 1024, 0.0, {}, {}, 1 << 20, 16)
    assert cost.copy_s(3, 64 * 2**20) == cost.prefill_s(48, 0) == 3 / 64
    assert not cost.should_copy(3, 64 * 2**20, 0.0, 0)  # a tie computes
    assert cost.should_copy(3, 64 * 2**20 * 1.001, 0.0, 0)
    assert not cost.should_copy(3, 128 * 2**20, 1 / 32, 0)  # 3/128 + 1/32 > 3/64
    assert cost.should_copy(8, 128 * 2**20, 1 / 32, 0)
    assert not cost.should_copy(0, 1e12, 0.0, 0) and cost.copy_s(0, 1.0) == 0.0
    with pytest.raises(ValueError):
        cost.copy_s(1, 0.0)


def test_should_load_later_blocks_sooner():
    # With attention, a block late in the prompt costs more to compute than the same block early.
    cost = PrefixCost(0.0, 1e-6, {"disk": 1e6}, {}, 10_000, 16)  # 10 ms per block read
    # 16 tokens after c cached: 1e-6 * (16 c + 136) s. Equal to 10 ms at c = 616.5.
    assert not cost.should_load("disk", 1, 0)
    assert not cost.should_load("disk", 1, 616)
    assert cost.should_load("disk", 1, 617)


def test_prefix_cost_rejects_bad_config():
    good = dict(per_prefill_token_s=1e-3, tier_bytes_per_s={"host": 1e9}, bytes_per_block=1024)
    PrefixCost(**good)
    for bad in (
        {"per_prefill_token_s": -1.0},
        {"per_prefill_token_s": math.nan},
        {"per_prefill_token_s": True},
        {"per_prefill_attn_pair_s": math.inf},
        {"tier_bytes_per_s": {"pool": 1e9}},
        {"tier_bytes_per_s": {"ssd": 1e9}},
        {"tier_bytes_per_s": {"host": 0.0}},
        {"tier_bytes_per_s": [("host", 1e9)]},
        {"tier_latency_s": {"disk": -0.001}},
        {"bytes_per_block": -1},
        {"bytes_per_block": 1.5},
        {"block_size": 0},
    ):
        with pytest.raises(ConfigError):
            PrefixCost(**{**good, **bad})
    with pytest.raises(ValueError):
        PrefixCost(**good).load_s("pool", 1)
    with pytest.raises(ValueError):
        PrefixCost(**good).load_s("host", -1)


def test_prefix_cost_is_frozen_with_its_maps():
    bandwidth = {"host": 1e9}
    cost = PrefixCost(1e-3, tier_bytes_per_s=bandwidth)
    bandwidth["host"] = 1.0  # the caller's dict is copied
    assert cost.tier_bytes_per_s["host"] == 1e9
    with pytest.raises(TypeError):
        cost.tier_bytes_per_s["host"] = 2.0
    assert cost == PrefixCost(1e-3, tier_bytes_per_s={"host": 1e9})
    hash(cost)


def test_prefix_cost_from_step_cost():
    step = StepCost(0.01, 2e-4, 3e-8, 1e-3, 1e-6)
    cost = PrefixCost.from_step_cost(step, 16, 4096, {"host": 5e9, "disk": 1e9}, {"disk": 1e-4})
    assert (cost.per_prefill_token_s, cost.per_prefill_attn_pair_s) == (2e-4, 3e-8)
    assert (cost.block_size, cost.bytes_per_block) == (16, 4096)
    shape = StepShape(32, causal_attn_pairs(32, 16), 0, 0)
    assert cost.prefill_s(32, 16) == pytest.approx(step.prefill_s(shape))
    assert cost.load_s("disk", 2) == 8192 / 1e9 + 1e-4
    assert PrefixCost.from_step_cost(step, 16, 4096).load_s("host", 1) == math.inf
    assert TIERS == ("pool",) + LOAD_TIERS == ("pool", "host", "disk")


# -- score and choose ----------------------------------------------------------------------


def cost_example() -> PrefixCost:
    # 4-token blocks of 1000 bytes; 1 ms/token + 1 us per attention pair; host reads a block in
    # 1 ms (+ 0.5 ms per load), disk in 10 ms.
    return PrefixCost(1e-3, 1e-6, {"host": 1e6, "disk": 1e5}, {"host": 5e-4}, 1000, 4)


def test_score_composes_loads_and_compute():
    b = chain(6)
    index = index_of(a="n1")
    index.apply("a", "stored", "pool", b[0:2])
    index.apply("a", "stored", "host", b[2:4])
    index.apply("a", "stored", "disk", b[4:6])
    s = score(index, Candidate("a", 0.1), b, 25, cost_example())
    # pool: tokens 0-7. host run (2 blocks, tokens 8-15): load 2 ms + 0.5 ms against computing
    # 8 ms + 1e-6 * (8*8 + 36) = 8.1 ms: load. disk run (tokens 16-23): load 20 ms against
    # 8 ms + 1e-6 * (8*16 + 36) = 8.164 ms: compute, from token 16 to 24: 9 ms + 1e-6 * (9*16 + 45).
    assert s.match == PrefixMatch(2, 2, 2)
    assert s.num_load_blocks == LoadBlocks(2, 0) and s.num_load_blocks.host == 2
    assert s.num_compute_tokens == 9
    assert s.predicted_ttft_s == pytest.approx(0.1 + 0.0025 + 0.009 + 189e-6, abs=1e-12)
    assert s.worker_id == "a"


def test_score_recomputes_everything_after_a_recomputed_run():
    b = chain(6)
    index = index_of(a="n1", b="n2")
    index.apply("a", "stored", "pool", b[0:1])
    index.apply("a", "stored", "host", b[1:2])
    index.apply("a", "stored", "disk", b[2:6])
    cheap_disk = PrefixCost(1e-3, 0.0, {"disk": 1e9}, {}, 1000, 4)  # no host bandwidth
    s = score(index, Candidate("a", 0.0), b, 25, cheap_disk)
    assert s.match == PrefixMatch(1, 1, 4) and s.num_load_blocks == NO_LOADS
    assert s.num_compute_tokens == 21 and s.predicted_ttft_s == pytest.approx(0.021)
    # No host run: the disk run is weighed right after the pool blocks.
    index.apply("b", "stored", "pool", b[0:1])
    index.apply("b", "stored", "disk", b[1:6])
    s = score(index, Candidate("b", 0.0), b, 25, cheap_disk)
    assert s.match == PrefixMatch(1, 0, 5) and s.num_load_blocks == LoadBlocks(0, 5)
    assert s.num_compute_tokens == 1 and s.predicted_ttft_s == pytest.approx(5e-6 + 1e-3)


def test_score_always_computes_the_last_token():
    b = chain(6)
    index = index_of(a="n1")
    index.apply("a", "stored", "pool", b)
    for num_tokens, (num_pool, num_compute) in {24: (5, 4), 25: (6, 1), 23: (5, 3), 1: (0, 1)}.items():
        s = score(index, Candidate("a", 0.0), b, num_tokens, cost_example())
        assert (s.match, s.num_compute_tokens) == (PrefixMatch(num_pool, 0, 0), num_compute)
    cold = score(index, Candidate("nobody", 0.5), b, 25, cost_example())
    assert cold.match == NO_MATCH and cold.num_compute_tokens == 25
    assert cold.predicted_ttft_s == pytest.approx(0.5 + 0.025 + 1e-6 * (25 * 26 // 2))


def test_score_rejects_bad_inputs():
    with pytest.raises(ValueError):
        score(PrefixIndex(), Candidate("a", 0.0), [], 0, cost_example())
    for queued in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError):
            Candidate("a", queued)


def scored(*ttfts: float) -> list[Score]:
    return [Score(f"w{i}", t, NO_MATCH, NO_LOADS, 1) for i, t in enumerate(ttfts)]


def test_choose_the_smallest_predicted_ttft_first_of_ties():
    assert choose([], None) is None and choose([], 1.0) is None
    assert choose(scored(0.3, 0.1, 0.2, 0.1)).worker_id == "w1"
    assert choose(scored(0.2, 0.2)).worker_id == "w0"


def test_choose_with_an_slo():
    scores = scored(0.5, 0.2, 0.3)
    assert choose(scores, 0.25).worker_id == "w1"  # w1 alone meets it
    assert choose(scores, 0.1).worker_id == "w1"  # none meets it: the filter is not applied
    assert choose(scores, 1.0).worker_id == "w1"  # all meet it, all compute as much: fastest
    assert choose(scored(0.2, 0.2), 0.2).worker_id == "w0"  # meeting includes equal
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError):
            choose(scores, bad)


def test_choose_spends_the_slack_on_the_fewest_computed_tokens():
    # w0: idle, computes the whole prompt; w1 holds most of it but has a queue; w2 holds it all
    # behind a longer queue.
    scores = [Score("w0", 0.20, NO_MATCH, NO_LOADS, 100), Score("w1", 0.40, PrefixMatch(5, 0, 0), NO_LOADS, 20),
              Score("w2", 0.90, PrefixMatch(6, 0, 0), NO_LOADS, 1)]
    assert choose(scores).worker_id == "w0"  # no SLO: the fastest
    assert choose(scores, 1.0).worker_id == "w2"  # all meet it: the fewest tokens to compute
    assert choose(scores, 0.5).worker_id == "w1"  # w2 would break it
    assert choose(scores, 0.3).worker_id == "w0"  # only the idle one meets it
    assert choose(scores, 0.1).worker_id == "w0"  # none meets it: the fastest
    ties = [Score("w0", 0.3, NO_MATCH, NO_LOADS, 5), Score("w1", 0.2, NO_MATCH, NO_LOADS, 5)]
    assert choose(ties, 1.0).worker_id == "w1"  # equal work: the faster


# -- the registry's prefix-aware pick ------------------------------------------------------


def _registry(role: str, n: int, block_size: int = 4, ttft_slo_s: float | None = None):
    registry = WorkerRegistry("prefix-aware", ttft_slo_s)
    for i in range(n):
        registry.add(WorkerInfo(m.Register(f"w{i}", role, 0, "h", "model", 1024, 100, block_size,
                                           kv_bytes_per_block=1000)))
    return registry


def _stored(registry, worker_id: str, hashes: list[bytes]) -> None:
    registry.apply_kv_events(worker_id, [m.KVEvent("stored", "pool", hashes)])


def test_prefix_aware_pick_prefers_the_holder_until_its_queue_costs_more():
    registry = _registry("prefill", 2)
    prompt = PromptBlocks(list(range(41)))  # 10 full blocks of 4 and a token
    _stored(registry, "w1", prompt.hashes(4)[:8])
    assert registry.pick("prefill", prompt).worker_id == "w1"
    assert registry.pick("prefill").worker_id == "w0"  # without the prompt: least loaded (first of equals)
    registry.get("w1").take("r1", 20)  # 20 tokens queued ahead there: 41 - 32 + 20 < 41 still
    assert registry.pick("prefill", prompt).worker_id == "w1"
    registry.get("w1").take("r2", 100)  # now computing the whole prompt on w0 is sooner
    assert registry.pick("prefill", prompt).worker_id == "w0"
    registry.apply_kv_events("w1", [m.KVEvent("removed", "pool", prompt.hashes(4)[:8])])
    assert registry.prefix_json("w1") == {"cached_blocks": {"pool": 0, "host": 0, "disk": 0}}


def test_prefix_aware_pick_with_an_slo_keeps_the_holder_while_it_meets_it():
    # No measured rate yet: PRIOR_PREFILL_S_PER_TOKEN (0.5 ms) per token on both.
    prompt = PromptBlocks(list(range(41)))
    for slo, expected in ((None, "w0"), (0.1, "w1"), (0.03, "w0")):
        registry = _registry("prefill", 2, ttft_slo_s=slo)
        _stored(registry, "w1", prompt.hashes(4)[:8])
        registry.get("w1").take("r1", 100)  # w1: (100 + 9) tokens = 54.5 ms; w0: 41 tokens = 20.5 ms
        assert registry.pick("prefill", prompt).worker_id == expected, slo
    # A request's own SLO comes before the registry's.
    assert registry.pick("prefill", PromptBlocks(list(range(41)), ttft_slo_s=1.0)).worker_id == "w1"
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError):
            WorkerRegistry("prefix-aware", bad)


def test_prefix_aware_decode_pick_takes_the_holder_within_the_slack():
    registry = _registry("decode", 2)
    prompt = PromptBlocks(list(range(41)))
    _stored(registry, "w1", prompt.hashes(4)[:3])
    for i in range(DECODE_AFFINITY_SLACK):
        registry.get("w1").take(f"r{i}")
    assert registry.pick("decode", prompt).worker_id == "w1"
    registry.get("w1").take("one-more")
    assert registry.pick("decode", prompt).worker_id == "w0"


def test_registration_again_empties_the_workers_pool_in_the_index():
    registry = _registry("colocated", 1)
    prompt = PromptBlocks(list(range(16)))
    _stored(registry, "w0", prompt.hashes(4))
    assert registry.prefix_json("w0")["cached_blocks"]["pool"] == 4
    registry.add(WorkerInfo(m.Register("w0", "colocated", 0, "h", "model", 1024, 100, 4)))
    assert registry.prefix_json("w0")["cached_blocks"]["pool"] == 0


def test_predicted_ttft_counts_only_the_work_queued_ahead_of_the_class():
    from epdserve.router.admission import check_predicted_ttft
    from epdserve.service import ClassSLO, schedule_key

    registry = WorkerRegistry("least-prefill")
    for i in range(2):  # steps of at most 256 prompt tokens
        registry.add(WorkerInfo(m.Register(f"w{i}", "colocated", 0, "h", "model", 1024, 100, 4,
                                           max_num_batched_tokens=256)))
    prompt = PromptBlocks(list(range(41)))
    w0, w1 = registry.get("w0"), registry.get("w1")
    w0.take("rt", 400, schedule_key("realtime"))
    w0.take("b", 1000, schedule_key("batch"))
    w1.take("i", 600)
    per_token = 5e-4  # PRIOR_PREFILL_S_PER_TOKEN: no measured rate yet
    # Work of its class or ahead of it, and of the rest one step's worth (the step in flight).
    assert w0.prefill_tokens_ahead(schedule_key("realtime")) == 400 + 256
    assert w0.prefill_tokens_ahead() == 400 + 256 and w1.prefill_tokens_ahead() == 600
    assert w0.prefill_tokens_ahead(schedule_key("batch")) == 1400
    assert w1.prefill_tokens_ahead(schedule_key("realtime")) == 256
    assert registry.predict_ttft("colocated", prompt) == pytest.approx(per_token * (600 + 41))
    assert registry.predict_ttft("colocated", prompt, schedule_key("realtime")) == pytest.approx(per_token * (256 + 41))
    assert registry.predict_ttft("decode", prompt) is None
    w0.prefilled("rt")
    assert w0.prefill_tokens_ahead() == 256 and w0.prefill_tokens_ahead(schedule_key("batch")) == 1000

    slo = ClassSLO(ttft_s=0.1)
    assert check_predicted_ttft("interactive", 0.05, slo) is None
    rejection = check_predicted_ttft("interactive", 2.3, slo)
    assert (rejection.status, rejection.reason, rejection.retry_after) == (429, "slo_unreachable", 3)
    assert check_predicted_ttft("batch", 2.3, slo) is None  # deferred, not refused
    assert check_predicted_ttft("interactive", 2.3, ClassSLO(tpot_s=0.1)) is None
    assert check_predicted_ttft("interactive", None, slo) is None


def test_prefill_rate_is_the_per_token_part_of_steps_of_several_sizes():
    """Steps of 70 ms plus 0.8 ms a token (the shape measured on one core): the rate is the
    0.8 ms a token spares, not the 4.5 ms a 16-token step averages per token."""
    rate = PrefillRate()
    rate.observe(999, 5.0)  # the first step pays the warm-up: left out
    assert rate.per_token_s == 0.0
    for n in (16, 16, 1552, 16, 800, 16, 32):
        rate.observe(n, 0.070 + 0.0008 * n)
    assert rate.per_token_s == pytest.approx(0.0008)
    rate.observe(8, 1.0)  # under min_tokens: ignored
    assert rate.per_token_s == pytest.approx(0.0008)


def test_prefill_rate_of_one_step_size_is_the_median_per_token():
    rate = PrefillRate(window=4)
    rate.observe(100, 1.0)
    for seconds in (0.10, 0.12, 0.11, 0.30, 0.11):
        rate.observe(128, seconds)
    # the window keeps the last four; all one size: no slope to fit
    assert rate.per_token_s == pytest.approx(0.115 / 128)


def test_prefill_rate_falls_back_when_noise_makes_the_slope_non_positive():
    rate = PrefillRate()
    rate.observe(100, 1.0)
    rate.observe(16, 0.10)
    rate.observe(64, 0.09)  # a larger step that ran faster
    assert rate.per_token_s == pytest.approx(statistics.median([0.10 / 16, 0.09 / 64]))
