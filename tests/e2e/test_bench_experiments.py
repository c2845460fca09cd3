"""``bench sweep`` and ``bench experiment``: files and keys of quick runs, the sweep's capacity
rule on hand-made data, the namespace plumbing, and one-line errors. Never timings."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import pytest
from serving import SMALL, start_server, stop_server

from epdserve.bench import BenchError
from epdserve.bench.sweep import max_level_meeting_slo, parse_levels

EXPERIMENT_TIMEOUT_S = 240


def run_cli(*args: str, timeout: float = EXPERIMENT_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


# ---- the sweep's capacity rule ----------------------------------------------------------------


@pytest.mark.parametrize(
    "attainments, expected",
    [
        ([0.99, 0.95, 0.90, 0.50], 4.0),  # exactly 90 % still meets the target
        ([1.0, 1.0, 1.0, 1.0], 8.0),
        ([0.85, 0.99, 0.99, 0.99], None),  # the lowest level already misses
        ([0.95, 0.60, 0.97, 0.20], 1.0),  # a pass above a failure is noise, not capacity
    ],
)
def test_max_level_meeting_slo(attainments, expected):
    assert max_level_meeting_slo([1.0, 2.0, 4.0, 8.0], attainments) == expected


def test_max_level_meeting_slo_other_target():
    assert max_level_meeting_slo([1.0, 4.0, 16.0], [0.8, 0.7, 0.4], target=0.75) == 1.0
    assert max_level_meeting_slo([], []) is None


def test_parse_levels():
    assert parse_levels("4,1,2", is_rate=True) == [1.0, 2.0, 4.0]
    assert parse_levels("1,inf", is_rate=True) == [1.0, float("inf")]
    assert parse_levels("16,1,4", is_rate=False) == [1.0, 4.0, 16.0]
    for text, is_rate in (("1,x", True), ("0,1", True), ("1,1", True), ("1.5", False), ("inf", False), ("", True)):
        with pytest.raises(BenchError):
            parse_levels(text, is_rate)


# ---- one-line errors ------------------------------------------------------------------------


def _one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr


def test_unknown_experiment_is_a_one_line_error(tmp_path):
    proc = run_cli("bench", "experiment", "no-such-thing", "--out", str(tmp_path / "x"), timeout=60)
    _one_line_error(proc, "unknown experiment 'no-such-thing'; choose one of interference, kv-exposure")
    assert not (tmp_path / "x").exists()


def test_sweep_against_an_unreachable_server_is_a_one_line_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_cli("bench", "sweep", "--base-url", f"http://127.0.0.1:{port}", "--request-rates", "1,2",
                   "--goodput", "ttft:100", "--out", str(tmp_path / "sweep"), timeout=60)
    _one_line_error(proc, f"cannot reach server at http://127.0.0.1:{port}")


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--request-rates", "1,abc"), "levels must be comma-separated numbers"),
        (("--concurrencies", "2.5"), "--concurrencies takes whole numbers"),
        (("--request-rates", "1", "--goodput", "itl:5"), "--goodput metric must be one of"),
    ],
)
def test_sweep_bad_arguments_are_one_line_errors(tmp_path, extra, message):
    args = ["--goodput", "ttft:100"] if "--goodput" not in extra else []
    proc = run_cli("bench", "sweep", "--base-url", "http://127.0.0.1:9", *extra, *args,
                   "--out", str(tmp_path / "s"), timeout=60)
    _one_line_error(proc, message)


# ---- network namespaces (skipped where the machine refuses them) ------------------------------


@pytest.fixture
def veth_link():
    from epdserve.bench.experiments.netns import NetnsUnavailable, create_veth_link, delete_veth_link

    try:
        link = create_veth_link("10gbit")
    except NetnsUnavailable as e:
        pytest.skip(f"cannot create network namespaces here: {e}")
    yield link
    delete_veth_link(link)


def test_veth_link_carries_a_tcp_stream(veth_link):
    from epdserve.bench.experiments.bandwidth import tcp_stream_gbps

    gbps = tcp_stream_gbps(2**20, num_repeats=1, host=veth_link.decode_addr, listen_ns=veth_link.decode_ns,
                           connect_ns=veth_link.prefill_ns)
    assert gbps > 0


def test_relay_reaches_this_namespace_from_inside_another(veth_link):
    from epdserve.bench.experiments.launch import stop_process, wait_for_line
    from epdserve.bench.experiments.netns import InNamespace
    from epdserve.bench.experiments.ns_workers import RELAY_READY

    echo = socket.create_server(("127.0.0.1", 0))

    def serve_once() -> None:
        conn, _ = echo.accept()
        with conn:
            conn.sendall(conn.recv(64).upper())

    threading.Thread(target=serve_once, daemon=True).start()
    relay = subprocess.Popen(
        [sys.executable, "-m", "epdserve.bench.experiments.relay", "--netns", veth_link.decode_ns,
         "--target", f"127.0.0.1:{echo.getsockname()[1]}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        port = int(wait_for_line(relay, RELAY_READY, 60, "relay").group(1))
        with InNamespace(veth_link.decode_ns):
            client = socket.create_connection(("127.0.0.1", port), timeout=10)
        with client:
            client.sendall(b"hello")
            assert client.recv(64) == b"HELLO"
    finally:
        stop_process(relay)
        echo.close()


# ---- quick runs end to end: files and keys only ---------------------------------------------


@pytest.mark.slow
def test_sweep_writes_levels_and_the_capacity(tmp_path):
    server = start_server(SMALL, str(tmp_path / "logs"))
    try:
        out = tmp_path / "sweep"
        proc = run_cli("bench", "sweep", "--base-url", server.url, "--concurrencies", "1,2",
                       "--random-input-len", "16", "--random-output-len", "4", "--num-prompts", "3",
                       "--goodput", "ttft:60000", "tpot:60000", "--out", str(out), "--disable-tqdm")
        assert proc.returncode == 0, proc.stderr
        assert "highest concurrency with >= 90 % of requests within every SLO: 2" in proc.stdout
        sweep = json.loads((out / "sweep.json").read_text())
        assert sweep["sweep"] == "max_concurrency" and sweep["max_level_at_90pct_slo"] == 2
        assert sweep["max_concurrency_at_90pct_slo"] == 2
        assert [level["max_concurrency"] for level in sweep["levels"]] == [1, 2]
        for level in sweep["levels"]:
            assert {"request_throughput", "request_goodput", "slo_attainment", "ttft_p50_ms", "ttft_p99_ms",
                    "tpot_p50_ms", "tpot_p99_ms"} <= set(level)
            assert level["slo_attainment"] == 1.0 and level["completed"] == 3
        assert (out / "goodput.png").stat().st_size > 0
        assert sorted(p.name for p in (out / "levels").iterdir()) == ["max_concurrency_1.json", "max_concurrency_2.json"]
    finally:
        stop_server(server)


def _run_quick(name: str, out) -> None:
    proc = run_cli("bench", "experiment", name, "--out", str(out), "--quick")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "report.md").read_text().startswith(f"# {name}")
    assert f"epdserve bench experiment {name} --out {out} --quick" in (out / "report.md").read_text()


@pytest.mark.slow
def test_interference_quick(tmp_path):
    out = tmp_path / "interference"
    _run_quick("interference", out)
    results = json.loads((out / "results.json").read_text())
    assert {"colocated", "pd"} <= set(results)
    assert len([k for k in results if k.startswith("colocated_chunk_")]) == 2
    for arm in results.values():
        assert {"itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50", "prefill_ms"} <= set(arm)
    for png in ("itl_over_time.png", "itl_cdf.png"):
        assert (out / png).stat().st_size > 0


@pytest.mark.slow
def test_kv_exposure_quick(tmp_path):
    out = tmp_path / "kv-exposure"
    _run_quick("kv-exposure", out)
    rows = json.loads((out / "results.json").read_text())
    assert {(r["transport"], r["layerwise"]) for r in rows} == {
        ("shm", True), ("shm", False), ("tcp", True), ("tcp", False)
    }
    for row in rows:
        assert {"transport", "layerwise", "prompt_len", "kv_bytes", "exposed_ms", "ttft_ms",
                "theoretical_ms", "exposed_share_of_ttft"} <= set(row)
    assert (out / "kv_exposure.png").stat().st_size > 0


@pytest.mark.slow
def test_handoff_paths_quick(tmp_path):
    out = tmp_path / "handoff"
    _run_quick("handoff-paths", out)
    rows = json.loads((out / "results.json").read_text())
    assert {r["path"] for r in rows} == {"memcpy", "pickle_socket", "fresh_shm", "prealloc_shm_memcpy",
                                        "registered_slab", "registered_slab_in_place"}
    for row in rows:
        assert {"path", "bytes", "ms", "gbps"} <= set(row)
    assert (out / "handoff_paths.png").stat().st_size > 0
