"""A serving worker's step trace: one JSON line per engine step that ran the model (an encode
worker: per encoder batch, with its images and the tiles it computed).

``epdserve serve --step-trace-dir DIR`` makes each worker write ``DIR/<worker id>.jsonl``; the
first line names the worker (id, role, threads), every later line is one step: when it began,
how long it took in service (the engine step and sending its outputs, wall time), the part of it
spent in ``ModelRunner.execute`` (what ``epdserve profile`` times; the rest is scheduling, output
processing and sending), the worker's
CPU time meanwhile (for a one-thread worker, wall minus CPU is time other processes held its
core), its shape in the cost model's terms and the prompts it computed tokens of, the pool's
free blocks after it and, with KV tiers,
the blocks held until their write-down to the tiers finishes. ``epdserve calibrate`` compares these steps with
what an offline profile predicts for the same shapes (see ``planner/calibrate.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from epdserve.engine.step_shape import StepShape

if TYPE_CHECKING:
    from epdserve.engine.engine import LLMEngine


class StepTrace:
    def __init__(self, directory: str, worker_id: str, role: str, num_threads: int, segment: int = 0) -> None:
        """``segment``: the worker's switches of role so far; after one, its steps in the new
        role go to ``DIR/<worker id>.<segment>.jsonl``."""
        os.makedirs(directory, exist_ok=True)
        self.path = Path(directory) / (f"{worker_id}.jsonl" if segment == 0 else f"{worker_id}.{segment}.jsonl")
        self._file: TextIO = open(self.path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 (open for the worker's life; line-buffered: readable while serving)
        header = {"worker_id": worker_id, "role": role, "num_threads": num_threads, "pid": os.getpid(),
                  "cores": sorted(os.sched_getaffinity(0))}  # the worker's cores: calibrate sees who shares them
        self._file.write(json.dumps(header) + "\n")

    @contextlib.contextmanager
    def step(self, engine: LLMEngine) -> Iterator[None]:
        """Around one engine step (and sending its outputs): records it when it ran the model
        (start on ``time.monotonic``, wall time, the worker process's CPU time in all threads)."""
        start, cpu_start = time.monotonic(), time.process_time()
        yield
        plan = engine.last_plan
        if plan is None or not plan.scheduled:
            return
        wall_s, cpu_s = time.monotonic() - start, time.process_time() - cpu_start
        shape = StepShape.from_scheduler_output(plan)
        record = {"t": round(start, 6), "wall_s": round(wall_s, 6), "model_s": round(engine.last_model_s, 6),
                  "cpu_s": round(cpu_s, 6), **shape.to_dict(), "free_blocks": engine.kv_cache.num_free_blocks(),
                  # prompts the step computed tokens of (the cost model's prefill terms do not count them)
                  "num_prefill_seqs": sum(1 for e in plan.scheduled if e.start_pos < e.request.num_prompt_tokens)}
        if engine.kv_offload is not None:
            record["pinned_blocks"] = engine.kv_offload.num_pinned  # held until written to the KV tiers
        self._file.write(json.dumps(record) + "\n")

    @contextlib.contextmanager
    def batch(self, num_images: int) -> Iterator[dict]:
        """Around one encoder batch (the encode worker has no engine step): recorded with its
        images and the tiles it computed (the caller sets ``num_tiles`` in the dict it is given,
        once it knows: cache hits compute none), so ``epdserve calibrate`` counts it as a
        neighbour's busy time and scales the encoder's cost to it."""
        start, cpu_start = time.monotonic(), time.process_time()
        extra: dict = {}
        yield extra
        record = {"t": round(start, 6), "wall_s": round(time.monotonic() - start, 6),
                  "cpu_s": round(time.process_time() - cpu_start, 6), "num_images": num_images}
        if "num_tiles" in extra:
            record["num_tiles"] = int(extra["num_tiles"])
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
