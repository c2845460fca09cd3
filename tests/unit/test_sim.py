"""Cluster simulator: hand-computed latencies, shared scheduler classes, prefix hits from trace
hash ids, bench-shaped results, fast-forward equivalence, and bad input.

The profiles here are small synthetic dicts: the cost model is not the subject, so its
coefficients are chosen to make the expected times easy to compute by hand.
"""

import json

import numpy as np
import pytest
from sim_profiles import STEP, profile_dict

from epdserve.bench.metrics import RequestOutput, compute_metrics
from epdserve.bench.report import RunInfo, build_result
from epdserve.engine.kv_cache import KVCacheManager
from epdserve.engine.scheduler import Scheduler
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.sim.cluster import ClusterSim, SimConfig
from epdserve.sim.cost_model import CostModel, StepCost
from epdserve.sim.instance import Link
from epdserve.sim.results import build_sim_result
from epdserve.sim.topology import Topology, parse_topology
from epdserve.sim.workload import SimWorkload, random_workload, trace_workload


def fixed_workload(arrivals, input_lens, output_lens, hash_ids=None, **kw):
    return SimWorkload("fixed", np.asarray(arrivals, dtype=float), np.asarray(input_lens, dtype=np.int64),
                       np.asarray(output_lens, dtype=np.int64), hash_ids, **kw)


def run(profile, topology, workload, **config):
    sim = ClusterSim(CostModel.from_dict(profile), SimConfig(parse_topology(topology), **config), workload)
    return sim, sim.run()


# -- hand-computed runs ----------------------------------------------------------------------
def test_colocated_single_request_with_every_cost_term():
    step = {"base_s": 0.01, "per_prefill_token_s": 1e-3, "per_prefill_attn_pair_s": 1e-6,
            "per_decode_seq_s": 2e-3, "per_decode_context_token_s": 1e-5}
    _, rec = run(profile_dict(step), "colocated=1", fixed_workload([0.5], [32], [4]))
    prefill = 0.01 + 32e-3 + 1e-6 * (32 * 33 // 2)  # P = 32 tokens, A = 528 query-key pairs
    decodes = [0.01 + 2e-3 + 1e-5 * ctx for ctx in (33, 34, 35)]  # context grows by one per token
    assert rec.ttft[0] == pytest.approx(prefill)
    assert rec.latency[0] == pytest.approx(prefill + sum(decodes))
    assert rec.itls[0] == pytest.approx(tuple(decodes))
    assert rec.output_len[0] == 4


def test_colocated_two_requests_share_steps():
    # Both arrive at 0; the first arrival starts a step at once, the second joins the next one,
    # a mixed step (one decode, a 50-token prefill); then both decode together, then one alone.
    _, rec = run(profile_dict(), "colocated=1", fixed_workload([0.0, 0.0], [100, 50], [5, 3]))
    first = 0.01 + 0.100
    mixed = 0.01 + 0.050 + 2e-3
    two, one = 0.01 + 2 * 2e-3, 0.01 + 2e-3
    assert rec.ttft == pytest.approx([first, first + mixed])
    assert rec.latency[1] == pytest.approx(first + mixed + 2 * two)
    assert rec.latency[0] == pytest.approx(first + mixed + 2 * two + one)
    assert rec.itls[0] == pytest.approx((mixed, two, two, one))


def test_neighbour_slowdown_on_a_shared_host():
    # Two colocated instances on one host; a step goes at 1 / 1.5 of its pace while the other
    # instance is mid-step. Request 0 reaches instance 0 at 0 (0.11 s of work, neighbour idle);
    # request 1 reaches instance 1 at 0.05: from then both go at 1 / 1.5, so instance 0's last
    # 0.06 s of work end at 0.05 + 0.09 = 0.14, and instance 1, 0.06 s done by then, runs its last
    # 0.05 s alone: both TTFTs 0.14.
    profile = profile_dict()
    profile["roles"]["colocated"]["neighbour_slowdown"] = 0.5
    workload = fixed_workload([0.0, 0.05], [100, 100], [1, 1])
    _, shared = run(profile, "colocated=2", workload, instances_per_host=2)
    assert shared.ttft == pytest.approx([0.14, 0.14])
    _, apart = run(profile, "colocated=2", workload, instances_per_host=1)
    assert apart.ttft == pytest.approx([0.11, 0.11])
    # Stepping every step (no fast-forward) is what makes the neighbour's state visible.
    sim, _ = run(profile, "colocated=2", fixed_workload([0.0], [16], [8]), instances_per_host=2)
    assert not sim.is_fast_forward
    # A calibrated profile's neighbour step: extra seconds per term (here 10 ms base and 0.5 ms
    # per prefill token: 60 ms more for a 100-token prefill next to a busy neighbour throughout,
    # a pace of 0.11 / 0.17 while the other is mid-step), and the same overlap as above.
    profile = profile_dict()
    profile["roles"]["colocated"]["neighbour_step"] = {
        "base_s": 0.01, "per_prefill_token_s": 5e-4, "per_prefill_attn_pair_s": 0.0, "per_decode_seq_s": 0.0,
        "per_decode_context_token_s": 0.0}
    _, shared = run(profile, "colocated=2", workload, instances_per_host=2)
    assert shared.ttft == pytest.approx([0.05 + 0.06 * 0.17 / 0.11] * 2)
    # The same two requests 1 s apart: neither step meets the other, each takes its 0.11 s.
    _, alone = run(profile, "colocated=2", fixed_workload([0.0, 1.0], [100, 100], [1, 1]), instances_per_host=2)
    assert alone.ttft == pytest.approx([0.11, 0.11])


def test_pd_first_token_at_prefill_end_and_decode_after_layerwise_transfer():
    # 100 prompt tokens x 1000 B over 4 layers on a 1 MB/s link: 25 ms of sending per layer.
    # Prefill step 0.11 s: layer i is computed at 0.0275 (i+1); sends end at 0.0525, 0.08,
    # 0.1075 and 0.135, so 25 ms of the transfer is exposed after the prefill step.
    sim, rec = run(profile_dict(), "prefill=1,decode=1", fixed_workload([0.0], [100], [3]), link_bytes_per_s=1e6)
    assert rec.ttft[0] == pytest.approx(0.11)
    decode_step = 0.01 + 2e-3
    assert rec.latency[0] == pytest.approx(0.135 + 2 * decode_step)
    assert rec.itls[0] == pytest.approx((0.135 - 0.11 + decode_step, decode_step))
    assert rec.components["exposed_transfer_ms"][0] == pytest.approx(25.0)
    assert rec.components["prefill_ms"][0] == pytest.approx(110.0)
    prefill, decode = sim.instances
    assert prefill.kv_cache.is_all_free() and decode.kv_cache.num_used_blocks() == 0
    assert prefill.link.num_bytes == 100 * 1000


def test_sliding_window_groups_send_only_the_window():
    """The simulator sends what the engine sends (tests/e2e/test_sliding_window_pd.py): full
    groups every position, a sliding group only from the block a query at the prompt's end sees."""
    profile = {**profile_dict(kv_bytes=600), "kv_groups": [{"window": None, "bytes_per_token": 100},
                                                          {"window": 512, "bytes_per_token": 500}]}
    cost = CostModel.from_dict(profile)
    assert CostModel.from_dict(cost.to_dict()).kv_groups == cost.kv_groups
    kept = (700 - 511) // 16 * 16  # 176: the first block position 699 - 511 falls in
    whole = 700 * 100 + (700 - kept) * 500
    assert cost.kv_bytes_sent(0, 700, 700) == whole
    assert sum(cost.kv_bytes_sent(a, min(a + 256, 700), 700) for a in range(0, 700, 256)) == whole  # chunked
    assert cost.kv_bytes_sent(0, 100, 100) == 100 * 600  # within the window: every layer
    sim, _ = run(profile, "prefill=1,decode=1", fixed_workload([0.0], [700], [2]), link_bytes_per_s=1e9)
    assert sim.instances[0].link.num_bytes == whole
    with pytest.raises(ConfigError, match="window"):
        CostModel.from_dict({**profile, "kv_groups": [{"window": 0, "bytes_per_token": 1}]})


def test_pd_reservation_waits_for_the_decode_step_in_flight():
    # A worker reads control messages between steps. r0 (100 tokens) is prefilled by 0.11 s
    # and decodes from then on in 12 ms steps (its KV lands at once on a 1 TB/s link). r1
    # arrives at 0.2 s, mid-step: the decode instance answers its reservation when that step
    # ends (0.11 + 8 x 0.012 = 0.206 s), and only then does r1's 20 ms prefill start.
    _, rec = run(profile_dict(), "prefill=1,decode=1", fixed_workload([0.0, 0.2], [100, 10], [50, 2]),
                 link_bytes_per_s=1e12)
    assert rec.ttft[0] == pytest.approx(0.11)
    assert rec.ttft[1] == pytest.approx(0.11 + 8 * 0.012 + 0.02 - 0.2, abs=1e-6)
    assert rec.components["queue_ms"][1] == pytest.approx(6.0, abs=1e-3)


def test_layerwise_closed_form_matches_layer_by_layer_sends():
    for free_at, sizes, layers, step_s in [(0.0, [1000, 3000], 4, 0.1), (0.5, [500], 3, 0.2),
                                           (0.0, [10**6, 10], 30, 0.05), (0.0, [7], 1, 0.01)]:
        link = Link(1e5)
        link.free_at = free_at
        ends = link.send_layerwise(0.0, step_s, layers, sizes)
        t, expected = free_at, []
        for i in range(layers):
            ready = step_s * (i + 1) / layers
            for size in sizes:
                t = max(t, ready) + size / layers / 1e5
                if i == layers - 1:
                    expected.append(t)
        assert ends == pytest.approx(expected)
        assert link.free_at == pytest.approx(t)


def test_encode_then_prefill_image_before_text():
    # One image of one tile (16 tokens) ahead of the text: encode 0.052 s, embeddings 16 x 1000 B
    # at 1 MB/s (0.016 s), then a 48-token prefill step (0.058 s).
    w = fixed_workload([0.0], [32], [2], num_images=1, tiles_per_image=1)
    _, rec = run(profile_dict(), "encode=1,prefill=1,decode=1", w, link_bytes_per_s=1e6, images_after_text=False)
    assert rec.components["encode_ms"][0] == pytest.approx(68.0)
    assert rec.components["queue_ms"][0] == pytest.approx(0.0)
    assert rec.ttft[0] == pytest.approx(0.068 + 0.058)
    assert rec.prompt_len[0] == 48


def test_waiting_for_the_encoder_is_queue_as_the_server_reports_it():
    # Two requests with an image each at 0, one encoder: the second's image waits for the
    # first's batch (0.052 s), then encodes and lands as the first's did (0.068 s); its prefill
    # waits for the first's step (0.068-0.126 s). Queue is every wait, as router/timing.py has it.
    w = fixed_workload([0.0, 0.0], [32, 32], [2, 2], num_images=1, tiles_per_image=1)
    _, rec = run(profile_dict(), "encode=1,prefill=1,decode=1", w, link_bytes_per_s=1e6,
                 images_after_text=False)
    c = rec.components
    assert c["encode_ms"][0] == pytest.approx(68.0) and c["queue_ms"][0] == pytest.approx(0.0)
    assert c["encode_ms"][1] == pytest.approx(68.0)
    assert c["queue_ms"][1] == pytest.approx(52.0 + (126.0 - 120.0))
    for i in range(2):
        assert sum(c[k][i] for k in c if k != "exposed_transfer_ms") == pytest.approx(rec.ttft[i] * 1e3)


def test_text_before_the_image_is_prefilled_while_it_encodes():
    # The image after the text (as bench's random-mm sends it): the 32 text tokens are computed
    # at once (0.042 s, inside the 0.068 s the embedding takes), then the 16 image tokens
    # (0.026 s) once it is there.
    w = fixed_workload([0.0], [32], [2], num_images=1, tiles_per_image=1)
    sim, rec = run(profile_dict(), "encode=1,prefill=1,decode=1", w, link_bytes_per_s=1e6)
    assert rec.components["encode_ms"][0] == pytest.approx(68.0)
    assert rec.ttft[0] == pytest.approx(0.068 + 0.026)
    assert rec.prompt_len[0] == 48
    prefill = next(i for i in sim.instances if i.worker.role == "prefill")
    assert prefill.scheduler.num_computed_prompt_tokens == 48


def test_pipelined_prefill_starts_before_the_last_image():
    w = fixed_workload([0.0], [32], [2], num_images=3, tiles_per_image=2)
    cfg = {"link_bytes_per_s": 1e6, "encode_max_batch_images": 1}
    _, piped = run(profile_dict(), "encode=1,prefill=1,decode=1", w, **cfg)
    _, whole = run(profile_dict(), "encode=1,prefill=1,decode=1", w, is_mm_pipelined=False, **cfg)
    assert piped.ttft[0] < whole.ttft[0]


def test_instances_on_one_core_time_share_it():
    # Two colocated instances, both requests at 0: on two cores each prefill (0.042 s) runs
    # alone; on one core they share it fairly from the start, and both end at twice their time.
    w = fixed_workload([0.0, 0.0], [32, 32], [1, 1])
    _, apart = run(profile_dict(), "colocated=2", w, instances_per_host=2, cores_per_host=2)
    assert sorted(apart.ttft) == pytest.approx([0.042, 0.042])
    sim, shared = run(profile_dict(), "colocated=2", w, instances_per_host=2, cores_per_host=1)
    assert sorted(shared.ttft) == pytest.approx([0.084, 0.084])
    # The second arrives halfway through the first's prefill: the first's last 0.021 s of work
    # take 0.042 s (ends 0.063); the second has done 0.021 s by then and runs the rest alone
    # (ends 0.084). Judged at the step's start instead, the first would end at 0.042 unslowed and
    # the second at 0.021 + 0.084.
    late_sim, late = run(profile_dict(), "colocated=2", fixed_workload([0.0, 0.021], [32, 32], [1, 1]),
                         instances_per_host=2, cores_per_host=1)
    assert late.ttft == pytest.approx([0.063, 0.063])
    assert [i.busy_s for i in late_sim.instances] == pytest.approx([0.063, 0.063])  # the re-timed steps' time
    assert all(len(i.sharers) == 1 and not i.neighbours for i in sim.instances) and not sim.is_fast_forward
    # E/P/D on two cores, placed as serve pins workers (one rule: cluster/local.py core_sets): the
    # encoder and the decode worker share core 0.
    from epdserve.cluster.local import core_sets
    assert core_sets(3, 1, [0, 1]) == [(0,), (1,), (0,)] and core_sets(2, 2, [0, 1, 2]) == [(0, 1), (2, 0)]
    sim, _ = run(profile_dict(), "encode=1,prefill=1,decode=1", fixed_workload([0.0], [32], [2], num_images=1,
                 tiles_per_image=1), instances_per_host=3, cores_per_host=2)
    by_role = {i.worker.role: i for i in sim.instances}
    assert by_role["decode"].sharers == [by_role["encode"]] and by_role["prefill"].sharers == []
    assert set(by_role["prefill"].neighbours) == {by_role["encode"], by_role["decode"]}
    with pytest.raises(ConfigError, match="cores per host"):
        run(profile_dict(), "colocated=2", w, cores_per_host=-1)


# -- the engine's classes ----------------------------------------------------------------------
def test_simulator_drives_the_engines_scheduler_and_kv_manager():
    sim, _ = run(profile_dict(), "prefill=1,decode=2", fixed_workload([0.0], [20], [2]))
    for inst in sim.instances:
        assert type(inst.scheduler) is Scheduler
        assert type(inst.kv_cache) is KVCacheManager
        assert inst.scheduler.kv_cache is inst.kv_cache


def test_trace_hash_ids_give_prefix_hits(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
            {"timestamp": 1000, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
            {"timestamp": 2000, "input_length": 1024, "output_length": 2, "hash_ids": [0, 2]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    w = trace_workload(str(trace))
    sim, _ = run(profile_dict(), "colocated=1", w)
    # Request 2 reuses 1008 tokens (whole blocks, at least one token left), request 3 one
    # 512-token trace block.
    assert sim.instances[0].scheduler.num_computed_prompt_tokens == 1024 + 16 + 512
    sim, _ = run(profile_dict(), "colocated=1", w, enable_prefix_caching=False)
    assert sim.instances[0].scheduler.num_computed_prompt_tokens == 3 * 1024


def test_azure_csv_trace(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n1.5,30,4\n0.5,20,3\n")
    w = trace_workload(str(path), time_scale=2.0)
    assert list(w.arrival_s) == [0.0, 2.0] and list(w.input_lens) == [20, 30] and list(w.output_lens) == [3, 4]
    assert w.hash_ids is None


# -- results ------------------------------------------------------------------------------------
def test_result_has_bench_keys_plus_simulator_section():
    sim, rec = run(profile_dict(), "prefill=1,decode=1", random_workload(30, 5.0, 64, 8, 0.5, seed=1))
    result = build_sim_result(rec, "synthetic", 5.0, 1.0, (50, 99), {"ttft": 500}, sim.summary())
    timing = {"queue_ms": 1.0, "encode_ms": 0.0, "prefill_ms": 2.0, "exposed_transfer_ms": 0.0, "first_token_ms": 0.0}
    outputs = [RequestOutput(True, 0.0, 1.0, 0.1, (0.2, 0.3), 10, 3, "", "", timing)]
    metrics = compute_metrics(outputs, 1.0, (50, 99), {"ttft": 500})
    info = RunInfo("openai", "m", "m", 1, 5.0, 1.0, None)
    bench = build_result(info, outputs, 1.0, metrics, ttft_breakdown={"queue_ms": {"mean": 1.0, "p99": 1.0}})
    assert set(result) - {"simulator"} == set(bench)
    assert result["completed"] + result["failed"] == 30
    json.dumps(result)


def test_admission_defaults_are_the_routers():
    core = pytest.importorskip("epdserve.router.core")  # the router module imports the worker stack
    from epdserve.router.admission import DEFAULT_MAX_PENDING, DEFAULT_MAX_WAITING_PER_WORKER

    config = core.RouterConfig()
    assert (DEFAULT_MAX_PENDING, DEFAULT_MAX_WAITING_PER_WORKER) == (config.max_pending, config.max_waiting_per_worker)
    assert SimConfig(parse_topology("prefill=1,decode=1")).decode_queue_timeout_s == config.decode_queue_timeout_s


def test_admission_limits_fail_requests():
    w = fixed_workload([0.0] * 5, [100] * 5, [4] * 5)
    _, rec = run(profile_dict(), "colocated=1", w, max_pending=2)
    assert (~rec.is_ok).sum() == 3 and all(e.startswith("429") for e in rec.errors.values())
    # decode reserves 2 at most; without a queue the other three are refused at once
    _, rec = run(profile_dict(max_num_seqs=2), "prefill=1,decode=1", w, decode_queue_timeout_s=0)
    assert (~rec.is_ok).sum() == 3 and all(e.startswith("503") for e in rec.errors.values())


def test_full_decode_instance_queues_reservations_first_come_first_served():
    # Two seats on the decode instance: requests 2-4 wait for the first two to finish, in order.
    w = fixed_workload([0.0, 0.0, 0.01, 0.02, 0.03], [100] * 5, [4] * 5)
    _, rec = run(profile_dict(max_num_seqs=2), "prefill=1,decode=1", w)
    assert rec.is_ok.all() and not rec.errors
    first_two_done = max(rec.latency[0], rec.latency[1])
    ttft = rec.ttft
    assert min(ttft[2:] + w.arrival_s[2:]) >= first_two_done  # none started before a seat came free
    assert list(np.argsort(ttft + w.arrival_s, kind="stable")) == [0, 1, 2, 3, 4]
    # A wait shorter than the first requests' decode: the waiting ones are refused at its end.
    _, rec = run(profile_dict(max_num_seqs=2), "prefill=1,decode=1", w, decode_queue_timeout_s=1e-3)
    assert rec.is_ok[:2].all() and (~rec.is_ok[2:]).all()
    assert all(e.startswith("503") for e in rec.errors.values())
    assert rec.latency[2] == pytest.approx(1e-3, abs=0.25)  # refused within a step or heartbeat of its deadline


# -- fast-forward ------------------------------------------------------------------------------
@pytest.mark.parametrize("topology,blocks,budget,seed", [
    ("colocated=2", 1000, 2048, 0),
    ("colocated=1", 60, 2048, 1),  # KV pressure: preemptions
    ("colocated=1", 1000, 33, 2),  # chunks that leave one prompt token for a later step
    ("prefill=1,decode=2", 1000, 2048, 3),
    ("prefill=1,decode=1", 60, 2048, 4),
])
def test_fast_forward_gives_the_same_result_as_stepping(topology, blocks, budget, seed):
    w = random_workload(60, 8.0, 96, 40, 0.9, seed=seed)
    profile = profile_dict({**STEP, "per_decode_context_token_s": 1e-6}, num_kv_blocks=blocks, budget=budget)
    stepped_sim, stepped = run(profile, topology, w, is_fast_forward=False)
    fast_sim, fast = run(profile, topology, w, is_fast_forward=True)
    assert fast_sim.stats.num_events < stepped_sim.stats.num_events
    for key in ("is_ok", "ttft", "latency", "output_len"):
        assert np.array_equal(getattr(stepped, key), getattr(fast, key)), key
    assert stepped.itls == fast.itls and stepped.errors == fast.errors
    for a, b in zip(stepped_sim.instances, fast_sim.instances):
        assert a.scheduler.num_preemptions == b.scheduler.num_preemptions
        assert a.num_steps == b.num_steps


def test_decode_step_times_are_time_s_exactly():
    # A stretch's step times come from decode_times_s: the same floats as time_s per shape.
    for coefficients in [(0.01, 1e-3, 1e-6, 2e-3, 1e-6), (0.02985, 3.504e-4, 4.597e-6, 6.26e-4, 0.0),
                         (0.0, 0.0, 0.0, 1.859e-3, 3.3e-7)]:
        for knots in ((), ((2, 0.9), (8, 1.25), (16, 1.0))):
            cost = StepCost(*coefficients, decode_factors=knots)
            for num_seqs, context in [(1, 0), (7, 1234), (256, 90000)]:
                expected = [cost.time_s(StepShape(0, 0, num_seqs, context + j * num_seqs)) for j in range(40)]
                assert cost.decode_times_s(num_seqs, context, 40) == expected


def test_decode_factors_by_batch_size():
    """A calibrated step cost's factor per decode batch size: linear between knots, the end
    knots' beyond them, decode-only steps only; kept through scaling and the profile file."""
    knots = ((2, 0.9), (8, 1.2), (16, 1.0))
    cost = StepCost(0.01, 1e-3, 0.0, 2e-3, 0.0, decode_factors=knots)
    plain = StepCost(0.01, 1e-3, 0.0, 2e-3, 0.0)
    for num_seqs, factor in [(1, 0.9), (2, 0.9), (5, 1.05), (8, 1.2), (12, 1.1), (16, 1.0), (300, 1.0)]:
        shape = StepShape(0, 0, num_seqs, 100 * num_seqs)
        assert cost.time_s(shape) == pytest.approx(factor * plain.time_s(shape))
        assert sum(cost.parts_s(shape)) == pytest.approx(cost.time_s(shape))
    mixed = StepShape(64, 64 * 65 // 2, 8, 800)  # a step that prefills: no factor
    assert cost.time_s(mixed) == plain.time_s(mixed) and cost.parts_s(mixed) == plain.parts_s(mixed)
    assert cost.scaled(2.0).decode_factors == knots
    assert StepCost.from_dict(cost.to_dict()) == cost and "decode_factors" not in plain.to_dict()
    assert StepCost.from_dict(plain.to_dict()) == plain  # profiles without knots read as before
    for bad, message in [(((0, 1.0),), "batch size"), (((2, 0.0),), "factor must be > 0"),
                         (((4, 1.0), (2, 1.0)), "must increase"), (((2, 1.0, 3),), "pairs")]:
        with pytest.raises(ConfigError, match=message):
            StepCost(0.01, 0.0, 0.0, 0.0, 0.0, decode_factors=bad)
    with pytest.raises(ConfigError, match="decode_factors"):
        StepCost.from_dict({**plain.to_dict(), "decode_factors": "fast"})


@pytest.mark.parametrize("blocks", [1000, 40])
def test_reservations_beside_a_stretch_give_the_same_result_as_stepping(monkeypatch, blocks):
    # A decode instance takes a reservation without cutting its decode stretch when the
    # blocks fit beside the stretch's own; with few blocks some do not fit and cut it.
    from epdserve.sim import fastforward

    fits = []
    free_after = fastforward.free_after

    def counted(inst, stretch, num_free):
        left = free_after(inst, stretch, num_free)
        fits.append(left >= 7)  # the workload's prompts (<= 96 tokens) and first token: <= 7 blocks
        return left

    monkeypatch.setattr(fastforward, "free_after", counted)
    w = random_workload(80, 6.0, 96, 60, 0.9, seed=7)
    profile = profile_dict({**STEP, "per_decode_context_token_s": 1e-6}, num_kv_blocks=blocks)
    stepped_sim, stepped = run(profile, "prefill=1,decode=2", w, is_fast_forward=False)
    fast_sim, fast = run(profile, "prefill=1,decode=2", w, is_fast_forward=True)
    assert any(fits) and (blocks > 100 or not all(fits))
    for key in ("is_ok", "ttft", "latency", "output_len"):
        assert np.array_equal(getattr(stepped, key), getattr(fast, key)), key
    assert stepped.itls == fast.itls and stepped.errors == fast.errors
    for a, b in zip(stepped_sim.instances, fast_sim.instances):
        assert (a.num_steps, a.busy_s) == (b.num_steps, b.busy_s)
        assert a.kv_cache.is_all_free() and b.kv_cache.is_all_free()  # every block back, either way


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["", "colocated=0", "colocated=-1", "gpu=2", "colocated=2,prefill=1,decode=1",
                                  "decode=2", "prefill=1", "encode=1", "colocated", "colocated=x", "colocated=1,colocated=2"])
def test_bad_topology(spec):
    with pytest.raises(ConfigError):
        parse_topology(spec)


def test_topology_parses():
    assert parse_topology("encode=1, prefill=2,decode=6") == Topology(num_encode=1, num_prefill=2, num_decode=6)
    assert parse_topology("colocated=4").spec == "colocated=4"


def _write(tmp_path, text):
    path = tmp_path / "profile.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: "{not json", "not JSON"),
    (lambda d: {**d, "version": 2}, "version"),
    (lambda d: {k: v for k, v in d.items() if k != "kv_bytes_per_token"}, "kv_bytes_per_token"),
    (lambda d: {**d, "roles": {**d["roles"], "decode": {**d["roles"]["decode"], "step": {**STEP, "per_decode_seq_s": -1.0}}}},
     "per_decode_seq_s"),
    (lambda d: {**d, "roles": {**d["roles"], "gpu": {}}}, "unknown role"),
])
def test_bad_profile_is_a_config_error(tmp_path, mutate, message):
    data = mutate(profile_dict())
    path = _write(tmp_path, data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ConfigError, match=message):
        CostModel.load(path)


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    from epdserve.cli import main

    good = _write(tmp_path, json.dumps(profile_dict()))
    (tmp_path / "bad.json").write_text("[1, 2")
    cases = [
        ["--profile", str(tmp_path / "bad.json"), "--topology", "colocated=1"],
        ["--profile", good, "--topology", "colocated=1,decode=2"],
        ["--profile", str(tmp_path / "missing.json"), "--topology", "colocated=1"],
    ]
    for args in cases:
        code = main(["simulate", *args, "--workload", "random", "--rate", "1", "--num-requests", "3"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("epdserve: error:") and err.count("\n") == 1


def test_cli_simulate_writes_the_result(tmp_path, capsys):
    from epdserve.cli import main

    good = _write(tmp_path, json.dumps(profile_dict()))
    out = tmp_path / "r.json"
    code = main(["simulate", "--profile", good, "--topology", "prefill=1,decode=1", "--workload", "random",
                 "--rate", "4", "--num-requests", "20", "--random-input-len", "64", "--random-output-len", "8",
                 "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 20 and result["simulator"]["topology"] == "prefill=1,decode=1"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_compare_to_a_real_result_prints_each_metrics_error(tmp_path, capsys):
    """``--compare-to``: the same run simulated twice stands in for a real result (the bench
    keys match), then one whose TTFT is doubled: the errors are exact."""
    from epdserve.cli import main
    from epdserve.sim.compare import compare_results

    good = _write(tmp_path, json.dumps(profile_dict()))
    args = ["simulate", "--profile", good, "--topology", "prefill=1,decode=1", "--workload", "random", "--rate", "4",
            "--num-requests", "20", "--random-input-len", "64", "--random-output-len", "8",
            "--goodput", "ttft:500", "tpot:50"]
    first = tmp_path / "first.json"
    assert main([*args, "--out", str(first)]) == 0
    real = json.loads(first.read_text())
    real["median_ttft_ms"] *= 2
    real["request_goodput"] = real["request_goodput"] or 1.0
    real["ttft_breakdown_ms"]["queue_ms"]["mean"] += 5.0
    slower = tmp_path / "real.json"
    slower.write_text(json.dumps(real))
    capsys.readouterr()
    out = tmp_path / "second.json"
    assert main([*args, "--compare-to", str(slower), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "-50.0 %" in printed and "median_ttft_ms" in printed and "mean absolute error" in printed
    rows = {r["metric"]: r for r in json.loads(out.read_text())["comparison"]["metrics"]}
    assert rows["median_ttft_ms"]["error"] == pytest.approx(-0.5)
    assert rows["p99_tpot_ms"]["error"] == pytest.approx(0.0) and "request_goodput" in rows
    # each TTFT part's mean beside the real one's, in ms, outside the mean error
    parts = {r["part"]: r for r in json.loads(out.read_text())["comparison"]["ttft_parts"]}
    assert parts["queue_ms"]["difference_ms"] == pytest.approx(-5.0) and "TTFT part" in printed
    assert parts["prefill_ms"]["difference_ms"] == pytest.approx(0.0)
    assert set(parts) == {"queue_ms", "encode_ms", "prefill_ms", "exposed_transfer_ms", "first_token_ms"}
    from epdserve.sim.compare import compare_ttft_parts  # a breakdown not of bench's shape is left out
    assert compare_ttft_parts(real, {**real, "ttft_breakdown_ms": [1, 2]}) == []
    assert compare_ttft_parts(real, {**real, "ttft_breakdown_ms": {"queue_ms": 3}}) == []
    # goodput under other SLOs is not compared; a file that is no result is a one-line error
    assert "request_goodput" not in {r["metric"] for r in compare_results({**real, "goodput_slos_ms": None}, real)}
    (tmp_path / "no.json").write_text("{}")
    assert main([*args, "--compare-to", str(tmp_path / "no.json")]) == 2
    assert "not a bench result" in capsys.readouterr().err


def test_request_too_large_for_the_kv_cache_is_a_config_error():
    with pytest.raises(ConfigError, match="holds"):
        run(profile_dict(num_kv_blocks=4), "colocated=1", fixed_workload([0.0], [100], [4]))


def test_step_shape_counts_prefill_and_decode_entries():
    from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
    from epdserve.request import Request
    from epdserve.sampling import SamplingParams

    prompt = Request("a", list(range(10)), SamplingParams())
    decoding = Request("b", list(range(5)), SamplingParams())
    decoding.output_token_ids = [1, 2]
    out = SchedulerOutput([ScheduledRequest(prompt, 4, 6, [], True), ScheduledRequest(decoding, 6, 1, [], True)])
    shape = StepShape.from_scheduler_output(out)
    assert shape == StepShape(6, 6 * 4 + 21, 1, 7)
    assert StepCost(1.0, 0.5, 0.0, 2.0, 0.0).time_s(shape) == 1.0 + 3.0 + 2.0


def test_prefix_aware_routing_in_the_simulator(tmp_path):
    """The simulator routes with the router's registry: under ``prefix-aware`` a repeated
    prefix goes to the instance that cached it (fewer prompt tokens computed over all), under
    ``least-prefill`` to whichever is least loaded."""
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 200, "hash_ids": [0, 1]},
            {"timestamp": 3000, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
            {"timestamp": 3100, "input_length": 1024, "output_length": 2, "hash_ids": [0, 2]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    w = trace_workload(str(trace))
    computed = {}
    for routing in ("least-prefill", "prefix-aware"):
        sim, _ = run(profile_dict(), "colocated=2", w, routing=routing)
        computed[routing] = sum(inst.scheduler.num_computed_prompt_tokens for inst in sim.instances)
    # Least-prefill sends the second request to the idle instance (the first still decodes
    # its 200 tokens), which computes it all; prefix-aware sends the second and the third
    # to the holder of blocks 0 (and 1).
    assert computed["least-prefill"] > computed["prefix-aware"]
    assert computed["prefix-aware"] == 1024 + 16 + 512


def _evicting_trace(tmp_path):
    """Prefix X, then prefix Y (evicts X from a 70-block pool), then X again."""
    trace = tmp_path / "evict.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]},
            {"timestamp": 5000, "input_length": 1024, "output_length": 2, "hash_ids": [2, 3]},
            {"timestamp": 10000, "input_length": 1024, "output_length": 2, "hash_ids": [0, 1]}]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    return trace_workload(str(trace))


def test_pd_decode_holds_the_prefix_and_only_the_delta_moves(tmp_path):
    """P/D: the decode instance's reservation names the prompt's blocks and takes those its
    prefix cache holds; the prefill instance sends only the rest, and takes from decode's pages
    (on one host) what its own pool lost instead of computing it (``reload_rule.pull_span`` and
    ``PrefixCost.should_copy``, as engine/kv_pull.py)."""
    w = _evicting_trace(tmp_path)  # X, then Y (evicts X from a 70-block prefill pool), then X
    profile = profile_dict()
    profile["roles"]["prefill"]["num_kv_blocks"] = 70
    sim, rec = run(profile, "prefill=1,decode=1", w, instances_per_host=2)
    prefill, decode = sim.instances
    # Decode's 1000 blocks still hold X's 63 whole blocks: of the third prompt 16 tokens are sent.
    assert prefill.link.num_bytes == (1024 + 1024 + 16) * 1000
    num_pool_hit = 63 - prefill.puller.num_pulled_blocks  # X's head may survive in prefill's pool
    assert 0 <= num_pool_hit < 8
    assert prefill.scheduler.num_computed_prompt_tokens == 2 * 1024 + 16
    assert prefill.kv_cache.is_all_free() and decode.kv_cache.num_used_blocks() == 0  # only the caches hold blocks
    # On two hosts nothing is copied (a worker copies over shared memory only): X is computed
    # again, and still only the 16 tokens decode lacks are sent.
    far, far_rec = run(profile, "prefill=1,decode=1", w)
    assert far.instances[0].puller.num_pulled_blocks == 0
    assert far.instances[0].scheduler.num_computed_prompt_tokens == 3 * 1024 - num_pool_hit * 16
    assert far.instances[0].link.num_bytes == (1024 + 1024 + 16) * 1000
    assert rec.ttft[2] < far_rec.ttft[2] - 0.5  # ~1 s of prefill (1e-3 per token) became a copy
    # Without a prefix cache every prompt is computed and sent whole.
    off, _ = run(profile, "prefill=1,decode=1", w, instances_per_host=2, enable_prefix_caching=False)
    assert off.instances[0].link.num_bytes == 3 * 1024 * 1000
    assert off.instances[0].scheduler.num_computed_prompt_tokens == 3 * 1024


@pytest.mark.parametrize("routing", ["least-prefill", "prefix-aware"])
def test_kv_tiers_in_the_simulator_follow_the_reload_rule(tmp_path, routing):
    """A prefix evicted from the pool is written to the host tier; when it comes back, the
    reload rule (engine/reload_rule.py) loads it when the tier is fast, recomputes it when slow;
    the load's time is in the step that admits it."""
    w = _evicting_trace(tmp_path)
    profile = profile_dict(num_kv_blocks=70)
    base_sim, base = run(profile, "colocated=1", w, routing=routing)
    fast_sim, fast = run(profile, "colocated=1", w, routing=routing, kv_host_tier_gib=0.01,
                         kv_tier_bytes_per_s={"host": 1e9})
    slow_sim, slow = run(profile, "colocated=1", w, routing=routing, kv_host_tier_gib=0.01,
                         kv_tier_bytes_per_s={"host": 1e3})

    def computed(sim):
        return sum(inst.scheduler.num_computed_prompt_tokens for inst in sim.instances)

    # Without tiers X's head blocks survive in the pool (it evicts a freed sequence's tail first).
    num_pool_hit = (3 * 1024 - computed(base_sim)) // 16
    assert 0 <= num_pool_hit < 8 and computed(slow_sim) == computed(base_sim)
    # The rest of X's 63 whole blocks come back from the host tier (the last token is always computed).
    assert computed(fast_sim) == 2 * 1024 + 16
    summary = fast_sim.summary()["kv_tiers"]
    assert summary["num_loaded_blocks"] == {"host": 63 - num_pool_hit, "disk": 0}
    assert summary["num_written_blocks"] >= 64 and summary["capacity_blocks"] == {"host": int(0.01 * 2**30) // 16000}
    assert slow_sim.summary()["kv_tiers"]["num_loaded_blocks"] == {"host": 0, "disk": 0}
    load_s = (63 - num_pool_hit) * 16 * 1000 / 1e9
    assert fast.ttft[2] < base.ttft[2] - 0.5  # ~1 s of prefill (1e-3 per token) became a load
    assert fast.ttft[2] > load_s
    assert slow.ttft[2] == pytest.approx(base.ttft[2])


def test_kv_tiers_in_the_simulator_demote_to_disk_and_need_measured_bandwidth(tmp_path):
    w = _evicting_trace(tmp_path)
    profile = profile_dict(num_kv_blocks=70)
    with pytest.raises(ConfigError, match="no measured KV host tier"):
        run(profile, "colocated=1", w, kv_host_tier_gib=0.01)
    # The profile's measurement (epdserve profile's kv_tiers) is used; a host tier of 64 blocks
    # demotes X to disk when Y arrives, and X comes back from there.
    profile["kv_tiers"] = {"host": {"bytes_per_s": 1e9, "latency_s": 1e-4},
                           "disk": {"bytes_per_s": 5e8, "latency_s": 1e-3}}
    sim, _ = run(profile, "colocated=1", w, kv_host_tier_gib=64 * 16000 / 2**30, kv_disk_tier_gib=0.01)
    loaded = sim.summary()["kv_tiers"]["num_loaded_blocks"]
    assert loaded["disk"] > 0 and 56 < loaded["host"] + loaded["disk"] <= 63
    assert sum(inst.scheduler.num_computed_prompt_tokens for inst in sim.instances) == 2 * 1024 + 16
    with pytest.raises(ConfigError, match="prefix caching"):
        SimConfig(parse_topology("colocated=1"), kv_host_tier_gib=1.0, enable_prefix_caching=False)
    bad = {**profile, "kv_tiers": {"host": {"bytes_per_s": -1.0, "latency_s": 0.0}}}
    with pytest.raises(ConfigError, match="bytes_per_s"):
        CostModel.from_dict(bad)


def test_predictive_admission_and_service_classes_in_the_simulator():
    """The router's admission rule and the workers' class order, simulated: at ~2x overload the
    queue bound admits everything and most interactive requests miss a 1 s TTFT; predictive
    admission refuses the ones predicted to miss, and the admitted ones meet it. Batch work is
    admitted either way (deferred)."""
    from epdserve.service import ClassSLO

    # One instance; 200 prompts of 200 tokens: 0.21 s of prefill each (base 0.01 + 1 ms/token), at 8 req/s.
    w = fixed_workload(np.arange(200) / 8.0, [200] * 200, [2] * 200)
    slos = {"interactive": ClassSLO(ttft_s=1.0), "batch": ClassSLO(ttft_s=1.0)}
    mix = {"interactive": 0.8, "batch": 0.2}
    runs = {policy: run(profile_dict(), "colocated=1", w, class_mix=mix, class_slos=slos, admission=policy)[0]
            for policy in ("queue", "predictive")}
    queue, predictive = (runs[p].summary()["service_classes"] for p in ("queue", "predictive"))
    assert queue["interactive"]["num_refused"] == 0 and queue["interactive"]["attainment_of_completed"] < 0.5
    assert predictive["interactive"]["num_refused"] > 0
    assert predictive["interactive"]["attainment_of_completed"] >= 0.9
    assert predictive["batch"]["num_refused"] == 0  # deferred, not refused
    assert queue["interactive"]["num_requests"] == predictive["interactive"]["num_requests"] > 100


def test_encoder_batches_as_many_images_as_serve_does_by_default():
    """simulate's encoder takes serve's default images per forward pass (one rule:
    config.ENCODE_BATCH_IMAGES): three requests with one image each, all at once, are three
    batches, not one of three."""
    import argparse

    from epdserve.cluster.encode_worker import EncodeWorkerOptions
    from epdserve.config import ENCODE_BATCH_IMAGES
    from epdserve.router.serve import add_serve_args
    from epdserve.sim.cli import add_simulate_parser

    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    simulate = add_simulate_parser(argparse.ArgumentParser().add_subparsers())
    assert ENCODE_BATCH_IMAGES == 1
    assert serve.get_default("encode_batch_images") == simulate.get_default("encode_batch_images") == 1
    assert EncodeWorkerOptions.__dataclass_fields__["max_batch_images"].default == 1
    w = fixed_workload([0.0, 0.0, 0.0], [32, 32, 32], [2, 2, 2], num_images=1, tiles_per_image=1)
    sim, _ = run(profile_dict(), "encode=1,prefill=1,decode=1", w, link_bytes_per_s=1e6)
    assert next(i for i in sim.instances if i.worker.role == "encode").num_steps == 3
