"""A served prefill worker's steps against its profile, one condition at a time.

    python benchmarks/served_prefill_probe.py --profile P [--out out/served_prefill_probe] [SERVE FLAGS ...]

Starts ``epdserve serve`` with one prefill and one decode worker (one core each, step tracing, the
extra serve flags appended, e.g. the prefix-cache experiment's ``--num-kv-blocks 128
--decode-num-kv-blocks 512``) and sends, one request at a time (max_tokens 1 unless said):

1. 20 fresh prompts of 272 tokens (256 + 16), the decode worker idle;
2. after each of them, its first 256 tokens again with 128 new ones (a cached prefix), decode idle;
3. 30 fresh prompts of 256 tokens while 8 clients keep the decode worker busy (64-token prompts,
   200 output tokens each, one after another).

For each: the prefill worker's median model time per step (``model_s`` of the step trace) against
the profile's prefill cost for the same shape. What a replayed trace adds beyond these conditions
(docs/benchmarks.md, "A served prefill worker against its profile") is what they leave out.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from epdserve.bench.experiments.launch import auth_headers, start_server, stop_server
from epdserve.engine.step_shape import StepShape
from epdserve.sim.cost_model import CostModel

NUM_DECODE_CLIENTS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="profile.json of this host (epdserve profile)")
    parser.add_argument("--out", type=Path, default=Path("out/served_prefill_probe"))
    ns, serve_flags = parser.parse_known_args()
    step = CostModel.load(ns.profile).role("prefill").step
    steps_dir = ns.out / "steps"
    server = start_server(["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1",
                           "--step-trace-dir", str(steps_dir), "--max-model-len", "2048", *serve_flags],
                          ns.out / "logs")
    url, headers = server.url, auth_headers(server)
    rng = np.random.default_rng(0)
    spans: dict[str, tuple[float, float]] = {}
    stop = threading.Event()
    try:
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]

        def post(prompt: list[int], max_tokens: int = 1) -> None:
            r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=600,
                           json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                 "ignore_eos": True})
            if r.status_code != 200:
                raise RuntimeError(f"request failed ({r.status_code}): {r.text[:200]}")

        def tokens(n: int) -> list[int]:
            return rng.integers(1000, 40000, size=n).tolist()

        start = time.monotonic()
        for _ in range(20):
            prefix = tokens(256)
            post(prefix + tokens(16))
            post(prefix + tokens(128))
        spans["idle"] = (start, time.monotonic())

        def decoder() -> None:
            while not stop.is_set():
                post(tokens(64), 200)

        clients = [threading.Thread(target=decoder) for _ in range(NUM_DECODE_CLIENTS)]
        for c in clients:
            c.start()
        time.sleep(5.0)  # the decode batch fills
        start = time.monotonic()
        for _ in range(30):
            post(tokens(256))
        spans["busy"] = (start, time.monotonic())
        stop.set()
        for c in clients:
            c.join(timeout=600)
    finally:
        stop.set()
        stop_server(server)
    trace = next(p for p in steps_dir.glob("*.jsonl") if json.loads(p.open().readline())["role"] == "prefill")
    records = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    cases = [("fresh 272 tokens, decode idle", "idle", 272), ("128 tokens after a cached 256, decode idle", "idle", 128),
             (f"fresh 256 tokens, {NUM_DECODE_CLIENTS} decodes running", "busy", 256)]
    for name, span, num_tokens in cases:
        lo, hi = spans[span]
        rows = [r for r in records if lo <= r["t"] < hi and r["num_prefill_tokens"] == num_tokens]
        model_s = np.median([r["model_s"] for r in rows])
        predicted = np.median([step.time_s(StepShape.from_dict(r)) for r in rows])
        print(f"{name}: {len(rows)} steps, model {model_s * 1e3:.1f} ms, profile {predicted * 1e3:.1f} ms: "
              f"{model_s / predicted:.2f}x", flush=True)


if __name__ == "__main__":
    main()
