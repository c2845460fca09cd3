"""How long a worker takes to change role, and what a switch costs the requests around it.

    python benchmarks/role_switch.py [--switches 6] [--out out/role_switch]

One server with two prefill workers and one decode worker (one core each, two cores shared),
``--role-switching manual``. Idle: worker ``prefill-1`` is switched to decode and back
``--switches`` times; each time, from the POST to the worker serving in its new role (ready in
``/v1/workers``, polled every 10 ms). Then the same under load: a stream of 64-token requests keeps the server busy
while the switches happen, and every request must complete (none lost) with greedy output equal
to the same prompt served without switches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import httpx

from epdserve.bench.experiments.launch import start_server, stop_server

SERVE = ["--prefill-workers", "2", "--decode-workers", "1", "--cores-per-worker", "1", "--max-model-len", "1024",
         "--kv-cache-memory", "0.2", "--role-switching", "manual", "--dtype", "float32"]
MODEL = "SmolLM2-135M-Instruct"


def worker(url: str, worker_id: str) -> dict:
    return next(w for w in httpx.get(f"{url}/v1/workers", timeout=10).json()["data"] if w["id"] == worker_id)


def switch(url: str, worker_id: str, role: str) -> float:
    """Seconds from the POST to the worker ready in ``role``."""
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/workers/{worker_id}/role", json={"role": role}, timeout=10)
    r.raise_for_status()
    while True:
        w = worker(url, worker_id)
        if w["role"] == role and w["state"] == "ready":
            return time.perf_counter() - start
        time.sleep(0.01)


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 64,
                                                  "temperature": 0, "ignore_eos": True}, timeout=300)
    return {"status": r.status_code, "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("out/role_switch"))
    ns = parser.parse_args()
    server = start_server(SERVE, ns.out / "logs")
    try:
        url = server.url
        prompts = [f"Request {i}: tell me about the number {i}." for i in range(8)]
        reference = {p: complete(url, p)["text"] for p in prompts}
        idle = []
        for i in range(ns.switches):
            idle.append(switch(url, "prefill-1", "decode" if i % 2 == 0 else "prefill"))
        results: list[tuple[str, dict]] = []
        stop = threading.Event()

        def load() -> None:
            k = 0
            while not stop.is_set():
                p = prompts[k % len(prompts)]
                results.append((p, complete(url, p)))
                k += 1

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(2)
        busy = []
        for i in range(ns.switches):
            busy.append(switch(url, "prefill-1", "decode" if (ns.switches + i) % 2 == 0 else "prefill"))
        stop.set()
        for t in threads:
            t.join(300)
        failed = [r for _, r in results if r["status"] != 200]
        differ = [p for p, r in results if r["status"] == 200 and r["text"] != reference[p]]
        summary = {
            "idle_switch_s": {"median": statistics.median(idle), "min": min(idle), "max": max(idle), "all": idle},
            "busy_switch_s": {"median": statistics.median(busy), "min": min(busy), "max": max(busy), "all": busy},
            "requests_during_switches": len(results), "failed": len(failed), "greedy_differs": len(differ),
        }
    finally:
        stop_server(server)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "role_switch.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
