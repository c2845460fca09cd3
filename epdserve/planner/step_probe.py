"""Times synthetic engine steps on the real runner (what ``epdserve profile`` measures, and what
the busy neighbour runs): steps whose block tables come from the engine's own KV cache manager."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable

from epdserve.engine.engine import LLMEngine
from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.planner.profile_grid import ProfileGrid, StepPoint
from epdserve.request import Request
from epdserve.sampling import SamplingParams

FIRST_TOKEN_ID = 100  # synthetic prompts use ids above the special tokens


def median_time_s(run: Callable[[], object], grid: ProfileGrid) -> float:
    """Median wall time of ``run`` after one warm-up call (seconds, ``time.perf_counter``):
    ``min_repeats`` .. ``max_repeats`` runs, more while under ``min_time_s``, fewer once past
    ``max_point_s``. A first call of ``max_point_s`` or more is the measurement itself: what a
    warm-up absorbs (first-use allocations, page faults) is milliseconds against such a step."""
    start = time.perf_counter()
    run()
    first_s = time.perf_counter() - start
    if first_s >= grid.max_point_s:
        return first_s
    times: list[float] = []
    spent = 0.0
    while not times or (
        (len(times) < grid.min_repeats and spent < grid.max_point_s)
        or (spent < grid.min_time_s and len(times) < grid.max_repeats)
    ):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)


class StepProbe:
    """Times synthetic steps on one engine's runner; blocks are taken from and returned to the
    engine's KV cache manager around every point."""

    def __init__(self, engine: LLMEngine, seed: int = 0, temperature: float = 0.0) -> None:
        """``temperature``: the sampling every probe request uses; 0 is greedy (argmax), a
        positive value samples each row from its softmax, which costs far more per sequence."""
        self.engine = engine
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=temperature)
        self._vocab_size = engine.loaded.spec.vocab_size
        self.kv_target: str | None = None  # set while prefill entries push their KV (``pushing_kv``)

    def _entry(self, start_pos: int, num_new: int, is_decode: bool) -> ScheduledRequest:
        request_id = f"probe-{next(self._ids)}"
        tokens = [self._rng.randrange(FIRST_TOKEN_ID, self._vocab_size) for _ in range(start_pos + num_new)]
        request = Request(request_id, tokens[:-1] if is_decode else tokens, self._params)
        if is_decode:  # its last token is an output token: the entry decodes
            request.output_token_ids.append(tokens[-1])
        kv_cache = self.engine.kv_cache
        num_tokens = start_pos + num_new
        # A served sequence's pages: its prompt's in runs (one allocation), the blocks its
        # decode steps added one at a time, in turn with the other running sequences: those
        # come from wherever the queue hands out. A quarter of a decode entry's context counts
        # as decoded.
        num_prompt = num_tokens - (num_tokens // 4 if is_decode else 0)
        if not kv_cache.allocate(request_id, 0, num_prompt) or (
                num_tokens > num_prompt and not self._allocate_scattered(request_id, num_prompt, num_tokens - num_prompt)):
            raise ConfigError(f"probe KV cache too small for a step of {num_tokens} tokens")
        tables = kv_cache.block_tables(request_id)
        if self.kv_target is not None and not is_decode:
            # The peer pool has as many blocks as this one: the same block ids address it.
            request.kv_target, request.kv_target_block_ids = self.kv_target, tables
        return ScheduledRequest(request, start_pos, num_new, tables, True)

    def _allocate_scattered(self, request_id: str, num_computed: int, num_new: int) -> bool:
        """``allocate`` with every block from the front of the (shuffled) free queue."""
        pools = self.engine.kv_cache.pools
        keep_runs = [pool.keep_runs for pool in pools]
        for pool in pools:
            pool.keep_runs = False
        try:
            return self.engine.kv_cache.allocate(request_id, num_computed, num_new)
        finally:
            for pool, keep in zip(pools, keep_runs):
                pool.keep_runs = keep

    def build(self, point: StepPoint) -> SchedulerOutput:
        # Pages as in a worker that has served a while: decode steps read every page of every
        # sequence, and run markedly slower over scattered pages than over consecutive ones
        # (benchmarks/scattered_pages.py). The free blocks are shuffled before every point (a
        # probe's freed blocks return in runs), then each entry takes its pages as a served
        # sequence does (``_entry``).
        self.engine.kv_cache.reorder_free_blocks(self._rng)
        entries = [self._entry(s, n, is_decode=False) for s, n in point.prefills]
        entries += [self._entry(point.decode_context - 1, 1, is_decode=True) for _ in range(point.num_decode_seqs)]
        return SchedulerOutput(entries)

    def release(self, plan: SchedulerOutput) -> None:
        for entry in plan.scheduled:
            self.engine.kv_cache.free(entry.request.request_id)
            self.engine.runner.release(entry.request.request_id)

    def measure(self, point: StepPoint, grid: ProfileGrid) -> tuple[StepShape, float]:
        plan = self.build(point)
        runner = self.engine.runner
        try:
            return StepShape.from_scheduler_output(plan), median_time_s(lambda: runner.execute(plan), grid)
        finally:
            if runner.pusher is not None:
                runner.pusher.poll()  # forget the finished transfers
            self.release(plan)
