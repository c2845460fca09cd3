"""Does an engine's memory follow the requests it serves, or the step shapes it has run?

    python benchmarks/rss_by_shape.py [--num-requests 800] [--passes 3] [--dtype auto]

One engine (one thread, one core) runs the same random prompt lengths ``--passes`` times over,
in the same batches of four (mostly short prompts, one in ten up to 400 tokens; two output
tokens each); the RSS is printed every 200 requests and after each pass. Growth that stops
after the first pass comes from per-shape caches (oneDNN primitives, allocator pools) filled
by shapes seen for the first time; growth that goes on with the same shapes is a leak.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time

import torch

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.sampling import SamplingParams

BATCH = 4


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=800)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    ns = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(max_model_len=512, num_kv_blocks=48, dtype=ns.dtype))
    rng = random.Random(0)
    lengths = [rng.randint(1, 400) if rng.random() < 0.1 else rng.randint(1, 80) for _ in range(ns.num_requests)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    print(f"loaded: {rss_mb():.0f} MB")
    for p in range(ns.passes):
        start = time.perf_counter()
        for i, n in enumerate(lengths):
            engine.add_request([rng.randrange(100, 40000) for _ in range(n)], params, f"r{p}-{i}")
            if i % BATCH == BATCH - 1:
                while engine.has_unfinished():
                    engine.step()
            if i % 200 == 0:
                print(f"pass {p} request {i}: {rss_mb():.0f} MB", flush=True)
        while engine.has_unfinished():
            engine.step()
        gc.collect()
        print(f"pass {p} done: {rss_mb():.0f} MB ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
