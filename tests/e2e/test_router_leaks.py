"""The router never leaks a request: random valid, invalid, failing and abandoned requests
against a real P/D server with two decode workers; afterwards the router holds nothing (its
pending-request and path gauges read 0), every worker is ready and every KV block is free."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import Server, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PREFILL_FAULT_SEED = 31337  # the prefill worker's sampler raises for this seed
DECODE_FAULT_SEED = 31338  # the decode worker's sampler raises on this seed's fourth token
NUM_REQUESTS = 80


def _gauge(metrics: str, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def _one(server: Server, rng: random.Random) -> str:
    """Send one random request; what happened to it."""
    kind = rng.choice(["ok", "ok-stream", "n2", "disconnect-stream", "disconnect", "invalid", "prefill-fault",
                       "decode-fault", "long-prompt"])
    body: dict = {"model": MODEL, "prompt": f"Item {rng.randrange(1000)}: the", "max_tokens": rng.randint(1, 40),
                  "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}
    match kind:
        case "n2":
            body |= {"n": 2, "seed": rng.randrange(1000)}
        case "invalid":
            body |= rng.choice([{"max_tokens": -1}, {"top_p": 7}, {"n": 0}, {"stop_token_ids": [10**9]},
                                {"seed": 2**64}, {"prompt": ""}])
        case "prefill-fault":
            body |= {"seed": PREFILL_FAULT_SEED}
        case "decode-fault":
            body |= {"seed": DECODE_FAULT_SEED, "max_tokens": 20}
        case "long-prompt":
            body |= {"prompt": "word " * 400}
    url = f"{server.url}/v1/completions"
    if kind in ("ok-stream", "disconnect-stream") or (kind == "n2" and rng.random() < 0.5):
        limit = rng.randint(0, 5) if kind == "disconnect-stream" else None
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
            if r.status_code != 200:
                return f"{kind}:{r.status_code}"
            for i, _ in enumerate(r.iter_lines()):
                if limit is not None and i >= limit:
                    return f"{kind}:gone"  # the client leaves mid-stream
        return f"{kind}:200"
    timeout = httpx.Timeout(60, read=rng.uniform(0.01, 0.3)) if kind == "disconnect" else 60
    try:
        r = httpx.post(url, json=body, timeout=timeout)
    except httpx.ReadTimeout:
        return f"{kind}:gone"  # the client gave up before the answer
    return f"{kind}:{r.status_code}"


def test_random_failing_requests_leave_nothing_behind(tmp_path):
    server = start_server(["--max-model-len", "512", "--kv-cache-memory", "0.02", "--decode-workers", "2",
                           "--max-pending", "12", "--debug-fault", f"sample-error:{PREFILL_FAULT_SEED}",
                           "--debug-fault", f"sample-error:{DECODE_FAULT_SEED}:after=3"], str(tmp_path))
    try:
        rngs = [random.Random(i) for i in range(NUM_REQUESTS)]
        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(lambda rng: _one(server, rng), rngs))
        statuses = [o.split(":")[1] for o in outcomes]
        assert not [o for o in outcomes if o.split(":")[1] in ("500", "502", "504")], outcomes
        assert statuses.count("200") > NUM_REQUESTS // 4, outcomes  # most of the valid ones were served
        for kind in ("prefill-fault", "decode-fault", "invalid"):  # each drawn several times with these seeds
            codes = {o.split(":")[1] for o in outcomes if o.startswith(kind + ":")}
            assert codes and "200" not in codes, (kind, outcomes)

        def drained() -> bool:
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            return (_gauge(metrics, "epdserve_router_requests_pending") == 0
                    and _gauge(metrics, "epdserve_router_request_paths") == 0)

        server.wait_until(drained, 20, "the router to hold no request")
        assert all(w["state"] == "ready" for w in server.workers())
        server.wait_all_blocks_free(20)
        # And it still serves.
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200
    finally:
        stop_server(server)
