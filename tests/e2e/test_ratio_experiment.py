"""``bench experiment ratio --quick``: files and keys, and how the results are summarized. Never timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epdserve.bench.experiments.ratio import TOPOLOGIES, measured, predicted, summarize

EXPERIMENT_TIMEOUT_S = 420


def test_predicted_prefers_the_served_default_candidate():
    plan = {"candidates": [
        {"topology": "colocated=2", "max_num_seqs": {"colocated": 64}, "max_rate": 9.0},
        {"topology": "colocated=2", "max_num_seqs": {}, "max_rate": 4.0},
        {"topology": "prefill=1,decode=1", "max_num_seqs": {"decode": 64}, "max_rate": 3.0},
    ]}
    assert predicted(plan, "colocated=2")["max_rate"] == 4.0
    assert predicted(plan, "prefill=1,decode=1")["max_rate"] == 3.0
    assert predicted(plan, "colocated=1") is None


def test_measured_reads_the_sweep_capacity():
    levels = [{"request_rate": r, "slo_attainment": a, "request_goodput": g, "ttft_p99_ms": 1.0, "tpot_p99_ms": 1.0}
              for r, a, g in ((1.0, 1.0, 0.9), (2.0, 0.95, 1.8), (3.0, 0.5, 1.2))]
    assert measured({"levels": levels, "max_level_at_90pct_slo": 2.0})["goodput"] == 1.8
    assert measured({"levels": levels, "max_level_at_90pct_slo": None})["max_rate"] == 0.0


def test_summarize_maps_a_colocated_verdict_to_two_workers():
    topologies = {t: {"predicted_max_rate": p, "measured_max_rate": m}
                  for t, p, m in (("colocated=1", 2.0, 1.5), ("colocated=2", 3.0, 2.5), ("prefill=1,decode=1", 1.0, 1.0))}
    plan = {"verdict": {"choice": "colocated", "configuration": {"topology": "colocated=1"}}}
    summary = summarize(topologies, plan)
    assert summary["plan_choice"] == "colocated=2"
    assert summary["measured_best"] == "colocated=2" and summary["predicted_best"] == "colocated=2"
    assert summary["is_plan_choice_measured_best"]


@pytest.mark.slow
def test_ratio_quick(tmp_path):
    out = tmp_path / "ratio"
    proc = subprocess.run([sys.executable, "-m", "epdserve.cli", "bench", "experiment", "ratio", "--out", str(out),
                           "--quick"], capture_output=True, text=True, timeout=EXPERIMENT_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = (out / "report.md").read_text()
    assert report.startswith("# ratio")
    assert f"epdserve bench experiment ratio --out {out} --quick" in report
    results = json.loads((out / "results.json").read_text())
    assert set(results["topologies"]) == set(TOPOLOGIES)
    for entry in results["topologies"].values():
        assert {"predicted", "predicted_max_rate", "measured", "measured_max_rate"} <= set(entry)
        assert entry["measured"]["levels"]
    assert {"plan_verdict", "plan_choice", "predicted_best", "measured_best", "is_plan_choice_measured_best",
            "commands"} <= set(results)
    for name in ("profile_1thread.json", "profile_colocated_2threads.json", "plan_2_instances.json",
                 "plan_colocated_2threads.json", "goodput_predicted_vs_measured.png"):
        assert (out / name).stat().st_size > 0
