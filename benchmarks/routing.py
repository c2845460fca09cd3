"""Routing policies side by side: ``--routing least-prefill`` against ``least-requests``.

    python benchmarks/routing.py [--rate 3.0] [--num-prompts 240] [--rounds 2] [--out out/routing]

Two colocated workers on one core each (``epdserve serve --colocated-workers 2``), random
requests (256 prompt / 96 output tokens, +-25 %, Poisson arrivals at ``--rate``), the same
requests (same seed) for both policies; each policy gets a fresh server per round, after a
warm-up that cycles its KV pools once, and the rounds alternate the policies. Prints TTFT and
TPOT P50/P99 per policy (median over rounds) and the ratio least-requests / least-prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from epdserve.bench.experiments.launch import start_server, stop_server

POLICIES = ("least-prefill", "least-requests")
SERVE = ["--colocated-workers", "2", "--cores-per-worker", "1", "--kv-cache-memory", "1", "--max-model-len", "1024"]
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms")
WARMUP_PROMPTS = 266  # two pools of 2912 blocks, 22 blocks per request


def bench(url: str, rate: float, num_prompts: int, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "epdserve.cli", "bench", "serve", "--base-url", url, "--dataset", "random",
           "--num-prompts", str(num_prompts), "--random-input-len", "256", "--random-output-len", "96",
           "--random-range-ratio", "0.25", "--request-rate", f"{rate:g}", "--seed", str(seed),
           "--result-json", str(out), "--disable-tqdm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--num-prompts", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/routing"))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for round_index in range(ns.rounds):
        order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
        for policy in order:
            server = start_server([*SERVE, "--routing", policy], ns.out / f"logs_{policy}_{round_index}")
            try:
                bench(server.url, ns.rate, WARMUP_PROMPTS, 1000, ns.out / f"warmup_{policy}_{round_index}.json")
                result = bench(server.url, ns.rate, ns.num_prompts, 1, ns.out / f"{policy}_{round_index}.json")
            finally:
                stop_server(server)
            results[policy].append(result)
            print(f"round {round_index + 1} {policy}: " + ", ".join(f"{m} {result[m]:.1f}" for m in METRICS),
                  flush=True)
    print(f"\ncolocated x2, {ns.rate:g} req/s, {ns.num_prompts} requests, median of {ns.rounds} rounds (ms):")
    print(f"{'':18}" + "".join(f"{m:>14}" for m in METRICS))
    medians = {p: {m: statistics.median(r[m] for r in results[p]) for m in METRICS} for p in POLICIES}
    for policy in POLICIES:
        print(f"{policy:18}" + "".join(f"{medians[policy][m]:14.1f}" for m in METRICS))
    print(f"{'ratio (lr / lp)':18}" + "".join(
        f"{medians['least-requests'][m] / medians['least-prefill'][m]:14.2f}" for m in METRICS))


if __name__ == "__main__":
    main()
