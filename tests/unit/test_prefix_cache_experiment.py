"""The prefix-cache experiment's workload and summaries, without servers: conversations are
recovered from a trace's block hashes, the reusable share is counted per 16-token block, and
one bench result becomes per-tier hit shares and the goals against the baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from epdserve.bench import BenchError
from epdserve.bench.experiments import cpu_quota
from epdserve.bench.experiments.prefix_cache import (
    FULL,
    Scale,
    conversation_subset,
    conversations,
    find_knee,
    merge_rounds,
    subset_stats,
    arms_for,
    serve_flags,
    summarize_level,
    topology_flags,
)
from epdserve.bench.experiments.prefix_cache_report import (
    BEFORE,
    before_lines,
    crossover_table,
    describe_machines,
    goals,
    knee_lines,
    plan_lines,
    round_lines,
)
from epdserve.bench.traces import TraceRecord


def record(t: float, hashes: tuple[int, ...], n: int = 1024) -> TraceRecord:
    return TraceRecord(t, n, 100, hashes)


def test_turns_join_the_conversation_whose_history_they_extend():
    records = [record(0, (0, 1, 2)), record(1, (0, 7)), record(2, (0, 1, 2, 3)), record(3, (0, 1, 9)),
               record(4, (0, 7, 8)), record(5, (0, 5))]
    # (0,) is the system prompt every request shares: it does not make a conversation
    assert conversations(records) == [[0, 2, 3], [1, 4], [5]]


def test_subset_keeps_conversations_with_enough_turns_that_fit(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [(0, [0, 1], 500), (10, [0, 2], 500), (20, [0, 1, 3], 500), (30, [0, 2, 4], 99999),
            (40, [0, 1, 3, 5], 700)]
    path.write_text("".join(json.dumps({"timestamp": t * 1000 + 5000, "input_length": n, "output_length": 10,
                                        "hash_ids": h}) + "\n" for t, h, n in rows))
    scale = Scale(1, 3, 9600, 0.1, (10.0,), 1.0, 1.0, 8, 8, 0.1, 0.1, 256, (32,), 1)
    subset = conversation_subset(path, scale)
    assert [r.hash_ids for r in subset] == [(0, 1), (0, 1, 3), (0, 1, 3, 5)]
    assert [r.arrival_s for r in subset] == [0.0, 20.0, 40.0]  # from the first chosen request
    with pytest.raises(BenchError, match="only 1 conversations"):
        conversation_subset(path, Scale(2, *list(vars(scale).values())[1:]))


def test_reusable_share_counts_whole_blocks_of_a_repeated_prefix():
    # scale 0.1: a trace block is 51 tokens; prompts of 102 tokens
    records = [record(0, (0, 1)), record(1, (0, 1)), record(2, (0, 2))]
    stats = subset_stats([TraceRecord(r.arrival_s, 1020, 100, r.hash_ids) for r in records], FULL)
    # second request: 102 shared tokens -> 96 in whole blocks; third: 51 -> 48
    assert stats["reusable_prompt_share"] == pytest.approx((96 + 48) / 306)
    assert stats["num_requests"] == 3 and stats["mean_prompt_tokens"] == 102


def test_summarize_level_splits_cached_tokens_by_tier_and_goals_compare_arms():
    result = {"num_prompts": 2, "completed": 2, "failed": 0, "request_goodput": 0.5, "request_throughput": 1.0,
              "input_lens": [100, 100], "ttfts": [0.1, 0.3], "errors": ["", ""], "p99_tpot_ms": 20.0,
              "timings": [{"num_cached_tokens": 64, "kv_load": {"num_host_tokens": 32, "num_disk_tokens": 16},
                           "kv_bytes": 1000, "kv_bytes_skipped": 200, "num_decode_cached_tokens": 10},
                          {"num_cached_tokens": 16}]}
    level = summarize_level(result, duration_s=4.0)
    assert level["request_rate"] == 0.5 and level["goodput_share"] == 0.5
    assert level["hit_share"] == {"pool": 0.16, "host": 0.16, "disk": 0.08}
    assert level["kv_bytes_p_to_d"] == 1000 and level["kv_bytes_not_sent"] == 200
    assert level["decode_cached_share"] == 0.05
    better = {**level, "request_goodput": 0.8, "ttft_p99_ms": level["ttft_p99_ms"] / 2}
    [row] = goals({"least-prefill": [level], "prefix-aware+tiers": [better]})
    assert row["goodput_ratio"] == pytest.approx(1.6) and row["is_goodput_met"]
    assert row["ttft_p99_cut"] == pytest.approx(0.5) and row["is_ttft_met"]


def test_crossover_table_marks_the_rules_choice():
    point = {"prefix_tokens": 64, "ttft_ms": 10.0, "num_chosen_tokens": 0, "num_found_tokens": 64,
             "predicted_load_ms": 9.0, "predicted_compute_ms": 5.0}
    headers, rows = crossover_table({"recompute": [point], "host, rule": [point]})
    assert headers[1] == "recompute TTFT (ms)"
    assert rows == [[64, 10.0, "recompute (9.0 / 5.0)"]]


def test_pin_sets_every_thread_of_a_running_process():
    """A started process with a second thread: both threads land on the chosen core."""

    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        tids: list[str] = []
        for _ in range(200):  # bounded: the second thread starts within moments
            tids = os.listdir(f"/proc/{proc.pid}/task")
            if len(tids) >= 2:
                break
            subprocess.run(["sleep", "0.01"])
        assert len(tids) >= 2
        last = len(os.sched_getaffinity(0)) - 1
        cpu_quota.pin(proc.pid, (last,))
        want = {sorted(os.sched_getaffinity(0))[last]}
        assert all(os.sched_getaffinity(int(t)) == want for t in os.listdir(f"/proc/{proc.pid}/task"))
        with pytest.raises(BenchError):
            cpu_quota.pin(proc.pid, (last + 1,))
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_report_names_each_roles_machine():
    text = describe_machines({"machines": {"prefill": {"share": 0.5, "cores": [0]},
                                           "decode": {"share": 1.0, "cores": [1]}}})
    assert "each prefill worker held to 0.5 of a core on core 0" in text
    assert "each decode worker held to 1 of a core on core 1" in text
    assert describe_machines({"cpu_share": 2 / 3}).startswith("each worker held to 0.67")
    assert describe_machines({"quota_wanted": False}) == "one core per worker"


def test_rounds_are_merged_by_mean_and_each_rounds_goals_are_reported():
    def level(goodput: float, p99: float, host: float) -> dict:
        return {"request_rate": 3.0, "request_goodput": goodput, "ttft_p99_ms": p99, "failed": 1,
                "hit_share": {"pool": 0.5, "host": host, "disk": 0.0}}

    rounds = [{"least-prefill": [level(1.0, 2000.0, 0.0)], "prefix-aware+tiers": [level(2.0, 1000.0, 0.2)]},
              {"least-prefill": [level(2.0, 3000.0, 0.0)], "prefix-aware+tiers": [level(2.0, 1500.0, 0.1)]}]
    merged = merge_rounds(rounds)
    tiers = merged["prefix-aware+tiers"][0]
    assert tiers["request_goodput"] == 2.0 and tiers["ttft_p99_ms"] == 1250.0 and tiers["failed"] == 2
    assert tiers["hit_share"] == {"pool": 0.5, "host": pytest.approx(0.15), "disk": 0.0}
    g = goals(merged)[0]
    assert g["goodput_ratio"] == pytest.approx(2.0 / 1.5) and g["ttft_p99_cut"] == pytest.approx(0.5)
    text = "\n".join(round_lines({"goals": goals(merged), "goals_by_round": [goals(r) for r in rounds]}))
    assert "2.00 / 50 %" in text and "1.00 / 50 %" in text
    assert round_lines({"goals": goals(merged), "goals_by_round": [goals(rounds[0])]}) == []


def _ladder(*rates: float) -> Scale:
    return Scale(1, 3, 9600, 0.1, rates, 1.0, 1.0, 8, 8, 0.1, 0.1, 256, (32,), 1, rate_multiples=(1.25, 1.5))


def test_knee_is_the_highest_rate_that_kept_the_share_and_probing_stops_after_two_misses_in_a_row():
    shares = {1.0: 1.0, 2.0: 0.95, 3.0: 0.6, 4.0: 0.1, 5.0: 1.0}
    probed = []

    def probe(rate: float) -> dict:
        probed.append(rate)
        return {"request_rate": rate, "request_goodput": rate * shares[rate], "goodput_share": shares[rate],
                "ttft_p50_ms": 100.0, "ttft_p99_ms": 900.0, "tpot_p99_ms": 50.0}

    knee = find_knee(_ladder(1.0, 2.0, 3.0, 4.0, 5.0), probe)
    assert probed == [1.0, 2.0, 3.0, 4.0]  # 3.0 and 4.0 missed in a row: 5.0 is not tried
    assert knee["rate"] == 2.0 and not knee["is_below_ladder"] and len(knee["probes"]) == 4
    text = "\n".join(knee_lines({"knee": knee}))
    assert "until 2 in a row kept fewer than 90 %" in text and "the knee, the highest rate that kept them, is 2.00" in text
    assert "1.25, 1.5 × the knee" in text and "60 %" in text and "95 %" in text  # every probe listed
    # One miss between passes does not end the probe: the knee is the higher pass.
    shares.update({3.0: 0.8, 4.0: 0.95})
    probed.clear()
    knee = find_knee(_ladder(1.0, 2.0, 3.0, 4.0, 5.0), probe)
    assert knee["rate"] == 5.0 and probed == [1.0, 2.0, 3.0, 4.0, 5.0]
    # No rate keeps the share: the knee is the first rate, said so.
    shares.update({3.0: 0.5, 4.0: 0.4})
    probed.clear()
    knee = find_knee(_ladder(3.0, 4.0, 5.0), probe)
    assert probed == [3.0, 4.0] and knee["rate"] == 3.0 and knee["is_below_ladder"]
    assert "below the ladder" in "\n".join(knee_lines({"knee": knee}))
    assert knee_lines({}) == []


def test_knee_probe_enters_the_ladder_at_the_plans_rate_and_climbs_or_descends_from_there():
    shares = {1.0: 1.0, 2.0: 0.95, 3.0: 0.95, 4.0: 0.5, 5.0: 0.3, 6.0: 1.0}
    probed = []

    def probe(rate: float) -> dict:
        probed.append(rate)
        return {"request_rate": rate, "request_goodput": rate * shares[rate], "goodput_share": shares[rate],
                "ttft_p50_ms": 100.0, "ttft_p99_ms": 900.0, "tpot_p99_ms": 50.0}

    ladder = _ladder(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    knee = find_knee(ladder, probe, start_rate=2.4)  # entered at 2.0, the highest rung not above 2.4
    assert probed == [2.0, 3.0, 4.0, 5.0] and knee["rate"] == 3.0 and knee["entry_rate"] == 2.0
    text = "\n".join(knee_lines({"knee": knee}))
    assert "entered at 2.00 req/s" in text and "is 3.00 req/s" in text
    probed.clear()
    knee = find_knee(ladder, probe, start_rate=5.5)  # 5.0 misses: down until a rate keeps the share
    assert probed == [5.0, 4.0, 3.0] and knee["rate"] == 3.0 and not knee["is_below_ladder"]
    assert [p["request_rate"] for p in knee["probes"]] == [3.0, 4.0, 5.0]  # sorted by rate
    probed.clear()
    shares.update({1.0: 0.2, 2.0: 0.2, 3.0: 0.2})
    knee = find_knee(ladder, probe, start_rate=3.0)
    assert probed == [3.0, 2.0, 1.0] and knee["is_below_ladder"] and knee["rate"] == 1.0
    probed.clear()
    find_knee(ladder, probe, start_rate=0.1)  # below the ladder's first rung: entered there
    assert probed[0] == 1.0


def test_topology_flags_give_serve_one_core_per_worker():
    assert topology_flags("colocated=2") == ["--colocated-workers", "2", "--cores-per-worker", "1"]
    assert topology_flags("prefill=2,decode=1") == ["--prefill-workers", "2", "--decode-workers", "1",
                                                    "--cores-per-worker", "1"]
    with pytest.raises(BenchError, match="text only"):
        topology_flags("encode=1,prefill=1,decode=1")
    with pytest.raises(BenchError, match="role=N"):
        topology_flags("prefill=x")


def test_the_arm_before_the_decode_cache_runs_on_pd_only_and_is_a_second_baseline(tmp_path):
    assert BEFORE not in arms_for("colocated=2")
    assert arms_for("prefill=1,decode=1")[-1] == BEFORE
    scale = _ladder(1.0)
    assert "--decode-no-prefix-caching" in serve_flags("prefill=1,decode=1", BEFORE, scale, tmp_path)
    assert "--decode-no-prefix-caching" not in serve_flags("prefill=1,decode=1", "least-prefill", scale, tmp_path)
    level = {"request_rate": 3.0, "request_goodput": 1.0, "ttft_p99_ms": 2000.0}
    levels = {"least-prefill": [level], BEFORE: [{**level, "request_goodput": 0.5}],
              "prefix-aware+tiers": [{**level, "request_goodput": 0.9, "ttft_p99_ms": 1000.0}]}
    [row] = goals(levels, baseline=BEFORE)
    assert row["goodput_ratio"] == pytest.approx(1.8) and row["is_goodput_met"]
    assert goals({"prefix-aware+tiers": levels["prefix-aware+tiers"]}, baseline=BEFORE) == []
    text = "\n".join(before_lines({"goals_before": [row]}))
    assert BEFORE in text and "1.8" in text
    assert before_lines({}) == []


def test_report_says_which_split_the_plan_chose():
    split = {"topology": "colocated=2", "reason": "goodput per instance: split 1.4 vs colocated 2.4 req/s",
             "instances": 2, "slo": "ttft_p90:1000,tpot_p90:200",
             "candidates": [{"topology": "colocated=2", "max_rate": 4.8, "goodput": 4.7, "goodput_per_instance": 2.4},
                            {"topology": "prefill=1,decode=1", "max_rate": 2.8, "goodput": 2.7,
                             "goodput_per_instance": 1.4}]}
    text = "\n".join(plan_lines({"plan": split}))
    assert "chose **colocated=2**" in text and "prefill=1,decode=1" in text and "2 instances" in text
    assert plan_lines({}) == []
