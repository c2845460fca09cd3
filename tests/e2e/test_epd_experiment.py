"""``bench experiment epd --quick``: the files and keys it writes, and the arms' serve flags.
Never timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from epdserve.bench.experiments.epd import FULL, QUICK, arms

EXPERIMENT_TIMEOUT_S = 240
CELL_KEYS = {"ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "breakdown_mean_ms", "num_errors",
             "embedding_bytes_per_image", "kv_bytes_per_request", "e_to_p_over_p_to_d", "num_encoder_cache_hits"}
ARM_KEYS = {"embedding_bytes_per_image", "kv_bytes_per_request", "e_to_p_over_p_to_d"}
TOP_KEYS = {"pipelined_over_unpipelined_multi", "epd_over_colocated_small", "epd_over_colocated_multi"}


def test_arms_share_two_cores_and_differ_only_in_topology():
    flags = arms(FULL)
    assert {"colocated", "epd", "epd_no_pipeline"} <= set(flags)
    assert "--no-encode-pipeline" in flags["epd_no_pipeline"] and "--no-encode-pipeline" not in flags["epd"]
    assert [f for f in flags["epd_no_pipeline"] if f != "--no-encode-pipeline"] == flags["epd"]
    colocated = flags["colocated"]
    assert colocated[colocated.index("--cores-per-worker") + 1] == "2"
    assert colocated[colocated.index("--vision") + 1] == "default"
    assert set(arms(QUICK)) == {"colocated", "epd", "epd_no_pipeline"}


@pytest.mark.slow
def test_quick_run_writes_report_results_and_plots(tmp_path):
    out = tmp_path / "epd"
    proc = subprocess.run([sys.executable, "-m", "epdserve.cli", "bench", "experiment", "epd", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=EXPERIMENT_TIMEOUT_S,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert TOP_KEYS <= set(results)
    for arm in ("colocated", "epd", "epd_no_pipeline"):
        assert ARM_KEYS <= set(results[arm])
        for load in ("small", "multi"):
            cell = results[arm][load]
            assert CELL_KEYS <= set(cell), (arm, load)
            assert cell["num_errors"] == 0, cell["errors"]
            assert cell["num_encoder_cache_hits"] == 0  # every image is distinct
            assert cell["num_images_per_request"] == (1 if load == "small" else 2)
    for arm in ("epd", "epd_no_pipeline"):
        # every image crossed E -> P, and its bytes are tokens x hidden x dtype bytes
        expected = results["expected"]["loads"]["small"]["embedding_bytes_per_image"]
        assert results[arm]["embedding_bytes_per_image"] == expected
        assert results[arm]["kv_bytes_per_request"] > 0
    assert results["colocated"]["embedding_bytes_per_image"] == 0  # in-process: nothing crosses a hop
    report = (out / "report.md").read_text()
    for text in ("# epd", "TTFT P50", "goal ≤ 0.7", "ttft_breakdown.png", "timeline.png"):
        assert text in report
    assert (out / "ttft_breakdown.png").stat().st_size > 0 and (out / "timeline.png").stat().st_size > 0
