"""`epdserve bench serve` end to end against a real epdserve P/D server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from serving import SMALL, start_server, stop_server

pytestmark = pytest.mark.slow


def test_bench_serve_against_epdserve(tmp_path):
    server = start_server(SMALL, str(tmp_path / "logs"))
    try:
        result_path = tmp_path / "result.json"
        cmd = [
            sys.executable, "-m", "epdserve.cli", "bench", "serve", "--base-url", server.url,
            "--dataset", "random", "--random-input-len", "32", "--random-output-len", "8",
            "--num-prompts", "6", "--max-concurrency", "3", "--return-timing", "--goodput", "ttft:60000",
            "--result-json", str(result_path), "--plots", str(tmp_path / "plots"), "--disable-tqdm",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "Serving Benchmark Result" in proc.stdout
        result = json.loads(result_path.read_text())
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["total_output_tokens"] == 6 * 8
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])
        for key in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p50_e2el_ms"):
            assert result[key] > 0
        breakdown = result["ttft_breakdown_ms"]
        assert breakdown["prefill_ms"]["mean"] > 0 and "exposed_transfer_ms" in breakdown
        assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["itl_cdf.png", "timeline.png", "ttft_cdf.png"]
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_bench_serve_unreachable_server_is_a_clear_error():
    cmd = [sys.executable, "-m", "epdserve.cli", "bench", "serve", "--base-url", "http://127.0.0.1:9",
           "--model", "x", "--num-prompts", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "epdserve bench: error: cannot reach server at http://127.0.0.1:9 (ClientConnectorError)"
    ]
