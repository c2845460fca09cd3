"""The router's admission rules as pure functions, for callers without an event loop.

Same rules as ``RouterCore``: too many requests in the router -> 429; the picked worker's
queue (last reported waiting + submitted since that report) is full -> 429; a decode worker
that cannot reserve the prompt's blocks -> 503.
"""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.router.workers import WorkerInfo

# RouterConfig's defaults (router/core.py imports the worker stack; this module stays light).
DEFAULT_MAX_PENDING = 512
DEFAULT_MAX_WAITING_PER_WORKER = 256


@dataclass(frozen=True)
class Rejection:
    status: int  # HTTP status: 429 (retry later, queue full) or 503 (no capacity)
    reason: str  # metric label: queue_full, worker_queue_full, no_workers, no_kv_blocks
    message: str


def check_pending(num_pending: int, max_pending: int) -> Rejection | None:
    """``num_pending``: requests the router holds now, this one not counted."""
    if num_pending >= max_pending:
        return Rejection(429, "queue_full", f"server is at its limit of {max_pending} requests")
    return None


def check_worker_queue(worker: WorkerInfo | None, max_waiting_per_worker: int) -> Rejection | None:
    if worker is None:
        return Rejection(503, "no_workers", "no workers are available")
    if worker.load.num_waiting + worker.num_submitted >= max_waiting_per_worker:
        return Rejection(429, "worker_queue_full", f"worker queues are full ({max_waiting_per_worker})")
    return None


def reservation_refused(reason: str) -> Rejection:
    return Rejection(503, "no_kv_blocks", f"decode KV cache is full: {reason}")
