"""Decode step time over KV pages laid out as a fresh pool, a served pool and the profile lay them.

    python benchmarks/scattered_pages.py [--batch 12] [--context 400] [--repeats 30] [--rounds 2]

One engine (SmolLM2, one thread on the first core, prefix caching on, the serving default of
2912 blocks), the real ``ModelRunner.execute`` of one decode step over ``--batch`` sequences of
``--context`` tokens, with their pages:

- fresh: a fresh pool's (one contiguous run per sequence);
- served, runs: after a served-like stream of requests came and went through the KV manager
  (``--churn`` requests of 192-320 prompt and 72-120 output tokens, ``--batch`` at a time, every
  running one growing a token per step, full blocks cached), the running ones, grown to the
  context: the allocator hands out runs of consecutive blocks (``BlockPool.allocate``);
- served, queue order: the same stream with blocks handed out one by one in queue order;
- shuffled: free blocks shuffled, then handed out in queue order (every page scattered);
- profile: the pages ``epdserve profile`` measures decode steps on (``StepProbe.build``).

Every round measures every layout; prints the median of each, the pages' runs per sequence,
and each layout's time relative to the fresh pool's.
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
from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from epdserve.planner.profile_grid import StepPoint
from epdserve.planner.step_probe import StepProbe
from epdserve.request import Request
from epdserve.sampling import SamplingParams

LAYOUTS = ("fresh", "served, runs", "served, queue order", "shuffled", "profile")


class Stream:
    """Requests coming and going through an engine's KV manager, as a serving worker's do."""

    def __init__(self, engine: LLMEngine, seed: int) -> None:
        self.engine = engine
        self.kv = engine.kv_cache
        self.rng = random.Random(seed)
        self.vocab = engine.loaded.spec.vocab_size
        self.live: dict[str, list] = {}  # id -> [tokens, prompt length, output length]
        self.count = 0

    def _token(self) -> int:
        return self.rng.randrange(100, self.vocab)

    def admit(self) -> None:
        rid = f"s{self.count}"
        self.count += 1
        tokens = [self._token() for _ in range(self.rng.randint(192, 320))]
        assert self.kv.allocate(rid, 0, len(tokens))
        self.kv.cache_computed_blocks(rid, tokens, len(tokens))
        self.live[rid] = [tokens, len(tokens), self.rng.randint(72, 120)]

    def grow(self, rid: str) -> None:
        tokens = self.live[rid][0]
        tokens.append(self._token())
        assert self.kv.allocate(rid, len(tokens) - 1, 1)
        self.kv.cache_computed_blocks(rid, tokens, len(tokens))

    def run(self, num_requests: int, num_live: int) -> None:
        """Until ``num_requests`` have been admitted, keep ``num_live`` running, one token each
        per step; a request leaves when its output is complete."""
        while True:
            while len(self.live) < num_live:
                self.admit()
            if self.count >= num_requests:
                return
            for rid in list(self.live):
                self.grow(rid)
                tokens, num_prompt, num_output = self.live[rid]
                if len(tokens) - num_prompt >= num_output:
                    self.kv.free(rid)
                    del self.live[rid]

    def plan(self, context: int) -> SchedulerOutput:
        """One decode step over the running requests, each grown to ``context`` tokens."""
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0.0)  # greedy, as the profile probe
        entries = []
        for rid, (tokens, _, _) in self.live.items():
            while len(tokens) < context:
                self.grow(rid)
            request = Request(rid, tokens[:-1], params)
            request.output_token_ids.append(tokens[-1])
            entries.append(ScheduledRequest(request, len(tokens) - 1, 1, self.kv.block_tables(rid), True))
        return SchedulerOutput(entries)

    def finish(self) -> None:
        for rid in list(self.live):
            self.kv.free(rid)
            self.engine.runner.release(rid)
        self.live.clear()


def set_runs(engine: LLMEngine, keep_runs: bool) -> None:
    for pool in engine.kv_cache.pools:
        pool.keep_runs = keep_runs


def median_step_ms(engine: LLMEngine, plan: SchedulerOutput, repeats: int) -> float:
    for _ in range(3):
        engine.runner.execute(plan)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.runner.execute(plan)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def runs_per_sequence(plan: SchedulerOutput) -> float:
    counts = [1 + sum(1 for a, b in zip(t, t[1:]) if b != a + 1) for t in (e.block_tables[0] for e in plan.scheduled)]
    return sum(counts) / len(counts)


def measure(engine: LLMEngine, layout: str, ns: argparse.Namespace, seed: int) -> tuple[float, float]:
    kv = engine.kv_cache
    kv.reset_prefix_cache()
    if layout == "profile":
        probe = StepProbe(engine, seed=seed)
        plan = probe.build(StepPoint((), ns.batch, ns.context))
        try:
            return median_step_ms(engine, plan, ns.repeats), runs_per_sequence(plan)
        finally:
            probe.release(plan)
    kv.reorder_free_blocks(None if layout == "fresh" else random.Random(seed))
    set_runs(engine, layout == "served, runs")
    stream = Stream(engine, seed)
    try:
        stream.run(0 if layout in ("fresh", "shuffled") else ns.churn, ns.batch)
        plan = stream.plan(ns.context)
        return median_step_ms(engine, plan, ns.repeats), runs_per_sequence(plan)
    finally:
        stream.finish()
        set_runs(engine, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--churn", type=int, default=600, help="requests that come and go before a served layout")
    ns = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(num_kv_blocks=2912, enable_prefix_caching=True, max_model_len=1024))
    times: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    runs: dict[str, float] = {}
    for k in range(ns.rounds):
        for layout in LAYOUTS:
            ms, runs[layout] = measure(engine, layout, ns, seed=k)
            times[layout].append(ms)
            print(f"round {k}: {layout:20s} {ms:7.2f} ms  ({runs[layout]:.1f} runs of pages per sequence)", flush=True)
    fresh = statistics.median(times["fresh"])
    print(f"\ndecode step, {ns.batch} sequences x {ns.context} tokens (median of {ns.rounds} rounds):")
    for layout in LAYOUTS:
        t = statistics.median(times[layout])
        print(f"  {layout:20s} {t:7.2f} ms  {t / fresh:.3f}x fresh  ({runs[layout]:.1f} runs per sequence)")


if __name__ == "__main__":
    main()
