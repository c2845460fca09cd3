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
    return [{m: (values[m][i] if m in values else None) for m in sim_fidelity.METRICS} for i in range(n)]


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
