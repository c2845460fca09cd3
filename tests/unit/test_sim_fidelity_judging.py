"""How benchmarks/sim_fidelity.py judges the simulator: the real runs' band widened by 5 % of
their mean, and the mean absolute error against the real mean."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_fidelity.py"
_spec = importlib.util.spec_from_file_location("sim_fidelity", _PATH)
sim_fidelity = importlib.util.module_from_spec(_spec)
sys.modules["sim_fidelity"] = sim_fidelity  # its dataclasses look their module up
_spec.loader.exec_module(sim_fidelity)


def runs(**values):
    """Per-run metric dicts from per-metric lists (every other metric None)."""
    n = len(next(iter(values.values())))
    names = (*sim_fidelity.METRICS, *sim_fidelity.SIDE_METRICS)
    return [{m: (values[m][i] if m in values else None) for m in names} for i in range(n)]


def test_band_is_the_runs_range_widened_by_five_percent_of_their_mean():
    real = runs(ttft_p50_ms=[90.0, 100.0, 110.0], goodput=[2.0, 2.0, 2.0])
    inside = sim_fidelity.summarize_cell(real, runs(ttft_p50_ms=[114.0, 116.0], goodput=[1.85, 1.85]))
    v = inside["ttft_p50_ms"]
    assert (v["real_mean"], v["real_min"], v["real_max"], v["sim"]) == (100.0, 90.0, 110.0, 115.0)
    assert v["band"] == pytest.approx((85.0, 115.0)) and v["is_inside"] and v["error"] == pytest.approx(0.15)
    g = inside["goodput"]
    assert g["band"] == pytest.approx((1.9, 2.1)) and not g["is_inside"] and g["error"] == pytest.approx(-0.075)
    assert inside["tpot_p50_ms"] is None  # no value on either side: not judged


def test_judge_counts_cell_metrics_and_averages_absolute_errors():
    def cell(err_ttft: float, err_goodput: float, tpot_inside: bool) -> dict:
        real = runs(ttft_p50_ms=[100.0], tpot_p50_ms=[50.0], goodput=[1.0])
        sim = runs(ttft_p50_ms=[100.0 * (1 + err_ttft)], tpot_p50_ms=[50.0 if tpot_inside else 60.0],
                   goodput=[1.0 + err_goodput])
        return {"sim": sim_fidelity.summarize_cell(real, sim)}

    j = sim_fidelity.judge([cell(0.04, -0.02, True), cell(-0.08, 0.0, True)], "sim")
    assert (j["num_inside"], j["num_cell_metrics"]) == (5, 6)  # the -8 % TTFT lies outside 100 +- 5
    assert j["mae"]["ttft_p50_ms"] == pytest.approx(0.06) and j["mae"]["goodput"] == pytest.approx(0.01)
    assert not j["is_met"]  # 83 % inside, below 90 %
    assert sim_fidelity.judge([cell(0.04, -0.02, True)], "sim")["is_met"]
    assert not sim_fidelity.judge([cell(0.04, -0.02, False)], "sim")["is_met"]  # TPOT 20 % off


def test_attainment_is_reported_in_points_beside_the_goal_and_not_judged():
    """A collapsed cell: real goodput near zero makes goodput's relative error large while the
    simulated share of requests meeting the SLO is a few points off."""
    real = runs(goodput=[0.0, 0.02, 0.04], attainment=[0.0, 0.01, 0.02])
    collapsed = {"sim": sim_fidelity.summarize_cell(real, runs(goodput=[0.05], attainment=[0.03]))}
    held = {"sim": sim_fidelity.summarize_cell(runs(goodput=[2.0], attainment=[0.95]),
                                               runs(goodput=[2.0], attainment=[0.90]))}
    assert collapsed["sim"]["goodput"]["error"] == pytest.approx(1.5)
    j = sim_fidelity.judge([collapsed, held], "sim")
    assert j["num_cell_metrics"] == 2  # goodput twice; attainment is not a judged cell-metric
    assert j["attainment_points"] == pytest.approx({"mean": 3.5, "max": 5.0, "num_cells": 2})
    assert "3.5 points apart on average, 5.0 at most, over 2 cells" in sim_fidelity.format_judgement(j)
    assert sim_fidelity.judge([{"sim": {"goodput": None}}], "sim")["attainment_points"] is None


def test_replay_traces_carry_the_arrivals_the_server_stamped(tmp_path):
    """The replay trace times each request by the server's ``arrived`` stamp, less the stamps'
    median offset from the send times (another clock): two requests sent 14 ms apart that reached
    the server 25 ms apart replay 25 ms apart. A request the server never stamped keeps its send
    time; a result without stamps replays its send times."""
    import json

    sends = [0.0, 8.645, 8.659, 9.0, 9.5]
    arrived = [1000.0, 1008.645, 1008.670, 1009.0, None]  # the third came 11 ms late
    result = {"start_times": sends, "input_lens": [10, 18, 816, 40, 5], "output_lens": [3, 3, 15, 4, 0],
              "errors": ["", "", "", "", "refused"],
              "timings": [{"arrived": a} if a else None for a in arrived]}
    assert sim_fidelity.arrival_times_s(result) == pytest.approx([0.0, 8.645, 8.670, 9.0, 9.5])
    path = tmp_path / "trace.jsonl"
    sim_fidelity.write_trace(result, path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["timestamp"] for r in records] == pytest.approx([0.0, 8645.0, 8670.0, 9000.0, 9500.0])
    assert [r["input_length"] for r in records] == [10, 18, 816, 40, 5]
    del result["timings"]
    assert sim_fidelity.arrival_times_s(result) == sends


def test_rejudge_replays_the_stored_runs_in_the_simulator_as_it_is_now(tmp_path):
    """--rejudge: a finished run's stored replay traces simulated again on the profiles it judged
    on (here a synthetic one: the cost model is not the subject), the cells and goal rewritten."""
    import json

    from sim_profiles import profile_dict

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**profile_dict(), "host": {"num_cores": 3}}))  # the real run's host
    # One request of 32 prompt tokens alone on a colocated instance: TTFT 0.01 + 32 x 1e-3 s.
    (tmp_path / "trace_c_r1.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 32, "output_length": 3}) + "\n")
    real = runs(ttft_p50_ms=[40.0, 44.0], goodput=[1.0, 1.0])
    scale = sim_fidelity.QUICK
    cell = {"topology": "colocated=2", "workload": "random", "load": 1.0, "rate": 1.0, "slo": [1000.0, 100.0],
            "num_runs": 2, "real_runs": real, "tags": ["c_r1"], "profiles": {"sim": str(profile)},
            "sim_runs": [], "sim": {}, "step_ratios": {}}
    results = {"scale": scale.__dict__, "capacities": {"colocated=2": {"random": 1.0}}, "with_azure": False,
               "workloads": {"colocated=2": ["random"]}, "slos": {"random": {"ttft_ms": 1000.0, "tpot_ms": 100.0}},
               "cells": [cell], "judgements": {}, "host_drift": [], "busy_at_start": 0.0, "profile": str(profile),
               "commands": []}
    (tmp_path / "results.json").write_text(json.dumps(results))
    report = sim_fidelity.rejudge(tmp_path)
    assert not (tmp_path / "trace_rejudged_c_r1.jsonl").exists()  # no stored bench result: its own trace
    out = json.loads((tmp_path / "results_rejudged.json").read_text())
    ttft = out["cells"][0]["sim"]["ttft_p50_ms"]
    assert ttft["sim"] == pytest.approx(42.0) and ttft["real_mean"] == 42.0 and ttft["is_inside"]
    assert out["judgements"]["sim"]["num_cell_metrics"] >= 1
    assert (tmp_path / "rejudged_c_r1.json").is_file() and "--rejudge" in report
    assert (tmp_path / "report_rejudged.md").read_text() == report
    # replayed on the cores of the host the real runs had (the profile's record), not this process's
    assert out["cells"][0]["num_cores"] == 3
    assert all("--cores-per-host 3" in c for c in out["rejudged_commands"] if " simulate " in c)
    assert json.loads((tmp_path / "results.json").read_text())["cells"][0]["sim"] == {}  # the run's own left alone
    # With the run's bench result stored, its replay trace is written again beside its own (the
    # server's arrival stamps: here the same single request), which stays as the run wrote it.
    own_trace = (tmp_path / "trace_c_r1.jsonl").read_text()
    # The stored run is scored again as score() scores now (here its TTFT is 50 ms).
    (tmp_path / "real_c_r1.json").write_text(json.dumps({"start_times": [0.0], "input_lens": [32],
                                                         "output_lens": [3], "errors": [""], "ttfts": [0.05],
                                                         "latencies": [0.1], "timings": [{"arrived": 5.0}]}))
    sim_fidelity.rejudge(tmp_path)
    assert json.loads((tmp_path / "trace_rejudged_c_r1.jsonl").read_text()) == json.loads(own_trace)
    assert (tmp_path / "trace_c_r1.jsonl").read_text() == own_trace
    out = json.loads((tmp_path / "results_rejudged.json").read_text())
    assert out["cells"][0]["sim"]["ttft_p50_ms"]["sim"] == pytest.approx(42.0)
    assert out["cells"][0]["sim"]["ttft_p50_ms"]["real_mean"] == pytest.approx(50.0)
    assert "ttft_parts" in out["cells"][0]["real_runs"][0]
    assert all("trace_rejudged_c_r1.jsonl" in c for c in out["rejudged_commands"] if " simulate " in c)
    # --recalibrate: the run's calibration redone from its step traces (the first round's
    # windows) by calibrate as it is now; here every traced step took 1.5x the profile's time.
    from epdserve.engine.step_shape import StepShape
    from epdserve.sim.cost_model import CostModel

    shape = StepShape(32, 32 * 33 // 2, 0, 0)
    wall = 1.5 * CostModel.from_dict(profile_dict()).role("colocated").step.time_s(shape)
    steps = tmp_path / "steps_r1"
    steps.mkdir()
    (steps / "colocated-0.jsonl").write_text("\n".join(
        [json.dumps({"worker_id": "colocated-0", "role": "colocated", "num_threads": 1}),
         *(json.dumps({"t": 10.0 + i, "wall_s": wall, **shape.to_dict()}) for i in range(12))]) + "\n")
    results["states"] = {"colocated=2": {"trace_dirs": [str(steps)], "calibration_windows": [[0, 0.0, 100.0]],
                                         "first_profile": str(profile),
                                         "runs": [{"tag": "c_r1", "round_index": 0, "window": [0.0, 100.0]}]}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    sim_fidelity.rejudge(tmp_path, redo_calibration=True)
    out = json.loads((tmp_path / "results_rejudged.json").read_text())
    assert out["cells"][0]["profiles"]["sim"] == str(tmp_path / "rejudged_profile_calibrated_colocated2.json")
    assert out["cells"][0]["sim"]["ttft_p50_ms"]["sim"] == pytest.approx(1.5 * 42.0, rel=1e-2)
    # Only some of the first round's calibration runs (by their order): here the one there is.
    sim_fidelity.rejudge(tmp_path, redo_calibration=True, first_windows=[0])
    out = json.loads((tmp_path / "results_rejudged.json").read_text())
    assert out["cells"][0]["sim"]["ttft_p50_ms"]["sim"] == pytest.approx(1.5 * 42.0, rel=1e-2)
    with pytest.raises(SystemExit, match="has 1 calibration runs"):
        sim_fidelity.rejudge(tmp_path, redo_calibration=True, first_windows=[1])


def test_num_prompts_sets_every_runs_request_count_and_bad_values_are_refused():
    scale = sim_fidelity.choose_scale(False, None, 50)
    assert (scale.num_prompts, scale.num_calibration_prompts, scale.azure_num_prompts) == (50, 50, 50)
    assert scale.rounds == sim_fidelity.FULL.rounds and scale.input_len == sim_fidelity.FULL.input_len
    assert sim_fidelity.choose_scale(True, 3, None) == sim_fidelity.replace(sim_fidelity.QUICK, rounds=3)
    assert sim_fidelity.choose_scale(False, None, None) is sim_fidelity.FULL
    for rounds, num_prompts, message in ((0, None, "--rounds"), (None, 1, "--num-prompts")):
        with pytest.raises(ValueError, match=message):
            sim_fidelity.choose_scale(False, rounds, num_prompts)
    with pytest.raises(SystemExit):  # the parser's error: exit 2 before anything runs
        sim_fidelity.main(["--num-prompts", "0", "--out", "/nonexistent/never"])


def test_farthest_term_names_a_kind_with_enough_steps():
    def r(x, n):
        return {"served_over_predicted": x, "num_steps": n}

    ratios = {"decode": {"prefill": r(5.0, 7), "decode": r(1.02, 929)}, "prefill": {"prefill": r(1.045, 62)}}
    assert sim_fidelity.farthest_term(ratios) == "prefill prefill steps × 1.045"
    few = {"decode": {"prefill": r(5.0, 7), "decode": r(1.2, 9)}}
    assert sim_fidelity.farthest_term(few) == "decode prefill steps × 5.000"
    assert sim_fidelity.farthest_term({}) == "no traced steps"


def test_tracked_profile_refreshes_each_later_round_on_its_own_calibration_run(tmp_path):
    """sim_tracked: a round's runs replayed on the first round's calibrated profile refreshed on
    that round's calibration run (epdserve calibrate --refresh; here round 2's steps took 1.2x
    round 1's); the first round's runs on the first profile itself. The simulated value is the
    mean of the runs' replays, the refresh factors are in the report."""
    import json

    from sim_profiles import profile_dict

    from epdserve.engine.step_shape import StepShape
    from epdserve.sim.cost_model import CostModel

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    shape = StepShape(32, 32 * 33 // 2, 0, 0)
    wall = CostModel.from_dict(profile_dict()).role("colocated").step.time_s(shape)
    dirs = []
    for k, slower in enumerate((1.5, 1.8)):  # round 1: 1.5x the offline profile, round 2: 1.2x that
        steps = tmp_path / f"steps_r{k + 1}"
        steps.mkdir()
        (steps / "colocated-0.jsonl").write_text("\n".join(
            [json.dumps({"worker_id": "colocated-0", "role": "colocated", "num_threads": 1}),
             *(json.dumps({"t": 100.0 * k + i, "wall_s": slower * wall, **shape.to_dict()})
               for i in range(12))]) + "\n")
        dirs.append(str(steps))
        (tmp_path / f"trace_c_r{k + 1}.jsonl").write_text(
            json.dumps({"timestamp": 0, "input_length": 32, "output_length": 3}) + "\n")
    real = runs(ttft_p50_ms=[63.0, 75.6], goodput=[1.0, 1.0])
    cell = {"topology": "colocated=2", "workload": "random", "load": 1.0, "rate": 1.0, "slo": [1000.0, 100.0],
            "num_runs": 2, "real_runs": real, "tags": ["c_r1", "c_r2"], "profiles": {"sim": str(profile)},
            "sim_runs": [], "sim": {}, "step_ratios": {}}
    results = {"scale": sim_fidelity.QUICK.__dict__, "capacities": {"colocated=2": {"random": 1.0}},
               "with_azure": False, "workloads": {"colocated=2": ["random"]},
               "slos": {"random": {"ttft_ms": 1000.0, "tpot_ms": 100.0}}, "cells": [cell], "judgements": {},
               "host_drift": [], "busy_at_start": 0.0, "profile": str(profile), "commands": [],
               "states": {"colocated=2": {"trace_dirs": dirs,
                                          "calibration_windows": [[0, 0.0, 50.0], [1, 100.0, 150.0]],
                                          "first_profile": str(profile),
                                          "runs": [{"tag": "c_r1", "round_index": 0, "window": [0.0, 50.0]},
                                                   {"tag": "c_r2", "round_index": 1,
                                                    "window": [100.0, 150.0]}]}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    report = sim_fidelity.rejudge(tmp_path, redo_calibration=True)
    out = json.loads((tmp_path / "results_rejudged.json").read_text())
    c = out["cells"][0]
    assert c["profiles"]["sim_tracked"] == [str(tmp_path / "rejudged_profile_calibrated_colocated2.json"),
                                            str(tmp_path / "rejudged_profile_calibrated_colocated2_r2.json")]
    # TTFT of one 32-token prompt alone: 42 ms on the offline profile
    assert [r["ttft_p50_ms"] for r in c["sim_tracked_runs"]] == pytest.approx([63.0, 75.6], rel=1e-2)
    assert c["sim_tracked"]["ttft_p50_ms"]["sim"] == pytest.approx(69.3, rel=1e-2)
    assert c["sim"]["ttft_p50_ms"]["sim"] == pytest.approx(63.0, rel=1e-2)  # the first profile for both runs
    assert "sim_tracked" in out["judgements"]
    refresh = json.loads(Path(c["profiles"]["sim_tracked"][1]).read_text())["calibration"]["refresh"]
    factor = refresh["factors"]["colocated"]["factor"]
    assert factor == pytest.approx(1.2, rel=1e-2) and f"round 2: colocated × {factor:.3f}" in report
    # sim_own (a diagnostic): each run on the first profile refreshed on the run's own steps
    own = [str(tmp_path / f"rejudged_profile_calibrated_colocated2_own_c_r{k}.json") for k in (1, 2)]
    assert c["profiles"]["sim_own"] == own
    assert [r["ttft_p50_ms"] for r in c["sim_own_runs"]] == pytest.approx([63.0, 75.6], rel=1e-2)
    assert "The host's speed in each judged run" in report
    speeds = [json.loads(Path(p).read_text())["calibration"]["refresh"]["factors"]["colocated"]["factor"]
              for p in own]
    assert speeds == pytest.approx([1.0, 1.2], rel=1e-2)
    assert f"| co×2 random 1x | colocated × {speeds[0]:.3f} | colocated × {speeds[1]:.3f} |" in report
    assert "(A diagnostic: not judged against the goal.)" in report


def test_a_run_too_short_to_refresh_on_keeps_its_rounds_profile(tmp_path):
    import json

    from sim_profiles import profile_dict

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    steps = tmp_path / "steps_r1"
    steps.mkdir()
    (steps / "colocated-0.jsonl").write_text(json.dumps({"worker_id": "colocated-0", "role": "colocated",
                                                         "num_threads": 1}) + "\n")
    log: list[str] = []
    own = sim_fidelity.own_speed_profiles(profile, [steps], [("c_r1", 0, (0.0, 10.0))],
                                          {"c_r1": profile}, "p", tmp_path, log)
    assert own == {"c_r1": profile} and "--refresh" in log[0]


def test_cpu_use_counts_each_process_and_its_busy_thread_by_name():
    import os
    import subprocess
    import time

    # A child whose second thread burns 0.5 s of CPU, then sleeps: its CPU must show apart from
    # the main thread's (Python's threads carry the process's name).
    code = ("import threading, time\n"
            "def spin():\n"
            "    t = time.process_time()\n"
            "    while time.process_time() - t < 0.5: pass\n"
            "    time.sleep(30)\n"
            "threading.Thread(target=spin, name='spinner').start()\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        with sim_fidelity.cpu_use({"worker": child.pid}) as use:
            deadline = time.monotonic() + 10
            while sum(c for t, (c, _) in sim_fidelity.thread_times(child.pid).items() if t != "main") < 0.49:
                assert time.monotonic() < deadline, "the child's thread never spun"
                time.sleep(0.05)
        assert sim_fidelity.thread_times(os.getpid())  # this process's threads read too
    finally:
        child.kill()
        child.wait(timeout=5)
    assert set(use) == {"worker", "client", "span_s"}
    spun = [c for t, c in use["worker"]["threads"].items() if t != "main"]
    assert spun and max(spun) >= 0.49
    assert use["worker"]["cpu_s"] >= max(spun)
    assert use["worker"]["wait_s"] >= 0.0 and use["span_s"] > 0.0
    assert sim_fidelity.thread_times(child.pid) == {}  # an exited process gives nothing


def test_format_cpu_lists_each_process_in_cores():
    cell = {"topology": "encode=1,prefill=1,decode=1", "workload": "images", "load": 1.5,
            "cpu": [{"router": {"cpu_s": 3.0, "wait_s": 1.0, "threads": {"python": 2.5}},
                     "client": {"cpu_s": 2.0}, "span_s": 10.0},
                    {"router": {"cpu_s": 5.0, "wait_s": 3.0, "threads": {"python": 4.0}},
                     "client": {"cpu_s": 4.0}, "span_s": 10.0}]}
    table = sim_fidelity.format_cpu([cell, {"topology": "colocated=2", "workload": "random", "load": 1}])
    assert "| 1E1P1D images 1.5x | router | 0.40 | 0.20 | python 2.5 |" in table
    assert "| 1E1P1D images 1.5x | client | 0.30 | |  |" in table
    assert "co×2" not in table  # a cell without CPU records (a stored run from before) is left out


def test_ttft_parts_of_a_served_run_come_from_its_stamps_with_the_servers_meanings():
    # Stamps of two requests (one waits 0.5 s for the encoder and 0.2 s for the prefill step),
    # and a stale server decomposition that must not be read; a failed request is left out.
    stamps = [{"arrived": 10.0, "encode_start": 10.5, "encode_end": 11.0, "prefill_start": 11.2,
               "prefill_end": 11.5, "first_token": 11.5, "queue_ms": 999.0},
              {"arrived": 20.0, "encode_start": 20.0, "encode_end": 20.4, "prefill_start": 20.4,
               "prefill_end": 20.7, "first_token": 20.7, "kv_bytes_by_group": {"full": 1}},
              {"arrived": 30.0}]
    real = {"timings": stamps, "errors": ["", "", "boom"]}
    parts = sim_fidelity.ttft_parts(real)
    assert parts["queue_ms"] == pytest.approx(350.0) and parts["encode_ms"] == pytest.approx(450.0)
    assert parts["prefill_ms"] == pytest.approx(300.0) and parts["first_token_ms"] == pytest.approx(0.0)
    breakdown = {k: {"mean": 1.0, "p99": 2.0} for k in sim_fidelity.TTFT_PARTS}
    simulated = {"simulator": {}, "ttft_breakdown_ms": breakdown}
    assert sim_fidelity.ttft_parts(simulated) == dict.fromkeys(sim_fidelity.TTFT_PARTS, 1.0)
    cell = {"topology": "encode=1,prefill=1,decode=1", "workload": "images", "load": 1.5,
            "real_runs": [{"ttft_parts": parts}], "sim_runs": [{"ttft_parts": {**parts, "queue_ms": 500.0}}]}
    table = sim_fidelity.format_ttft_parts([cell])
    assert "| 1E1P1D images 1.5x | 350 / 500 | 450 / 450 | 300 / 300 | 0 / 0 |" in table
