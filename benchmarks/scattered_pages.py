"""Decode step time with each sequence's KV pages contiguous vs in random order.

    python benchmarks/scattered_pages.py [--batch 12] [--context 400] [--repeats 30]

One engine (SmolLM2, one thread on the first core), the real ``ModelRunner.execute`` of one
decode step over ``--batch`` sequences of ``--context`` tokens: first with the pages a fresh
KV pool hands out (one contiguous run per sequence), then after shuffling the free blocks (as
in a worker whose requests have come and gone). Alternates the two several times and prints
the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.engine.scheduler import SchedulerOutput
from epdserve.planner.profile import StepProbe
from epdserve.planner.profile_grid import StepPoint


def median_step_ms(engine: LLMEngine, probe: StepProbe, point: StepPoint, repeats: int, scattered: bool) -> float:
    engine.kv_cache.reorder_free_blocks(random.Random(0) if scattered else None)
    entries = [probe._entry(point.decode_context - 1, 1, is_decode=True) for _ in range(point.num_decode_seqs)]
    plan = SchedulerOutput(entries)
    try:
        for _ in range(3):
            engine.runner.execute(plan)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.runner.execute(plan)
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)
    finally:
        probe.release(plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(num_kv_blocks=2912, enable_prefix_caching=False, max_model_len=1024))
    probe = StepProbe(engine)
    point = StepPoint((), ns.batch, ns.context)
    contiguous, scattered = [], []
    for _ in range(ns.rounds):
        contiguous.append(median_step_ms(engine, probe, point, ns.repeats, scattered=False))
        scattered.append(median_step_ms(engine, probe, point, ns.repeats, scattered=True))
    c, s = statistics.median(contiguous), statistics.median(scattered)
    print(f"decode step, {ns.batch} sequences x {ns.context} tokens: contiguous pages {c:.2f} ms, "
          f"scattered pages {s:.2f} ms, ratio {s / c:.3f}")


if __name__ == "__main__":
    main()
