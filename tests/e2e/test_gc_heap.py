"""The router's and workers' garbage-collector settings (epdserve/gc_heap.py)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

from epdserve.gc_heap import GCPauseObserver

FREEZE = "from epdserve.gc_heap import freeze_startup_heap; import gc; print(freeze_startup_heap(), gc.get_freeze_count())"


def run_freeze(env_value: str | None) -> tuple[int, int]:
    # A process of its own: freezing this one would keep the test session's objects forever.
    env = {k: v for k, v in os.environ.items() if k != "EPDSERVE_GC_FREEZE"}
    if env_value is not None:
        env["EPDSERVE_GC_FREEZE"] = env_value
    out = subprocess.run([sys.executable, "-c", FREEZE], env=env, capture_output=True, text=True, timeout=60, check=True)
    returned, count = out.stdout.split()
    return int(returned), int(count)


def test_freeze_moves_the_startup_heap_out_of_the_collectors_reach():
    returned, count = run_freeze(None)
    assert returned == count > 1000  # the interpreter and epdserve's imports alone are thousands


def test_freeze_can_be_switched_off():
    assert run_freeze("0") == (0, 0)
    assert run_freeze("off") == (0, 0)


def test_pause_observer_times_every_collection_until_closed():
    seen: list[tuple[int, float]] = []
    observer = GCPauseObserver(lambda generation, seconds: seen.append((generation, seconds)))
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        observer.close()
    assert (2, seen[0][1]) in seen and any(g == 0 for g, _ in seen)
    assert all(s >= 0 for _, s in seen)
    count = len(seen)
    gc.collect()
    assert len(seen) == count and observer._callback not in gc.callbacks
    observer.close()  # a second close is harmless
