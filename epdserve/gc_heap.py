"""The garbage collector in long-running processes (the router and the workers).

CPython's collector of the oldest generation walks every tracked object. At the end of
start-up a router holds some 200,000 of them (the web framework, the tokenizer, imported
libraries) and a worker as many; none will ever become garbage, but each full collection
walks them all again. In the router that was a stop of 120-270 ms every minute or two at
load on two busy cores: every stream's tokens, every arrival and every first token waited
for it. ``freeze_startup_heap`` moves what is alive at the end of start-up into the
permanent generation (``gc.freeze``), so a full collection walks only what was made since.
``GCPauseObserver`` measures each collection (the router exports them as
``epdserve_router_gc_pause_seconds``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from epdserve import envs


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object still alive; returns how many are frozen (0
    with ``EPDSERVE_GC_FREEZE=0``). Call it once start-up is done."""
    if not envs.is_gc_freeze_enabled():
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GCPauseObserver:
    """Calls ``observe(generation, seconds)`` after every collection in this process."""

    def __init__(self, observe: Callable[[int, float], None]) -> None:
        self._observe = observe
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._observe(info["generation"], time.perf_counter() - self._started)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
