"""The load-shift experiment's trace and summaries, the router's traffic log and
``plan --from-server``'s switch list: plain functions, no servers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from epdserve.bench import BenchError
from epdserve.bench.experiments import cpu_quota
from epdserve.bench.experiments import load_shift as ls
from epdserve.bench.experiments.load_shift_report import arm_summary, goals, goals_overload, is_met
from epdserve.bench.traces import TraceRecord, read_trace
from epdserve.planner.from_server import role_switches, target_split, write_trace
from epdserve.router.traffic import TrafficLog


def _records() -> list[TraceRecord]:
    """A made-up source trace: alternating long-prompt/short-answer and short/long requests,
    one a second."""
    out = []
    for i in range(400):
        if i % 2:
            out.append(TraceRecord(float(i), 4000 + i, 40))
        else:
            out.append(TraceRecord(float(i), 200, 220 + i % 7))
    return out


SCALE = ls.Scale(phases=(ls.Phase("A1", "prefill-heavy", 20.0, 2.0), ls.Phase("B", "decode-heavy", 10.0, 3.0)),
                 overload=ls.Phase("o", "prefill-heavy", 5.0, 4.0), input_scale=0.25, output_scales=(0.5, 1.0),
                 max_input_len=1024, max_output_len=200, slo_ttft_ms=1000.0, slo_tpot_ms=100.0, cpu_share=0.5,
                 max_model_len=2048, dwell_s=1.0, cooldown_s=1.0, window_s=1.0, profile=False)


def test_trace_phases_take_their_mix_at_their_rate(tmp_path):
    trace = ls.build_trace(_records(), SCALE.phases, SCALE)
    names = ls.phase_of(trace, SCALE.phases)
    assert names.count("A1") == 40 and names.count("B") == 30
    a = [r for r, n in zip(trace, names) if n == "A1"]
    b = [r for r, n in zip(trace, names) if n == "B"]
    assert all(1000 <= r.input_length <= 1024 and r.output_length == 20 for r in a)  # scaled, clipped; answers halved
    assert all(r.input_length == 50 and r.output_length == 200 for r in b)  # kept, clipped to 200
    assert a[0].arrival_s == 0.0 and all(0 <= r.arrival_s < 20 for r in a)
    assert all(20 <= r.arrival_s < 30 for r in b)
    assert np.all(np.diff([r.arrival_s for r in trace]) >= 0)
    stats = ls.trace_stats(trace, SCALE.phases)
    assert stats["A1"]["rate"] == pytest.approx(2.0) and stats["B"]["mix"] == "decode-heavy"
    path = tmp_path / "t.jsonl"
    ls.write_trace(trace, path)
    again = read_trace(str(path))
    assert [(r.input_length, r.output_length) for r in again] == [(r.input_length, r.output_length) for r in trace]
    assert again[-1].arrival_s == pytest.approx(trace[-1].arrival_s, abs=1e-3)


def test_a_phase_longer_than_its_pool_is_an_error():
    phases = (ls.Phase("A1", "prefill-heavy", 1000.0, 1.0),)
    with pytest.raises(BenchError, match="prefill-heavy requests"):
        ls.build_trace(_records(), phases, SCALE)


def _req(ok=True, ttft=0.5, tpot=0.05, status="200"):
    return {"ok": ok, "ttft_s": ttft if ok else None, "tpot_s": tpot if ok else None, "output_len": 5,
            "status": status}


def test_summaries_goals_and_the_slo_rule():
    assert is_met(_req(), 1000, 100) and not is_met(_req(ttft=1.5), 1000, 100)
    assert not is_met(_req(tpot=0.2), 1000, 100) and is_met(_req(tpot=None), 1000, 100)
    assert not is_met(_req(ok=False), 1000, 100)
    names = ["A1"] * 4 + ["B"] * 2
    arms = {
        "prefill=1,decode=1": {"requests": [_req(), _req(), _req(ttft=2), _req(ttft=2), _req(), _req()]},
        "prefill=2,decode=0": {"requests": [_req()] * 4 + [_req(tpot=1)] * 2},
        "role switching": {"requests": [_req()] * 6},
    }
    g = goals(arms, names, SCALE)
    s = g["summaries"]["prefill=1,decode=1"]
    assert s["A1"]["num_met"] == 2 and s["A1"]["goodput"] == pytest.approx(2 / 20)
    assert s["B"]["attainment"] == 1.0 and s["all"]["goodput"] == pytest.approx(4 / 30)
    assert g["best_split"] == "prefill=1,decode=1"  # 4 met against 4: the first of equals
    assert g["best_split_by_phase"] == {"A1": "prefill=2,decode=0", "B": "prefill=1,decode=1"}
    assert g["switching_vs_best_split"] == pytest.approx(1.5) and g["is_switching_met"]
    over = goals_overload({"queue": {"requests": [_req(ttft=5)] * 3 + [_req()]},
                           "predictive": {"requests": [_req()] * 2 + [_req(ok=False, status="429")] * 2}}, 1000, 100)
    assert over["overload"]["queue"]["attainment_of_admitted"] == 0.25
    assert over["overload"]["predictive"] == {"num_requests": 4, "num_refused": 2, "attainment_of_admitted": 1.0,
                                              "goodput_requests": 2}
    assert over["is_overload_met"]
    assert arm_summary([], [], SCALE)["all"]["attainment"] is None


def test_cpu_quota_share_is_checked():
    with pytest.raises(BenchError):
        cpu_quota.CpuQuotas(0)


def test_traffic_log_keeps_demand_and_actual_answers():
    log = TrafficLog(max_records=3)
    log.arrived("a", 100, 64, "interactive", now=10.0)
    log.arrived("b", 200, 32, "batch", now=11.0)
    log.finished("a", 17)
    log.finished("b", None)  # refused: its requested answer stays
    body = log.as_json(window_s=5.0, now=12.0)
    assert body["requests"] == [[0.0, 100, 17, "interactive"], [1.0, 200, 32, "batch"]]
    assert body["num_requests"] == 2 and body["rate"] == pytest.approx(1.0)
    for i in range(5):
        log.arrived(f"r{i}", 1, 1, "interactive", now=20.0 + i)
    assert len(log.records) == 3 and log.as_json(100.0, now=30.0)["num_requests"] == 3
    assert log.as_json(1.0, now=100.0)["num_requests"] == 0


def _worker(worker_id, role, num_requests=0, state="ready"):
    return {"id": worker_id, "role": role, "state": state, "load": {"num_requests": num_requests}}


def test_role_switches_toward_a_target():
    workers = [_worker("p0", "prefill"), _worker("d0", "decode", 3), _worker("d1", "decode", 1),
               _worker("d2", "decode", 2), _worker("e0", "encode")]
    assert role_switches(workers, 3, 1) == [{"worker": "d1", "from_role": "decode", "to_role": "prefill"},
                                            {"worker": "d2", "from_role": "decode", "to_role": "prefill"}]
    assert role_switches(workers, 1, 3) == []
    workers = [_worker("p0", "prefill", 2), _worker("p1", "prefill"), _worker("d0", "decode")]
    assert role_switches(workers, 1, 2) == [{"worker": "p1", "from_role": "prefill", "to_role": "decode"}]


def test_target_split_prefers_a_simulated_split_of_the_servers_size(tmp_path):
    plan = {"candidates": [{"topology": "prefill=1,decode=1", "max_rate": 5.0},
                           {"topology": "prefill=3,decode=1", "max_rate": 2.0},
                           {"topology": "prefill=2,decode=2", "max_rate": 3.0},
                           {"topology": "colocated=4", "max_rate": 9.0}],
            "formula_ratio": {"counts_for_budget": {"prefill": 1, "decode": 3}}}
    assert target_split(plan, 4) == (2, 2)
    assert target_split({"candidates": [], "formula_ratio": plan["formula_ratio"]}, 4) == (1, 3)
    assert target_split({"candidates": [], "formula_ratio": {}}, 4) is None
    traffic = {"columns": ["arrived_s", "prompt_tokens", "output_tokens", "service_class"],
               "requests": [[0.0, 10, 5, "interactive"], [0.5, 0, 0, "batch"]]}
    path = tmp_path / "t.jsonl"
    write_trace(traffic, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"timestamp": 0.0, "input_length": 10, "output_length": 5},
                    {"timestamp": 500.0, "input_length": 1, "output_length": 1}]
