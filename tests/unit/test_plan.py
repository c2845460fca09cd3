"""Planner: the seeds' ratio formula and worked examples, instance counts, SLO parsing and
evaluation, and a search that must find the obviously better configuration.

Worked examples are from the seed notes on P/D ratios (sections 2.2 and 7.2): 2000 input /
500 output tokens, a 100 ms prefill, 30 ms (or 25 ms) per decoded token. Profiles are small
synthetic dicts: the cost model is not the subject here.
"""

import json
import math

import numpy as np
import pytest

from epdserve.errors import ConfigError
from epdserve.planner.capacity import Candidate, max_rate, normalized
from epdserve.planner.plan import (
    counts_for_budget,
    counts_for_rate,
    decode_throughput_at_slo,
    estimate_prefix_hit_rate,
    normalize_ratio,
    role_work,
)
from epdserve.planner.planning import VALIDATION_FACTOR
from epdserve.planner.search import enumerate_candidates, search
from epdserve.planner.slo import evaluate, parse_slo, tpot_slo_ms, ttft_slo_ms
from epdserve.sim.cost_model import CostModel, StepCost
from epdserve.sim.topology import Topology
from epdserve.sim.workload import random_workload


# -- the seeds' worked examples ----------------------------------------------------------------
def test_single_request_latencies_give_the_naive_150():
    # Section 2.2: prefill of 2000 tokens in 100 ms; one decode token every 30 ms; 500 tokens.
    work = role_work(2000, 500, thr_prefill=2000 / 0.100, thr_decode=1 / 0.030)
    assert work == pytest.approx({"prefill": 0.1, "decode": 15.0})
    assert normalize_ratio(work) == pytest.approx({"prefill": 1.0, "decode": 150.0})


def test_section_7_2_gives_one_to_125():
    # N_p / N_d = T_p / (T_d * L) = 100 / (25 * 500) = 1 / 125.
    ratio = normalize_ratio(role_work(2000, 500, thr_prefill=2000 / 0.100, thr_decode=1 / 0.025))
    assert ratio["decode"] / ratio["prefill"] == pytest.approx(125.0)


@pytest.mark.parametrize("batch_one_step_s,low,high", [(0.030, 3, 5), (0.025, 3, 8)])
def test_decode_batched_at_the_tpot_slo_lands_in_the_seeds_practical_range(batch_one_step_s, low, high):
    # The seeds: "in practice 1:3 ~ 1:5" (2.2) and "1:3 ~ 1:8" (7.2), because instances batch.
    # A memory-bound decode step: the seed's single-token time at batch 1, 0.4 ms more per extra
    # sequence (illustrative), TPOT SLO 50 ms (the seed's 5.2 typical value).
    per_seq = 0.0004
    step = StepCost(batch_one_step_s - per_seq, 0.0, 0.0, per_seq, 0.0)
    dec = decode_throughput_at_slo(step, 0.050, mean_context=2250, max_num_seqs=256, num_kv_blocks=100_000,
                                   block_size=16)
    assert dec.is_within_slo and dec.step_s <= 0.050 < step.base_s + per_seq * (dec.batch + 1)
    ratio = normalize_ratio(role_work(2000, 500, thr_prefill=2000 / 0.100, thr_decode=dec.tokens_per_s))
    assert low <= ratio["decode"] <= high


def test_decode_batch_is_capped_by_kv_blocks_and_max_num_seqs():
    step = StepCost(0.01, 0.0, 0.0, 1e-5, 0.0)
    # 2000-token contexts take 125 blocks each: 1001 blocks (one is the null block) hold 8.
    assert decode_throughput_at_slo(step, 1.0, 2000, 256, 1001, 16).batch == 8
    assert decode_throughput_at_slo(step, 1.0, 2000, 5, 100_000, 16).batch == 5
    slow = decode_throughput_at_slo(StepCost(0.2, 0, 0, 0, 0), 0.05, 100, 64, 1000, 16)
    assert not slow.is_within_slo and slow.batch == 1


def test_prefix_hits_discount_prefill_work():
    work = role_work(2000, 500, 20000, 1000, prefix_hit_rate=0.75)
    assert work["prefill"] == pytest.approx(0.025)


def test_counts_for_a_budget_and_for_a_rate():
    work = {"prefill": 0.1, "decode": 0.49}
    assert counts_for_budget(work, 6) == {"prefill": 1, "decode": 5}
    assert counts_for_budget({"prefill": 0.01, "decode": 1.0}, 3) == {"prefill": 1, "decode": 2}
    assert counts_for_budget({"encode": 0.2, "prefill": 0.3, "decode": 0.5}, 10) == {"encode": 2, "prefill": 3, "decode": 5}
    assert counts_for_rate(work, 30) == {"prefill": 3, "decode": 15}
    with pytest.raises(ConfigError):
        counts_for_budget(work, 1)


def test_prefix_hit_estimate_from_trace_hash_ids():
    # Second request repeats both 512-token blocks (at most n - 1 tokens hit), third the first.
    rate = estimate_prefix_hit_rate(((0, 1), (0, 1), (0, 2)), [1024, 1024, 1024], 512)
    assert rate == pytest.approx((1023 + 512) / 3072)
    assert estimate_prefix_hit_rate(None, [10], 512) == 0.0


# -- SLOs --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "ttft_p99:100", "tpot_p99:10", "ttft:100,tpot_p99:10", "ttft_p99:0,tpot_p99:1",
                                  "ttft_p101:1,tpot_p99:1", "ttft_p99:abc,tpot_p99:1", "lat_p99:1,tpot_p99:1,ttft_p99:1",
                                  "ttft_p99:1,ttft_p90:1,tpot_p99:1", "ttft_p99:nan,tpot_p99:1"])
def test_bad_slo(text):
    with pytest.raises(ConfigError):
        parse_slo(text)


def test_auto_thresholds_are_sized_to_the_host_and_refused_where_they_mean_nothing():
    asked = []

    def auto(metric, percentile):
        asked.append((metric, percentile))
        return 1234.0

    slo = parse_slo("ttft_p90:auto,tpot_p50:auto,e2el_p99:5000", auto=auto)
    assert asked == [("ttft", 90.0), ("tpot", 50.0)]
    assert slo.spec == "ttft_p90:1234,tpot_p50:1234,e2el_p99:5000"
    with pytest.raises(ConfigError, match="not accepted here"):
        parse_slo("ttft_p90:auto,tpot_p90:50")
    with pytest.raises(ConfigError, match="only ttft and tpot"):
        parse_slo("ttft_p90:1,tpot_p90:1,e2el_p99:auto", auto=auto)
    # the rules: 4x one prompt prefilled alone (plus what comes before it), 5x a one-sequence step
    step = StepCost(0.010, 1e-3, 0.0, 2e-3, 0.0)
    assert ttft_slo_ms(step, 100) == 4 * 110.0 and ttft_slo_ms(step, 100, extra_s=0.05) == 4 * 160.0
    assert tpot_slo_ms(step, 500) == 5 * 12.0
    slower = StepCost(0.050, 5e-3, 0.0, 2e-3, 0.0)  # a host that prefills five times slower
    assert ttft_slo_ms(slower, 100) == 5 * ttft_slo_ms(step, 100)


def test_plan_sizes_an_auto_ttft_from_the_workloads_percentile_prompt(tmp_path):
    from epdserve.cli import main

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile(prefill_per_token=2e-5, decode_per_seq=3e-3)))
    out = tmp_path / "plan.json"
    code = main(["plan", "--profile", str(path), "--slo", "ttft_p90:auto,tpot_p90:60", "--workload", "random",
                 "--random-input-len", "128", "--random-output-len", "32", "--random-range-ratio", "0.5",
                 "--instances", "2", "--search-requests", "60", "--search-max-requests", "120", "--workers", "1",
                 "--out", str(out)])
    assert code == 0
    plan = json.loads(out.read_text())
    workload = random_workload(120 * VALIDATION_FACTOR, 1.0, 128, 32, 0.5, seed=0)  # the plan's: its size and seed
    n = int(np.percentile(workload.input_lens, 90))
    assert 128 < n <= 192  # the long end of 64..192
    step = CostModel.from_dict(profile(prefill_per_token=2e-5, decode_per_seq=3e-3)).role("colocated").step
    expected = ttft_slo_ms(step, n)
    assert plan["slo_thresholds_ms"] == {"ttft_p90": expected, "tpot_p90": 60.0}
    assert plan["slo"] == f"ttft_p90:{expected:g},tpot_p90:60"


def test_slo_evaluation_counts_failures_as_misses():
    slo = parse_slo("ttft_p50:100,tpot_p99:50")
    ok = np.array([True, True, True, False])
    ttft = np.array([0.05, 0.08, 0.2, 0.0])
    latency = np.array([0.4, 0.5, 0.3, 0.0])
    out = np.array([10, 11, 2, 0])
    report = evaluate(slo, ok, ttft, latency, out)
    assert report.attainment == pytest.approx(0.5)  # request 3 over TTFT, request 4 failed
    assert report.percentiles_ms["ttft_p50"] == pytest.approx(80.0)
    assert math.isinf(report.percentiles_ms["tpot_p99"]) and not report.is_within_percentiles


# -- search ------------------------------------------------------------------------------------
def profile(prefill_per_token=1e-4, decode_per_seq=1e-3):
    step = {"base_s": 0.005, "per_prefill_token_s": prefill_per_token, "per_prefill_attn_pair_s": 0.0,
            "per_decode_seq_s": decode_per_seq, "per_decode_context_token_s": 0.0}
    role = {"num_threads": 1, "num_kv_blocks": 4000, "max_num_seqs": 64, "max_num_batched_tokens": 1024, "step": step}
    return {"version": 1, "model": "synthetic", "dtype": "bfloat16", "block_size": 16, "kv_bytes_per_token": 1000,
            "embed_bytes_per_token": None, "num_layers": 4,
            "roles": {"colocated": dict(role), "prefill": dict(role), "decode": dict(role)}}


def test_max_rate_grows_with_instances():
    cost = CostModel.from_dict(profile())
    base = normalized(random_workload(150, 1.0, 256, 32, 0.5, seed=1))
    slo = parse_slo("ttft_p90:500,tpot_p90:50")
    one = max_rate(cost, Candidate(Topology(num_colocated=1)), base, slo, 0.9, 20.0, {})
    three = max_rate(cost, Candidate(Topology(num_colocated=3)), base, slo, 0.9, 60.0, {})
    assert 0 < one.max_rate < three.max_rate
    assert one.point.is_met and one.point.attainment >= 0.9


def test_search_prefers_more_decode_when_decode_is_the_bottleneck():
    # Prefill is nearly free and decode slow: with 4 instances, 1 prefill + 3 decode must beat
    # 3 prefill + 1 decode.
    cost = CostModel.from_dict(profile(prefill_per_token=2e-5, decode_per_seq=3e-3))
    base = normalized(random_workload(150, 1.0, 128, 64, 0.3, seed=2))
    slo = parse_slo("ttft_p90:1000,tpot_p90:60")
    split = [c for c in enumerate_candidates(4, (), False) if c.topology.is_split and c.topology.num_instances == 4]
    assert {c.topology.spec for c in split} == {"prefill=1,decode=3", "prefill=2,decode=2", "prefill=3,decode=1"}
    from epdserve.planner.capacity import ProbeSpec

    found = search(cost, split, lambda c: 10.0 * c.topology.num_decode, base, slo, 0.9, {}, ProbeSpec(150, 0, 150),
                   num_workers=1)
    by_spec = {c.candidate.topology.spec: c for c in found.results}
    assert by_spec["prefill=1,decode=3"].max_rate > by_spec["prefill=3,decode=1"].max_rate
    best = max(found.results, key=lambda c: c.goodput_per_instance)
    assert best.candidate.topology.num_decode > best.candidate.topology.num_prefill


def test_ratio_class_groups_multiples_of_one_shape():
    from epdserve.planner.search import ratio_class

    big = Candidate(Topology(num_prefill=4, num_decode=6), (("decode", 64),))
    small = Candidate(Topology(num_prefill=2, num_decode=3), (("decode", 64),))
    assert ratio_class(big) == (((0, 2, 3, 0), (("decode", 64),)), 2)
    assert ratio_class(small)[0] == ratio_class(big)[0] and ratio_class(small)[1] == 1
    assert ratio_class(Candidate(Topology(num_prefill=2, num_decode=3)))[0] != ratio_class(small)[0]


def test_candidates_stay_within_the_budget():
    cands = enumerate_candidates(5, (0, 64), True)
    assert all(c.topology.num_instances <= 5 and c.topology.num_encode == 1 for c in cands)
    assert all(dict(c.max_num_seqs).keys() <= {"colocated", "decode"} for c in cands)
    assert len({c for c in cands}) == len(cands)


# -- the command -------------------------------------------------------------------------------
def test_plan_cli_writes_the_keys(tmp_path, capsys):
    from epdserve.cli import main

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile(prefill_per_token=2e-5, decode_per_seq=3e-3)))
    out = tmp_path / "plan.json"
    code = main(["plan", "--profile", str(path), "--slo", "ttft_p90:1000,tpot_p90:60", "--workload", "random",
                 "--random-input-len", "128", "--random-output-len", "32", "--instances", "3", "--rate", "20",
                 "--search-requests", "60", "--search-max-requests", "120", "--workers", "1", "--out", str(out)])
    assert code == 0
    plan = json.loads(out.read_text())
    assert {"formula_ratio", "best_split", "best_colocated", "verdict", "max_rate"} <= set(plan)
    assert plan["formula_ratio"]["ratio"]["decode"] > 0 and plan["formula_ratio"]["counts_for_rate"]
    assert plan["verdict"]["choice"] in ("split", "colocated")
    assert plan["max_rate"] > 0 and plan["validation"]["runs"][-1]["is_met"]
    assert "verdict" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--slo", "ttft_p99:100"], "tpot"),
    (["--slo", "ttft_p99:100,tpot_p99:10", "--instances", "0"], "instances"),
    (["--slo", "ttft_p99:100,tpot_p99:10", "--attainment", "1.5"], "attainment"),
    (["--slo", "ttft_p99:auto,tpot_p99:10,itl_p99:auto"], "only ttft and tpot"),
])
def test_plan_cli_bad_input_exits_2(tmp_path, capsys, args, message):
    from epdserve.cli import main

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile()))
    code = main(["plan", "--profile", str(path), "--workload", "random", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_verdict_names_its_configuration_when_only_one_kind_meets_the_slo():
    from epdserve.planner.capacity import Capacity
    from epdserve.planner.planning import _verdict

    split = Capacity(Candidate(Topology(num_prefill=1, num_decode=1)), 0.25, None, 6)
    verdict, chosen = _verdict(split, None)
    assert chosen is split and verdict["choice"] == "split"
    assert verdict["configuration"]["topology"] == split.candidate.topology.spec
    assert _verdict(None, None) == ({"choice": "none", "reason": "no configuration meets the SLO at any simulated rate"},
                                    None)
