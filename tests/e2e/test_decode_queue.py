"""P/D on a full decode worker: reservations wait, by service class then arrival, for a bounded time.

Real router and worker processes. The decode worker has two sequence seats (--max-num-seqs 2):
requests beyond them wait in its reservation queue instead of being refused, a wait that runs
out is a 503 naming the limit, a client that leaves while waiting takes its place with it, and
a realtime request that arrives later takes the first free seat before an interactive one.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from serving import SMALL, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUEUE_TIMEOUT_S = 8.0  # long enough for step 4's interactive request to outwait a realtime one
DECODE_BLOCKS = 48


def _decode(server) -> dict:
    return next(w for w in server.workers() if w["role"] == "decode")


def _hold(server, prompt: str, started: threading.Event, leave: threading.Event) -> None:
    """A long stream that holds a decode seat: ``started`` set at its first token; it leaves
    (aborting the request, freeing the seat) once ``leave`` is set."""
    long = {"model": MODEL, "prompt": prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
            if leave.is_set():
                return


def test_full_decode_worker_queues_then_times_out_and_forgets_leavers(tmp_path):
    # float32: the test compares greedy answers in a batch with each alone, and in bfloat16 a
    # near tie between two tokens can go either way with the batch's shape.
    server = start_server(SMALL + ["--dtype", "float32", "--max-num-seqs", "2", "--decode-queue-timeout", str(QUEUE_TIMEOUT_S),
                                   "--decode-num-kv-blocks", str(DECODE_BLOCKS)], str(tmp_path))
    try:
        # The decode worker's pool is sized apart (block 0 is the null block).
        free = {w["role"]: w["load"]["num_free_blocks"] for w in server.workers()}
        assert free["decode"] == DECODE_BLOCKS - 1 and free["prefill"] != DECODE_BLOCKS - 1, free

        # 1. Six requests at once on two seats: all are served, each greedy answer as alone.
        prompts = [f"Fact number {i} about the sea:" for i in range(6)]

        def body(prompt: str, **kw) -> dict:
            return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}

        alone = {p: httpx.post(f"{server.url}/v1/completions", json=body(p), timeout=60).json()["choices"][0]["text"]
                 for p in prompts}
        results: dict[str, httpx.Response] = {}

        def send(prompt: str) -> None:
            results[prompt] = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60)

        threads = [threading.Thread(target=send, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(r.status_code for r in results.values()) == [200] * 6, [r.text for r in results.values()]
        assert {p: r.json()["choices"][0]["text"] for p, r in results.items()} == alone
        server.wait_all_blocks_free()

        # 2. Both seats held by long streams: a third request waits, then is refused at the timeout.
        stop = threading.Event()
        started = [threading.Event(), threading.Event()]
        holders = [threading.Thread(target=_hold, args=(server, f"Story {i}:", started[i], stop)) for i in range(2)]
        for t in holders:
            t.start()
        for event in started:
            assert event.wait(60), "a long stream did not start"
        r = httpx.post(f"{server.url}/v1/completions", json=body("Wait for me"), timeout=60)
        assert r.status_code == 503 and "retry-after" in r.headers
        error = r.json()["error"]
        assert "decode-queue-timeout" in error["message"] and "seat" in error["message"], error

        # 3. A client that leaves while waiting: its reservation leaves the decode worker's queue.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body("I will not wait"), timeout=1.0)
        server.wait_until(lambda: _decode(server)["load"]["num_waiting"] == 0, 10, "the left request to go")
        waiting: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: waiting.append(
            httpx.post(f"{server.url}/v1/completions", json=body("Fact number 0 about the sea:"), timeout=60)))
        waiter.start()
        server.wait_until(lambda: _decode(server)["load"]["num_waiting"] == 1, 10, "a reservation to wait")
        stop.set()  # the holders leave: the waiting request gets a seat and is served
        for t in holders:
            t.join(60)
        waiter.join(60)
        assert waiting and waiting[0].status_code == 200, waiting and waiting[0].text
        assert waiting[0].json()["choices"][0]["text"] == alone["Fact number 0 about the sea:"]
        server.wait_all_blocks_free()

        # 4. Both seats held again; an interactive request waits, then a realtime one arrives.
        # One seat frees: the realtime request takes it and the interactive one the seat the
        # realtime one leaves, so the realtime answer comes first (arrival order would serve the
        # interactive one first).
        leave = [threading.Event(), threading.Event()]
        started = [threading.Event(), threading.Event()]
        holders = [threading.Thread(target=_hold, args=(server, f"Poem {i}:", started[i], leave[i])) for i in range(2)]
        for t in holders:
            t.start()
        for event in started:
            assert event.wait(60), "a long stream did not start"
        answers: dict[str, httpx.Response] = {}
        finished: list[str] = []

        def ask(name: str, prompt: str, **kw) -> None:
            answers[name] = httpx.post(f"{server.url}/v1/completions", json=body(prompt, **kw), timeout=60)
            finished.append(name)

        first = threading.Thread(target=ask, args=("interactive", "Fact number 1 about the sea:"))
        first.start()
        server.wait_until(lambda: _decode(server)["load"]["num_waiting"] == 1, 10, "the interactive one to wait")
        second = threading.Thread(target=ask, args=("realtime", "Fact number 2 about the sea:"),
                                  kwargs={"service_tier": "priority"})
        second.start()
        server.wait_until(lambda: _decode(server)["load"]["num_waiting"] == 2, 10, "the realtime one to wait")
        leave[0].set()  # one seat frees; the other stays held
        second.join(60)
        first.join(60)
        assert finished == ["realtime", "interactive"], finished
        for name, prompt in [("realtime", "Fact number 2 about the sea:"), ("interactive", "Fact number 1 about the sea:")]:
            assert answers[name].status_code == 200, answers[name].text
            assert answers[name].json()["choices"][0]["text"] == alone[prompt]
        leave[1].set()
        for t in holders:
            t.join(60)
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_bad_decode_queue_flags_exit_2_before_starting():
    for flags, message in [(["--decode-queue-timeout", "-1"], "decode queue timeout"),
                           (["--decode-num-kv-blocks", "1"], "--decode-num-kv-blocks")]:
        proc = subprocess.run([sys.executable, "-m", "epdserve.cli", "serve", *flags], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
