"""How steady served step times are: the same load in consecutive windows against one profile.

    python benchmarks/served_step_drift.py --profile P [--windows 6] [--rate 2.73] [--out out/served_step_drift]

Starts ``epdserve serve`` (two colocated workers on one core each, step tracing), sends an
unscored warm-up that cycles the KV pools (266 requests at 3.64 req/s), then ``--windows``
windows of 150 random requests (256 in / 96 out tokens, +-25 %, Poisson at ``--rate``), each with
a seed of its own. For every window and worker it prints served / predicted step time (the
profile's colocated cost for the traced shapes): over all steps, prefill steps, and decode-only
steps by batch size while the other worker was mid-step for at least 90 % of the step. Identical
load in every window: what moves between windows is the machine, not the workload; it bounds
how well a calibration run minutes earlier can predict a later one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from routing import SERVE, bench  # benchmarks/routing.py: the same server layout and load client

from epdserve.bench.experiments.launch import start_server, stop_server
from epdserve.planner.calibrate import busy_overlap, read_step_trace
from epdserve.sim.cost_model import CostModel

WARMUP = (3.64, 266, 1000)  # rate, requests, seed
WINDOW_PROMPTS = 150


def report(trace_dir: Path, profile: Path, windows: list[tuple[str, float, float]]) -> list[str]:
    step = CostModel.load(profile).role("colocated").step
    traces = [read_step_trace(p) for p in sorted(trace_dir.glob("*.jsonl"))]
    lines = []
    for trace in traces:
        predicted = np.array([step.time_s(s) for s in trace.shapes])
        overlap = busy_overlap(trace, [t for t in traces if t is not trace])
        seqs = np.array([s.num_decode_seqs for s in trace.shapes])
        prefill = np.array([s.num_prefill_tokens > 0 for s in trace.shapes])
        busy_decode = ~prefill & (overlap > 0.9)
        lines.append(f"{trace.worker_id}: served / predicted (steps)")
        for tag, start, end in windows:
            inside = (trace.starts >= start) & (trace.starts < end)
            cells = []
            for label, mask in (("all", inside), ("prefill", inside & prefill),
                                ("1-4 seqs busy", inside & busy_decode & (seqs < 4)),
                                ("4-8 busy", inside & busy_decode & (seqs >= 4) & (seqs < 8)),
                                ("8+ busy", inside & busy_decode & (seqs >= 8))):
                n = int(mask.sum())
                cells.append(f"{label} {trace.walls[mask].sum() / predicted[mask].sum():.3f} ({n})" if n > 10
                             else f"{label} -")
            lines.append(f"  {tag:7s} " + " | ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="a profile with a colocated role (epdserve profile)")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--rate", type=float, default=2.73, help="requests/s in every window")
    parser.add_argument("--out", type=Path, default=Path("out/served_step_drift"))
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    trace_dir = ns.out / "steps"
    for old in trace_dir.glob("*.jsonl"):
        old.unlink()
    server = start_server([*SERVE, "--step-trace-dir", str(trace_dir)], ns.out / "logs")
    windows = []
    try:
        rate, num_prompts, seed = WARMUP
        start = time.monotonic()
        bench(server.url, rate, num_prompts, seed, ns.out / "warmup.json")
        windows.append(("warm-up", start, time.monotonic()))
        for k in range(ns.windows):
            start = time.monotonic()
            bench(server.url, ns.rate, WINDOW_PROMPTS, 500 + k, ns.out / f"window{k}.json")
            windows.append((f"window {k}", start, time.monotonic()))
            print(f"window {k}: {time.monotonic() - start:.0f} s", flush=True)
    finally:
        stop_server(server)
    lines = report(trace_dir, ns.profile, windows)
    (ns.out / "report.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
