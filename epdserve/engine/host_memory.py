"""Host memory for activations: freed buffers stay in the process for the next step.

A forward pass on the CPU allocates its activations afresh in every step, and many are large
(a 2048-token prefill step's fused gate/up output alone is 12 MB). glibc's malloc serves such
requests with a fresh ``mmap`` and returns them with ``munmap`` (or trims the top of its heap
once enough is free; its threshold adapts, but not to every size a step mixes), so steps touch
new pages: 15,000-33,000 page faults in one 2048-token prefill step of SmolLM2-135M against 2
with the memory kept, and the step 1.15-1.27x slower (``docs/benchmarks.md``). ``keep_freed_memory`` raises malloc's mmap and trim thresholds for
the process, so buffers up to ``MMAP_THRESHOLD`` come from the heap and freed ones are reused;
the heap then stays at the largest step's working set instead of returning it to the system.
Allocations above the threshold (the KV cache, weights) are still mapped on their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from epdserve import envs

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Larger than any one activation of the models served here; smaller than a KV cache.
MMAP_THRESHOLD = 64 << 20
# Free memory at the top of the heap kept before trimming: a few steps' activations.
TRIM_THRESHOLD = 512 << 20

_applied = False


def keep_freed_memory() -> bool:
    """Set the thresholds once per process (glibc on Linux only; ``EPDSERVE_KEEP_FREED_MEMORY=0``
    skips it). Returns whether they are set."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux") or not envs.is_keep_freed_memory_enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.warning("malloc refused the activation memory thresholds; keeping its defaults")
        return False
    _applied = True
    return True
