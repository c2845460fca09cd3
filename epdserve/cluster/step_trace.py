"""A serving worker's step trace: one JSON line per engine step that ran the model.

``epdserve serve --step-trace-dir DIR`` makes each worker write ``DIR/<worker id>.jsonl``; the
first line names the worker (id, role, threads), every later line is one step: when it began,
how long it took in service (the engine step and sending its outputs, wall time), the worker's
CPU time meanwhile (for a one-thread worker, wall minus CPU is time other processes held its
core) and its shape in the cost model's terms. ``epdserve calibrate`` compares these steps with
what an offline profile predicts for the same shapes (see ``planner/calibrate.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TextIO

from epdserve.engine.scheduler import SchedulerOutput
from epdserve.sim.cost_model import StepShape


class StepTrace:
    def __init__(self, directory: str, worker_id: str, role: str, num_threads: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = Path(directory) / f"{worker_id}.jsonl"
        self._file: TextIO = open(self.path, "w", encoding="utf-8", buffering=1)  # noqa: SIM115 (open for the worker's life; line-buffered: readable while serving)
        header = {"worker_id": worker_id, "role": role, "num_threads": num_threads, "pid": os.getpid()}
        self._file.write(json.dumps(header) + "\n")

    def record(self, plan: SchedulerOutput, start: float, wall_s: float, cpu_s: float) -> None:
        """One step that ran ``plan``, begun at ``start`` (``time.monotonic``), ``wall_s`` long,
        ``cpu_s`` of the worker process's CPU time (all its threads) during it."""
        shape = StepShape.from_scheduler_output(plan)
        record = {"t": round(start, 6), "wall_s": round(wall_s, 6), "cpu_s": round(cpu_s, 6), **shape.to_dict()}
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()
