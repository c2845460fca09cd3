"""Workers that change role at run time, on a real server: a switch requested through the API
(prefill -> decode, decode -> prefill) serves greedy-identical output in the new role and frees
every block and the old role's shared memory; a switch begun while requests are in flight
loses none of them; under a scripted burst of long prompts the controller
(``--role-switching auto``) moves a decode worker to prefill by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest
from serving import SMALL, start_server, stop_server
from sim_profiles import profile_dict

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]


def _complete(url: str, prompt: str | list[int], max_tokens: int = 24, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _texts(url: str) -> list[str]:
    return [_complete(url, p)["choices"][0]["text"] for p in PROMPTS]


def _switch(url: str, worker_id: str, role: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/workers/{worker_id}/role", json={"role": role}, timeout=10)


def _kv_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("epdserve-")}


def _wait_role(server, worker_id: str, role: str, timeout_s: float = 60) -> None:
    server.wait_until(lambda: (w := server.worker(worker_id))["role"] == role and w["state"] == "ready",
                      timeout_s, f"{worker_id} to serve as {role}")


def test_switched_workers_serve_identically_and_free_the_old_role(tmp_path):
    before_start = _kv_segments()
    server = start_server(SMALL + ["--prefill-workers", "2", "--decode-workers", "1", "--dtype", "float32",
                                   "--role-switching", "manual"], str(tmp_path))
    try:
        reference = _texts(server.url)
        segments = _kv_segments() - before_start
        # prefill-1 -> decode: two decode workers now.
        r = _switch(server.url, "prefill-1", "decode")
        assert r.status_code == 202, r.text
        assert r.json()["from_role"] == "prefill" and r.json()["to_role"] == "decode"
        _wait_role(server, "prefill-1", "decode")
        # decode-0 -> prefill: the switched worker is now the only decode worker, so every
        # request below decodes there (and prefills on prefill-0 or decode-0).
        assert _switch(server.url, "decode-0", "prefill").status_code == 202
        _wait_role(server, "decode-0", "prefill")
        assert _texts(server.url) == reference
        assert _texts(server.url) == reference  # both prefill workers took some
        roles = httpx.get(f"{server.url}/v1/roles", timeout=10).json()
        assert roles["workers"] == {"prefill": {"ready": 2}, "decode": {"ready": 1}}
        assert [(s["worker"], s["to_role"]) for s in roles["switches"]] == [("prefill-1", "decode"),
                                                                            ("decode-0", "prefill")]
        assert server.worker("decode-0")["num_role_switches"] == 1
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'epdserve_role_switches_total{from_role="prefill",to_role="decode"} 1.0' in metrics
        assert 'epdserve_role_switches_total{from_role="decode",to_role="prefill"} 1.0' in metrics
        assert 'epdserve_worker_up{role="decode",worker="decode-0"}' not in metrics  # its old series went
        server.wait_all_blocks_free()
        # decode-0's pages (and fence) were unlinked; prefill-1 made its own.
        now = _kv_segments() - before_start
        assert len(now) == len(segments) and not now & segments
        # Refusals: the last ready decode worker, an unknown worker, a bad role, the same role.
        r = _switch(server.url, "prefill-1", "prefill")
        assert r.status_code == 409 and "last ready decode worker" in r.json()["error"]["message"], r.text
        assert _switch(server.url, "nope", "decode").status_code == 404
        r = _switch(server.url, "prefill-0", "encode")
        assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
        r = _switch(server.url, "prefill-0", "prefill")
        assert r.status_code == 409 and "already" in r.json()["error"]["message"], r.text
        _plan_from_the_server(server, tmp_path)
    finally:
        stop_server(server)
    assert not _kv_segments() - before_start


def _plan_from_the_server(server, tmp_path) -> None:
    """GET /v1/traffic has every request above; ``epdserve plan --from-server`` plans for them
    with the server's three workers and names the switches (a synthetic profile: the plan's
    numbers are not the subject)."""
    traffic = httpx.get(f"{server.url}/v1/traffic", params={"window_s": 3600}, timeout=10).json()
    assert traffic["num_requests"] == 3 * len(PROMPTS)  # the three greedy rounds
    assert traffic["columns"] == ["arrived_s", "prompt_tokens", "output_tokens", "service_class"]
    assert all(row[2] == 24 and row[3] == "interactive" for row in traffic["requests"])
    assert httpx.get(f"{server.url}/v1/traffic", params={"window_s": -1}, timeout=10).status_code == 400
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "epdserve.cli", "plan", "--profile", str(profile),
                           "--from-server", server.url, "--slo", "ttft_p90:2000,tpot_p90:200",
                           "--time-budget-s", "20", "--workers", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"server {server.url}: decode=1, prefill=2; {traffic['num_requests']} requests" in done.stdout
    plan = json.loads(out.read_text())
    assert plan["instances"] == 3 and plan["from_server"]["workers"] == {"prefill": 2, "decode": 1}
    for switch in plan["from_server"]["switches"]:
        assert f"/v1/workers/{switch['worker']}/role" in done.stdout


def test_switch_requested_while_requests_are_in_flight_loses_none(tmp_path):
    """decode-1 holds running requests when it is asked to become a prefill worker: it hands them
    over to decode-0 (their KV copied, they continue there) and switches while they still run;
    then it comes back and decode-0 leaves, handing them (some a second time) back. Every one
    completes with the greedy output it has without a switch, and new requests are served
    meanwhile."""
    server = start_server(SMALL + ["--prefill-workers", "1", "--decode-workers", "2", "--dtype", "float32",
                                   "--role-switching", "manual"], str(tmp_path))
    try:
        long = {"max_tokens": 320, "ignore_eos": True}
        results: dict[str, dict] = {}

        def run(prompt: str) -> None:
            results[prompt] = _complete(server.url, prompt, **long)

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]  # the reference: no switch
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        reference = {p: r["choices"][0]["text"] for p, r in results.items()}
        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
        for t in threads:
            t.start()
        # Both decode workers hold some of them (least-loaded routing alternates).
        server.wait_until(lambda: all(server.worker(w)["load"]["num_running"] > 0 for w in ("decode-0", "decode-1")),
                          60, "both decode workers to run requests")
        r = _switch(server.url, "decode-1", "prefill")
        assert r.status_code == 202, r.text
        assert r.json()["state"] in ("draining", "switching") and r.json()["num_requests"] > 0
        _wait_role(server, "decode-1", "prefill", 30)
        assert any(t.is_alive() for t in threads)  # it switched while the requests ran: handed over
        # Back to decode, and decode-0 leaves in turn: the requests it took over move a second time.
        assert _switch(server.url, "decode-1", "decode").status_code == 202
        _wait_role(server, "decode-1", "decode", 30)
        assert _switch(server.url, "decode-0", "prefill").status_code == 202
        _wait_role(server, "decode-0", "prefill", 30)
        assert any(t.is_alive() for t in threads)
        extra = _complete(server.url, "A new request after the switch", ignore_eos=True)
        assert extra["usage"]["completion_tokens"] == 24
        for t in threads:
            t.join(120)
        assert {p: r["choices"][0]["text"] for p, r in results.items()} == reference
        assert all(r["usage"]["completion_tokens"] == 320 for r in results.values())
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'epdserve_handovers_total{outcome="moved"}' in metrics
        assert 'epdserve_requests_total{outcome="failed"}' not in metrics
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_a_hand_over_the_target_cannot_take_is_recomputed(tmp_path):
    """With one seat per decode worker, the other decode worker cannot reserve for the running
    request: the hand-over falls back to recomputing the prompt and its tokens so far there;
    the request still completes whole and nothing leaks."""
    server = start_server(SMALL + ["--prefill-workers", "1", "--decode-workers", "2", "--dtype", "float32",
                                   "--max-num-seqs", "1", "--role-switching", "manual"], str(tmp_path))
    try:
        results: dict[str, dict] = {}

        def run(prompt: str) -> None:
            results[prompt] = _complete(server.url, prompt, max_tokens=120, ignore_eos=True)

        threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:2]]
        for t in threads:
            t.start()
        server.wait_until(lambda: all(server.worker(w)["load"]["num_running"] > 0 for w in ("decode-0", "decode-1")),
                          60, "both decode workers to run a request")
        assert _switch(server.url, "decode-1", "prefill").status_code == 202
        _wait_role(server, "decode-1", "prefill", 60)
        for t in threads:
            t.join(120)
        assert all(r["usage"]["completion_tokens"] == 120 for r in results.values()) and len(results) == 2
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'epdserve_handovers_total{outcome="recomputed"} 1.0' in metrics
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_prompts_queued_for_a_leaving_decode_worker_are_sent_elsewhere(tmp_path):
    """Long prompts queue at the one prefill worker with their blocks reserved on both decode
    workers; decode-1 leaves: the prompts not yet started have their KV sent to decode-0's
    blocks instead (re-pointed), so decode-1 switches without waiting for the queue, and every
    answer is the one served without the switch."""
    server = start_server(SMALL + ["--kv-cache-memory", "0.3", "--prefill-workers", "1", "--decode-workers", "2",
                                   "--dtype", "float32", "--role-switching", "manual"], str(tmp_path))
    try:
        prompts = [[(7 * i + 31 * k) % 3000 + 200 for i in range(600)] for k in range(6)]
        reference = [_complete(server.url, p, 8)["choices"][0]["text"] for p in prompts]
        results: dict[int, dict] = {}

        def run(k: int) -> None:
            results[k] = _complete(server.url, prompts[k], 8)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        server.wait_until(lambda: server.worker("decode-1")["load"]["num_requests"] >= 2, 30,
                          "decode-1 to hold reservations")
        assert _switch(server.url, "decode-1", "prefill").status_code == 202
        _wait_role(server, "decode-1", "prefill", 60)
        for t in threads:
            t.join(120)
        assert [results[k]["choices"][0]["text"] for k in range(len(prompts))] == reference
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'epdserve_handovers_total{outcome="retargeted"}' in metrics
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_controller_moves_a_decode_worker_to_prefill_under_long_prompts(tmp_path):
    """A burst of long prompts queues prompt work far past the TTFT target on the one prefill
    worker while decode has slack: the controller drains a decode worker and makes it a
    prefill worker, which then serves greedy-identical output."""
    # Room for the burst's KV on the decode side (the controller keeps the donor's KV in use
    # after the switch below its band).
    server = start_server(SMALL + ["--kv-cache-memory", "0.3", "--prefill-workers", "1", "--decode-workers", "2",
                                   "--dtype", "float32", "--role-switching", "auto", "--role-switching-slo", "ttft:100,tpot:5000",
                                   "--role-switching-interval", "0.2", "--role-switching-dwell", "0",
                                   "--role-switching-window", "3"], str(tmp_path))
    try:
        reference = _texts(server.url)
        long_prompts = [[(7 * i + 13 * k) % 3000 + 200 for i in range(400)] for k in range(8)]
        threads = [threading.Thread(target=_complete, args=(server.url, p, 4)) for p in long_prompts]
        for t in threads:
            t.start()
        server.wait_until(lambda: any(w["role"] == "prefill" and w["id"].startswith("decode")
                                      and w["state"] == "ready" for w in server.workers()),
                          120, "the controller to move a decode worker to prefill")
        for t in threads:
            t.join(180)
        roles = httpx.get(f"{server.url}/v1/roles", timeout=10).json()
        switch = roles["switches"][0]
        assert switch["from_role"] == "decode" and switch["to_role"] == "prefill"
        assert switch["reason"].startswith("controller: prefill pressure")
        assert roles["workers"]["prefill"]["ready"] == 2 and roles["workers"]["decode"]["ready"] == 1
        assert _texts(server.url) == reference
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
