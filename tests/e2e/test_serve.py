"""End-to-end serving: real router, real worker processes, shared memory and TCP on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serving import SMALL, Server, shm_segments, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def add(a, b):", "Three colors of the rainbow are", "Once upon a time"]


def complete(server: Server, prompt: str, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, **kw}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def pd_shm(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pd_shm")
    server = start_server(SMALL + ["--step-trace-dir", str(log_dir / "steps")], str(log_dir))
    server.step_trace_dir = log_dir / "steps"
    yield server
    stop_server(server)


def greedy_outputs(server: Server) -> list[list]:
    out = []
    for prompt in PROMPTS:
        choice = complete(server, prompt, logprobs=1)["choices"][0]
        out.append([choice["text"], choice["logprobs"]["tokens"]])
    return out


def test_greedy_identical_colocated_pd_shm_pd_tcp(pd_shm, tmp_path):
    pd = greedy_outputs(pd_shm)
    tcp = start_server(SMALL + ["--kv-transport", "tcp"], str(tmp_path / "tcp"))
    try:
        assert greedy_outputs(tcp) == pd
        tcp.wait_all_blocks_free()
    finally:
        stop_server(tcp)
    colocated = start_server(SMALL + ["--colocated-workers", "1", "--cores-per-worker", "2"], str(tmp_path / "co"))
    try:
        assert greedy_outputs(colocated) == pd
        colocated.wait_all_blocks_free()
    finally:
        stop_server(colocated)
    pd_shm.wait_all_blocks_free()


def test_openai_client_streams_chat_and_completions(pd_shm):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{pd_shm.url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 12
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True)
    pieces = [c.choices[0].text for c in stream]
    assert len(pieces) >= 2
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert "".join(pieces) == full.choices[0].text
    assert full.usage.completion_tokens == 10
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    pd_shm.wait_all_blocks_free()


def test_n_seed_stop_timing_and_metrics(pd_shm):
    body = complete(pd_shm, "Write a list of fruits:", n=3, temperature=1.0, seed=11, max_tokens=8, return_timing=True)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    assert body["usage"]["completion_tokens"] <= 24
    timing = body["timing"]
    assert timing["prefill_start"] > 0 and timing["kv_transfer_end"] >= timing["kv_transfer_start"] > 0
    assert timing["ttft_ms"] >= timing["prefill_ms"] > 0
    again = complete(pd_shm, "Write a list of fruits:", n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]
    greedy = complete(pd_shm, "The capital of France is", max_tokens=12)["choices"][0]["text"]
    word = greedy.split()[1]
    stopped = complete(pd_shm, "The capital of France is", max_tokens=12, stop=[word])["choices"][0]
    assert stopped["finish_reason"] == "stop" and word not in stopped["text"]
    metrics = httpx.get(f"{pd_shm.url}/metrics").text
    for name in ("epdserve_time_to_first_token_seconds_bucket", "epdserve_inter_token_latency_seconds_bucket",
                 "epdserve_e2e_request_latency_seconds_bucket", "epdserve_request_queue_time_seconds_bucket",
                 "epdserve_kv_transfer_bytes_total", "epdserve_worker_kv_blocks_used"):
        assert name in metrics
    kv_bytes = [line for line in metrics.splitlines() if line.startswith("epdserve_kv_transfer_bytes_total")]
    assert float(kv_bytes[0].split()[-1]) > 0
    # The router froze its start-up heap, and times its collections (at least the one before the freeze).
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line and not line.startswith("#")}
    assert values["epdserve_router_gc_frozen_objects"] > 10_000
    assert values['epdserve_router_gc_pause_seconds_count{generation="2"}'] >= 1
    pd_shm.wait_all_blocks_free()


@pytest.mark.parametrize(
    "body,fragment",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"prompt": "hi"}), "model"),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": "many"}), "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 5000}), "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi " * 1100, "max_tokens": 5}), "context length"),
        (json.dumps({"model": "gpt-4", "prompt": "hi"}), "does not exist"),
        (json.dumps({"model": MODEL, "prompt": "", "max_tokens": 5}), "empty"),
        (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}), "temperature"),
    ],
)
def test_bad_input_is_400_with_openai_error(pd_shm, body, fragment):
    r = httpx.post(f"{pd_shm.url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "BadRequestError"


def test_bad_chat_input(pd_shm):
    r = httpx.post(f"{pd_shm.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{pd_shm.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400


def _stream_lines(server: Server, body: dict, on_line) -> None:
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and not on_line(line[6:]):
                return


def test_client_disconnect_aborts_and_frees_blocks(pd_shm):
    seen = []
    body = {"model": MODEL, "prompt": "Count: one two three", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    _stream_lines(pd_shm, body, lambda data: seen.append(data) or len(seen) < 3)
    assert len(seen) == 3
    pd_shm.wait_all_blocks_free()
    assert complete(pd_shm, "Hello")["choices"][0]["text"]


def test_overload_is_429_or_503_with_retry_after(tmp_path):
    server = start_server(SMALL + ["--max-pending", "2"], str(tmp_path))
    try:
        body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True}
        results = []

        def send() -> None:
            results.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120))

        threads = [threading.Thread(target=send) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) >= 2 and codes.count(429) >= 1
        refused = next(r for r in results if r.status_code == 429)
        assert refused.headers["retry-after"] and refused.json()["error"]["type"] == "RateLimitError"
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_decode_kv_exhaustion_is_503(tmp_path):
    # 12 blocks of 16 tokens per decode worker: a 300-token prompt cannot be reserved.
    server = start_server(["--max-model-len", "1024", "--num-kv-blocks", "12"], str(tmp_path))
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "word " * 300, "max_tokens": 4})
        assert r.status_code == 503 and "retry-after" in r.headers
        assert complete(server, "Hi", max_tokens=4)["choices"][0]["text"] is not None
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_kill_workers_mid_request_and_rejoin(tmp_path):
    # No automatic restart: this test restarts the worker by hand.
    server = start_server(SMALL + ["--decode-workers", "2", "--max-worker-restarts", "0"], str(tmp_path))
    try:
        decode_pids = {w["id"]: w["pid"] for w in server.workers() if w["role"] == "decode"}
        events: dict[int, list] = {0: [], 1: []}

        def stream(i: int) -> None:
            body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            _stream_lines(server, body, lambda d: events[i].append((time.monotonic(), d)) or d != "[DONE]")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        server.wait_until(lambda: all(len(e) > 3 for e in events.values()), 60, "both streams to start")
        victim = next(w for w in server.workers() if w["role"] == "decode" and w["load"]["num_requests"] > 0)
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        for t in threads:
            t.join(120)
        errored = [i for i, e in events.items() if any('"error"' in d for _, d in e)]
        finished = [i for i, e in events.items() if i not in errored]
        assert len(errored) == 1 and len(finished) == 1
        error_time = next(t for t, d in events[errored[0]] if '"error"' in d)
        assert error_time - killed_at < 2.0
        assert any(d == "[DONE]" for _, d in events[finished[0]])
        assert server.worker(victim["id"])["state"] == "dead"
        assert not shm_segments(victim["pid"])  # the dead worker's pool was unlinked
        # New requests go to the live decode worker.
        assert complete(server, "Hello")["choices"][0]["text"]
        server.wait_all_blocks_free()

        # A restarted worker rejoins under its old id.
        restarted = subprocess.Popen(
            [sys.executable, "-m", "epdserve.cli", "worker", "--role", "decode", "--router", server.router,
             "--cluster-key-file", str(server.key_file),
             "--worker-id", victim["id"], *SMALL],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            server.wait_until(lambda: server.worker(victim["id"])["state"] == "ready", 90, "the worker to rejoin")
            for _ in range(4):
                assert complete(server, "Hi again")["choices"][0]["text"] is not None
            server.wait_all_blocks_free()
        finally:
            restarted.send_signal(signal.SIGTERM)
            restarted.wait(20)
        assert decode_pids
    finally:
        stop_server(server)


def test_kill_prefill_worker_frees_decode_reservation(tmp_path):
    # Small chunks stretch the prefill over many steps, so the kill lands in the middle of it.
    server = start_server(SMALL + ["--prefill-workers", "2", "--max-num-batched-tokens", "64"], str(tmp_path))
    try:
        result = {}

        def send() -> None:
            body = {"model": MODEL, "prompt": "word " * 900, "max_tokens": 4}
            result["r"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            result["at"] = time.monotonic()

        thread = threading.Thread(target=send)
        thread.start()
        server.wait_until(
            lambda: any(w["role"] == "prefill" and w["load"]["num_requests"] > 0 for w in server.workers()),
            30, "the prefill to start",
        )
        victim = next(w for w in server.workers() if w["role"] == "prefill" and w["load"]["num_requests"] > 0)
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        thread.join(30)
        answered_at = result["at"]
        assert result["r"].status_code == 503 and answered_at - killed_at < 2.0
        assert "prefill worker" in result["r"].json()["error"]["message"]
        server.wait_all_blocks_free()
        assert complete(server, "Still alive?")["choices"][0]["text"] is not None
    finally:
        stop_server(server)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_stalled_transfer_times_out_under_policy(tmp_path, pd_shm, policy):
    expected = complete(pd_shm, "The capital of France is", max_tokens=10)["choices"][0]["text"]
    server = start_server(SMALL + ["--debug-stall-kv-transfers", "--transfer-timeout", "1",
                                   "--transfer-policy", policy], str(tmp_path))
    try:
        lines = []
        body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
                "stream": True}
        _stream_lines(server, body, lambda d: lines.append(d) or d != "[DONE]")
        chunks = [json.loads(d) for d in lines if d != "[DONE]"]
        if policy == "fail":
            assert "error" in chunks[-1] and "did not finish" in chunks[-1]["error"]["message"]
            assert len(chunks) == 2  # the first token, then the error
        else:
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_api_key_shm_mode_and_cleanup_after_router_crash(tmp_path):
    server = start_server(SMALL + ["--api-key", "sekret"], str(tmp_path))
    try:
        decode = next(w for w in server.workers() if w["role"] == "decode")
        segments = shm_segments(decode["pid"])  # its KV pool and its write fence
        assert sorted(os.path.basename(s).split("-")[1] for s in segments) == ["fence", "kv"]
        assert all((os.stat(s).st_mode & 0o777) == 0o600 for s in segments)
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        pids = [w["pid"] for w in server.workers()]
        os.kill(server.process.pid, signal.SIGKILL)  # the router dies without any clean-up of its own
        server.process.wait(10)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "workers outlived the router"
        assert not shm_segments(decode["pid"])
    finally:
        if server.process.poll() is None:
            stop_server(server)


def test_workers_trace_their_steps_and_calibrate_reads_them(pd_shm):
    """--step-trace-dir: each step worker writes its steps (shape, time in service); the
    prefill worker's steps are the prompt's tokens, the decode worker's one sequence each."""
    from sim_profiles import profile_dict

    from epdserve.planner.calibrate import MIN_STEPS, calibrate, neighbour_split, read_step_trace
    from epdserve.sim.cost_model import CostModel

    for i in range(MIN_STEPS):
        out = complete(pd_shm, f"Tracing the steps of request {i}", max_tokens=3, ignore_eos=True)
    num_prompt = out["usage"]["prompt_tokens"]
    traces = {}
    for path in pd_shm.step_trace_dir.glob("*.jsonl"):
        trace = read_step_trace(path)
        traces[trace.role] = list(zip(trace.shapes, trace.walls.tolist()))
        assert trace.cores  # the header names the worker's cores (calibrate: who time-shares them)
    assert set(traces) == {"prefill", "decode"}
    assert any(s.num_prefill_tokens == num_prompt and s.num_decode_seqs == 0 for s, _ in traces["prefill"])
    assert traces["decode"] and all(s.num_prefill_tokens == 0 and s.num_decode_seqs >= 1 for s, _ in traces["decode"])
    assert all(t > 0 for steps in traces.values() for _, t in steps)
    for path in pd_shm.step_trace_dir.glob("*.jsonl"):  # the worker's CPU time per step
        records = [json.loads(line) for line in path.read_text().splitlines()[1:]]
        assert records and all(r["cpu_s"] >= 0 for r in records)
        # The pool's free blocks after each step (a running sequence holds some); no tiers, no pins.
        assert all(isinstance(r["free_blocks"], int) and r["free_blocks"] >= 0 for r in records)
        assert not any("pinned_blocks" in r for r in records)
        # The prompts each step computed tokens of (the fixture's server has run other tests'
        # requests too): some whenever a step computed prompt tokens, none otherwise.
        assert all((r["num_prefill_seqs"] > 0) == (r["num_prefill_tokens"] > 0)
                   and r["num_prefill_seqs"] <= r["num_prefill_tokens"] for r in records)
    # Calibrating a synthetic profile on them scales each role by its fitted factor for a step alone.
    cost = CostModel.from_dict(profile_dict())
    calibrated, result = calibrate(cost, pd_shm.step_trace_dir)
    assert set(result) == {"prefill", "decode"}
    # served_s is the steps' time on a core of their own: where the fixture's earlier requests ran
    # a prefill and a decode step at once on a shared core, less than their wall time.
    read = [read_step_trace(path) for path in pd_shm.step_trace_dir.glob("*.jsonl")]
    alone = {t.role: float((t.walls / neighbour_split(t, read)[0]).sum()) for t in read}
    for role, cal in result.items():
        assert cal.served_s == pytest.approx(alone[role], rel=1e-3)
        assert cal.served_s <= sum(t for _, t in traces[role]) * (1 + 1e-9)
        assert calibrated.role(role).step.base_s == pytest.approx(cost.role(role).step.base_s * cal.alone[0])
        neighbour = calibrated.role(role).neighbour_step
        assert (neighbour is None) == (not any(cal.busy))
        if neighbour is not None:
            assert neighbour.base_s == pytest.approx(cost.role(role).step.base_s * cal.busy[0])
    pd_shm.wait_all_blocks_free()
