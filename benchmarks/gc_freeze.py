"""The router's garbage collector at load: start-up heap frozen (default) against not.

    python benchmarks/gc_freeze.py [--rate 3.6] [--num-prompts 600] [--rounds 2] [--out out/gc_freeze]

Two colocated workers on one core each (``epdserve serve --colocated-workers 2``), random
requests (256 prompt / 96 output tokens, +-25 %, Poisson arrivals at ``--rate``), the same
requests for both arms. Each arm gets a fresh server per round (``EPDSERVE_GC_FREEZE=0`` for
the unfrozen one), a warm-up of 100 requests, then the scored run; rounds alternate the order.
Per arm and round: the router's full collections during the scored run (count, how many took
over 50 ms, total seconds; from ``epdserve_router_gc_pause_seconds`` in /metrics) and the
client's TTFT P99, inter-token latency P99 and the largest gap between two tokens of a stream.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import httpx
from routing import SERVE, bench  # benchmarks/routing.py: the same server layout and load client

from epdserve.bench.experiments.launch import start_server, stop_server

ARMS = {"frozen": None, "not frozen": "0"}  # arm -> EPDSERVE_GC_FREEZE
WARMUP_PROMPTS = 100
SLOW_S = 0.05


def full_collections(url: str) -> dict[str, float]:
    """The router's generation-2 collections so far: count, over SLOW_S, total seconds."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line.startswith("epdserve_router_gc_pause_seconds") and 'generation="2"' in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    count = values.get('epdserve_router_gc_pause_seconds_count{generation="2"}', 0.0)
    fast = values.get(f'epdserve_router_gc_pause_seconds_bucket{{generation="2",le="{SLOW_S}"}}', 0.0)
    total = values.get('epdserve_router_gc_pause_seconds_sum{generation="2"}', 0.0)
    return {"count": count, "slow": count - fast, "seconds": total}


def serve_arm(freeze: str | None, log_dir: Path):
    saved = os.environ.pop("EPDSERVE_GC_FREEZE", None)
    if freeze is not None:
        os.environ["EPDSERVE_GC_FREEZE"] = freeze
    try:
        return start_server(SERVE, log_dir)
    finally:
        os.environ.pop("EPDSERVE_GC_FREEZE", None)
        if saved is not None:
            os.environ["EPDSERVE_GC_FREEZE"] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=3.6)
    parser.add_argument("--num-prompts", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/gc_freeze"))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for round_index in range(ns.rounds):
        order = list(ARMS) if round_index % 2 == 0 else list(ARMS)[::-1]
        for arm in order:
            tag = f"{arm.replace(' ', '_')}_{round_index}"
            server = serve_arm(ARMS[arm], ns.out / f"logs_{tag}")
            try:
                bench(server.url, ns.rate, WARMUP_PROMPTS, 1000, ns.out / f"warmup_{tag}.json")
                before = full_collections(server.url)
                result = bench(server.url, ns.rate, ns.num_prompts, 1, ns.out / f"{tag}.json")
                after = full_collections(server.url)
            finally:
                stop_server(server)
            gaps = [g for stream in result["itls"] for g in stream]
            row = {"gc_count": after["count"] - before["count"], "gc_slow": after["slow"] - before["slow"],
                   "gc_ms": 1e3 * (after["seconds"] - before["seconds"]), "ttft_p99_ms": result["p99_ttft_ms"],
                   "itl_p99_ms": result["p99_itl_ms"], "max_gap_ms": 1e3 * max(gaps), "tpot_p99_ms": result["p99_tpot_ms"]}
            rows[arm].append(row)
            print(f"round {round_index + 1} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    keys = list(next(iter(rows.values()))[0])
    print(f"\ncolocated x2, {ns.rate:g} req/s, {ns.num_prompts} requests; median of {ns.rounds} rounds:")
    print(f"{'':12}" + "".join(f"{k:>14}" for k in keys))
    for arm, arm_rows in rows.items():
        print(f"{arm:12}" + "".join(f"{statistics.median(r[k] for r in arm_rows):14.1f}" for k in keys))
    (ns.out / "results.json").write_text(json.dumps({"rate": ns.rate, "num_prompts": ns.num_prompts, "rows": rows},
                                                    indent=2) + "\n")


if __name__ == "__main__":
    main()
