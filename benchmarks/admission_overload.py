"""Admission under overload: the queue bound against predictive admission (issue goal: under 2x
overload, admitted requests meet their SLO >= 90 % with predictive admission, where the queue
bound falls below 50 %).

    python benchmarks/admission_overload.py [--overload 2.0] [--num-prompts 200] [--slo-ttft-ms 1000] [--out out/admission]

Two colocated workers on one core each; random requests (256 prompt / 32 output tokens, +-25 %,
EOS ignored), interactive class with a TTFT SLO (``--service-class-slo interactive=ttft:MS``).
First the capacity: every one of 64 requests sent at once to a fresh server, completed
requests per second. Then, at ``--overload`` x that rate (Poisson arrivals, the same requests
for both), a fresh server per policy, alternating over ``--rounds``: ``--admission queue``
(refuses only at the queue bounds) and ``--admission predictive``. Per policy: requests
admitted and refused, SLO attainment of the admitted ones (TTFT within the SLO), goodput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from epdserve.bench.experiments.launch import start_server, stop_server

POLICIES = ("queue", "predictive")
SERVE = ["--colocated-workers", "2", "--cores-per-worker", "1", "--max-model-len", "1024"]


def bench(url: str, rate: str, num_prompts: int, seed: int, slo_ms: float, out: Path) -> dict:
    cmd = [sys.executable, "-m", "epdserve.cli", "bench", "serve", "--base-url", url, "--dataset", "random",
           "--num-prompts", str(num_prompts), "--random-input-len", "256", "--random-output-len", "32",
           "--random-range-ratio", "0.25", "--ignore-eos", "--request-rate", rate, "--seed", str(seed),
           "--goodput", f"ttft:{slo_ms:g}", "--result-json", str(out), "--disable-tqdm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def summarize(result: dict, slo_ms: float) -> dict:
    admitted = [t for t, e in zip(result["ttfts"], result["errors"]) if not e]
    refused = sum(1 for e in result["errors"] if "HTTP 429" in e)
    met = sum(1 for t in admitted if t * 1e3 <= slo_ms)
    return {"admitted": len(admitted), "refused": refused, "other_errors": len(result["errors"]) - len(admitted) - refused,
            "attainment_of_admitted": met / len(admitted) if admitted else 0.0,
            "goodput": result["request_goodput"], "p99_ttft_ms": result["p99_ttft_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overload", type=float, default=2.0)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/admission"))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    slo = ["--service-class-slo", f"interactive=ttft:{ns.slo_ttft_ms:g}"]

    server = start_server([*SERVE, *slo], ns.out / "logs_capacity")
    try:
        bench(server.url, "inf", 64, 1000, ns.slo_ttft_ms, ns.out / "warmup.json")
        capacity = bench(server.url, "inf", 64, 2000, ns.slo_ttft_ms, ns.out / "capacity.json")["request_throughput"]
    finally:
        stop_server(server)
    rate = ns.overload * capacity
    print(f"capacity {capacity:.2f} req/s; offered {rate:.2f} req/s ({ns.overload:g}x)", flush=True)

    rows: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for round_index in range(ns.rounds):
        for policy in (POLICIES if round_index % 2 == 0 else POLICIES[::-1]):
            server = start_server([*SERVE, *slo, "--admission", policy], ns.out / f"logs_{policy}_{round_index}")
            try:
                bench(server.url, "inf", 16, 1000, ns.slo_ttft_ms, ns.out / f"warmup_{policy}_{round_index}.json")
                result = bench(server.url, f"{rate:.4f}", ns.num_prompts, 1, ns.slo_ttft_ms,
                               ns.out / f"{policy}_{round_index}.json")
            finally:
                stop_server(server)
            row = summarize(result, ns.slo_ttft_ms)
            rows[policy].append(row)
            print(f"round {round_index + 1} {policy}: {row}", flush=True)

    summary = {"capacity_req_s": capacity, "offered_req_s": rate, "slo_ttft_ms": ns.slo_ttft_ms,
               "policies": {p: {k: statistics.median(r[k] for r in rows[p]) for k in rows[p][0]} for p in POLICIES},
               "rounds": rows}
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{ns.num_prompts} requests at {rate:.2f} req/s, TTFT SLO {ns.slo_ttft_ms:g} ms, median of {ns.rounds} rounds:")
    print(f"{'admission':12}{'admitted':>10}{'refused':>9}{'attainment':>12}{'goodput':>9}{'TTFT P99':>10}")
    for policy in POLICIES:
        s = summary["policies"][policy]
        print(f"{policy:12}{s['admitted']:10.0f}{s['refused']:9.0f}{100 * s['attainment_of_admitted']:11.0f}%"
              f"{s['goodput']:9.2f}{s['p99_ttft_ms']:10.0f}")


if __name__ == "__main__":
    main()
