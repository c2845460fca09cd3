"""A busy neighbour for ``epdserve profile --busy-neighbours``: another process that works like
a serving worker on the cores the profiled role does not use.

When every core runs a worker (colocated x2, or one prefill and one decode worker on two
cores), each worker's steps share the memory bandwidth and the last-level cache with the
other's; a step timed next to idle cores is faster than the same step in service. The
neighbour repeats what a busy worker does (one prompt's prefill, then decode steps of a batch),
pinned to its cores with one thread per core, until it is stopped.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.synchronize import Event

from epdserve.config import EngineArgs
from epdserve.errors import ConfigError
from epdserve.planner.profile_grid import StepPoint

NEIGHBOUR_PREFILL = StepPoint(((0, 256),))  # one prompt's prefill
NEIGHBOUR_DECODE = StepPoint((), 8, 384)  # then decode steps of 8 sequences
NUM_DECODE_STEPS_PER_PREFILL = 10
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def neighbour_loop(args: EngineArgs, cores: tuple[int, ...], ready: Event, stop: Event) -> None:
    """The neighbour process: load the model, then run the busy-worker pattern until ``stop``."""
    os.sched_setaffinity(0, cores)
    import torch

    torch.set_num_threads(len(cores))
    from epdserve.engine.engine import LLMEngine
    from epdserve.planner.step_probe import StepProbe

    engine = LLMEngine(replace(args, num_kv_blocks=256, enable_prefix_caching=False))
    probe = StepProbe(engine, seed=args.seed + 1)
    prefill, decode = probe.build(NEIGHBOUR_PREFILL), probe.build(NEIGHBOUR_DECODE)
    ready.set()
    while not stop.is_set():
        engine.runner.execute(prefill)
        for _ in range(NUM_DECODE_STEPS_PER_PREFILL):
            engine.runner.execute(decode)


@contextlib.contextmanager
def busy_neighbour(args: EngineArgs, cores: tuple[int, ...]) -> Iterator[None]:
    """A neighbour process on ``cores`` while the body runs (none when ``cores`` is empty)."""
    if not cores:
        yield
        return
    ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's thread pools
    ready, stop = ctx.Event(), ctx.Event()
    process = ctx.Process(target=neighbour_loop, args=(args, cores, ready, stop), daemon=True)
    process.start()
    try:
        if not ready.wait(START_TIMEOUT_S):
            raise ConfigError(f"the busy neighbour did not start within {START_TIMEOUT_S:g} s")
        yield
    finally:
        stop.set()
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()
