"""How steady this host is: one fixed model step, timed in consecutive windows.

    python benchmarks/host_drift.py [--minutes 5] [--window-s 15] [--core 1] [--batch 8] [--context 300] [--json F]

One engine (SmolLM2, the dtype serving takes here, one thread pinned to ``--core``) runs the
same decode step (``--batch`` sequences of ``--context`` tokens, the same KV pages every time)
over and over for ``--minutes``; prints the median step time of every ``--window-s`` window,
then the lowest, median and highest window and their spread ((highest - lowest) / median).
Nothing about the work changes between windows: what moves is the machine (other tenants on
the host sharing cores, caches and memory bandwidth; frequency). It bounds how well anything
measured minutes earlier on this host — an offline profile, a calibration run, a real run of
the same arrivals — can predict a later measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.planner.profile_grid import StepPoint
from epdserve.planner.step_probe import StepProbe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--json", default=None, help="also write the windows' medians (ms) here")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(num_kv_blocks=1024, max_model_len=1024))
    probe = StepProbe(engine)
    plan = probe.build(StepPoint(tuple((args.context, 1) for _ in range(args.batch))))
    for _ in range(3):
        engine.runner.execute(plan)
    print(f"decode step, {args.batch} sequences x {args.context} tokens, {engine.config.dtype}, core {args.core}")
    medians = []
    end = time.monotonic() + 60 * args.minutes
    while time.monotonic() < end:
        window_end = time.monotonic() + args.window_s
        samples = []
        while time.monotonic() < window_end:
            start = time.perf_counter()
            engine.runner.execute(plan)
            samples.append(time.perf_counter() - start)
        medians.append(statistics.median(samples))
        print(f"{time.strftime('%H:%M:%S')}  {1e3 * medians[-1]:7.1f} ms  ({len(samples)} steps)", flush=True)
    probe.release(plan)
    low, mid, high = min(medians), statistics.median(medians), max(medians)
    print(f"windows: {len(medians)}; lowest {1e3 * low:.1f} ms, median {1e3 * mid:.1f} ms, highest {1e3 * high:.1f} ms; "
          f"spread (highest - lowest) / median {100 * (high - low) / mid:.0f} %; highest / lowest {high / low:.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"window_medians_ms": [1e3 * m for m in medians], "median_ms": 1e3 * mid, "batch": args.batch,
                       "context": args.context, "core": args.core, "end_time": time.time()}, f)


if __name__ == "__main__":
    main()
